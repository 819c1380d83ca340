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

"""
    adam_apply!(params, grads, exp_avgs, exp_avg_sqs, steps; lr=1e-3, betas=(0.9, 0.999),
                eps=1e-8, weight_decay=0.0, decoupled_weight_decay=false)

One Adam update of arrays you own with the engine's kernel (`rp_adam_apply`): for each `i`,
what `torch.optim.Adam` computes for a parameter at step `steps[i]` (1-based).
`params[i]`, `exp_avgs[i]` and `exp_avg_sqs[i]` are updated in place, so they must be dense
`Array{Float32}`s (a view would be updated as a copy, so it is refused); `grads[i]` is read. All
of entry `i` have one size. Every entry is checked first; on error nothing has changed.
"""
function adam_apply!(params::AbstractVector, grads::AbstractVector, exp_avgs::AbstractVector,
                     exp_avg_sqs::AbstractVector, steps::AbstractVector{<:Integer};
                     lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                     decoupled_weight_decay::Bool=false)
    _ensure_abi()
    n = length(params)
    all(length(x) == n for x in (grads, exp_avgs, exp_avg_sqs, steps)) ||
        _invalid("adam_apply!: params, grads, exp_avgs, exp_avg_sqs and steps differ in length")
    for (name, xs) in (("params", params), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs))
        for (i, a) in enumerate(xs)
            a isa Array{Float32} ||
                _invalid("adam_apply!: $name[$i] must be an Array{Float32}, got $(typeof(a))")
        end
    end
    steps64 = Int64[s for s in steps]
    _with_borrowed(params) do p, _
        _with_borrowed(grads) do g, _
            _with_borrowed(exp_avgs) do m, _
                _with_borrowed(exp_avg_sqs) do v, _
                    GC.@preserve steps64 begin
                        @check L.rp_adam_apply(p, g, m, v, pointer(steps64), Csize_t(n),
                                               Float64(lr), Float64(betas[1]),
                                               Float64(betas[2]), Float64(eps),
                                               Float64(weight_decay),
                                               Int32(decoupled_weight_decay))
                    end
                end
            end
        end
    end
    return params
end
