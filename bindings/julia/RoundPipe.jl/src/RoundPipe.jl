"""
    RoundPipe

Julia interface of RoundPipe: train models larger than GPU memory with a round-robin pipeline of
layer stages, fused forward + backward and an asynchronous CPU optimizer.

```julia
using RoundPipe
model = Model(spec_json; seed=42, devices=:cpu, num_devices=2, num_microbatch=3)
loss = Loss(:mse; scale=1/3)
opt = Optimizer(:adamw; lr=1e-2)
for step in 1:20
    l = forward_backward(model, X; labels=Y, loss=loss)
    step!(model, opt)
end
synchronize!(model)
close(model)
```

Arrays cross the C API as DLPack, without copies on the way in. Julia is column-major and the
library row-major, so the library sees an array's dimensions in reverse: a Julia
`Matrix{Float32}` of size `(features, batch)` is the C tensor `[batch, features]`. Outputs come
back the same way (a C `[batch, 1]` output is a Julia `(1, batch)` array).

Handles (`Model`, `RunConfig`, `Loss`, `Optimizer`) own their C object: `close` frees it
(idempotent), a finalizer does it otherwise, and each has a do-block form that closes at the end.
Failed calls throw `RoundPipeError` with the library's status and message.
"""
module RoundPipe

include("LibRoundPipe.jl")
using .LibRoundPipe
const L = LibRoundPipe

export Model, RunConfig, Loss, Optimizer, RoundPipeError, StepContext
export forward, forward_backward, step!, synchronize!, zero_grad!
export num_layers, num_stages, num_devices, step_count, host_state_bytes
export param_count, param_name, param_names, param_find, param_shape
export param_master, param_grad, with_param_master, with_param_grad
export save, load!, set_log_callback, reset_log_callback

# -------------------------------------------------------------------------------------------
# Errors
# -------------------------------------------------------------------------------------------

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

# -------------------------------------------------------------------------------------------
# DLPack: Julia arrays in and out
# -------------------------------------------------------------------------------------------

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

_delete(p::Ptr{L.DLManagedTensor}) = begin
    d = unsafe_load(p).deleter
    d == C_NULL || ccall(d, Cvoid, (Ptr{L.DLManagedTensor},), p)
    nothing
end

function _check_host_compact(t::L.DLTensor)
    t.device.device_type in (L.kDLCPU, L.kDLCUDAHost) ||
        _invalid("tensor is on device type $(t.device.device_type), not in host memory")
    if t.strides != C_NULL && t.ndim > 0
        shape = unsafe_wrap(Array, t.shape, Int(t.ndim))
        strides = unsafe_wrap(Array, t.strides, Int(t.ndim))
        expected = 1
        for k in Int(t.ndim):-1:1
            (shape[k] == 1 || strides[k] == expected) || _invalid("tensor is not contiguous")
            expected *= shape[k]
        end
    end
end

"Julia dimensions (reversed C shape) of a DLPack tensor."
_jldims(t::L.DLTensor) =
    t.ndim == 0 ? () : Tuple(reverse(Int.(unsafe_wrap(Array, t.shape, Int(t.ndim)))))

"A Julia copy of a DLPack tensor (bfloat16 widened to Float32); `delete` calls its deleter
afterwards."
function _to_array(p::Ptr{L.DLManagedTensor}; delete::Bool=true)
    try
        t = unsafe_load(p).dl_tensor
        if _isbf16(t.dtype)  # bfloat16 is the top half of a Float32
            _check_host_compact(t)
            raw = Array{UInt16}(undef, _jldims(t)...)
            n = length(raw)
            n > 0 && unsafe_copyto!(pointer(raw), Ptr{UInt16}(t.data + t.byte_offset), n)
            return map(b -> reinterpret(Float32, UInt32(b) << 16), raw)
        end
        T = _jltype(t.dtype)
        _check_host_compact(t)
        out = Array{T}(undef, _jldims(t)...)
        n = length(out)
        n > 0 && unsafe_copyto!(pointer(out), Ptr{T}(t.data + t.byte_offset), n)
        return out
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

# -------------------------------------------------------------------------------------------
# Handles
# -------------------------------------------------------------------------------------------

# Every handle: `ptr` (C_NULL once closed), close (idempotent), finalizer, do-block form.
function _handle(obj)
    finalizer(close, obj)
    return obj
end

function _ptr(obj, what)
    obj.ptr == C_NULL && throw(RoundPipeError(L.RP_ERR_INVALID_ARGUMENT, "$what is closed"))
    return obj.ptr
end

_grain(g) = g === nothing ? L.RP_GRAIN_DEFAULT : g === :stage ? L.RP_GRAIN_STAGE :
            g === :layer ? L.RP_GRAIN_LAYER : _invalid("recompute grain must be :stage or :layer")
_split(s) = s === :replicate ? L.RP_SPLIT_REPLICATE : Int32(s)

"""
    RunConfig(; num_microbatch, recompute_grain, output_device, input_split, label_split,
              merge_output)

A run configuration (upstream's `RoundPipeRunConfig`); unset keywords stay unset, so the
model's configuration (or the built-in default) applies. `recompute_grain` is `:stage` or
`:layer`; `output_device` `:cpu` or a GPU index; `input_split` a `Dict(input index => dim or
:replicate)` (C dimensions, counted in C order); `label_split` a dim or `:replicate`;
`merge_output` a Bool.
"""
mutable struct RunConfig
    ptr::Ptr{L.rp_run_config}

    function RunConfig(; num_microbatch=nothing, recompute_grain=nothing, output_device=nothing,
                       input_split=nothing, label_split=nothing, merge_output=nothing)
        _ensure_abi()
        out = Ref{Ptr{L.rp_run_config}}(C_NULL)
        @check L.rp_run_config_create(out)
        c = _handle(new(out[]))
        try
            num_microbatch === nothing ||
                @check L.rp_run_config_set_num_microbatch(c.ptr, Int32(num_microbatch))
            recompute_grain === nothing ||
                @check L.rp_run_config_set_recompute_grain(c.ptr, Int32(_grain(recompute_grain)))
            if output_device !== nothing
                kind, id = output_device === :cpu ? (L.kDLCPU, 0) : (L.kDLCUDA, Int(output_device))
                @check L.rp_run_config_set_output_device(c.ptr, Int32(kind), Int32(id))
            end
            if input_split !== nothing
                for (i, s) in input_split
                    @check L.rp_run_config_set_input_split_dim(c.ptr, Int32(i), Int32(_split(s)))
                end
            end
            label_split === nothing ||
                @check L.rp_run_config_set_label_split_dim(c.ptr, Int32(_split(label_split)))
            merge_output === nothing ||
                @check L.rp_run_config_set_merge_output(c.ptr, Int32(merge_output ? 1 : 0))
        catch
            close(c)
            rethrow()
        end
        return c
    end
end

function Base.close(c::RunConfig)
    p, c.ptr = c.ptr, C_NULL
    p == C_NULL || L.rp_run_config_destroy(p)
    return nothing
end

RunConfig(f::Function; kw...) = (c = RunConfig(; kw...); try f(c) finally close(c) end)

_cfg(c::Nothing) = Ptr{L.rp_run_config}(C_NULL)
_cfg(c::RunConfig) = _ptr(c, "RunConfig")

"""
    Optimizer(kind=:adamw; lr, betas, eps, weight_decay, momentum)

Settings of a built-in optimizer (`:adamw` or `:sgd`), PyTorch's defaults for what is not
given. The optimizer state lives in the model; the settings are copied by each `step!`.
"""
mutable struct Optimizer
    ptr::Ptr{L.rp_optimizer}
    kind::Symbol

    function Optimizer(kind::Symbol=:adamw; lr=nothing, betas=nothing, eps=nothing,
                       weight_decay=nothing, momentum=nothing)
        _ensure_abi()
        code = kind === :adamw ? L.RP_OPTIMIZER_ADAMW : kind === :sgd ? L.RP_OPTIMIZER_SGD :
               _invalid("optimizer kind must be :adamw or :sgd, got :$kind")
        out = Ref{Ptr{L.rp_optimizer}}(C_NULL)
        @check L.rp_optimizer_create(out, Int32(code))
        o = _handle(new(out[], kind))
        try
            lr === nothing || @check L.rp_optimizer_set_learning_rate(o.ptr, Float64(lr))
            betas === nothing ||
                @check L.rp_optimizer_set_betas(o.ptr, Float64(betas[1]), Float64(betas[2]))
            eps === nothing || @check L.rp_optimizer_set_eps(o.ptr, Float64(eps))
            weight_decay === nothing ||
                @check L.rp_optimizer_set_weight_decay(o.ptr, Float64(weight_decay))
            momentum === nothing || @check L.rp_optimizer_set_momentum(o.ptr, Float64(momentum))
        catch
            close(o)
            rethrow()
        end
        return o
    end
end

function Base.close(o::Optimizer)
    p, o.ptr = o.ptr, C_NULL
    p == C_NULL || L.rp_optimizer_destroy(p)
    return nothing
end

Optimizer(f::Function, kind::Symbol=:adamw; kw...) =
    (o = Optimizer(kind; kw...); try f(o) finally close(o) end)

"Set the learning rate (takes effect at the next step)."
function set_learning_rate!(o::Optimizer, lr::Real)
    @check L.rp_optimizer_set_learning_rate(_ptr(o, "Optimizer"), Float64(lr))
    return o
end

"""
    Loss(kind=:mse; scale=1.0)
    Loss(f::Function; scale=1.0)

A built-in loss (`:output`, `:mse`, `:cross_entropy`, `:causal_lm`), or a loss computed by
`f(outputs, labels, microbatch) -> (loss::Real, grad::AbstractArray)` for one microbatch:
`outputs` and `labels` (or `nothing`) are Julia copies, `grad` is d(loss)/d(outputs) of the
outputs' size. `f` runs on a library thread (not a Julia task); an exception in it fails the
call with `RP_ERR_CALLBACK`, and the error message includes it. The loss must stay open while
calls use it.
"""
mutable struct Loss
    ptr::Ptr{L.rp_loss}
    callback::Any
    last_error::Union{Nothing,String}

    function Loss(kind::Symbol=:mse; scale::Real=1.0)
        _ensure_abi()
        code = kind === :output ? L.RP_LOSS_OUTPUT : kind === :mse ? L.RP_LOSS_MSE :
               kind === :cross_entropy ? L.RP_LOSS_CROSS_ENTROPY :
               kind === :causal_lm ? L.RP_LOSS_CAUSAL_LM :
               _invalid("loss kind must be :output, :mse, :cross_entropy or :causal_lm, got :$kind")
        out = Ref{Ptr{L.rp_loss}}(C_NULL)
        @check L.rp_loss_create(out, Int32(code))
        l = _handle(new(out[], nothing, nothing))
        _set_scale(l, scale)
        return l
    end

    function Loss(f::Function; scale::Real=1.0)
        _ensure_abi()
        l = _handle(new(Ptr{L.rp_loss}(C_NULL), f, nothing))
        out = Ref{Ptr{L.rp_loss}}(C_NULL)
        # user_data is the Loss itself: it stays reachable while the handle exists.
        @check L.rp_loss_create_callback(out, _LOSS_TRAMPOLINE[], pointer_from_objref(l))
        l.ptr = out[]
        _set_scale(l, scale)
        return l
    end
end

function _set_scale(l::Loss, scale)
    try
        @check L.rp_loss_set_scale(l.ptr, Float64(scale))
    catch
        close(l)
        rethrow()
    end
end

function Base.close(l::Loss)
    p, l.ptr = l.ptr, C_NULL
    p == C_NULL || L.rp_loss_destroy(p)
    return nothing
end

Loss(f::Function, kind::Symbol; kw...) = (l = Loss(kind; kw...); try f(l) finally close(l) end)

function _loss_trampoline(out_loss::Ptr{Cdouble}, out_grad::Ptr{Ptr{L.DLManagedTensor}},
                          outputs::Ptr{L.DLManagedTensor}, labels::Ptr{L.DLManagedTensor},
                          microbatch::Int32, user_data::Ptr{Cvoid})::Int32
    loss = unsafe_pointer_to_objref(user_data)::Loss
    try
        out = _to_array(outputs; delete=false)  # borrowed for the callback: no deleter call
        lab = labels == C_NULL ? nothing : _to_array(labels; delete=false)
        value, grad = loss.callback(out, lab, Int(microbatch))
        size(grad) == size(out) ||
            error("the gradient has size $(size(grad)), the outputs $(size(out))")
        unsafe_store!(out_loss, Float64(value))
        unsafe_store!(out_grad, _managed_copy(grad))
        return Int32(0)
    catch err
        loss.last_error = "loss callback failed on microbatch $microbatch: " *
                          sprint(showerror, err)
        return Int32(1)
    end
end

const _LOSS_TRAMPOLINE = Ref{Ptr{Cvoid}}(C_NULL)

# -------------------------------------------------------------------------------------------
# Model
# -------------------------------------------------------------------------------------------

"""
    Model(spec_json; seed=0, devices=:auto, num_devices=0, num_microbatch=nothing,
          run_config=nothing, model_dtype=nothing, optim_dtype=nothing, pin=nothing,
          name=nothing, stage_plan=nothing, host_memory=nothing)

Build a model from a JSON spec (`{"layers": [...]}`, see docs/semantics.md). `devices` is
`:auto`, `:cpu` or `:cuda`; `num_microbatch` is a shortcut for a model-level `RunConfig`;
`model_dtype` / `optim_dtype` are `:f32`, `:bf16` or `:f16`; `pin` is `:alloc`, `:register`
or `:off`.

`host_memory` is `:standard` (the default: 24 bytes of host state per parameter for bf16 /
f16 models, 28 for f32 ones; asynchronous steps are one step stale) or `:saving` (12 bytes:
AdamW moments in bf16 with stochastic rounding, one gradient buffer, one weight copy; weights
are never stale); see `rp_host_memory_mode` in the header and `host_state_bytes`. In saving
mode the gradients of a bf16 / f16 model are bfloat16: `param_grad` widens them to Float32,
`with_param_grad` cannot view them.
"""
mutable struct Model
    ptr::Ptr{L.rp_model}
    pending_steps::Vector{Any}  # step callbacks the optimizer thread may still run

    function Model(spec::AbstractString; seed::Integer=0, devices::Symbol=:auto,
                   num_devices::Integer=0, num_microbatch=nothing, run_config=nothing,
                   model_dtype=nothing, optim_dtype=nothing, pin=nothing, name=nothing,
                   stage_plan=nothing, host_memory=nothing)
        _ensure_abi()
        o = Ref{Ptr{L.rp_model_options}}(C_NULL)
        @check L.rp_model_options_create(o)
        opts = o[]
        own_cfg = nothing
        try
            @check L.rp_model_options_set_seed(opts, UInt64(seed))
            kind = devices === :auto ? L.RP_DEVICE_AUTO : devices === :cpu ? L.RP_DEVICE_CPU :
                   devices === :cuda ? L.RP_DEVICE_CUDA :
                   _invalid("devices must be :auto, :cpu or :cuda, got :$devices")
            @check L.rp_model_options_set_devices(opts, Int32(kind), Int32(num_devices))
            if run_config === nothing && num_microbatch !== nothing
                own_cfg = RunConfig(; num_microbatch=num_microbatch)
                run_config = own_cfg
            elseif num_microbatch !== nothing
                _invalid("give num_microbatch or run_config, not both")
            end
            run_config === nothing ||
                @check L.rp_model_options_set_run_config(opts, _cfg(run_config))
            dt(x) = x === :f32 ? L.RP_DTYPE_F32 : x === :bf16 ? L.RP_DTYPE_BF16 :
                    x === :f16 ? L.RP_DTYPE_F16 : _invalid("dtype must be :f32, :bf16 or :f16")
            model_dtype === nothing ||
                @check L.rp_model_options_set_model_dtype(opts, Int32(dt(model_dtype)))
            optim_dtype === nothing ||
                @check L.rp_model_options_set_optim_dtype(opts, Int32(dt(optim_dtype)))
            if pin !== nothing
                mode = pin === :alloc ? L.RP_PIN_ALLOC : pin === :register ? L.RP_PIN_REGISTER :
                       pin === :off ? L.RP_PIN_OFF : _invalid("pin must be :alloc, :register or :off")
                @check L.rp_model_options_set_pin_mode(opts, Int32(mode))
            end
            if host_memory !== nothing
                hm = host_memory === :standard ? L.RP_HOST_MEMORY_STANDARD :
                     host_memory === :saving ? L.RP_HOST_MEMORY_SAVING :
                     _invalid("host_memory must be :standard or :saving, got $(repr(host_memory))")
                @check L.rp_model_options_set_host_memory_mode(opts, Int32(hm))
            end
            name === nothing || @check L.rp_model_options_set_name(opts, String(name))
            if stage_plan !== nothing
                plan = Int32[stage_plan...]
                @check L.rp_model_options_set_stage_plan(opts, plan, Csize_t(length(plan)))
            end
            out = Ref{Ptr{L.rp_model}}(C_NULL)
            @check L.rp_model_create(out, String(spec), opts)
            return _handle(new(out[], Any[]))
        finally
            L.rp_model_options_destroy(opts)
            own_cfg === nothing || close(own_cfg)
        end
    end
end

function Base.close(m::Model)
    p, m.ptr = m.ptr, C_NULL
    # Destroy drains the pipeline and the optimizer thread, which may run Julia callbacks.
    p == C_NULL || _gcsafe(() -> L.rp_model_destroy(p))
    empty!(m.pending_steps)
    return nothing
end

Model(f::Function, spec::AbstractString; kw...) =
    (m = Model(spec; kw...); try f(m) finally close(m) end)

_mp(m::Model) = _ptr(m, "Model")

for (fname, cfn, T) in ((:num_layers, :rp_model_num_layers, Int32),
                        (:num_stages, :rp_model_num_stages, Int32),
                        (:num_devices, :rp_model_num_devices, Int32),
                        (:step_count, :rp_model_step_count, Int64))
    @eval function $fname(m::Model)
        n = Ref{$T}(0)
        @check L.$cfn(n, _mp(m))
        return Int(n[])
    end
end

"""
    host_state_bytes(model) -> (bytes=..., elements=..., bytes_per_param=...)

Host memory held by the model's parameter state (master weights, weight copies the devices
read, gradient buffers, built-in optimizer state once a built-in step has run), in tensor
bytes, and the number of parameter elements (tied parameters once). After a built-in AdamW
step a bf16 model holds 24 bytes per parameter with `host_memory=:standard` and 12 with
`:saving` (28 and 12 for f32 models).
"""
function host_state_bytes(m::Model)
    b, n = Ref{Int64}(0), Ref{Int64}(0)
    @check L.rp_model_host_state_bytes(b, n, _mp(m))
    return (bytes=Int(b[]), elements=Int(n[]),
            bytes_per_param=n[] == 0 ? 0.0 : b[] / n[])
end

_input_list(inputs) = [_dense(a) for a in inputs]

function _take_list(list::Ptr{L.rp_tensor_list})
    try
        n = Ref{Csize_t}(0)
        @check L.rp_tensor_list_size(n, list)
        outs = Array[]
        for i in 0:Int(n[])-1
            t = Ref{Ptr{L.DLManagedTensor}}(C_NULL)
            @check L.rp_tensor_list_get(t, list, Csize_t(i))
            push!(outs, _to_array(t[]))
        end
        return outs
    finally
        L.rp_tensor_list_destroy(list)
    end
end

"""
    forward(model, inputs...; config=nothing) -> Vector{Array}

Inference on the published weights. Returns the outputs (one array when merged, else one per
microbatch), as Julia copies.
"""
function forward(m::Model, inputs::AbstractArray...; config::Union{Nothing,RunConfig}=nothing)
    arrs = _input_list(inputs)
    shapes = [_cshape(a) for a in arrs]
    mts = [_borrow(a, s) for (a, s) in zip(arrs, shapes)]
    list = Ref{Ptr{L.rp_tensor_list}}(C_NULL)
    mp, cp = _mp(m), _cfg(config)
    local st
    GC.@preserve arrs shapes mts list begin
        ptrs = [pointer(mts, i) for i in eachindex(mts)]
        GC.@preserve ptrs begin
            pp, np, lp = pointer(ptrs), Csize_t(length(ptrs)),
                         Base.unsafe_convert(Ptr{Ptr{L.rp_tensor_list}}, list)
            st = _gcsafe(() -> L.rp_forward(lp, mp, pp, np, cp))
        end
    end
    st == L.RP_OK || throw(_last_error(st))
    return _take_list(list[])
end

"""
    forward_backward(model, inputs...; labels=nothing, loss=nothing, config=nothing,
                     outputs=false) -> Float64  (or (Float64, Vector{Array}) with outputs=true)

Training: forward, loss and backward of every microbatch in one pipelined pass. Returns the sum
of the microbatch losses; gradients accumulate until the next `step!`. `loss` `nothing` means
the model's output is the loss.
"""
function forward_backward(m::Model, inputs::AbstractArray...; labels=nothing,
                          loss::Union{Nothing,Loss}=nothing,
                          config::Union{Nothing,RunConfig}=nothing, outputs::Bool=false)
    arrs = _input_list(inputs)
    shapes = [_cshape(a) for a in arrs]
    mts = [_borrow(a, s) for (a, s) in zip(arrs, shapes)]
    lab = labels === nothing ? nothing : _dense(labels)
    lshape = lab === nothing ? Int64[] : _cshape(lab)
    lmt = lab === nothing ? nothing : Ref(_borrow(lab, lshape))
    value = Ref{Cdouble}(0)
    list = Ref{Ptr{L.rp_tensor_list}}(C_NULL)
    loss === nothing || (loss.last_error = nothing)
    mp, cp = _mp(m), _cfg(config)
    lsp = loss === nothing ? Ptr{L.rp_loss}(C_NULL) : _ptr(loss, "Loss")
    local st
    GC.@preserve arrs shapes mts lab lshape lmt value list loss begin
        ptrs = [pointer(mts, i) for i in eachindex(mts)]
        GC.@preserve ptrs begin
            pp, np = pointer(ptrs), Csize_t(length(ptrs))
            vp = Base.unsafe_convert(Ptr{Cdouble}, value)
            op = outputs ? Base.unsafe_convert(Ptr{Ptr{L.rp_tensor_list}}, list) :
                 Ptr{Ptr{L.rp_tensor_list}}(C_NULL)
            lp = lmt === nothing ? Ptr{L.DLManagedTensor}(C_NULL) :
                 Base.unsafe_convert(Ptr{L.DLManagedTensor}, lmt)
            st = _gcsafe(() -> L.rp_forward_backward(vp, op, mp, pp, np, lp, lsp, cp))
        end
    end
    if st != L.RP_OK
        e = _last_error(st)
        if st == L.RP_ERR_CALLBACK && loss !== nothing && loss.last_error !== nothing
            e = RoundPipeError(e.status, e.message * ": " * loss.last_error)
        end
        throw(e)
    end
    outputs || return value[]
    return value[], _take_list(list[])
end

"""
    StepContext

What a step callback gets: parameter access on the optimizer thread, valid during the callback
only. Use `param_count(ctx)`, `param_name(ctx, i)`, and `with_param_master(f, ctx, i)` /
`with_param_grad(f, ctx, i)` for zero-copy arrays (indices from 1).
"""
struct StepContext
    ptr::Ptr{L.rp_model}
end

mutable struct _StepState
    f::Any
    error::Union{Nothing,String}
end

function _step_trampoline(model::Ptr{L.rp_model}, user_data::Ptr{Cvoid})::Int32
    state = unsafe_pointer_to_objref(user_data)::_StepState
    try
        state.f(StepContext(model))
        return Int32(0)
    catch err
        state.error = "step callback failed: " * sprint(showerror, err)
        return Int32(1)
    end
end

const _STEP_TRAMPOLINE = Ref{Ptr{Cvoid}}(C_NULL)

function _step_status(m::Model, st, extra::Union{Nothing,_StepState}=nothing)
    details = String[]
    if st == L.RP_ERR_CALLBACK
        for s in m.pending_steps
            s.error === nothing || push!(details, s.error)
        end
        extra === nothing || extra.error === nothing || push!(details, extra.error)
    end
    # A call that returned OK or CALLBACK waited for every earlier step.
    (st == L.RP_OK || st == L.RP_ERR_CALLBACK) && empty!(m.pending_steps)
    if st != L.RP_OK
        e = _last_error(st)
        isempty(details) || (e = RoundPipeError(e.status, e.message * ": " * join(details, "; ")))
        throw(e)
    end
    return nothing
end

"""
    step!(model, optimizer; async=true)
    step!(f, model; async=true)

One optimizer step on the gradients accumulated since the previous one: built-in, or computed
by `f(ctx::StepContext)` on the optimizer thread. Asynchronous steps return at once; the next
`forward_backward` runs on the weights from before this step (staleness 1).
"""
function step!(m::Model, opt::Optimizer; async::Bool=true)
    mp, op, flag = _mp(m), _ptr(opt, "Optimizer"), Int32(async)
    st = _gcsafe(() -> L.rp_step(mp, op, flag))
    _step_status(m, st)
    return m
end

function step!(f::Function, m::Model; async::Bool=true)
    mp = _mp(m)
    state = _StepState(f, nothing)
    ud = pointer_from_objref(state)
    tp, flag = _STEP_TRAMPOLINE[], Int32(async)
    st = GC.@preserve state _gcsafe(() -> L.rp_step_callback(mp, tp, ud, flag))
    _step_status(m, st, async && st == L.RP_OK ? nothing : state)
    (async && st == L.RP_OK) && push!(m.pending_steps, state)  # kept until it has run
    return m
end

"Wait for every pending step and publish the latest master weights."
function synchronize!(m::Model)
    mp = _mp(m)
    st = _gcsafe(() -> L.rp_synchronize(mp))
    _step_status(m, st)
    return m
end

"Drop the gradients accumulated since the last step."
function zero_grad!(m::Model)
    @check L.rp_zero_grad(_mp(m))
    return m
end

# Parameters (indices from 1, as everywhere in Julia).
_pp(m::Model) = _mp(m)
_pp(c::StepContext) = c.ptr

function param_count(m::Union{Model,StepContext})
    n = Ref{Csize_t}(0)
    @check L.rp_param_count(n, _pp(m))
    return Int(n[])
end

function param_name(m::Union{Model,StepContext}, i::Integer)
    s = Ref{Cstring}()  # written by the library on success
    @check L.rp_param_name(s, _pp(m), Csize_t(i - 1))
    return _string(s[])
end

param_names(m::Union{Model,StepContext}) = [param_name(m, i) for i in 1:param_count(m)]

function param_find(m::Model, name::AbstractString)
    i = Ref{Csize_t}(0)
    @check L.rp_param_find(i, _mp(m), String(name))
    return Int(i[]) + 1
end

"Shape of parameter `i` in C order (a Julia view of it has these dimensions reversed)."
function param_shape(m::Model, i::Integer)
    nd = Ref{Int32}(0)
    @check L.rp_param_shape(Ptr{Int64}(C_NULL), nd, Int32(0), _mp(m), Csize_t(i - 1))
    shape = zeros(Int64, nd[])
    @check L.rp_param_shape(shape, nd, nd[], _mp(m), Csize_t(i - 1))
    return shape
end

function _param_ptr(m, i, grad::Bool)
    t = Ref{Ptr{L.DLManagedTensor}}(C_NULL)
    if grad
        @check L.rp_param_grad(t, _pp(m), Csize_t(i - 1))
    else
        @check L.rp_param_master(t, _pp(m), Csize_t(i - 1))
    end
    return t[]
end

"A copy of the fp32 master weight of parameter `i` (read after `synchronize!`)."
param_master(m::Union{Model,StepContext}, i::Integer) = _to_array(_param_ptr(m, i, false))

"A copy of the gradient of parameter `i` (accumulated since the last step; in a step callback,
that step's gradient). Float32; the bfloat16 gradients of `host_memory=:saving` are widened."
param_grad(m::Union{Model,StepContext}, i::Integer) = _to_array(_param_ptr(m, i, true))

"""
    with_param_master(f, model_or_ctx, i)

Call `f(w)` with a zero-copy array over the master weight of parameter `i`; writes change the
weight (in a step callback: this step's update; elsewhere: at the next synchronize or step).
`w` must not be used after `f` returns.
"""
function with_param_master(f, m::Union{Model,StepContext}, i::Integer)
    p = _param_ptr(m, i, false)
    try
        return f(_wrap(p))
    finally
        _delete(p)
    end
end

"As `with_param_master`, over the gradient of parameter `i`."
function with_param_grad(f, m::Union{Model,StepContext}, i::Integer)
    p = _param_ptr(m, i, true)
    try
        return f(_wrap(p))
    finally
        _delete(p)
    end
end

"Save the latest weights to a safetensors file (synchronizes first)."
function save(m::Model, path::AbstractString)
    mp, s = _mp(m), Base.cconvert(Cstring, String(path))
    cs = Base.unsafe_convert(Cstring, s)  # throws here, not in the GC-safe call, on a NUL byte
    st = GC.@preserve s _gcsafe(() -> L.rp_model_save(mp, cs))
    st == L.RP_OK || throw(_last_error(st))
    return m
end

"Load every parameter from a safetensors file (synchronizes first)."
function load!(m::Model, path::AbstractString)
    mp, s = _mp(m), Base.cconvert(Cstring, String(path))
    cs = Base.unsafe_convert(Cstring, s)
    st = GC.@preserve s _gcsafe(() -> L.rp_model_load(mp, cs))
    st == L.RP_OK || throw(_last_error(st))
    return m
end

# -------------------------------------------------------------------------------------------
# Logging
# -------------------------------------------------------------------------------------------

const _LOG_FN = Ref{Any}(nothing)
const _LOG_TRAMPOLINE = Ref{Ptr{Cvoid}}(C_NULL)

function _log_trampoline(level::Int32, message::Cstring, user_data::Ptr{Cvoid})::Cvoid
    f = _LOG_FN[]
    f === nothing && return nothing
    try
        f(Int(level), _string(message))
    catch
        # A log line is not worth an exception crossing into C.
    end
    return nothing
end

"""
    set_log_callback(f; min_level=RP_LOG_INFO)

Send library log messages at or above `min_level` to `f(level::Int, message::String)`, called
from any RoundPipe thread, one call at a time; `f` must not call back into RoundPipe.
"""
function set_log_callback(f; min_level::Integer=L.RP_LOG_INFO)
    _ensure_abi()
    _LOG_FN[] = f
    @check L.rp_set_log_callback(_LOG_TRAMPOLINE[], Int32(min_level), C_NULL)
    return nothing
end

"Restore the default log sink (warnings and errors to stderr)."
function reset_log_callback()
    @check L.rp_set_log_callback(C_NULL, Int32(L.RP_LOG_WARN), C_NULL)
    _LOG_FN[] = nothing
    return nothing
end

function __init__()
    # C function pointers are made at load time (they cannot be precompiled).
    _LOSS_TRAMPOLINE[] = @cfunction(_loss_trampoline, Int32,
                                    (Ptr{Cdouble}, Ptr{Ptr{L.DLManagedTensor}},
                                     Ptr{L.DLManagedTensor}, Ptr{L.DLManagedTensor}, Int32,
                                     Ptr{Cvoid}))
    _STEP_TRAMPOLINE[] = @cfunction(_step_trampoline, Int32, (Ptr{L.rp_model}, Ptr{Cvoid}))
    _LOG_TRAMPOLINE[] = @cfunction(_log_trampoline, Cvoid, (Int32, Cstring, Ptr{Cvoid}))
    _FREE_DELETER[] = @cfunction(_free_managed, Cvoid, (Ptr{L.DLManagedTensor},))
    return nothing
end

end # module RoundPipe
