/*
 * reference.h - an independent libtorch reference for the RoundPipe test suite.
 *
 * It shares no code with src/: it parses the JSON model spec itself (nlohmann), builds every
 * layer from plain torch ops, runs each microbatch with full autograd (no pipeline, no
 * recompute) following docs/semantics.md, and steps with torch::optim::AdamW / SGD. Initial
 * weights are copied in from the model under test (ref_set_param), so both start equal.
 *
 * Every function that can fail returns 0 on success and -1 on failure; ref_last_error() then
 * says why. Callable from C.
 */
#ifndef RP_TEST_REFERENCE_H
#define RP_TEST_REFERENCE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ref_model ref_model;

/** A borrowed, contiguous, row-major host tensor: fp32 (is_int64 == 0) or int64. */
typedef struct ref_tensor {
    const void *data;
    int32_t is_int64;
    int32_t ndim;
    const int64_t *shape;
} ref_tensor;

/** Loss kinds, numbered as rp_loss_kind. */
enum { REF_LOSS_OUTPUT = 0, REF_LOSS_MSE = 1, REF_LOSS_CROSS_ENTROPY = 2 };

/** Split dimension meaning "every microbatch gets the whole tensor" (RP_SPLIT_REPLICATE). */
#define REF_SPLIT_REPLICATE (-1)

/** Arguments of one training call. */
typedef struct ref_fb_args {
    ref_tensor input;
    const ref_tensor *labels; /**< NULL: no labels */
    int32_t num_microbatch;   /**< >= 1 */
    int32_t input_split_dim;  /**< >= 0, or REF_SPLIT_REPLICATE */
    int32_t label_split_dim;  /**< >= 0, or REF_SPLIT_REPLICATE */
    int64_t call_index;       /**< k of the dropout rule: index of this training call */
    int32_t loss_kind;        /**< REF_LOSS_* */
    double scale;             /**< loss scale */
} ref_fb_args;

/** Message of the last failure on this thread ("" when none). */
const char *ref_last_error(void);

/** SplitMix64 finaliser, as docs/semantics.md defines `mix`. */
uint64_t ref_mix(uint64_t x);

/** Parse a spec and build the layers. `seed` is the model seed (used by dropout). Parameters
 * start at zero: copy the model's initial weights in with ref_set_param. NULL on failure. */
ref_model *ref_create(const char *spec_json, uint64_t seed);
void ref_destroy(ref_model *model);

size_t ref_param_count(const ref_model *model);
/** Name of parameter `index` following the semantics' naming and order; NULL out of range. */
const char *ref_param_name(const ref_model *model, size_t index);
/** Number of elements of parameter `name`, -1 when there is none. */
int64_t ref_param_numel(const ref_model *model, const char *name);
/** Rank of parameter `name` (-1 when none); up to `capacity` sizes go to `out_shape`. */
int32_t ref_param_shape(const ref_model *model, const char *name, int64_t *out_shape,
                        int32_t capacity);

int ref_set_param(ref_model *model, const char *name, const float *data, int64_t numel);
int ref_get_param(const ref_model *model, const char *name, float *out, int64_t numel);
/** Gradient accumulated since the last step (zeros when none). */
int ref_get_grad(const ref_model *model, const char *name, float *out, int64_t numel);
void ref_zero_grad(ref_model *model);

/**
 * Training call: split, per microbatch forward in training mode (dropout masks by the seeding
 * rule), loss times scale, backward; gradients accumulate. `out_loss` receives the sum of the
 * microbatch losses. When `out_output` is not NULL the merged output (concatenated along dim 0,
 * 0-d outputs averaged) is written there; `*out_output_numel` (may be NULL) receives its size.
 * Fails when the output has more than `output_capacity` elements.
 */
int ref_forward_backward(ref_model *model, double *out_loss, float *out_output,
                         int64_t output_capacity, int64_t *out_output_numel,
                         const ref_fb_args *args);

/** Inference in evaluation mode, split into `num_microbatch` pieces along dim 0 and merged. */
int ref_forward(ref_model *model, float *out_output, int64_t output_capacity,
                int64_t *out_output_numel, const ref_tensor *input, int32_t num_microbatch);

/** One torch::optim::AdamW step over the accumulated gradients, then zero them. The optimizer
 * (and its state) is created at the first call; later calls update its hyperparameters. */
int ref_step_adamw(ref_model *model, double lr, double beta1, double beta2, double eps,
                   double weight_decay);
/** One torch::optim::SGD step (dampening 0, no Nesterov), then zero the gradients. */
int ref_step_sgd(ref_model *model, double lr, double momentum, double weight_decay);

/* ---- safetensors, read and written with nlohmann + torch, independently of src/io ---- */

typedef struct ref_st ref_st;

/** Parse a safetensors file. NULL on failure (ref_last_error says why). */
ref_st *ref_st_open(const char *path);
void ref_st_close(ref_st *file);
size_t ref_st_count(const ref_st *file);
const char *ref_st_name(const ref_st *file, size_t index);
/** dtype string of tensor `name` ("F32", "BF16", ...), NULL when absent. */
const char *ref_st_dtype(const ref_st *file, const char *name);
/** Rank of tensor `name` (-1 when absent); up to `capacity` sizes go to `out_shape`. */
int32_t ref_st_shape(const ref_st *file, const char *name, int64_t *out_shape, int32_t capacity);
/** Values of tensor `name` converted to fp32. */
int ref_st_get_f32(const ref_st *file, const char *name, float *out, int64_t numel);

/** One tensor for ref_st_write: fp32 values written as `dtype` ("F32", "F64", "F16", "BF16"). */
typedef struct ref_st_entry {
    const char *name;
    const char *dtype;
    int32_t ndim;
    const int64_t *shape;
    const float *values;
} ref_st_entry;

/** Write a well-formed safetensors file. */
int ref_st_write(const char *path, const ref_st_entry *entries, size_t n);

#ifdef __cplusplus
}
#endif

#endif /* RP_TEST_REFERENCE_H */
