# Model: options, construction (JSON spec or Hugging Face), queries, weights on disk.

"""
    Model(spec_json; seed=0, devices=:auto, num_devices=0, num_microbatch=nothing,
          run_config=nothing, model_dtype=nothing, optim_dtype=nothing, pin=nothing,
          name=nothing, stage_plan=nothing, host_memory=nothing, data_parallel=nothing,
          lora=nothing)
    Model(; hf_config=json_text, options...)
    Model(; hf_dir=path, options...)

Build a model from a JSON spec (`{"layers": [...]}`, see docs/semantics.md), or a Hugging Face
Qwen3ForCausalLM / Qwen3MoeForCausalLM / LlamaForCausalLM: from the text of its config.json (weights initialised
from the seed as transformers does) or from a model directory (config.json and weights).
`devices` is `:auto`, `:cpu` or `:cuda`; `num_microbatch` is a shortcut for a model-level
`RunConfig`; `model_dtype` / `optim_dtype` are `:f32`, `:bf16` or `:f16`; `pin` is `:alloc`,
`:register` or `:off`; `stage_plan` a list of layers per stage (else the planner decides).

`host_memory` is `:standard` (the default: 24 bytes of host state per parameter for bf16 /
f16 models, 28 for f32 ones; asynchronous steps are one step stale) or `:saving` (12 bytes:
AdamW moments in bf16 with stochastic rounding, one gradient buffer, one weight copy; weights
are never stale); see `rp_host_memory_mode` in the header and `host_state_bytes`. In saving
mode the gradients of a bf16 / f16 model are bfloat16: `param_grad` widens them to Float32,
`with_param_grad` cannot view them.

`data_parallel` is a `DataParallel` (or `true`: `DataParallel()`, torchrun's environment):
this process trains as one rank of several, see `DataParallel` and `data_parallel(model)`.

`lora` is a `Lora` (Hugging Face models only): adapters on the decoder layers' projections,
every other parameter frozen; see `Lora`, `lora(model)`, `save_lora` and `load_lora!`.
"""
mutable struct Model <: Handle
    ptr::Ptr{L.rp_model}
    pending_steps::Vector{Any}  # step callbacks the optimizer thread may still run
    layers::Vector{Any}         # its caller-defined layers (LayerDef): their callbacks' user_data

    Model(p::Ptr{L.rp_model}) = _own!(new(p, Any[], Any[]))
end

# Destroying the model drained its optimizer thread and its device workers: no step or layer
# callback can run any more.
_closed!(m::Model) = (empty!(m.pending_steps); empty!(m.layers); nothing)

const _DEVICE_KINDS = (auto=L.RP_DEVICE_AUTO, cpu=L.RP_DEVICE_CPU, cuda=L.RP_DEVICE_CUDA)
const _FLOAT_TYPES = (f32=L.RP_DTYPE_F32, bf16=L.RP_DTYPE_BF16, f16=L.RP_DTYPE_F16)
const _PIN_MODES = (alloc=L.RP_PIN_ALLOC, register=L.RP_PIN_REGISTER, off=L.RP_PIN_OFF)
const _HOST_MEMORY_MODES = (standard=L.RP_HOST_MEMORY_STANDARD, saving=L.RP_HOST_MEMORY_SAVING)

"""
    DataParallel(; rank=-1, world_size=-1, rendezvous="env://", timeout=nothing, global_loss=false)

Data parallelism across processes (`Model(...; data_parallel=DataParallel(...))`,
docs/several-machines.md): this process is rank `rank` (-1: `ENV["RANK"]`) of `world_size`
(-1: `ENV["WORLD_SIZE"]`; 0: off), each running its own model on its share of every batch; the
ranks' gradients are averaged before every optimizer step. `rendezvous` is `"env://"`
(`MASTER_ADDR` and `MASTER_PORT`, as torchrun sets them) or `"tcp://host:port"` (rank 0 hosts
the store there). `timeout` (seconds; `nothing`: the engine's default, 10 minutes) is how long a
rank waits for the others, when the model is created (which blocks until every rank has joined)
and in every collective; before the first training call every rank takes rank 0's weights. A
rank that died or hung makes the others' calls throw `RoundPipeError` with `RP_ERR_IO` (CPU
devices and GPUs), then `RP_ERR_STATE` (create the model again on every rank).
`global_loss`: each training call returns the mean loss over the ranks. The values are checked
by `rp_model_options_set_data_parallel` when the model is made.
"""
struct DataParallel
    rank::Int32
    world_size::Int32
    rendezvous::String
    timeout::Union{Nothing,Float64}
    global_loss::Bool
end

DataParallel(; rank::Integer=-1, world_size::Integer=-1, rendezvous::AbstractString="env://",
             timeout::Union{Nothing,Real}=nothing, global_loss::Bool=false) =
    DataParallel(Int32(rank), Int32(world_size), String(rendezvous),
                 timeout === nothing ? nothing : Float64(timeout), global_loss)

function _set_data_parallel(opts, data_parallel)
    (data_parallel === nothing || data_parallel === false) && return nothing
    dp = data_parallel === true ? DataParallel() : data_parallel
    dp isa DataParallel || _invalid("data_parallel must be a DataParallel, true or nothing")
    timeout_ms = Int64(0) # the engine's default
    if dp.timeout !== nothing
        (isfinite(dp.timeout) && dp.timeout > 0) ||
            _invalid("data parallel timeout must be a positive number of seconds")
        timeout_ms = max(Int64(1), round(Int64, min(dp.timeout * 1000, 9.0e18)))
    end
    @check L.rp_model_options_set_data_parallel(opts, dp.rank, dp.world_size, dp.rendezvous,
                                                timeout_ms)
    @check L.rp_model_options_set_global_loss(opts, Int32(dp.global_loss))
    return nothing
end

"""
    Lora(; rank, alpha, dropout=0.0, target_modules=nothing)

LoRA adapters (PEFT's LoraConfig) on the decoder layers of a Hugging Face model
(`Model(; hf_config=..., lora=Lora(...))`): each target projection gains (alpha / rank) B A, A
uniform and B zero at creation, and every other parameter becomes frozen (held once in the model
dtype: no master, gradient or optimizer state). `target_modules` is comma-separated text of PEFT
module names among q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, or
"all-linear"; `nothing` means "q_proj,v_proj". Checked by `rp_model_options_set_lora`.
"""
struct Lora
    rank::Int32
    alpha::Float64
    dropout::Float64
    target_modules::Union{Nothing,String}
end

Lora(; rank::Integer, alpha::Real, dropout::Real=0.0, target_modules=nothing) =
    Lora(Int32(rank), Float64(alpha), Float64(dropout),
         target_modules === nothing ? nothing : String(target_modules))

function _set_lora(opts, lora)
    lora === nothing && return nothing
    lora isa Lora || _invalid("lora must be a Lora or nothing")
    targets = lora.target_modules === nothing ? C_NULL : lora.target_modules
    @check L.rp_model_options_set_lora(opts, lora.rank, lora.alpha, lora.dropout, targets)
    return nothing
end

"""
    _with_options(f; Model's keywords...) -> f(options::Ptr{rp_model_options})

Model options made from `Model`'s keywords, given to `f`, freed when `f` returns.
"""
function _with_options(f; seed::Integer=0, devices::Symbol=:auto, num_devices::Integer=0,
                       num_microbatch=nothing, run_config=nothing, model_dtype=nothing,
                       optim_dtype=nothing, pin=nothing, name=nothing, stage_plan=nothing,
                       host_memory=nothing, data_parallel=nothing, lora=nothing)
    _scoped(_create(L.rp_model_options, L.rp_model_options_create)) do opts
        @check L.rp_model_options_set_seed(opts, UInt64(seed))
        kind = _code(_DEVICE_KINDS, devices, "devices")
        @check L.rp_model_options_set_devices(opts, kind, Int32(num_devices))
        if num_microbatch !== nothing
            run_config === nothing || _invalid("give num_microbatch or run_config, not both")
            RunConfig(; num_microbatch=num_microbatch) do c  # the options keep a copy
                @check L.rp_model_options_set_run_config(opts, c.ptr)
            end
        elseif run_config !== nothing
            @check L.rp_model_options_set_run_config(opts, _cfg(run_config))
        end
        model_dtype === nothing || @check L.rp_model_options_set_model_dtype(opts,
            _code(_FLOAT_TYPES, model_dtype, "dtype"))
        optim_dtype === nothing || @check L.rp_model_options_set_optim_dtype(opts,
            _code(_FLOAT_TYPES, optim_dtype, "dtype"))
        pin === nothing ||
            @check L.rp_model_options_set_pin_mode(opts, _code(_PIN_MODES, pin, "pin"))
        host_memory === nothing || @check L.rp_model_options_set_host_memory_mode(opts,
            _code(_HOST_MEMORY_MODES, host_memory, "host_memory"))
        name === nothing || @check L.rp_model_options_set_name(opts, String(name))
        if stage_plan !== nothing
            plan = Int32[stage_plan...]
            @check L.rp_model_options_set_stage_plan(opts, plan, Csize_t(length(plan)))
        end
        _set_data_parallel(opts, data_parallel)
        _set_lora(opts, lora)
        return f(opts)
    end
end

function Model(spec::AbstractString; options...)
    _ensure_abi()
    p = _with_options(; options...) do opts
        _create(L.rp_model, L.rp_model_create, String(spec), opts)
    end
    return Model(p)
end

function Model(; hf_config=nothing, hf_dir=nothing, options...)
    _ensure_abi()
    (hf_config === nothing) == (hf_dir === nothing) &&
        _invalid("give a JSON spec, or one of hf_config and hf_dir")
    p = _with_options(; options...) do opts
        if hf_dir === nothing
            _create(L.rp_model, L.rp_model_create_from_hf_config, String(hf_config), opts)
        else
            _create(L.rp_model, L.rp_model_create_from_hf, String(hf_dir), opts)
        end
    end
    return Model(p)
end

for (fname, cfn, T) in ((:num_layers, :rp_model_num_layers, Int32),
                        (:num_stages, :rp_model_num_stages, Int32),
                        (:num_devices, :rp_model_num_devices, Int32),
                        (:step_count, :rp_model_step_count, Int64))
    @eval function $fname(m::Model)
        n = Ref{$T}(0)
        @check L.$cfn(n, _ptr(m))
        return Int(n[])
    end
end

"""
    stage_plan(model) -> Vector{Int}

The current stage plan, as the engine decided it (the `stage_plan` option, else the planner;
on GPUs, re-planned from measured times by the third training call): stage `s` holds the next
`stage_plan(model)[s]` layers of the layer list, so the counts add up to `num_layers(model)`.
"""
stage_plan(m::Model) = _read_plan(L.rp_model_stage_plan, m)

"""
    backward_stage_plan(model) -> Vector{Int}

The backward stage plan in force: the one `set_backward_stage_plan!` set, else the forward
stages of `stage_plan(model)`.
"""
backward_stage_plan(m::Model) = _read_plan(L.rp_model_backward_stage_plan, m)

"""
    plan_stages(model; max_stage_bytes=0, min_stages=0) -> Vector{Int}

A stage plan the engine's planner makes for the model's layers without changing the model
(apply it with `set_stage_plan!`): each stage's weights and gradients (model dtype, plus
workspaces) at most `max_stage_bytes` (0: no limit), at least `min_stages` stages (at most one
per layer). A layer alone over the limit throws, naming it.
"""
function plan_stages(m::Model; max_stage_bytes::Integer=0, min_stages::Integer=0)
    plan = zeros(Int32, max(1, num_layers(m)))
    n = Ref{Int32}(0)
    @check L.rp_model_plan_stages(plan, n, Int32(length(plan)), _ptr(m),
                                  Int64(max_stage_bytes), Int32(min_stages))
    return Int.(plan[1:n[]])
end

# rp_model_stage_plan / rp_model_backward_stage_plan: ask for the count, then the plan.
function _read_plan(query, m::Model)
    n = Ref{Int32}(0)
    @check query(Ptr{Int32}(C_NULL), n, Int32(0), _ptr(m))
    plan = zeros(Int32, n[])
    @check query(plan, n, Int32(length(plan)), _ptr(m))
    return Int.(plan)
end

"Replace the stage plan (layers per stage; empty: the automatic planner). A backward stage plan
set before is dropped."
set_stage_plan!(m::Model, layers_per_stage::AbstractVector{<:Integer}) =
    _write_plan(L.rp_model_set_stage_plan, m, layers_per_stage)

"""
    set_backward_stage_plan!(model, layers_per_stage)

Backward stages that differ from the forward ones (upstream's asymmetric execute plans):
backward stage `b` holds the next `layers_per_stage[b]` layers from layer 0; empty: the forward
stages again. Needs an explicit forward plan (`set_stage_plan!`); a fused `forward_backward`
needs both plans to end with the same stage (the tail).
"""
set_backward_stage_plan!(m::Model, layers_per_stage::AbstractVector{<:Integer}) =
    _write_plan(L.rp_model_set_backward_stage_plan, m, layers_per_stage)

function _write_plan(set, m::Model, layers_per_stage)
    plan = Int32[c for c in layers_per_stage]
    GC.@preserve plan begin
        @check set(_ptr(m), isempty(plan) ? Ptr{Int32}(C_NULL) : pointer(plan),
                   Csize_t(length(plan)))
    end
    return m
end

"""
    resolve_run_config(model, config=nothing) -> RunConfig

The configuration a call given `config` would run with: the model's configuration overlaid by
`config` field by field, every field still unset filled in with the built-in default
(`num_microbatch` `num_devices(model) + 1`, `recompute_grain` `:stage`, `output_device` `:cpu`,
`merge_output` true). Read it with `num_microbatch` and the other getters; it is a new handle:
close it when done.
"""
resolve_run_config(m::Model, config::Union{Nothing,RunConfig}=nothing) =
    RunConfig(_create(L.rp_run_config, L.rp_model_resolve_run_config, _ptr(m), _cfg(config)))

"""
    host_state_bytes(model) -> (bytes=..., elements=..., bytes_per_param=...)

Host memory held by the model's parameter state (master weights, weight copies the devices
read, gradient buffers, built-in optimizer state once a built-in step has run), in tensor
bytes, and the number of parameter elements (tied parameters once). After a built-in AdamW
step a bf16 model holds 24 bytes per parameter with `host_memory=:standard` and 12 with
`:saving` (28 and 12 for f32 models).
"""
function host_state_bytes(m::Model)
    b, n = Ref{Int64}(0), Ref{Int64}(0)
    @check L.rp_model_host_state_bytes(b, n, _ptr(m))
    return (bytes=Int(b[]), elements=Int(n[]),
            bytes_per_param=n[] == 0 ? 0.0 : b[] / n[])
end

"""
    data_parallel(model) -> (rank=..., world_size=...)

This process's data-parallel rank and the number of ranks, as the engine joined
(`rp_model_data_parallel`; `(rank=0, world_size=1)` without data parallelism).
"""
function data_parallel(m::Model)
    rank, world_size = Ref{Int32}(0), Ref{Int32}(0)
    @check L.rp_model_data_parallel(rank, world_size, _ptr(m))
    return (rank=Int(rank[]), world_size=Int(world_size[]))
end

"Whether the loaded library can do data parallelism (built with c10d's Gloo support)."
function data_parallel_available()
    available = Ref{Int32}(0)
    @check L.rp_data_parallel_available(available)
    return available[] != 0
end

"
Timing record of the model's last `forward` / `forward_backward` as Chrome trace JSON (open it in
Perfetto): one process per device, one thread per stream, transfers with the bytes they moved.
"
function trace_json(m::Model)
    out = Ref{Cstring}(C_NULL)
    @check L.rp_model_trace_json(out, _ptr(m))
    return unsafe_string(out[])
end

"Training calls whose loss was inf or nan, and steps skipped for inf or nan gradients."
function nonfinite_counts(m::Model)
    losses, skipped = Ref{Int64}(0), Ref{Int64}(0)
    @check L.rp_model_nonfinite_counts(losses, skipped, _ptr(m))
    return (nonfinite_losses=Int(losses[]), skipped_steps=Int(skipped[]))
end

"""
    set_grad_scaler!(m, initial_scale, growth_interval=2000)

Switch dynamic loss scaling on (`initial_scale` > 0, a fresh schedule) or off (0) on a live
model; steps already queued finish first with the old setting.
"""
function set_grad_scaler!(m::Model, initial_scale::Real, growth_interval::Integer=2000)
    @check L.rp_model_set_grad_scaler(_ptr(m), Float64(initial_scale), Int32(growth_interval))
    return m
end

"Skip (true) or run (false) steps whose gradients hold inf or nan, from the next step on."
function set_skip_nonfinite_steps!(m::Model, skip::Bool)
    @check L.rp_model_set_skip_nonfinite_steps(_ptr(m), Int32(skip))
    return m
end

# A call taking the model and a path. It synchronizes first, so step callbacks may run on the
# optimizer thread meanwhile: the call runs GC-safe.
function _path_call(cfn, m::Model, path::AbstractString)
    mp, s = _ptr(m), Base.cconvert(Cstring, String(path))
    cs = Base.unsafe_convert(Cstring, s)  # throws here, not in the GC-safe call, on a NUL byte
    st = GC.@preserve s _gcsafe(() -> cfn(mp, cs))
    @check st
    return m
end

"Save the latest weights to a safetensors file (synchronizes first)."
save(m::Model, path::AbstractString) = _path_call(L.rp_model_save, m, path)

"Load every parameter from a safetensors file (synchronizes first)."
load!(m::Model, path::AbstractString) = _path_call(L.rp_model_load, m, path)

"Save the latest weights as a Hugging Face directory transformers loads (a Hugging Face model)."
save_hf(m::Model, dir::AbstractString) = _path_call(L.rp_model_save_hf, m, dir)

"Load the weights of a Hugging Face directory into a model built from a Hugging Face config."
load_hf!(m::Model, dir::AbstractString) = _path_call(L.rp_model_load_hf, m, dir)

"""
    lora(model) -> Lora or nothing

The model's LoRA configuration as the engine holds it (`rp_model_lora`; `target_modules` in
layer order), `nothing` for a model without adapters. The adapters are its trainable parameters.
"""
function lora(m::Model)
    rank, alpha, dropout = Ref{Int32}(0), Ref{Float64}(0), Ref{Float64}(0)
    targets = Ref{Cstring}(C_NULL)
    @check L.rp_model_lora(rank, alpha, dropout, targets, _ptr(m))
    rank[] == 0 && return nothing
    return Lora(rank[], alpha[], dropout[], unsafe_string(targets[]))
end

"""
    save_lora(model, dir; base_model=nothing)

Save the adapters in PEFT's format (adapter_config.json and adapter_model.safetensors, which
PEFT's `PeftModel.from_pretrained` loads); synchronizes first.
"""
function save_lora(m::Model, dir::AbstractString; base_model=nothing)
    base = base_model === nothing ? C_NULL : String(base_model)
    # checked here: the call below runs GC-safe, where nothing may throw
    base isa String && occursin('\0', base) && _invalid("base_model contains a NUL byte")
    _path_call((mp, cs) -> L.rp_model_save_lora(mp, cs, base), m, dir)
end

"Load adapters saved by `save_lora` or by PEFT (they must match the model's LoRA)."
load_lora!(m::Model, dir::AbstractString) = _path_call(L.rp_model_load_lora, m, dir)
