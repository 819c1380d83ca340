/*
 * test_nonfinite.c - inf and nan never pass silently (roundpipe.h: rp_model_nonfinite_counts,
 * rp_model_options_set_skip_nonfinite_steps, rp_step): a call whose loss is not finite is
 * counted and logged; a step whose gradients are not finite is skipped by default and runs when
 * asked; a parameter without a gradient since the last step is left alone, as torch.optim does.
 * Expectations are exact: a skipped step leaves every master weight bitwise unchanged.
 */
#include "test_support.h"

#include <math.h>
#include <pthread.h>
#include <string.h>

static const char *SPEC = "{\"layers\": ["
                          "{\"type\": \"linear\", \"in\": 4, \"out\": 8},"
                          "{\"type\": \"tanh\"},"
                          "{\"type\": \"linear\", \"in\": 8, \"out\": 2}]}";

typedef struct warnings {
    pthread_mutex_t lock;
    int count;
    char last[512];
} warnings;

static void collect(int32_t level, const char *message, void *user_data) {
    warnings *w = user_data;
    if (level < RP_LOG_WARN)
        return;
    pthread_mutex_lock(&w->lock);
    ++w->count;
    strncpy(w->last, message, sizeof w->last - 1);
    pthread_mutex_unlock(&w->lock);
}

static rp_model *model_with(int32_t skip) {
    rp_model_options *o = NULL;
    TS_OK(rp_model_options_create(&o));
    TS_OK(rp_model_options_set_devices(o, ts_device_kind(), ts_devices(1)));
    TS_OK(rp_model_options_set_seed(o, 3));
    if (skip >= 0)
        TS_OK(rp_model_options_set_skip_nonfinite_steps(o, skip));
    rp_model *m = NULL;
    TS_OK(rp_model_create(&m, SPEC, o));
    rp_model_options_destroy(o);
    return m;
}

/* One MSE call on 6 rows; `poison` puts a nan in row 0 of the input. */
static double train_call(rp_model *m, int poison) {
    float x[6 * 4], y[6 * 2];
    ts_fill_uniform(x, 24, 7, -1, 1);
    ts_fill_uniform(y, 12, 8, -1, 1);
    if (poison)
        x[0] = NAN;
    int64_t xs[2] = {6, 4}, ys[2] = {6, 2};
    DLManagedTensor *in = ts_f32(2, xs, x), *lab = ts_f32(2, ys, y);
    const DLManagedTensor *inputs[1] = {in};
    rp_loss *mse = NULL;
    TS_OK(rp_loss_create(&mse, RP_LOSS_MSE));
    double loss = 0;
    TS_OK(rp_forward_backward(&loss, NULL, m, inputs, 1, lab, mse, NULL));
    rp_loss_destroy(mse);
    ts_free(in);
    ts_free(lab);
    return loss;
}

static void step(rp_model *m) {
    rp_optimizer *opt = NULL;
    TS_OK(rp_optimizer_create(&opt, RP_OPTIMIZER_ADAMW));
    TS_OK(rp_optimizer_set_learning_rate(opt, 0.1));
    TS_OK(rp_step(m, opt, 1));
    TS_OK(rp_synchronize(m));
    rp_optimizer_destroy(opt);
}

static int any_nan(const ts_params *p) {
    for (size_t i = 0; i < p->count; ++i)
        for (int64_t k = 0; k < p->numel[i]; ++k)
            if (isnan(p->data[i][k]))
                return 1;
    return 0;
}

static void nan_loss_is_counted_and_logged_and_its_step_skipped(void **state) {
    (void)state;
    warnings w = {.lock = PTHREAD_MUTEX_INITIALIZER};
    TS_OK(rp_set_log_callback(collect, RP_LOG_WARN, &w));
    rp_model *m = model_with(-1); /* the default: skip */
    ts_params *before = ts_masters(m);
    double loss = train_call(m, 1);
    assert_true(isnan(loss));
    int64_t losses = -1, skipped = -1;
    TS_OK(rp_model_nonfinite_counts(&losses, &skipped, m));
    assert_int_equal(losses, 1);
    assert_true(w.count >= 1 && ts_contains(w.last, "loss is nan"));
    step(m);
    TS_OK(rp_model_nonfinite_counts(&losses, &skipped, m));
    assert_int_equal(skipped, 1);
    assert_true(ts_contains(w.last, "skipped"));
    double scale = -1;
    int64_t scaler_skipped = -1;
    TS_OK(rp_model_grad_scale(&scale, &scaler_skipped, m));
    assert_int_equal(scaler_skipped, 1);
    ts_params *after = ts_masters(m);
    ts_assert_params_equal(before, after); /* bitwise: the step did not run */
    /* The model goes on: a clean call and step train as usual. */
    assert_true(isfinite(train_call(m, 0)));
    step(m);
    ts_params *trained = ts_masters(m);
    assert_false(any_nan(trained));
    assert_true(trained->data[0][0] != after->data[0][0]);
    TS_OK(rp_set_log_callback(NULL, RP_LOG_WARN, NULL));
    ts_params_free(before);
    ts_params_free(after);
    ts_params_free(trained);
    rp_model_destroy(m);
}

/* With the rule off the step runs, and nan reaches the weights: proof that the default skip
 * above is what kept them clean. */
static void nonfinite_step_runs_when_skipping_is_off(void **state) {
    (void)state;
    rp_model *m = model_with(0);
    train_call(m, 1);
    step(m);
    ts_params *after = ts_masters(m);
    assert_true(any_nan(after));
    int64_t losses = -1, skipped = -1;
    TS_OK(rp_model_nonfinite_counts(&losses, &skipped, m));
    assert_int_equal(losses, 1);
    assert_int_equal(skipped, 0);
    ts_params_free(after);
    rp_model_destroy(m);
    rp_model_options *o = NULL;
    TS_OK(rp_model_options_create(&o));
    TS_ERR(rp_model_options_set_skip_nonfinite_steps(o, 2), RP_ERR_INVALID_ARGUMENT, "0 or 1");
    rp_model_options_destroy(o);
}

/* rp_model_set_skip_nonfinite_steps: off on a model created with the default, the poisoned
 * step runs (nan in the weights); on again, the next is skipped. An asynchronous step queued
 * before a switch decides with the setting of its time. */
static void skip_rule_switched_at_runtime(void **state) {
    (void)state;
    rp_model *m = model_with(-1);
    TS_OK(rp_model_set_skip_nonfinite_steps(m, 0));
    train_call(m, 1);
    step(m);
    ts_params *after = ts_masters(m);
    assert_true(any_nan(after));
    ts_params_free(after);
    rp_model_destroy(m);

    m = model_with(0);
    TS_OK(rp_model_set_skip_nonfinite_steps(m, 1));
    ts_params *before = ts_masters(m);
    train_call(m, 1);
    rp_optimizer *opt = NULL;
    TS_OK(rp_optimizer_create(&opt, RP_OPTIMIZER_ADAMW));
    TS_OK(rp_step(m, opt, 1)); /* queued while skipping is on */
    TS_OK(rp_model_set_skip_nonfinite_steps(m, 0));
    TS_OK(rp_synchronize(m));
    after = ts_masters(m);
    ts_assert_params_equal(before, after);
    int64_t losses = -1, skipped = -1;
    TS_OK(rp_model_nonfinite_counts(&losses, &skipped, m));
    assert_int_equal(skipped, 1);
    ts_params_free(before);
    ts_params_free(after);
    rp_optimizer_destroy(opt);
    rp_model_destroy(m);
}

/* torch.optim.AdamW(weight_decay=0.01).step() with every .grad None changes nothing; nor does
 * ours without a gradient since the last step. */
static void step_without_gradients_leaves_weights_alone(void **state) {
    (void)state;
    rp_model *m = model_with(-1);
    ts_params *before = ts_masters(m);
    step(m); /* no call at all */
    ts_params *after = ts_masters(m);
    ts_assert_params_equal(before, after);
    train_call(m, 0);
    step(m);
    step(m); /* the gradients were consumed by the step before */
    ts_params *once = ts_masters(m);
    ts_params_free(before);
    before = ts_masters(m);
    ts_assert_params_equal(before, once);
    /* A gradient view taken outside a step counts as a gradient: written through, it is used. */
    DLManagedTensor *g = NULL;
    TS_OK(rp_param_grad(&g, m, 0));
    ((float *)g->dl_tensor.data)[0] = 1.0f;
    ts_free(g);
    step(m);
    ts_params *moved = ts_masters(m);
    assert_true(moved->data[0][0] != once->data[0][0]);
    for (size_t i = 1; i < moved->count; ++i) /* no gradient: bitwise unchanged */
        assert_memory_equal(moved->data[i], once->data[i], moved->numel[i] * sizeof(float));
    ts_params_free(before);
    ts_params_free(after);
    ts_params_free(once);
    ts_params_free(moved);
    rp_model_destroy(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(nan_loss_is_counted_and_logged_and_its_step_skipped),
        cmocka_unit_test(nonfinite_step_runs_when_skipping_is_off),
        cmocka_unit_test(skip_rule_switched_at_runtime),
        cmocka_unit_test(step_without_gradients_leaves_weights_alone),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
