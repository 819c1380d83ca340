# Julia code the library calls, on its own threads (device workers, the optimizer thread, any
# thread for logs; Julia >= 1.9 adopts them). The rule for all of it: no exception crosses into
# C. A failure is returned as a status and its message kept for the Julia call that reports it.

# --- Loss: one microbatch's loss and gradient (device worker thread) ------------------------

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

# --- Step: a user optimizer step (optimizer thread) ------------------------------------------

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

# --- Caller-defined layers (device worker threads) -------------------------------------------

function _layer_forward_trampoline(out::Ptr{L.rp_tensor_list}, inout_context::Ptr{Ptr{Cvoid}},
                                   call::Ptr{L.rp_layer_call},
                                   inputs::Ptr{Ptr{L.DLManagedTensor}}, n_inputs::Csize_t,
                                   user_data::Ptr{Cvoid})::Int32
    layer = unsafe_pointer_to_objref(user_data)::LayerDef
    try
        c = LayerCall(call)
        xs = Array[_to_array(unsafe_load(inputs, i); delete=false) for i in 1:Int(n_inputs)]
        outputs, context = layer.forward(c, xs...)
        for y in outputs
            @check L.rp_tensor_list_push(out, _managed_copy(y))  # the list owns it now
        end
        # Only the phases with gradient keep a context; the engine releases it exactly once.
        if c.phase !== :forward && inout_context != C_NULL
            unsafe_store!(inout_context, _keep_context!(layer, context))
        end
        return Int32(0)
    catch err
        layer.last_error = "$(layer.name): forward failed: " * sprint(showerror, err)
        return Int32(1)
    end
end

_grad_ptr(g) = g === nothing ? Ptr{L.DLManagedTensor}(C_NULL) : _managed_copy(g)

function _layer_backward_trampoline(input_grads::Ptr{L.rp_tensor_list},
                                    param_grads::Ptr{L.rp_tensor_list}, context::Ptr{Cvoid},
                                    call::Ptr{L.rp_layer_call},
                                    output_grads::Ptr{Ptr{L.DLManagedTensor}},
                                    n_outputs::Csize_t, user_data::Ptr{Cvoid})::Int32
    layer = unsafe_pointer_to_objref(user_data)::LayerDef
    try
        c = LayerCall(call)
        ctx = _context(layer, context)
        gs = Any[]
        for i in 1:Int(n_outputs)
            p = unsafe_load(output_grads, i)
            push!(gs, p == C_NULL ? nothing : _to_array(p; delete=false))
        end
        dinputs, dparams = layer.backward(c, ctx, gs)
        for g in dinputs
            @check L.rp_tensor_list_push(input_grads, _grad_ptr(g))
        end
        for g in dparams
            @check L.rp_tensor_list_push(param_grads, _grad_ptr(g))
        end
        return Int32(0)
    catch err
        layer.last_error = "$(layer.name): backward failed: " * sprint(showerror, err)
        return Int32(1)
    end
end

function _layer_release_trampoline(context::Ptr{Cvoid}, user_data::Ptr{Cvoid})::Cvoid
    layer = unsafe_pointer_to_objref(user_data)::LayerDef
    try
        _release_context!(layer, context)
    catch
        # Nothing may cross into C; a context that is not in the table was never kept.
    end
    return nothing
end

const _LAYER_FORWARD_TRAMPOLINE = Ref{Ptr{Cvoid}}(C_NULL)
const _LAYER_BACKWARD_TRAMPOLINE = Ref{Ptr{Cvoid}}(C_NULL)
const _LAYER_RELEASE_TRAMPOLINE = Ref{Ptr{Cvoid}}(C_NULL)

# --- Logging (any library thread, one call at a time) ---------------------------------------

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

# C function pointers are made at load time (they cannot be precompiled): called by __init__.
function _init_callbacks()
    _LOSS_TRAMPOLINE[] = @cfunction(_loss_trampoline, Int32,
                                    (Ptr{Cdouble}, Ptr{Ptr{L.DLManagedTensor}},
                                     Ptr{L.DLManagedTensor}, Ptr{L.DLManagedTensor}, Int32,
                                     Ptr{Cvoid}))
    _STEP_TRAMPOLINE[] = @cfunction(_step_trampoline, Int32, (Ptr{L.rp_model}, Ptr{Cvoid}))
    _LOG_TRAMPOLINE[] = @cfunction(_log_trampoline, Cvoid, (Int32, Cstring, Ptr{Cvoid}))
    _FREE_DELETER[] = @cfunction(_free_managed, Cvoid, (Ptr{L.DLManagedTensor},))
    _LAYER_FORWARD_TRAMPOLINE[] = @cfunction(_layer_forward_trampoline, Int32,
                                             (Ptr{L.rp_tensor_list}, Ptr{Ptr{Cvoid}},
                                              Ptr{L.rp_layer_call}, Ptr{Ptr{L.DLManagedTensor}},
                                              Csize_t, Ptr{Cvoid}))
    _LAYER_BACKWARD_TRAMPOLINE[] = @cfunction(_layer_backward_trampoline, Int32,
                                              (Ptr{L.rp_tensor_list}, Ptr{L.rp_tensor_list},
                                               Ptr{Cvoid}, Ptr{L.rp_layer_call},
                                               Ptr{Ptr{L.DLManagedTensor}}, Csize_t,
                                               Ptr{Cvoid}))
    _LAYER_RELEASE_TRAMPOLINE[] = @cfunction(_layer_release_trampoline, Cvoid,
                                             (Ptr{Cvoid}, Ptr{Cvoid}))
    return nothing
end
