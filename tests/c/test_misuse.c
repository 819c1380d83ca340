/*
 * test_misuse.c - misuse and oversized input are refused with a status and a message, never a
 * crash, a silent wrong answer or RP_ERR_INTERNAL (roundpipe.h conventions): two threads on one
 * model, destroy during a call, element counts that overflow int64, JSON numbers out of range,
 * models larger than the host (or than RP_HOST_MEMORY_LIMIT_MB), high-rank inputs, unknown
 * status codes.
 */
#include "test_support.h"

#include <pthread.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

static const char *SPEC = "{\"layers\": ["
                          "{\"type\": \"linear\", \"in\": 8, \"out\": 64},"
                          "{\"type\": \"gelu\"},"
                          "{\"type\": \"linear\", \"in\": 64, \"out\": 8}]}";

typedef struct race {
    rp_model *model;
    pthread_barrier_t *start;
    rp_status status;
    char message[256];
} race;

static void *run_once(void *arg) {
    race *r = arg;
    float x[32 * 8];
    ts_fill_uniform(x, 32 * 8, 5, -1, 1);
    int64_t xs[2] = {32, 8};
    DLManagedTensor *in = ts_f32(2, xs, x);
    const DLManagedTensor *inputs[1] = {in};
    rp_tensor_list *out = NULL;
    pthread_barrier_wait(r->start);
    r->status = rp_forward(&out, r->model, inputs, 1, NULL);
    snprintf(r->message, sizeof r->message, "%s", rp_last_error_message());
    rp_tensor_list_destroy(out);
    ts_free(in);
    return NULL;
}

/* Each trial starts two calls at once: each is either RP_OK or the busy RP_ERR_STATE, never
 * anything else, and over the trials the busy path is taken. The model stays usable. */
static void two_threads_on_one_model_get_busy_not_corruption(void **state) {
    (void)state;
    rp_model *m = ts_model("{\"layers\": [{\"type\": \"linear\", \"in\": 8, \"out\": 1}]}", 1, 1,
                           NULL, 0);
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, 2);
    int busy = 0, ok = 0;
    for (int trial = 0; trial < 1000; ++trial) {
        race a = {m, &start, RP_OK, ""}, b = {m, &start, RP_OK, ""};
        pthread_t ta, tb;
        pthread_create(&ta, NULL, run_once, &a);
        pthread_create(&tb, NULL, run_once, &b);
        pthread_join(ta, NULL);
        pthread_join(tb, NULL);
        for (race *r = &a; r; r = r == &a ? &b : NULL) {
            if (r->status == RP_OK) {
                ++ok;
                continue;
            }
            assert_int_equal(r->status, RP_ERR_STATE);
            assert_true(ts_contains(r->message, "busy"));
            ++busy;
        }
    }
    pthread_barrier_destroy(&start);
    assert_true(ok >= 1000); /* at least one call of every trial ran */
    assert_true(busy >= 1);
    TS_OK(rp_zero_grad(m));
    rp_model_destroy(m);
}

typedef struct destroy_arg {
    rp_model *model;
    int called;
} destroy_arg;

/* A step callback that tries to destroy its own model: refused (logged), the model lives on. */
static int32_t destroy_me(rp_model *model, void *user_data) {
    destroy_arg *d = user_data;
    rp_model_destroy(model);
    d->called = 1;
    return 0;
}

static void destroy_from_a_step_callback_is_refused(void **state) {
    (void)state;
    rp_model *m = ts_model(SPEC, 1, 1, NULL, 0);
    destroy_arg d = {m, 0};
    TS_OK(rp_step_callback(m, destroy_me, &d, 0));
    assert_int_equal(d.called, 1);
    int32_t layers = 0;
    TS_OK(rp_model_num_layers(&layers, m)); /* still alive */
    assert_int_equal(layers, 3);
    rp_model_destroy(m);
}

static void dlpack_element_counts_that_overflow_are_refused(void **state) {
    (void)state;
    rp_model *m = ts_model(SPEC, 1, 1, NULL, 0);
    /* 2^32 x 2^32 elements wraps to 0 in int64: with data NULL that used to pass. */
    int64_t shape[2] = {INT64_C(1) << 32, INT64_C(1) << 32};
    DLManagedTensor t = {.dl_tensor = {.data = NULL, .device = {kDLCPU, 0}, .ndim = 2,
                                       .dtype = {kDLFloat, 32, 1}, .shape = shape}};
    const DLManagedTensor *inputs[1] = {&t};
    rp_tensor_list *out = NULL;
    TS_ERR(rp_forward(&out, m, inputs, 1, NULL), RP_ERR_INVALID_ARGUMENT, "int64");
    /* elements fit, bytes do not */
    int64_t big[1] = {INT64_C(1) << 62};
    t.dl_tensor.ndim = 1;
    t.dl_tensor.shape = big;
    TS_ERR(rp_forward(&out, m, inputs, 1, NULL), RP_ERR_INVALID_ARGUMENT, "int64");
    rp_model_destroy(m);
}

static void out_of_range_json_and_sizes_are_caller_errors(void **state) {
    (void)state;
    rp_model *m = NULL;
    TS_ERR(rp_model_create(&m, "{\"layers\": [{\"type\": \"linear\", \"in\": 1e400, \"out\": 2}]}",
                           NULL),
           RP_ERR_INVALID_ARGUMENT, "1e400");
    TS_ERR(rp_model_create(&m, "{\"layers\": [{\"type\": \"linear\", \"in\": 4000000000, "
                               "\"out\": 4000000000}]}",
                           NULL),
           RP_ERR_INVALID_ARGUMENT, "int64");
    TS_ERR(rp_model_create_from_hf_config(
               &m,
               "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 40, "
               "\"hidden_size\": 16, \"intermediate_size\": 24, \"num_attention_heads\": 4, "
               "\"num_hidden_layers\": 2, \"rms_norm_eps\": 1e400}",
               NULL),
           RP_ERR_INVALID_ARGUMENT, "1e400");
    /* A head dimension of 2^31 would build a 4 GiB rotary table per layer before any check. */
    TS_ERR(rp_model_create_from_hf_config(
               &m,
               "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 40, "
               "\"hidden_size\": 16, \"intermediate_size\": 24, \"num_attention_heads\": 4, "
               "\"num_hidden_layers\": 2, \"head_dim\": 2147483648}",
               NULL),
           RP_ERR_INVALID_ARGUMENT, "2147483648");
    assert_null(m);
}

/* 10^8 decoder layers in a 200-byte config, and a spec of 64 G parameters: refused with
 * RP_ERR_OUT_OF_MEMORY and the figures, before anything is allocated (no OOM-kill). */
static void models_larger_than_the_host_are_refused_before_allocating(void **state) {
    (void)state;
    rp_model *m = NULL;
    TS_ERR(rp_model_create_from_hf_config(
               &m,
               "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 40, "
               "\"hidden_size\": 16, \"intermediate_size\": 24, \"num_attention_heads\": 4, "
               "\"num_hidden_layers\": 100000000}",
               NULL),
           RP_ERR_OUT_OF_MEMORY, "of host memory for its parameter state");
    TS_ERR(rp_model_create(&m, "{\"layers\": [{\"type\": \"linear\", \"in\": 262144, "
                               "\"out\": 262144}]}",
                           NULL),
           RP_ERR_OUT_OF_MEMORY, "GiB");
    assert_null(m);
}

/* RP_HOST_MEMORY_LIMIT_MB lowers the headroom the check assumes: a 1024 x 1024 linear layer in
 * fp32 needs (1024 * 1024 + 1024) parameters x 28 bytes = 28.0 MiB of host state, refused under a
 * 16 MiB limit (the message names the variable), built under 64 MiB and without it. */
static void the_host_memory_limit_variable_lowers_the_headroom(void **state) {
    (void)state;
    const char *spec = "{\"layers\": [{\"type\": \"linear\", \"in\": 1024, \"out\": 1024}]}";
    rp_model *m = NULL;
    setenv("RP_HOST_MEMORY_LIMIT_MB", "16", 1);
    TS_ERR(rp_model_create(&m, spec, NULL), RP_ERR_OUT_OF_MEMORY, "RP_HOST_MEMORY_LIMIT_MB");
    assert_null(m);
    setenv("RP_HOST_MEMORY_LIMIT_MB", "64", 1);
    TS_OK(rp_model_create(&m, spec, NULL));
    rp_model_destroy(m);
    m = NULL;
    unsetenv("RP_HOST_MEMORY_LIMIT_MB");
    TS_OK(rp_model_create(&m, spec, NULL));
    rp_model_destroy(m);
}

/* The API accepts up to 16 dimensions; elementwise layers work at every rank it accepts. */
static void sixteen_dimensional_inputs_run_through_activations(void **state) {
    (void)state;
    rp_model *m = ts_model("{\"layers\": [{\"type\": \"gelu\"}, {\"type\": \"silu\"}]}", 1, 1,
                           NULL, 0);
    int64_t shape[16];
    for (int d = 0; d < 16; ++d)
        shape[d] = 1;
    shape[0] = 2;
    shape[15] = 3;
    float x[6] = {-1, 0, 1, 2, -2, 0.5f};
    DLManagedTensor t = {.dl_tensor = {.data = x, .device = {kDLCPU, 0}, .ndim = 16,
                                       .dtype = {kDLFloat, 32, 1}, .shape = shape}};
    const DLManagedTensor *inputs[1] = {&t};
    rp_tensor_list *out = NULL;
    TS_OK(rp_forward(&out, m, inputs, 1, NULL));
    DLManagedTensor *y = NULL;
    TS_OK(rp_tensor_list_get(&y, out, 0));
    assert_int_equal(y->dl_tensor.ndim, 16);
    float got[6];
    ts_read_f32(&y->dl_tensor, got);
    /* silu(gelu(1)) = silu(0.8413447) = 0.8413447 / (1 + e^-0.8413447) = 0.5878883 */
    assert_true(got[2] > 0.58788f && got[2] < 0.58790f);
    ts_free(y);
    rp_tensor_list_destroy(out);
    rp_model_destroy(m);
}

static void unknown_status_codes_have_a_string(void **state) {
    (void)state;
    int32_t codes[4] = {-8, 1, 77, -1000};
    for (int i = 0; i < 4; ++i) {
        rp_status s;
        memcpy(&s, &codes[i], sizeof s);
        assert_string_equal(rp_status_string(s), "unknown status");
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(two_threads_on_one_model_get_busy_not_corruption),
        cmocka_unit_test(destroy_from_a_step_callback_is_refused),
        cmocka_unit_test(dlpack_element_counts_that_overflow_are_refused),
        cmocka_unit_test(out_of_range_json_and_sizes_are_caller_errors),
        cmocka_unit_test(models_larger_than_the_host_are_refused_before_allocating),
        cmocka_unit_test(the_host_memory_limit_variable_lowers_the_headroom),
        cmocka_unit_test(sixteen_dimensional_inputs_run_through_activations),
        cmocka_unit_test(unknown_status_codes_have_a_string),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
