# Loss: built-in, or computed by a Julia function (its trampoline is in callbacks.jl).

const _LOSS_KINDS = (output=L.RP_LOSS_OUTPUT, mse=L.RP_LOSS_MSE,
                     cross_entropy=L.RP_LOSS_CROSS_ENTROPY, causal_lm=L.RP_LOSS_CAUSAL_LM)

"""
    Loss(kind=:mse; scale=1.0)
    Loss(f::Function; scale=1.0)

A built-in loss (`:output`, `:mse`, `:cross_entropy`, `:causal_lm`), or a loss computed by
`f(outputs, labels, microbatch) -> (loss::Real, grad::AbstractArray)` for one microbatch:
`outputs` and `labels` (or `nothing`) are Julia copies, `grad` is d(loss)/d(outputs) of the
outputs' size. `f` runs on a library thread (not a Julia task); an exception in it fails the
call with `RP_ERR_CALLBACK`, and the error message includes it. The loss must stay open while
calls use it. The do-block form needs the kind: `Loss(:mse) do loss ... end`.
"""
mutable struct Loss <: Handle
    ptr::Ptr{L.rp_loss}
    callback::Any
    last_error::Union{Nothing,String}

    Loss(p::Ptr{L.rp_loss}, callback) = _own!(new(p, callback, nothing))
end

function Loss(kind::Symbol=:mse; scale::Real=1.0)
    _ensure_abi()
    code = _code(_LOSS_KINDS, kind, "loss kind")
    l = Loss(_create(L.rp_loss, L.rp_loss_create, code), nothing)
    return _setup!(l -> @check(L.rp_loss_set_scale(l.ptr, Float64(scale))), l)
end

function Loss(f::Function; scale::Real=1.0)
    _ensure_abi()
    l = Loss(Ptr{L.rp_loss}(C_NULL), f)
    # user_data is the Loss itself: it stays reachable while the handle exists.
    l.ptr = _create(L.rp_loss, L.rp_loss_create_callback, _LOSS_TRAMPOLINE[],
                    pointer_from_objref(l))
    return _setup!(l -> @check(L.rp_loss_set_scale(l.ptr, Float64(scale))), l)
end
