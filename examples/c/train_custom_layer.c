/*
 * train_custom_layer.c - a layer of your own, in plain C, trained by RoundPipe.
 *
 * The model is  linear 8 -> 16,  swish with a learned slope (ours),  linear 16 -> 1.  The
 * swish layer y = x * sigmoid(a * x), with one trainable slope a per feature, is declared with
 * rp_layer_def_create: RoundPipe owns `a` (master weight, gradient, AdamW state, save/load)
 * and calls our forward and backward on its CPU worker devices, where the tensors are plain
 * host memory. Each layer gets a stage of its own, so ours runs as a forward stage (FORWARD),
 * then again in backward (RECOMPUTE, keeping what backward needs in a context), then backward.
 *
 * Prints the loss of each of 30 steps and fails unless the last is below half of the first.
 * Usage: train_custom_layer
 */
#define _POSIX_C_SOURCE 200809L

#include "example_util.h"

#include <math.h>

enum { ROWS = 24, COLS = 8, HIDDEN = 16, STEPS = 30, MICROBATCHES = 3 };

static const char *const SPEC = "{\"layers\":["
                                "{\"type\":\"linear\",\"in\":8,\"out\":16},"
                                "{\"type\":\"caller\",\"def\":0},"
                                "{\"type\":\"linear\",\"in\":16,\"out\":1}]}";

/* ---- a host tensor RoundPipe can own ------------------------------------------------------ */

/* One malloc block: the DLPack struct, the shape and the data; the deleter frees the block. */
typedef struct owned_tensor {
    DLManagedTensor managed;
    int64_t shape[2];
    float data[];
} owned_tensor;

static void free_owned(DLManagedTensor *self) { free(self->manager_ctx); }

static DLManagedTensor *new_tensor(int32_t ndim, const int64_t *shape) {
    int64_t n = 1;
    for (int32_t d = 0; d < ndim; ++d)
        n *= shape[d];
    owned_tensor *t = calloc(1, sizeof *t + (size_t)n * sizeof(float));
    if (!t)
        return NULL;
    memcpy(t->shape, shape, (size_t)ndim * sizeof(int64_t));
    t->managed.dl_tensor.data = t->data;
    t->managed.dl_tensor.device.device_type = kDLCPU;
    t->managed.dl_tensor.ndim = ndim;
    t->managed.dl_tensor.dtype.code = kDLFloat;
    t->managed.dl_tensor.dtype.bits = 32;
    t->managed.dl_tensor.dtype.lanes = 1;
    t->managed.dl_tensor.shape = t->shape;
    t->managed.manager_ctx = t;
    t->managed.deleter = free_owned;
    return &t->managed;
}

/* The fp32 elements of a lent tensor. On CPU worker devices of an fp32 model, the engine lends
 * compact fp32 host tensors; anything else is refused rather than misread. */
static float *elements(const DLManagedTensor *t) {
    const DLTensor *d = &t->dl_tensor;
    if (d->device.device_type != kDLCPU || d->dtype.code != kDLFloat || d->dtype.bits != 32)
        return NULL;
    if (d->strides) { /* strides given: they must be the compact ones */
        int64_t expect = 1;
        for (int32_t k = d->ndim - 1; k >= 0; --k) {
            if (d->shape[k] != 1 && d->strides[k] != expect)
                return NULL;
            expect *= d->shape[k];
        }
    }
    return (float *)((char *)d->data + d->byte_offset);
}

/* ---- the layer: y = x * sigmoid(a * x), a [HIDDEN] ---------------------------------------- */

/* What backward needs: a copy of the input and of the slopes of this microbatch's forward. */
typedef struct swish_context {
    int64_t rows;
    float *x, a[HIDDEN];
} swish_context;

static float sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

static int32_t swish_forward(rp_tensor_list *out, void **inout_context, const rp_layer_call *call,
                             const DLManagedTensor *const *inputs, size_t n_inputs, void *ud) {
    (void)ud;
    int32_t phase = 0;
    const DLManagedTensor *const *params = NULL;
    size_t n_params = 0;
    if (rp_layer_call_info(&phase, NULL, NULL, NULL, NULL, NULL, NULL, call) != RP_OK ||
        rp_layer_call_tensors(&params, &n_params, NULL, NULL, call) != RP_OK || n_inputs != 1 ||
        n_params != 1)
        return 1;
    const DLTensor *xt = &inputs[0]->dl_tensor;
    const float *x = elements(inputs[0]), *a = elements(params[0]);
    if (!x || !a || xt->ndim != 2 || xt->shape[1] != HIDDEN)
        return 1;
    int64_t rows = xt->shape[0];
    DLManagedTensor *yt = new_tensor(2, xt->shape);
    if (!yt)
        return 1;
    float *y = yt->dl_tensor.data;
    for (int64_t i = 0; i < rows * HIDDEN; ++i)
        y[i] = x[i] * sigmoid(a[i % HIDDEN] * x[i]);
    if (rp_tensor_list_push(out, yt) != RP_OK) /* the list owns yt now, also on failure */
        return 1;
    if (phase == RP_PHASE_FORWARD)
        return 0; /* no gradient wanted: nothing to keep */
    swish_context *c = malloc(sizeof *c);
    if (!c)
        return 1;
    c->rows = rows;
    c->x = malloc((size_t)(rows * HIDDEN) * sizeof(float));
    if (!c->x) {
        free(c);
        return 1;
    }
    memcpy(c->x, x, (size_t)(rows * HIDDEN) * sizeof(float));
    memcpy(c->a, a, sizeof c->a);
    *inout_context = c; /* RoundPipe calls swish_release once, after backward or on failure */
    return 0;
}

static int32_t swish_backward(rp_tensor_list *input_grads, rp_tensor_list *param_grads,
                              void *context, const rp_layer_call *call,
                              const DLManagedTensor *const *output_grads, size_t n_outputs,
                              void *ud) {
    (void)call;
    (void)ud;
    swish_context *c = context;
    const float *g = n_outputs == 1 && output_grads[0] ? elements(output_grads[0]) : NULL;
    if (!c || !g)
        return 1;
    int64_t shape[2] = {c->rows, HIDDEN}, pshape[1] = {HIDDEN};
    DLManagedTensor *dxt = new_tensor(2, shape), *dat = new_tensor(1, pshape);
    if (!dxt || !dat) {
        if (dxt)
            dxt->deleter(dxt);
        if (dat)
            dat->deleter(dat);
        return 1;
    }
    float *dx = dxt->dl_tensor.data, *da = dat->dl_tensor.data;
    for (int64_t i = 0; i < c->rows * HIDDEN; ++i) {
        float x = c->x[i], a = c->a[i % HIDDEN], s = sigmoid(a * x);
        dx[i] = g[i] * (s + a * x * s * (1.0f - s)); /* d/dx x s(ax) */
        da[i % HIDDEN] += g[i] * x * x * s * (1.0f - s); /* d/da x s(ax) */
    }
    /* One gradient per input, one per parameter, in order; RoundPipe owns them. */
    int failed = rp_tensor_list_push(input_grads, dxt) != RP_OK;
    failed |= rp_tensor_list_push(param_grads, dat) != RP_OK;
    return failed;
}

static void swish_release(void *context, void *ud) {
    (void)ud;
    swish_context *c = context;
    free(c->x);
    free(c);
}

/* ---- training ----------------------------------------------------------------------------- */

static void make_data(float x[ROWS][COLS], float y[ROWS][1]) {
    uint64_t state = 7; /* a 64-bit LCG: the same data on every machine */
    for (int i = 0; i < ROWS; ++i) {
        double sum = 0.0;
        for (int j = 0; j < COLS; ++j) {
            state = state * 6364136223846793005ULL + 1442695040888963407ULL;
            x[i][j] = (float)(state >> 40) / 8388608.0f - 1.0f;
            sum += (j % 2 ? 1.0 : -0.5) * x[i][j] * x[i][j];
        }
        y[i][0] = (float)sum;
    }
}

int main(void) {
    /* The layer: its callbacks and its one parameter, slopes starting at 1. */
    rp_layer_def *swish = NULL;
    CHECK(rp_layer_def_create(&swish, "c:learned_swish", swish_forward, swish_backward,
                              swish_release, NULL));
    float ones[HIDDEN];
    for (int i = 0; i < HIDDEN; ++i)
        ones[i] = 1.0f;
    example_tensor slope;
    const int64_t slope_shape[1] = {HIDDEN};
    example_tensor_f32(&slope, ones, 1, slope_shape);
    CHECK(rp_layer_def_add_param(swish, "slope", &slope.managed, 1)); /* 1: trainable */

    /* 2 CPU worker devices, one layer per stage, 3 microbatches per call. */
    rp_model_options *options = NULL;
    rp_run_config *config = NULL;
    rp_model *model = NULL;
    const int32_t plan[3] = {1, 1, 1};
    CHECK(rp_model_options_create(&options));
    CHECK(rp_model_options_set_seed(options, 3));
    CHECK(rp_model_options_set_devices(options, RP_DEVICE_CPU, 2));
    CHECK(rp_model_options_set_stage_plan(options, plan, 3));
    CHECK(rp_run_config_create(&config));
    CHECK(rp_run_config_set_num_microbatch(config, MICROBATCHES));
    CHECK(rp_model_options_set_run_config(options, config));
    const rp_layer_def *defs[1] = {swish};
    CHECK(rp_model_create_with_layers(&model, SPEC, defs, 1, options));
    rp_layer_def_destroy(swish); /* the model keeps its own copy */
    rp_run_config_destroy(config);
    rp_model_options_destroy(options);

    static float x[ROWS][COLS], y[ROWS][1];
    make_data(x, y);
    example_tensor xt, yt;
    const int64_t xs[2] = {ROWS, COLS}, ys[2] = {ROWS, 1};
    example_tensor_f32(&xt, &x[0][0], 2, xs);
    example_tensor_f32(&yt, &y[0][0], 2, ys);
    const DLManagedTensor *inputs[1] = {&xt.managed};

    rp_loss *loss = NULL;
    rp_optimizer *adamw = NULL;
    CHECK(rp_loss_create(&loss, RP_LOSS_MSE));
    CHECK(rp_loss_set_scale(loss, 1.0 / MICROBATCHES)); /* the mean over the batch */
    CHECK(rp_optimizer_create(&adamw, RP_OPTIMIZER_ADAMW));
    CHECK(rp_optimizer_set_learning_rate(adamw, 2e-2));
    double first = 0.0, last = 0.0;
    for (int step = 0; step < STEPS; ++step) {
        double value = 0.0;
        CHECK(rp_forward_backward(&value, NULL, model, inputs, 1, &yt.managed, loss, NULL));
        CHECK(rp_step(model, adamw, 1));
        printf("step %2d  loss %.6f\n", step, value);
        if (step == 0)
            first = value;
        last = value;
    }
    CHECK(rp_synchronize(model));

    /* The slopes moved: RoundPipe applied AdamW to our layer's parameter too. */
    size_t index = 0;
    DLManagedTensor *a = NULL;
    CHECK(rp_param_find(&index, model, "1.slope"));
    CHECK(rp_param_master(&a, model, index));
    const float *av = (const float *)((char *)a->dl_tensor.data + a->dl_tensor.byte_offset);
    printf("learned slopes: %.3f %.3f %.3f %.3f ...\n", av[0], av[1], av[2], av[3]);
    a->deleter(a);

    rp_optimizer_destroy(adamw);
    rp_loss_destroy(loss);
    rp_model_destroy(model);
    if (!(last < 0.5 * first)) {
        fprintf(stderr, "the loss did not halve: %.6f -> %.6f\n", first, last);
        return EXIT_FAILURE;
    }
    return EXIT_SUCCESS;
}
