# Driving a model: inference, fused forward + backward, optimizer steps, synchronization.

"""
    forward(model, inputs...; config=nothing) -> Vector{Array}

Inference on the published weights. Returns the outputs (one array when merged, else one per
microbatch), as Julia copies.
"""
function forward(m::Model, inputs::AbstractArray...; config::Union{Nothing,RunConfig}=nothing)
    list = Ref{Ptr{L.rp_tensor_list}}(C_NULL)
    mp, cp = _ptr(m), _cfg(config)
    _clear_layer_errors!(m)
    st = _with_borrowed(inputs) do pp, np
        GC.@preserve list begin
            lp = Base.unsafe_convert(Ptr{Ptr{L.rp_tensor_list}}, list)
            _gcsafe(() -> L.rp_forward(lp, mp, pp, np, cp))
        end
    end
    st == L.RP_OK || throw(_layer_details(m, _last_error(st)))
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
    value = Ref{Cdouble}(0)
    list = Ref{Ptr{L.rp_tensor_list}}(C_NULL)
    loss === nothing || (loss.last_error = nothing)
    _clear_layer_errors!(m)
    mp, cp = _ptr(m), _cfg(config)
    lsp = loss === nothing ? Ptr{L.rp_loss}(C_NULL) : _ptr(loss)
    st = _with_borrowed(inputs) do pp, np
        _with_borrowed_one(labels) do lp
            GC.@preserve value list loss begin
                vp = Base.unsafe_convert(Ptr{Cdouble}, value)
                op = outputs ? Base.unsafe_convert(Ptr{Ptr{L.rp_tensor_list}}, list) :
                     Ptr{Ptr{L.rp_tensor_list}}(C_NULL)
                _gcsafe(() -> L.rp_forward_backward(vp, op, mp, pp, np, lp, lsp, cp))
            end
        end
    end
    if st != L.RP_OK
        e = _last_error(st)
        if st == L.RP_ERR_CALLBACK && loss !== nothing && loss.last_error !== nothing
            e = RoundPipeError(e.status, e.message * ": " * loss.last_error)
        end
        throw(_layer_details(m, e))
    end
    outputs || return value[]
    return value[], _take_list(list[])
end

# The status of a call that waits for earlier steps, with the messages of failed step
# callbacks attached; forgets the callbacks the library is done with.
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
    mp, op, flag = _ptr(m), _ptr(opt), Int32(async)
    st = _gcsafe(() -> L.rp_step(mp, op, flag))
    _step_status(m, st)
    return m
end

function step!(f::Function, m::Model; async::Bool=true)
    mp = _ptr(m)
    state = _StepState(f, nothing)
    ud = pointer_from_objref(state)
    tp, flag = _STEP_TRAMPOLINE[], Int32(async)
    st = GC.@preserve state _gcsafe(() -> L.rp_step_callback(mp, tp, ud, flag))
    _step_status(m, st, async && st == L.RP_OK ? nothing : state)
    (async && st == L.RP_OK) && push!(m.pending_steps, state)  # kept until it has run
    return m
end

"""
    set_step_in_call!(model, optimizer)
    set_step_in_call!(model, nothing)

Step inside the training calls (models built with `host_memory=:saving` only;
`rp_model_set_step_in_call`). With an `Optimizer`, every later `forward_backward` is also the
optimizer step over its own gradients: it leaves the weights `forward_backward` followed by
`step!(model, optimizer; async=false)` would, bit for bit, but each parameter is updated on the
optimizer thread as soon as its gradient is final, so the step hides behind the backward. The
settings are copied (pass the optimizer again after changing it); `nothing` switches back to
explicit steps. While on, one call is one step (no accumulation over calls), `step!` throws
(`RP_ERR_STATE`), and a parameter without a gradient, or with inf or nan in it, is left alone.
Throws `RoundPipeError` (`RP_ERR_STATE`, nothing changed) for a standard-mode model, with loss
scaling, optimizer state of another kind, or gradients held since the last step (`step!` or
`zero_grad!` first). With data parallelism each rank updates from the averaged gradients.
"""
function set_step_in_call!(m::Model, opt::Union{Optimizer,Nothing})
    mp = _ptr(m)
    op = opt === nothing ? Ptr{L.rp_optimizer}(C_NULL) : _ptr(opt)
    GC.@preserve opt @check L.rp_model_set_step_in_call(mp, op)
    return m
end

"Whether each `forward_backward` is also the optimizer step (`set_step_in_call!`)."
function step_in_call(m::Model)
    enabled = Ref{Int32}(0)
    @check L.rp_model_step_in_call(enabled, _ptr(m))
    return enabled[] != 0
end

"Wait for every pending step and publish the latest master weights."
function synchronize!(m::Model)
    mp = _ptr(m)
    st = _gcsafe(() -> L.rp_synchronize(mp))
    _step_status(m, st)
    return m
end

"Drop the gradients accumulated since the last step."
function zero_grad!(m::Model)
    @check L.rp_zero_grad(_ptr(m))
    return m
end
