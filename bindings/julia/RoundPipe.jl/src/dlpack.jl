# Julia arrays in and out of the library as DLPack structs built in Julia.

const _DTYPES = Dict{DataType,Tuple{Int,Int}}(
    Float32 => (L.kDLFloat, 32), Float64 => (L.kDLFloat, 64), Float16 => (L.kDLFloat, 16),
    Int8 => (L.kDLInt, 8), Int16 => (L.kDLInt, 16), Int32 => (L.kDLInt, 32),
    Int64 => (L.kDLInt, 64), UInt8 => (L.kDLUInt, 8), UInt16 => (L.kDLUInt, 16),
    UInt32 => (L.kDLUInt, 32), UInt64 => (L.kDLUInt, 64), Bool => (L.kDLBool, 8))

function _dltype(::Type{T}) where {T}
    haskey(_DTYPES, T) || _invalid("element type $T has no DLPack equivalent")
    code, bits = _DTYPES[T]
    return L.DLDataType(UInt8(code), UInt8(bits), UInt16(1))
end

_isbf16(dt::L.DLDataType) = dt.code == L.kDLBfloat && dt.bits == 16 && dt.lanes == 1

function _jltype(dt::L.DLDataType)
    dt.lanes == 1 || _invalid("vector DLPack types are not supported")
    for (T, (code, bits)) in _DTYPES
        (code == dt.code && bits == dt.bits) && return T
    end
    _isbf16(dt) && _invalid("a bfloat16 tensor (the gradients of a bf16 / f16 model built " *
                            "with host_memory=:saving) has no Julia array type here; " *
                            "param_grad gives a Float32 copy")
    _invalid("DLPack type (code $(dt.code), $(dt.bits) bits) has no Julia equivalent")
end

# C-order shape of a Julia array: its dimensions reversed.
_cshape(a::AbstractArray) = Int64[reverse(size(a))...]

"A DLPack struct borrowing `a` and `shape` (preserve both while the library uses it)."
function _borrow(a::Array{T}, shape::Vector{Int64}) where {T}
    t = L.DLTensor(Ptr{Cvoid}(pointer(a)), L.DLDevice(L.kDLCPU, 0), Int32(ndims(a)), _dltype(T),
                   isempty(shape) ? Ptr{Int64}(C_NULL) : pointer(shape), Ptr{Int64}(C_NULL),
                   UInt64(0))
    return L.DLManagedTensor(t, C_NULL, C_NULL)
end

function _dense(a)
    a isa Array || return Array(a)  # views, ranges, transposes: copied to a dense array
    return a
end

"""
    _with_borrowed(f, arrays) -> f(pointers::Ptr{Ptr{DLManagedTensor}}, n::Csize_t)

Call `f` with borrowed DLPack structs of `arrays` (an array of pointers to them, and their
number), all kept alive until `f` returns.
"""
function _with_borrowed(f, arrays)
    arrs = [_dense(a) for a in arrays]
    shapes = Vector{Int64}[_cshape(a) for a in arrs]
    mts = L.DLManagedTensor[_borrow(a, s) for (a, s) in zip(arrs, shapes)]
    GC.@preserve arrs shapes mts begin
        ptrs = Ptr{L.DLManagedTensor}[pointer(mts, i) for i in eachindex(mts)]
        GC.@preserve ptrs f(pointer(ptrs), Csize_t(length(ptrs)))
    end
end

"Call `f(p)` with `p` a borrowed DLPack struct of `a` (C_NULL for `nothing`), kept alive."
function _with_borrowed_one(f, a)
    a === nothing && return f(Ptr{L.DLManagedTensor}(C_NULL))
    arr = _dense(a)
    shape = _cshape(arr)
    mt = Ref(_borrow(arr, shape))
    GC.@preserve arr shape mt f(Base.unsafe_convert(Ptr{L.DLManagedTensor}, mt))
end

_delete(p::Ptr{L.DLManagedTensor}) = begin
    d = unsafe_load(p).deleter
    d == C_NULL || ccall(d, Cvoid, (Ptr{L.DLManagedTensor},), p)
    nothing
end

function _check_host(t::L.DLTensor)
    t.device.device_type in (L.kDLCPU, L.kDLCUDAHost) ||
        _invalid("tensor is on device type $(t.device.device_type), not in host memory")
end

"Whether a DLPack tensor's elements are compact and row-major."
function _is_compact(t::L.DLTensor)
    (t.strides == C_NULL || t.ndim == 0) && return true
    shape = unsafe_wrap(Array, t.shape, Int(t.ndim))
    strides = unsafe_wrap(Array, t.strides, Int(t.ndim))
    expected = 1
    for k in Int(t.ndim):-1:1
        (shape[k] == 1 || strides[k] == expected) || return false
        expected *= shape[k]
    end
    return true
end

function _check_host_compact(t::L.DLTensor)
    _check_host(t)
    _is_compact(t) || _invalid("tensor is not contiguous")
end

"Julia dimensions (reversed C shape) of a DLPack tensor."
_jldims(t::L.DLTensor) =
    t.ndim == 0 ? () : Tuple(reverse(Int.(unsafe_wrap(Array, t.shape, Int(t.ndim)))))

"The elements of a host tensor as a Julia `Array{S}` (`S` of the elements' size), compact or
strided (the pieces of `split_microbatches` along an inner dimension are strided)."
function _host_elements(::Type{S}, t::L.DLTensor) where {S}
    _check_host(t)
    out = Array{S}(undef, _jldims(t)...)
    src = Ptr{S}(t.data + t.byte_offset)
    if _is_compact(t)
        length(out) > 0 && unsafe_copyto!(pointer(out), src, length(out))
    else
        steps = reverse(unsafe_wrap(Array, t.strides, Int(t.ndim)))  # Julia dimension order
        for I in CartesianIndices(out)
            out[I] = unsafe_load(src, 1 + sum((I[k] - 1) * steps[k] for k in 1:ndims(out)))
        end
    end
    return out
end

"A Julia copy of a DLPack tensor (bfloat16 widened to Float32); `delete` calls its deleter
afterwards."
function _to_array(p::Ptr{L.DLManagedTensor}; delete::Bool=true)
    try
        t = unsafe_load(p).dl_tensor
        if _isbf16(t.dtype)  # bfloat16 is the top half of a Float32
            return map(b -> reinterpret(Float32, UInt32(b) << 16), _host_elements(UInt16, t))
        end
        return _host_elements(_jltype(t.dtype), t)
    finally
        delete && _delete(p)
    end
end

"A zero-copy Julia array over a DLPack tensor (valid while the tensor is)."
function _wrap(p::Ptr{L.DLManagedTensor})
    t = unsafe_load(p).dl_tensor
    T = _jltype(t.dtype)
    _check_host_compact(t)
    return unsafe_wrap(Array, Ptr{T}(t.data + t.byte_offset), _jldims(t); own=false)
end

"Julia copies of every tensor of an output list; the list is freed."
function _take_list(list::Ptr{L.rp_tensor_list})
    _scoped(list) do list
        n = Ref{Csize_t}(0)
        @check L.rp_tensor_list_size(n, list)
        outs = Array[]
        for i in 0:Int(n[])-1
            t = Ref{Ptr{L.DLManagedTensor}}(C_NULL)
            @check L.rp_tensor_list_get(t, list, Csize_t(i))
            push!(outs, _to_array(t[]))
        end
        return outs
    end
end

"""
    split_microbatches(a, num_microbatch; dim=0) -> Vector{Array}

The pieces the engine makes of an input or labels array `a` for `num_microbatch`
microbatches (copies): along C dimension `dim` (0, the default, is the last Julia dimension:
the batch), with `torch.tensor_split`'s sizes, or `a` itself for each microbatch with
`dim=:replicate` and for 0-dimensional arrays. One rule, the engine's, for every binding.
"""
function split_microbatches(a::AbstractArray, num_microbatch::Integer; dim=0)
    _ensure_abi()
    d = Int32(dim === :replicate ? L.RP_SPLIT_REPLICATE : dim)
    return _with_borrowed_one(a) do tp
        list = _create(L.rp_tensor_list, L.rp_split_microbatches, tp, d, Int32(num_microbatch))
        _take_list(list)  # the pieces are views of the borrowed memory: copied while it is held
    end
end

# A DLPack tensor the library will own: one malloc block holding the struct, the shape and a
# copy of the data; its deleter frees the block (from whatever thread the library calls it).
function _free_managed(p::Ptr{L.DLManagedTensor})::Cvoid
    Libc.free(Ptr{Cvoid}(p))
    return nothing
end

const _FREE_DELETER = Ref{Ptr{Cvoid}}(C_NULL)

function _managed_copy(a::AbstractArray)
    A = _dense(a)
    T = eltype(A)
    nd = ndims(A)
    shape = _cshape(A)
    hdr = sizeof(L.DLManagedTensor)
    block = Libc.malloc(hdr + 8 * nd + sizeof(A))
    block == C_NULL && throw(OutOfMemoryError())
    shp = Ptr{Int64}(block + hdr)
    data = Ptr{T}(block + hdr + 8 * nd)
    for k in 1:nd
        unsafe_store!(shp, shape[k], k)
    end
    length(A) > 0 && unsafe_copyto!(data, pointer(A), length(A))
    t = L.DLTensor(Ptr{Cvoid}(data), L.DLDevice(L.kDLCPU, 0), Int32(nd), _dltype(T),
                   nd == 0 ? Ptr{Int64}(C_NULL) : shp, Ptr{Int64}(C_NULL), UInt64(0))
    unsafe_store!(Ptr{L.DLManagedTensor}(block), L.DLManagedTensor(t, block, _FREE_DELETER[]))
    return Ptr{L.DLManagedTensor}(block)
end
