# train_mlp.jl - the shared training recipe (examples/RECIPE.md) through RoundPipe.jl.
#
# Builds a small MLP from a JSON spec, trains it for 20 asynchronous AdamW steps on a fixed
# synthetic batch and prints one line per step. Standard output carries only the recipe's lines,
# so the output can be compared with the C, Python and Rust examples line by line.
#
#   ROUNDPIPE_LIBRARY=build/libroundpipe.so \
#       julia --project=bindings/julia/RoundPipe.jl examples/julia/train_mlp.jl
#
# Julia arrays are column-major: the C tensor x[24, 8] is the Julia matrix X of size (8, 24),
# with X[j, i] == x[i][j], so the recipe's row-major generation order fills X in memory order.

using RoundPipe

const SPEC = """{"layers":[{"type":"linear","in":8,"out":32},{"type":"gelu"},{"type":"residual_mlp","dim":32,"hidden":64},{"type":"linear","in":32,"out":1}]}"""
const ROWS, COLS, STEPS, MICROBATCHES, SEED = 24, 8, 20, 3, 42

"The recipe's data: X (8, 24) in [-1, 1) from a 64-bit LCG, Y (1, 24) = column sums of sin."
function make_data()
    state = UInt64(42)
    X = Matrix{Float32}(undef, COLS, ROWS)
    Y = Matrix{Float32}(undef, 1, ROWS)
    for i in 1:ROWS
        s = 0.0
        for j in 1:COLS
            state = state * 0x5851f42d4c957f2d + 0x14057b7ef767814f  # wraps modulo 2^64
            X[j, i] = Float32(state >> 40) / 8388608.0f0 - 1.0f0
            s += sin(Float64(X[j, i]))
        end
        Y[1, i] = Float32(s)
    end
    return X, Y
end

"Run the recipe; returns the data check values and the loss of every step."
function train()
    X, Y = make_data()
    losses = Float64[]
    Model(SPEC; seed=SEED, devices=:cpu, num_devices=2, num_microbatch=MICROBATCHES) do model
        println(stderr, "roundpipe $(RoundPipe.version()): $(num_stages(model)) stage(s) on ",
                "$(num_devices(model)) device(s)")
        # Mean squared error per microbatch; scaling by 1/3 makes the summed loss the batch mean.
        loss = Loss(:mse; scale=1 / MICROBATCHES)
        opt = Optimizer(:adamw; lr=1e-2)
        for _ in 1:STEPS
            push!(losses, forward_backward(model, X; labels=Y, loss=loss))
            # Asynchronous: the update runs on the optimizer thread while the next
            # forward_backward already computes, on weights one step old.
            step!(model, opt; async=true)
        end
        synchronize!(model)  # wait for the last step and publish its weights
        close(opt)
        close(loss)
    end
    return (Float64(X[1, 1]), Float64(X[2, 1]), Float64(Y[1, 1])), losses
end

function main()
    data, losses = train()
    println("data ", repr(data[1]), " ", repr(data[2]), " ", repr(data[3]))
    for (k, l) in enumerate(losses)
        println("step ", k - 1, " loss ", repr(l))
    end
    if !(losses[end] < losses[1])
        println(stderr, "error: the loss did not fall ($(losses[1]) -> $(losses[end]))")
        exit(1)
    end
end

abspath(PROGRAM_FILE) == @__FILE__ && main()
