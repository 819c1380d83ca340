/*
 * test_callbacks.c - user callbacks: loss, optimizer step, microbatch split; merge_output.
 *
 * Each callback is compared with the built-in feature it can replace (a loss callback that
 * computes MSE in C against RP_LOSS_MSE, a hand-written SGD step against the built-in SGD, a
 * split callback that reproduces tensor_split against the default split), and failures must
 * surface as RP_ERR_CALLBACK with the model left usable.
 *
 * Tolerances: the callback and the built-in compute the same fp32 expressions in a different
 * order, so 1e-6 relative on losses and 1e-5 on gradients and weights.
 */
#include "test_support.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *SPEC = "{\"layers\": ["
                          "{\"type\": \"linear\", \"in\": 6, \"out\": 10},"
                          "{\"type\": \"gelu\"},"
                          "{\"type\": \"residual_mlp\", \"dim\": 10, \"hidden\": 12},"
                          "{\"type\": \"linear\", \"in\": 10, \"out\": 3}]}";

static const char *SPEC_DROPOUT = "{\"layers\": ["
                                  "{\"type\": \"linear\", \"in\": 6, \"out\": 10},"
                                  "{\"type\": \"dropout\", \"p\": 0.25},"
                                  "{\"type\": \"tanh\"},"
                                  "{\"type\": \"linear\", \"in\": 10, \"out\": 3}]}";

#define ROWS 10
#define IN 6
#define OUT 3

static float X[ROWS * IN], Y[ROWS * OUT];
static const int64_t XS[2] = {ROWS, IN}, YS[2] = {ROWS, OUT};

static int setup(void **state) {
    (void)state;
    ts_fill_uniform(X, ROWS * IN, 31, -1.5f, 1.5f);
    ts_fill_uniform(Y, ROWS * OUT, 32, -1.f, 1.f);
    return 0;
}

/* ---- a DLPack tensor whose deleter counts ------------------------------------------------- */

typedef struct counted {
    DLManagedTensor mt;
    DLManagedTensor *inner;
    int *counter;
} counted;

static void counted_deleter(DLManagedTensor *self) {
    counted *c = self->manager_ctx;
    __atomic_fetch_add(c->counter, 1, __ATOMIC_SEQ_CST);
    ts_free(c->inner);
    free(c);
}

static DLManagedTensor *count_deletes(DLManagedTensor *t, int *counter) {
    counted *c = calloc(1, sizeof *c);
    c->mt.dl_tensor = t->dl_tensor;
    c->mt.manager_ctx = c;
    c->mt.deleter = counted_deleter;
    c->inner = t;
    c->counter = counter;
    return &c->mt;
}

static int deletes(int *counter) { return __atomic_load_n(counter, __ATOMIC_SEQ_CST); }

/* ---- loss callback ------------------------------------------------------------------------ */

typedef struct mse_ctx {
    int calls;
    int seen[16];
    int fail_at;   /* microbatch whose callback fails; -1: never */
    int grad_f64;  /* return the gradient as float64 */
    int deleted;   /* gradient tensors released by RoundPipe */
    int bad_input; /* set when outputs/labels were not as documented */
} mse_ctx;

static int32_t mse_callback(double *out_loss, DLManagedTensor **out_grad,
                            const DLManagedTensor *outputs, const DLManagedTensor *labels,
                            int32_t microbatch, void *user_data) {
    mse_ctx *c = user_data;
    ++c->calls;
    if (microbatch >= 0 && microbatch < 16)
        ++c->seen[microbatch];
    if (microbatch == c->fail_at)
        return 7;
    const DLTensor *o = &outputs->dl_tensor;
    if (!labels || o->dtype.code != kDLFloat || o->dtype.bits != 32 ||
        o->device.device_type != kDLCPU || ts_numel(o) != ts_numel(&labels->dl_tensor)) {
        c->bad_input = 1;
        return 1;
    }
    int64_t n = ts_numel(o);
    float *ov = malloc(sizeof(float) * n), *lv = malloc(sizeof(float) * n);
    float *gv = malloc(sizeof(float) * n);
    ts_read_f32(o, ov);
    ts_read_f32(&labels->dl_tensor, lv);
    double loss = 0.0;
    for (int64_t i = 0; i < n; ++i) {
        double d = (double)ov[i] - lv[i];
        loss += d * d;
        gv[i] = (float)(2.0 * d / (double)n);
    }
    *out_loss = loss / (double)n;
    DLManagedTensor *g =
        c->grad_f64 ? ts_f64(o->ndim, o->shape, gv) : ts_f32(o->ndim, o->shape, gv);
    *out_grad = count_deletes(g, &c->deleted);
    free(ov);
    free(lv);
    free(gv);
    return 0;
}

static double run_fb(rp_model *model, const rp_loss *loss, int nmb, rp_status expect) {
    DLManagedTensor *x = ts_f32(2, XS, X), *y = ts_f32(2, YS, Y);
    const DLManagedTensor *inputs[1] = {x};
    rp_run_config *cfg = ts_config(nmb, 0);
    double l = 0.0;
    rp_status s = rp_forward_backward(&l, NULL, model, inputs, 1, y, loss, cfg);
    if (expect == RP_OK)
        ts_ok(s, "rp_forward_backward", __FILE__, __LINE__);
    else
        ts_err(s, expect, "rp_forward_backward", __FILE__, __LINE__,
               (const char *[]){"callback", NULL});
    rp_run_config_destroy(cfg);
    ts_free(x);
    ts_free(y);
    return l;
}

static void check_mse_callback(int f64) {
    {
        rp_model *a = ts_model(SPEC, 51, 2, NULL, 0), *b = ts_model(SPEC, 51, 2, NULL, 0);
        mse_ctx ctx = {.fail_at = -1, .grad_f64 = f64};
        rp_loss *cb = NULL, *mse = NULL;
        TS_OK(rp_loss_create_callback(&cb, mse_callback, &ctx));
        TS_OK(rp_loss_set_scale(cb, 0.5));
        TS_OK(rp_loss_create(&mse, RP_LOSS_MSE));
        TS_OK(rp_loss_set_scale(mse, 0.5));
        double la = run_fb(a, cb, 3, RP_OK), lb = run_fb(b, mse, 3, RP_OK);
        assert_false(ctx.bad_input);
        assert_int_equal(ctx.calls, 3);
        for (int m = 0; m < 3; ++m)
            assert_int_equal(ctx.seen[m], 1);
        if (!(fabs(la - lb) <= 1e-6 * fabs(lb))) {
            print_error("callback loss %.10g, built-in %.10g (f64 grad: %d)\n", la, lb, f64);
            fail();
        }
        ts_params *ga = ts_grads(a), *gb = ts_grads(b);
        ts_assert_params_close(
            ga, gb, 1e-5, f64 ? "gradient (float64 callback gradient)" : "gradient (callback)");
        ts_params_free(ga);
        ts_params_free(gb);
        /* RoundPipe took ownership of the three gradients and released them. */
        assert_int_equal(deletes(&ctx.deleted), 3);
        rp_loss_destroy(cb);
        rp_loss_destroy(mse);
        rp_model_destroy(a);
        rp_model_destroy(b);
    }
}

static void loss_callback_computing_mse_in_c_equals_builtin_mse(void **state) {
    (void)state;
    check_mse_callback(0);
}

/* The header: out_grad may have "any float dtype". */
static void loss_callback_may_return_a_float64_gradient(void **state) {
    (void)state;
    check_mse_callback(1);
}

/* A failing loss callback: RP_ERR_CALLBACK, nothing of the call accumulated, model usable. The
 * failed call still counts as a training call for the dropout masks (semantics: "counting every
 * call that started running, also failed ones"), so the next call uses k = 2. */
static void failing_loss_callback_is_callback_error_and_accumulates_nothing(void **state) {
    (void)state;
    rp_model *model = ts_model(SPEC_DROPOUT, 52, 3, NULL, 0);
    ref_model *ref = ts_reference_from(model, SPEC_DROPOUT, 52);
    mse_ctx ctx = {.fail_at = -1};
    rp_loss *cb = NULL;
    TS_OK(rp_loss_create_callback(&cb, mse_callback, &ctx));
    run_fb(model, cb, 3, RP_OK); /* k = 0 */
    ref_tensor rx = {X, 0, 2, XS}, ry = {Y, 0, 2, YS};
    ref_fb_args args = {rx, &ry, 3, 0, 0, 0, REF_LOSS_MSE, 1.0};
    assert_int_equal(ref_forward_backward(ref, NULL, NULL, 0, NULL, &args), 0);
    ts_params *before = ts_grads(model);

    ctx.fail_at = 1;                       /* microbatch 0 has already been through the loss */
    run_fb(model, cb, 3, RP_ERR_CALLBACK); /* k = 1, fails */
    ts_params *after = ts_grads(model);
    ts_assert_params_equal(after, before);
    ts_params_free(after);
    ts_params_free(before);

    ctx.fail_at = -1;
    run_fb(model, cb, 3, RP_OK); /* k = 2 */
    args.call_index = 2;
    assert_int_equal(ref_forward_backward(ref, NULL, NULL, 0, NULL, &args), 0);
    ts_assert_grads_match(model, ref, 1e-4, "gradient after a failed call (dropout k = 0 and 2)");

    rp_optimizer *opt = NULL;
    TS_OK(rp_optimizer_create(&opt, RP_OPTIMIZER_SGD));
    TS_OK(rp_optimizer_set_learning_rate(opt, 0.1));
    TS_OK(rp_step(model, opt, 0));
    assert_int_equal(ref_step_sgd(ref, 0.1, 0, 0), 0);
    ts_assert_masters_match(model, ref, 1e-4, "weights after the step");
    rp_optimizer_destroy(opt);
    rp_loss_destroy(cb);
    ref_destroy(ref);
    rp_model_destroy(model);
}

/* ---- step callback ------------------------------------------------------------------------ */

typedef struct sgd_ctx {
    double lr;
    int calls;
    int fail;        /* return this (after updating) */
    int query_error; /* set when a query from inside the callback failed */
} sgd_ctx;

static int32_t hand_sgd(rp_model *model, void *user_data) {
    sgd_ctx *c = user_data;
    ++c->calls;
    size_t count = 0;
    if (rp_param_count(&count, model) != RP_OK) {
        c->query_error = 1;
        return 1;
    }
    for (size_t i = 0; i < count; ++i) {
        DLManagedTensor *w = NULL, *g = NULL;
        const char *name = NULL;
        int64_t shape[8];
        int32_t ndim = 0;
        if (rp_param_name(&name, model, i) != RP_OK ||
            rp_param_shape(shape, &ndim, 8, model, i) != RP_OK ||
            rp_param_master(&w, model, i) != RP_OK || rp_param_grad(&g, model, i) != RP_OK) {
            c->query_error = 1;
            return 1;
        }
        int64_t n = ts_numel(&w->dl_tensor);
        float *wp = (float *)((char *)w->dl_tensor.data + w->dl_tensor.byte_offset);
        float *gv = malloc(sizeof(float) * n);
        ts_read_f32(&g->dl_tensor, gv);
        for (int64_t j = 0; j < n; ++j)
            wp[j] = wp[j] - (float)c->lr * gv[j];
        free(gv);
        ts_free(w);
        ts_free(g);
    }
    return c->fail;
}

static void step_callback_with_hand_written_sgd_equals_builtin_sgd(void **state) {
    (void)state;
    for (int async = 0; async < 2; ++async) {
        rp_model *a = ts_model(SPEC, 53, 2, NULL, 0), *b = ts_model(SPEC, 53, 2, NULL, 0);
        rp_loss *mse = NULL;
        TS_OK(rp_loss_create(&mse, RP_LOSS_MSE));
        rp_optimizer *opt = NULL;
        TS_OK(rp_optimizer_create(&opt, RP_OPTIMIZER_SGD));
        TS_OK(rp_optimizer_set_learning_rate(opt, 0.1));
        sgd_ctx ctx = {0.1, 0, 0, 0};
        for (int t = 0; t < 3; ++t) {
            run_fb(a, mse, 2, RP_OK);
            run_fb(b, mse, 2, RP_OK);
            TS_OK(rp_step(a, opt, async));
            TS_OK(rp_step_callback(b, hand_sgd, &ctx, async));
        }
        TS_OK(rp_synchronize(b));
        assert_int_equal(ctx.calls, 3);
        assert_false(ctx.query_error);
        ts_params *wa = ts_masters(a), *wb = ts_masters(b);
        ts_assert_params_close(wb, wa, 1e-5, async ? "weights (async callback)" : "weights");
        ts_params_free(wa);
        ts_params_free(wb);
        int64_t steps = 0;
        TS_OK(rp_model_step_count(&steps, b));
        assert_int_equal(steps, 3);
        rp_optimizer_destroy(opt);
        rp_loss_destroy(mse);
        rp_model_destroy(a);
        rp_model_destroy(b);
    }
}

/* rp_param_grad_received inside a step callback: what the step's own gradients hold. */
typedef struct received_ctx {
    size_t count;
    int32_t received[16]; /* per parameter, as the callback saw it */
    int query_error;
} received_ctx;

static int32_t record_received(rp_model *model, void *user_data) {
    received_ctx *c = user_data;
    for (size_t i = 0; i < c->count; ++i)
        if (rp_param_grad_received(&c->received[i], model, i) != RP_OK)
            c->query_error = 1;
    return 0;
}

static void assert_all_received(const rp_model *model, size_t count, int32_t want,
                                const char *when) {
    for (size_t i = 0; i < count; ++i) {
        int32_t got = -1;
        TS_OK(rp_param_grad_received(&got, model, i));
        if (got != want)
            fail_msg("%s: parameter %zu received %d, want %d", when, i, (int)got, (int)want);
    }
}

/* Whether a gradient received anything, as the header says: nothing before a call; every
 * parameter after a call that reached it; inside a step callback that step's gradients, while
 * outside the next step's start empty; a gradient view taken outside a step counts (it may be
 * written through); bad arguments are refused. */
static void grad_received_says_what_each_step_has(void **state) {
    (void)state;
    rp_model *model = ts_model(SPEC, 57, 1, NULL, 0);
    rp_loss *mse = NULL;
    TS_OK(rp_loss_create(&mse, RP_LOSS_MSE));
    received_ctx ctx = {0};
    TS_OK(rp_param_count(&ctx.count, model));
    assert_true(ctx.count > 2 && ctx.count <= 16);
    assert_all_received(model, ctx.count, 0, "before any call");
    run_fb(model, mse, 2, RP_OK);
    assert_all_received(model, ctx.count, 1, "after a call");
    TS_OK(rp_step_callback(model, record_received, &ctx, 0));
    assert_false(ctx.query_error);
    for (size_t i = 0; i < ctx.count; ++i)
        assert_int_equal(ctx.received[i], 1);
    assert_all_received(model, ctx.count, 0, "after the step");
    /* A step with no call before it: its callback sees no gradient. */
    TS_OK(rp_step_callback(model, record_received, &ctx, 0));
    for (size_t i = 0; i < ctx.count; ++i)
        assert_int_equal(ctx.received[i], 0);
    /* A view taken outside a step: that parameter only. */
    DLManagedTensor *g = NULL;
    TS_OK(rp_param_grad(&g, model, 1));
    ts_free(g);
    for (size_t i = 0; i < ctx.count; ++i) {
        int32_t got = -1;
        TS_OK(rp_param_grad_received(&got, model, i));
        assert_int_equal(got, i == 1 ? 1 : 0);
    }
    int32_t got = 0;
    TS_ERR(rp_param_grad_received(NULL, model, 0), RP_ERR_INVALID_ARGUMENT, "out_received");
    TS_ERR(rp_param_grad_received(&got, model, ctx.count), RP_ERR_INVALID_ARGUMENT, "index|range");
    TS_ERR(rp_param_grad_received(&got, NULL, 0), RP_ERR_INVALID_ARGUMENT, "model");
    rp_loss_destroy(mse);
    rp_model_destroy(model);
}

static void failing_sync_step_callback_is_callback_error_weights_as_left(void **state) {
    (void)state;
    rp_model *model = ts_model(SPEC, 54, 1, NULL, 0);
    rp_loss *mse = NULL;
    TS_OK(rp_loss_create(&mse, RP_LOSS_MSE));
    run_fb(model, mse, 2, RP_OK);
    ts_params *w0 = ts_masters(model), *g0 = ts_grads(model);
    sgd_ctx ctx = {0.1, 0, 3, 0};
    TS_ERR(rp_step_callback(model, hand_sgd, &ctx, 0), RP_ERR_CALLBACK, "callback");
    assert_int_equal(ctx.calls, 1);
    /* "the weights then stay as the callback left them": w0 - lr g0 */
    ts_params *w1 = ts_masters(model);
    for (size_t i = 0; i < w0->count; ++i)
        for (int64_t j = 0; j < w0->numel[i]; ++j)
            w0->data[i][j] = w0->data[i][j] - 0.1f * g0->data[i][j];
    ts_assert_params_close(w1, w0, 1e-6, "weights left by the failed callback");
    /* Reported once: the model goes on. */
    TS_OK(rp_synchronize(model));
    ctx.fail = 0;
    run_fb(model, mse, 2, RP_OK);
    TS_OK(rp_step_callback(model, hand_sgd, &ctx, 0));
    assert_int_equal(ctx.calls, 2);
    ts_params_free(w0);
    ts_params_free(g0);
    ts_params_free(w1);
    rp_loss_destroy(mse);
    rp_model_destroy(model);
}

static void failing_async_step_callback_is_reported_by_next_synchronize_or_step(void **state) {
    (void)state;
    rp_model *model = ts_model(SPEC, 55, 2, NULL, 0);
    rp_loss *mse = NULL;
    TS_OK(rp_loss_create(&mse, RP_LOSS_MSE));
    sgd_ctx bad = {0.1, 0, 1, 0};

    /* Reported by rp_synchronize, once. */
    run_fb(model, mse, 2, RP_OK);
    TS_OK(rp_step_callback(model, hand_sgd, &bad, 1));
    TS_ERR(rp_synchronize(model), RP_ERR_CALLBACK, "callback");
    TS_OK(rp_synchronize(model));

    /* Reported by the next rp_step, which then enqueues nothing; a retry works. */
    run_fb(model, mse, 2, RP_OK);
    TS_OK(rp_step_callback(model, hand_sgd, &bad, 1));
    run_fb(model, mse, 2, RP_OK);
    rp_optimizer *opt = NULL;
    TS_OK(rp_optimizer_create(&opt, RP_OPTIMIZER_SGD));
    TS_ERR(rp_step(model, opt, 1), RP_ERR_CALLBACK, "callback");
    int64_t steps = 0;
    TS_OK(rp_model_step_count(&steps, model));
    assert_int_equal(steps, 2);
    TS_OK(rp_step(model, opt, 1));
    TS_OK(rp_synchronize(model));
    TS_OK(rp_model_step_count(&steps, model));
    assert_int_equal(steps, 3);
    assert_int_equal(bad.calls, 2);
    rp_optimizer_destroy(opt);
    rp_loss_destroy(mse);
    rp_model_destroy(model);
}

/* ---- split callback ----------------------------------------------------------------------- */

typedef struct split_ctx {
    int calls;
    int deleted;
    int fail;        /* fill slot 0 then fail */
    const int *rows; /* custom piece sizes along dim 0 (NULL: tensor_split) */
} split_ctx;

static int32_t split_rows(DLManagedTensor **out_pieces, const DLManagedTensor *const *inputs,
                          size_t n_inputs, int32_t num_microbatch, void *user_data) {
    split_ctx *c = user_data;
    ++c->calls;
    for (size_t i = 0; i < n_inputs; ++i) {
        const DLTensor *t = &inputs[i]->dl_tensor;
        int64_t rows = t->shape[0], row_elems = ts_numel(t) / rows;
        float *all = malloc(sizeof(float) * ts_numel(t));
        ts_read_f32(t, all);
        int64_t start = 0;
        for (int32_t m = 0; m < num_microbatch; ++m) {
            int64_t size =
                c->rows ? c->rows[m] : rows / num_microbatch + (m < rows % num_microbatch ? 1 : 0);
            int64_t shape[8];
            for (int32_t d = 0; d < t->ndim; ++d)
                shape[d] = t->shape[d];
            shape[0] = size;
            out_pieces[m * n_inputs + i] =
                count_deletes(ts_f32(t->ndim, shape, all + start * row_elems), &c->deleted);
            start += size;
            if (c->fail) {
                free(all);
                return 1;
            }
        }
        free(all);
    }
    return 0;
}

static void split_callback_reproducing_tensor_split_equals_default_split(void **state) {
    (void)state;
    rp_model *a = ts_model(SPEC, 56, 2, NULL, 0), *b = ts_model(SPEC, 56, 2, NULL, 0);
    rp_loss *mse = NULL;
    TS_OK(rp_loss_create(&mse, RP_LOSS_MSE));
    split_ctx ctx = {0};
    DLManagedTensor *x = ts_f32(2, XS, X), *y = ts_f32(2, YS, Y);
    const DLManagedTensor *inputs[1] = {x};
    rp_run_config *cfg = ts_config(3, 0);
    rp_run_config *cb_cfg = ts_config(3, 0);
    TS_OK(rp_run_config_set_split_callback(cb_cfg, split_rows, &ctx));
    double la = 0, lb = 0;
    TS_OK(rp_forward_backward(&la, NULL, a, inputs, 1, y, mse, cb_cfg));
    TS_OK(rp_forward_backward(&lb, NULL, b, inputs, 1, y, mse, cfg));
    assert_int_equal(ctx.calls, 1);
    assert_true(fabs(la - lb) <= 1e-6 * fabs(lb));
    ts_params *ga = ts_grads(a), *gb = ts_grads(b);
    ts_assert_params_close(ga, gb, 1e-5, "gradient with split callback");
    ts_params_free(ga);
    ts_params_free(gb);
    /* RoundPipe owns the three pieces and has released them once the call is done. */
    assert_int_equal(deletes(&ctx.deleted), 3);
    rp_run_config_destroy(cfg);
    rp_run_config_destroy(cb_cfg);
    ts_free(x);
    ts_free(y);
    rp_loss_destroy(mse);
    rp_model_destroy(a);
    rp_model_destroy(b);
}

static void read_output(const rp_tensor_list *outs, size_t index, int64_t rows, float *dst) {
    DLManagedTensor *o = NULL;
    TS_OK(rp_tensor_list_get(&o, outs, index));
    assert_int_equal(o->dl_tensor.ndim, 2);
    assert_int_equal(o->dl_tensor.shape[0], rows);
    assert_int_equal(o->dl_tensor.shape[1], OUT);
    ts_read_f32(&o->dl_tensor, dst);
    ts_free(o);
}

/* Uneven custom pieces (1 and 9 rows) with merge_output 0: one output per microbatch, with the
 * rows of the merged default forward. */
static void split_callback_with_uneven_pieces_and_unmerged_outputs(void **state) {
    (void)state;
    rp_model *model = ts_model(SPEC, 57, 2, NULL, 0);
    static const int ROWS_1_9[2] = {1, 9};
    split_ctx ctx = {.rows = ROWS_1_9};
    DLManagedTensor *x = ts_f32(2, XS, X);
    const DLManagedTensor *inputs[1] = {x};
    rp_run_config *cfg = ts_config(2, 0);
    TS_OK(rp_run_config_set_split_callback(cfg, split_rows, &ctx));
    TS_OK(rp_run_config_set_merge_output(cfg, 0));
    rp_tensor_list *outs = NULL;
    TS_OK(rp_forward(&outs, model, inputs, 1, cfg));
    size_t n = 0;
    TS_OK(rp_tensor_list_size(&n, outs));
    assert_int_equal(n, 2);
    float got[ROWS * OUT], want[ROWS * OUT];
    read_output(outs, 0, 1, got);
    read_output(outs, 1, 9, got + OUT);
    rp_tensor_list_destroy(outs);

    rp_tensor_list *merged = NULL;
    TS_OK(rp_forward(&merged, model, inputs, 1, NULL));
    read_output(merged, 0, ROWS, want);
    rp_tensor_list_destroy(merged);
    assert_true(ts_rel_err(got, want, ROWS * OUT, 1e-6) <= 1e-5);
    assert_int_equal(deletes(&ctx.deleted), 2);
    rp_run_config_destroy(cfg);
    ts_free(x);
    rp_model_destroy(model);
}

static void failing_split_callback_is_callback_error_and_pieces_are_released(void **state) {
    (void)state;
    rp_model *model = ts_model(SPEC, 58, 2, NULL, 0);
    split_ctx ctx = {.fail = 1};
    DLManagedTensor *x = ts_f32(2, XS, X), *y = ts_f32(2, YS, Y);
    const DLManagedTensor *inputs[1] = {x};
    rp_run_config *cfg = ts_config(2, 0);
    TS_OK(rp_run_config_set_split_callback(cfg, split_rows, &ctx));
    rp_loss *mse = NULL;
    TS_OK(rp_loss_create(&mse, RP_LOSS_MSE));
    ts_params *g0 = ts_grads(model);
    TS_ERR(rp_forward_backward(NULL, NULL, model, inputs, 1, y, mse, cfg), RP_ERR_CALLBACK,
           "split|callback");
    rp_tensor_list *outs = NULL;
    TS_ERR(rp_forward(&outs, model, inputs, 1, cfg), RP_ERR_CALLBACK, "split|callback");
    assert_null(outs);
    /* "RoundPipe takes ownership of every tensor stored there ... also when the callback
     * fails": the piece stored before each failure was released. */
    assert_int_equal(deletes(&ctx.deleted), 2);
    ts_params *g1 = ts_grads(model);
    ts_assert_params_equal(g1, g0);
    ts_params_free(g0);
    ts_params_free(g1);
    ts_assert_trains_like_reference(model, SPEC, IN, OUT);
    rp_loss_destroy(mse);
    rp_run_config_destroy(cfg);
    ts_free(x);
    ts_free(y);
    rp_model_destroy(model);
}

/* Two inputs: slot [m * n_inputs + i] holds microbatch m of input i. Input 1 has the shape of
 * input 0 but other values, so a transposed slot layout would silently change the outputs. */
static void split_callback_slots_are_microbatch_major_over_inputs(void **state) {
    (void)state;
    rp_model *model = ts_model(SPEC, 60, 2, NULL, 0);
    split_ctx ctx = {0};
    float other[ROWS * IN];
    ts_fill_uniform(other, ROWS * IN, 99, 5.f, 6.f);
    DLManagedTensor *x = ts_f32(2, XS, X), *x2 = ts_f32(2, XS, other);
    const DLManagedTensor *two[2] = {x, x2}, *one[1] = {x};
    rp_run_config *cfg = ts_config(3, 0);
    TS_OK(rp_run_config_set_split_callback(cfg, split_rows, &ctx));
    rp_tensor_list *outs = NULL;
    TS_OK(rp_forward(&outs, model, two, 2, cfg));
    float got[ROWS * OUT], want[ROWS * OUT];
    read_output(outs, 0, ROWS, got);
    rp_tensor_list_destroy(outs);
    assert_int_equal(deletes(&ctx.deleted), 6);
    /* The default split of two inputs, and one input alone, give the same outputs. */
    TS_OK(rp_forward(&outs, model, one, 1, NULL));
    read_output(outs, 0, ROWS, want);
    rp_tensor_list_destroy(outs);
    assert_true(ts_rel_err(got, want, ROWS * OUT, 1e-6) <= 1e-6);
    TS_OK(rp_forward(&outs, model, two, 2, NULL));
    read_output(outs, 0, ROWS, got);
    rp_tensor_list_destroy(outs);
    assert_true(ts_rel_err(got, want, ROWS * OUT, 1e-6) <= 1e-6);
    rp_run_config_destroy(cfg);
    ts_free(x);
    ts_free(x2);
    rp_model_destroy(model);
}

/* merge_output 0 on forward_backward: num_microbatch outputs of 4, 3 and 3 rows. */
static void unmerged_outputs_are_one_tensor_per_microbatch(void **state) {
    (void)state;
    rp_model *model = ts_model(SPEC, 59, 3, NULL, 0);
    rp_loss *mse = NULL;
    TS_OK(rp_loss_create(&mse, RP_LOSS_MSE));
    DLManagedTensor *x = ts_f32(2, XS, X), *y = ts_f32(2, YS, Y);
    const DLManagedTensor *inputs[1] = {x};
    rp_run_config *cfg = ts_config(3, 0);
    TS_OK(rp_run_config_set_merge_output(cfg, 0));
    rp_tensor_list *outs = NULL;
    TS_OK(rp_forward_backward(NULL, &outs, model, inputs, 1, y, mse, cfg));
    size_t n = 0;
    TS_OK(rp_tensor_list_size(&n, outs));
    assert_int_equal(n, 3);
    float got[ROWS * OUT], want[ROWS * OUT];
    read_output(outs, 0, 4, got);
    read_output(outs, 1, 3, got + 4 * OUT);
    read_output(outs, 2, 3, got + 7 * OUT);
    /* rp_tensor_list_get hands out independent references to the same memory. */
    DLManagedTensor *r1 = NULL, *r2 = NULL;
    TS_OK(rp_tensor_list_get(&r1, outs, 1));
    TS_OK(rp_tensor_list_get(&r2, outs, 1));
    assert_ptr_equal((char *)r1->dl_tensor.data + r1->dl_tensor.byte_offset,
                     (char *)r2->dl_tensor.data + r2->dl_tensor.byte_offset);
    rp_tensor_list_destroy(outs);
    float after[3 * OUT];
    ts_read_f32(&r1->dl_tensor, after); /* still valid after the list is gone */
    assert_memory_equal(after, got + 4 * OUT, sizeof after);
    ts_free(r1);
    ts_free(r2);

    /* Same rows as the merged output of the same call on a twin model. */
    rp_model *twin = ts_model(SPEC, 59, 3, NULL, 0);
    rp_run_config *merged_cfg = ts_config(3, 0);
    rp_tensor_list *merged = NULL;
    TS_OK(rp_forward_backward(NULL, &merged, twin, inputs, 1, y, mse, merged_cfg));
    TS_OK(rp_tensor_list_size(&n, merged));
    assert_int_equal(n, 1);
    read_output(merged, 0, ROWS, want);
    rp_tensor_list_destroy(merged);
    assert_true(ts_rel_err(got, want, ROWS * OUT, 1e-6) <= 1e-6);
    rp_run_config_destroy(merged_cfg);
    rp_model_destroy(twin);
    rp_run_config_destroy(cfg);
    ts_free(x);
    ts_free(y);
    rp_loss_destroy(mse);
    rp_model_destroy(model);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(loss_callback_computing_mse_in_c_equals_builtin_mse),
        cmocka_unit_test(loss_callback_may_return_a_float64_gradient),
        cmocka_unit_test(failing_loss_callback_is_callback_error_and_accumulates_nothing),
        cmocka_unit_test(step_callback_with_hand_written_sgd_equals_builtin_sgd),
        cmocka_unit_test(grad_received_says_what_each_step_has),
        cmocka_unit_test(failing_sync_step_callback_is_callback_error_weights_as_left),
        cmocka_unit_test(failing_async_step_callback_is_reported_by_next_synchronize_or_step),
        cmocka_unit_test(split_callback_reproducing_tensor_split_equals_default_split),
        cmocka_unit_test(split_callback_with_uneven_pieces_and_unmerged_outputs),
        cmocka_unit_test(failing_split_callback_is_callback_error_and_pieces_are_released),
        cmocka_unit_test(split_callback_slots_are_microbatch_major_over_inputs),
        cmocka_unit_test(unmerged_outputs_are_one_tensor_per_microbatch),
    };
    return cmocka_run_group_tests_name("callbacks", tests, setup, NULL);
}
