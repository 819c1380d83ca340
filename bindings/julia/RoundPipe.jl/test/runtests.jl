# Tests of RoundPipe.jl, mirroring the Rust crate's (bindings/rust/roundpipe/tests).
#
#   ROUNDPIPE_LIBRARY=build/libroundpipe.so julia --project=bindings/julia/RoundPipe.jl \
#       -e 'using Pkg; Pkg.test()'
#
# No Julia runtime can be installed on our CI machines, so these tests are not run there; the
# header gate (tools/abi/check_bindings.py) checks the raw ccall layer against the header.
# Set ROUNDPIPE_C_EXAMPLE to the C example's binary to compare losses with it.

using Test
using RoundPipe
const L = RoundPipe.LibRoundPipe

# The Julia example itself, so that the tests run the code a reader sees.
const EXAMPLE = normpath(joinpath(@__DIR__, "..", "..", "..", "..", "examples", "julia",
                                  "train_mlp.jl"))
module Example end
Base.include(Example, EXAMPLE)

reldiff(a, b) = abs(a - b) / max(abs(a), abs(b), floatmin(Float64))

@testset "RoundPipe.jl" begin

@testset "library and ABI version" begin
    @test RoundPipe.abi_version() == L.RP_ABI_VERSION
    @test length(split(RoundPipe.version(), '.')) == 3
    @test RoundPipe.status_name(L.RP_ERR_IO) != ""
end

@testset "DLPack struct layouts" begin
    @test sizeof(L.DLDevice) == 8
    @test sizeof(L.DLDataType) == 4
    @test sizeof(L.DLTensor) == 48
    @test sizeof(L.DLManagedTensor) == 64
    @test sizeof(L.DLManagedTensorVersioned) == 80
end

@testset "recipe data matches the check values in RECIPE.md" begin
    X, Y = Example.make_data()
    @test size(X) == (8, 24) && size(Y) == (1, 24)
    @test Float64(X[1, 1]) == 0.136460542678833
    @test Float64(X[2, 1]) == -0.5490732192993164
    @test Float64(Y[1, 1]) == -2.218505382537842
    @test Float64(X[8, 24]) == 0.02287578582763672
    @test Float64(Y[1, 24]) == 0.6170184016227722
end

@testset "recipe training: the loss falls, deterministically" begin
    _, a = Example.train()
    _, b = Example.train()
    @test length(a) == 20
    @test all(isfinite, a)
    @test a[end] < a[1]
    @test minimum(a) < 0.5 * a[1]
    @test a[2] == a[1]  # staleness one: the second call still runs on the initial weights
    @test a == b
end

@testset "recipe losses equal the C example's" begin
    exe = get(ENV, "ROUNDPIPE_C_EXAMPLE", "")
    if isempty(exe) || !isfile(exe)
        @info "skipped: set ROUNDPIPE_C_EXAMPLE to the C example's binary"
    else
        lines = split(read(`$exe`, String), '\n'; keepempty=false)
        c_data = parse.(Float64, split(lines[1])[2:end])
        c_losses = [parse(Float64, split(l)[4]) for l in lines[2:end]]
        data, losses = Example.train()
        @test c_data == collect(data)
        @test length(c_losses) == length(losses)
        @test all(reldiff(c, r) <= 1e-6 for (c, r) in zip(c_losses, losses))
    end
end

@testset "first loss equals the MSE of the forward outputs" begin
    X, Y = Example.make_data()
    Model(Example.SPEC; seed=42, devices=:cpu, num_devices=2, num_microbatch=3) do m
        outs = forward(m, X)
        @test length(outs) == 1
        @test size(outs[1]) == (1, 24) && eltype(outs[1]) == Float32
        expected = sum((Float64.(outs[1]) .- Float64.(Y)) .^ 2) / 24
        loss = Loss(:mse; scale=1 / 3)
        @test reldiff(forward_backward(m, X; labels=Y, loss=loss), expected) <= 1e-5
        close(loss)
    end
end

rust_like_mse(o, l, mb) = (sum((Float64.(o) .- Float64.(l)) .^ 2) / length(o),
                           Float32.(2 .* (o .- l) ./ length(o)))

@testset "loss callback trains like the built-in MSE" begin
    X, Y = Example.make_data()
    builtin = Loss(:mse; scale=1 / 3)
    callback = Loss(rust_like_mse; scale=1 / 3)
    opt = Optimizer(:adamw; lr=1e-2)
    a = Model(Example.SPEC; seed=42, devices=:cpu, num_devices=2, num_microbatch=3)
    b = Model(Example.SPEC; seed=42, devices=:cpu, num_devices=2, num_microbatch=3)
    for _ in 1:5
        la = forward_backward(a, X; labels=Y, loss=builtin)
        lb = forward_backward(b, X; labels=Y, loss=callback)
        @test reldiff(la, lb) <= 1e-5
        step!(a, opt)
        step!(b, opt)
    end
    foreach(close, (a, b, builtin, callback, opt))
end

@testset "loss callback errors become RoundPipeError(RP_ERR_CALLBACK)" begin
    X, Y = Example.make_data()
    Model(Example.SPEC; seed=1, devices=:cpu, num_devices=2, num_microbatch=3) do m
        failing = Loss((o, l, mb) -> error("labels look wrong"))
        e = try
            forward_backward(m, X; labels=Y, loss=failing); nothing
        catch err
            err
        end
        @test e isa RoundPipeError
        @test e.status == L.RP_ERR_CALLBACK
        @test occursin("labels look wrong", e.message)
        # The model is still usable.
        @test isfinite(forward_backward(m, X; labels=Y, loss=Loss(:mse)))
        close(failing)
    end
end

@testset "step callback SGD equals built-in SGD" begin
    X, Y = Example.make_data()
    lr = 0.05
    loss = Loss(:mse)
    sgd = Optimizer(:sgd; lr=lr)
    a = Model(Example.SPEC; seed=42, devices=:cpu, num_devices=2, num_microbatch=3)
    b = Model(Example.SPEC; seed=42, devices=:cpu, num_devices=2, num_microbatch=3)
    for _ in 1:3
        forward_backward(a, X; labels=Y, loss=loss)
        step!(a, sgd; async=false)
        forward_backward(b, X; labels=Y, loss=loss)
        step!(b; async=false) do ctx
            for i in 1:param_count(ctx)
                g = param_grad(ctx, i)
                with_param_master(ctx, i) do w
                    w .-= Float32(lr) .* g
                end
            end
        end
    end
    synchronize!(a); synchronize!(b)
    for i in 1:param_count(a)
        @test isapprox(param_master(a, i), param_master(b, i); rtol=1e-6, atol=1e-6)
    end
    foreach(close, (a, b, loss, sgd))
end

@testset "failed async step callback is reported by synchronize!" begin
    X, Y = Example.make_data()
    Model(Example.SPEC; seed=3, devices=:cpu, num_devices=2, num_microbatch=3) do m
        forward_backward(m, X; labels=Y, loss=Loss(:mse))
        step!(ctx -> error("refusing this step"), m; async=true)
        e = try
            synchronize!(m); nothing
        catch err
            err
        end
        @test e isa RoundPipeError && e.status == L.RP_ERR_CALLBACK
        @test occursin("refusing this step", e.message)
    end
end

@testset "parameters follow the spec" begin
    Model(Example.SPEC; seed=42, devices=:cpu, num_devices=2, num_microbatch=3) do m
        expected = [("0.weight", [32, 8]), ("0.bias", [32]), ("2.norm.weight", [32]),
                    ("2.norm.bias", [32]), ("2.fc1.weight", [64, 32]), ("2.fc1.bias", [64]),
                    ("2.fc2.weight", [32, 64]), ("2.fc2.bias", [32]), ("3.weight", [1, 32]),
                    ("3.bias", [1])]
        @test num_layers(m) == 4
        @test num_devices(m) == 2
        @test param_count(m) == length(expected)
        for (i, (name, shape)) in enumerate(expected)
            @test param_name(m, i) == name
            @test param_find(m, name) == i
            @test param_shape(m, i) == shape
            @test size(param_master(m, i)) == Tuple(reverse(shape))
        end
    end
end

@testset "saved weights load into another model" begin
    X, _ = Example.make_data()
    a = Model(Example.SPEC; seed=42, devices=:cpu, num_devices=2, num_microbatch=3)
    b = Model(Example.SPEC; seed=7, devices=:cpu, num_devices=2, num_microbatch=3)
    mktempdir() do dir
        path = joinpath(dir, "weights.safetensors")
        save(a, path)
        before = forward(b, X)[1]
        load!(b, path)
        @test forward(b, X)[1] == forward(a, X)[1]
        @test before != forward(a, X)[1]
    end
    foreach(close, (a, b))
end

@testset "error paths" begin
    # Malformed JSON and bad layer arguments.
    e = try Model("{\"layers\": [ {\"type\": \"linear\", "); nothing catch err; err end
    @test e isa RoundPipeError && e.status == L.RP_ERR_INVALID_ARGUMENT && !isempty(e.message)
    e = try
        Model("""{"layers":[{"type":"gelu"},{"type":"linear","in":-3,"out":2}]}"""); nothing
    catch err
        err
    end
    @test e isa RoundPipeError && occursin("layer 1 (linear)", e.message)
    @test occursin("invalid", sprint(showerror, e)) || occursin("(-1)", sprint(showerror, e))
    # Bad option values.
    @test_throws RoundPipeError RunConfig(; num_microbatch=-1)
    @test_throws RoundPipeError Optimizer(:sgd; betas=(0.9, 0.99))
    @test_throws RoundPipeError Optimizer(:adamw; momentum=0.9)
    @test_throws RoundPipeError Loss(:mse; scale=Inf)
    @test_throws RoundPipeError Model("""{"layers":[{"type":"linear","in":4,"out":2}]}""";
                                      devices=:cpu, num_devices=65)
    # Wrong input shape and dtype; the model survives.
    Model("""{"layers":[{"type":"linear","in":4,"out":2}]}"""; seed=5, devices=:cpu,
          num_devices=1) do m
        loss = Loss(:mse)
        labels = zeros(Float32, 2, 6)
        @test_throws RoundPipeError forward_backward(m, zeros(Float32, 5, 6); labels=labels,
                                                     loss=loss)
        @test_throws RoundPipeError forward(m, zeros(Int64, 4, 6))
        @test isfinite(forward_backward(m, fill(0.25f0, 4, 6); labels=labels, loss=loss))
        @test size(forward(m, fill(0.25f0, 4, 6))[1]) == (2, 6)
        # Missing file, out-of-range parameter.
        e = try load!(m, "/nonexistent-roundpipe/weights.safetensors"); nothing catch err; err end
        @test e isa RoundPipeError && e.status == L.RP_ERR_IO
        @test occursin("weights.safetensors", e.message)
        @test_throws RoundPipeError param_name(m, 3)
        close(loss)
    end
end

@testset "host memory modes: bytes per parameter, bf16 gradients in saving mode" begin
    # The header's rp_host_memory_mode: after a built-in AdamW step, standard holds 24 bytes
    # per parameter for bf16 models and 28 for f32 ones, saving 12 for both.
    X, Y = Example.make_data()
    for (mode, dtype, want) in ((:standard, :bf16, 24), (:standard, :f32, 28),
                                (:saving, :bf16, 12), (:saving, :f32, 12))
        Model(Example.SPEC; seed=42, devices=:cpu, num_devices=2, num_microbatch=3,
              model_dtype=dtype, host_memory=mode) do m
            loss = Loss(:mse; scale=1 / 3)
            opt = Optimizer(:adamw; lr=1e-2)
            losses = Float64[]
            for _ in 1:(mode === :saving && dtype === :bf16 ? 20 : 1)
                push!(losses, forward_backward(m, X; labels=Y, loss=loss))
                step!(m, opt)
            end
            synchronize!(m)
            @test all(isfinite, losses)
            length(losses) > 1 && @test minimum(losses[end-4:end]) < 0.5 * losses[1]
            n = sum(prod(param_shape(m, i)) for i in 1:param_count(m))
            h = host_state_bytes(m)
            @test h.elements == n
            @test h.bytes == want * n
            @test h.bytes_per_param == want
            # CPU devices record compute spans only; the trace names every device.
            @test occursin("\"traceEvents\"", trace_json(m))
            @test nonfinite_counts(m) == (nonfinite_losses=0, skipped_steps=0)
            # Saving mode keeps bf16 gradients for a bf16 model: param_grad widens them.
            forward_backward(m, X; labels=Y, loss=loss)
            synchronize!(m)
            g = param_grad(m, 1)
            @test eltype(g) == Float32 && any(!iszero, g)
            close(loss); close(opt)
        end
    end
    @test_throws RoundPipeError Model(Example.SPEC; devices=:cpu, host_memory=:low)
end

# --- Data parallelism (mirrors bindings/rust/roundpipe/tests/data_parallel.rs) --------------

@testset "data parallelism: off is rank 0 of 1; out-of-range settings are invalid" begin
    Model(Example.SPEC; devices=:cpu, num_devices=1) do m
        @test data_parallel(m) == (rank=0, world_size=1)
    end
    Model(Example.SPEC; devices=:cpu, num_devices=1,
          data_parallel=DataParallel(; world_size=0)) do m
        @test data_parallel(m) == (rank=0, world_size=1)
    end
    for dp in (DataParallel(; rank=0, world_size=-2), DataParallel(; rank=2, world_size=2),
               DataParallel(; timeout=0))
        e = try Model(Example.SPEC; devices=:cpu, data_parallel=dp); nothing catch err; err end
        @test e isa RoundPipeError && e.status == L.RP_ERR_INVALID_ARGUMENT
    end
    @test data_parallel_available() isa Bool
end

# --- What the engine decided, asked (mirrors bindings/rust/roundpipe/tests/queries.rs) ------

@testset "stage plan: the explicit plan, else one covering every layer once" begin
    for plan in ([1, 3], [2, 1, 1], [4])
        Model(Example.SPEC; devices=:cpu, num_devices=2, stage_plan=plan) do m
            @test stage_plan(m) == plan
            @test num_stages(m) == length(plan)
        end
    end
    for n in 1:3
        Model(Example.SPEC; devices=:cpu, num_devices=n) do m
            plan = stage_plan(m)
            @test length(plan) == num_stages(m)
            @test all(>(0), plan)
            @test sum(plan) == num_layers(m) == 4
        end
    end
end

@testset "plan_stages: the planner's plan under limits, the model's own left alone" begin
    Model(Example.SPEC; devices=:cpu, num_devices=2, stage_plan=[4]) do m
        @test plan_stages(m; min_stages=4) == [1, 1, 1, 1]
        @test plan_stages(m; min_stages=9) == [1, 1, 1, 1]
        @test sum(plan_stages(m; min_stages=2)) == 4
        @test_throws RoundPipeError plan_stages(m; max_stage_bytes=1)
        @test_throws RoundPipeError plan_stages(m; max_stage_bytes=-1)
        @test stage_plan(m) == [4]
    end
end

@testset "backward stage plan: needs a forward plan, reads back, dropped by a new one" begin
    Model(Example.SPEC; devices=:cpu, num_devices=2) do m
        @test_throws RoundPipeError set_backward_stage_plan!(m, [1, 1, 1, 1])
        set_stage_plan!(m, [2, 2])
        @test backward_stage_plan(m) == [2, 2]
        set_backward_stage_plan!(m, [1, 1, 2])
        @test backward_stage_plan(m) == [1, 1, 2] && stage_plan(m) == [2, 2]
        @test_throws RoundPipeError set_backward_stage_plan!(m, [1, 1])
        set_stage_plan!(m, [4])
        @test backward_stage_plan(m) == [4]
    end
end

@testset "run config getters: nothing when unset, else what was set" begin
    RunConfig() do c
        @test num_microbatch(c) === nothing && recompute_grain(c) === nothing
        @test output_device(c) === nothing && merge_output(c) === nothing
    end
    RunConfig(; num_microbatch=6, recompute_grain=:layer, output_device=:cpu,
              merge_output=false) do c
        @test num_microbatch(c) == 6 && recompute_grain(c) == :layer
        @test output_device(c) == :cpu && merge_output(c) == false
    end
end

@testset "resolved run config: the header's defaults, num_microbatch devices + 1" begin
    for n in 1:3
        Model(Example.SPEC; devices=:cpu, num_devices=n) do m
            @test num_devices(m) == n
            r = resolve_run_config(m)
            @test num_microbatch(r) == n + 1
            @test recompute_grain(r) == :stage && output_device(r) == :cpu
            @test merge_output(r) == true
            close(r)
        end
    end
end

@testset "resolved run config: the call's values over the model's" begin
    Model(Example.SPEC; devices=:cpu, num_devices=2, num_microbatch=4) do m
        r = resolve_run_config(m)
        @test num_microbatch(r) == 4
        close(r)
        RunConfig(; num_microbatch=5, recompute_grain=:layer) do call
            r = resolve_run_config(m, call)
            @test num_microbatch(r) == 5 && recompute_grain(r) == :layer
            @test merge_output(r) == true
            close(r)
        end
        RunConfig(; merge_output=false) do call
            r = resolve_run_config(m, call)
            @test num_microbatch(r) == 4 && merge_output(r) == false
            @test num_microbatch(call) === nothing  # the call's own configuration is unchanged
            close(r)
        end
    end
end

const QWEN3 = """{"architectures": ["Qwen3ForCausalLM"], "vocab_size": 40, "hidden_size": 32,
    "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "tie_word_embeddings": false,
    "dtype": "float32"}"""

const LLAMA_TIED = """{"architectures": ["LlamaForCausalLM"], "vocab_size": 40,
    "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
    "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": true,
    "torch_dtype": "float32"}"""

# transformers' Qwen3ForCausalLM(config).named_parameters() for QWEN3, written out.
const QWEN3_HF_NAMES = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.self_attn.q_norm.weight",
    "model.layers.0.self_attn.k_norm.weight",
    "model.layers.0.mlp.gate_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.0.input_layernorm.weight",
    "model.layers.0.post_attention_layernorm.weight",
    "model.layers.1.self_attn.q_proj.weight",
    "model.layers.1.self_attn.k_proj.weight",
    "model.layers.1.self_attn.v_proj.weight",
    "model.layers.1.self_attn.o_proj.weight",
    "model.layers.1.self_attn.q_norm.weight",
    "model.layers.1.self_attn.k_norm.weight",
    "model.layers.1.mlp.gate_proj.weight",
    "model.layers.1.mlp.up_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
    "model.layers.1.input_layernorm.weight",
    "model.layers.1.post_attention_layernorm.weight",
    "model.norm.weight",
    "lm_head.weight",
]

# The same for LLAMA_TIED: no q/k norms, no lm_head.weight (tied to the embedding).
const LLAMA_TIED_HF_NAMES = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.mlp.gate_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.0.input_layernorm.weight",
    "model.layers.0.post_attention_layernorm.weight",
    "model.norm.weight",
]

# The header's rule from our name to the Hugging Face one: "0.weight" is the embedding,
# "<i>.<name>" of decoder layer i is "model.layers.<i - 1>.<name>", then the norm and the head.
function hf_name_by_the_headers_rule(ours, num_decoder_layers)
    layer, loc = split(ours, '.'; limit=2)
    l = parse(Int, layer)
    l == 0 && return "model.embed_tokens.$loc"
    l <= num_decoder_layers && return "model.layers.$(l - 1).$loc"
    l == num_decoder_layers + 1 && return "model.norm.$loc"
    return "lm_head.$loc"
end

@testset "hf names of tiny Qwen3 / tied Llama configs are transformers' names" begin
    for (config, expected, layers) in ((QWEN3, QWEN3_HF_NAMES, 2),
                                       (LLAMA_TIED, LLAMA_TIED_HF_NAMES, 1))
        Model(; hf_config=config, devices=:cpu, num_devices=2) do m
            names = [param_hf_name(m, i) for i in 1:param_count(m)]
            @test names == expected
            @test names == [hf_name_by_the_headers_rule(param_name(m, i), layers)
                            for i in 1:param_count(m)]
        end
    end
    Model(Example.SPEC; devices=:cpu) do m
        e = try param_hf_name(m, 1); nothing catch err; err end
        @test e isa RoundPipeError && e.status == L.RP_ERR_STATE
    end
    @test_throws RoundPipeError Model(; devices=:cpu)  # neither a spec nor a config
end

@testset "LoRA: adapters are the trainable parameters and round-trip through PEFT files" begin
    Model(; hf_config=QWEN3, devices=:cpu, num_devices=2,
          lora=Lora(; rank=4, alpha=8.0, target_modules="q_proj,down_proj")) do m
        @test lora(m) == Lora(Int32(4), 8.0, 0.0, "q_proj,down_proj")
        adapters = [i for i in 1:param_count(m) if occursin(".lora_", param_hf_name(m, i))]
        @test length(adapters) == 2 * 2 * 2  # A and B, two projections, two layers
        dir = mktempdir()
        save_lora(m, dir; base_model="tiny")
        @test isfile(joinpath(dir, "adapter_config.json"))
        Model(; hf_config=QWEN3, devices=:cpu, num_devices=2,
              lora=Lora(; rank=4, alpha=8.0, target_modules="down_proj,q_proj")) do other
            load_lora!(other, dir)
            @test [param_master(other, i) for i in adapters] == [param_master(m, i) for i in adapters]
        end
        Model(; hf_config=QWEN3, devices=:cpu, lora=Lora(; rank=4, alpha=8.0)) do other
            e = try load_lora!(other, dir); nothing catch err; err end
            @test e isa RoundPipeError && e.status == L.RP_ERR_INVALID_ARGUMENT
        end
    end
    Model(; hf_config=QWEN3, devices=:cpu) do m
        @test lora(m) === nothing
    end
    @test_throws RoundPipeError Model(Example.SPEC; devices=:cpu, lora=Lora(; rank=4, alpha=8.0))
    @test_throws RoundPipeError Lora(; rank=4, alpha=8.0, target_modules="lm_head") |>
                                (l -> Model(; hf_config=QWEN3, devices=:cpu, lora=l))
end

@testset "split_microbatches: the engine's rule, tensor_split sizes" begin
    a = Float32.(reshape(0:9, 2, 5))  # the C tensor [5, 2]: 5 rows
    @test split_microbatches(a, 2) == [a[:, 1:3], a[:, 4:5]]  # 3 rows, then 2
    @test split_microbatches(a, 2; dim=1) == [a[1:1, :], a[2:2, :]]  # strided pieces, copied
    @test split_microbatches(a, 3; dim=:replicate) == [a, a, a]
    @test split_microbatches(fill(2.5f0), 2) == [fill(2.5f0), fill(2.5f0)]  # 0-d: replicated
    @test_throws RoundPipeError split_microbatches(a, 6)  # fewer rows than microbatches
    @test_throws RoundPipeError split_microbatches(a, 2; dim=2)  # no such dimension
end

@testset "every handle type has the do-block form" begin
    @test Optimizer(o -> o.kind, :sgd; lr=0.1) == :sgd
    @test Loss(l -> l.ptr != C_NULL, :mse) == true
    kept = Loss(identity, :mse)  # the block's value is returned; the handle is closed
    @test kept.ptr == C_NULL
    @test RunConfig(num_microbatch; num_microbatch=3) == 3
end

include("caller_layers.jl")

@testset "close is idempotent and closed handles are refused" begin
    m = Model("""{"layers":[{"type":"linear","in":4,"out":2}]}"""; devices=:cpu)
    close(m)
    close(m)
    @test m.ptr == C_NULL
    @test_throws RoundPipeError num_layers(m)
    o = Optimizer(:adamw)
    close(o); close(o)
    l = Loss(:mse)
    close(l); close(l)
    c = RunConfig(; num_microbatch=2)
    close(c); close(c)
end

end # testset
