"""
    RoundPipe

Julia interface of RoundPipe: train models larger than GPU memory with a round-robin pipeline of
layer stages, fused forward + backward and an asynchronous CPU optimizer.

```julia
using RoundPipe
model = Model(spec_json; seed=42, devices=:cpu, num_devices=2, num_microbatch=3)
loss = Loss(:mse; scale=1/3)
opt = Optimizer(:adamw; lr=1e-2)
for step in 1:20
    l = forward_backward(model, X; labels=Y, loss=loss)
    step!(model, opt)
end
synchronize!(model)
close(model)
```

Arrays cross the C API as DLPack, without copies on the way in. Julia is column-major and the
library row-major, so the library sees an array's dimensions in reverse: a Julia
`Matrix{Float32}` of size `(features, batch)` is the C tensor `[batch, features]`. Outputs come
back the same way (a C `[batch, 1]` output is a Julia `(1, batch)` array).

Handles (`Model`, `RunConfig`, `Loss`, `Optimizer`) own their C object: `close` frees it
(idempotent), a finalizer does it otherwise, and each has a do-block form that closes at the end.
Failed calls throw `RoundPipeError` with the library's status and message.

What the engine decided is asked, not re-derived: `stage_plan(model)`,
`resolve_run_config(model, config)`, `param_hf_name(model, i)`, `split_microbatches(a, n)`.
"""
module RoundPipe

include("LibRoundPipe.jl")
using .LibRoundPipe
const L = LibRoundPipe

export Model, RunConfig, Loss, Optimizer, RoundPipeError, StepContext
export forward, forward_backward, step!, synchronize!, zero_grad!, adam_apply!
export num_layers, num_stages, num_devices, step_count, host_state_bytes, trace_json
export nonfinite_counts, set_grad_scaler!, set_skip_nonfinite_steps!
export set_step_in_call!, step_in_call
export DataParallel, data_parallel, data_parallel_available
export stage_plan, set_stage_plan!, backward_stage_plan, set_backward_stage_plan!, plan_stages
export resolve_run_config, split_microbatches
export num_microbatch, recompute_grain, output_device, merge_output
export param_count, param_name, param_names, param_find, param_shape, param_hf_name
export param_master, param_grad, with_param_master, with_param_grad
export save, load!, save_hf, load_hf!, Lora, lora, save_lora, load_lora!, set_log_callback, reset_log_callback
export LayerDef, LayerCall, add_param!, add_buffer!, set_cost!, set_activation_bytes!, layer_params, layer_buffers
export with_buffer, param_kind

# The layers of the package, each on the ones above it:
include("errors.jl")      # RoundPipeError, @check, the ABI check, GC-safe calls
include("handles.jl")     # the handle table: one close, finalizer and do-block for every handle
include("dlpack.jl")      # Julia arrays in and out as DLPack; split_microbatches
include("run_config.jl")  # RunConfig and its getters
include("optimizer.jl")   # Optimizer
include("loss.jl")        # Loss
include("model.jl")       # Model: options, construction, queries, weights on disk
include("params.jl")      # StepContext and parameter access
include("layers.jl")      # caller-defined layers: LayerDef, LayerCall, Model(spec, layers)
include("callbacks.jl")   # code the library calls on its threads: loss, step, log, layers
include("training.jl")    # forward, forward_backward, step!, synchronize!, zero_grad!

__init__() = _init_callbacks()

end # module RoundPipe
