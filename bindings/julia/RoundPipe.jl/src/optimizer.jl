# Optimizer: settings of a built-in optimizer (its state lives in the model).

const _OPTIMIZER_KINDS = (adamw=L.RP_OPTIMIZER_ADAMW, sgd=L.RP_OPTIMIZER_SGD)

"""
    Optimizer(kind=:adamw; lr, betas, eps, weight_decay, momentum)

Settings of a built-in optimizer (`:adamw` or `:sgd`), PyTorch's defaults for what is not
given. The optimizer state lives in the model; the settings are copied by each `step!`.
"""
mutable struct Optimizer <: Handle
    ptr::Ptr{L.rp_optimizer}
    kind::Symbol

    Optimizer(p::Ptr{L.rp_optimizer}, kind::Symbol) = _own!(new(p, kind))
end

function Optimizer(kind::Symbol=:adamw; lr=nothing, betas=nothing, eps=nothing,
                   weight_decay=nothing, momentum=nothing)
    _ensure_abi()
    code = _code(_OPTIMIZER_KINDS, kind, "optimizer kind")
    _setup!(Optimizer(_create(L.rp_optimizer, L.rp_optimizer_create, code), kind)) do o
        p = o.ptr
        lr === nothing || @check L.rp_optimizer_set_learning_rate(p, Float64(lr))
        betas === nothing ||
            @check L.rp_optimizer_set_betas(p, Float64(betas[1]), Float64(betas[2]))
        eps === nothing || @check L.rp_optimizer_set_eps(p, Float64(eps))
        weight_decay === nothing ||
            @check L.rp_optimizer_set_weight_decay(p, Float64(weight_decay))
        momentum === nothing || @check L.rp_optimizer_set_momentum(p, Float64(momentum))
    end
end

"Set the learning rate (takes effect at the next step)."
function set_learning_rate!(o::Optimizer, lr::Real)
    @check L.rp_optimizer_set_learning_rate(_ptr(o), Float64(lr))
    return o
end
