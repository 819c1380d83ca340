/*
 * test_support.h - helpers shared by the CMocka tests: DLPack tensors built from C arrays
 * (contiguous and strided), status/message assertions, parameter snapshots, comparison with
 * the libtorch reference (reference/reference.h).
 *
 * A test file includes only this header first: it brings cmocka.h (with the headers cmocka
 * needs before it), roundpipe.h and the reference.
 */
#ifndef RP_TEST_SUPPORT_H
#define RP_TEST_SUPPORT_H

/* cmocka.h needs these first */
// clang-format off
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>
// clang-format on

#include "reference/reference.h"
#include "roundpipe.h"

/* ---- DLPack tensors owned by the tests ---------------------------------------------------- */

/** fp32 CPU tensor holding a copy of `values` (NULL: zeros). Free with ts_free. */
DLManagedTensor *ts_f32(int32_t ndim, const int64_t *shape, const float *values);
/** int64 CPU tensor holding a copy of `values` (NULL: zeros). */
DLManagedTensor *ts_i64(int32_t ndim, const int64_t *shape, const int64_t *values);
/** float64 CPU tensor holding `values` converted to double. */
DLManagedTensor *ts_f64(int32_t ndim, const int64_t *shape, const float *values);
/** fp32 CPU tensor whose logical (row-major) values are `values`, stored with the given element
 * strides (e.g. {1, rows} for a column-major matrix). */
DLManagedTensor *ts_f32_strided(int32_t ndim, const int64_t *shape, const int64_t *strides,
                                const float *values);
/** A tensor with any dtype and device; `data` is a zeroed host buffer of `bytes` bytes (never
 * dereferenced as device memory by the tests). strides may be NULL. */
DLManagedTensor *ts_raw(DLDataType dtype, DLDevice device, int32_t ndim, const int64_t *shape,
                        const int64_t *strides, size_t bytes);
/** Call the deleter (NULL is ignored). */
void ts_free(DLManagedTensor *t);
int64_t ts_numel(const DLTensor *t);
/** Copy an fp32 CPU tensor (any strides) into `out` in row-major order. Asserts dtype/device. */
void ts_read_f32(const DLTensor *t, float *out);

extern const DLDataType TS_F32, TS_F64, TS_I64, TS_I32, TS_F16;
extern const DLDevice TS_CPU, TS_CUDA0;

/** Deterministic pseudo-random values in [lo, hi). */
void ts_fill_uniform(float *out, int64_t n, uint64_t seed, float lo, float hi);

/* ---- status assertions -------------------------------------------------------------------- */

/** Assert `status == RP_OK`, printing the library's message otherwise. */
#define TS_OK(call) ts_ok((call), #call, __FILE__, __LINE__)
void ts_ok(rp_status status, const char *expr, const char *file, int line);

/**
 * Assert that `call` returned `expected` with a non-empty message that contains each of the
 * given substrings (case-insensitive; "a|b" accepts either alternative). NULL-terminated list.
 */
#define TS_ERR(call, expected, ...)                                                                \
    ts_err((call), (expected), #call, __FILE__, __LINE__, (const char *[]){__VA_ARGS__, NULL})
void ts_err(rp_status status, rp_status expected, const char *expr, const char *file, int line,
            const char *const *needles);

/** Case-insensitive substring test; "a|b" alternatives. */
int ts_contains(const char *haystack, const char *needle_alternatives);

/* ---- models ------------------------------------------------------------------------------- */

/** Create a model on `devices` CPU worker devices (or, with RP_TEST_DEVICE=cuda, on that many
 * GPUs but no more than are visible), optional explicit plan (NULL: automatic), asserting
 * success. */
rp_model *ts_model(const char *spec, uint64_t seed, int32_t devices, const int32_t *plan,
                   size_t plan_len);
/** Device kind used by ts_model: RP_DEVICE_CPU, or RP_DEVICE_CUDA when the environment
 * variable RP_TEST_DEVICE is "cuda". */
int32_t ts_device_kind(void);
/** True, after printing why, when ts_device_kind() is RP_DEVICE_CUDA and no GPU is visible: a
 * GPU test's main then returns 77, ctest's skip code. */
int ts_gpu_missing(void);
/** `wanted`, capped at the number of visible GPUs when ts_device_kind() is RP_DEVICE_CUDA. */
int32_t ts_devices(int32_t wanted);

/** Model options with `seed` and `devices` worker devices of ts_device_kind() (capped by
 * ts_devices), asserting success: a test adds its own settings, then ts_model_with_options. */
rp_model_options *ts_options(uint64_t seed, int32_t devices);
/** rp_model_create of `spec` with `options`, asserting success; destroys `options`. */
rp_model *ts_model_with_options(const char *spec, rp_model_options *options);
/** The same with rp_model_create_from_hf_config and a config.json text. */
rp_model *ts_hf_model_with_options(const char *config, rp_model_options *options);

/** Run configuration with num_microbatch and grain set (grain 0 leaves it unset). */
rp_run_config *ts_config(int32_t num_microbatch, int32_t grain);
/** AdamW with learning rate `lr`, every other hyperparameter at its default. */
rp_optimizer *ts_adamw(double lr);

/** A snapshot of every parameter (master weights or gradients) of a model. */
typedef struct ts_params {
    size_t count;
    char **names;
    int64_t *numel;
    float **data;
} ts_params;

/** Snapshot of the master weights (rp_synchronize first). */
ts_params *ts_masters(rp_model *model);
/** Snapshot of the accumulated gradients (rp_synchronize first). */
ts_params *ts_grads(rp_model *model);
void ts_params_free(ts_params *p);
/** Assert bitwise equality of two snapshots. */
void ts_assert_params_equal(const ts_params *a, const ts_params *b);
/** Assert every value of a snapshot is zero (e.g. gradients), naming the first that is not. */
void ts_assert_all_zero(const ts_params *p);
/** Norm-based relative error ||a - b|| / max(||b||, floor), in double. */
double ts_rel_err(const float *a, const float *b, int64_t n, double floor);
/** Assert per-parameter ts_rel_err(a, b) <= tol (floor 1e-6); `what` names the quantity. */
void ts_assert_params_close(const ts_params *a, const ts_params *b, double tol, const char *what);

/** Write one fp32 value into parameter `index`'s master weight through rp_param_master, then
 * rp_synchronize so that it is in use. */
void ts_set_master(rp_model *model, size_t index, const float *values, int64_t numel);
/** Number of elements of parameter `index` (rp_param_shape). */
int64_t ts_param_numel(const rp_model *model, size_t index);

/* ---- the reference ------------------------------------------------------------------------ */

/** Build the reference for `spec`, check that its parameter names, order and shapes are those
 * of the model, and copy the model's master weights into it. */
ref_model *ts_reference_from(rp_model *model, const char *spec, uint64_t seed);
/** Snapshot of the reference's weights / gradients, in the model's parameter order. */
ts_params *ts_ref_params(const ref_model *ref, int grads);
/** ts_assert_params_close of the model's master weights (ts_masters) / accumulated gradients
 * (ts_grads) against the reference's, `what` naming them in a failure. */
void ts_assert_masters_match(rp_model *model, const ref_model *ref, double tol, const char *what);
void ts_assert_grads_match(rp_model *model, const ref_model *ref, double tol, const char *what);

/** The reference's training call with the MSE loss (scale 1) on `rows` rows of inputs `x`
 * (`in` wide) and labels `y` (`out` wide), both split along dim 0 into `num_microbatch`;
 * `call_index` is the dropout rule's k. Fails the test on a reference error; returns the loss. */
double ts_ref_mse_call(ref_model *ref, const float *x, const float *y, int64_t rows, int64_t in,
                       int64_t out, int32_t num_microbatch, int64_t call_index);
/** Assert |got - want| <= rel * |want| for the losses of iteration `it`. */
void ts_assert_loss_close(double got, double want, double rel, int it);
/** The model's master weights against the reference's after step `step` (0-based) of an
 * optimizer whose state is stored in bf16 (RP_HOST_MEMORY_SAVING): the first step computes from
 * fp32 state, so ts_assert_params_close at 1e-5 (`first_what` names the weights); later steps
 * read state rounded to bf16, so every weight within 1e-3 absolute (each caller derives it). */
void ts_assert_masters_follow_bf16_state(rp_model *model, const ref_model *ref, int step,
                                         const char *first_what);

/**
 * Proof that a model still trains correctly (used after bad-input calls): copy its weights into
 * a fresh reference, run two iterations of forward_backward (MSE, 2 microbatches, 8 rows of
 * `in_features` -> `out_features`) + synchronous AdamW (lr 1e-2) on both, and assert that the
 * losses (rel 1e-5) and the weights (rel 1e-4) agree and that the loss fell. The model must not
 * hold optimizer state yet, and must contain no dropout.
 */
void ts_assert_trains_like_reference(rp_model *model, const char *spec, int64_t in_features,
                                     int64_t out_features);

/* ---- a caller layer that fails on demand ------------------------------------------------- */

/** "c:tripwire": a parameter-free caller layer that passes its input through (fp32 or bf16 in,
 * fp32 out; the engine converts it back to the model dtype) and, while *fail is nonzero, fails
 * (status 5) in the backward of microbatch 1, the last of ts_config(2, 0)'s two. In the first
 * stage every deeper stage has back-propagated its last microbatch by then (the failing backward
 * needs that gradient), so their gradients are final and the first stage's never is. (Failing
 * on an earlier microbatch would race the deeper stages' later microbatches.) CPU devices only:
 * the callbacks read the tensors on the host. The caller destroys the definition. */
rp_layer_def *ts_tripwire_def(int *fail);
/** A model spec with the tripwire (caller def 0) third: linear 6 -> 24, tanh, tripwire, then
 * linear 24 -> 24, tanh, linear 24 -> 24, tanh, linear 24 -> 3 (8 layers). */
extern const char *const TS_TRIPWIRE_SPEC;
/** TS_TRIPWIRE_SPEC without the tripwire: linear 6 -> 24, tanh, linear 24 -> 24, tanh,
 * linear 24 -> 24, tanh, linear 24 -> 3 (7 layers), for the models trained beside one. */
extern const char *const TS_MLP_SPEC;
/** A model of TS_TRIPWIRE_SPEC with ts_tripwire_def(fail) on 3 CPU devices in four stages
 * {3, 2, 2, 1} (the tripwire in the first), built with `options` (seed, dtype, mode: this sets
 * the devices and the plan) and destroying them. */
rp_model *ts_tripwire_model(int *fail, rp_model_options *options);

/* ---- files and Hugging Face names --------------------------------------------------------- */

/** A small model of several parameter kinds, for the weights-on-disk tests: linear 5 -> 9,
 * layer_norm 9, residual_mlp 9 (hidden 13), linear 9 -> 2 without bias (input 5, output 2). */
extern const char *const TS_DISK_SPEC;
/** A tiny Qwen3 config.json for the Hugging Face file tests: vocabulary 40, hidden 32,
 * intermediate 48, 2 decoder layers, 4 query / 2 key-value heads of 8, untied, float32. */
extern const char *const TS_QWEN3_CONFIG;

/** The Hugging Face name of parameter `ours` of a decoder model with `num_layers` decoder layers
 * (written from the table in roundpipe.h): embedding, layers, final norm, LM head. */
void ts_hf_name(char *out, size_t cap, const char *ours, int num_layers);

/** A fresh empty directory under /tmp (caller frees the string; ts_rmdir removes it). */
char *ts_tempdir(void);
void ts_rmdir(const char *dir);
/** Number of directory entries (excluding . and ..). */
int ts_dir_entries(const char *dir);

#endif /* RP_TEST_SUPPORT_H */
