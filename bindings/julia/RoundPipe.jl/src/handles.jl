# The handle table: one close, one finalizer, one do-block form for every handle type
# (LibGit2.jl's types.jl is the model). A handle is a mutable struct <: Handle whose `ptr`
# field holds its C object (C_NULL once closed); freeing goes through the table below, by the
# C type of that pointer, so no handle type writes its own ownership code.

"A Julia object owning one C object of RoundPipe in its `ptr` field."
abstract type Handle end

# C type, the function that frees it, and whether freeing may wait for library threads that
# run Julia callbacks (then the GC must be free to run meanwhile). Options and tensor lists
# have no Julia handle; `_scoped` frees them.
const _HANDLE_TABLE = (
    (L.rp_run_config, L.rp_run_config_destroy, false),
    (L.rp_model_options, L.rp_model_options_destroy, false),
    (L.rp_model, L.rp_model_destroy, true),  # drains the pipeline and the optimizer thread
    (L.rp_tensor_list, L.rp_tensor_list_destroy, false),
    (L.rp_loss, L.rp_loss_destroy, false),
    (L.rp_optimizer, L.rp_optimizer_destroy, false),
    (L.rp_layer_def, L.rp_layer_def_destroy, false),  # models keep their own copies
)

for (R, destroy, drains) in _HANDLE_TABLE
    @eval _destroy(p::Ptr{$R}) = $drains ? _gcsafe(() -> $destroy(p)) : $destroy(p)
end

"""
    close(handle)

Free the handle's C object now (idempotent; a finalizer does it otherwise). A closed handle
is refused by every call.
"""
function Base.close(h::Handle)
    p, h.ptr = h.ptr, C_NULL
    p == C_NULL || _destroy(p)
    _closed!(h)
    return nothing
end

# What a handle type drops when its C object is gone (a Model: its pending step callbacks).
_closed!(::Handle) = nothing

"Attach the finalizer that closes `h`; returns `h`. Every handle constructor ends here."
_own!(h::Handle) = finalizer(close, h)

"The C object of `h`; a RoundPipeError once `h` is closed."
function _ptr(h::Handle)
    h.ptr == C_NULL && _invalid("$(nameof(typeof(h))) is closed")
    return h.ptr
end

"""
    _create(R, create, args...) -> Ptr{R}

Call the C constructor `create(out, args...)` and return the new object, or throw.
"""
function _create(::Type{R}, create, args...) where {R}
    out = Ref{Ptr{R}}(C_NULL)
    @check create(out, args...)
    return out[]
end

"Configure a new handle with `f(h)`; on failure free it at once (not at a later GC) and rethrow."
function _setup!(f, h::Handle)
    try
        f(h)
    catch
        close(h)
        rethrow()
    end
    return h
end

"Call `f(p)`, then free the C object `p` (which no Julia handle owns), also on error."
function _scoped(f, p::Ptr)
    try
        return f(p)
    finally
        _destroy(p)
    end
end

# The do-block form of every handle constructor, `Model(spec) do model ... end` (and RunConfig,
# Loss, Optimizer likewise): the handle is closed when the block ends, and the block's value is
# returned. (A comment, not a docstring: the doc system would file it under Core.Type.)
function (::Type{T})(f::Function, args...; kw...) where {T<:Handle}
    h = T(args...; kw...)
    try
        return f(h)
    finally
        close(h)
    end
end
