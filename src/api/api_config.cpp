// Option objects: run configuration, model options, losses, optimizer settings.
#include <cmath>

#include "api/api_guard.h"
#include "api/dlpack_bridge.h"
#include "api/handles.h"

using namespace rp;

namespace {

template <typename T> rp_status create_handle(T **out) {
    return guard([&] {
        require_arg(out, "output pointer is NULL");
        *out = new T();
    });
}

std::optional<at::ScalarType> dtype_of(int32_t dtype) {
    switch (dtype) {
    case RP_DTYPE_F32:
        return at::kFloat;
    case RP_DTYPE_BF16:
        return at::kBFloat16;
    case RP_DTYPE_F16:
        return at::kHalf;
    default:
        return std::nullopt;
    }
}

void require_finite(double x, double lo, const char *what) {
    if (!std::isfinite(x) || x < lo)
        fail(ErrorKind::InvalidArgument,
             std::string(what) + " must be finite and >= " + std::to_string(lo) + ", got " +
                 std::to_string(x));
}

// Adapts a C split callback to the engine's SplitFn.
SplitFn wrap_split(rp_split_fn fn, void *user_data) {
    return [fn, user_data](const std::vector<at::Tensor> &inputs, int n) {
        std::vector<DLManagedTensor *> in;
        for (const at::Tensor &t : inputs)
            in.push_back(export_dlpack(t));
        std::vector<DLManagedTensor *> pieces(static_cast<size_t>(n) * inputs.size(), nullptr);
        int32_t rc = fn(pieces.data(), in.data(), in.size(), n, user_data);
        for (DLManagedTensor *t : in)
            t->deleter(t);
        std::vector<std::vector<at::Tensor>> out(n);
        std::string error;
        for (int m = 0; m < n; ++m)
            for (size_t i = 0; i < inputs.size(); ++i) {
                DLManagedTensor *p = pieces[m * inputs.size() + i];
                if (rc != 0 || !error.empty()) {
                    if (p && p->deleter)
                        p->deleter(p); // RoundPipe owns the pieces even when the callback fails
                    continue;
                }
                try {
                    out[m].push_back(adopt_dlpack(p, "split callback piece (microbatch " +
                                                         std::to_string(m) + ", input " +
                                                         std::to_string(i) + ")"));
                } catch (const Error &e) {
                    error = e.what();
                }
            }
        if (rc != 0)
            fail(ErrorKind::Callback, "split callback returned " + std::to_string(rc));
        if (!error.empty())
            fail(ErrorKind::Callback, error);
        return out;
    };
}

} // namespace

extern "C" {

rp_status rp_run_config_create(rp_run_config **out_config) { return create_handle(out_config); }

void rp_run_config_destroy(rp_run_config *config) { delete config; }

rp_status rp_run_config_set_num_microbatch(rp_run_config *config, int32_t n) {
    return guard([&] {
        require_arg(config, "config is NULL");
        require(n >= 0 && n <= 65536,
                "num_microbatch must be between 1 and 65536 (0 unsets), got " + std::to_string(n));
        config->config.num_microbatch = n == 0 ? std::nullopt : std::optional<int>(n);
    });
}

rp_status rp_run_config_set_recompute_grain(rp_run_config *config, int32_t grain) {
    return guard([&] {
        require_arg(config, "config is NULL");
        require(grain >= RP_GRAIN_DEFAULT && grain <= RP_GRAIN_LAYER,
                "recompute_grain must be RP_GRAIN_DEFAULT, RP_GRAIN_STAGE or RP_GRAIN_LAYER, got " +
                    std::to_string(grain));
        if (grain == RP_GRAIN_DEFAULT)
            config->config.grain.reset();
        else
            config->config.grain =
                grain == RP_GRAIN_STAGE ? RecomputeGrain::Stage : RecomputeGrain::Layer;
    });
}

rp_status rp_run_config_set_output_device(rp_run_config *config, int32_t device_type,
                                          int32_t device_id) {
    return guard([&] {
        require_arg(config, "config is NULL");
        require(device_type == kDLCPU || device_type == kDLCUDA,
                "output device type must be kDLCPU (1) or kDLCUDA (2), got " +
                    std::to_string(device_type));
        require(device_type == kDLCPU || (device_id >= 0 && device_id < 1024),
                "output GPU index must be >= 0, got " + std::to_string(device_id));
        config->config.output_device =
            device_type == kDLCPU
                ? at::Device(at::kCPU)
                : at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device_id));
    });
}

rp_status rp_run_config_set_input_split_dim(rp_run_config *config, int32_t input_index,
                                            int32_t dim) {
    return guard([&] {
        require_arg(config, "config is NULL");
        require(input_index >= 0 && input_index < 64,
                "input_index must be in 0..63, got " + std::to_string(input_index));
        require(dim >= RP_SPLIT_REPLICATE && dim < 16,
                "split dim must be RP_SPLIT_REPLICATE (-1) or 0..15, got " + std::to_string(dim));
        config->config.input_split_dims[input_index] = dim;
    });
}

rp_status rp_run_config_set_label_split_dim(rp_run_config *config, int32_t dim) {
    return guard([&] {
        require_arg(config, "config is NULL");
        require(dim >= RP_SPLIT_REPLICATE && dim < 16,
                "split dim must be RP_SPLIT_REPLICATE (-1) or 0..15, got " + std::to_string(dim));
        config->config.label_split_dim = dim;
    });
}

rp_status rp_run_config_set_split_callback(rp_run_config *config, rp_split_fn fn,
                                           void *user_data) {
    return guard([&] {
        require_arg(config, "config is NULL");
        config->config.split = fn ? wrap_split(fn, user_data) : SplitFn();
    });
}

rp_status rp_run_config_set_merge_output(rp_run_config *config, int32_t merge) {
    return guard([&] {
        require_arg(config, "config is NULL");
        require(merge >= -1 && merge <= 1,
                "merge_output must be 1, 0 or -1 (unset), got " + std::to_string(merge));
        config->config.merge_output = merge == -1 ? std::nullopt : std::optional<bool>(merge == 1);
    });
}

rp_status rp_run_config_get_num_microbatch(int32_t *out_num_microbatch,
                                           const rp_run_config *config) {
    return guard([&] {
        require_arg(out_num_microbatch && config, "output pointer or config is NULL");
        *out_num_microbatch = config->config.num_microbatch.value_or(0);
    });
}

rp_status rp_run_config_get_recompute_grain(int32_t *out_grain, const rp_run_config *config) {
    return guard([&] {
        require_arg(out_grain && config, "output pointer or config is NULL");
        const auto &g = config->config.grain;
        *out_grain = !g ? RP_GRAIN_DEFAULT
                        : (*g == RecomputeGrain::Stage ? RP_GRAIN_STAGE : RP_GRAIN_LAYER);
    });
}

rp_status rp_run_config_get_output_device(int32_t *out_device_type, int32_t *out_device_id,
                                          const rp_run_config *config) {
    return guard([&] {
        require_arg(out_device_type && out_device_id && config,
                    "output pointer or config is NULL");
        const auto &d = config->config.output_device;
        *out_device_type = !d ? 0 : (d->is_cuda() ? kDLCUDA : kDLCPU);
        *out_device_id = d && d->is_cuda() ? d->index() : 0;
    });
}

rp_status rp_run_config_get_merge_output(int32_t *out_merge, const rp_run_config *config) {
    return guard([&] {
        require_arg(out_merge && config, "output pointer or config is NULL");
        const auto &m = config->config.merge_output;
        *out_merge = !m ? -1 : (*m ? 1 : 0);
    });
}

rp_status rp_split_microbatches(rp_tensor_list **out_pieces, const DLManagedTensor *tensor,
                                int32_t dim, int32_t num_microbatch) {
    return guard([&] {
        require_arg(out_pieces, "out_pieces is NULL");
        require(num_microbatch >= 1 && num_microbatch <= 65536,
                "num_microbatch must be between 1 and 65536, got " +
                    std::to_string(num_microbatch));
        require(dim >= RP_SPLIT_REPLICATE,
                "split dim must be RP_SPLIT_REPLICATE (-1) or >= 0, got " + std::to_string(dim));
        at::Tensor t = borrow_dlpack(tensor, "tensor", visible_cuda_devices(), /*any_dtype=*/true);
        auto list = std::make_unique<rp_tensor_list>();
        list->tensors = split_tensor(t, dim, num_microbatch, "tensor");
        *out_pieces = list.release();
    });
}

rp_status rp_model_options_create(rp_model_options **out_options) {
    return create_handle(out_options);
}

void rp_model_options_destroy(rp_model_options *options) { delete options; }

rp_status rp_model_options_set_model_dtype(rp_model_options *options, int32_t dtype) {
    return guard([&] {
        require_arg(options, "options is NULL");
        if (dtype == RP_DTYPE_DEFAULT) {
            options->options.model_dtype = at::kFloat;
            return;
        }
        auto t = dtype_of(dtype);
        require(t.has_value(), "model dtype must be RP_DTYPE_F32, RP_DTYPE_BF16 or RP_DTYPE_F16, "
                               "got " + std::to_string(dtype));
        options->options.model_dtype = *t;
    });
}

rp_status rp_model_options_set_optim_dtype(rp_model_options *options, int32_t dtype) {
    return guard([&] {
        require_arg(options, "options is NULL");
        require(dtype == RP_DTYPE_DEFAULT || dtype == RP_DTYPE_F32,
                "optimizer dtype " + std::to_string(dtype) +
                    " is not supported yet: master weights and optimizer state are float32 "
                    "(RP_DTYPE_F32)");
    });
}

rp_status rp_model_options_set_host_memory_mode(rp_model_options *options, int32_t mode) {
    return guard([&] {
        require_arg(options, "options is NULL");
        require(mode == RP_HOST_MEMORY_STANDARD || mode == RP_HOST_MEMORY_SAVING,
                "host memory mode must be RP_HOST_MEMORY_STANDARD (0) or RP_HOST_MEMORY_SAVING "
                "(1), got " + std::to_string(mode));
        options->options.host_memory_mode = mode == RP_HOST_MEMORY_SAVING
                                                ? HostMemoryMode::Saving
                                                : HostMemoryMode::Standard;
    });
}

rp_status rp_model_options_set_pin_mode(rp_model_options *options, int32_t pin_mode) {
    return guard([&] {
        require_arg(options, "options is NULL");
        require(pin_mode >= RP_PIN_ALLOC && pin_mode <= RP_PIN_OFF,
                "pin mode must be RP_PIN_ALLOC, RP_PIN_REGISTER or RP_PIN_OFF, got " +
                    std::to_string(pin_mode));
        options->options.pin_mode = static_cast<PinMode>(pin_mode);
    });
}

rp_status rp_model_options_set_run_config(rp_model_options *options,
                                          const rp_run_config *config) {
    return guard([&] {
        require_arg(options, "options is NULL");
        options->options.run_config = config ? config->config : RunConfig();
    });
}

rp_status rp_model_options_set_gpu_memory_cap(rp_model_options *options, int64_t bytes) {
    return guard([&] {
        require_arg(options, "options is NULL");
        require(bytes >= 0, "GPU memory cap must be >= 0 (0: default), got " +
                                std::to_string(bytes));
        options->options.gpu_memory_cap = bytes;
    });
}

rp_status rp_model_options_set_grad_scaler(rp_model_options *options, double initial_scale,
                                           int32_t growth_interval) {
    return guard([&] {
        require_arg(options, "options is NULL");
        require(std::isfinite(initial_scale) && initial_scale >= 0,
                "initial loss scale must be finite and >= 0 (0: off), got " +
                    std::to_string(initial_scale));
        require(growth_interval >= 1,
                "growth_interval must be >= 1, got " + std::to_string(growth_interval));
        options->options.grad_scale = initial_scale;
        options->options.grad_scale_growth_interval = growth_interval;
    });
}

rp_status rp_model_options_set_skip_nonfinite_steps(rp_model_options *options, int32_t skip) {
    return guard([&] {
        require_arg(options, "options is NULL");
        require(skip == 0 || skip == 1,
                "skip_nonfinite_steps must be 0 or 1, got " + std::to_string(skip));
        options->options.skip_nonfinite_steps = skip == 1;
    });
}

rp_status rp_model_options_set_seed(rp_model_options *options, uint64_t seed) {
    return guard([&] {
        require_arg(options, "options is NULL");
        options->options.seed = seed;
    });
}

rp_status rp_model_options_set_name(rp_model_options *options, const char *name) {
    return guard([&] {
        require_arg(options, "options is NULL");
        require_arg(name, "name is NULL");
        options->options.name = name;
    });
}

rp_status rp_model_options_set_data_parallel(rp_model_options *options, int32_t rank,
                                             int32_t world_size, const char *rendezvous,
                                             int64_t timeout_ms) {
    return guard([&] {
        require_arg(options, "options is NULL");
        require(world_size >= -1, "world_size must be >= 1, -1 ($WORLD_SIZE) or 0 (off), not " +
                                      std::to_string(world_size));
        require(rank >= -1 && (world_size <= 0 || rank < world_size),
                "rank " + std::to_string(rank) + " is not -1 ($RANK) or in 0 .. world_size - 1");
        require(timeout_ms >= 0, "timeout_ms must be >= 0 (0: the default)");
        rp::DataParallelOptions &dp = options->options.data_parallel;
        dp.world_size = world_size;
        dp.rank = rank;
        dp.rendezvous = rendezvous ? rendezvous : "env://";
        dp.timeout_ms = timeout_ms > 0 ? timeout_ms : rp::DataParallelOptions{}.timeout_ms;
    });
}

rp_status rp_model_options_set_global_loss(rp_model_options *options, int32_t global) {
    return guard([&] {
        require_arg(options, "options is NULL");
        require(global == 0 || global == 1, "global must be 0 or 1");
        options->options.data_parallel.global_loss = global == 1;
    });
}

rp_status rp_model_options_set_lora(rp_model_options *options, int32_t rank, double alpha,
                                    double dropout, const char *target_modules) {
    return guard([&] {
        require_arg(options, "options is NULL");
        require(rank >= 0, "LoRA rank must be >= 0 (0: no adapters), got " +
                               std::to_string(rank));
        if (rank == 0) {
            options->lora = LoraSpec();
            return;
        }
        LoraSpec lora;
        lora.rank = rank;
        lora.alpha = alpha;
        lora.dropout = dropout;
        lora.targets = parse_lora_targets(target_modules);
        check_lora_spec(lora);
        options->lora = lora; // only once every value is good
    });
}

rp_status rp_data_parallel_available(int32_t *out_available) {
    return guard([&] {
        require_arg(out_available, "out_available is NULL");
        *out_available = rp::data_parallel_available() ? 1 : 0;
    });
}

rp_status rp_model_options_set_devices(rp_model_options *options, int32_t kind,
                                       int32_t num_devices) {
    return guard([&] {
        require_arg(options, "options is NULL");
        require(kind >= RP_DEVICE_AUTO && kind <= RP_DEVICE_CUDA,
                "device kind must be RP_DEVICE_AUTO, RP_DEVICE_CPU or RP_DEVICE_CUDA, got " +
                    std::to_string(kind));
        require(num_devices >= 0 && num_devices <= 64,
                "num_devices must be in 0..64, got " + std::to_string(num_devices));
        options->options.device_kind = static_cast<DeviceKind>(kind);
        options->options.num_devices = num_devices;
    });
}

rp_status rp_model_options_set_stage_plan(rp_model_options *options,
                                          const int32_t *layers_per_stage, size_t n) {
    return guard([&] {
        require_arg(options, "options is NULL");
        require_arg(n == 0 || layers_per_stage, "layers_per_stage is NULL but n > 0");
        std::vector<int> plan;
        for (size_t i = 0; i < n; ++i) {
            require(layers_per_stage[i] > 0, "stage plan: stage " + std::to_string(i) + " has " +
                                                 std::to_string(layers_per_stage[i]) +
                                                 " layers; each needs at least one");
            plan.push_back(layers_per_stage[i]);
        }
        options->options.stage_plan = std::move(plan);
    });
}

rp_status rp_loss_create(rp_loss **out_loss, int32_t kind) {
    return guard([&] {
        require_arg(out_loss, "out_loss is NULL");
        require(kind >= RP_LOSS_OUTPUT && kind <= RP_LOSS_CAUSAL_LM,
                "loss kind must be RP_LOSS_OUTPUT, RP_LOSS_MSE, RP_LOSS_CROSS_ENTROPY or "
                "RP_LOSS_CAUSAL_LM, got " + std::to_string(kind));
        auto loss = std::make_unique<rp_loss>();
        switch (kind) {
        case RP_LOSS_OUTPUT:
            loss->kind = LossKind::Output;
            break;
        case RP_LOSS_MSE:
            loss->kind = LossKind::Mse;
            break;
        case RP_LOSS_CROSS_ENTROPY:
            loss->kind = LossKind::CrossEntropy;
            break;
        default:
            loss->kind = LossKind::CausalLm;
            break;
        }
        *out_loss = loss.release();
    });
}

rp_status rp_loss_create_callback(rp_loss **out_loss, rp_loss_fn fn, void *user_data) {
    return guard([&] {
        require_arg(out_loss, "out_loss is NULL");
        require_arg(fn, "loss callback is NULL");
        auto loss = std::make_unique<rp_loss>();
        loss->kind = LossKind::Callback;
        loss->fn = fn;
        loss->user_data = user_data;
        *out_loss = loss.release();
    });
}

rp_status rp_loss_create_device_callback(rp_loss **out_loss, rp_device_loss_fn fn,
                                         void *user_data) {
    return guard([&] {
        require_arg(out_loss, "out_loss is NULL");
        require_arg(fn, "loss callback is NULL");
        auto loss = std::make_unique<rp_loss>();
        loss->kind = LossKind::DeviceCallback;
        loss->device_fn = fn;
        loss->user_data = user_data;
        *out_loss = loss.release();
    });
}

rp_status rp_loss_set_scale(rp_loss *loss, double scale) {
    return guard([&] {
        require_arg(loss, "loss is NULL");
        require(std::isfinite(scale), "loss scale must be finite");
        loss->scale = scale;
    });
}

void rp_loss_destroy(rp_loss *loss) { delete loss; }

rp_status rp_optimizer_create(rp_optimizer **out_optimizer, int32_t kind) {
    return guard([&] {
        require_arg(out_optimizer, "out_optimizer is NULL");
        require(kind == RP_OPTIMIZER_ADAMW || kind == RP_OPTIMIZER_SGD,
                "optimizer kind must be RP_OPTIMIZER_ADAMW or RP_OPTIMIZER_SGD, got " +
                    std::to_string(kind));
        auto opt = std::make_unique<rp_optimizer>();
        if (kind == RP_OPTIMIZER_SGD) {
            opt->settings.kind = OptimizerKind::Sgd;
            opt->settings.weight_decay = 0.0;
        }
        *out_optimizer = opt.release();
    });
}

void rp_optimizer_destroy(rp_optimizer *optimizer) { delete optimizer; }

rp_status rp_optimizer_set_learning_rate(rp_optimizer *optimizer, double lr) {
    return guard([&] {
        require_arg(optimizer, "optimizer is NULL");
        require_finite(lr, 0.0, "learning rate");
        optimizer->settings.lr = lr;
    });
}

rp_status rp_optimizer_set_betas(rp_optimizer *optimizer, double beta1, double beta2) {
    return guard([&] {
        require_arg(optimizer, "optimizer is NULL");
        require(optimizer->settings.kind == OptimizerKind::AdamW, "betas apply to AdamW only");
        require(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1,
                "betas must be in [0, 1), got (" + std::to_string(beta1) + ", " +
                    std::to_string(beta2) + ")");
        optimizer->settings.beta1 = beta1;
        optimizer->settings.beta2 = beta2;
    });
}

rp_status rp_optimizer_set_eps(rp_optimizer *optimizer, double eps) {
    return guard([&] {
        require_arg(optimizer, "optimizer is NULL");
        require(optimizer->settings.kind == OptimizerKind::AdamW, "eps applies to AdamW only");
        require(std::isfinite(eps) && eps > 0, "eps must be finite and > 0");
        optimizer->settings.eps = eps;
    });
}

rp_status rp_optimizer_set_weight_decay(rp_optimizer *optimizer, double weight_decay) {
    return guard([&] {
        require_arg(optimizer, "optimizer is NULL");
        require_finite(weight_decay, 0.0, "weight decay");
        optimizer->settings.weight_decay = weight_decay;
    });
}

rp_status rp_optimizer_set_momentum(rp_optimizer *optimizer, double momentum) {
    return guard([&] {
        require_arg(optimizer, "optimizer is NULL");
        require(optimizer->settings.kind == OptimizerKind::Sgd, "momentum applies to SGD only");
        require(momentum >= 0 && momentum < 1, "momentum must be in [0, 1)");
        optimizer->settings.momentum = momentum;
    });
}

} // extern "C"
