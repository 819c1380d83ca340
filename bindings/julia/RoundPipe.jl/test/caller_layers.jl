# A layer from Julia functions, trained with a built-in linear layer on 2 CPU worker devices,
# against values computed here by hand (Float64); the Julia twin of the Rust crate's
# tests/caller_layers.rs. Included by runtests.jl.
#
# The model, x of C shape [6, 4] (Julia (4, 6)) in 3 microbatches of 2 rows, built-in MSE
# summed over microbatches:
#   0 "julia:affine"  y = x .* w .* s .+ b  (w, b (4,) trainable, s (4,) frozen; buffer "seen"
#                                            (1,) counts the training microbatches its
#                                            non-recompute forward saw)
#   1 linear 4 -> 2
# One layer per stage: the Julia layer is a forward stage (:forward, then :recompute and
# backward), the linear layer the tail.
#
# Tolerance: Float32 in the engine against Float64 here through two layers of 4-term sums of
# values of order 1: a few Float32 roundings (~1e-7 relative); 1e-5 still catches any wrong term.

const CL_N, CL_D, CL_O, CL_M = 6, 4, 2, 3
const CL_W0 = Float32[0.9, 1.1, 0.7, 1.3]
const CL_B0 = Float32[0.1, -0.2, 0.3, -0.4]
const CL_S0 = Float32[1.5, 0.5, 1.0, 2.0]
const CL_SPEC = """{"layers": [{"type": "caller", "def": 0},
                               {"type": "linear", "in": 4, "out": 2}]}"""

# A 64-bit LCG: exact, portable values in [-1, 1).
function cl_data(seed::UInt64, n)
    state = seed
    return map(1:n) do _
        state = state * 0x5851f42d4c957f2d + 0x14057b7ef767814f
        Float32(state >> 40) / 8388608.0f0 - 1.0f0
    end
end

# What the functions saw, counted (the functions run on library threads: atomics).
mutable struct ClSeen
    phases::Dict{Symbol,Threads.Atomic{Int}}
    backward::Threads.Atomic{Int}
    fail::Bool
end
ClSeen() = ClSeen(Dict(p => Threads.Atomic{Int}(0) for p in (:forward, :recompute, :tail)),
                  Threads.Atomic{Int}(0), false)

function cl_layer(seen::ClSeen)
    forward = function (call, x)
        Threads.atomic_add!(seen.phases[call.phase], 1)
        seen.fail && error("deliberate failure")
        w, b, s = layer_params(call)
        y = x .* w .* s .+ b                      # x is (4, rows): features first
        if call.phase !== :recompute && call.training
            with_buffer(count -> (count[1] += 1), call, 1)
        end
        # Keep what backward needs only when a gradient is wanted.
        return (y,), call.phase === :forward ? nothing : (x, w, s)
    end
    backward = function (call, ctx, grads)
        Threads.atomic_add!(seen.backward, 1)
        x, w, s = ctx
        g = grads[1]
        dx = g .* w .* s
        dw = vec(sum(g .* x .* s; dims=2))
        db = vec(sum(g; dims=2))
        return (dx,), (dw, db, nothing)            # s is frozen: no gradient
    end
    layer = LayerDef(forward, backward; name="julia:affine")
    add_param!(layer, "w", CL_W0)
    add_param!(layer, "b", CL_B0)
    add_param!(layer, "s", CL_S0; trainable=false)
    add_buffer!(layer, "seen", Float32[0])
    return layer
end

cl_model(seen) = Model(CL_SPEC, [cl_layer(seen)]; seed=5, devices=:cpu, num_devices=2,
                       num_microbatch=CL_M, stage_plan=[1, 1])

relerr(got, want) = sqrt(sum(abs2, Float64.(got) .- want)) / max(sqrt(sum(abs2, want)), 1e-6)

# Loss and gradients of one call by hand. lw is the Julia view of the C [2, 4] weight: (4, 2).
function cl_reference(x, t, w, b, lw, lb)
    rows = CL_N ÷ CL_M
    loss = 0.0
    dw, db, dlw, dlb = zeros(CL_D), zeros(CL_D), zeros(CL_D, CL_O), zeros(CL_O)
    for r in 1:CL_N
        h = [x[j, r] * w[j] * CL_S0[j] + b[j] for j in 1:CL_D]
        gh = zeros(CL_D)
        for o in 1:CL_O
            y = lb[o] + sum(h[j] * lw[j, o] for j in 1:CL_D)
            d = y - t[o, r]
            loss += d^2 / (rows * CL_O)           # MSE: the mean over a microbatch's elements
            gy = 2d / (rows * CL_O)
            dlb[o] += gy
            for j in 1:CL_D
                dlw[j, o] += gy * h[j]
                gh[j] += gy * lw[j, o]
            end
        end
        for j in 1:CL_D
            dw[j] += gh[j] * x[j, r] * CL_S0[j]
            db[j] += gh[j]
        end
    end
    return loss, dw, db, dlw, dlb
end

@testset "caller-defined layer from Julia functions matches the hand-computed reference" begin
    seen = ClSeen()
    model = cl_model(seen)
    try
        @test stage_plan(model) == [1, 1]
        X = reshape(cl_data(UInt64(11), CL_N * CL_D), CL_D, CL_N)
        T = reshape(cl_data(UInt64(12), CL_N * CL_O), CL_O, CL_N)
        idx(name) = param_find(model, name)
        synchronize!(model)
        lw = Float64.(param_master(model, idx("1.weight")))
        lb = Float64.(param_master(model, idx("1.bias")))
        w, b = Float64.(CL_W0), Float64.(CL_B0)
        want, dw, db, dlw, dlb = cl_reference(X, T, w, b, lw, lb)

        l = forward_backward(model, X; labels=T, loss=Loss(:mse))
        @test abs(l - want) <= 1e-5 * abs(want)
        synchronize!(model)
        @test relerr(param_grad(model, idx("0.w")), dw) <= 1e-5
        @test relerr(param_grad(model, idx("0.b")), db) <= 1e-5
        @test relerr(param_grad(model, idx("1.weight")), dlw) <= 1e-5
        @test relerr(param_grad(model, idx("1.bias")), dlb) <= 1e-5

        # A forward stage: :forward, then :recompute and backward, once per microbatch; every
        # context kept was released.
        @test seen.phases[:forward][] == CL_M
        @test seen.phases[:recompute][] == CL_M
        @test seen.phases[:tail][] == 0
        @test seen.backward[] == CL_M
        @test isempty(model.layers[1].contexts)
        @test param_master(model, idx("0.seen")) == Float32[CL_M]

        # The frozen parameter: its kind, no gradient, unchanged by a step.
        @test param_kind(model, idx("0.s")) === :frozen
        @test param_kind(model, idx("0.seen")) === :buffer
        @test param_kind(model, idx("0.w")) === :trainable
        @test_throws RoundPipeError param_grad(model, idx("0.s"))
        lr = 0.1
        step!(model, Optimizer(:sgd; lr=lr); async=false)
        synchronize!(model)
        @test relerr(param_master(model, idx("0.w")), w .- lr .* dw) <= 1e-5
        @test relerr(param_master(model, idx("1.weight")), lw .- lr .* dlw) <= 1e-5
        @test param_master(model, idx("0.s")) == CL_S0

        # A failing function fails the call with its message; the model stays usable.
        seen.fail = true
        err = try
            forward_backward(model, X; labels=T, loss=Loss(:mse))
            nothing
        catch e
            e
        end
        @test err isa RoundPipeError && err.status == L.RP_ERR_CALLBACK
        @test occursin("julia:affine", err.message) && occursin("deliberate failure", err.message)
        seen.fail = false
        @test isfinite(forward_backward(model, X; labels=T, loss=Loss(:mse)))
        @test isempty(model.layers[1].contexts)
    finally
        close(model)
    end
end
