# Parameters, by index from 1 (as everywhere in Julia), on a model or inside a step callback.

"""
    StepContext

What a step callback gets: parameter access on the optimizer thread, valid during the callback
only. Use `param_count(ctx)`, `param_name(ctx, i)`, and `with_param_master(f, ctx, i)` /
`with_param_grad(f, ctx, i)` for zero-copy arrays (indices from 1).
"""
struct StepContext
    ptr::Ptr{L.rp_model}
end

const ModelOrStep = Union{Model,StepContext}

_pp(m::Model) = _ptr(m)
_pp(c::StepContext) = c.ptr

function param_count(m::ModelOrStep)
    n = Ref{Csize_t}(0)
    @check L.rp_param_count(n, _pp(m))
    return Int(n[])
end

# A library-owned name of parameter `i` (valid while the model lives), copied.
function _param_string(cfn, m::ModelOrStep, i::Integer)
    s = Ref{Cstring}()  # written by the library on success
    @check cfn(s, _pp(m), Csize_t(i - 1))
    return _string(s[])
end

"Name of parameter `i` (\"3.fc1.weight\": the layer's index, then the layer's own name)."
param_name(m::ModelOrStep, i::Integer) = _param_string(L.rp_param_name, m, i)

param_names(m::ModelOrStep) = [param_name(m, i) for i in 1:param_count(m)]

"""
    param_hf_name(model, i) -> String

Hugging Face tensor name of parameter `i` ("model.layers.0.mlp.up_proj.weight"), the name
`save_hf` writes; a `RoundPipeError` (`RP_ERR_STATE`) for a model not built from a Hugging
Face config.
"""
param_hf_name(m::ModelOrStep, i::Integer) = _param_string(L.rp_param_hf_name, m, i)

function param_find(m::Model, name::AbstractString)
    i = Ref{Csize_t}(0)
    @check L.rp_param_find(i, _ptr(m), String(name))
    return Int(i[]) + 1
end

"Shape of parameter `i` in C order (a Julia view of it has these dimensions reversed)."
function param_shape(m::Model, i::Integer)
    nd = Ref{Int32}(0)
    @check L.rp_param_shape(Ptr{Int64}(C_NULL), nd, Int32(0), _ptr(m), Csize_t(i - 1))
    shape = zeros(Int64, nd[])
    @check L.rp_param_shape(shape, nd, nd[], _ptr(m), Csize_t(i - 1))
    return shape
end

function _param_ptr(m::ModelOrStep, i, grad::Bool)
    t = Ref{Ptr{L.DLManagedTensor}}(C_NULL)
    cfn = grad ? L.rp_param_grad : L.rp_param_master
    @check cfn(t, _pp(m), Csize_t(i - 1))
    return t[]
end

"A copy of the fp32 master weight of parameter `i` (read after `synchronize!`)."
param_master(m::ModelOrStep, i::Integer) = _to_array(_param_ptr(m, i, false))

"A copy of the gradient of parameter `i` (accumulated since the last step; in a step callback,
that step's gradient). Float32; the bfloat16 gradients of `host_memory=:saving` are widened."
param_grad(m::ModelOrStep, i::Integer) = _to_array(_param_ptr(m, i, true))

function _with_param(f, m::ModelOrStep, i::Integer, grad::Bool)
    p = _param_ptr(m, i, grad)
    try
        return f(_wrap(p))
    finally
        _delete(p)
    end
end

"""
    with_param_master(f, model_or_ctx, i)

Call `f(w)` with a zero-copy array over the master weight of parameter `i`; writes change the
weight (in a step callback: this step's update; elsewhere: at the next synchronize or step).
`w` must not be used after `f` returns.
"""
with_param_master(f, m::ModelOrStep, i::Integer) = _with_param(f, m, i, false)

"As `with_param_master`, over the gradient of parameter `i`."
with_param_grad(f, m::ModelOrStep, i::Integer) = _with_param(f, m, i, true)
