/*
 * test_grad_scaler.c - dynamic loss scaling. Scaling by a power of two and unscaling is exact in
 * binary floating point, so a scaled fp32 run must give bit-for-bit the losses, gradients and
 * weights of an unscaled one; an overflowing step must be skipped (weights unchanged) and halve
 * the scale; good steps must grow it; fp16 models scale by default. rp_model_set_grad_scaler
 * and rp_model_set_skip_nonfinite_steps switch the same rules on a live model.
 */
#include "test_support.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

static const char *SPEC = "{\"layers\":[{\"type\":\"linear\",\"in\":4,\"out\":8},{\"type\":\"tanh\"},"
                          "{\"type\":\"linear\",\"in\":8,\"out\":2}]}";
enum { ROWS = 6 };

static rp_model *model_with_scaler(double scale, int32_t interval, int32_t dtype) {
    rp_model_options *o = NULL;
    TS_OK(rp_model_options_create(&o));
    TS_OK(rp_model_options_set_devices(o, ts_device_kind(), ts_devices(2)));
    TS_OK(rp_model_options_set_seed(o, 11));
    TS_OK(rp_model_options_set_model_dtype(o, dtype));
    if (scale >= 0)
        TS_OK(rp_model_options_set_grad_scaler(o, scale, interval));
    rp_model *m = NULL;
    TS_OK(rp_model_create(&m, SPEC, o));
    rp_model_options_destroy(o);
    return m;
}

typedef struct {
    DLManagedTensor *x, *y;
} batch;

static batch make_batch(uint64_t seed) {
    float x[ROWS * 4], y[ROWS * 2];
    ts_fill_uniform(x, ROWS * 4, seed, -1, 1);
    ts_fill_uniform(y, ROWS * 2, seed + 100, -1, 1);
    int64_t xs[2] = {ROWS, 4}, ys[2] = {ROWS, 2};
    batch b = {ts_f32(2, xs, x), ts_f32(2, ys, y)};
    return b;
}

static void free_batch(batch b) {
    ts_free(b.x);
    ts_free(b.y);
}

static double train_call(rp_model *m, const rp_loss *loss, batch b) {
    const DLManagedTensor *in[1] = {b.x};
    double value = 0;
    rp_run_config *c = ts_config(2, 0);
    TS_OK(rp_forward_backward(&value, NULL, m, in, 1, b.y, loss, c));
    rp_run_config_destroy(c);
    return value;
}

static void scaled_fp32_run_equals_unscaled_run_bit_for_bit(void **state) {
    (void)state;
    rp_model *plain = model_with_scaler(0, 1, RP_DTYPE_F32);
    rp_model *scaled = model_with_scaler(1024, 1000, RP_DTYPE_F32);
    rp_loss *mse = NULL;
    TS_OK(rp_loss_create(&mse, RP_LOSS_MSE));
    rp_optimizer *opt = NULL;
    TS_OK(rp_optimizer_create(&opt, RP_OPTIMIZER_ADAMW));
    for (int step = 0; step < 3; ++step) {
        batch b = make_batch(step + 1);
        double l_plain = train_call(plain, mse, b), l_scaled = train_call(scaled, mse, b);
        assert_true(l_plain == l_scaled);
        TS_OK(rp_synchronize(plain));
        TS_OK(rp_synchronize(scaled));
        ts_params *g1 = ts_grads(plain), *g2 = ts_grads(scaled);
        ts_assert_params_equal(g1, g2);
        ts_params_free(g1);
        ts_params_free(g2);
        TS_OK(rp_step(plain, opt, 0));
        TS_OK(rp_step(scaled, opt, 0));
        free_batch(b);
    }
    ts_params *w1 = ts_masters(plain), *w2 = ts_masters(scaled);
    ts_assert_params_equal(w1, w2);
    ts_params_free(w1);
    ts_params_free(w2);
    double scale = 0;
    int64_t skipped = -1;
    TS_OK(rp_model_grad_scale(&scale, &skipped, scaled));
    assert_true(scale == 1024.0 && skipped == 0);
    TS_OK(rp_model_grad_scale(&scale, &skipped, plain));
    assert_true(scale == 0.0 && skipped == 0);
    rp_optimizer_destroy(opt);
    rp_loss_destroy(mse);
    rp_model_destroy(plain);
    rp_model_destroy(scaled);
}

/* An MSE loss callback whose gradient turns infinite when *poison is set. */
static int32_t mse_or_inf(double *out_loss, DLManagedTensor **out_grad, const DLManagedTensor *out,
                          const DLManagedTensor *labels, int32_t microbatch, void *user_data) {
    (void)microbatch;
    const int *poison = user_data;
    int64_t n = ts_numel(&out->dl_tensor);
    float *o = malloc(sizeof(float) * n), *l = malloc(sizeof(float) * n), *g = malloc(sizeof(float) * n);
    ts_read_f32(&out->dl_tensor, o);
    ts_read_f32(&labels->dl_tensor, l);
    double sum = 0;
    for (int64_t i = 0; i < n; ++i) {
        sum += (double)(o[i] - l[i]) * (o[i] - l[i]);
        g[i] = *poison ? INFINITY : 2.0f * (o[i] - l[i]) / (float)n;
    }
    *out_loss = sum / n;
    *out_grad = ts_f32(out->dl_tensor.ndim, out->dl_tensor.shape, g);
    free(o);
    free(l);
    free(g);
    return 0;
}

static void overflowing_step_is_skipped_and_halves_the_scale(void **state) {
    (void)state;
    rp_model *m = model_with_scaler(256, 1000, RP_DTYPE_F32);
    int poison = 0;
    rp_loss *loss = NULL;
    TS_OK(rp_loss_create_callback(&loss, mse_or_inf, &poison));
    rp_optimizer *opt = NULL;
    TS_OK(rp_optimizer_create(&opt, RP_OPTIMIZER_SGD));
    TS_OK(rp_optimizer_set_learning_rate(opt, 0.1));
    batch b = make_batch(7);

    poison = 1;
    train_call(m, loss, b);
    TS_OK(rp_synchronize(m));
    ts_params *before = ts_masters(m);
    TS_OK(rp_step(m, opt, 0));
    TS_OK(rp_synchronize(m));
    ts_params *after = ts_masters(m);
    ts_assert_params_equal(before, after); /* skipped: nothing moved */
    double scale = 0;
    int64_t skipped = 0;
    TS_OK(rp_model_grad_scale(&scale, &skipped, m));
    assert_true(scale == 128.0 && skipped == 1);
    ts_params *grads = ts_grads(m); /* the poisoned gradients were consumed by the step */
    for (size_t i = 0; i < grads->count; ++i)
        for (int64_t k = 0; k < grads->numel[i]; ++k)
            assert_true(grads->data[i][k] == 0.0f);
    ts_params_free(grads);

    poison = 0;
    train_call(m, loss, b);
    TS_OK(rp_step(m, opt, 0));
    TS_OK(rp_synchronize(m));
    ts_params *moved = ts_masters(m);
    int changed = 0;
    for (size_t i = 0; i < moved->count; ++i)
        changed |= memcmp(moved->data[i], after->data[i], sizeof(float) * moved->numel[i]) != 0;
    assert_true(changed);
    TS_OK(rp_model_grad_scale(&scale, &skipped, m));
    assert_true(scale == 128.0 && skipped == 1);
    ts_params_free(before);
    ts_params_free(after);
    ts_params_free(moved);
    free_batch(b);
    rp_optimizer_destroy(opt);
    rp_loss_destroy(loss);
    rp_model_destroy(m);
}

static void good_steps_double_the_scale_every_growth_interval(void **state) {
    (void)state;
    rp_model *m = model_with_scaler(8, 2, RP_DTYPE_F32);
    rp_loss *mse = NULL;
    TS_OK(rp_loss_create(&mse, RP_LOSS_MSE));
    rp_optimizer *opt = NULL;
    TS_OK(rp_optimizer_create(&opt, RP_OPTIMIZER_SGD));
    const double expected[5] = {8, 16, 16, 32, 32};
    for (int step = 0; step < 5; ++step) {
        batch b = make_batch(20 + step);
        train_call(m, mse, b);
        TS_OK(rp_step(m, opt, 0));
        double scale = 0;
        int64_t skipped = 0;
        TS_OK(rp_model_grad_scale(&scale, &skipped, m));
        assert_true(scale == expected[step] && skipped == 0);
        free_batch(b);
    }
    rp_optimizer_destroy(opt);
    rp_loss_destroy(mse);
    rp_model_destroy(m);
}

static void fp16_models_scale_by_default_and_train(void **state) {
    (void)state;
    rp_model *m = model_with_scaler(-1, 0, RP_DTYPE_F16);
    double scale = 0;
    int64_t skipped = 0;
    TS_OK(rp_model_grad_scale(&scale, &skipped, m));
    assert_true(scale == 65536.0);
    rp_loss *mse = NULL;
    TS_OK(rp_loss_create(&mse, RP_LOSS_MSE));
    rp_optimizer *opt = NULL;
    TS_OK(rp_optimizer_create(&opt, RP_OPTIMIZER_ADAMW));
    TS_OK(rp_optimizer_set_learning_rate(opt, 1e-2));
    batch b = make_batch(3);
    double first = train_call(m, mse, b), last = first;
    for (int step = 0; step < 20; ++step) {
        TS_OK(rp_step(m, opt, 1));
        last = train_call(m, mse, b);
    }
    TS_OK(rp_synchronize(m));
    assert_true(isfinite(last) && last < first);
    TS_ERR(rp_model_grad_scale(NULL, &skipped, m), RP_ERR_INVALID_ARGUMENT, "null");
    TS_ERR(rp_model_grad_scale(&scale, &skipped, NULL), RP_ERR_INVALID_ARGUMENT, "model");
    free_batch(b);
    rp_optimizer_destroy(opt);
    rp_loss_destroy(mse);
    rp_model_destroy(m);
}

static void scaler_options_reject_bad_values(void **state) {
    (void)state;
    rp_model_options *o = NULL;
    TS_OK(rp_model_options_create(&o));
    TS_ERR(rp_model_options_set_grad_scaler(NULL, 1, 1), RP_ERR_INVALID_ARGUMENT, "options");
    TS_ERR(rp_model_options_set_grad_scaler(o, -2, 1), RP_ERR_INVALID_ARGUMENT, "scale");
    TS_ERR(rp_model_options_set_grad_scaler(o, NAN, 1), RP_ERR_INVALID_ARGUMENT, "scale");
    TS_ERR(rp_model_options_set_grad_scaler(o, 2, 0), RP_ERR_INVALID_ARGUMENT, "growth_interval");
    rp_model_options_destroy(o);
}

/* Switched on at runtime, scaling behaves as when created on: a model created without a scaler
 * and switched to 1024 trains bit-for-bit like a plain one (power-of-two scaling is exact), an
 * overflow is then skipped and halves the scale; switched off, the scale reads 0, the skip count
 * is kept, and the non-finite rule (default on) skips the next overflow instead. */
static void scaler_switched_at_runtime_acts_as_if_created_so(void **state) {
    (void)state;
    rp_model *plain = model_with_scaler(0, 1, RP_DTYPE_F32);
    rp_model *m = model_with_scaler(0, 1, RP_DTYPE_F32);
    TS_OK(rp_model_set_grad_scaler(m, 1024, 1000));
    rp_loss *mse = NULL;
    TS_OK(rp_loss_create(&mse, RP_LOSS_MSE));
    rp_optimizer *opt = NULL;
    TS_OK(rp_optimizer_create(&opt, RP_OPTIMIZER_ADAMW));
    for (int step = 0; step < 2; ++step) {
        batch b = make_batch(step + 30);
        assert_true(train_call(plain, mse, b) == train_call(m, mse, b));
        TS_OK(rp_step(plain, opt, 0));
        TS_OK(rp_step(m, opt, 0));
        free_batch(b);
    }
    ts_params *w1 = ts_masters(plain), *w2 = ts_masters(m);
    ts_assert_params_equal(w1, w2);
    double scale = 0;
    int64_t skipped = -1;
    TS_OK(rp_model_grad_scale(&scale, &skipped, m));
    assert_true(scale == 1024.0 && skipped == 0);

    int poison = 1;
    rp_loss *inf_loss = NULL;
    TS_OK(rp_loss_create_callback(&inf_loss, mse_or_inf, &poison));
    batch b = make_batch(40);
    train_call(m, inf_loss, b);
    TS_OK(rp_step(m, opt, 0));
    TS_OK(rp_model_grad_scale(&scale, &skipped, m));
    assert_true(scale == 512.0 && skipped == 1);

    TS_OK(rp_model_set_grad_scaler(m, 0, 1));
    TS_OK(rp_model_grad_scale(&scale, &skipped, m));
    assert_true(scale == 0.0 && skipped == 1);
    train_call(m, inf_loss, b);
    TS_OK(rp_step(m, opt, 0));
    int64_t losses = 0, nonfinite_skips = 0;
    TS_OK(rp_model_nonfinite_counts(&losses, &nonfinite_skips, m));
    assert_int_equal(nonfinite_skips, 2); /* the scaler's one and the rule's one */
    ts_params *w3 = ts_masters(m);
    ts_assert_params_equal(w2, w3); /* both overflowing steps were skipped */
    ts_params_free(w1);
    ts_params_free(w2);
    ts_params_free(w3);
    free_batch(b);
    rp_loss_destroy(inf_loss);
    rp_optimizer_destroy(opt);
    rp_loss_destroy(mse);
    rp_model_destroy(plain);
    rp_model_destroy(m);
}

typedef struct {
    rp_model *model;
    rp_status from_callback, from_other_thread;
} busy_probe;

static void *switch_from_other_thread(void *arg) {
    busy_probe *p = arg;
    p->from_other_thread = rp_model_set_skip_nonfinite_steps(p->model, 0);
    return NULL;
}

/* Inside a synchronous step callback the driving thread is in rp_step_callback: the model is
 * busy for every other thread, and the callback itself may not switch either. */
static int32_t probe_step(rp_model *model, void *user_data) {
    busy_probe *p = user_data;
    p->from_callback = rp_model_set_grad_scaler(model, 8, 1);
    pthread_t t;
    pthread_create(&t, NULL, switch_from_other_thread, p);
    pthread_join(t, NULL);
    return 0;
}

static void runtime_switches_refuse_bad_values_and_calls_in_flight(void **state) {
    (void)state;
    rp_model *m = model_with_scaler(64, 3, RP_DTYPE_F32);
    TS_ERR(rp_model_set_grad_scaler(NULL, 1, 1), RP_ERR_INVALID_ARGUMENT, "model");
    TS_ERR(rp_model_set_grad_scaler(m, -2, 1), RP_ERR_INVALID_ARGUMENT, "scale");
    TS_ERR(rp_model_set_grad_scaler(m, INFINITY, 1), RP_ERR_INVALID_ARGUMENT, "scale");
    TS_ERR(rp_model_set_grad_scaler(m, 2, 0), RP_ERR_INVALID_ARGUMENT, "growth_interval");
    TS_ERR(rp_model_set_skip_nonfinite_steps(NULL, 1), RP_ERR_INVALID_ARGUMENT, "model");
    TS_ERR(rp_model_set_skip_nonfinite_steps(m, 2), RP_ERR_INVALID_ARGUMENT, "0 or 1");
    rp_loss *mse = NULL;
    TS_OK(rp_loss_create(&mse, RP_LOSS_MSE));
    batch b = make_batch(50);
    train_call(m, mse, b);
    busy_probe p = {m, RP_OK, RP_OK};
    TS_OK(rp_step_callback(m, probe_step, &p, 0));
    assert_int_equal(p.from_callback, RP_ERR_INVALID_ARGUMENT);
    assert_int_equal(p.from_other_thread, RP_ERR_STATE);
    double scale = 0;
    int64_t skipped = -1;
    TS_OK(rp_model_grad_scale(&scale, &skipped, m));
    assert_true(scale == 64.0 && skipped == 0); /* nothing refused took effect */
    free_batch(b);
    rp_loss_destroy(mse);
    rp_model_destroy(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(scaled_fp32_run_equals_unscaled_run_bit_for_bit),
        cmocka_unit_test(overflowing_step_is_skipped_and_halves_the_scale),
        cmocka_unit_test(good_steps_double_the_scale_every_growth_interval),
        cmocka_unit_test(fp16_models_scale_by_default_and_train),
        cmocka_unit_test(scaler_options_reject_bad_values),
        cmocka_unit_test(scaler_switched_at_runtime_acts_as_if_created_so),
        cmocka_unit_test(runtime_switches_refuse_bad_values_and_calls_in_flight),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
