# Errors, the ABI check, library-wide queries, and calls that let the GC run.

"""
    RoundPipeError(status, message)

A failed RoundPipe call: `status` is the C `rp_status` (negative `RP_ERR_*`), `message` the
library's `rp_last_error_message()` (or the binding's own words for checks made in Julia).
"""
struct RoundPipeError <: Exception
    status::Int32
    message::String
end

_string(s::Cstring) = convert(Ptr{UInt8}, s) == C_NULL ? "" : unsafe_string(s)

"The library's name for a status (\"invalid argument\", ...)."
status_name(status::Integer) = _string(L.rp_status_string(L.rp_status(status)))

function Base.showerror(io::IO, e::RoundPipeError)
    print(io, "RoundPipeError: ", status_name(e.status), " (", e.status, "): ", e.message)
end

_last_error(status) = RoundPipeError(status, _string(L.rp_last_error_message()))

"""
    @check call

Evaluate a raw call returning `rp_status`; throw `RoundPipeError` unless it is `RP_OK`.
"""
macro check(ex)
    quote
        local st = $(esc(ex))
        st == L.RP_OK || throw(_last_error(st))
        nothing
    end
end

_invalid(msg) = throw(RoundPipeError(L.RP_ERR_INVALID_ARGUMENT, msg))

"""
    _code(table, x, what) -> Int32

The C code `table` (a NamedTuple of Symbol => code) gives `x`; an invalid-argument error that
lists the accepted symbols otherwise. Every Symbol-valued option goes through here.
"""
function _code(table::NamedTuple, x, what::AbstractString)
    x isa Symbol && haskey(table, x) && return Int32(table[x])
    _invalid("$what must be " * join((repr(k) for k in keys(table)), ", ", " or ") *
             ", got $(repr(x))")
end

const _ABI_CHECKED = Ref(false)

"Refuse to run against a library of another ABI version (checked once, by every constructor)."
function _ensure_abi()
    _ABI_CHECKED[] && return nothing
    found = L.rp_abi_version()
    found == L.RP_ABI_VERSION || throw(RoundPipeError(L.RP_ERR_STATE,
        "libroundpipe at $(L.libroundpipe()) has ABI version $found, this package was written " *
        "for $(L.RP_ABI_VERSION)"))
    _ABI_CHECKED[] = true
    return nothing
end

"Version of the loaded library, \"MAJOR.MINOR.PATCH\"."
version() = _string(L.rp_version())

"ABI version of the loaded library."
abi_version() = Int(L.rp_abi_version())

"Number of CUDA GPUs visible to this process."
function cuda_device_count()
    n = Ref{Int32}(0)
    @check L.rp_cuda_device_count(n)
    return Int(n[])
end

# Calls that block while library threads run Julia callbacks must let the GC run meanwhile
# (a thread inside a plain ccall holds the GC up, and a callback that allocates would wait for
# it forever). Arguments are converted before entering; only the call itself runs GC-safe.
@inline function _gcsafe(f)
    st = ccall(:jl_gc_safe_enter, Int8, ())
    r = f()
    ccall(:jl_gc_safe_leave, Cvoid, (Int8,), st)
    return r
end
