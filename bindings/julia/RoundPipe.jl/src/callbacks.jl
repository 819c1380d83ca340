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
    return nothing
end
