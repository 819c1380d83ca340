/*
 * test_reporting.c - what the library reports besides results: progress of loading and saving
 * weights (rp_set_progress_callback), the level set by RP_LOG_LEVEL, and the device names of the
 * timing record (rp_model_trace_json).
 *
 * Byte totals are computed here from the parameter shapes (fp32: 4 bytes per element), not read
 * from the library. RP_LOG_LEVEL is read once per process, at the first use of the log: main()
 * sets it to "info" before any RoundPipe call, so this binary runs with that level.
 */
#define _GNU_SOURCE
#include "test_support.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *SPEC = "{\"layers\": [{\"type\": \"linear\", \"in\": 5, \"out\": 9},"
                          "{\"type\": \"relu\"},"
                          "{\"type\": \"linear\", \"in\": 9, \"out\": 2, \"bias\": false}]}";
/* 5 x 9 + 9 + 9 x 2 fp32 elements. */
static const int64_t SPEC_BYTES = (5 * 9 + 9 + 9 * 2) * 4;

static const char *LLAMA =
    "{\"architectures\": [\"LlamaForCausalLM\"], \"model_type\": \"llama\","
    " \"vocab_size\": 32, \"hidden_size\": 16, \"intermediate_size\": 24,"
    " \"num_hidden_layers\": 2, \"num_attention_heads\": 2, \"num_key_value_heads\": 1,"
    " \"hidden_act\": \"silu\", \"max_position_embeddings\": 64, \"rms_norm_eps\": 1e-5,"
    " \"tie_word_embeddings\": false, \"initializer_range\": 0.02, \"dtype\": \"float32\"}";

/* ---- progress ---------------------------------------------------------------------------- */

enum { MAX_CALLS = 4096 };

typedef struct progress_log {
    int count;
    char what[MAX_CALLS][256];
    int64_t done[MAX_CALLS], total[MAX_CALLS];
} progress_log;

static void record_progress(const char *what, int64_t done, int64_t total, void *user_data) {
    progress_log *log = user_data;
    if (log->count >= MAX_CALLS)
        return;
    snprintf(log->what[log->count], sizeof log->what[0], "%s", what);
    log->done[log->count] = done;
    log->total[log->count] = total;
    log->count++;
}

/* Every call of `log` names `what`, with `total`; done starts at 0, never falls, and reaches
 * `total` exactly once, in the last call. */
static void assert_one_operation(const progress_log *log, const char *what, int64_t total) {
    assert_true(log->count >= 2);
    for (int i = 0; i < log->count; ++i) {
        assert_string_equal(log->what[i], what);
        assert_int_equal(log->total[i], total);
        if (i > 0)
            assert_true(log->done[i] >= log->done[i - 1]);
        assert_true(log->done[i] < total || i == log->count - 1);
    }
    assert_int_equal(log->done[0], 0);
    assert_int_equal(log->done[log->count - 1], total);
}

static int64_t param_bytes(rp_model *model) {
    size_t count = 0;
    TS_OK(rp_param_count(&count, model));
    int64_t bytes = 0;
    for (size_t i = 0; i < count; ++i)
        bytes += 4 * ts_param_numel(model, i);
    return bytes;
}

static void test_save_and_load_report_every_byte_ending_once_at_the_total(void **state) {
    (void)state;
    char *dir = ts_tempdir();
    char path[4200];
    snprintf(path, sizeof path, "%s/w.safetensors", dir);
    char save_what[4300], load_what[4300];
    snprintf(save_what, sizeof save_what, "save %s", path);
    snprintf(load_what, sizeof load_what, "load %s", path);
    rp_model *model = ts_model(SPEC, 1, 1, NULL, 0);
    static progress_log log;

    memset(&log, 0, sizeof log);
    TS_OK(rp_set_progress_callback(record_progress, &log));
    TS_OK(rp_model_save(model, path));
    assert_one_operation(&log, save_what, SPEC_BYTES);

    memset(&log, 0, sizeof log);
    TS_OK(rp_model_load(model, path));
    assert_one_operation(&log, load_what, SPEC_BYTES);

    /* A failed load reports no completion. */
    memset(&log, 0, sizeof log);
    char missing[4300];
    snprintf(missing, sizeof missing, "%s/missing.safetensors", dir);
    TS_ERR(rp_model_load(model, missing), RP_ERR_IO, "missing.safetensors");
    for (int i = 0; i < log.count; ++i)
        assert_true(log.done[i] < log.total[i]);

    /* NULL: no more reports. */
    TS_OK(rp_set_progress_callback(NULL, NULL));
    memset(&log, 0, sizeof log);
    TS_OK(rp_model_save(model, path));
    assert_int_equal(log.count, 0);

    rp_model_destroy(model);
    ts_rmdir(dir);
    free(dir);
}

static void test_hugging_face_save_and_create_report_the_model_bytes(void **state) {
    (void)state;
    char *dir = ts_tempdir();
    char hf_dir[4200], what[4300];
    snprintf(hf_dir, sizeof hf_dir, "%s/llama", dir);
    rp_model_options *options = NULL;
    TS_OK(rp_model_options_create(&options));
    TS_OK(rp_model_options_set_devices(options, RP_DEVICE_CPU, 1));
    rp_model *model = NULL;
    TS_OK(rp_model_create_from_hf_config(&model, LLAMA, options));
    const int64_t bytes = param_bytes(model);
    static progress_log log;

    memset(&log, 0, sizeof log);
    TS_OK(rp_set_progress_callback(record_progress, &log));
    TS_OK(rp_model_save_hf(model, hf_dir));
    snprintf(what, sizeof what, "save %s", hf_dir);
    assert_one_operation(&log, what, bytes);

    memset(&log, 0, sizeof log);
    rp_model *loaded = NULL;
    TS_OK(rp_model_create_from_hf(&loaded, hf_dir, options));
    snprintf(what, sizeof what, "load %s", hf_dir);
    assert_one_operation(&log, what, bytes);
    assert_true(log.count >= 3); /* one report per tensor at least */

    memset(&log, 0, sizeof log);
    TS_OK(rp_model_load_hf(loaded, hf_dir));
    assert_one_operation(&log, what, bytes);
    TS_OK(rp_set_progress_callback(NULL, NULL));

    rp_model_destroy(loaded);
    rp_model_destroy(model);
    rp_model_options_destroy(options);
    ts_rmdir(dir);
    free(dir);
}

/* ---- RP_LOG_LEVEL ------------------------------------------------------------------------- */

typedef struct log_record {
    int info, warn;
} log_record;

static void record_log(int32_t level, const char *message, void *user_data) {
    log_record *r = user_data;
    (void)message;
    if (level == RP_LOG_INFO)
        r->info++;
    if (level == RP_LOG_WARN)
        r->warn++;
}

static void test_rp_log_level_overrides_the_callback_min_level(void **state) {
    (void)state;
    static log_record r;
    memset(&r, 0, sizeof r);
    /* min_level error, but RP_LOG_LEVEL=info (set by main): creating a model logs its layout at
     * info level, and it arrives. */
    TS_OK(rp_set_log_callback(record_log, RP_LOG_ERROR, &r));
    rp_model *model = ts_model(SPEC, 1, 1, NULL, 0);
    rp_model_destroy(model);
    TS_OK(rp_set_log_callback(NULL, RP_LOG_WARN, NULL));
    assert_true(r.info >= 1);
}

/* ---- timing record ------------------------------------------------------------------------- */

static void test_trace_names_each_cpu_worker_device(void **state) {
    (void)state;
    rp_model *model = ts_model(SPEC, 1, 2, NULL, 0);
    float x[6 * 5];
    ts_fill_uniform(x, 30, 3, -1.f, 1.f);
    int64_t xs[2] = {6, 5};
    DLManagedTensor *in = ts_f32(2, xs, x);
    const DLManagedTensor *inputs[1] = {in};
    rp_tensor_list *out = NULL;
    TS_OK(rp_forward(&out, model, inputs, 1, NULL));
    rp_tensor_list_destroy(out);
    const char *json = NULL;
    TS_OK(rp_model_trace_json(&json, model));
    if (ts_device_kind() == RP_DEVICE_CPU) {
        assert_non_null(strstr(json, "{\"args\":{\"name\":\"cpu 0\"},\"name\":\"process_name\","
                                     "\"ph\":\"M\",\"pid\":0}"));
        assert_non_null(strstr(json, "{\"args\":{\"name\":\"cpu 1\"},\"name\":\"process_name\","
                                     "\"ph\":\"M\",\"pid\":1}"));
        assert_null(strstr(json, "cuda:"));
    } else {
        assert_non_null(strstr(json, "\"name\":\"cuda:0\""));
    }
    ts_free(in);
    rp_model_destroy(model);
}

int main(void) {
    /* Before the first RoundPipe call: the library reads it at the first use of its log. */
    setenv("RP_LOG_LEVEL", "info", 1);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_save_and_load_report_every_byte_ending_once_at_the_total),
        cmocka_unit_test(test_hugging_face_save_and_create_report_the_model_bytes),
        cmocka_unit_test(test_rp_log_level_overrides_the_callback_min_level),
        cmocka_unit_test(test_trace_names_each_cpu_worker_device),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
