/*
 * roundpipe.h - the public C API of RoundPipe.
 *
 * RoundPipe trains models larger than GPU memory: parameters, fp32 master weights and optimizer
 * state live in host memory, layers are streamed to the devices a stage at a time in a
 * round-robin pipeline, forward and backward are fused, activations are recomputed in backward,
 * and the optimizer runs on a background thread.
 *
 * Conventions, for every function below:
 *   - Fallible calls return rp_status (RP_OK == 0, errors negative). On error,
 *     rp_last_error_message() on the same thread says what went wrong, nothing was changed, and
 *     out-parameters are left untouched.
 *   - Out-parameters come first. Pointers are borrowed for the duration of the call unless the
 *     comment says otherwise.
 *   - Tensors cross this API only as DLPack DLManagedTensor. Inputs are borrowed for the call;
 *     tensors returned to you are yours: call their `deleter` when done.
 *   - rp_*_destroy functions return nothing, accept NULL, and wait for work in flight first.
 *   - One model may be driven from one thread at a time; different models are independent. A
 *     call on a model that another thread is in a call on fails with RP_ERR_STATE ("busy") and
 *     changes nothing; step callbacks may use the model from the optimizer thread.
 *   - No C++ exception and no abort crosses this API.
 *
 * Environment variables the library reads (every one it reads is listed here):
 *   - RP_OPTIMIZER_THREADS=N: cap the threads of the CPU optimizer's parallel loops (AdamW, SGD,
 *     the overflow check) at N >= 1; unset or invalid, libtorch's intra-op thread count is used
 *     in memory-saving mode and half of it in standard mode (ranks sharing a host: an even share
 *     of the cores). Read when a model's optimizer thread starts.
 *   - RP_OPTIMIZER_BLOCKS=0: the optimizer's loops split each parameter into one equal share per
 *     thread instead of letting the threads take blocks of 65,536 elements from a shared
 *     counter (which keeps a thread that shares its core with the devices' workers from holding
 *     up the rest); results are bit for bit the same. Read once.
 *   - RP_DEFER_TABLE_ROWS=0: in-call steps (rp_model_set_step_in_call) update an embedding first
 *     layer's whole table at once instead of deferring the rows no token used (docs/semantics.md
 *     "Deferred table rows"); results are bit for bit the same. Read by rp_model_set_step_in_call.
 *   - RP_IN_CALL_ROW_GRADIENTS=0: in-call steps download an embedding's whole dense gradient
 *     instead of the rows its tokens used (docs/semantics.md); the sum is the same, its rounding
 *     may differ in the last bits. Read by rp_model_set_step_in_call.
 *   - RP_NEXT_CALL_WEIGHTS=0: a GPU call in the standard mode does not upload, during each
 *     device's last job, the weights the next call's first jobs there will read. Read once.
 *   - RP_PEER_HAND_OFFS=0: activations and gradients cross between GPUs through host memory
 *     instead of direct peer copies. Read when a model is created.
 *   - RP_UPLOAD_THREAD=0: each GPU's next weight upload is enqueued by its worker before the job
 *     at hand instead of by an uploader thread beside it. Read when a model is created.
 *   - RP_HOST_MEMORY_LIMIT_MB=N: host memory the library may plan for, when less than the
 *     machine's (docs/semantics.md "Host memory").
 *   - RP_LOG_LEVEL=debug|info|warn|error: the lowest level of log message the library emits, to
 *     any sink: it overrides the default sink's level (warn) and the `min_level` of
 *     rp_set_log_callback. Unset or invalid (reported on stderr), those apply. Read at the first
 *     use of the log.
 */
#ifndef ROUNDPIPE_H
#define ROUNDPIPE_H

#include <stddef.h>
#include <stdint.h>

#ifdef SWIG
#define RP_API
#elif defined(RP_BUILDING_LIBRARY)
#define RP_API __attribute__((visibility("default")))
#else
#define RP_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------------
 * DLPack 1.x declarations, written to the DLPack specification and ABI-compatible with it.
 * If your own dlpack.h was included first, it is used instead; if it comes later, its include
 * guard (DLPACK_DLPACK_H_) makes it a no-op.
 * ------------------------------------------------------------------------------------------- */
#ifndef DLPACK_DLPACK_H_
#define DLPACK_DLPACK_H_
#define DLPACK_MAJOR_VERSION 1
#define DLPACK_MINOR_VERSION 0

typedef struct {
    uint32_t major;
    uint32_t minor;
} DLPackVersion;

typedef enum {
    kDLCPU = 1,
    kDLCUDA = 2,
    kDLCUDAHost = 3,
    kDLOpenCL = 4,
    kDLVulkan = 7,
    kDLMetal = 8,
    kDLVPI = 9,
    kDLROCM = 10,
    kDLROCMHost = 11,
    kDLExtDev = 12,
    kDLCUDAManaged = 13,
    kDLOneAPI = 14,
    kDLWebGPU = 15,
    kDLHexagon = 16,
    kDLMAIA = 17
} DLDeviceType;

typedef struct {
    DLDeviceType device_type;
    int32_t device_id;
} DLDevice;

typedef enum {
    kDLInt = 0,
    kDLUInt = 1,
    kDLFloat = 2,
    kDLOpaqueHandle = 3,
    kDLBfloat = 4,
    kDLComplex = 5,
    kDLBool = 6
} DLDataTypeCode;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} DLDataType;

typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides;
    uint64_t byte_offset;
} DLTensor;

typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

typedef struct DLManagedTensorVersioned {
    DLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *self);
    uint64_t flags;
    DLTensor dl_tensor;
} DLManagedTensorVersioned;
#endif /* DLPACK_DLPACK_H_ */

/* ---------------------------------------------------------------------------------------------
 * Status, errors, versions, logging
 * ------------------------------------------------------------------------------------------- */

/** Result of every fallible call. */
typedef enum rp_status {
    RP_OK = 0,
    RP_ERR_INVALID_ARGUMENT = -1, /**< bad pointer, value, shape, dtype, device or spec */
    RP_ERR_OUT_OF_MEMORY = -2,    /**< host or device allocation failed */
    RP_ERR_IO = -3,               /**< a file could not be read, written or parsed */
    RP_ERR_CUDA = -4,             /**< a CUDA call failed */
    RP_ERR_CALLBACK = -5,         /**< a user callback reported failure */
    RP_ERR_STATE = -6,            /**< the call is not allowed in the model's current state */
    RP_ERR_INTERNAL = -7          /**< a bug in RoundPipe; please report it with the message */
} rp_status;

/** Version of the library as "MAJOR.MINOR.PATCH". Static storage. Any thread. */
RP_API const char *rp_version(void);

/** ABI version of the library. Bindings compare it with the RP_ABI_VERSION they were written
 * for and refuse to load on mismatch. Any thread. */
RP_API int32_t rp_abi_version(void);

/** Version of the libtorch this library was built against, as "MAJOR.MINOR.PATCH" ("2.11.0"):
 * the library runs only with that torch (its libraries are found through the library's run
 * path). Bindings that also load torch compare it with torch's own version at load. Static
 * storage. Any thread. */
RP_API const char *rp_torch_version(void);

/** Short English name of a status ("invalid argument", ...). Static storage. Any thread. */
RP_API const char *rp_status_string(rp_status status);

/** Message describing the last error on the calling thread ("" when none). Library-owned,
 * valid until the next RoundPipe call on this thread. Any thread. */
RP_API const char *rp_last_error_message(void);

/** Log levels, in increasing severity. */
typedef enum rp_log_level {
    RP_LOG_DEBUG = 0,
    RP_LOG_INFO = 1,
    RP_LOG_WARN = 2,
    RP_LOG_ERROR = 3
} rp_log_level;

/** Log sink. `message` is borrowed for the call. Called from any RoundPipe thread (caller,
 * device workers, optimizer thread), one call at a time. Must not call back into RoundPipe. */
typedef void (*rp_log_fn)(int32_t level, const char *message, void *user_data);

/**
 * Route library log messages at or above `min_level` to `fn` (NULL restores the default sink,
 * which writes RP_LOG_WARN and above to stderr). The environment variable RP_LOG_LEVEL, when
 * set, overrides `min_level` (see the list at the top of this header). When it returns, no call
 * to the previous sink is in flight, so its user_data may be freed. Any thread.
 * @return RP_OK, or RP_ERR_INVALID_ARGUMENT for a level outside rp_log_level.
 */
RP_API rp_status rp_set_log_callback(rp_log_fn fn, int32_t min_level, void *user_data);

/** Progress sink. `what` names the operation: "load " or "save " followed by the path given to
 * the call (a file or a Hugging Face directory); `done` and `total` count bytes of tensor data,
 * so done / total is the fraction complete. `what` is borrowed for the call. Called on the
 * thread that made the call being reported, one call at a time across threads; the operation
 * waits for it. Must not call back into RoundPipe. */
typedef void (*rp_progress_fn)(const char *what, int64_t done, int64_t total, void *user_data);

/**
 * Report the progress of long operations to `fn` (NULL, the default: no reports). Process-wide,
 * like the log sink. Reported: rp_model_create_from_hf and rp_model_load_hf ("load <dir>",
 * checkpoint bytes copied into the model), rp_model_load ("load <path>", bytes read),
 * rp_model_save_hf ("save <dir>") and rp_model_save ("save <path>"), bytes written. Each
 * operation reports done == 0 first, then done after each piece of work (a tensor, or 64 MiB
 * of a larger one) and, when it succeeds, exactly one report with done == total, its last; an
 * operation that fails stops with done < total (its call returns the error). When this
 * returns, no call to the previous sink is in flight, so its user_data may be freed.
 * @param fn the sink, or NULL.
 * @param user_data passed to every call of `fn`, borrowed until the sink is replaced.
 * @return RP_OK. Thread: any thread.
 */
RP_API rp_status rp_set_progress_callback(rp_progress_fn fn, void *user_data);

/**
 * Number of CUDA GPUs visible to this process (0 without a GPU or without a CUDA build).
 * @param out_count receives the count.
 * @return RP_OK or RP_ERR_INVALID_ARGUMENT (NULL pointer). Any thread.
 */
RP_API rp_status rp_cuda_device_count(int32_t *out_count);

/* ---------------------------------------------------------------------------------------------
 * Enumerations used by options
 * ------------------------------------------------------------------------------------------- */

/** Floating-point types for weights and optimizer state. */
typedef enum rp_dtype {
    RP_DTYPE_DEFAULT = 0, /**< inherit / built-in default */
    RP_DTYPE_F32 = 1,
    RP_DTYPE_BF16 = 2,
    RP_DTYPE_F16 = 3
} rp_dtype;

/** How host copies of the model weights are pinned (upstream's pin_model). */
typedef enum rp_pin_mode {
    RP_PIN_ALLOC = 0,    /**< page-locked allocation (default; fastest uploads) */
    RP_PIN_REGISTER = 1, /**< cudaHostRegister over ordinary memory (less host memory) */
    RP_PIN_OFF = 2       /**< pageable memory */
} rp_pin_mode;

/**
 * How much host memory the per-parameter state takes (docs/semantics.md, "Memory-saving mode").
 * Bytes per parameter for bf16/fp16 models (fp32 models in parentheses), built-in optimizer
 * state included:
 *  - RP_HOST_MEMORY_STANDARD: 24 (28) bytes: fp32 master, fp32 AdamW moments, two fp32 gradient
 *    buffers and two model-dtype weight copies, so an asynchronous step overlaps the whole next
 *    call and its weights are one step stale.
 *  - RP_HOST_MEMORY_SAVING: 12 (12) bytes: fp32 master, AdamW moments (SGD momentum) in bf16
 *    with stochastic rounding, one gradient buffer (bf16; fp32 for fp32 models) and one
 *    model-dtype weight copy (none for fp32 models, which upload the master). An asynchronous
 *    step still overlaps the next call: the step updates the layers in order and each stage's
 *    weights are uploaded as soon as the step has passed it, so weights are never stale.
 */
typedef enum rp_host_memory_mode {
    RP_HOST_MEMORY_STANDARD = 0,
    RP_HOST_MEMORY_SAVING = 1
} rp_host_memory_mode;

/** Which kind of device runs the stages. */
typedef enum rp_device_kind {
    RP_DEVICE_AUTO = 0, /**< all visible GPUs, else CPU worker devices */
    RP_DEVICE_CPU = 1,  /**< CPU worker devices, even when GPUs are visible */
    RP_DEVICE_CUDA = 2  /**< GPUs; model creation fails when none is visible */
} rp_device_kind;

/** Granularity of activation recomputation in backward. */
typedef enum rp_recompute_grain {
    RP_GRAIN_DEFAULT = 0, /**< inherit / built-in default (stage) */
    RP_GRAIN_STAGE = 1,   /**< recompute a whole stage, then run its backward */
    RP_GRAIN_LAYER = 2    /**< recompute and back-propagate one layer at a time */
} rp_recompute_grain;

/** Value for rp_run_config_set_input_split_dim: give every microbatch the whole tensor. */
#define RP_SPLIT_REPLICATE (-1)

/* ---------------------------------------------------------------------------------------------
 * Run configuration (upstream's RoundPipeRunConfig)
 * ------------------------------------------------------------------------------------------- */

/** Run configuration. Every field starts "unset": a per-call configuration overrides the
 * model-level one field by field, and fields unset in both take the built-in defaults. */
typedef struct rp_run_config rp_run_config;

/**
 * Custom microbatch split. Called on the caller's thread once per call, before any work starts.
 * @param out_pieces array of num_microbatch * n_inputs slots; fill slot [m * n_inputs + i] with
 *        microbatch m of input i. RoundPipe takes ownership of every tensor stored there (it
 *        calls their deleters), also when the callback fails.
 * @param inputs the call's inputs, borrowed for the callback.
 * @return 0 on success; any other value aborts the call with RP_ERR_CALLBACK.
 */
typedef int32_t (*rp_split_fn)(DLManagedTensor **out_pieces, const DLManagedTensor *const *inputs,
                               size_t n_inputs, int32_t num_microbatch, void *user_data);

/** Create a run configuration with every field unset. Caller frees with
 * rp_run_config_destroy. @return RP_OK, RP_ERR_INVALID_ARGUMENT or RP_ERR_OUT_OF_MEMORY. */
RP_API rp_status rp_run_config_create(rp_run_config **out_config);

/** Free a run configuration. NULL is ignored. A model keeps its own copy. */
RP_API void rp_run_config_destroy(rp_run_config *config);

/** Number of microbatches (>= 1; 0 unsets). Default: number of devices + 1.
 * @return RP_OK or RP_ERR_INVALID_ARGUMENT (NULL config, negative or > 65536). */
RP_API rp_status rp_run_config_set_num_microbatch(rp_run_config *config, int32_t num_microbatch);

/** Recompute granularity (RP_GRAIN_DEFAULT unsets). Default: RP_GRAIN_STAGE.
 * @return RP_OK or RP_ERR_INVALID_ARGUMENT. */
RP_API rp_status rp_run_config_set_recompute_grain(rp_run_config *config, int32_t grain);

/** Where outputs are returned: kDLCPU (default; device_id ignored) or kDLCUDA with a GPU index.
 * @return RP_OK or RP_ERR_INVALID_ARGUMENT (other device types, negative index). A GPU that
 * does not exist is reported when the configuration is used. */
RP_API rp_status rp_run_config_set_output_device(rp_run_config *config, int32_t device_type,
                                                 int32_t device_id);

/** How input `input_index` is split into microbatches: a dimension >= 0 (default 0 for tensors
 * with at least one dimension; 0-d tensors are always replicated) or RP_SPLIT_REPLICATE.
 * @return RP_OK or RP_ERR_INVALID_ARGUMENT (index outside 0..63, dim < -1). */
RP_API rp_status rp_run_config_set_input_split_dim(rp_run_config *config, int32_t input_index,
                                                   int32_t dim);

/** How labels are split: a dimension >= 0 (default 0) or RP_SPLIT_REPLICATE.
 * @return RP_OK or RP_ERR_INVALID_ARGUMENT. */
RP_API rp_status rp_run_config_set_label_split_dim(rp_run_config *config, int32_t dim);

/** Replace the input split rules by a callback (NULL unsets). `user_data` is passed back
 * unchanged and must outlive every call that uses this configuration.
 * @return RP_OK or RP_ERR_INVALID_ARGUMENT. */
RP_API rp_status rp_run_config_set_split_callback(rp_run_config *config, rp_split_fn fn,
                                                  void *user_data);

/** 1 (default): outputs of the microbatches are merged (tensors with dimensions concatenated
 * along dim 0, 0-d tensors averaged) into one tensor. 0: one output tensor per microbatch.
 * -1 unsets. @return RP_OK or RP_ERR_INVALID_ARGUMENT. */
RP_API rp_status rp_run_config_set_merge_output(rp_run_config *config, int32_t merge);

/** Number of microbatches the configuration sets (0: unset). @return RP_OK or
 * RP_ERR_INVALID_ARGUMENT (NULL pointer). Any thread. */
RP_API rp_status rp_run_config_get_num_microbatch(int32_t *out_num_microbatch,
                                                  const rp_run_config *config);

/** Recompute granularity the configuration sets (RP_GRAIN_DEFAULT: unset). @return RP_OK or
 * RP_ERR_INVALID_ARGUMENT. Any thread. */
RP_API rp_status rp_run_config_get_recompute_grain(int32_t *out_grain,
                                                   const rp_run_config *config);

/** Output device the configuration sets: `*out_device_type` kDLCPU or kDLCUDA, or 0 when unset
 * (then `*out_device_id` is 0). @return RP_OK or RP_ERR_INVALID_ARGUMENT. Any thread. */
RP_API rp_status rp_run_config_get_output_device(int32_t *out_device_type, int32_t *out_device_id,
                                                 const rp_run_config *config);

/** Merge rule the configuration sets: 1 merge, 0 one output per microbatch, -1 unset.
 * @return RP_OK or RP_ERR_INVALID_ARGUMENT. Any thread. */
RP_API rp_status rp_run_config_get_merge_output(int32_t *out_merge, const rp_run_config *config);

/* ---------------------------------------------------------------------------------------------
 * Model options and model lifetime
 * ------------------------------------------------------------------------------------------- */

/** Options for rp_model_create. */
typedef struct rp_model_options rp_model_options;

/** A model: layers, host parameter store, optimizer state, device workers and threads. */
typedef struct rp_model rp_model;

/** Create options holding the defaults. Caller frees with rp_model_options_destroy.
 * @return RP_OK, RP_ERR_INVALID_ARGUMENT or RP_ERR_OUT_OF_MEMORY. */
RP_API rp_status rp_model_options_create(rp_model_options **out_options);

/** Free options. NULL is ignored. */
RP_API void rp_model_options_destroy(rp_model_options *options);

/** Data type of the weights the devices compute with (default RP_DTYPE_F32).
 * @return RP_OK or RP_ERR_INVALID_ARGUMENT. */
RP_API rp_status rp_model_options_set_model_dtype(rp_model_options *options, int32_t dtype);

/** Data type of master weights and optimizer state (default RP_DTYPE_F32, recommended).
 * @return RP_OK or RP_ERR_INVALID_ARGUMENT. */
RP_API rp_status rp_model_options_set_optim_dtype(rp_model_options *options, int32_t dtype);

/** Host pinning of model weights (default RP_PIN_ALLOC; ignored on CPU devices).
 * @return RP_OK or RP_ERR_INVALID_ARGUMENT. */
RP_API rp_status rp_model_options_set_pin_mode(rp_model_options *options, int32_t pin_mode);

/** Host memory layout of parameters, gradients and optimizer state (default
 * RP_HOST_MEMORY_STANDARD; see rp_host_memory_mode).
 * @return RP_OK or RP_ERR_INVALID_ARGUMENT. */
RP_API rp_status rp_model_options_set_host_memory_mode(rp_model_options *options, int32_t mode);

/** Model-level run configuration, copied (NULL clears it).
 * @return RP_OK or RP_ERR_INVALID_ARGUMENT. */
RP_API rp_status rp_model_options_set_run_config(rp_model_options *options,
                                                 const rp_run_config *config);

/** GPU memory one model may use on each GPU, in bytes (default 0: 80% of the smallest free
 * memory among its GPUs at creation). The planner makes every stage's weights and gradients fit
 * in a third of it, since a GPU holds two stages' weights and one stage's gradients at once and
 * activations and library workspaces (cuBLAS keeps about 32 MiB per stream) need the rest; a
 * layer too large for that fails rp_model_create. Activations count too: each training call is
 * planned for the tokens of its microbatches (plans are cached per call shape), so that a stage's
 * weights, gradients, workspaces and the activations it keeps (the fused tail's, or a backward
 * stage's recompute working set at the call's recompute grain) fit in three quarters of the cap;
 * long sequences get shorter stages and a shorter tail. An explicit cap
 * is enforced through libtorch's per-process memory fraction of each GPU (it applies to the
 * whole process): going over it fails with RP_ERR_OUT_OF_MEMORY. On CPU devices nothing is
 * capped, but an explicit cap still shapes the plan, so plans can be previewed without a GPU.
 * @return RP_OK or RP_ERR_INVALID_ARGUMENT (negative). */
RP_API rp_status rp_model_options_set_gpu_memory_cap(rp_model_options *options, int64_t bytes);

/**
 * Dynamic loss scaling (torch.amp.GradScaler's rule): the loss is multiplied by the scale for
 * backward and the gradients divided by it as they accumulate; a step whose gradients hold inf or
 * nan is skipped (the weights stay) and halves the scale; `growth_interval` good steps in a row
 * double it. The step decides on the optimizer thread, so under async steps a new scale reaches
 * the training call after the next (one iteration late, as upstream). Reported losses are
 * unscaled. Default: on with 65536 and 2000 for RP_DTYPE_F16 models, off otherwise.
 * @param initial_scale > 0 turns scaling on with that scale; 0 turns it off.
 * @param growth_interval >= 1.
 * @return RP_OK or RP_ERR_INVALID_ARGUMENT.
 */
RP_API rp_status rp_model_options_set_grad_scaler(rp_model_options *options, double initial_scale,
                                                  int32_t growth_interval);

/** Seed of weight initialisation and of dropout (default 0).
 * @return RP_OK or RP_ERR_INVALID_ARGUMENT. */
RP_API rp_status rp_model_options_set_seed(rp_model_options *options, uint64_t seed);

/** 1 (default): a step whose gradients hold inf or nan is skipped (weights and optimizer state
 * unchanged, gradients dropped, a RP_LOG_WARN message), as a GradScaler does, for every dtype;
 * with loss scaling on, the scaler's rule (skip and lower the scale) decides. 0: such steps run.
 * @return RP_OK or RP_ERR_INVALID_ARGUMENT (not 0 or 1). */
RP_API rp_status rp_model_options_set_skip_nonfinite_steps(rp_model_options *options,
                                                           int32_t skip);

/** Name shown in logs (copied; default "roundpipe"). @return RP_OK or RP_ERR_INVALID_ARGUMENT. */
RP_API rp_status rp_model_options_set_name(rp_model_options *options, const char *name);

/** Device kind and count. `num_devices` 0 means: all visible GPUs, or 1 CPU worker device.
 * @return RP_OK or RP_ERR_INVALID_ARGUMENT (unknown kind, negative or > 64 devices). */
RP_API rp_status rp_model_options_set_devices(rp_model_options *options, int32_t kind,
                                              int32_t num_devices);

/**
 * Data parallelism across processes (docs/several-machines.md): this process is rank `rank` of
 * `world_size`, each running its own model on its share of every batch; before every optimizer
 * step the ranks' gradients are averaged over libtorch's c10d while the pipeline still runs (GPU
 * models: NCCL, in device memory, and every rank must run the same stage plan on as many GPUs,
 * which each training call checks; CPU devices: Gloo, on the host). rp_model_create joins the
 * group (it blocks until every rank has joined, at most `timeout_ms`); before the first training
 * call every rank takes rank 0's weights. Checkpoint saves write on rank 0 only; loads read on
 * every rank. A rank whose collective does not complete within `timeout_ms` (another rank
 * died, hung or failed its call) fails its call with RP_ERR_IO (on GPUs the NCCL communicators
 * are then aborted); the group is then unusable (RP_ERR_STATE) and the model must be created
 * again on every rank.
 * @param rank 0 .. world_size - 1, or -1: $RANK.
 * @param world_size >= 1, or -1: $WORLD_SIZE; 0 turns data parallelism off (the default).
 * @param rendezvous "env://" ($MASTER_ADDR and $MASTER_PORT, as torchrun sets them; NULL means
 *        this) or "tcp://host:port" (rank 0 hosts the store there unless torchrun's agent does).
 *        Borrowed; copied.
 * @param timeout_ms > 0: how long a rank waits for the others, at the rendezvous and in each
 *        collective; 0 means 600000 (10 minutes).
 * @return RP_OK or RP_ERR_INVALID_ARGUMENT (checked here: the ranges; checked by
 *         rp_model_create: the environment, the address, and that this library was built with
 *         c10d's Gloo support, see rp_data_parallel_available).
 */
RP_API rp_status rp_model_options_set_data_parallel(rp_model_options *options, int32_t rank,
                                                    int32_t world_size, const char *rendezvous,
                                                    int64_t timeout_ms);

/** Data parallel only: 1 reports each training call's loss as the mean over the ranks (one more
 * small collective per call); 0 (default): this rank's own loss.
 * @return RP_OK or RP_ERR_INVALID_ARGUMENT (not 0 or 1). */
RP_API rp_status rp_model_options_set_global_loss(rp_model_options *options, int32_t global);

/**
 * LoRA adapters (PEFT's LoraConfig) on the decoder layers of a Hugging Face model: each target
 * projection y = x W^T + b gains (alpha / rank) * B (A dropout(x)), A [rank, in] initialised
 * uniform(-1/sqrt(in), 1/sqrt(in)) and B [out, rank] zeros, as PEFT's defaults. Every other
 * parameter of the model (embeddings, norms, projections, LM head) becomes frozen: held once in
 * the model dtype, with no fp32 master, gradient or optimizer state (2 bytes per parameter for
 * bf16), and the LM head computes no weight gradient. Only rp_model_create_from_hf and
 * rp_model_create_from_hf_config honour it; rp_model_create(_with_layers) refuses options with
 * LoRA set. rp_model_save_hf then writes merged weights (a plain Hugging Face model);
 * rp_model_save_lora / rp_model_load_lora move the adapters in PEFT's format.
 * @param rank 1 .. 65536, or 0: no adapters (the default).
 * @param alpha finite, > 0 (PEFT's lora_alpha; the scaling is alpha / rank).
 * @param dropout in [0, 1): dropout on the adapters' input in training calls (masks drawn from
 *        the model seed, replayed exactly by the recompute).
 * @param target_modules comma-separated PEFT module names among q_proj, k_proj, v_proj, o_proj,
 *        gate_proj, up_proj, down_proj, or "all-linear" (all seven); NULL or "" means PEFT's
 *        default for Llama and Qwen3: "q_proj,v_proj". Borrowed; copied. A Qwen3-MoE model
 *        with sparse layers takes attention projections only (q_proj, k_proj, v_proj, o_proj):
 *        its experts are stacked tensors, and rp_model_create_from_hf(_config) refuses the MLP
 *        modules (and "all-linear") by name.
 * @return RP_OK or RP_ERR_INVALID_ARGUMENT (a value out of range; an unknown module, named).
 */
RP_API rp_status rp_model_options_set_lora(rp_model_options *options, int32_t rank, double alpha,
                                           double dropout, const char *target_modules);

/** 1 when this library can do data parallelism (it was built with c10d's Gloo headers), else 0.
 * @return RP_OK or RP_ERR_INVALID_ARGUMENT (NULL pointer). */
RP_API rp_status rp_data_parallel_available(int32_t *out_available);

/**
 * Explicit stage plan: stage s holds the next `layers_per_stage[s]` layers. The counts must be
 * positive and add up to the number of layers (checked by rp_model_create). NULL or n == 0
 * returns to the automatic planner, which balances estimated layer cost.
 * @param layers_per_stage borrowed; copied.
 * @return RP_OK or RP_ERR_INVALID_ARGUMENT.
 */
RP_API rp_status rp_model_options_set_stage_plan(rp_model_options *options,
                                                 const int32_t *layers_per_stage, size_t n);

/**
 * Build a model from a JSON spec: {"layers": [{"type": "linear", "in": 4, "out": 8}, ...]}, with
 * at least one layer. docs/semantics.md lists the layer types and their arguments. Weights are initialised from the seed.
 * @param out_model receives the model; caller frees with rp_model_destroy.
 * @param spec_json NUL-terminated JSON text, borrowed.
 * @param options borrowed; NULL means defaults.
 * @return RP_OK; RP_ERR_INVALID_ARGUMENT for a bad spec (the message names the layer) or bad
 *         options; RP_ERR_CUDA when RP_DEVICE_CUDA is asked for and no GPU is visible;
 *         RP_ERR_OUT_OF_MEMORY.
 */
RP_API rp_status rp_model_create(rp_model **out_model, const char *spec_json,
                                 const rp_model_options *options);


/** Destroy a model after draining its pipeline and optimizer thread. NULL is ignored. A model
 * that another thread is in a call on, or destroyed from its own step callback, is not destroyed
 * (an RP_LOG_ERROR message says so): freeing it under the call would crash the call. Destroying a
 * model while another thread may still start calls on it is undefined.
 * Tensors previously returned stay valid (they hold their own references). */
RP_API void rp_model_destroy(rp_model *model);

/** Number of layers in the pipeline's layer list. */
RP_API rp_status rp_model_num_layers(int32_t *out_count, const rp_model *model);

/** Number of stages of the current plan. */
RP_API rp_status rp_model_num_stages(int32_t *out_count, const rp_model *model);

/** Number of worker devices. */
RP_API rp_status rp_model_num_devices(int32_t *out_count, const rp_model *model);

/**
 * The stage plan of the last call (after the re-plan the third GPU training call makes from the
 * times measured in the first three; before any call, the plan for weights alone): stage s
 * holds the next `out_layers_per_stage[s]` layers of the layer list. Under a memory cap the
 * plan depends on the call's tokens per microbatch, recompute grain and kind (see
 * rp_model_options_set_gpu_memory_cap).
 * @param out_layers_per_stage up to `capacity` counts are written (may be NULL when capacity
 *        is 0).
 * @param out_num_stages receives the number of stages (also when it exceeds `capacity`).
 * @return RP_OK or RP_ERR_INVALID_ARGUMENT (NULL model or out_num_stages, negative capacity).
 * Thread: the thread driving this model.
 */
RP_API rp_status rp_model_stage_plan(int32_t *out_layers_per_stage, int32_t *out_num_stages,
                                     int32_t capacity, const rp_model *model);

/**
 * A stage plan the automatic planner makes for this model's layers under a per-stage memory
 * limit, without changing the model (its plan stays; apply this one with
 * rp_model_set_stage_plan or a call's run config). The planner balances the layers' estimated
 * (on GPUs, once measured, their measured) compute costs over contiguous stages whose fixed
 * bytes (each layer's weights and gradients in the model dtype, plus its workspace) stay within
 * `max_stage_bytes`, with at least `min_stages` stages (capped at one per layer). Activations
 * are not counted. This is upstream's ModelExecutePlan.auto(model_memory_limit=G): pass G GiB
 * / 2 per stage.
 * @param max_stage_bytes the most a stage may hold; 0: no limit.
 * @param min_stages the fewest stages; 0 or 1: as few as the limit allows.
 * @param out_layers_per_stage up to `capacity` counts are written (may be NULL when capacity
 *        is 0).
 * @param out_num_stages receives the number of stages (also when it exceeds `capacity`).
 * @return RP_OK; RP_ERR_INVALID_ARGUMENT (NULL model or out_num_stages, negative capacity,
 *         max_stage_bytes or min_stages, or one layer alone over max_stage_bytes: the message
 *         names it and its bytes).
 * Thread: the thread driving this model.
 */
RP_API rp_status rp_model_plan_stages(int32_t *out_layers_per_stage, int32_t *out_num_stages,
                                      int32_t capacity, const rp_model *model,
                                      int64_t max_stage_bytes, int32_t min_stages);

/**
 * Replace the stage plan of a live model, as rp_model_options_set_stage_plan does at creation:
 * stage s holds the next `layers_per_stage[s]` layers; NULL or n == 0 returns to the automatic
 * planner (on GPUs the third training call from then re-plans from measured times). The next
 * call runs on the new stages; backward runs them in reverse order, and a backward stage plan
 * set before (rp_model_set_backward_stage_plan) is dropped. Weights, gradients, optimizer state and
 * queued steps do not depend on the plan and are untouched.
 * @param layers_per_stage borrowed; copied.
 * @return RP_OK; RP_ERR_INVALID_ARGUMENT (NULL model, counts not positive or not adding up to
 *         the number of layers, called from a step callback); RP_ERR_STATE (a rp_forward_train
 *         awaits its rp_backward, whose kept stage inputs follow the old plan; another thread is
 *         in a call on the model). On error the plan is unchanged.
 * Thread: the thread driving this model.
 */
RP_API rp_status rp_model_set_stage_plan(rp_model *model, const int32_t *layers_per_stage,
                                         size_t n);

/**
 * Backward stages that differ from the forward ones (upstream's asymmetric execute plans:
 * backward costs about three forwards, so shorter backward stages balance the pipeline): backward
 * stage b holds the next `layers_per_stage[b]` layers, counted from layer 0 as for
 * rp_model_set_stage_plan; backward jobs run them deepest first. A training forward keeps the
 * input of every backward stage (a download from inside a forward stage where a backward stage
 * starts in its middle), and each backward job recomputes its layers from that input. In a fused
 * call (rp_forward_backward) the last forward stage is the tail, run once forward and backward
 * without recompute: the backward plan must end with the same stage, else that call fails with
 * RP_ERR_INVALID_ARGUMENT before anything changes. rp_forward_train / rp_backward take any
 * backward plan. NULL or n == 0: the backward stages are the forward ones (the default).
 * Applies from the next call until cleared or until rp_model_set_stage_plan sets a new forward
 * plan. Results do not depend on the plan (only rounding: gradients summed in another order).
 * @param layers_per_stage borrowed; copied.
 * @return RP_OK; RP_ERR_INVALID_ARGUMENT (NULL model, counts not positive or not adding up to
 *         the number of layers, called from a step callback); RP_ERR_STATE (no explicit forward
 *         stage plan: the automatic planner's stages change with the call shape; a
 *         rp_forward_train awaits its rp_backward; another thread is in a call on the model). On
 *         error the plan is unchanged.
 * Thread: the thread driving this model.
 */
RP_API rp_status rp_model_set_backward_stage_plan(rp_model *model,
                                                  const int32_t *layers_per_stage, size_t n);

/**
 * The backward stage plan in force, as rp_model_stage_plan reports the forward one: the plan
 * rp_model_set_backward_stage_plan set, else the forward stage plan of the last call.
 * @return RP_OK or RP_ERR_INVALID_ARGUMENT (NULL model or out_num_stages, negative capacity).
 * Thread: the thread driving this model.
 */
RP_API rp_status rp_model_backward_stage_plan(int32_t *out_layers_per_stage,
                                              int32_t *out_num_stages, int32_t capacity,
                                              const rp_model *model);

/**
 * The run configuration a call with `call` would use: the model-level configuration overlaid by
 * `call` field by field, with every field still unset filled in with the built-in default
 * (num_microbatch: number of devices + 1; grain: RP_GRAIN_STAGE; output device: the CPU;
 * merge_output: 1). Input and label split dimensions and the split callback are copied as set.
 * @param out_config receives a new configuration; caller frees with rp_run_config_destroy.
 * @param call borrowed; NULL means no per-call configuration.
 * @return RP_OK; RP_ERR_INVALID_ARGUMENT (NULL pointer, an output GPU that does not exist).
 * Thread: the thread driving this model.
 */
RP_API rp_status rp_model_resolve_run_config(rp_run_config **out_config, const rp_model *model,
                                             const rp_run_config *call);

/** Number of optimizer steps enqueued so far (built-in or callback). */
RP_API rp_status rp_model_step_count(int64_t *out_count, const rp_model *model);

/** Current loss scale (0 when loss scaling is off) and the number of steps skipped so far for
 * overflowing (inf or nan) gradients. Read after rp_synchronize for the latest values. */
RP_API rp_status rp_model_grad_scale(double *out_scale, int64_t *out_skipped_steps,
                                     const rp_model *model);

/** Non-finite values met so far: training calls whose loss was inf or nan (each is also logged
 * at RP_LOG_WARN), and steps skipped because their gradients held inf or nan (by the loss scaler
 * or by rp_model_options_set_skip_nonfinite_steps; also counted by rp_model_grad_scale). Read
 * after rp_synchronize for the latest step count. Thread: the thread driving this model. */
RP_API rp_status rp_model_nonfinite_counts(int64_t *out_nonfinite_losses,
                                           int64_t *out_skipped_steps,
                                           const rp_model *model);

/**
 * Switch dynamic loss scaling on a live model, as rp_model_options_set_grad_scaler does at
 * creation (same arguments and rule): `initial_scale` > 0 (re)starts scaling at that scale with
 * a fresh count of good steps; 0 turns it off (the loss is no longer scaled and the scaler no
 * longer skips steps; rp_model_options_set_skip_nonfinite_steps's rule applies instead). A
 * binding's own scaler (Python's roundpipe.GradScaler) turns the engine's off so that every step
 * callback runs and decides itself, as upstream. The steps already queued finish first (they
 * decide with the old setting); the next training call and step use the new one. The count of
 * skipped steps is kept.
 * @return RP_OK; RP_ERR_INVALID_ARGUMENT (NULL, scale negative or not finite, growth_interval
 *         < 1; called from a step callback); RP_ERR_STATE (another thread is in a call on the
 *         model). On error nothing changed.
 * Thread: the thread driving this model.
 */
RP_API rp_status rp_model_set_grad_scaler(rp_model *model, double initial_scale,
                                          int32_t growth_interval);

/**
 * Change rp_model_options_set_skip_nonfinite_steps on a live model: 1 skips a step whose
 * gradients hold inf or nan (the step callback does not run), 0 lets it run. With loss scaling
 * on, the scaler's rule still decides. The steps already queued finish first, with the old
 * setting.
 * @return RP_OK; RP_ERR_INVALID_ARGUMENT (NULL, not 0 or 1, called from a step callback);
 *         RP_ERR_STATE (another thread is in a call on the model). On error nothing changed.
 * Thread: the thread driving this model.
 */
RP_API rp_status rp_model_set_skip_nonfinite_steps(rp_model *model, int32_t skip);

/** The GPU memory cap in force (0 on CPU devices). */
RP_API rp_status rp_model_gpu_memory_cap(int64_t *out_bytes, const rp_model *model);

/** This process's data-parallel rank and the number of ranks (0 and 1 without data parallelism).
 * @return RP_OK or RP_ERR_INVALID_ARGUMENT (NULL pointer). */
RP_API rp_status rp_model_data_parallel(int32_t *out_rank, int32_t *out_world_size,
                                        const rp_model *model);

/** Host memory held by the model's parameter state: master weights, weight copies the devices
 * read, gradient buffers and built-in optimizer state (allocated at the first built-in step),
 * counted as tensor bytes (allocator padding excluded), and the number of parameter elements
 * (tied parameters once), so out_bytes / out_elements is bytes per parameter.
 * @return RP_OK or RP_ERR_INVALID_ARGUMENT (NULL pointer). Thread: the thread driving this
 * model. */
RP_API rp_status rp_model_host_state_bytes(int64_t *out_bytes, int64_t *out_elements,
                                           const rp_model *model);

/**
 * Timing record of the model's last rp_forward / rp_forward_backward, as Chrome trace JSON (open it
 * in chrome://tracing or Perfetto): one process per device (pid = device index), named by a
 * "process_name" metadata event "cuda:<index>" for a GPU or "cpu <n>" for the n-th CPU worker
 * device, one thread per stream ("weights", "activation_upload", "compute", "download"), one
 * complete event per transfer or microbatch computation, times in microseconds from the call's
 * start, measured with CUDA events on GPUs and the host clock on CPU devices (which record compute
 * only). Each event's args name the job, the stage and the kind (forward, tail, backward); a
 * transfer's args also hold "bytes", the bytes it moved, and "content", what it carried ("weights",
 * "activations" or "gradients": the stage's weight gradients). On GPUs an event's args also hold
 * "enqueued_us", when the host enqueued the work (same clock as "ts"): a start well after it is
 * a stream waiting on the device, not a late host. The host is one more process
 * ("host") with one thread per host activity ("caller", "optimizer", "gradients").
 * @param out_json receives the text; library-owned, valid until the next call on this model.
 * Thread: the thread driving this model.
 */
RP_API rp_status rp_model_trace_json(const char **out_json, rp_model *model);

/**
 * Memory of GPU `device` held by tensors through libtorch's caching allocator, now and at its
 * peak since the last reset (all RoundPipe models of the process together).
 * @return RP_OK; RP_ERR_INVALID_ARGUMENT for NULL pointers or a GPU that is not visible.
 * Any thread.
 */
RP_API rp_status rp_cuda_memory_stats(int64_t *out_allocated_bytes, int64_t *out_peak_bytes,
                                      int32_t device);

/** Restart the peak of rp_cuda_memory_stats for GPU `device`. @return RP_OK or
 * RP_ERR_INVALID_ARGUMENT (GPU not visible). Any thread. */
RP_API rp_status rp_cuda_reset_peak_memory(int32_t device);

/* ---------------------------------------------------------------------------------------------
 * Tensor lists (outputs)
 * ------------------------------------------------------------------------------------------- */

/** An owned list of output tensors. */
typedef struct rp_tensor_list rp_tensor_list;

/** Number of tensors in the list. */
RP_API rp_status rp_tensor_list_size(size_t *out_size, const rp_tensor_list *list);

/** A new DLPack reference to tensor `index`: caller owns it and calls its deleter. May be
 * called more than once; all references share memory. @return RP_OK or
 * RP_ERR_INVALID_ARGUMENT (NULL, index out of range). */
RP_API rp_status rp_tensor_list_get(DLManagedTensor **out_tensor, const rp_tensor_list *list,
                                    size_t index);

/** Free the list. Tensors already taken with rp_tensor_list_get stay valid. NULL is ignored. */
RP_API void rp_tensor_list_destroy(rp_tensor_list *list);

/** Create an empty list, for a program that hands tensors to RoundPipe through one (tests; the
 * engine creates the lists its callbacks fill). Caller frees with rp_tensor_list_destroy.
 * @return RP_OK, RP_ERR_INVALID_ARGUMENT or RP_ERR_OUT_OF_MEMORY. */
RP_API rp_status rp_tensor_list_create(rp_tensor_list **out_list);

/** Append a tensor, taking ownership of it: the list calls its deleter (also when this call
 * fails). NULL appends "no tensor" (an input that needs no gradient); rp_tensor_list_get then
 * gives NULL for that index. Appended tensors are validated where the engine uses them.
 * @return RP_OK; RP_ERR_INVALID_ARGUMENT (NULL list); RP_ERR_OUT_OF_MEMORY. Any thread. */
RP_API rp_status rp_tensor_list_push(rp_tensor_list *list, DLManagedTensor *tensor);

/* ---------------------------------------------------------------------------------------------
 * Caller-defined layers (docs/semantics.md, "Caller-defined layers")
 *
 * A layer whose computation is yours. RoundPipe owns its parameters and buffers exactly as it
 * owns a built-in layer's: host master weights, pinned copies, streaming to the devices,
 * gradients, optimizer state, save and load. For each call it lends your callbacks the
 * parameters and buffers on the device, the device and its compute stream, and the inputs.
 *
 * Activations between layers are lists of tensors of any dtype. A caller-defined first layer
 * receives every input of the call; any other receives the previous layer's outputs. A built-in
 * layer reads tensor 0 of its input list (and, as always, the call's inputs 1.. as side inputs)
 * and outputs one tensor.
 *
 * Phases of the forward callback (rp_layer_call_info):
 *  - RP_PHASE_FORWARD: a forward stage, no gradient wanted. Buffers may be updated in place.
 *  - RP_PHASE_RECOMPUTE: the recompute of a backward stage, with gradient: keep what your
 *    backward needs in *context. The seed equals the forward's, so dropout masks match.
 *    Buffers must not change (their update already happened in the forward).
 *  - RP_PHASE_TAIL: the fused tail stage: forward with gradient (keep a context as for
 *    RP_PHASE_RECOMPUTE); buffers may be updated in place. Backward follows.
 * After RP_PHASE_RECOMPUTE and RP_PHASE_TAIL the engine calls backward once with the gradients
 * of the outputs, then release(context). It calls only release when the call fails in between,
 * and when no gradient is wanted from that pass: nothing before the layer needs one and it has
 * no trainable parameter, or it is the gradient-free first pass of an RP_GRAIN_LAYER recompute.
 * Buffers changed in place by RP_PHASE_FORWARD or RP_PHASE_TAIL are written back to host memory
 * at the end of the stage.
 *
 * Errors: a callback that returns non-zero, or whose results are malformed (a wrong number of
 * outputs or gradients, a gradient of the wrong shape or dtype, a gradient for a frozen
 * parameter, a recompute whose outputs differ from the forward's), fails the call with
 * RP_ERR_CALLBACK and a message naming the layer; nothing of that call is accumulated.
 *
 * Threads and streams: callbacks run on a device worker thread of the model (or an autograd
 * thread for backward), one device at a time per thread but possibly concurrently for different
 * devices. Launch GPU work on the stream rp_layer_call_info gives (the engine orders it against
 * its transfers); do not synchronise the device. Do not call back into RoundPipe with the same
 * model. Tensors you return may live on the layer's device or on the CPU, in any dtype the
 * engine can convert (floating activations are converted to the model dtype where they cross
 * from one stage to the next).
 * ------------------------------------------------------------------------------------------- */

/** What a forward callback is asked to do (see above). */
typedef enum rp_layer_phase {
    RP_PHASE_FORWARD = 0,
    RP_PHASE_RECOMPUTE = 1,
    RP_PHASE_TAIL = 2
} rp_layer_phase;

/** A caller-defined layer's declaration: callbacks, parameters and buffers. */
typedef struct rp_layer_def rp_layer_def;

/** What one callback invocation is lent: device, stream, phase, seed, parameters, buffers.
 * Valid only during the callback. */
typedef struct rp_layer_call rp_layer_call;

/**
 * Forward of one microbatch.
 * @param out_outputs append the outputs (at least one), in order; RoundPipe owns them.
 * @param inout_context in RP_PHASE_RECOMPUTE and RP_PHASE_TAIL, store what backward needs
 *        (starts NULL); ignored in RP_PHASE_FORWARD.
 * @param call the device, phase, parameters and buffers.
 * @param inputs the layer's inputs, borrowed for the callback.
 * @return 0 on success; any other value fails the call with RP_ERR_CALLBACK (release is still
 *         called for a context you stored).
 */
typedef int32_t (*rp_layer_forward_fn)(rp_tensor_list *out_outputs, void **inout_context,
                                       const rp_layer_call *call,
                                       const DLManagedTensor *const *inputs, size_t n_inputs,
                                       void *user_data);

/**
 * Backward of one microbatch, after RP_PHASE_RECOMPUTE or RP_PHASE_TAIL.
 * @param out_input_grads append one entry per input: its gradient (the input's shape) or NULL
 *        where the input needs none (integer inputs always get NULL).
 * @param out_param_grads append one entry per parameter in declaration order: its gradient (the
 *        parameter's shape) or NULL; a frozen parameter must get NULL. RoundPipe accumulates
 *        them into the parameters' gradients.
 * @param context what the forward stored.
 * @param output_grads one per output of the forward: the gradient of the loss with respect to
 *        it, borrowed; NULL where an output received none (integer outputs, unused outputs).
 * @return 0 on success; any other value fails the call with RP_ERR_CALLBACK.
 */
typedef int32_t (*rp_layer_backward_fn)(rp_tensor_list *out_input_grads,
                                        rp_tensor_list *out_param_grads, void *context,
                                        const rp_layer_call *call,
                                        const DLManagedTensor *const *output_grads,
                                        size_t n_outputs, void *user_data);

/** Frees a context stored by a forward callback. Called exactly once per stored context. */
typedef void (*rp_layer_release_fn)(void *context, void *user_data);

/**
 * Declare a caller-defined layer. Caller frees with rp_layer_def_destroy (a model built from it
 * keeps its own copy; `user_data` must outlive every model built from it).
 * @param type_name names the layer in messages and traces (e.g. "python:BasicBlock").
 * @param forward required. @param backward NULL for a layer that passes no gradient (no
 *        trainable parameters, inputs that need none). @param release NULL when no context is
 *        ever stored.
 * @return RP_OK; RP_ERR_INVALID_ARGUMENT (NULL out_def, type_name or forward); RP_ERR_OUT_OF_MEMORY.
 */
RP_API rp_status rp_layer_def_create(rp_layer_def **out_def, const char *type_name,
                                     rp_layer_forward_fn forward, rp_layer_backward_fn backward,
                                     rp_layer_release_fn release, void *user_data);

/** Free a declaration. NULL is ignored. */
RP_API void rp_layer_def_destroy(rp_layer_def *def);

/**
 * Declare a parameter, in the order the callbacks receive them. Its shape is `initial`'s; its
 * value is copied from `initial` now. Floating parameters are held in the model dtype (trainable
 * ones with an fp32 master, gradient and optimizer state); a frozen parameter gets no master, no
 * gradient and no optimizer state, and keeps a non-floating dtype as given.
 * @param name unique within the layer, e.g. "conv1.weight"; the model names it
 *        "<layer index>.<name>".
 * @param initial borrowed; contiguous, in host or GPU memory, any dtype libtorch knows.
 * @param trainable 1: gets gradients and optimizer updates (must be floating); 0: frozen.
 * @return RP_OK; RP_ERR_INVALID_ARGUMENT (NULL, empty or duplicate name, bad tensor, a
 *         non-floating trainable parameter); RP_ERR_OUT_OF_MEMORY.
 */
RP_API rp_status rp_layer_def_add_param(rp_layer_def *def, const char *name,
                                        const DLManagedTensor *initial, int32_t trainable);

/**
 * Declare a parameter that is another layer's parameter (tied weights: an embedding and an LM
 * head), in the order the callbacks receive them. It has one master weight, one optimizer state
 * and one gradient, the sum over every use; its shape, dtype and trainability are those of
 * `tied_to`.
 * @param name unique within the layer. @param tied_to the model name ("<layer index>.<name>")
 *        of a parameter of an earlier layer, checked when the model is built.
 * @return RP_OK; RP_ERR_INVALID_ARGUMENT (NULL, empty or duplicate name, empty tied_to).
 */
RP_API rp_status rp_layer_def_add_tied_param(rp_layer_def *def, const char *name,
                                             const char *tied_to);

/**
 * Declare a buffer (state that is not trained: BatchNorm running statistics, counters), in the
 * order the callbacks receive them. Value copied from `initial`; floating buffers are held in the
 * model dtype, others keep their dtype. Saved and loaded with the parameters; updated only by
 * RP_PHASE_FORWARD and RP_PHASE_TAIL. Same rules and statuses as rp_layer_def_add_param.
 */
RP_API rp_status rp_layer_def_add_buffer(rp_layer_def *def, const char *name,
                                         const DLManagedTensor *initial);

/** Relative cost of the layer for the stage planner before anything is measured (default: its
 * parameter count plus a constant, as for built-in layers). @return RP_OK or
 * RP_ERR_INVALID_ARGUMENT (NULL, negative or non-finite). */
RP_API rp_status rp_layer_def_set_cost(rp_layer_def *def, double cost);

/** Device bytes the layer's forward with gradients keeps for its backward, per token of the
 * microbatch (each element of an integer input 0, else each row along the last dimension of
 * input 0), in the model dtype. Under a GPU memory cap the planner multiplies it by the tokens
 * of a call's microbatches to size the fused tail and the recompute working sets (see
 * rp_model_options_set_gpu_memory_cap). Default: four times the model-dtype bytes of the
 * summed input widths (last dimensions) of the layer's matrices; for a layer without matrices,
 * four times its widest vector parameter; for one without parameters, the figure of the layer
 * before. @return RP_OK or RP_ERR_INVALID_ARGUMENT (NULL, negative or non-finite).
 * Thread: any thread, before rp_model_create_with_layers takes the definition. */
RP_API rp_status rp_layer_def_set_activation_bytes(rp_layer_def *def, double bytes_per_token);

/**
 * The scalar facts of a callback invocation; any out-parameter may be NULL.
 * @param out_phase an rp_layer_phase (loss callbacks: RP_PHASE_TAIL).
 * @param out_device_type kDLCPU or kDLCUDA; @param out_device_id the device index.
 * @param out_stream the cudaStream_t to launch on (NULL on CPU devices).
 * @param out_seed the same in a forward and its recompute (use it for dropout).
 * @param out_microbatch index of the microbatch in the call.
 * @param out_training 1 in a training call (forward_backward), 0 in rp_forward.
 */
RP_API rp_status rp_layer_call_info(int32_t *out_phase, int32_t *out_device_type,
                                    int32_t *out_device_id, void **out_stream, uint64_t *out_seed,
                                    int32_t *out_microbatch, int32_t *out_training,
                                    const rp_layer_call *call);

/**
 * The layer's parameters and buffers on the device, in declaration order, in their held dtype;
 * borrowed, valid until the callback returns. Do not write parameters. Buffers are meant to be
 * written in place (their data is writable although the struct is const), in RP_PHASE_FORWARD
 * and RP_PHASE_TAIL only. Any out-parameter may be NULL.
 */
RP_API rp_status rp_layer_call_tensors(const DLManagedTensor *const **out_params,
                                       size_t *out_n_params,
                                       const DLManagedTensor *const **out_buffers,
                                       size_t *out_n_buffers, const rp_layer_call *call);

/**
 * Build a model that mixes built-in and caller-defined layers. The spec is as for
 * rp_model_create, where an entry {"type": "caller", "def": i} is the layer declared by
 * defs[i]; every def is used exactly once. The model copies each def (callbacks, user_data,
 * initial values): the defs may be destroyed afterwards.
 * @return as rp_model_create; the message names a bad entry or def.
 */
RP_API rp_status rp_model_create_with_layers(rp_model **out_model, const char *spec_json,
                                             const rp_layer_def *const *defs, size_t n_defs,
                                             const rp_model_options *options);

/**
 * Split one tensor into `num_microbatch` pieces by the rule the engine applies to inputs and
 * labels: along dimension `dim` with the sizes of torch.tensor_split (the first pieces one row
 * larger when the rows do not divide evenly); a 0-d tensor, or `dim` RP_SPLIT_REPLICATE, gives
 * every microbatch the whole tensor. For bindings that split structures the engine does not see
 * (Python pytrees) leaf by leaf, so the rule and its errors have one home.
 * @param out_pieces receives a list of `num_microbatch` views of `tensor` (no copy); caller frees
 *        with rp_tensor_list_destroy. The views keep the borrowed memory alive only while the
 *        caller keeps `tensor`'s memory alive.
 * @param tensor borrowed; on the CPU or a GPU, any dtype.
 * @param dim a dimension >= 0, or RP_SPLIT_REPLICATE.
 * @param num_microbatch 1..65536.
 * @return RP_OK; RP_ERR_INVALID_ARGUMENT (NULL, bad tensor, dim outside the tensor, fewer rows
 *         than microbatches: the message says which). Any thread.
 */
RP_API rp_status rp_split_microbatches(rp_tensor_list **out_pieces, const DLManagedTensor *tensor,
                                       int32_t dim, int32_t num_microbatch);

/* ---------------------------------------------------------------------------------------------
 * Losses
 * ------------------------------------------------------------------------------------------- */

/** Built-in losses. Each is computed per microbatch; forward_backward returns their sum. */
typedef enum rp_loss_kind {
    RP_LOSS_OUTPUT = 0,       /**< the model's output is the loss (must be a 0-d tensor) */
    RP_LOSS_MSE = 1,          /**< mean squared error against float labels of the same shape */
    RP_LOSS_CROSS_ENTROPY = 2, /**< mean cross entropy of logits [N, C] against int64 labels [N] */
    /** Causal-LM cross entropy, fused into a last `lm_head` layer and computed in chunks (the
     * logits of a batch never exist at once). Labels: integer token ids [batch, seq] shaped like
     * input 0, -100 where a token has no target; token i is scored against label i + 1. The loss
     * is the mean over every target of the call: each microbatch contributes its summed token
     * losses divided by the number of targets in the whole call (docs/semantics.md). */
    RP_LOSS_CAUSAL_LM = 3
} rp_loss_kind;

/** A loss: built-in or callback, times a scale factor. */
typedef struct rp_loss rp_loss;

/**
 * Custom loss of one microbatch. Called on a device worker thread, never concurrently for one
 * model. Must not call back into RoundPipe with the same model.
 * @param out_loss receives the loss value of this microbatch.
 * @param out_grad receives d(loss)/d(outputs), same shape as `outputs`, any float dtype, on
 *        the CPU or on the outputs' device. RoundPipe takes ownership and calls its deleter.
 * @param outputs the microbatch's outputs, borrowed for the callback (fp32, on the CPU).
 * @param labels the microbatch's labels, borrowed for the callback (NULL when the call has none).
 * @param microbatch index of the microbatch.
 * @return 0 on success; any other value aborts the call with RP_ERR_CALLBACK and nothing is
 *         accumulated.
 */
typedef int32_t (*rp_loss_fn)(double *out_loss, DLManagedTensor **out_grad,
                              const DLManagedTensor *outputs, const DLManagedTensor *labels,
                              int32_t microbatch, void *user_data);

/**
 * Custom loss of one microbatch, computed on the device where the tail stage ran. Called on a
 * device worker thread, like a layer callback (same threads and stream rules).
 * @param out_loss receives this microbatch's loss: a tensor of one element, any float dtype, on
 *        the device or the CPU (left on the device, no synchronisation is needed). RoundPipe
 *        takes ownership.
 * @param out_grads append d(loss)/d(output) for each output, in order (the output's shape, any
 *        float dtype), or NULL for an output without one. RoundPipe owns them.
 * @param call the device, stream and microbatch (phase RP_PHASE_TAIL; no parameters).
 * @param outputs the microbatch's outputs on the device, in the model dtype, borrowed.
 * @param labels the microbatch's labels on the device, borrowed (NULL when the call has none).
 * @return 0 on success; any other value fails the call with RP_ERR_CALLBACK.
 */
typedef int32_t (*rp_device_loss_fn)(DLManagedTensor **out_loss, rp_tensor_list *out_grads,
                                     const rp_layer_call *call,
                                     const DLManagedTensor *const *outputs, size_t n_outputs,
                                     const DLManagedTensor *labels, void *user_data);

/** Create a built-in loss. Caller frees with rp_loss_destroy.
 * @return RP_OK or RP_ERR_INVALID_ARGUMENT (unknown kind). */
RP_API rp_status rp_loss_create(rp_loss **out_loss, int32_t kind);

/** Create a loss computed by `fn`. `user_data` must outlive every call using the loss.
 * @return RP_OK or RP_ERR_INVALID_ARGUMENT (NULL fn). */
RP_API rp_status rp_loss_create_callback(rp_loss **out_loss, rp_loss_fn fn, void *user_data);

/** Create a loss computed on the device by `fn` (rp_device_loss_fn). The loss scale multiplies
 * the returned loss and gradients. `user_data` must outlive every call using the loss.
 * @return RP_OK or RP_ERR_INVALID_ARGUMENT (NULL fn). */
RP_API rp_status rp_loss_create_device_callback(rp_loss **out_loss, rp_device_loss_fn fn,
                                                void *user_data);

/** Multiply the loss (and so its gradient) by `scale` (default 1; e.g. 1/num_microbatch for a
 * batch mean). @return RP_OK or RP_ERR_INVALID_ARGUMENT (NULL, non-finite). */
RP_API rp_status rp_loss_set_scale(rp_loss *loss, double scale);

/** Free a loss. NULL is ignored. */
RP_API void rp_loss_destroy(rp_loss *loss);

/* ---------------------------------------------------------------------------------------------
 * Forward and fused forward + backward
 * ------------------------------------------------------------------------------------------- */

/**
 * Inference: split inputs into microbatches, run them through the pipeline, merge the outputs.
 * Uses the published weights (see rp_step). No gradients are recorded.
 * @param out_outputs receives the outputs (one tensor when merged, else one per microbatch);
 *        caller frees with rp_tensor_list_destroy.
 * @param inputs n_inputs (1..64) borrowed DLPack tensors, contiguous, in host memory (kDLCPU or
 *        kDLCUDAHost) or, for a model on GPUs, in the memory of a visible GPU (kDLCUDA), of dtype float32, float16, bfloat16 (converted to the model dtype), int64
 *        or int32. inputs[0] feeds the first layer; the others are split alongside it.
 * @param config per-call overrides, borrowed; NULL uses the model's configuration.
 * @return RP_OK; RP_ERR_INVALID_ARGUMENT for bad tensors or configuration; RP_ERR_CALLBACK
 *         when the split callback fails; RP_ERR_OUT_OF_MEMORY; RP_ERR_CUDA.
 * Thread: the thread driving this model.
 */
RP_API rp_status rp_forward(rp_tensor_list **out_outputs, rp_model *model,
                            const DLManagedTensor *const *inputs, size_t n_inputs,
                            const rp_run_config *config);

/**
 * Training: forward, loss and backward of every microbatch, fused in one pipelined pass.
 * Gradients are added to the model's accumulated gradients (they accumulate across calls until
 * rp_step consumes them). If the call fails, no gradient of it is accumulated.
 * @param out_loss receives the sum of the microbatch losses (may be NULL).
 * @param out_outputs when not NULL, receives the merged outputs as for rp_forward; caller
 *        frees with rp_tensor_list_destroy.
 * @param inputs as for rp_forward.
 * @param labels borrowed, split like inputs (may be NULL for RP_LOSS_OUTPUT or a callback).
 * @param loss borrowed; NULL means RP_LOSS_OUTPUT.
 * @param config per-call overrides, borrowed; NULL uses the model's configuration.
 * @return as rp_forward, plus RP_ERR_CALLBACK when the loss callback fails.
 * Thread: the thread driving this model.
 */
RP_API rp_status rp_forward_backward(double *out_loss, rp_tensor_list **out_outputs,
                                     rp_model *model, const DLManagedTensor *const *inputs,
                                     size_t n_inputs, const DLManagedTensor *labels,
                                     const rp_loss *loss, const rp_run_config *config);

/**
 * Upstream's non-fused training, first half: a forward in training mode (dropout on, buffers
 * updated) whose outputs can be back-propagated later by rp_backward, for a loss the caller
 * computes itself (e.g. with autograd on the outputs). The model keeps what the backward needs
 * (every stage's input, in host memory) until rp_backward, the next rp_forward_train, or a load.
 * Outputs, inputs and configuration as for rp_forward.
 * @return as rp_forward. Thread: the thread driving this model.
 */
RP_API rp_status rp_forward_train(rp_tensor_list **out_outputs, rp_model *model,
                                  const DLManagedTensor *const *inputs, size_t n_inputs,
                                  const rp_run_config *config);

/**
 * Second half: back-propagate the gradients of the last rp_forward_train's outputs and add the
 * parameter gradients to the accumulated ones (every stage is recomputed, deepest first, with
 * the forward's dropout masks). Once per rp_forward_train.
 * @param output_grads borrowed, laid out as the forward returned its outputs (merged: one per
 *        output; otherwise every output of microbatch 0, then of microbatch 1, ...), each of its
 *        output's shape, floating point, in host memory or on a GPU of the model; NULL where an
 *        output has no gradient.
 * @return RP_OK; RP_ERR_INVALID_ARGUMENT (wrong count, shape or dtype: the forward's state is
 *         kept, so a corrected call works); RP_ERR_STATE (no forward to back-propagate, or an
 *         optimizer step ran since it); RP_ERR_CALLBACK, RP_ERR_OUT_OF_MEMORY, RP_ERR_CUDA as for
 *         rp_forward_backward (the forward's state is then gone). If the call fails, no gradient
 *         of it is accumulated. Thread: the thread driving this model.
 */
RP_API rp_status rp_backward(rp_model *model, const DLManagedTensor *const *output_grads,
                             size_t n_grads);

/**
 * rp_backward that also returns the gradients of the training forward's inputs (x.grad in
 * autograd terms), e.g. to back-propagate into whatever produced them (another model).
 * Everything rp_backward says holds; in addition:
 * @param out_input_grads receives one entry per input of the rp_forward_train call, in the
 *        input's shape and dtype, in host memory: the gradient of the outputs (weighted by
 *        `output_grads`) with respect to that input, put back together from the microbatches
 *        (concatenated along the input's split dimension; summed where every microbatch got the
 *        whole input). NULL entries (rp_tensor_list_get gives NULL) for inputs that are not
 *        floating point or that no layer reads (inputs after the first, unless the first layer
 *        takes every call input). Unscaled when loss scaling is on. Caller frees with
 *        rp_tensor_list_destroy.
 * @return as rp_backward, plus RP_ERR_INVALID_ARGUMENT when the forward's inputs were cut by a
 *         split callback (its pieces cannot be put back together; the forward's state is kept,
 *         so rp_backward still works). Thread: the thread driving this model.
 */
RP_API rp_status rp_backward_input_grads(rp_tensor_list **out_input_grads, rp_model *model,
                                         const DLManagedTensor *const *output_grads,
                                         size_t n_grads);

/* ---------------------------------------------------------------------------------------------
 * Optimizer
 * ------------------------------------------------------------------------------------------- */

/** Built-in optimizers (run on the CPU over fp32 master weights). */
typedef enum rp_optimizer_kind {
    RP_OPTIMIZER_ADAMW = 0,
    RP_OPTIMIZER_SGD = 1 /**< SGD with optional momentum and L2 weight decay, as torch.optim.SGD */
} rp_optimizer_kind;

/** Hyperparameters of a built-in optimizer. State (moments) lives in the model. */
typedef struct rp_optimizer rp_optimizer;

/** Create optimizer settings with PyTorch's defaults: AdamW lr 1e-3, betas (0.9, 0.999),
 * eps 1e-8, weight_decay 1e-2; SGD lr 1e-3, momentum 0, weight_decay 0.
 * Caller frees with rp_optimizer_destroy. @return RP_OK or RP_ERR_INVALID_ARGUMENT. */
RP_API rp_status rp_optimizer_create(rp_optimizer **out_optimizer, int32_t kind);

/** Free optimizer settings. NULL is ignored. */
RP_API void rp_optimizer_destroy(rp_optimizer *optimizer);

/** Learning rate (finite, >= 0). Takes effect at the next rp_step. */
RP_API rp_status rp_optimizer_set_learning_rate(rp_optimizer *optimizer, double lr);

/** AdamW betas, each in [0, 1). RP_ERR_INVALID_ARGUMENT for SGD settings. */
RP_API rp_status rp_optimizer_set_betas(rp_optimizer *optimizer, double beta1, double beta2);

/** AdamW epsilon (finite, > 0). RP_ERR_INVALID_ARGUMENT for SGD settings. */
RP_API rp_status rp_optimizer_set_eps(rp_optimizer *optimizer, double eps);

/** Weight decay (finite, >= 0): decoupled for AdamW, added to the gradient for SGD. */
RP_API rp_status rp_optimizer_set_weight_decay(rp_optimizer *optimizer, double weight_decay);

/** SGD momentum in [0, 1). RP_ERR_INVALID_ARGUMENT for AdamW settings. */
RP_API rp_status rp_optimizer_set_momentum(rp_optimizer *optimizer, double momentum);

/**
 * One Adam update of caller-owned tensors with the engine's CPU kernel (the one rp_step runs for
 * RP_OPTIMIZER_ADAMW), for optimizers whose state lives outside a model (Python's
 * roundpipe.optim.Adam inside a step callback). Stateless: the caller keeps the moments and the
 * step counts. Entry i computes what torch.optim.Adam computes for one parameter at step
 * `steps[i]` (fp32 rounding aside): with `decoupled_weight_decay` 1 the weight is first scaled
 * by 1 - lr * weight_decay (torch.optim.AdamW); with 0 the moments see grad + weight_decay *
 * param (torch.optim.Adam's default L2; the gradient tensor is not modified). Every argument is
 * checked before anything is written: on error no tensor has changed.
 * @param params, exp_avgs, exp_avg_sqs n_tensors borrowed tensors, updated in place.
 * @param grads n_tensors borrowed tensors, read only (they may share memory with each other).
 *        Every tensor: float32, contiguous, in host memory (kDLCPU or kDLCUDAHost); the four of
 *        entry i of one shape; no updated tensor overlapping any other tensor of the call.
 * @param steps n_tensors 1-based update numbers (bias correction), each >= 1.
 * @param n_tensors 0 (nothing to do) .. 2^24.
 * @param lr finite, >= 0. @param beta1, beta2 each in [0, 1). @param eps finite, >= 0.
 * @param weight_decay finite, >= 0. @param decoupled_weight_decay 0 or 1.
 * @return RP_OK; RP_ERR_INVALID_ARGUMENT naming the first bad argument or entry.
 * Thread: any thread; tensors may not be used by another thread during the call. The kernel
 * splits each tensor over the calling thread's OpenMP threads: on a model's optimizer thread
 * (inside a step callback) RP_OPTIMIZER_THREADS applies, as for rp_step.
 */
RP_API rp_status rp_adam_apply(DLManagedTensor *const *params,
                               const DLManagedTensor *const *grads,
                               DLManagedTensor *const *exp_avgs,
                               DLManagedTensor *const *exp_avg_sqs, const int64_t *steps,
                               size_t n_tensors, double lr, double beta1, double beta2,
                               double eps, double weight_decay, int32_t decoupled_weight_decay);

/**
 * Apply one optimizer step to the gradients accumulated since the previous step, then start
 * accumulating afresh. The settings are copied at the call.
 * Asynchronous (`is_async` != 0, recommended): returns at once; the step runs on the optimizer
 * thread while the next rp_forward_backward runs on the weights from before this step
 * (staleness 1, as upstream) in RP_HOST_MEMORY_STANDARD, or, in RP_HOST_MEMORY_SAVING, uploads
 * each stage as soon as the step has updated it (never stale). Synchronous: returns when the
 * updated weights are in use.
 * Calling it waits for the previous step if that one is still running: whatever it returns
 * (except RP_ERR_INVALID_ARGUMENT for bad arguments), every earlier step has finished.
 * A parameter that received no gradient since the previous step (no rp_forward_backward reached
 * it, and no rp_param_grad view of it was taken) is left alone, its optimizer state and step
 * count included, as torch.optim leaves a parameter whose .grad is None. A step whose gradients
 * hold inf or nan is skipped by default (rp_model_options_set_skip_nonfinite_steps).
 * @return RP_OK; RP_ERR_INVALID_ARGUMENT; RP_ERR_STATE when the model already holds optimizer
 *         state of another kind; RP_ERR_CALLBACK when a previous callback step failed.
 * Thread: the thread driving this model.
 */
RP_API rp_status rp_step(rp_model *model, const rp_optimizer *optimizer, int32_t is_async);

/**
 * User step function. Runs on the optimizer thread. Inside it, rp_param_master and rp_param_grad
 * give the master weights and the gradients of this step: update the master weights in place.
 * Only those functions and the rp_param_* queries may be called on `model` from it.
 * @return 0 on success; other values are reported as RP_ERR_CALLBACK by rp_step (sync) or, once,
 *         by the next rp_step / rp_synchronize (async), which then enqueues no step of its own;
 *         the weights stay as the callback left them.
 */
typedef int32_t (*rp_step_fn)(rp_model *model, void *user_data);

/** Like rp_step, but the update is `fn(model, user_data)` on the optimizer thread.
 * `user_data` must stay valid until the step has run (rp_synchronize guarantees it). */
RP_API rp_status rp_step_callback(rp_model *model, rp_step_fn fn, void *user_data,
                                  int32_t is_async);

/**
 * Steps inside the training calls (RP_HOST_MEMORY_SAVING). With `optimizer` given, every later
 * rp_forward_backward is also the optimizer step over its own gradients: the weights it leaves
 * are those of rp_forward_backward followed by rp_step(model, optimizer, 1), bit for bit, but
 * each parameter's update starts on the optimizer thread as soon as its gradient is final in the
 * call (the deepest stages first, while the GPUs back-propagate the stages below), so the step
 * hides behind the backward instead of holding back the next call's uploads. The call returns
 * without waiting for the last updates; the next call uploads each stage once it is updated,
 * as after an asynchronous rp_step. The settings are copied; NULL switches back to explicit
 * steps (rp_step, rp_step_callback), which are refused (RP_ERR_STATE) while this is on.
 * While on:
 *  - one call is one step: gradients are not accumulated over calls;
 *  - a parameter that received no gradient in the call is left alone, as by rp_step; a
 *    parameter whose gradient holds inf or nan is left alone too (its gradient dropped), the
 *    step is counted as skipped and logged at RP_LOG_WARN (rp_model_nonfinite_counts); a nan or
 *    inf loss makes every gradient behind it non-finite, so the whole step is skipped then.
 *    rp_model_set_skip_nonfinite_steps(model, 0) lets such updates through instead;
 *  - a call that fails before any gradient is final leaves no trace, as without this setting;
 *    one that fails later (a device or callback error in the backward) keeps the updates of the
 *    parameters whose gradients were final by then, logs how many at RP_LOG_WARN, and drops
 *    every other gradient of the call: the model stays usable;
 *  - with data parallelism each rank updates from the gradients averaged over the ranks, each
 *    as soon as its average is final, and the ranks decide alike (the non-finite flags are
 *    averaged with them). A failed collective can leave a rank with updates from a partial
 *    average; the group then refuses work, as without this setting: reload the weights.
 * @return RP_OK; RP_ERR_INVALID_ARGUMENT (NULL model, called from a step callback);
 *         RP_ERR_STATE, with nothing changed: the model is in RP_HOST_MEMORY_STANDARD (whose
 *         asynchronous steps already overlap a whole call), uses loss scaling (which needs every
 *         gradient before the first update), holds optimizer state of another kind, or holds
 *         gradients accumulated since its last step (rp_step or rp_zero_grad first).
 * Thread: the thread driving this model.
 */
RP_API rp_status rp_model_set_step_in_call(rp_model *model, const rp_optimizer *optimizer);

/** 1 when training calls step inside (rp_model_set_step_in_call), 0 otherwise. */
RP_API rp_status rp_model_step_in_call(int32_t *out_enabled, const rp_model *model);

/**
 * Wait for every pending step, then make the latest master weights the weights in use.
 * Afterwards rp_param_master shows the latest weights and rp_param_grad the gradients
 * accumulated since the last step. Like llama_synchronize: a point where nothing is in flight;
 * whatever it returns for a valid model, every step has finished and its user_data may be freed.
 * @return RP_OK, RP_ERR_INVALID_ARGUMENT, or RP_ERR_CALLBACK when an async callback step failed.
 * Thread: the thread driving this model.
 */
RP_API rp_status rp_synchronize(rp_model *model);

/** Drop the gradients accumulated since the last step. Thread: the thread driving this model. */
RP_API rp_status rp_zero_grad(rp_model *model);

/* ---------------------------------------------------------------------------------------------
 * Parameters
 * ------------------------------------------------------------------------------------------- */

/** Number of parameter tensors. */
RP_API rp_status rp_param_count(size_t *out_count, const rp_model *model);

/** Name of parameter `index` ("3.weight": layer index, then the layer's own name).
 * Library-owned, valid while the model lives. */
RP_API rp_status rp_param_name(const char **out_name, const rp_model *model, size_t index);

/** Index of the parameter called `name`. RP_ERR_INVALID_ARGUMENT when there is none. */
RP_API rp_status rp_param_find(size_t *out_index, const rp_model *model, const char *name);

/** Hugging Face tensor name of parameter `index` ("model.layers.2.mlp.up_proj.weight"), the name
 * rp_model_save_hf writes. Library-owned, valid while the model lives.
 * @return RP_OK; RP_ERR_STATE for a model not built from a Hugging Face config;
 *         RP_ERR_INVALID_ARGUMENT (NULL, index out of range). Any thread. */
RP_API rp_status rp_param_hf_name(const char **out_name, const rp_model *model, size_t index);

/** What a model tensor is (rp_layer_def_add_param, rp_layer_def_add_buffer). Built-in layers'
 * parameters are all RP_PARAM_TRAINABLE. Only trainable parameters have an fp32 master,
 * gradients and optimizer state; for the others rp_param_master gives the held value (in its
 * held dtype) and rp_param_grad fails. */
typedef enum rp_param_kind {
    RP_PARAM_TRAINABLE = 0,
    RP_PARAM_FROZEN = 1,
    RP_PARAM_BUFFER = 2
} rp_param_kind;

/** The rp_param_kind of tensor `index`. @return RP_OK or RP_ERR_INVALID_ARGUMENT. */
RP_API rp_status rp_param_kind_of(int32_t *out_kind, const rp_model *model, size_t index);

/** Shape of parameter `index`: `*out_ndim` receives the rank; up to `capacity` sizes are written
 * to `out_shape` (which may be NULL when capacity is 0). */
RP_API rp_status rp_param_shape(int64_t *out_shape, int32_t *out_ndim, int32_t capacity,
                                const rp_model *model, size_t index);

/**
 * Zero-copy view of the fp32 master weight of parameter `index`. Caller owns the DLPack struct
 * and calls its deleter; the memory stays valid as long as the view is held. Writes through it
 * change the master weight (take effect at the next rp_synchronize or step). Read it after
 * rp_synchronize, or inside a step callback; elsewhere an async step may be writing it.
 */
RP_API rp_status rp_param_master(DLManagedTensor **out_tensor, rp_model *model, size_t index);

/**
 * Zero-copy view of the gradient of parameter `index` (fp32; bf16 for bf16/fp16 models in
 * RP_HOST_MEMORY_SAVING): inside a step callback, the gradient of that step; elsewhere, the
 * gradient accumulated since the last step (read it after rp_synchronize). A view taken outside
 * a callback refers to that buffer only until the next rp_step; take a fresh one afterwards. In
 * memory-saving mode the buffer is the same one before and after a step, and the step zeroes it.
 * Caller owns the struct and calls its deleter.
 */
RP_API rp_status rp_param_grad(DLManagedTensor **out_tensor, rp_model *model, size_t index);

/**
 * Whether the gradient of parameter `index` received anything: inside a step callback, that
 * step's gradient; elsewhere, the gradient accumulated since the last step. A training call
 * that reached the parameter gives it one; so does an rp_param_grad view taken outside a step
 * callback (it may be written through). A parameter with none is what torch.optim sees as a
 * .grad of None: the built-in optimizers leave it alone (rp_step), and a step callback should
 * too (the Python binding's step functions see .grad None there). 0 for frozen parameters and
 * buffers, which have no gradient.
 * @return RP_OK, RP_ERR_INVALID_ARGUMENT (NULL pointer, index out of range).
 */
RP_API rp_status rp_param_grad_received(int32_t *out_received, const rp_model *model,
                                        size_t index);

/* ---------------------------------------------------------------------------------------------
 * Weights on disk
 * ------------------------------------------------------------------------------------------- */

/** Save the latest weights (synchronizes first) to a safetensors file, in the model dtype,
 * with the parameter names. Crash-safe: the file is written and synced as "<path>.tmp.<pid>" in
 * the same folder, renamed over `path`, and the folder synced, so `path` holds the old weights
 * or the new ones, whole, after a failure, a kill or a power cut. A temporary that a killed save
 * left is removed by the next save to `path` (docs/semantics.md, "Crash safety"). Data parallel:
 * only rank 0 writes; the other ranks synchronize and return RP_OK.
 * @return RP_OK, RP_ERR_INVALID_ARGUMENT, RP_ERR_IO (message names the path). */
RP_API rp_status rp_model_save(rp_model *model, const char *path);

/** Load every parameter from a safetensors file (any float dtype, converted). The file must hold
 * every parameter with the right shape; nothing is changed unless all of them load. The whole
 * header is checked before any tensor is read or allocated (offsets inside the file's real size,
 * shapes whose size fits int64, names, shapes and dtypes against the model), and only the
 * model's tensors are read: others are skipped, however large they claim to be.
 * Synchronizes first. Optimizer state is kept; accumulated gradients are dropped.
 * @return RP_OK, RP_ERR_INVALID_ARGUMENT, RP_ERR_IO (a missing, corrupt or truncated file, a
 *         directory; the message names the file and, where it applies, the tensor and the
 *         offending value). */
RP_API rp_status rp_model_load(rp_model *model, const char *path);

/* ---------------------------------------------------------------------------------------------
 * Hugging Face models (Qwen3ForCausalLM, Qwen3MoeForCausalLM, LlamaForCausalLM)
 *
 * A Hugging Face directory holds config.json and the weights, as model.safetensors or as shards
 * listed by model.safetensors.index.json. The model is the layer list token_embedding,
 * num_hidden_layers x decoder_layer (moe_decoder_layer for Qwen3-MoE's sparse layers), rms_norm,
 * lm_head (docs/semantics.md); parameter "0.weight" is "model.embed_tokens.weight", "<i>.<name>"
 * of decoder layer i is "model.layers.<i - 1>.<name>", then "model.norm.weight" and
 * "lm_head.weight" (absent when tie_word_embeddings: the LM head shares "0.weight"). The stacked
 * expert weights of a sparse layer (transformers 5's in-memory "mlp.experts.gate_up_proj" and
 * "mlp.experts.down_proj") are read and written one tensor per expert and projection, as
 * Qwen3-MoE checkpoints store them ("mlp.experts.<e>.gate_proj.weight", ...).
 * Inputs of rp_forward / rp_forward_backward: input 0 token ids [batch, seq] (int64 or int32);
 * optional input 1 attention mask [batch, seq] (non-zero: a real token, 0: padding); optional
 * input 2 position ids [batch, seq] (default 0 .. seq - 1 in every row). rp_forward returns the
 * logits [batch, seq, vocab]; train with RP_LOSS_CAUSAL_LM and token labels.
 * ------------------------------------------------------------------------------------------- */

/**
 * Build a model from a Hugging Face model directory: config.json and its weights, read through
 * memory maps and converted to the model dtype (stored as float32, float16 or bfloat16).
 * @param out_model receives the model; caller frees with rp_model_destroy.
 * @param dir the directory, borrowed.
 * @param options borrowed; NULL means defaults (the seed is unused).
 * @return RP_OK; RP_ERR_IO for a missing, corrupt or truncated file, a missing shard, a missing
 *         tensor or one of the wrong shape or dtype (the message names the file and the tensor);
 *         RP_ERR_INVALID_ARGUMENT for an unsupported architecture or feature (the message names
 *         the config key) or bad options; RP_ERR_CUDA; RP_ERR_OUT_OF_MEMORY.
 * Thread: any thread.
 */
RP_API rp_status rp_model_create_from_hf(rp_model **out_model, const char *dir,
                                         const rp_model_options *options);

/**
 * Build a model from the text of a Hugging Face config.json, with weights initialised from the
 * seed as transformers does (normal(0, initializer_range) for embeddings and projections, ones
 * for norms, zeros for biases). For benchmarks and tests; rp_model_save_hf writes it as a
 * single-file checkpoint.
 * @param out_model receives the model; caller frees with rp_model_destroy.
 * @param config_json NUL-terminated JSON text, borrowed.
 * @param options borrowed; NULL means defaults.
 * @return RP_OK; RP_ERR_INVALID_ARGUMENT for bad JSON, an unsupported architecture or feature,
 *         or bad options; RP_ERR_CUDA; RP_ERR_OUT_OF_MEMORY.
 * Thread: any thread.
 */
RP_API rp_status rp_model_create_from_hf_config(rp_model **out_model, const char *config_json,
                                                const rp_model_options *options);

/**
 * Load the weights of a Hugging Face directory into a model built by rp_model_create_from_hf or
 * rp_model_create_from_hf_config (config.json of `dir` is not read). Every tensor is checked
 * before any weight changes: on error the model is unchanged. Only model.safetensors or the shards
 * the index names are opened (never the files of an unfinished save), and tensors the model does
 * not use are never read. Synchronizes first; optimizer state is kept; accumulated gradients are
 * dropped. Later saves use the layout of `dir`.
 * @param model the model.
 * @param dir the directory, borrowed.
 * @return RP_OK; RP_ERR_IO as for rp_model_create_from_hf; RP_ERR_STATE for a model not built
 *         from a Hugging Face config; RP_ERR_INVALID_ARGUMENT.
 * Thread: the thread driving this model.
 */
RP_API rp_status rp_model_load_hf(rp_model *model, const char *dir);

/**
 * Save the latest weights (synchronizes first) as a Hugging Face directory that transformers
 * loads unchanged: config.json (its "dtype" set to the model dtype) and the weights in the model
 * dtype with Hugging Face tensor names, in the layout of the checkpoint last loaded (one file, or
 * the same shards and index). `dir` is created if missing (its parent must exist). Tokenizer
 * files are not copied. Crash-safe: after a failure, a kill or a power cut at any moment, `dir`
 * loads (here and in transformers) as the old weights or the new ones, never a mix. One file is
 * written and synced under a temporary name, then renamed over model.safetensors. Shards are
 * written beside the old ones (under the layout's names, or, where a load may be reading those,
 * as "<stem>.rp-gen<N>.safetensors"), then model.safetensors.index.json, written last, switches
 * to them in one rename, and the old shards are removed. config.json is replaced, by its own
 * rename right after the weights, only when it changes. What a killed save left (temporaries,
 * shards no index names) is removed by the next save to `dir` (docs/semantics.md, "Crash
 * safety"). Data parallel: only rank 0 writes; the other ranks synchronize and return RP_OK.
 * @param model the model.
 * @param dir the directory, borrowed.
 * @return RP_OK; RP_ERR_IO (the message names the path); RP_ERR_STATE for a model not built from
 *         a Hugging Face config; RP_ERR_INVALID_ARGUMENT.
 * Thread: the thread driving this model.
 */
RP_API rp_status rp_model_save_hf(rp_model *model, const char *dir);

/**
 * The LoRA configuration of a model (rp_model_options_set_lora): `*out_rank` 0 when it has no
 * adapters (then the other outputs are 0, 0 and ""). `out_target_modules` receives the adapted
 * projections, comma-separated in layer order ("q_proj,v_proj"); library-owned, valid while the
 * model lives. Any output may be NULL. Adapter parameters are the RP_PARAM_TRAINABLE ones;
 * rp_param_hf_name names them "model.layers.<i>.self_attn.q_proj.lora_A.weight".
 * @return RP_OK or RP_ERR_INVALID_ARGUMENT. Thread: any thread.
 */
RP_API rp_status rp_model_lora(int32_t *out_rank, double *out_alpha, double *out_dropout,
                               const char **out_target_modules, const rp_model *model);

/**
 * Save the adapters of a LoRA model (synchronizes first) in PEFT's format, so that
 * PeftModel.from_pretrained(base, dir) loads them: `dir`/adapter_config.json and
 * `dir`/adapter_model.safetensors (fp32 master weights, named
 * "base_model.model.model.layers.<i>.<module>.lora_A.weight"). `dir` is created if missing (its
 * parent must exist). Each file is replaced crash-safely (the weights first, then the config).
 * Data parallel: only rank 0 writes.
 * @param base_model written as base_model_name_or_path (NULL: null); borrowed.
 * @return RP_OK; RP_ERR_IO (the message names the path); RP_ERR_STATE for a model not built from
 *         a Hugging Face config; RP_ERR_INVALID_ARGUMENT (NULL, or a model without adapters).
 * Thread: the thread driving this model.
 */
RP_API rp_status rp_model_save_lora(rp_model *model, const char *dir, const char *base_model);

/**
 * Load adapters saved by rp_model_save_lora or by PEFT (save_pretrained of a PeftModel) into a
 * LoRA model. adapter_config.json must describe the model's adapters (PEFT type LORA, the same
 * rank, lora_alpha and target_modules, plain LoRA: no DoRA, rsLoRA, patterns or
 * modules_to_save); lora_dropout may differ. adapter_model.safetensors must hold exactly the
 * model's adapter tensors with their shapes. Everything is checked before any weight changes.
 * Synchronizes first; optimizer state is kept; accumulated gradients are dropped.
 * @return RP_OK; RP_ERR_INVALID_ARGUMENT for a configuration or tensor that does not match the
 *         model (the message names the key or the tensor), NULL, or a model without adapters;
 *         RP_ERR_IO for a missing, corrupt or truncated file; RP_ERR_STATE for a model not built
 *         from a Hugging Face config.
 * Thread: the thread driving this model.
 */
RP_API rp_status rp_model_load_lora(rp_model *model, const char *dir);

/** ABI version this header describes. */
#define RP_ABI_VERSION 1

#ifdef __cplusplus
}
#endif

#endif /* ROUNDPIPE_H */
