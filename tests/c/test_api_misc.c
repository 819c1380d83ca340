/*
 * test_api_misc.c - versions, status strings, the thread-local error, logging, parameter
 * naming and shapes, initialisation, counts and defaults, as documented in roundpipe.h and
 * docs/semantics.md.
 */
#define _GNU_SOURCE
#include "test_support.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef RP_EXPECTED_VERSION
#define RP_EXPECTED_VERSION "0.1.0"
#endif

static const char *SPEC = "{\"layers\": ["
                          "{\"type\": \"linear\", \"in\": 8, \"out\": 16},"
                          "{\"type\": \"relu\"},"
                          "{\"type\": \"linear\", \"in\": 16, \"out\": 4}]}";

static void version_strings_and_abi_version_match_the_build(void **state) {
    (void)state;
    const char *v = rp_version();
    assert_non_null(v);
    assert_string_equal(v, RP_EXPECTED_VERSION);
    int a, b, c;
    assert_int_equal(sscanf(v, "%d.%d.%d", &a, &b, &c), 3);
    assert_int_equal(rp_abi_version(), RP_ABI_VERSION);
    assert_ptr_equal(rp_version(), v); /* static storage */
}

static void status_strings_are_distinct_and_never_null(void **state) {
    (void)state;
    static const rp_status all[] = {
        RP_OK,       RP_ERR_INVALID_ARGUMENT, RP_ERR_OUT_OF_MEMORY, RP_ERR_IO,
        RP_ERR_CUDA, RP_ERR_CALLBACK,         RP_ERR_STATE,         RP_ERR_INTERNAL};
    const size_t n = sizeof all / sizeof all[0];
    for (size_t i = 0; i < n; ++i) {
        const char *s = rp_status_string(all[i]);
        assert_non_null(s);
        assert_true(strlen(s) > 0);
        for (size_t j = 0; j < i; ++j)
            assert_string_not_equal(s, rp_status_string(all[j]));
    }
    assert_true(ts_contains(rp_status_string(RP_ERR_INVALID_ARGUMENT), "invalid argument"));
    assert_true(ts_contains(rp_status_string(RP_ERR_IO), "i/o|io|input"));
    assert_true(ts_contains(rp_status_string(RP_ERR_CALLBACK), "callback"));
    assert_non_null(rp_status_string((rp_status)-1000));
    assert_non_null(rp_status_string((rp_status)77));
}

typedef struct thread_result {
    char initial[256];
    char own[256];
} thread_result;

static void *other_thread(void *arg) {
    thread_result *r = arg;
    snprintf(r->initial, sizeof r->initial, "%s", rp_last_error_message());
    rp_optimizer *o = NULL;
    rp_optimizer_create(&o, 42);
    snprintf(r->own, sizeof r->own, "%s", rp_last_error_message());
    return NULL;
}

static void last_error_message_is_per_thread(void **state) {
    (void)state;
    rp_loss *l = NULL;
    TS_ERR(rp_loss_create(&l, 99), RP_ERR_INVALID_ARGUMENT, "kind|loss");
    char mine[256];
    snprintf(mine, sizeof mine, "%s", rp_last_error_message());
    pthread_t t;
    thread_result r;
    memset(&r, 0, sizeof r);
    assert_int_equal(pthread_create(&t, NULL, other_thread, &r), 0);
    assert_int_equal(pthread_join(t, NULL), 0);
    assert_string_equal(r.initial, ""); /* a fresh thread has no error */
    assert_true(strlen(r.own) > 0);
    assert_true(ts_contains(r.own, "kind|optimizer"));
    assert_string_equal(rp_last_error_message(), mine); /* untouched by the other thread */
}

typedef struct log_sink {
    pthread_mutex_t lock;
    int count;
    int below_min;
    int bad_level;
    int min_level;
    int empty;
} log_sink;

static void sink_fn(int32_t level, const char *message, void *user_data) {
    log_sink *s = user_data;
    pthread_mutex_lock(&s->lock);
    ++s->count;
    if (level < s->min_level)
        ++s->below_min;
    if (level < RP_LOG_DEBUG || level > RP_LOG_ERROR)
        ++s->bad_level;
    if (!message || !message[0])
        ++s->empty;
    pthread_mutex_unlock(&s->lock);
}

static void train_a_little(const char *name) {
    rp_model_options *o = NULL;
    TS_OK(rp_model_options_create(&o));
    TS_OK(rp_model_options_set_devices(o, RP_DEVICE_CPU, 2));
    TS_OK(rp_model_options_set_name(o, name));
    rp_model *model = NULL;
    TS_OK(rp_model_create(&model, SPEC, o));
    rp_model_options_destroy(o);
    float x[40], y[20];
    ts_fill_uniform(x, 40, 1, -1, 1);
    ts_fill_uniform(y, 20, 2, -1, 1);
    int64_t xs[2] = {5, 8}, ys[2] = {5, 4};
    DLManagedTensor *in = ts_f32(2, xs, x), *lab = ts_f32(2, ys, y);
    const DLManagedTensor *inputs[1] = {in};
    rp_loss *mse = NULL;
    TS_OK(rp_loss_create(&mse, RP_LOSS_MSE));
    rp_optimizer *opt = NULL;
    TS_OK(rp_optimizer_create(&opt, RP_OPTIMIZER_ADAMW));
    for (int i = 0; i < 2; ++i) {
        TS_OK(rp_forward_backward(NULL, NULL, model, inputs, 1, lab, mse, NULL));
        TS_OK(rp_step(model, opt, 1));
    }
    TS_OK(rp_synchronize(model));
    rp_model *bad = NULL;
    rp_model_create(&bad, "{\"layers\": [{\"type\": \"nope\"}]}", NULL);
    rp_optimizer_destroy(opt);
    rp_loss_destroy(mse);
    ts_free(in);
    ts_free(lab);
    rp_model_destroy(model);
}

static void log_callback_receives_messages_at_or_above_its_level(void **state) {
    (void)state;
    log_sink s = {.lock = PTHREAD_MUTEX_INITIALIZER, .min_level = RP_LOG_DEBUG};
    TS_OK(rp_set_log_callback(sink_fn, RP_LOG_DEBUG, &s));
    train_a_little("log-debug");
    assert_true(s.count > 0);
    assert_int_equal(s.bad_level, 0);
    assert_int_equal(s.empty, 0);

    log_sink w = {.lock = PTHREAD_MUTEX_INITIALIZER, .min_level = RP_LOG_WARN};
    TS_OK(rp_set_log_callback(sink_fn, RP_LOG_WARN, &w));
    train_a_little("log-warn");
    assert_int_equal(w.below_min, 0);
    assert_int_equal(w.bad_level, 0);

    /* NULL restores the default sink: ours hears nothing more. */
    TS_OK(rp_set_log_callback(NULL, RP_LOG_WARN, NULL));
    int before = s.count + w.count;
    train_a_little("log-default");
    assert_int_equal(s.count + w.count, before);
}

typedef struct expected_param {
    const char *name;
    int32_t ndim;
    int64_t shape[2];
} expected_param;

/* Names "<layer>.<name>", layer order then the order of the semantics table. */
static void parameter_names_order_and_shapes_follow_the_semantics(void **state) {
    (void)state;
    const char *spec =
        "{\"layers\": ["
        "{\"type\": \"embedding\", \"num\": 5, \"dim\": 4},"
        "{\"type\": \"layer_norm\", \"dim\": 4},"
        "{\"type\": \"residual_mlp\", \"dim\": 4, \"hidden\": 6},"
        "{\"type\": \"residual_mlp\", \"dim\": 4, \"hidden\": 3, \"norm\": \"rms_norm\"},"
        "{\"type\": \"residual_mlp\", \"dim\": 4, \"hidden\": 2, \"norm\": \"none\"},"
        "{\"type\": \"gelu\"},"
        "{\"type\": \"rms_norm\", \"dim\": 4},"
        "{\"type\": \"flatten\"},"
        "{\"type\": \"linear\", \"in\": 12, \"out\": 3, \"bias\": false},"
        "{\"type\": \"dropout\", \"p\": 0.1},"
        "{\"type\": \"linear\", \"in\": 3, \"out\": 2}]}";
    static const expected_param want[] = {
        {"0.weight", 2, {5, 4}},     {"1.weight", 1, {4}},        {"1.bias", 1, {4}},
        {"2.norm.weight", 1, {4}},   {"2.norm.bias", 1, {4}},     {"2.fc1.weight", 2, {6, 4}},
        {"2.fc1.bias", 1, {6}},      {"2.fc2.weight", 2, {4, 6}}, {"2.fc2.bias", 1, {4}},
        {"3.norm.weight", 1, {4}},   {"3.fc1.weight", 2, {3, 4}}, {"3.fc1.bias", 1, {3}},
        {"3.fc2.weight", 2, {4, 3}}, {"3.fc2.bias", 1, {4}},      {"4.fc1.weight", 2, {2, 4}},
        {"4.fc1.bias", 1, {2}},      {"4.fc2.weight", 2, {4, 2}}, {"4.fc2.bias", 1, {4}},
        {"6.weight", 1, {4}},        {"8.weight", 2, {3, 12}},    {"10.weight", 2, {2, 3}},
        {"10.bias", 1, {2}},
    };
    const size_t n = sizeof want / sizeof want[0];
    rp_model *model = ts_model(spec, 1, 1, NULL, 0);
    int32_t layers = 0;
    TS_OK(rp_model_num_layers(&layers, model));
    assert_int_equal(layers, 11);
    size_t count = 0;
    TS_OK(rp_param_count(&count, model));
    assert_int_equal(count, n);
    for (size_t i = 0; i < n; ++i) {
        const char *name = NULL;
        TS_OK(rp_param_name(&name, model, i));
        assert_string_equal(name, want[i].name);
        size_t index = 99;
        TS_OK(rp_param_find(&index, model, want[i].name));
        assert_int_equal(index, i);
        int64_t shape[4] = {0};
        int32_t ndim = 0;
        TS_OK(rp_param_shape(shape, &ndim, 4, model, i));
        assert_int_equal(ndim, want[i].ndim);
        for (int32_t d = 0; d < ndim; ++d)
            assert_int_equal(shape[d], want[i].shape[d]);
        DLManagedTensor *t = NULL;
        TS_OK(rp_param_master(&t, model, i));
        assert_int_equal(t->dl_tensor.ndim, ndim);
        for (int32_t d = 0; d < ndim; ++d)
            assert_int_equal(t->dl_tensor.shape[d], shape[d]);
        assert_int_equal(t->dl_tensor.dtype.code, kDLFloat);
        assert_int_equal(t->dl_tensor.dtype.bits, 32);
        assert_int_equal(t->dl_tensor.device.device_type, kDLCPU);
        ts_free(t);
        TS_OK(rp_param_grad(&t, model, i));
        assert_int_equal(t->dl_tensor.ndim, ndim);
        assert_int_equal(t->dl_tensor.dtype.bits, 32);
        ts_free(t);
    }
    rp_model_destroy(model);
}

/* Documented initialisation: linear uniform(+-1/sqrt(in)), norms ones/zeros, embedding
 * normal(0, 1); it depends on the seed only (not on devices or plan). */
static void initialisation_follows_the_semantics_and_depends_on_the_seed_only(void **state) {
    (void)state;
    const char *spec = "{\"layers\": ["
                       "{\"type\": \"embedding\", \"num\": 50, \"dim\": 40},"
                       "{\"type\": \"layer_norm\", \"dim\": 40},"
                       "{\"type\": \"linear\", \"in\": 40, \"out\": 30},"
                       "{\"type\": \"rms_norm\", \"dim\": 30},"
                       "{\"type\": \"residual_mlp\", \"dim\": 30, \"hidden\": 25}]}";
    rp_model *a = ts_model(spec, 7, 1, NULL, 0);
    ts_params *w = ts_masters(a);
    for (size_t i = 0; i < w->count; ++i) {
        const char *nm = w->names[i];
        const float *d = w->data[i];
        int64_t n = w->numel[i];
        if (!strcmp(nm, "0.weight")) {
            double mean = 0, sq = 0;
            for (int64_t j = 0; j < n; ++j)
                mean += d[j];
            mean /= n;
            for (int64_t j = 0; j < n; ++j)
                sq += (d[j] - mean) * (d[j] - mean);
            double sd = sqrt(sq / (n - 1));
            /* 2000 draws: the standard error of the mean is 0.022, of the sd 0.016. */
            assert_true(fabs(mean) < 0.1);
            assert_true(fabs(sd - 1.0) < 0.08);
        } else if (!strcmp(nm, "1.weight") || !strcmp(nm, "3.weight") ||
                   !strcmp(nm, "4.norm.weight")) {
            for (int64_t j = 0; j < n; ++j)
                assert_true(d[j] == 1.0f);
        } else if (!strcmp(nm, "1.bias") || !strcmp(nm, "4.norm.bias")) {
            for (int64_t j = 0; j < n; ++j)
                assert_true(d[j] == 0.0f);
        } else {
            double fan_in = !strncmp(nm, "2.", 2) ? 40 : !strncmp(nm, "4.fc1", 5) ? 30 : 25;
            double bound = 1.0 / sqrt(fan_in), maxabs = 0, mean = 0;
            for (int64_t j = 0; j < n; ++j) {
                if (!(fabs(d[j]) <= bound)) {
                    print_error("%s[%lld] = %g outside +-%g\n", nm, (long long)j, d[j], bound);
                    fail();
                }
                maxabs = fmax(maxabs, fabs(d[j]));
                mean += d[j];
            }
            mean /= n;
            /* uniform: the largest of n >= 25 draws is near the bound, the mean near 0 */
            assert_true(maxabs > 0.75 * bound);
            assert_true(fabs(mean) < 0.5 * bound);
        }
    }
    static const int32_t plan[] = {2, 1, 2};
    rp_model *b = ts_model(spec, 7, 3, plan, 3);
    rp_model *c = ts_model(spec, 8, 1, NULL, 0);
    ts_params *wb = ts_masters(b), *wc = ts_masters(c);
    ts_assert_params_equal(wb, w);
    /* Another seed: the random tensors differ. */
    for (size_t i = 0; i < w->count; ++i) {
        if (!strcmp(w->names[i], "0.weight") || !strcmp(w->names[i], "2.weight"))
            assert_memory_not_equal(wc->data[i], w->data[i], sizeof(float) * w->numel[i]);
    }
    ts_params_free(w);
    ts_params_free(wb);
    ts_params_free(wc);
    rp_model_destroy(a);
    rp_model_destroy(b);
    rp_model_destroy(c);
}

static size_t output_count(rp_model *model, const rp_run_config *cfg, int64_t rows) {
    float x[12 * 8];
    ts_fill_uniform(x, 12 * 8, 3, -1, 1);
    int64_t xs[2] = {rows, 8};
    DLManagedTensor *in = ts_f32(2, xs, x);
    const DLManagedTensor *inputs[1] = {in};
    rp_tensor_list *outs = NULL;
    TS_OK(rp_forward(&outs, model, inputs, 1, cfg));
    size_t n = 0;
    TS_OK(rp_tensor_list_size(&n, outs));
    for (size_t i = 0; i < n; ++i) {
        DLManagedTensor *o = NULL;
        TS_OK(rp_tensor_list_get(&o, outs, i));
        assert_int_equal(o->dl_tensor.device.device_type, kDLCPU); /* default output device */
        assert_int_equal(o->dl_tensor.dtype.code, kDLFloat);
        assert_int_equal(o->dl_tensor.dtype.bits, 32);
        ts_free(o);
    }
    rp_tensor_list_destroy(outs);
    ts_free(in);
    return n;
}

static void default_num_microbatch_is_devices_plus_one(void **state) {
    (void)state;
    rp_run_config *unmerged = NULL;
    TS_OK(rp_run_config_create(&unmerged));
    TS_OK(rp_run_config_set_merge_output(unmerged, 0));
    for (int32_t d = 1; d <= 3; ++d) {
        rp_model *m = ts_model(SPEC, 1, d, NULL, 0);
        int32_t n = 0;
        TS_OK(rp_model_num_devices(&n, m));
        assert_int_equal(n, d);
        assert_int_equal(output_count(m, unmerged, 12), (size_t)d + 1);
        assert_int_equal(output_count(m, NULL, 12), 1); /* merged by default */
        int64_t steps = -1;
        TS_OK(rp_model_step_count(&steps, m));
        assert_int_equal(steps, 0);
        rp_model_destroy(m);
    }
    /* 0 CPU devices means one. */
    rp_model *m = ts_model(SPEC, 1, 0, NULL, 0);
    int32_t n = 0;
    TS_OK(rp_model_num_devices(&n, m));
    assert_int_equal(n, 1);
    rp_model_destroy(m);
    rp_run_config_destroy(unmerged);
}

/* A per-call configuration overrides the model-level one field by field. */
static void per_call_config_overrides_model_config_field_by_field(void **state) {
    (void)state;
    rp_run_config *model_cfg = ts_config(3, 0);
    TS_OK(rp_run_config_set_merge_output(model_cfg, 0));
    rp_model_options *o = NULL;
    TS_OK(rp_model_options_create(&o));
    TS_OK(rp_model_options_set_devices(o, RP_DEVICE_CPU, 1));
    TS_OK(rp_model_options_set_run_config(o, model_cfg));
    rp_run_config_destroy(model_cfg); /* the options keep a copy */
    rp_model *m = NULL;
    TS_OK(rp_model_create(&m, SPEC, o));
    rp_model_options_destroy(o); /* the model keeps its own copy */
    assert_int_equal(output_count(m, NULL, 12), 3);
    rp_run_config *grain_only = ts_config(0, RP_GRAIN_LAYER);
    assert_int_equal(output_count(m, grain_only, 12), 3);
    rp_run_config *two = ts_config(2, 0);
    assert_int_equal(output_count(m, two, 12), 2);
    rp_run_config *merged = NULL;
    TS_OK(rp_run_config_create(&merged));
    TS_OK(rp_run_config_set_merge_output(merged, 1));
    assert_int_equal(output_count(m, merged, 12), 1);
    TS_OK(rp_run_config_set_merge_output(merged, -1)); /* unset again: the model's 0 */
    assert_int_equal(output_count(m, merged, 12), 3);
    TS_OK(rp_run_config_set_num_microbatch(two, 0)); /* unset: the model's 3 */
    assert_int_equal(output_count(m, two, 12), 3);
    rp_run_config_destroy(grain_only);
    rp_run_config_destroy(two);
    rp_run_config_destroy(merged);
    rp_model_destroy(m);
}

static void stage_counts_follow_explicit_and_automatic_plans(void **state) {
    (void)state;
    static const int32_t plan[] = {2, 1};
    rp_model *m = ts_model(SPEC, 1, 2, plan, 2);
    int32_t n = 0;
    TS_OK(rp_model_num_stages(&n, m));
    assert_int_equal(n, 2);
    TS_OK(rp_model_num_layers(&n, m));
    assert_int_equal(n, 3);
    rp_model_destroy(m);
    m = ts_model(SPEC, 1, 2, NULL, 0);
    TS_OK(rp_model_num_stages(&n, m));
    assert_true(n >= 1 && n <= 3);
    rp_model_destroy(m);
    int32_t gpus = -1;
    TS_OK(rp_cuda_device_count(&gpus));
    assert_true(gpus >= 0);
}

/* Views are zero-copy and keep their memory alive: two views share memory, a write through one
 * is in use after rp_synchronize, and a view outlives the model. */
static void param_views_share_memory_and_outlive_the_model(void **state) {
    (void)state;
    rp_model *m = ts_model(SPEC, 1, 1, NULL, 0);
    DLManagedTensor *v1 = NULL, *v2 = NULL;
    TS_OK(rp_param_master(&v1, m, 3));
    TS_OK(rp_param_master(&v2, m, 3));
    float *p1 = (float *)((char *)v1->dl_tensor.data + v1->dl_tensor.byte_offset);
    float *p2 = (float *)((char *)v2->dl_tensor.data + v2->dl_tensor.byte_offset);
    assert_ptr_equal(p1, p2);
    static const float bias[4] = {1.5f, -2.0f, 0.25f, 8.0f};
    memcpy(p1, bias, sizeof bias);
    TS_OK(rp_synchronize(m));
    /* With an all-zero input the model computes relu(b0) W2^T + b2, and b2 is what we wrote. */
    ts_params *w = ts_masters(m);
    float x[2 * 8] = {0};
    int64_t xs[2] = {2, 8};
    DLManagedTensor *in = ts_f32(2, xs, x);
    const DLManagedTensor *inputs[1] = {in};
    rp_tensor_list *outs = NULL;
    TS_OK(rp_forward(&outs, m, inputs, 1, NULL));
    DLManagedTensor *o = NULL;
    TS_OK(rp_tensor_list_get(&o, outs, 0));
    float got[8];
    ts_read_f32(&o->dl_tensor, got);
    for (int r = 0; r < 2; ++r)
        for (int k = 0; k < 4; ++k) {
            double want = bias[k];
            for (int j = 0; j < 16; ++j)
                want += fmax(0.0, w->data[1][j]) * w->data[2][k * 16 + j];
            assert_true(fabs(got[r * 4 + k] - want) <= 1e-5 * (1 + fabs(want)));
        }
    ts_free(o);
    rp_tensor_list_destroy(outs);
    ts_free(in);
    ts_params_free(w);
    rp_model_destroy(m);
    /* The views are still ours. */
    assert_memory_equal(p1, bias, sizeof bias);
    ts_free(v1);
    ts_free(v2);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(version_strings_and_abi_version_match_the_build),
        cmocka_unit_test(status_strings_are_distinct_and_never_null),
        cmocka_unit_test(last_error_message_is_per_thread),
        cmocka_unit_test(log_callback_receives_messages_at_or_above_its_level),
        cmocka_unit_test(parameter_names_order_and_shapes_follow_the_semantics),
        cmocka_unit_test(initialisation_follows_the_semantics_and_depends_on_the_seed_only),
        cmocka_unit_test(default_num_microbatch_is_devices_plus_one),
        cmocka_unit_test(per_call_config_overrides_model_config_field_by_field),
        cmocka_unit_test(stage_counts_follow_explicit_and_automatic_plans),
        cmocka_unit_test(param_views_share_memory_and_outlive_the_model),
    };
    return cmocka_run_group_tests_name("api_misc", tests, NULL, NULL);
}
