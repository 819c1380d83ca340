/*
 * test_accumulation.c - gradients accumulate across rp_forward_backward calls until rp_step.
 *
 * Two calls on 6 rows (2 microbatches: 3+3) and 4 rows (2 microbatches: 2+2) before one step
 * are the same computation as one call on the concatenated 10 rows with 4 microbatches
 * (tensor_split(10, 4) = 3,3,2,2): same microbatches, same losses, same gradients. Checked
 * through the API (two models from the same seed) and against the reference.
 *
 * Tolerances: API vs API 1e-5 relative (identical per-microbatch arithmetic; only the order
 * in which microbatch gradients are added may differ, fp32 roundoff 6e-8 per addition);
 * against the reference 1e-4 as in test_equivalence.c.
 *
 * Also: a parameter that the last microbatch of a call gives no gradient still gets the earlier
 * microbatches' gradients (hand-computed).
 */
#include "test_support.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static const char *SPEC = "{\"layers\": ["
                          "{\"type\": \"linear\", \"in\": 6, \"out\": 12},"
                          "{\"type\": \"layer_norm\", \"dim\": 12},"
                          "{\"type\": \"relu\"},"
                          "{\"type\": \"residual_mlp\", \"dim\": 12, \"hidden\": 16},"
                          "{\"type\": \"linear\", \"in\": 12, \"out\": 3}]}";

static const char *SPEC_DROPOUT = "{\"layers\": ["
                                  "{\"type\": \"linear\", \"in\": 6, \"out\": 12},"
                                  "{\"type\": \"dropout\", \"p\": 0.3},"
                                  "{\"type\": \"silu\"},"
                                  "{\"type\": \"linear\", \"in\": 12, \"out\": 3}]}";

#define ROWS 10
#define IN 6
#define OUT 3

static float X[ROWS * IN], Y[ROWS * OUT];

static int setup(void **state) {
    (void)state;
    ts_fill_uniform(X, ROWS * IN, 11, -1.5f, 1.5f);
    ts_fill_uniform(Y, ROWS * OUT, 12, -1.f, 1.f);
    return 0;
}

/* fb on rows [r0, r0 + rows) with nmb microbatches. */
static double fb_rows(rp_model *model, int r0, int rows, int nmb, int grain) {
    int64_t xs[2] = {rows, IN}, ys[2] = {rows, OUT};
    DLManagedTensor *x = ts_f32(2, xs, X + r0 * IN), *y = ts_f32(2, ys, Y + r0 * OUT);
    rp_run_config *cfg = ts_config(nmb, grain);
    rp_loss *loss = NULL;
    TS_OK(rp_loss_create(&loss, RP_LOSS_MSE));
    const DLManagedTensor *inputs[1] = {x};
    double l = 0.0;
    TS_OK(rp_forward_backward(&l, NULL, model, inputs, 1, y, loss, cfg));
    rp_loss_destroy(loss);
    rp_run_config_destroy(cfg);
    ts_free(x);
    ts_free(y);
    return l;
}

static double ref_fb_rows(ref_model *ref, int r0, int rows, int nmb, int64_t call) {
    return ts_ref_mse_call(ref, X + r0 * IN, Y + r0 * OUT, rows, IN, OUT, nmb, call);
}

static void assert_loss(double got, double want, double tol) {
    if (!(fabs(got - want) <= tol * fabs(want))) {
        print_error("loss %.10g, expected %.10g\n", got, want);
        fail();
    }
}

static void two_calls_before_a_step_equal_one_call_on_the_concatenated_batch(void **state) {
    (void)state;
    rp_model *a = ts_model(SPEC, 21, 2, NULL, 0);
    rp_model *b = ts_model(SPEC, 21, 3, NULL, 0);
    ts_params *wa = ts_masters(a), *wb = ts_masters(b);
    /* Initialisation depends on the seed only, not on the number of devices. */
    ts_assert_params_equal(wa, wb);
    ts_params_free(wa);
    ts_params_free(wb);
    ref_model *ref = ts_reference_from(a, SPEC, 21);

    double la = fb_rows(a, 0, 6, 2, RP_GRAIN_STAGE) + fb_rows(a, 6, 4, 2, RP_GRAIN_LAYER);
    double lb = fb_rows(b, 0, 10, 4, 0);
    double lr = ref_fb_rows(ref, 0, 6, 2, 0) + ref_fb_rows(ref, 6, 4, 2, 1);
    assert_loss(la, lb, 1e-5);
    assert_loss(la, lr, 1e-5);

    ts_params *ga = ts_grads(a), *gb = ts_grads(b), *gr = ts_ref_params(ref, 1);
    ts_assert_params_close(ga, gb, 1e-5, "accumulated gradient vs one call");
    ts_assert_params_close(ga, gr, 1e-4, "accumulated gradient vs reference");
    ts_params_free(ga);
    ts_params_free(gb);
    ts_params_free(gr);

    rp_optimizer *opt = ts_adamw(1e-2);
    TS_OK(rp_step(a, opt, 0));
    TS_OK(rp_step(b, opt, 0));
    assert_int_equal(ref_step_adamw(ref, 1e-2, 0.9, 0.999, 1e-8, 1e-2), 0);
    wa = ts_masters(a);
    wb = ts_masters(b);
    ts_params *wr = ts_ref_params(ref, 0);
    ts_assert_params_close(wa, wb, 1e-5, "weights after the step vs one call");
    ts_assert_params_close(wa, wr, 1e-4, "weights after the step vs reference");
    ts_params_free(wa);
    ts_params_free(wb);
    ts_params_free(wr);

    /* The step consumed the gradients: accumulation starts afresh at zero. */
    ts_params *g = ts_grads(a);
    for (size_t i = 0; i < g->count; ++i)
        for (int64_t j = 0; j < g->numel[i]; ++j)
            assert_true(g->data[i][j] == 0.0f);
    ts_params_free(g);

    rp_optimizer_destroy(opt);
    ref_destroy(ref);
    rp_model_destroy(a);
    rp_model_destroy(b);
}

/* The same with async steps: the gradients of both calls go into the one step. */
static void accumulation_feeds_an_async_step(void **state) {
    (void)state;
    rp_model *a = ts_model(SPEC, 22, 2, NULL, 0);
    ref_model *ref = ts_reference_from(a, SPEC, 22);
    fb_rows(a, 0, 6, 2, 0);
    fb_rows(a, 6, 4, 2, 0);
    ref_fb_rows(ref, 0, 6, 2, 0);
    ref_fb_rows(ref, 6, 4, 2, 1);
    rp_optimizer *opt = ts_adamw(1e-2);
    TS_OK(rp_step(a, opt, 1));
    assert_int_equal(ref_step_adamw(ref, 1e-2, 0.9, 0.999, 1e-8, 1e-2), 0);
    TS_OK(rp_synchronize(a));
    ts_assert_masters_match(a, ref, 1e-4, "weights after async step");
    rp_optimizer_destroy(opt);
    ref_destroy(ref);
    rp_model_destroy(a);
}

/* Dropout masks follow the call index k: the second call of an accumulation uses k = 1. */
static void accumulated_calls_with_dropout_use_successive_call_indices(void **state) {
    (void)state;
    rp_model *a = ts_model(SPEC_DROPOUT, 23, 3, NULL, 0);
    ref_model *ref = ts_reference_from(a, SPEC_DROPOUT, 23);
    double l = fb_rows(a, 0, 6, 2, RP_GRAIN_LAYER) + fb_rows(a, 6, 4, 3, RP_GRAIN_STAGE);
    double lr = ref_fb_rows(ref, 0, 6, 2, 0) + ref_fb_rows(ref, 6, 4, 3, 1);
    assert_loss(l, lr, 1e-5);
    ts_assert_grads_match(a, ref, 1e-4, "accumulated gradient with dropout");
    ref_destroy(ref);
    rp_model_destroy(a);
}

static void zero_grad_drops_what_was_accumulated(void **state) {
    (void)state;
    rp_model *a = ts_model(SPEC, 24, 1, NULL, 0);
    rp_model *b = ts_model(SPEC, 24, 1, NULL, 0);
    fb_rows(a, 0, 6, 2, 0);
    TS_OK(rp_zero_grad(a));
    ts_params *g = ts_grads(a);
    for (size_t i = 0; i < g->count; ++i)
        for (int64_t j = 0; j < g->numel[i]; ++j)
            assert_true(g->data[i][j] == 0.0f);
    ts_params_free(g);
    fb_rows(a, 6, 4, 2, 0);
    fb_rows(b, 6, 4, 2, 0);
    ts_params *ga = ts_grads(a), *gb = ts_grads(b);
    ts_assert_params_close(ga, gb, 1e-6, "gradient after zero_grad");
    ts_params_free(ga);
    ts_params_free(gb);
    rp_model_destroy(a);
    rp_model_destroy(b);
}

/* ---- a parameter the last microbatch gives no gradient ----------------------------------- */

/* A caller-defined layer y = x * w (elementwise over D columns) whose backward gives no gradient
 * for w in the call's last microbatch. The engine sends each gradient to the host as it becomes
 * final in the last microbatch's backward; w gets nothing in that backward and must still arrive
 * with the earlier microbatches' sum. The model is the layer then tanh, one stage each on two CPU devices
 * (the layer's stage is a backward job, tanh the tail), MSE against t: for microbatch m of R
 * rows, dL/dz = 2 (z - t) / (R D) with z = tanh(y), dL/dy = dL/dz (1 - z^2), dL/dw = sum over
 * its rows of dL/dy x. Worked out here in double; fp32 engine: 1e-5 relative. */
enum { LR_ROWS = 6, LR_D = 3, LR_MB = 3 };

typedef struct scale_context {
    int64_t rows;
    float x[LR_ROWS * LR_D];
    float w[LR_D];
} scale_context;

static int32_t last_less_forward(rp_tensor_list *out, void **ctx, const rp_layer_call *call,
                                 const DLManagedTensor *const *inputs, size_t n, void *ud) {
    (void)ud;
    (void)n;
    const DLTensor *x = &inputs[0]->dl_tensor;
    const DLManagedTensor *const *params = NULL;
    size_t n_params = 0;
    if (rp_layer_call_tensors(&params, &n_params, NULL, NULL, call) != RP_OK || n_params != 1)
        return 1;
    scale_context c;
    c.rows = x->shape[0];
    ts_read_f32(x, c.x);
    ts_read_f32(&params[0]->dl_tensor, c.w);
    float y[LR_ROWS * LR_D];
    for (int64_t i = 0; i < c.rows * LR_D; ++i)
        y[i] = c.x[i] * c.w[i % LR_D];
    int64_t shape[2] = {c.rows, LR_D};
    rp_tensor_list_push(out, ts_f32(2, shape, y));
    int32_t phase = RP_PHASE_FORWARD;
    rp_layer_call_info(&phase, NULL, NULL, NULL, NULL, NULL, NULL, call);
    if (phase != RP_PHASE_FORWARD) { /* a recompute or the tail: backward follows */
        scale_context *keep = malloc(sizeof *keep);
        *keep = c;
        *ctx = keep;
    }
    return 0;
}

static int32_t last_less_backward(rp_tensor_list *in_grads, rp_tensor_list *param_grads,
                                  void *vctx, const rp_layer_call *call,
                                  const DLManagedTensor *const *out_grads, size_t n, void *ud) {
    (void)ud;
    (void)n;
    const scale_context *c = vctx;
    int32_t microbatch = -1;
    rp_layer_call_info(NULL, NULL, NULL, NULL, NULL, &microbatch, NULL, call);
    float g[LR_ROWS * LR_D], dx[LR_ROWS * LR_D], dw[LR_D] = {0};
    ts_read_f32(&out_grads[0]->dl_tensor, g);
    for (int64_t i = 0; i < c->rows * LR_D; ++i) {
        dx[i] = g[i] * c->w[i % LR_D];
        dw[i % LR_D] += g[i] * c->x[i];
    }
    int64_t shape[2] = {c->rows, LR_D}, wshape[1] = {LR_D};
    rp_tensor_list_push(in_grads, ts_f32(2, shape, dx));
    rp_tensor_list_push(param_grads, microbatch == LR_MB - 1 ? NULL : ts_f32(1, wshape, dw));
    return 0;
}

static void last_less_release(void *ctx, void *ud) {
    (void)ud;
    free(ctx);
}

static void a_parameter_the_last_microbatch_skips_keeps_the_earlier_gradients(void **state) {
    (void)state;
    const float w0[LR_D] = {0.5f, -1.25f, 2.0f};
    rp_layer_def *def = NULL;
    TS_OK(rp_layer_def_create(&def, "c:last_less", last_less_forward, last_less_backward,
                              last_less_release, NULL));
    int64_t wshape[1] = {LR_D};
    DLManagedTensor *initial = ts_f32(1, wshape, w0);
    TS_OK(rp_layer_def_add_param(def, "w", initial, 1));
    ts_free(initial);
    const int32_t plan[2] = {1, 1};
    rp_model_options *opt = NULL;
    TS_OK(rp_model_options_create(&opt));
    TS_OK(rp_model_options_set_devices(opt, RP_DEVICE_CPU, 2));
    TS_OK(rp_model_options_set_stage_plan(opt, plan, 2));
    rp_model *m = NULL;
    TS_OK(rp_model_create_with_layers(
        &m, "{\"layers\": [{\"type\": \"caller\", \"def\": 0}, {\"type\": \"tanh\"}]}",
        (const rp_layer_def *const *)&def, 1, opt));
    rp_model_options_destroy(opt);
    rp_layer_def_destroy(def);

    float x[LR_ROWS * LR_D], t[LR_ROWS * LR_D];
    ts_fill_uniform(x, LR_ROWS * LR_D, 31, -1.0f, 1.0f);
    ts_fill_uniform(t, LR_ROWS * LR_D, 32, -0.5f, 0.5f);
    int64_t shape[2] = {LR_ROWS, LR_D};
    DLManagedTensor *in = ts_f32(2, shape, x), *labels = ts_f32(2, shape, t);
    rp_loss *loss = NULL;
    TS_OK(rp_loss_create(&loss, RP_LOSS_MSE));
    rp_run_config *cfg = ts_config(LR_MB, 0);
    double value = 0;
    TS_OK(rp_forward_backward(&value, NULL, m, (const DLManagedTensor *const *)&in, 1, labels,
                              loss, cfg));

    const int rows_per_mb = LR_ROWS / LR_MB;
    double want[LR_D] = {0};
    for (int r = 0; r < LR_ROWS; ++r) {
        if (r / rows_per_mb == LR_MB - 1)
            continue; /* the last microbatch gives w no gradient */
        for (int j = 0; j < LR_D; ++j) {
            const double xi = x[r * LR_D + j], y = xi * (double)w0[j], z = tanh(y);
            const double dz = 2.0 * (z - t[r * LR_D + j]) / (rows_per_mb * LR_D);
            want[j] += dz * (1.0 - z * z) * xi;
        }
    }
    TS_OK(rp_synchronize(m));
    ts_params *g = ts_grads(m);
    assert_int_equal(g->count, 1);
    for (int j = 0; j < LR_D; ++j)
        if (fabs(g->data[0][j] - want[j]) > 1e-5 * fmax(1e-3, fabs(want[j])))
            fail_msg("w grad[%d] = %.8g, expected %.8g", j, g->data[0][j], want[j]);
    ts_params_free(g);
    rp_run_config_destroy(cfg);
    rp_loss_destroy(loss);
    ts_free(in);
    ts_free(labels);
    rp_model_destroy(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(two_calls_before_a_step_equal_one_call_on_the_concatenated_batch),
        cmocka_unit_test(accumulation_feeds_an_async_step),
        cmocka_unit_test(accumulated_calls_with_dropout_use_successive_call_indices),
        cmocka_unit_test(zero_grad_drops_what_was_accumulated),
        cmocka_unit_test(a_parameter_the_last_microbatch_skips_keeps_the_earlier_gradients),
    };
    return cmocka_run_group_tests_name("accumulation", tests, setup, NULL);
}
