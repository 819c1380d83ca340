/*
 * test_caller_layers.c - caller-defined layers (rp_layer_def) written in plain C, mixed with
 * built-in "linear" layers, on 2 CPU worker devices with one layer per stage, so that caller
 * layers run as forward stages (FORWARD, then RECOMPUTE + backward) and as the tail stage
 * (TAIL + backward).
 *
 * The main model, x [6, 4] in 3 microbatches of 2 rows:
 *   0 caller "c:affine_in"   y = x * w + b           (w, b [4] trainable, elementwise)
 *   1 linear 4 -> 4
 *   2 caller "c:scale"       y = x * s + c           (s [4] frozen, c [4] trainable; buffers
 *                                                     sum [4] += mean of x's rows and
 *                                                     count [1] (int64) += 1, in FORWARD and
 *                                                     TAIL of training calls only)
 *   3 linear 4 -> 3
 *   4 caller "c:affine_out"  y = x * w + b           (w, b [3]), the tail stage
 * Every expected value is computed here, in double, from the inputs and the initial weights
 * (reference_* below); nothing expected is read back from the library.
 *
 * Tolerances: the engine computes in fp32 what the reference computes in double, through at
 * most five layers of sums over 4 terms with values of order 1, so relative errors are a few
 * fp32 roundings (~1e-7); 1e-5 relative (norm-based, ts_rel_err) leaves room and still catches
 * any wrong term (a missing microbatch or a wrong sign is an O(1) error).
 */
#include "test_support.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define N 6   /* rows of a call */
#define D 4   /* features of the caller layers 0 and 2 */
#define O 3   /* outputs */
#define M 3   /* microbatches */
#define MAXMB 16
#define TOL 1e-5

static float X[N * D], T[N * O];
static const int64_t XS[2] = {N, D}, TS[2] = {N, O};

static const char *SPEC = "{\"layers\": [{\"type\": \"caller\", \"def\": 0},"
                          "{\"type\": \"linear\", \"in\": 4, \"out\": 4},"
                          "{\"type\": \"caller\", \"def\": 1},"
                          "{\"type\": \"linear\", \"in\": 4, \"out\": 3},"
                          "{\"type\": \"caller\", \"def\": 2}]}";
static const int32_t PLAN[5] = {1, 1, 1, 1, 1};

/* ---- what the callbacks saw ------------------------------------------------------------- */

enum layer_kind { AFFINE, SCALE, SPLIT2, JOIN2 };

/* A failure the test asks a callback to make (once the phase and microbatch match). */
enum failure {
    FAIL_NONE,
    FAIL_FORWARD_RETURN,    /* forward returns nonzero */
    FAIL_BACKWARD_RETURN,   /* backward returns nonzero */
    FAIL_NO_OUTPUTS,        /* forward returns no tensor */
    FAIL_INPUT_GRAD_SHAPE,  /* input gradient one column too wide */
    FAIL_PARAM_GRAD_SHAPE,  /* parameter gradient one element too long */
    FAIL_PARAM_GRAD_COUNT,  /* one parameter gradient short */
    FAIL_FROZEN_GRAD        /* a gradient for the frozen parameter */
};

typedef struct layer_state {
    enum layer_kind kind;
    enum failure fail;
    int fail_phase; /* phase whose forward fails (FAIL_FORWARD_RETURN, FAIL_NO_OUTPUTS) */
    int forward[3]; /* forward calls per rp_layer_phase */
    int backward, stored, released, buffer_updates;
    int backward_without_context; /* backward called with a NULL context */
    int bad;                      /* something the header does not allow was lent */
    char why[160];
    uint64_t forward_seed[MAXMB];
    int seed_mismatch;            /* a RECOMPUTE seed differed from its FORWARD's */
} layer_state;

/* What the engine stores between a forward with gradient and its backward. */
typedef struct context {
    layer_state *owner;
    int64_t rows, dim;
    float *x;  /* the input (AFFINE, SPLIT2), or y2 (JOIN2) */
    float *p;  /* w (AFFINE, SPLIT2), s (SCALE), or y1 (JOIN2) */
} context;

#define BUMP(field) __atomic_fetch_add(&(field), 1, __ATOMIC_SEQ_CST)
#define LOAD(field) __atomic_load_n(&(field), __ATOMIC_SEQ_CST)

static void note_bad(layer_state *st, const char *why) {
    if (!__atomic_exchange_n(&st->bad, 1, __ATOMIC_SEQ_CST))
        snprintf(st->why, sizeof st->why, "%s", why);
}

/* fp32 CPU tensor of `n` elements into `out` (any strides); -1 when it is not one. A callback
 * runs on a worker thread, where a cmocka assertion must not fire. */
static int read_f32(const DLTensor *t, float *out, int64_t n) {
    if (t->dtype.code != kDLFloat || t->dtype.bits != 32 || t->device.device_type != kDLCPU ||
        ts_numel(t) != n)
        return -1;
    const float *data = (const float *)((const char *)t->data + t->byte_offset);
    for (int64_t i = 0; i < n; ++i) {
        int64_t off = i; /* compact row-major: the element index */
        if (t->strides) {
            int64_t rest = i;
            off = 0;
            for (int32_t d = t->ndim - 1; d >= 0; --d) {
                off += (rest % t->shape[d]) * t->strides[d];
                rest /= t->shape[d];
            }
        }
        out[i] = data[off];
    }
    return 0;
}

static float *copy_of(const float *v, int64_t n) {
    float *c = malloc(sizeof(float) * (size_t)n);
    memcpy(c, v, sizeof(float) * (size_t)n);
    return c;
}

static void free_context(context *c) {
    if (!c)
        return;
    free(c->x);
    free(c->p);
    free(c);
}

/* A [rows, dim] fp32 tensor (dim 0 gives a 1-d [rows] one). */
static DLManagedTensor *matrix(int64_t rows, int64_t dim, const float *v) {
    int64_t shape[2] = {rows, dim};
    return ts_f32(2, shape, v);
}

static DLManagedTensor *vector(int64_t n, const float *v) { return ts_f32(1, &n, v); }

/* ---- forward ------------------------------------------------------------------------------ */

static int32_t layer_forward(rp_tensor_list *out, void **inout_context, const rp_layer_call *call,
                             const DLManagedTensor *const *inputs, size_t n_inputs, void *ud) {
    layer_state *st = ud;
    int32_t phase = -1, dev_type = 0, dev_id = -1, mb = -1, training = -1;
    void *stream = (void *)1;
    uint64_t seed = 0;
    if (rp_layer_call_info(&phase, &dev_type, &dev_id, &stream, &seed, &mb, &training, call)) {
        note_bad(st, "rp_layer_call_info failed");
        return 1;
    }
    if (phase < 0 || phase > 2 || mb < 0 || mb >= MAXMB) {
        note_bad(st, "phase or microbatch out of range");
        return 1;
    }
    BUMP(st->forward[phase]);
    if (dev_type != kDLCPU || dev_id < 0 || dev_id > 1 || stream != NULL)
        note_bad(st, "not a CPU worker device, or a stream on a CPU device");
    if (phase == RP_PHASE_FORWARD)
        __atomic_store_n(&st->forward_seed[mb], seed, __ATOMIC_SEQ_CST);
    else if (phase == RP_PHASE_RECOMPUTE &&
             __atomic_load_n(&st->forward_seed[mb], __ATOMIC_SEQ_CST) != seed)
        __atomic_store_n(&st->seed_mismatch, 1, __ATOMIC_SEQ_CST);
    if (phase != RP_PHASE_FORWARD && !training)
        note_bad(st, "a phase with gradient in an inference call");
    if (st->fail == FAIL_FORWARD_RETURN && phase == st->fail_phase && mb == 1)
        return 5;
    if (st->fail == FAIL_NO_OUTPUTS && phase == st->fail_phase)
        return 0;

    const DLManagedTensor *const *params = NULL, *const *buffers = NULL;
    size_t np = 0, nb = 0;
    if (rp_layer_call_tensors(&params, &np, &buffers, &nb, call)) {
        note_bad(st, "rp_layer_call_tensors failed");
        return 1;
    }
    size_t want_inputs = st->kind == JOIN2 ? 2 : 1;
    size_t want_params = st->kind == AFFINE || st->kind == SCALE ? 2 : st->kind == SPLIT2 ? 1 : 0;
    size_t want_buffers = st->kind == SCALE ? 2 : 0;
    if (n_inputs != want_inputs || np != want_params || nb != want_buffers) {
        note_bad(st, "wrong number of inputs, parameters or buffers");
        return 1;
    }
    const DLTensor *xt = &inputs[0]->dl_tensor;
    if (xt->ndim != 2) {
        note_bad(st, "input is not a matrix");
        return 1;
    }
    int64_t rows = xt->shape[0], dim = xt->shape[1], n = rows * dim;
    float *x = malloc(sizeof(float) * (size_t)n), *y = malloc(sizeof(float) * (size_t)n);
    float p0[D] = {0}, p1[D] = {0};
    int err = read_f32(xt, x, n) || dim > D;
    for (size_t k = 0; k < np && !err; ++k)
        err = read_f32(&params[k]->dl_tensor, k ? p1 : p0, dim);
    if (err) {
        note_bad(st, "an input or parameter is not fp32 on the CPU of the expected size");
        free(x);
        free(y);
        return 1;
    }
    int with_grad = phase != RP_PHASE_FORWARD;
    context *ctx = with_grad ? calloc(1, sizeof *ctx) : NULL;
    if (ctx) {
        ctx->owner = st;
        ctx->rows = rows;
        ctx->dim = dim;
    }
    switch (st->kind) {
    case AFFINE:
    case SCALE:
        for (int64_t i = 0; i < n; ++i)
            y[i] = x[i] * p0[i % dim] + p1[i % dim];
        if (ctx) {
            ctx->x = copy_of(x, n);
            ctx->p = copy_of(p0, dim);
        }
        break;
    case SPLIT2: { /* y1 = x * w, y2 = x + 1 */
        float *y2 = malloc(sizeof(float) * (size_t)n);
        for (int64_t i = 0; i < n; ++i) {
            y[i] = x[i] * p0[i % dim];
            y2[i] = x[i] + 1.f;
        }
        rp_tensor_list_push(out, matrix(rows, dim, y));
        rp_tensor_list_push(out, matrix(rows, dim, y2));
        free(y2);
        if (ctx) {
            ctx->x = copy_of(x, n);
            ctx->p = copy_of(p0, dim);
        }
        break;
    }
    case JOIN2: { /* z = y1 * y2 */
        float *x2 = malloc(sizeof(float) * (size_t)n);
        if (read_f32(&inputs[1]->dl_tensor, x2, n)) {
            note_bad(st, "second input is not like the first");
            free(x2);
            free(x);
            free(y);
            free_context(ctx);
            return 1;
        }
        for (int64_t i = 0; i < n; ++i)
            y[i] = x[i] * x2[i];
        if (ctx) {
            ctx->x = x2;
            ctx->p = copy_of(x, n);
        } else {
            free(x2);
        }
        break;
    }
    }
    if (st->kind != SPLIT2)
        rp_tensor_list_push(out, matrix(rows, dim, y));

    /* The running statistics: only a non-recompute forward of a training call updates them. */
    if (st->kind == SCALE && phase != RP_PHASE_RECOMPUTE && training) {
        /* The struct is lent const; the memory it points at is the buffer to update. */
        const DLTensor *sum = &buffers[0]->dl_tensor, *count = &buffers[1]->dl_tensor;
        if (sum->dtype.code != kDLFloat || sum->dtype.bits != 32 || count->dtype.code != kDLInt ||
            count->dtype.bits != 64 || ts_numel(sum) != dim || ts_numel(count) != 1) {
            note_bad(st, "buffers not as declared");
        } else {
            float *s = (float *)((char *)sum->data + sum->byte_offset);
            for (int64_t j = 0; j < dim; ++j) {
                double mean = 0.0;
                for (int64_t r = 0; r < rows; ++r)
                    mean += x[r * dim + j];
                s[j] += (float)(mean / (double)rows);
            }
            ++*(int64_t *)((char *)count->data + count->byte_offset);
            BUMP(st->buffer_updates);
        }
    }
    free(x);
    free(y);
    if (ctx) {
        *inout_context = ctx;
        BUMP(st->stored);
    }
    return 0;
}

/* ---- backward and release ----------------------------------------------------------------- */

static int32_t layer_backward(rp_tensor_list *in_grads, rp_tensor_list *param_grads, void *vctx,
                              const rp_layer_call *call, const DLManagedTensor *const *out_grads,
                              size_t n_outputs, void *ud) {
    layer_state *st = ud;
    context *c = vctx;
    BUMP(st->backward);
    int32_t phase = -1;
    rp_layer_call_info(&phase, NULL, NULL, NULL, NULL, NULL, NULL, call);
    if (phase != RP_PHASE_RECOMPUTE && phase != RP_PHASE_TAIL)
        note_bad(st, "backward reports a phase without gradient");
    if (!c) {
        BUMP(st->backward_without_context);
        return 1;
    }
    if (st->fail == FAIL_BACKWARD_RETURN)
        return 9;
    size_t want_outputs = st->kind == SPLIT2 ? 2 : 1;
    int64_t rows = c->rows, dim = c->dim, n = rows * dim;
    if (n_outputs != want_outputs || !out_grads[0]) {
        note_bad(st, "wrong number of output gradients");
        return 1;
    }
    float *g = malloc(sizeof(float) * (size_t)n), *g2 = malloc(sizeof(float) * (size_t)n);
    float *dx = calloc((size_t)n + rows, sizeof(float)); /* room for a wrong shape */
    float dp[D + 1] = {0}, dq[D + 1] = {0};
    if (read_f32(&out_grads[0]->dl_tensor, g, n) ||
        (want_outputs == 2 && (!out_grads[1] || read_f32(&out_grads[1]->dl_tensor, g2, n)))) {
        note_bad(st, "an output gradient is not fp32 of the output's size");
        free(g);
        free(g2);
        free(dx);
        return 1;
    }
    switch (st->kind) {
    case AFFINE: /* dx = g w, dw = sum_r g x, db = sum_r g */
    case SCALE:
        for (int64_t i = 0; i < n; ++i) {
            dx[i] = g[i] * c->p[i % dim];
            dp[i % dim] += g[i] * c->x[i];
            dq[i % dim] += g[i];
        }
        break;
    case SPLIT2: /* x -> (x w, x + 1): dx = g1 w + g2, dw = sum_r g1 x */
        for (int64_t i = 0; i < n; ++i) {
            dx[i] = g[i] * c->p[i % dim] + g2[i];
            dp[i % dim] += g[i] * c->x[i];
        }
        break;
    case JOIN2: /* (y1, y2) -> y1 y2: dy1 = g y2, dy2 = g y1 */
        for (int64_t i = 0; i < n; ++i) {
            dx[i] = g[i] * c->x[i];
            g2[i] = g[i] * c->p[i];
        }
        break;
    }
    int64_t xcols = st->fail == FAIL_INPUT_GRAD_SHAPE ? dim + 1 : dim;
    rp_tensor_list_push(in_grads, matrix(rows, xcols, dx));
    if (st->kind == JOIN2)
        rp_tensor_list_push(in_grads, matrix(rows, dim, g2));
    int64_t plen = st->fail == FAIL_PARAM_GRAD_SHAPE ? dim + 1 : dim;
    switch (st->kind) {
    case AFFINE:
        rp_tensor_list_push(param_grads, vector(plen, dp));
        if (st->fail != FAIL_PARAM_GRAD_COUNT)
            rp_tensor_list_push(param_grads, vector(dim, dq));
        break;
    case SCALE: /* s is frozen: no gradient, unless the test asks for the mistake */
        rp_tensor_list_push(param_grads, st->fail == FAIL_FROZEN_GRAD ? vector(dim, dp) : NULL);
        rp_tensor_list_push(param_grads, vector(plen, dq));
        break;
    case SPLIT2:
        rp_tensor_list_push(param_grads, vector(plen, dp));
        break;
    case JOIN2:
        break;
    }
    free(g);
    free(g2);
    free(dx);
    return 0;
}

static void layer_release(void *vctx, void *ud) {
    layer_state *st = ud;
    context *c = vctx;
    if (!c || c->owner != st)
        note_bad(st, "release got a context that is not this layer's");
    BUMP(st->released);
    free_context(c);
}

/* ---- building models ---------------------------------------------------------------------- */

/* Initial values of the caller layers' tensors; `variant` changes them (for save/load). */
typedef struct init_values {
    float w0[D], b0[D], s[D], c[D], w4[O], b4[O];
} init_values;

static init_values initial(uint64_t variant) {
    init_values v;
    ts_fill_uniform(v.w0, D, 101 + variant, 0.5f, 1.5f);
    ts_fill_uniform(v.b0, D, 102 + variant, -0.5f, 0.5f);
    ts_fill_uniform(v.s, D, 103 + variant, 0.5f, 1.5f);
    ts_fill_uniform(v.c, D, 104 + variant, -0.5f, 0.5f);
    ts_fill_uniform(v.w4, O, 105 + variant, 0.5f, 1.5f);
    ts_fill_uniform(v.b4, O, 106 + variant, -0.5f, 0.5f);
    return v;
}

static void add_param(rp_layer_def *def, const char *name, int64_t n, const float *v,
                      int trainable) {
    DLManagedTensor *t = vector(n, v);
    TS_OK(rp_layer_def_add_param(def, name, t, trainable));
    ts_free(t); /* borrowed: the def copied it */
}

static rp_layer_def *affine_def(const char *name, layer_state *st, int64_t n, const float *w,
                                const float *b) {
    rp_layer_def *def = NULL;
    st->kind = AFFINE;
    TS_OK(rp_layer_def_create(&def, name, layer_forward, layer_backward, layer_release, st));
    add_param(def, "w", n, w, 1);
    add_param(def, "b", n, b, 1);
    return def;
}

static rp_layer_def *scale_def(layer_state *st, const init_values *v, int s_trainable) {
    rp_layer_def *def = NULL;
    st->kind = SCALE;
    TS_OK(rp_layer_def_create(&def, "c:scale", layer_forward, layer_backward, layer_release, st));
    add_param(def, "s", D, v->s, s_trainable);
    add_param(def, "c", D, v->c, 1);
    DLManagedTensor *sum = vector(D, NULL);
    int64_t one = 1, zero = 0;
    DLManagedTensor *count = ts_i64(1, &one, &zero);
    TS_OK(rp_layer_def_add_buffer(def, "sum", sum));
    TS_OK(rp_layer_def_add_buffer(def, "count", count));
    ts_free(sum);
    ts_free(count);
    return def;
}

typedef struct fixture {
    layer_state st[3];
    init_values v;
    rp_model *model;
} fixture;

static rp_model *build_main(layer_state st[3], const init_values *v, int s_trainable,
                            uint64_t seed) {
    rp_layer_def *defs[3] = {affine_def("c:affine_in", &st[0], D, v->w0, v->b0),
                             scale_def(&st[1], v, s_trainable),
                             affine_def("c:affine_out", &st[2], O, v->w4, v->b4)};
    rp_model_options *opt = NULL;
    TS_OK(rp_model_options_create(&opt));
    TS_OK(rp_model_options_set_devices(opt, RP_DEVICE_CPU, 2));
    TS_OK(rp_model_options_set_seed(opt, seed));
    TS_OK(rp_model_options_set_stage_plan(opt, PLAN, 5));
    rp_model *model = NULL;
    TS_OK(rp_model_create_with_layers(&model, SPEC, (const rp_layer_def *const *)defs, 3, opt));
    rp_model_options_destroy(opt);
    for (int i = 0; i < 3; ++i)
        rp_layer_def_destroy(defs[i]); /* the model keeps its own copies */
    return model;
}

static int setup_data(void **state) {
    (void)state;
    ts_fill_uniform(X, N * D, 41, -1.f, 1.f);
    ts_fill_uniform(T, N * O, 42, -1.f, 1.f);
    return 0;
}

static int setup_main(void **state) {
    fixture *f = calloc(1, sizeof *f);
    f->v = initial(0);
    f->model = build_main(f->st, &f->v, 0, 7);
    *state = f;
    return 0;
}

static int teardown_main(void **state) {
    fixture *f = *state;
    rp_model_destroy(f->model);
    free(f);
    return 0;
}

/* ---- reading the model -------------------------------------------------------------------- */

static size_t find(rp_model *m, const char *name) {
    size_t i = 0;
    TS_OK(rp_param_find(&i, m, name));
    return i;
}

/* fp32 values of tensor `name`: its master weight (kind 0) or its gradient (kind 1). */
static void read_tensor(rp_model *m, const char *name, int grad, float *out, int64_t n) {
    DLManagedTensor *t = NULL;
    size_t i = find(m, name);
    TS_OK(grad ? rp_param_grad(&t, m, i) : rp_param_master(&t, m, i));
    assert_int_equal(ts_numel(&t->dl_tensor), n);
    ts_read_f32(&t->dl_tensor, out);
    ts_free(t);
}

static int64_t read_count(rp_model *m) {
    DLManagedTensor *t = NULL;
    TS_OK(rp_param_master(&t, m, find(m, "2.count")));
    assert_int_equal(t->dl_tensor.dtype.code, kDLInt);
    assert_int_equal(t->dl_tensor.dtype.bits, 64);
    int64_t v = *(int64_t *)((char *)t->dl_tensor.data + t->dl_tensor.byte_offset);
    ts_free(t);
    return v;
}

static void assert_close(const float *got, const double *want, int64_t n, const char *what) {
    float w[64];
    assert_true(n <= 64);
    for (int64_t i = 0; i < n; ++i)
        w[i] = (float)want[i];
    double e = ts_rel_err(got, w, n, 1e-6);
    if (!(e <= TOL)) {
        print_error("%s: relative error %.3g > %.1g (first: got %.8g, want %.8g)\n", what, e,
                    TOL, got[0], want[0]);
        fail();
    }
}

/* ---- the reference ------------------------------------------------------------------------ */

/* Every trainable weight of the main model and the buffers, in double. */
typedef struct ref {
    double w0[D], b0[D], W1[D * D], c1[D], s[D], c[D], W3[O * D], c3[O], w4[O], b4[O];
    double sum[D];
    int64_t count;
} ref;

typedef struct ref_grads {
    double w0[D], b0[D], W1[D * D], c1[D], c[D], W3[O * D], c3[O], w4[O], b4[O];
} ref_grads;

static void to_double(double *out, const float *in, int64_t n) {
    for (int64_t i = 0; i < n; ++i)
        out[i] = in[i];
}

/* The reference starts from the caller layers' initial values and the linear layers'
 * initialised weights (inputs of the computation, read once). */
static ref reference_init(rp_model *m, const init_values *v) {
    ref r;
    memset(&r, 0, sizeof r);
    float tmp[D * D];
    to_double(r.w0, v->w0, D);
    to_double(r.b0, v->b0, D);
    to_double(r.s, v->s, D);
    to_double(r.c, v->c, D);
    to_double(r.w4, v->w4, O);
    to_double(r.b4, v->b4, O);
    TS_OK(rp_synchronize(m));
    read_tensor(m, "1.weight", 0, tmp, D * D);
    to_double(r.W1, tmp, D * D);
    read_tensor(m, "1.bias", 0, tmp, D);
    to_double(r.c1, tmp, D);
    read_tensor(m, "3.weight", 0, tmp, O * D);
    to_double(r.W3, tmp, O * D);
    read_tensor(m, "3.bias", 0, tmp, O);
    to_double(r.c3, tmp, O);
    return r;
}

/* y = x W^T + bias for `rows` rows, W [out, in]. */
static void linear(double *y, const double *x, const double *W, const double *bias, int rows,
                   int in, int out) {
    for (int r = 0; r < rows; ++r)
        for (int o = 0; o < out; ++o) {
            double acc = bias[o];
            for (int i = 0; i < in; ++i)
                acc += x[r * in + i] * W[o * in + i];
            y[r * out + o] = acc;
        }
}

/* Forward and backward of one call (3 microbatches of 2 rows, MSE per microbatch, summed):
 * returns the loss, writes the outputs [N, O], adds the gradients to `g` and updates the
 * buffers when `training`. */
static double reference_call(ref *r, ref_grads *g, double *out, int training) {
    double loss = 0.0;
    const int rows = N / M;
    for (int mb = 0; mb < M; ++mb) {
        double x[rows * D], h0[rows * D], h1[rows * D], h2[rows * D], h3[rows * O];
        double y[rows * O], gy[rows * O], gh3[rows * O], gh2[rows * D], gh1[rows * D];
        to_double(x, X + mb * rows * D, rows * D);
        for (int i = 0; i < rows * D; ++i)
            h0[i] = x[i] * r->w0[i % D] + r->b0[i % D];
        linear(h1, h0, r->W1, r->c1, rows, D, D);
        for (int i = 0; i < rows * D; ++i)
            h2[i] = h1[i] * r->s[i % D] + r->c[i % D];
        if (training) {
            for (int j = 0; j < D; ++j) {
                double mean = 0.0;
                for (int k = 0; k < rows; ++k)
                    mean += h1[k * D + j];
                r->sum[j] += mean / rows;
            }
            r->count += 1;
        }
        linear(h3, h2, r->W3, r->c3, rows, D, O);
        for (int i = 0; i < rows * O; ++i) {
            y[i] = h3[i] * r->w4[i % O] + r->b4[i % O];
            out[mb * rows * O + i] = y[i];
            double d = y[i] - T[mb * rows * O + i];
            loss += d * d / (rows * O);
            gy[i] = 2.0 * d / (rows * O);
        }
        if (!g)
            continue;
        for (int i = 0; i < rows * O; ++i) {
            g->w4[i % O] += gy[i] * h3[i];
            g->b4[i % O] += gy[i];
            gh3[i] = gy[i] * r->w4[i % O];
        }
        for (int k = 0; k < rows; ++k)
            for (int o = 0; o < O; ++o) {
                g->c3[o] += gh3[k * O + o];
                for (int i = 0; i < D; ++i)
                    g->W3[o * D + i] += gh3[k * O + o] * h2[k * D + i];
            }
        for (int k = 0; k < rows; ++k)
            for (int i = 0; i < D; ++i) {
                double acc = 0.0;
                for (int o = 0; o < O; ++o)
                    acc += gh3[k * O + o] * r->W3[o * D + i];
                gh2[k * D + i] = acc;
            }
        for (int i = 0; i < rows * D; ++i) {
            g->c[i % D] += gh2[i];
            gh1[i] = gh2[i] * r->s[i % D];
        }
        for (int k = 0; k < rows; ++k)
            for (int o = 0; o < D; ++o) {
                g->c1[o] += gh1[k * D + o];
                for (int i = 0; i < D; ++i)
                    g->W1[o * D + i] += gh1[k * D + o] * h0[k * D + i];
            }
        for (int k = 0; k < rows; ++k)
            for (int i = 0; i < D; ++i) {
                double gh0 = 0.0;
                for (int o = 0; o < D; ++o)
                    gh0 += gh1[k * D + o] * r->W1[o * D + i];
                g->w0[i] += gh0 * x[k * D + i];
                g->b0[i] += gh0;
            }
    }
    return loss;
}

static void sgd(double *w, const double *g, int n, double lr) {
    for (int i = 0; i < n; ++i)
        w[i] -= lr * g[i];
}

static void reference_sgd(ref *r, const ref_grads *g, double lr) {
    sgd(r->w0, g->w0, D, lr);
    sgd(r->b0, g->b0, D, lr);
    sgd(r->W1, g->W1, D * D, lr);
    sgd(r->c1, g->c1, D, lr);
    sgd(r->c, g->c, D, lr);
    sgd(r->W3, g->W3, O * D, lr);
    sgd(r->c3, g->c3, O, lr);
    sgd(r->w4, g->w4, O, lr);
    sgd(r->b4, g->b4, O, lr);
}

/* Compare every trainable tensor's master weight (grad 0) or gradient (grad 1) with `r` / `g`. */
static void assert_model_matches(rp_model *m, const ref *r, const ref_grads *g) {
    struct {
        const char *name;
        const double *want;
        int64_t n;
    } t[] = {{"0.w", g ? g->w0 : r->w0, D},       {"0.b", g ? g->b0 : r->b0, D},
             {"1.weight", g ? g->W1 : r->W1, D * D}, {"1.bias", g ? g->c1 : r->c1, D},
             {"2.c", g ? g->c : r->c, D},         {"3.weight", g ? g->W3 : r->W3, O * D},
             {"3.bias", g ? g->c3 : r->c3, O},    {"4.w", g ? g->w4 : r->w4, O},
             {"4.b", g ? g->b4 : r->b4, O}};
    TS_OK(rp_synchronize(m));
    for (size_t k = 0; k < sizeof t / sizeof t[0]; ++k) {
        float got[D * D];
        char what[64];
        read_tensor(m, t[k].name, g != NULL, got, t[k].n);
        snprintf(what, sizeof what, "%s of %s", g ? "gradient" : "weight", t[k].name);
        assert_close(got, t[k].want, t[k].n, what);
    }
}

/* ---- driving ------------------------------------------------------------------------------ */

/* One training call with the built-in MSE (or `custom`) at recompute grain `grain` (0: the
 * default); `outputs` (may be NULL) receives the outputs. */
static rp_status train_call_grain(rp_model *m, double *loss, float *outputs,
                                  const rp_loss *custom, int32_t grain) {
    DLManagedTensor *x = ts_f32(2, XS, X), *t = ts_f32(2, TS, T);
    const DLManagedTensor *inputs[1] = {x};
    rp_loss *mse = NULL;
    TS_OK(rp_loss_create(&mse, RP_LOSS_MSE));
    rp_run_config *cfg = ts_config(M, grain);
    rp_tensor_list *outs = NULL;
    double l = 0.0;
    rp_status s = rp_forward_backward(&l, outputs ? &outs : NULL, m, inputs, 1, t,
                                      custom ? custom : mse, cfg);
    if (s == RP_OK && outputs) {
        DLManagedTensor *o = NULL;
        TS_OK(rp_tensor_list_get(&o, outs, 0));
        assert_int_equal(ts_numel(&o->dl_tensor), N * O);
        ts_read_f32(&o->dl_tensor, outputs);
        ts_free(o);
    }
    if (loss)
        *loss = l;
    rp_tensor_list_destroy(outs);
    rp_run_config_destroy(cfg);
    rp_loss_destroy(mse);
    ts_free(x);
    ts_free(t);
    return s;
}

static rp_status train_call(rp_model *m, double *loss, float *outputs, const rp_loss *custom) {
    return train_call_grain(m, loss, outputs, custom, 0);
}

static void sgd_step(rp_model *m, double lr) {
    rp_optimizer *opt = NULL;
    TS_OK(rp_optimizer_create(&opt, RP_OPTIMIZER_SGD));
    TS_OK(rp_optimizer_set_learning_rate(opt, lr));
    TS_OK(rp_step(m, opt, 0));
    rp_optimizer_destroy(opt);
}

static void assert_contexts_released(const layer_state *st, int n) {
    for (int i = 0; i < n; ++i) {
        int stored = LOAD(st[i].stored), released = LOAD(st[i].released);
        if (stored != released) {
            print_error("layer %d: %d contexts stored, %d released\n", i, stored, released);
            fail();
        }
        if (LOAD(st[i].bad)) {
            print_error("layer %d: %s\n", i, st[i].why);
            fail();
        }
        assert_int_equal(LOAD(st[i].backward_without_context), 0);
        assert_int_equal(LOAD(st[i].seed_mismatch), 0);
    }
}

static void reset_counts(layer_state *st, int n) {
    for (int i = 0; i < n; ++i) {
        enum layer_kind k = st[i].kind;
        memset(&st[i], 0, sizeof st[i]);
        st[i].kind = k;
    }
}

/* ---- tests -------------------------------------------------------------------------------- */

/* Outputs, loss, gradients, phases and contexts of one training call; then weights after two
 * synchronous SGD steps, the frozen parameter untouched, the buffers updated per microbatch. */
static void test_train_matches_reference(void **state) {
    fixture *f = *state;
    rp_model *m = f->model;
    int32_t stages = 0;
    TS_OK(rp_model_num_stages(&stages, m));
    assert_int_equal(stages, 5);

    ref r = reference_init(m, &f->v);
    ref_grads g;
    memset(&g, 0, sizeof g);
    double want_out[N * O];
    double want_loss = reference_call(&r, &g, want_out, 1);

    float out[N * O];
    double loss = 0.0;
    TS_OK(train_call(m, &loss, out, NULL));
    assert_true(fabs(loss - want_loss) <= TOL * fabs(want_loss));
    assert_close(out, want_out, N * O, "outputs");
    assert_model_matches(m, &r, &g);

    /* Phases: layers 0 and 2 are forward stages (FORWARD, then RECOMPUTE + backward), layer
     * 4 is the tail (TAIL + backward); one of each per microbatch. */
    for (int i = 0; i < 2; ++i) {
        assert_int_equal(f->st[i].forward[RP_PHASE_FORWARD], M);
        assert_int_equal(f->st[i].forward[RP_PHASE_RECOMPUTE], M);
        assert_int_equal(f->st[i].forward[RP_PHASE_TAIL], 0);
        assert_int_equal(f->st[i].backward, M);
    }
    assert_int_equal(f->st[2].forward[RP_PHASE_FORWARD], 0);
    assert_int_equal(f->st[2].forward[RP_PHASE_RECOMPUTE], 0);
    assert_int_equal(f->st[2].forward[RP_PHASE_TAIL], M);
    assert_int_equal(f->st[2].backward, M);
    for (int i = 0; i < 3; ++i)
        assert_int_equal(f->st[i].stored, M);
    assert_contexts_released(f->st, 3);

    /* The buffers: one update per microbatch, by the FORWARD stage, none by the recompute. */
    assert_int_equal(f->st[1].buffer_updates, M);
    assert_int_equal(read_count(m), M);
    float sum[D];
    read_tensor(m, "2.sum", 0, sum, D);
    assert_close(sum, r.sum, D, "buffer 2.sum after one call");

    /* Kinds, and the frozen parameter has no gradient. */
    int32_t kind = -1;
    TS_OK(rp_param_kind_of(&kind, m, find(m, "2.s")));
    assert_int_equal(kind, RP_PARAM_FROZEN);
    TS_OK(rp_param_kind_of(&kind, m, find(m, "2.sum")));
    assert_int_equal(kind, RP_PARAM_BUFFER);
    TS_OK(rp_param_kind_of(&kind, m, find(m, "2.count")));
    assert_int_equal(kind, RP_PARAM_BUFFER);
    TS_OK(rp_param_kind_of(&kind, m, find(m, "2.c")));
    assert_int_equal(kind, RP_PARAM_TRAINABLE);
    TS_OK(rp_param_kind_of(&kind, m, find(m, "1.weight")));
    assert_int_equal(kind, RP_PARAM_TRAINABLE);
    DLManagedTensor *none = NULL;
    assert_int_not_equal(rp_param_grad(&none, m, find(m, "2.s")), RP_OK);
    assert_null(none);

    /* Two synchronous SGD steps (the second call runs on the first step's weights). */
    const double lr = 0.1;
    sgd_step(m, lr);
    reference_sgd(&r, &g, lr);
    memset(&g, 0, sizeof g);
    want_loss = reference_call(&r, &g, want_out, 1);
    TS_OK(train_call(m, &loss, NULL, NULL));
    assert_true(fabs(loss - want_loss) <= TOL * fabs(want_loss));
    sgd_step(m, lr);
    reference_sgd(&r, &g, lr);
    assert_model_matches(m, &r, NULL);

    float s[D];
    read_tensor(m, "2.s", 0, s, D);
    assert_memory_equal(s, f->v.s, sizeof s); /* frozen: bit for bit */
    assert_int_equal(read_count(m), 2 * M);
    read_tensor(m, "2.sum", 0, sum, D);
    assert_close(sum, r.sum, D, "buffer 2.sum after two calls");
    assert_contexts_released(f->st, 3);

    /* Inference: FORWARD for every caller layer, no context, buffers untouched. */
    reset_counts(f->st, 3);
    DLManagedTensor *x = ts_f32(2, XS, X);
    const DLManagedTensor *inputs[1] = {x};
    rp_run_config *cfg = ts_config(M, 0);
    rp_tensor_list *outs = NULL;
    TS_OK(rp_forward(&outs, m, inputs, 1, cfg));
    DLManagedTensor *o = NULL;
    TS_OK(rp_tensor_list_get(&o, outs, 0));
    ts_read_f32(&o->dl_tensor, out);
    reference_call(&r, NULL, want_out, 0);
    assert_close(out, want_out, N * O, "rp_forward outputs after two steps");
    for (int i = 0; i < 3; ++i) {
        assert_int_equal(f->st[i].forward[RP_PHASE_FORWARD], M);
        assert_int_equal(f->st[i].stored, 0);
    }
    assert_int_equal(read_count(m), 2 * M);
    ts_free(o);
    rp_tensor_list_destroy(outs);
    rp_run_config_destroy(cfg);
    ts_free(x);
}

/* Recomputing one layer at a time: the same phases per caller layer, the same gradients. */
static void test_layer_grain_matches_reference(void **state) {
    fixture *f = *state;
    ref r = reference_init(f->model, &f->v);
    ref_grads g;
    memset(&g, 0, sizeof g);
    double want_out[N * O], loss = 0.0;
    double want_loss = reference_call(&r, &g, want_out, 1);
    TS_OK(train_call_grain(f->model, &loss, NULL, NULL, RP_GRAIN_LAYER));
    assert_true(fabs(loss - want_loss) <= TOL * fabs(want_loss));
    assert_model_matches(f->model, &r, &g);
    for (int i = 0; i < 2; ++i) {
        assert_int_equal(f->st[i].forward[RP_PHASE_FORWARD], M);
        assert_int_equal(f->st[i].forward[RP_PHASE_RECOMPUTE], M);
        assert_int_equal(f->st[i].backward, M);
    }
    assert_int_equal(f->st[2].forward[RP_PHASE_TAIL], M);
    assert_int_equal(f->st[2].backward, M);
    assert_int_equal(f->st[1].buffer_updates, M);
    assert_contexts_released(f->st, 3);
}

/* A frozen parameter holds no gradient and no optimizer state: less host memory than the same
 * parameter trainable (at least its fp32 gradient buffer, 4 bytes per element). */
static void test_frozen_costs_less_host_memory(void **state) {
    (void)state;
    layer_state a[3], b[3];
    memset(a, 0, sizeof a);
    memset(b, 0, sizeof b);
    init_values v = initial(0);
    rp_model *frozen = build_main(a, &v, 0, 7), *trainable = build_main(b, &v, 1, 7);
    int64_t bytes_f = 0, bytes_t = 0, el = 0;
    TS_OK(rp_model_host_state_bytes(&bytes_f, &el, frozen));
    TS_OK(rp_model_host_state_bytes(&bytes_t, &el, trainable));
    if (!(bytes_t - bytes_f >= 4 * D)) {
        print_error("frozen %lld bytes, trainable %lld bytes\n", (long long)bytes_f,
                    (long long)bytes_t);
        fail();
    }
    int32_t kind = -1;
    TS_OK(rp_param_kind_of(&kind, trainable, find(trainable, "2.s")));
    assert_int_equal(kind, RP_PARAM_TRAINABLE);
    rp_model_destroy(frozen);
    rp_model_destroy(trainable);
}

/* ---- failures ----------------------------------------------------------------------------- */

typedef struct failure_case {
    int layer;
    enum failure fail;
    int phase;
    const char *needle; /* in the message, besides the layer's name */
} failure_case;

static void check_failure(fixture *f, const failure_case *c) {
    static const char *names[3] = {"affine_in", "scale", "affine_out"};
    rp_model *m = f->model;
    TS_OK(rp_zero_grad(m));
    TS_OK(train_call(m, NULL, NULL, NULL)); /* gradients accumulated before the failure */
    float before[O * D], after[O * D];
    read_tensor(m, "3.weight", 1, before, O * D);
    float w0_before[D], w0_after[D];
    read_tensor(m, "0.w", 1, w0_before, D);

    reset_counts(f->st, 3);
    f->st[c->layer].fail = c->fail;
    f->st[c->layer].fail_phase = c->phase;
    rp_status s = train_call(m, NULL, NULL, NULL);
    f->st[c->layer].fail = FAIL_NONE;
    /* docs/semantics.md, "Errors": a nonzero return, a wrong number of outputs or gradients,
     * or a gradient of the wrong shape (a frozen parameter's included) is RP_ERR_CALLBACK. */
    assert_int_equal(s, RP_ERR_CALLBACK);
    const char *msg = rp_last_error_message();
    if (!ts_contains(msg, names[c->layer]) || !ts_contains(msg, c->needle)) {
        print_error("failure %d of layer %d: message \"%s\" lacks \"%s\" or \"%s\"\n", c->fail,
                    c->layer, msg, names[c->layer], c->needle);
        fail();
    }
    /* Every stored context released once; the earlier gradients intact, bit for bit. */
    assert_contexts_released(f->st, 3);
    read_tensor(m, "3.weight", 1, after, O * D);
    assert_memory_equal(before, after, sizeof before);
    read_tensor(m, "0.w", 1, w0_after, D);
    assert_memory_equal(w0_before, w0_after, sizeof w0_before);

    /* Still usable: one more call doubles the gradient. */
    TS_OK(train_call(m, NULL, NULL, NULL));
    read_tensor(m, "0.w", 1, w0_after, D);
    double twice[D];
    for (int i = 0; i < D; ++i)
        twice[i] = 2.0 * w0_before[i];
    assert_close(w0_after, twice, D, "gradient after a failed call and a good one");
    assert_contexts_released(f->st, 3);
    TS_OK(rp_zero_grad(m));
}

static void test_callback_failures(void **state) {
    fixture *f = *state;
    const failure_case cases[] = {
        {0, FAIL_FORWARD_RETURN, RP_PHASE_FORWARD, "callback|fail|return"},
        {0, FAIL_FORWARD_RETURN, RP_PHASE_RECOMPUTE, "callback|fail|return"},
        {2, FAIL_FORWARD_RETURN, RP_PHASE_TAIL, "callback|fail|return"},
        {1, FAIL_BACKWARD_RETURN, -1, "backward|callback|fail"},
        {2, FAIL_BACKWARD_RETURN, -1, "backward|callback|fail"},
        {0, FAIL_NO_OUTPUTS, RP_PHASE_FORWARD, "output"},
        {1, FAIL_NO_OUTPUTS, RP_PHASE_RECOMPUTE, "output"},
        {0, FAIL_INPUT_GRAD_SHAPE, -1, "shape"},
        {2, FAIL_PARAM_GRAD_SHAPE, -1, "shape"},
        {0, FAIL_PARAM_GRAD_COUNT, -1, "gradient"},
        {1, FAIL_FROZEN_GRAD, -1, "frozen"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; ++k)
        check_failure(f, &cases[k]);
}

/* Declarations the engine refuses. */
static void test_bad_declarations(void **state) {
    (void)state;
    layer_state st;
    memset(&st, 0, sizeof st);
    rp_layer_def *def = NULL;
    TS_OK(rp_layer_def_create(&def, "c:bad", layer_forward, layer_backward, layer_release, &st));
    int64_t n = 3;
    int64_t idx[3] = {0, 1, 2};
    DLManagedTensor *ints = ts_i64(1, &n, idx);
    TS_ERR(rp_layer_def_add_param(def, "idx", ints, 1), RP_ERR_INVALID_ARGUMENT,
           "float|floating|trainable");
    TS_OK(rp_layer_def_add_param(def, "idx", ints, 0)); /* frozen, it may be an integer */
    TS_ERR(rp_layer_def_add_param(def, "idx", ints, 0), RP_ERR_INVALID_ARGUMENT,
           "idx|duplicate");
    TS_ERR(rp_layer_def_add_param(def, "", ints, 0), RP_ERR_INVALID_ARGUMENT, "name");
    TS_OK(rp_layer_def_set_cost(def, 10.0));
    TS_ERR(rp_layer_def_set_cost(def, -1.0), RP_ERR_INVALID_ARGUMENT, "cost");
    TS_ERR(rp_layer_def_create(&def, "c:bad", NULL, NULL, NULL, NULL), RP_ERR_INVALID_ARGUMENT,
           "forward");
    ts_free(ints);

    /* A def used twice, or not at all, is refused. */
    const char *twice = "{\"layers\": [{\"type\": \"caller\", \"def\": 0},"
                        "{\"type\": \"caller\", \"def\": 0}]}";
    rp_model *m = NULL;
    TS_ERR(rp_model_create_with_layers(&m, twice, (const rp_layer_def *const *)&def, 1, NULL),
           RP_ERR_INVALID_ARGUMENT, "def");
    const char *unused = "{\"layers\": [{\"type\": \"linear\", \"in\": 3, \"out\": 3}]}";
    TS_ERR(rp_model_create_with_layers(&m, unused, (const rp_layer_def *const *)&def, 1, NULL),
           RP_ERR_INVALID_ARGUMENT, "def|declared layer", "not used|unused");
    assert_null(m);
    rp_layer_def_destroy(def);
}

/* ---- a device loss ------------------------------------------------------------------------ */

typedef struct loss_log {
    int calls, bad;
} loss_log;

/* MSE of one microbatch, computed in C on the worker device where the tail ran. */
static int32_t device_mse(DLManagedTensor **out_loss, rp_tensor_list *out_grads,
                          const rp_layer_call *call, const DLManagedTensor *const *outputs,
                          size_t n_outputs, const DLManagedTensor *labels, void *ud) {
    loss_log *log = ud;
    BUMP(log->calls);
    int32_t phase = -1, dev = 0;
    rp_layer_call_info(&phase, &dev, NULL, NULL, NULL, NULL, NULL, call);
    if (phase != RP_PHASE_TAIL || dev != kDLCPU || n_outputs != 1 || !labels) {
        log->bad = 1;
        return 1;
    }
    const DLTensor *o = &outputs[0]->dl_tensor;
    int64_t n = ts_numel(o);
    float ov[N * O], lv[N * O], gv[N * O];
    if (n > N * O || read_f32(o, ov, n) || read_f32(&labels->dl_tensor, lv, n)) {
        log->bad = 1;
        return 1;
    }
    double loss = 0.0;
    for (int64_t i = 0; i < n; ++i) {
        double d = (double)ov[i] - lv[i];
        loss += d * d / (double)n;
        gv[i] = (float)(2.0 * d / (double)n);
    }
    float l = (float)loss;
    *out_loss = ts_f32(0, NULL, &l);
    rp_tensor_list_push(out_grads, ts_f32(o->ndim, o->shape, gv));
    return 0;
}

static void test_device_loss_matches_reference(void **state) {
    fixture *f = *state;
    /* A model of its own, with the loss callback's gradients only. */
    layer_state st[3];
    memset(st, 0, sizeof st);
    rp_model *fresh = build_main(st, &f->v, 0, 7);
    ref r = reference_init(fresh, &f->v);
    ref_grads g;
    memset(&g, 0, sizeof g);
    double want_out[N * O];
    double want_loss = reference_call(&r, &g, want_out, 1);

    loss_log log = {0, 0};
    rp_loss *loss = NULL;
    TS_OK(rp_loss_create_device_callback(&loss, device_mse, &log));
    double got = 0.0;
    TS_OK(train_call(fresh, &got, NULL, loss));
    assert_int_equal(log.calls, M);
    assert_false(log.bad);
    /* The loss value passed through an fp32 tensor: 1e-5 relative as everywhere. */
    assert_true(fabs(got - want_loss) <= TOL * fabs(want_loss));
    assert_model_matches(fresh, &r, &g);
    assert_contexts_released(st, 3);

    /* A failing device loss: RP_ERR_CALLBACK, contexts released, nothing accumulated. */
    TS_OK(rp_zero_grad(fresh));
    log.calls = 0;
    rp_loss_destroy(loss);
    TS_OK(rp_loss_create_device_callback(&loss, device_mse, &log));
    rp_run_config *cfg = ts_config(M, 0);
    DLManagedTensor *x = ts_f32(2, XS, X);
    const DLManagedTensor *inputs[1] = {x};
    /* No labels: the callback refuses. */
    TS_ERR(rp_forward_backward(NULL, NULL, fresh, inputs, 1, NULL, loss, cfg), RP_ERR_CALLBACK,
           "loss|callback");
    assert_contexts_released(st, 3);
    float zero[D], gw[D];
    memset(zero, 0, sizeof zero);
    read_tensor(fresh, "0.w", 1, gw, D);
    assert_memory_equal(gw, zero, sizeof gw);
    ts_free(x);
    rp_run_config_destroy(cfg);
    rp_loss_destroy(loss);
    rp_model_destroy(fresh);
}

/* ---- saving and loading ------------------------------------------------------------------- */

/* Raw bytes of every model tensor (masters, frozen values, buffers), in order. */
static void assert_same_tensors(rp_model *a, rp_model *b) {
    size_t na = 0, nb = 0;
    TS_OK(rp_param_count(&na, a));
    TS_OK(rp_param_count(&nb, b));
    assert_int_equal(na, nb);
    for (size_t i = 0; i < na; ++i) {
        DLManagedTensor *ta = NULL, *tb = NULL;
        TS_OK(rp_param_master(&ta, a, i));
        TS_OK(rp_param_master(&tb, b, i));
        const DLTensor *x = &ta->dl_tensor, *y = &tb->dl_tensor;
        assert_int_equal(x->dtype.bits, y->dtype.bits);
        assert_int_equal(x->dtype.code, y->dtype.code);
        assert_int_equal(ts_numel(x), ts_numel(y));
        size_t bytes = (size_t)ts_numel(x) * x->dtype.bits / 8;
        assert_memory_equal((char *)x->data + x->byte_offset, (char *)y->data + y->byte_offset,
                            bytes);
        ts_free(ta);
        ts_free(tb);
    }
}

static void test_save_load_round_trip(void **state) {
    fixture *f = *state;
    rp_model *m = f->model;
    TS_OK(train_call(m, NULL, NULL, NULL)); /* buffers moved, weights stepped */
    sgd_step(m, 0.05);
    char *dir = ts_tempdir();
    char path[512];
    snprintf(path, sizeof path, "%s/caller.safetensors", dir);
    TS_OK(rp_model_save(m, path));

    /* Another model from other initial values (and another seed for the linear layers). */
    layer_state st[3];
    memset(st, 0, sizeof st);
    init_values other = initial(1000);
    rp_model *copy = build_main(st, &other, 0, 99);
    float s[D];
    read_tensor(copy, "2.s", 0, s, D);
    assert_memory_not_equal(s, f->v.s, sizeof s);
    TS_OK(rp_model_load(copy, path));
    TS_OK(rp_synchronize(m));
    assert_same_tensors(m, copy);
    assert_int_equal(read_count(copy), read_count(m));
    rp_model_destroy(copy);
    ts_rmdir(dir);
    free(dir);
}

/* ---- several tensors between layers ------------------------------------------------------- */

/* [split2: x -> (x w, x + 1)] -> [join2: (y1, y2) -> y1 y2] -> [linear 4 -> 3], one layer per
 * stage: the engine carries a list of two tensors between devices, forward and backward. */
static void test_two_tensor_activations(void **state) {
    (void)state;
    layer_state st[2];
    memset(st, 0, sizeof st);
    float w[D];
    ts_fill_uniform(w, D, 201, 0.5f, 1.5f);
    rp_layer_def *split = NULL, *join = NULL;
    st[0].kind = SPLIT2;
    st[1].kind = JOIN2;
    TS_OK(rp_layer_def_create(&split, "c:split2", layer_forward, layer_backward, layer_release,
                              &st[0]));
    add_param(split, "w", D, w, 1);
    TS_OK(rp_layer_def_create(&join, "c:join2", layer_forward, layer_backward, layer_release,
                              &st[1]));
    const rp_layer_def *defs[2] = {split, join};
    const char *spec = "{\"layers\": [{\"type\": \"caller\", \"def\": 0},"
                       "{\"type\": \"caller\", \"def\": 1},"
                       "{\"type\": \"linear\", \"in\": 4, \"out\": 3}]}";
    const int32_t plan[3] = {1, 1, 1};
    rp_model_options *opt = NULL;
    TS_OK(rp_model_options_create(&opt));
    TS_OK(rp_model_options_set_devices(opt, RP_DEVICE_CPU, 2));
    TS_OK(rp_model_options_set_stage_plan(opt, plan, 3));
    rp_model *m = NULL;
    TS_OK(rp_model_create_with_layers(&m, spec, defs, 2, opt));
    rp_model_options_destroy(opt);
    rp_layer_def_destroy(split);
    rp_layer_def_destroy(join);

    float Wf[O * D], bf[O];
    TS_OK(rp_synchronize(m));
    read_tensor(m, "2.weight", 0, Wf, O * D);
    read_tensor(m, "2.bias", 0, bf, O);

    /* Reference: z = (x w)(x + 1); y = z W^T + b; MSE per microbatch, summed. */
    double want_out[N * O], gw[D] = {0}, gW[O * D] = {0}, want_loss = 0.0;
    const int rows = N / M;
    for (int mb = 0; mb < M; ++mb)
        for (int k = 0; k < rows; ++k) {
            int r = mb * rows + k;
            double z[D], gy[O];
            for (int i = 0; i < D; ++i)
                z[i] = (double)X[r * D + i] * w[i] * ((double)X[r * D + i] + 1.0);
            for (int o = 0; o < O; ++o) {
                double y = bf[o];
                for (int i = 0; i < D; ++i)
                    y += z[i] * Wf[o * D + i];
                want_out[r * O + o] = y;
                double d = y - T[r * O + o];
                want_loss += d * d / (rows * O);
                gy[o] = 2.0 * d / (rows * O);
                for (int i = 0; i < D; ++i)
                    gW[o * D + i] += gy[o] * z[i];
            }
            for (int i = 0; i < D; ++i) {
                double gz = 0.0;
                for (int o = 0; o < O; ++o)
                    gz += gy[o] * Wf[o * D + i];
                /* z = w x (x + 1): dz/dw = x (x + 1) */
                gw[i] += gz * X[r * D + i] * ((double)X[r * D + i] + 1.0);
            }
        }
    float out[N * O], got_w[D], got_W[O * D];
    double loss = 0.0;
    TS_OK(train_call(m, &loss, out, NULL));
    assert_true(fabs(loss - want_loss) <= TOL * fabs(want_loss));
    assert_close(out, want_out, N * O, "outputs through two-tensor activations");
    TS_OK(rp_synchronize(m));
    read_tensor(m, "0.w", 1, got_w, D);
    assert_close(got_w, gw, D, "gradient of 0.w through both tensors");
    read_tensor(m, "2.weight", 1, got_W, O * D);
    assert_close(got_W, gW, O * D, "gradient of 2.weight");
    assert_int_equal(st[0].backward, M);
    assert_int_equal(st[1].backward, M);
    assert_contexts_released(st, 2);
    rp_model_destroy(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_train_matches_reference, setup_main, teardown_main),
        cmocka_unit_test_setup_teardown(test_layer_grain_matches_reference, setup_main,
                                        teardown_main),
        cmocka_unit_test_setup_teardown(test_callback_failures, setup_main, teardown_main),
        cmocka_unit_test_setup_teardown(test_device_loss_matches_reference, setup_main,
                                        teardown_main),
        cmocka_unit_test_setup_teardown(test_save_load_round_trip, setup_main, teardown_main),
        cmocka_unit_test(test_frozen_costs_less_host_memory),
        cmocka_unit_test(test_bad_declarations),
        cmocka_unit_test(test_two_tensor_activations),
    };
    return cmocka_run_group_tests(tests, setup_data, NULL);
}
