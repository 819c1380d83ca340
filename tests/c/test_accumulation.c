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
 */
#include "test_support.h"

#include <math.h>
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
    int64_t xs[2] = {rows, IN}, ys[2] = {rows, OUT};
    ref_tensor x = {X + r0 * IN, 0, 2, xs}, y = {Y + r0 * OUT, 0, 2, ys};
    ref_fb_args a = {x, &y, nmb, 0, 0, call, REF_LOSS_MSE, 1.0};
    double l = 0.0;
    if (ref_forward_backward(ref, &l, NULL, 0, NULL, &a) != 0) {
        print_error("reference: %s\n", ref_last_error());
        fail();
    }
    return l;
}

static void assert_loss(double got, double want, double tol) {
    if (!(fabs(got - want) <= tol * fabs(want))) {
        print_error("loss %.10g, expected %.10g\n", got, want);
        fail();
    }
}

static rp_optimizer *adamw(void) {
    rp_optimizer *opt = NULL;
    TS_OK(rp_optimizer_create(&opt, RP_OPTIMIZER_ADAMW));
    TS_OK(rp_optimizer_set_learning_rate(opt, 1e-2));
    return opt;
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

    rp_optimizer *opt = adamw();
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
    rp_optimizer *opt = adamw();
    TS_OK(rp_step(a, opt, 1));
    assert_int_equal(ref_step_adamw(ref, 1e-2, 0.9, 0.999, 1e-8, 1e-2), 0);
    TS_OK(rp_synchronize(a));
    ts_params *w = ts_masters(a), *wr = ts_ref_params(ref, 0);
    ts_assert_params_close(w, wr, 1e-4, "weights after async step");
    ts_params_free(w);
    ts_params_free(wr);
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
    ts_params *g = ts_grads(a), *gr = ts_ref_params(ref, 1);
    ts_assert_params_close(g, gr, 1e-4, "accumulated gradient with dropout");
    ts_params_free(g);
    ts_params_free(gr);
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

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(two_calls_before_a_step_equal_one_call_on_the_concatenated_batch),
        cmocka_unit_test(accumulation_feeds_an_async_step),
        cmocka_unit_test(accumulated_calls_with_dropout_use_successive_call_indices),
        cmocka_unit_test(zero_grad_drops_what_was_accumulated),
    };
    return cmocka_run_group_tests_name("accumulation", tests, setup, NULL);
}
