/*
 * test_bad_input.c - every exported function refuses bad input with the right status and a
 * message that says what was wrong, changes nothing, and leaves the model working.
 *
 * Message checks are case-insensitive substrings; "a|b" accepts either wording. A NULL pointer
 * must be named ("<parameter>|null"); a bad value must name the setting; a bad spec must name
 * the layer index, as docs/semantics.md promises. After the bad calls each test proves the
 * model still works: ts_assert_trains_like_reference() trains it for three AdamW steps and
 * compares with the libtorch reference (loss falls, losses and weights agree).
 *
 * Handles that were already destroyed cannot be tested from C without undefined behaviour;
 * they are not covered here.
 */
#define _GNU_SOURCE
#include "test_support.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static const char *SPEC = "{\"layers\": ["
                          "{\"type\": \"linear\", \"in\": 8, \"out\": 16},"
                          "{\"type\": \"relu\"},"
                          "{\"type\": \"linear\", \"in\": 16, \"out\": 4}]}";

#define ROWS 10
#define IN 8
#define OUT 4

static float X[ROWS * IN], Y[ROWS * OUT];
static const int64_t XS[2] = {ROWS, IN}, YS[2] = {ROWS, OUT};

static int setup(void **state) {
    (void)state;
    ts_fill_uniform(X, ROWS * IN, 61, -1.f, 1.f);
    ts_fill_uniform(Y, ROWS * OUT, 62, -1.f, 1.f);
    return 0;
}

static rp_model *good_model(void) { return ts_model(SPEC, 60, 2, NULL, 0); }

static void assert_grads_zero(rp_model *model) {
    ts_params *g = ts_grads(model);
    for (size_t i = 0; i < g->count; ++i)
        for (int64_t j = 0; j < g->numel[i]; ++j)
            if (g->data[i][j] != 0.0f) {
                print_error("gradient of %s accumulated by a failed call\n", g->names[i]);
                fail();
            }
    ts_params_free(g);
}

static void assert_weights_unchanged(rp_model *model, const ts_params *before) {
    ts_params *now = ts_masters(model);
    ts_assert_params_equal(now, before);
    ts_params_free(now);
}

static int32_t dummy_loss(double *out_loss, DLManagedTensor **out_grad,
                          const DLManagedTensor *outputs, const DLManagedTensor *labels,
                          int32_t microbatch, void *user_data) {
    (void)out_grad;
    (void)outputs;
    (void)labels;
    (void)microbatch;
    (void)user_data;
    *out_loss = 0.0;
    return 1;
}

static int32_t dummy_split(DLManagedTensor **out_pieces, const DLManagedTensor *const *inputs,
                           size_t n_inputs, int32_t num_microbatch, void *user_data) {
    (void)out_pieces;
    (void)inputs;
    (void)n_inputs;
    (void)num_microbatch;
    (void)user_data;
    return 1;
}

static int32_t dummy_step(rp_model *model, void *user_data) {
    (void)model;
    (void)user_data;
    return 0;
}

static void dummy_log(int32_t level, const char *message, void *user_data) {
    (void)level;
    (void)message;
    (void)user_data;
}

/* ---- status, logging, devices -------------------------------------------------------------- */

static void status_string_log_callback_and_device_count_reject_bad_values(void **state) {
    (void)state;
    const char *s = rp_status_string((rp_status)-99);
    assert_non_null(s);
    assert_true(strlen(s) > 0);
    s = rp_status_string((rp_status)12345);
    assert_non_null(s);
    TS_ERR(rp_set_log_callback(dummy_log, -1, NULL), RP_ERR_INVALID_ARGUMENT, "level");
    TS_ERR(rp_set_log_callback(dummy_log, 4, NULL), RP_ERR_INVALID_ARGUMENT, "level");
    TS_ERR(rp_set_log_callback(NULL, 99, NULL), RP_ERR_INVALID_ARGUMENT, "level");
    TS_OK(rp_set_log_callback(NULL, RP_LOG_WARN, NULL));
    TS_ERR(rp_cuda_device_count(NULL), RP_ERR_INVALID_ARGUMENT, "out_count|null");
}

/* ---- run configuration --------------------------------------------------------------------- */

static size_t forward_output_count(rp_model *model, const rp_run_config *cfg) {
    DLManagedTensor *x = ts_f32(2, XS, X);
    const DLManagedTensor *inputs[1] = {x};
    rp_tensor_list *outs = NULL;
    TS_OK(rp_forward(&outs, model, inputs, 1, cfg));
    size_t n = 0;
    TS_OK(rp_tensor_list_size(&n, outs));
    rp_tensor_list_destroy(outs);
    ts_free(x);
    return n;
}

static void run_config_setters_reject_null_and_out_of_range_values(void **state) {
    (void)state;
    TS_ERR(rp_run_config_create(NULL), RP_ERR_INVALID_ARGUMENT, "out_config|null");
    rp_run_config_destroy(NULL);
    rp_run_config *c = ts_config(2, 0);
    TS_OK(rp_run_config_set_merge_output(c, 0));

    TS_ERR(rp_run_config_set_num_microbatch(NULL, 2), RP_ERR_INVALID_ARGUMENT, "config|null");
    TS_ERR(rp_run_config_set_num_microbatch(c, -1), RP_ERR_INVALID_ARGUMENT, "microbatch");
    TS_ERR(rp_run_config_set_num_microbatch(c, 65537), RP_ERR_INVALID_ARGUMENT, "microbatch");
    TS_OK(rp_run_config_set_num_microbatch(c, 65536)); /* the documented maximum */
    TS_OK(rp_run_config_set_num_microbatch(c, 2));

    TS_ERR(rp_run_config_set_recompute_grain(NULL, 1), RP_ERR_INVALID_ARGUMENT, "config|null");
    TS_ERR(rp_run_config_set_recompute_grain(c, 3), RP_ERR_INVALID_ARGUMENT, "grain");
    TS_ERR(rp_run_config_set_recompute_grain(c, -1), RP_ERR_INVALID_ARGUMENT, "grain");

    TS_ERR(rp_run_config_set_output_device(NULL, kDLCPU, 0), RP_ERR_INVALID_ARGUMENT,
           "config|null");
    TS_ERR(rp_run_config_set_output_device(c, kDLOpenCL, 0), RP_ERR_INVALID_ARGUMENT, "device");
    TS_ERR(rp_run_config_set_output_device(c, kDLCUDA, -1), RP_ERR_INVALID_ARGUMENT,
           "device|gpu|index");
    TS_ERR(rp_run_config_set_output_device(c, 0, 0), RP_ERR_INVALID_ARGUMENT, "device");

    TS_ERR(rp_run_config_set_input_split_dim(NULL, 0, 0), RP_ERR_INVALID_ARGUMENT, "config|null");
    TS_ERR(rp_run_config_set_input_split_dim(c, 64, 0), RP_ERR_INVALID_ARGUMENT, "index|input");
    TS_ERR(rp_run_config_set_input_split_dim(c, -1, 0), RP_ERR_INVALID_ARGUMENT, "index|input");
    TS_ERR(rp_run_config_set_input_split_dim(c, 0, -2), RP_ERR_INVALID_ARGUMENT, "dim");
    TS_OK(rp_run_config_set_input_split_dim(c, 63, RP_SPLIT_REPLICATE));

    TS_ERR(rp_run_config_set_label_split_dim(NULL, 0), RP_ERR_INVALID_ARGUMENT, "config|null");
    TS_ERR(rp_run_config_set_label_split_dim(c, -2), RP_ERR_INVALID_ARGUMENT, "dim");

    TS_ERR(rp_run_config_set_split_callback(NULL, dummy_split, NULL), RP_ERR_INVALID_ARGUMENT,
           "config|null");

    TS_ERR(rp_run_config_set_merge_output(NULL, 1), RP_ERR_INVALID_ARGUMENT, "config|null");
    TS_ERR(rp_run_config_set_merge_output(c, 2), RP_ERR_INVALID_ARGUMENT, "merge");
    TS_ERR(rp_run_config_set_merge_output(c, -2), RP_ERR_INVALID_ARGUMENT, "merge");

    /* Nothing changed: still 2 unmerged microbatches. */
    rp_model *model = good_model();
    assert_int_equal(forward_output_count(model, c), 2);
    ts_assert_trains_like_reference(model, SPEC, IN, OUT);
    rp_model_destroy(model);
    rp_run_config_destroy(c);
}

/* ---- model options ------------------------------------------------------------------------- */

static void model_options_setters_reject_null_and_out_of_range_values(void **state) {
    (void)state;
    TS_ERR(rp_model_options_create(NULL), RP_ERR_INVALID_ARGUMENT, "out_options|null");
    rp_model_options_destroy(NULL);
    rp_model_options *o = NULL;
    TS_OK(rp_model_options_create(&o));
    rp_run_config *c = ts_config(3, 0);
    TS_OK(rp_run_config_set_merge_output(c, 0));

    TS_ERR(rp_model_options_set_model_dtype(NULL, RP_DTYPE_F32), RP_ERR_INVALID_ARGUMENT,
           "options|null");
    TS_ERR(rp_model_options_set_model_dtype(o, 99), RP_ERR_INVALID_ARGUMENT, "dtype");
    TS_ERR(rp_model_options_set_model_dtype(o, -1), RP_ERR_INVALID_ARGUMENT, "dtype");
    TS_ERR(rp_model_options_set_optim_dtype(NULL, RP_DTYPE_F32), RP_ERR_INVALID_ARGUMENT,
           "options|null");
    TS_ERR(rp_model_options_set_optim_dtype(o, 4), RP_ERR_INVALID_ARGUMENT, "dtype");
    TS_ERR(rp_model_options_set_pin_mode(NULL, RP_PIN_OFF), RP_ERR_INVALID_ARGUMENT,
           "options|null");
    TS_ERR(rp_model_options_set_pin_mode(o, 3), RP_ERR_INVALID_ARGUMENT, "pin");
    TS_ERR(rp_model_options_set_pin_mode(o, -1), RP_ERR_INVALID_ARGUMENT, "pin");
    TS_ERR(rp_model_options_set_run_config(NULL, c), RP_ERR_INVALID_ARGUMENT, "options|null");
    TS_ERR(rp_model_options_set_seed(NULL, 1), RP_ERR_INVALID_ARGUMENT, "options|null");
    TS_ERR(rp_model_options_set_name(NULL, "x"), RP_ERR_INVALID_ARGUMENT, "options|null");
    TS_ERR(rp_model_options_set_name(o, NULL), RP_ERR_INVALID_ARGUMENT, "name|null");
    TS_ERR(rp_model_options_set_devices(NULL, RP_DEVICE_CPU, 1), RP_ERR_INVALID_ARGUMENT,
           "options|null");
    TS_ERR(rp_model_options_set_devices(o, 3, 1), RP_ERR_INVALID_ARGUMENT, "kind|device");
    TS_ERR(rp_model_options_set_devices(o, -1, 1), RP_ERR_INVALID_ARGUMENT, "kind|device");
    TS_ERR(rp_model_options_set_devices(o, RP_DEVICE_CPU, -1), RP_ERR_INVALID_ARGUMENT, "device");
    TS_ERR(rp_model_options_set_devices(o, RP_DEVICE_CPU, 65), RP_ERR_INVALID_ARGUMENT, "device");
    static const int32_t plan[] = {1, 2};
    TS_ERR(rp_model_options_set_stage_plan(NULL, plan, 2), RP_ERR_INVALID_ARGUMENT, "options|null");

    /* The good values, set around the failures, are the ones in force. */
    TS_OK(rp_model_options_set_devices(o, RP_DEVICE_CPU, 2));
    TS_OK(rp_model_options_set_run_config(o, c));
    TS_OK(rp_model_options_set_seed(o, 60));
    TS_OK(rp_model_options_set_name(o, "bad-input"));
    TS_ERR(rp_model_options_set_devices(o, RP_DEVICE_CPU, -3), RP_ERR_INVALID_ARGUMENT, "device");
    rp_model *model = NULL;
    TS_OK(rp_model_create(&model, SPEC, o));
    int32_t n = 0;
    TS_OK(rp_model_num_devices(&n, model));
    assert_int_equal(n, 2);
    assert_int_equal(forward_output_count(model, NULL), 3); /* the model-level config */
    /* Same seed as good_model(): same initial weights. */
    rp_model *twin = good_model();
    ts_params *a = ts_masters(model), *b = ts_masters(twin);
    ts_assert_params_equal(a, b);
    ts_params_free(a);
    ts_params_free(b);
    rp_model_destroy(twin);
    ts_assert_trains_like_reference(model, SPEC, IN, OUT);
    rp_model_destroy(model);
    rp_run_config_destroy(c);
    rp_model_options_destroy(o);
}

/* ---- model creation ------------------------------------------------------------------------ */

typedef struct bad_spec {
    const char *json;
    const char *needles[4];
} bad_spec;

static const bad_spec BAD_SPECS[] = {
    {"{\"layers\": [", {"json|parse", NULL}},
    {"not json at all", {"json|parse", NULL}},
    {"", {"json|parse|empty", NULL}},
    {"[1, 2]", {"layers|object", NULL}},
    {"{}", {"layers", NULL}},
    {"{\"layers\": 3}", {"layers", NULL}},
    {"{\"layers\": [{\"type\": \"linear\", \"in\": 8, \"out\": 4}], \"extra\": 1}",
     {"extra", NULL}},
    {"{\"layers\": [3]}", {"layer 0", NULL}},
    {"{\"layers\": [{\"in\": 3, \"out\": 2}]}", {"layer 0", "type", NULL}},
    {"{\"layers\": [{\"type\": \"linear\", \"in\": 8, \"out\": 4},"
     " {\"type\": \"convolution\"}]}",
     {"layer 1", "convolution", NULL}},
    {"{\"layers\": [{\"type\": \"linear\", \"in\": 8}]}", {"layer 0", "linear", "out", NULL}},
    {"{\"layers\": [{\"type\": \"relu\"}, {\"type\": \"relu\"},"
     " {\"type\": \"linear\", \"in\": -3, \"out\": 4}]}",
     {"layer 2", "linear", "\"in\"|'in'| in ", "-3"}},
    {"{\"layers\": [{\"type\": \"linear\", \"in\": 0, \"out\": 4}]}", {"layer 0", "in", NULL}},
    {"{\"layers\": [{\"type\": \"linear\", \"in\": 2.5, \"out\": 4}]}", {"layer 0", "in", NULL}},
    {"{\"layers\": [{\"type\": \"linear\", \"in\": \"8\", \"out\": 4}]}", {"layer 0", "in", NULL}},
    {"{\"layers\": [{\"type\": \"linear\", \"in\": 8, \"out\": 4, \"biass\": true}]}",
     {"layer 0", "biass", NULL}},
    {"{\"layers\": [{\"type\": \"linear\", \"in\": 8, \"out\": 4, \"bias\": \"yes\"}]}",
     {"layer 0", "bias", NULL}},
    {"{\"layers\": [{\"type\": \"relu\"}, {\"type\": \"dropout\", \"p\": 1.0}]}",
     {"layer 1", "dropout", "p", NULL}},
    {"{\"layers\": [{\"type\": \"dropout\", \"p\": -0.1}]}", {"layer 0", "p", NULL}},
    {"{\"layers\": [{\"type\": \"gelu\", \"approximate\": \"fast\"}]}",
     {"layer 0", "approximate", NULL}},
    {"{\"layers\": [{\"type\": \"residual_mlp\", \"dim\": 4, \"hidden\": 8,"
     " \"activation\": \"swish\"}]}",
     {"layer 0", "activation|swish", NULL}},
    {"{\"layers\": [{\"type\": \"residual_mlp\", \"dim\": 4, \"hidden\": 8,"
     " \"norm\": \"batch_norm\"}]}",
     {"layer 0", "norm", NULL}},
    {"{\"layers\": [{\"type\": \"residual_mlp\", \"dim\": 4}]}", {"layer 0", "hidden", NULL}},
    {"{\"layers\": [{\"type\": \"embedding\", \"num\": 10, \"dim\": -1}]}",
     {"layer 0", "dim", NULL}},
    {"{\"layers\": [{\"type\": \"layer_norm\"}]}", {"layer 0", "dim", NULL}},
    {"{\"layers\": [{\"type\": \"reshape\", \"shape\": [-1, -1]}]}", {"layer 0", "shape", NULL}},
    {"{\"layers\": [{\"type\": \"relu\", \"in\": 3}]}", {"layer 0", "in", NULL}},
};

static void model_create_rejects_bad_specs_naming_the_layer(void **state) {
    (void)state;
    rp_model_options *o = NULL;
    TS_OK(rp_model_options_create(&o));
    TS_OK(rp_model_options_set_devices(o, RP_DEVICE_CPU, 2));
    TS_OK(rp_model_options_set_seed(o, 60));
    for (size_t i = 0; i < sizeof BAD_SPECS / sizeof BAD_SPECS[0]; ++i) {
        rp_model *model = NULL;
        rp_status s = rp_model_create(&model, BAD_SPECS[i].json, o);
        char msg[2048];
        snprintf(msg, sizeof msg, "%s", rp_last_error_message());
        if (s != RP_ERR_INVALID_ARGUMENT || model != NULL || msg[0] == '\0') {
            print_error("spec %s: status %d, model %p, message \"%s\"\n", BAD_SPECS[i].json, (int)s,
                        (void *)model, msg);
            fail();
        }
        for (size_t k = 0; k < 4 && BAD_SPECS[i].needles[k]; ++k)
            if (!ts_contains(msg, BAD_SPECS[i].needles[k])) {
                print_error("spec %s: message \"%s\" does not mention \"%s\"\n", BAD_SPECS[i].json,
                            msg, BAD_SPECS[i].needles[k]);
                fail();
            }
    }
    TS_ERR(rp_model_create(NULL, SPEC, o), RP_ERR_INVALID_ARGUMENT, "out_model|null");
    rp_model *model = (rp_model *)0x1;
    TS_ERR(rp_model_create(&model, NULL, o), RP_ERR_INVALID_ARGUMENT, "spec|null");
    rp_model_destroy(NULL);
    /* The same options still build a working model. */
    model = NULL;
    TS_OK(rp_model_create(&model, SPEC, o));
    ts_assert_trains_like_reference(model, SPEC, IN, OUT);
    rp_model_destroy(model);
    rp_model_options_destroy(o);
}

static void model_create_rejects_bad_plans_and_missing_gpus(void **state) {
    (void)state;
    rp_model_options *o = NULL;
    TS_OK(rp_model_options_create(&o));
    TS_OK(rp_model_options_set_seed(o, 60));
    TS_OK(rp_model_options_set_devices(o, RP_DEVICE_CPU, 2));
    static const int32_t short_plan[] = {1, 1};     /* 2 of 3 layers */
    static const int32_t long_plan[] = {2, 2};      /* 4 of 3 layers */
    static const int32_t zero_plan[] = {0, 3};      /* empty stage */
    static const int32_t negative_plan[] = {4, -1}; /* sums to 3, but negative */
    const int32_t *plans[] = {short_plan, long_plan, zero_plan, negative_plan};
    for (size_t i = 0; i < 4; ++i) {
        rp_status s = rp_model_options_set_stage_plan(o, plans[i], 2);
        if (s == RP_OK) {
            rp_model *model = NULL;
            TS_ERR(rp_model_create(&model, SPEC, o), RP_ERR_INVALID_ARGUMENT, "plan|stage");
            assert_null(model);
        } else {
            TS_ERR(s, RP_ERR_INVALID_ARGUMENT, "plan|stage|layer");
        }
    }
    TS_OK(rp_model_options_set_stage_plan(o, NULL, 0)); /* back to the automatic planner */

    int32_t gpus = -1;
    TS_OK(rp_cuda_device_count(&gpus));
    assert_true(gpus >= 0);
    if (gpus == 0) {
        rp_model_options *cuda = NULL;
        TS_OK(rp_model_options_create(&cuda));
        TS_OK(rp_model_options_set_devices(cuda, RP_DEVICE_CUDA, 1));
        rp_model *model = NULL;
        TS_ERR(rp_model_create(&model, SPEC, cuda), RP_ERR_CUDA, "cuda|gpu");
        assert_null(model);
        rp_model_options_destroy(cuda);
    }
    rp_model *model = NULL;
    TS_OK(rp_model_create(&model, SPEC, o));
    ts_assert_trains_like_reference(model, SPEC, IN, OUT);
    rp_model_destroy(model);
    rp_model_options_destroy(o);
}

/* ---- model queries and tensor lists -------------------------------------------------------- */

static void model_queries_and_tensor_lists_reject_null_and_bad_index(void **state) {
    (void)state;
    rp_model *model = good_model();
    int32_t n = 0;
    int64_t steps = 0;
    TS_ERR(rp_model_num_layers(NULL, model), RP_ERR_INVALID_ARGUMENT, "out_count|null");
    TS_ERR(rp_model_num_layers(&n, NULL), RP_ERR_INVALID_ARGUMENT, "model|null");
    TS_ERR(rp_model_num_stages(NULL, model), RP_ERR_INVALID_ARGUMENT, "out_count|null");
    TS_ERR(rp_model_num_stages(&n, NULL), RP_ERR_INVALID_ARGUMENT, "model|null");
    TS_ERR(rp_model_num_devices(NULL, model), RP_ERR_INVALID_ARGUMENT, "out_count|null");
    TS_ERR(rp_model_num_devices(&n, NULL), RP_ERR_INVALID_ARGUMENT, "model|null");
    TS_ERR(rp_model_step_count(NULL, model), RP_ERR_INVALID_ARGUMENT, "out_count|null");
    TS_ERR(rp_model_step_count(&steps, NULL), RP_ERR_INVALID_ARGUMENT, "model|null");

    DLManagedTensor *x = ts_f32(2, XS, X);
    const DLManagedTensor *inputs[1] = {x};
    rp_tensor_list *outs = NULL;
    TS_OK(rp_forward(&outs, model, inputs, 1, NULL));
    size_t size = 0;
    DLManagedTensor *t = NULL;
    TS_ERR(rp_tensor_list_size(NULL, outs), RP_ERR_INVALID_ARGUMENT, "out_size|null");
    TS_ERR(rp_tensor_list_size(&size, NULL), RP_ERR_INVALID_ARGUMENT, "list|null");
    TS_ERR(rp_tensor_list_get(NULL, outs, 0), RP_ERR_INVALID_ARGUMENT, "out_tensor|null");
    TS_ERR(rp_tensor_list_get(&t, NULL, 0), RP_ERR_INVALID_ARGUMENT, "list|null");
    TS_ERR(rp_tensor_list_get(&t, outs, 1), RP_ERR_INVALID_ARGUMENT, "index|range");
    TS_ERR(rp_tensor_list_get(&t, outs, (size_t)-1), RP_ERR_INVALID_ARGUMENT, "index|range");
    assert_null(t);
    TS_OK(rp_tensor_list_get(&t, outs, 0));
    ts_free(t);
    rp_tensor_list_destroy(outs);
    rp_tensor_list_destroy(NULL);
    ts_free(x);
    ts_assert_trains_like_reference(model, SPEC, IN, OUT);
    rp_model_destroy(model);
}

/* ---- losses -------------------------------------------------------------------------------- */

static void losses_reject_unknown_kinds_null_functions_and_non_finite_scales(void **state) {
    (void)state;
    rp_loss *l = NULL;
    TS_ERR(rp_loss_create(NULL, RP_LOSS_MSE), RP_ERR_INVALID_ARGUMENT, "out_loss|null");
    TS_ERR(rp_loss_create(&l, 99), RP_ERR_INVALID_ARGUMENT, "kind|loss");
    TS_ERR(rp_loss_create(&l, -1), RP_ERR_INVALID_ARGUMENT, "kind|loss");
    assert_null(l);
    TS_ERR(rp_loss_create_callback(&l, NULL, NULL), RP_ERR_INVALID_ARGUMENT, "fn|callback|null");
    TS_ERR(rp_loss_create_callback(NULL, dummy_loss, NULL), RP_ERR_INVALID_ARGUMENT,
           "out_loss|null");
    assert_null(l);
    TS_ERR(rp_loss_set_scale(NULL, 1.0), RP_ERR_INVALID_ARGUMENT, "loss|null");
    TS_OK(rp_loss_create(&l, RP_LOSS_MSE));
    TS_OK(rp_loss_set_scale(l, 0.5));
    TS_ERR(rp_loss_set_scale(l, NAN), RP_ERR_INVALID_ARGUMENT, "scale|finite");
    TS_ERR(rp_loss_set_scale(l, INFINITY), RP_ERR_INVALID_ARGUMENT, "scale|finite");
    TS_ERR(rp_loss_set_scale(l, -INFINITY), RP_ERR_INVALID_ARGUMENT, "scale|finite");
    rp_loss_destroy(NULL);

    /* The scale is still 0.5: the loss is half the reference's unscaled sum. */
    rp_model *model = good_model();
    ref_model *ref = ts_reference_from(model, SPEC, 60);
    DLManagedTensor *x = ts_f32(2, XS, X), *y = ts_f32(2, YS, Y);
    const DLManagedTensor *inputs[1] = {x};
    rp_run_config *cfg = ts_config(2, 0);
    double got = 0, want = 0;
    TS_OK(rp_forward_backward(&got, NULL, model, inputs, 1, y, l, cfg));
    ref_tensor rx = {X, 0, 2, XS}, ry = {Y, 0, 2, YS};
    ref_fb_args a = {rx, &ry, 2, 0, 0, 0, REF_LOSS_MSE, 1.0};
    assert_int_equal(ref_forward_backward(ref, &want, NULL, 0, NULL, &a), 0);
    assert_true(fabs(got - 0.5 * want) <= 1e-5 * fabs(want));
    rp_run_config_destroy(cfg);
    ts_free(x);
    ts_free(y);
    ref_destroy(ref);
    rp_loss_destroy(l);
    ts_assert_trains_like_reference(model, SPEC, IN, OUT);
    rp_model_destroy(model);
}

/* ---- forward and forward_backward: tensors ------------------------------------------------- */

typedef enum { BAD_INPUT_FORWARD, BAD_INPUT_TRAIN } call_kind;

/* Failures of expect_bad() are collected so that one run reports every bad case; the test
 * fails at its end (expect_bad_done). */
static int g_bad_failures;

static void expect_bad_done(void) {
    if (g_bad_failures) {
        print_error("%d bad input(s) not rejected as documented (listed above)\n", g_bad_failures);
        g_bad_failures = 0;
        fail();
    }
}

/* Run one failing call, check status/message, and that no gradient was accumulated. */
static void expect_bad(rp_model *model, call_kind kind, const DLManagedTensor *input,
                       const DLManagedTensor *labels, const rp_loss *loss, const rp_run_config *cfg,
                       const char *what, const char *needle) {
    const DLManagedTensor *inputs[1] = {input};
    rp_tensor_list *outs = NULL;
    double l = 0;
    rp_status s = kind == BAD_INPUT_FORWARD
                      ? rp_forward(&outs, model, inputs, 1, cfg)
                      : rp_forward_backward(&l, &outs, model, inputs, 1, labels, loss, cfg);
    char msg[2048];
    snprintf(msg, sizeof msg, "%s", rp_last_error_message());
    const char *fn = kind == BAD_INPUT_FORWARD ? "rp_forward" : "rp_forward_backward";
    if (s != RP_ERR_INVALID_ARGUMENT || msg[0] == '\0' || !ts_contains(msg, needle)) {
        print_error("%s (%s): status %d (expected %d), message \"%s\" (should mention \"%s\")\n",
                    what, fn, (int)s, (int)RP_ERR_INVALID_ARGUMENT, s == RP_OK ? "" : msg, needle);
        ++g_bad_failures;
    }
    if (outs) {
        if (s != RP_OK) {
            print_error("%s (%s): failed call returned an output list\n", what, fn);
            ++g_bad_failures;
        }
        rp_tensor_list_destroy(outs);
    }
    ts_params *g = ts_grads(model);
    int dirty = 0;
    for (size_t i = 0; i < g->count; ++i)
        for (int64_t j = 0; j < g->numel[i]; ++j)
            dirty |= g->data[i][j] != 0.0f;
    ts_params_free(g);
    if (dirty) {
        print_error("%s (%s): gradients were accumulated (status %d)\n", what, fn, (int)s);
        ++g_bad_failures;
        TS_OK(rp_zero_grad(model)); /* keep the next cases independent */
    }
}

static void forward_and_training_reject_bad_input_tensors(void **state) {
    (void)state;
    rp_model *model = good_model();
    ts_params *w0 = ts_masters(model);
    rp_loss *mse = NULL;
    TS_OK(rp_loss_create(&mse, RP_LOSS_MSE));
    DLManagedTensor *x = ts_f32(2, XS, X), *y = ts_f32(2, YS, Y);

    DLManagedTensor *f64 = ts_f64(2, XS, X);
    DLManagedTensor *i32 = ts_raw(TS_I32, TS_CPU, 2, XS, NULL, ROWS * IN * 4);
    DLManagedTensor *cuda = ts_raw(TS_F32, TS_CUDA0, 2, XS, NULL, ROWS * IN * 4);
    DLDevice opencl = {kDLOpenCL, 0};
    DLManagedTensor *ocl = ts_raw(TS_F32, opencl, 2, XS, NULL, ROWS * IN * 4);
    DLDataType f32x2 = {kDLFloat, 32, 2};
    DLManagedTensor *lanes = ts_raw(f32x2, TS_CPU, 2, XS, NULL, ROWS * IN * 8);
    int64_t transposed_strides[2] = {1, ROWS};
    DLManagedTensor *strided = ts_f32_strided(2, XS, transposed_strides, X);
    int64_t gap_strides[2] = {IN + 3, 1}; /* rows with padding */
    DLManagedTensor *gappy = ts_f32_strided(2, XS, gap_strides, X);
    int64_t wrong_features[2] = {ROWS, IN - 1};
    DLManagedTensor *narrow = ts_f32(2, wrong_features, X);
    int64_t two_rows[2] = {2, IN};
    DLManagedTensor *tiny = ts_f32(2, two_rows, X);
    DLManagedTensor *nodata = ts_f32(2, XS, X);
    nodata->dl_tensor.data = NULL;
    DLManagedTensor *negative = ts_f32(2, XS, X);
    int64_t neg_shape[2] = {-ROWS, IN};
    negative->dl_tensor.shape = neg_shape;

    rp_run_config *cfg3 = ts_config(3, 0);
    for (int k = 0; k < 2; ++k) {
        call_kind kind = k ? BAD_INPUT_TRAIN : BAD_INPUT_FORWARD;
        expect_bad(model, kind, f64, y, mse, NULL, "float64 input", "has dtype float64");
        expect_bad(model, kind, i32, y, mse, NULL, "int32 input", "dtype|int");
        expect_bad(model, kind, cuda, y, mse, NULL, "CUDA input on a CPU model", "device|cuda");
        expect_bad(model, kind, ocl, y, mse, NULL, "OpenCL input", "device");
        expect_bad(model, kind, lanes, y, mse, NULL, "2 lanes", "has dtype float32 x 2 lanes");
        expect_bad(model, kind, strided, y, mse, NULL, "transposed strides", "contiguous|stride");
        expect_bad(model, kind, gappy, y, mse, NULL, "padded rows", "contiguous|stride");
        expect_bad(model, kind, narrow, y, mse, NULL, "7 features for linear(8)",
                   "shape|size|dim|mat");
        expect_bad(model, kind, tiny, y, mse, cfg3, "2 rows for 3 microbatches", "microbatch|rows");
        expect_bad(model, kind, nodata, y, mse, NULL, "NULL data", "data|null");
        expect_bad(model, kind, negative, y, mse, NULL, "negative size", "shape|size|negative");
    }

    /* NULL handles and pointers. */
    const DLManagedTensor *inputs[1] = {x};
    const DLManagedTensor *null_inputs[1] = {NULL};
    rp_tensor_list *outs = NULL;
    TS_ERR(rp_forward(NULL, model, inputs, 1, NULL), RP_ERR_INVALID_ARGUMENT, "out_outputs|null");
    TS_ERR(rp_forward(&outs, NULL, inputs, 1, NULL), RP_ERR_INVALID_ARGUMENT, "model|null");
    TS_ERR(rp_forward(&outs, model, NULL, 1, NULL), RP_ERR_INVALID_ARGUMENT, "input|null");
    TS_ERR(rp_forward(&outs, model, inputs, 0, NULL), RP_ERR_INVALID_ARGUMENT, "input");
    TS_ERR(rp_forward(&outs, model, null_inputs, 1, NULL), RP_ERR_INVALID_ARGUMENT, "input|null");
    TS_ERR(rp_forward_backward(NULL, NULL, NULL, inputs, 1, y, mse, NULL), RP_ERR_INVALID_ARGUMENT,
           "model|null");
    TS_ERR(rp_forward_backward(NULL, NULL, model, NULL, 1, y, mse, NULL), RP_ERR_INVALID_ARGUMENT,
           "input|null");
    TS_ERR(rp_forward_backward(NULL, NULL, model, inputs, 0, y, mse, NULL), RP_ERR_INVALID_ARGUMENT,
           "input");
    TS_ERR(rp_forward_backward(NULL, NULL, model, null_inputs, 1, y, mse, NULL),
           RP_ERR_INVALID_ARGUMENT, "input|null");
    assert_null(outs);
    assert_grads_zero(model);

    /* Valid variants that must be accepted: explicit row-major strides, and byte_offset. */
    int64_t row_major[2] = {IN, 1};
    DLManagedTensor *explicit_strides = ts_f32_strided(2, XS, row_major, X);
    DLManagedTensor *offset = ts_raw(TS_F32, TS_CPU, 2, XS, NULL, ROWS * IN * 4 + 64);
    memcpy((char *)offset->dl_tensor.data + 64, X, sizeof X);
    offset->dl_tensor.byte_offset = 64;
    float want[ROWS * OUT], got[ROWS * OUT];
    const DLManagedTensor *variants[3] = {x, explicit_strides, offset};
    for (int v = 0; v < 3; ++v) {
        const DLManagedTensor *in[1] = {variants[v]};
        TS_OK(rp_forward(&outs, model, in, 1, NULL));
        DLManagedTensor *o = NULL;
        TS_OK(rp_tensor_list_get(&o, outs, 0));
        ts_read_f32(&o->dl_tensor, v == 0 ? want : got);
        ts_free(o);
        rp_tensor_list_destroy(outs);
        outs = NULL;
        if (v)
            assert_memory_equal(got, want, sizeof got);
    }

    assert_weights_unchanged(model, w0);
    ts_params_free(w0);
    ts_assert_trains_like_reference(model, SPEC, IN, OUT);
    expect_bad_done();
    DLManagedTensor *all[] = {
        x, y, f64, i32, cuda, ocl, lanes, strided, gappy, narrow, tiny, explicit_strides, offset};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; ++i)
        ts_free(all[i]);
    ts_free(nodata);   /* the deleter frees its own buffer, not dl_tensor.data */
    ts_free(negative); /* nor dl_tensor.shape */
    rp_run_config_destroy(cfg3);
    rp_loss_destroy(mse);
    rp_model_destroy(model);
}

static void training_rejects_bad_labels_and_loss_mismatches(void **state) {
    (void)state;
    rp_model *model = good_model();
    ts_params *w0 = ts_masters(model);
    rp_loss *mse = NULL, *ce = NULL, *out = NULL;
    TS_OK(rp_loss_create(&mse, RP_LOSS_MSE));
    TS_OK(rp_loss_create(&ce, RP_LOSS_CROSS_ENTROPY));
    TS_OK(rp_loss_create(&out, RP_LOSS_OUTPUT));
    DLManagedTensor *x = ts_f32(2, XS, X);

    int64_t nine_rows[2] = {ROWS - 1, OUT}, three_cols[2] = {ROWS, OUT - 1};
    DLManagedTensor *y_rows = ts_f32(2, nine_rows, Y);
    DLManagedTensor *y_cols = ts_f32(2, three_cols, Y);
    DLManagedTensor *y_f64 = ts_f64(2, YS, Y);
    DLManagedTensor *y_cuda = ts_raw(TS_F32, TS_CUDA0, 2, YS, NULL, sizeof Y);
    int64_t tstrides[2] = {1, ROWS};
    DLManagedTensor *y_strided = ts_f32_strided(2, YS, tstrides, Y);
    int64_t cls[ROWS], bad_cls[ROWS], neg_cls[ROWS];
    for (int r = 0; r < ROWS; ++r) {
        cls[r] = r % OUT;
        bad_cls[r] = r == 7 ? OUT : r % OUT;
        neg_cls[r] = r == 2 ? -1 : r % OUT;
    }
    int64_t n_rows[1] = {ROWS}, n_rows_short[1] = {ROWS - 3};
    DLManagedTensor *c_float = ts_f32(1, n_rows, Y);
    DLManagedTensor *c_range = ts_i64(1, n_rows, bad_cls);
    DLManagedTensor *c_neg = ts_i64(1, n_rows, neg_cls);
    DLManagedTensor *c_short = ts_i64(1, n_rows_short, cls);
    DLManagedTensor *c_2d = ts_i64(2, YS, NULL);

    expect_bad(model, BAD_INPUT_TRAIN, x, y_rows, mse, NULL, "9 label rows for 10 inputs", "label");
    expect_bad(model, BAD_INPUT_TRAIN, x, y_cols, mse, NULL, "MSE labels of another shape",
               "shape|size|label");
    expect_bad(model, BAD_INPUT_TRAIN, x, y_f64, mse, NULL, "float64 labels", "dtype|float64|f64");
    expect_bad(model, BAD_INPUT_TRAIN, x, y_cuda, mse, NULL, "CUDA labels", "device|cuda");
    expect_bad(model, BAD_INPUT_TRAIN, x, y_strided, mse, NULL, "transposed labels",
               "contiguous|stride");
    expect_bad(model, BAD_INPUT_TRAIN, x, NULL, mse, NULL, "MSE without labels", "label");
    expect_bad(model, BAD_INPUT_TRAIN, x, NULL, ce, NULL, "CE without labels", "label");
    expect_bad(model, BAD_INPUT_TRAIN, x, c_float, ce, NULL, "CE with float labels",
               "int64|dtype|long");
    expect_bad(model, BAD_INPUT_TRAIN, x, c_range, ce, NULL, "CE class 4 of 4",
               "class|range|target|bound");
    expect_bad(model, BAD_INPUT_TRAIN, x, c_neg, ce, NULL, "CE class -1",
               "class|range|target|bound|negative");
    expect_bad(model, BAD_INPUT_TRAIN, x, c_short, ce, NULL, "CE with 7 labels for 10 rows",
               "label|size|shape|batch");
    expect_bad(model, BAD_INPUT_TRAIN, x, c_2d, ce, NULL, "CE with 2-d labels", "label|shape|dim");
    expect_bad(model, BAD_INPUT_TRAIN, x, NULL, out, NULL, "OUTPUT loss on a [rows, 4] output",
               "scalar|element|0-d|output");
    expect_bad(model, BAD_INPUT_TRAIN, x, NULL, NULL, NULL, "NULL loss on a [rows, 4] output",
               "scalar|element|0-d|output");

    /* A split dimension the tensor does not have. */
    rp_run_config *cfg = ts_config(2, 0);
    TS_OK(rp_run_config_set_input_split_dim(cfg, 0, 5));
    DLManagedTensor *y = ts_f32(2, YS, Y);
    expect_bad(model, BAD_INPUT_TRAIN, x, y, mse, cfg, "split dim 5 of a 2-d input", "dim");
    rp_run_config_destroy(cfg);
    cfg = ts_config(2, 0);
    TS_OK(rp_run_config_set_label_split_dim(cfg, 4));
    expect_bad(model, BAD_INPUT_TRAIN, x, y, mse, cfg, "label split dim 4", "dim");
    rp_run_config_destroy(cfg);

    /* An output device that does not exist is reported when the configuration is used. */
    int32_t gpus = 0;
    TS_OK(rp_cuda_device_count(&gpus));
    cfg = ts_config(2, 0);
    TS_OK(rp_run_config_set_output_device(cfg, kDLCUDA, gpus + 3));
    const DLManagedTensor *inputs[1] = {x};
    rp_tensor_list *outs = NULL;
    rp_status s = rp_forward_backward(NULL, &outs, model, inputs, 1, y, mse, cfg);
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", rp_last_error_message());
    if (!((s == RP_ERR_INVALID_ARGUMENT || s == RP_ERR_CUDA) &&
          ts_contains(msg, "device|cuda|gpu"))) {
        print_error("output device cuda:%d: status %d, message \"%s\"\n", gpus + 3, (int)s, msg);
        fail();
    }
    assert_null(outs);
    assert_grads_zero(model);
    rp_run_config_destroy(cfg);

    assert_weights_unchanged(model, w0);
    ts_params_free(w0);
    ts_assert_trains_like_reference(model, SPEC, IN, OUT);
    expect_bad_done();
    DLManagedTensor *all[] = {x,         y,       y_rows,  y_cols, y_f64,   y_cuda,
                              y_strided, c_float, c_range, c_neg,  c_short, c_2d};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; ++i)
        ts_free(all[i]);
    rp_loss_destroy(mse);
    rp_loss_destroy(ce);
    rp_loss_destroy(out);
    rp_model_destroy(model);
}

/* ---- optimizer ----------------------------------------------------------------------------- */

static void optimizer_setters_reject_bad_values_and_keep_the_old_ones(void **state) {
    (void)state;
    rp_optimizer *adam = NULL, *sgd = NULL;
    TS_ERR(rp_optimizer_create(NULL, RP_OPTIMIZER_ADAMW), RP_ERR_INVALID_ARGUMENT,
           "out_optimizer|null");
    TS_ERR(rp_optimizer_create(&adam, 2), RP_ERR_INVALID_ARGUMENT, "kind|optimizer");
    TS_ERR(rp_optimizer_create(&adam, -1), RP_ERR_INVALID_ARGUMENT, "kind|optimizer");
    assert_null(adam);
    rp_optimizer_destroy(NULL);
    TS_OK(rp_optimizer_create(&adam, RP_OPTIMIZER_ADAMW));
    TS_OK(rp_optimizer_create(&sgd, RP_OPTIMIZER_SGD));

    TS_ERR(rp_optimizer_set_learning_rate(NULL, 0.1), RP_ERR_INVALID_ARGUMENT, "optimizer|null");
    TS_OK(rp_optimizer_set_learning_rate(adam, 2e-2));
    TS_ERR(rp_optimizer_set_learning_rate(adam, -1.0), RP_ERR_INVALID_ARGUMENT, "learning|lr");
    TS_ERR(rp_optimizer_set_learning_rate(adam, NAN), RP_ERR_INVALID_ARGUMENT, "learning|lr");
    TS_ERR(rp_optimizer_set_learning_rate(adam, INFINITY), RP_ERR_INVALID_ARGUMENT, "learning|lr");
    TS_OK(rp_optimizer_set_learning_rate(sgd, 0.0)); /* lr 0 is allowed */

    TS_ERR(rp_optimizer_set_betas(NULL, 0.9, 0.99), RP_ERR_INVALID_ARGUMENT, "optimizer|null");
    TS_OK(rp_optimizer_set_betas(adam, 0.8, 0.99));
    TS_ERR(rp_optimizer_set_betas(adam, 0.5, 1.0), RP_ERR_INVALID_ARGUMENT, "beta");
    TS_ERR(rp_optimizer_set_betas(adam, 1.0, 0.9), RP_ERR_INVALID_ARGUMENT, "beta");
    TS_ERR(rp_optimizer_set_betas(adam, -0.1, 0.9), RP_ERR_INVALID_ARGUMENT, "beta");
    TS_ERR(rp_optimizer_set_betas(adam, NAN, 0.9), RP_ERR_INVALID_ARGUMENT, "beta");
    TS_ERR(rp_optimizer_set_betas(sgd, 0.9, 0.99), RP_ERR_INVALID_ARGUMENT, "sgd|adamw|beta");

    TS_ERR(rp_optimizer_set_eps(NULL, 1e-8), RP_ERR_INVALID_ARGUMENT, "optimizer|null");
    TS_OK(rp_optimizer_set_eps(adam, 1e-6));
    TS_ERR(rp_optimizer_set_eps(adam, 0.0), RP_ERR_INVALID_ARGUMENT, "eps");
    TS_ERR(rp_optimizer_set_eps(adam, -1e-8), RP_ERR_INVALID_ARGUMENT, "eps");
    TS_ERR(rp_optimizer_set_eps(adam, NAN), RP_ERR_INVALID_ARGUMENT, "eps");
    TS_ERR(rp_optimizer_set_eps(sgd, 1e-8), RP_ERR_INVALID_ARGUMENT, "sgd|adamw|eps");

    TS_ERR(rp_optimizer_set_weight_decay(NULL, 0.0), RP_ERR_INVALID_ARGUMENT, "optimizer|null");
    TS_OK(rp_optimizer_set_weight_decay(adam, 0.05));
    TS_ERR(rp_optimizer_set_weight_decay(adam, -0.1), RP_ERR_INVALID_ARGUMENT, "decay");
    TS_ERR(rp_optimizer_set_weight_decay(adam, NAN), RP_ERR_INVALID_ARGUMENT, "decay");
    TS_ERR(rp_optimizer_set_weight_decay(sgd, INFINITY), RP_ERR_INVALID_ARGUMENT, "decay");

    TS_ERR(rp_optimizer_set_momentum(NULL, 0.5), RP_ERR_INVALID_ARGUMENT, "optimizer|null");
    TS_ERR(rp_optimizer_set_momentum(sgd, 1.0), RP_ERR_INVALID_ARGUMENT, "momentum");
    TS_ERR(rp_optimizer_set_momentum(sgd, -0.1), RP_ERR_INVALID_ARGUMENT, "momentum");
    TS_ERR(rp_optimizer_set_momentum(sgd, NAN), RP_ERR_INVALID_ARGUMENT, "momentum");
    TS_ERR(rp_optimizer_set_momentum(adam, 0.5), RP_ERR_INVALID_ARGUMENT, "adamw|sgd|momentum");

    /* The AdamW settings in force are the last good ones: lr 2e-2, betas (0.8, 0.99) (not
     * half-applied by the failed (0.5, 1.0)), eps 1e-6, weight decay 0.05. */
    rp_model *model = good_model();
    ref_model *ref = ts_reference_from(model, SPEC, 60);
    DLManagedTensor *x = ts_f32(2, XS, X), *y = ts_f32(2, YS, Y);
    const DLManagedTensor *inputs[1] = {x};
    rp_loss *mse = NULL;
    TS_OK(rp_loss_create(&mse, RP_LOSS_MSE));
    rp_run_config *cfg = ts_config(2, 0);
    ref_tensor rx = {X, 0, 2, XS}, ry = {Y, 0, 2, YS};
    ref_fb_args a = {rx, &ry, 2, 0, 0, 0, REF_LOSS_MSE, 1.0};
    for (int t = 0; t < 2; ++t) {
        TS_OK(rp_forward_backward(NULL, NULL, model, inputs, 1, y, mse, cfg));
        TS_OK(rp_step(model, adam, 0));
        a.call_index = t;
        assert_int_equal(ref_forward_backward(ref, NULL, NULL, 0, NULL, &a), 0);
        assert_int_equal(ref_step_adamw(ref, 2e-2, 0.8, 0.99, 1e-6, 0.05), 0);
    }
    ts_assert_masters_match(model, ref, 1e-4, "weights with the last good AdamW settings");
    rp_run_config_destroy(cfg);
    rp_loss_destroy(mse);
    ts_free(x);
    ts_free(y);
    ref_destroy(ref);
    rp_model_destroy(model);
    rp_optimizer_destroy(adam);
    rp_optimizer_destroy(sgd);
}

static void step_synchronize_and_zero_grad_reject_null(void **state) {
    (void)state;
    rp_model *model = good_model();
    rp_optimizer *adam = NULL;
    TS_OK(rp_optimizer_create(&adam, RP_OPTIMIZER_ADAMW));
    TS_ERR(rp_step(NULL, adam, 0), RP_ERR_INVALID_ARGUMENT, "model|null");
    TS_ERR(rp_step(model, NULL, 0), RP_ERR_INVALID_ARGUMENT, "optimizer|null");
    TS_ERR(rp_step(model, NULL, 1), RP_ERR_INVALID_ARGUMENT, "optimizer|null");
    TS_ERR(rp_step_callback(NULL, dummy_step, NULL, 0), RP_ERR_INVALID_ARGUMENT, "model|null");
    TS_ERR(rp_step_callback(model, NULL, NULL, 0), RP_ERR_INVALID_ARGUMENT, "fn|callback|null");
    TS_ERR(rp_step_callback(model, NULL, NULL, 1), RP_ERR_INVALID_ARGUMENT, "fn|callback|null");
    TS_ERR(rp_synchronize(NULL), RP_ERR_INVALID_ARGUMENT, "model|null");
    TS_ERR(rp_zero_grad(NULL), RP_ERR_INVALID_ARGUMENT, "model|null");
    int64_t steps = -1;
    TS_OK(rp_model_step_count(&steps, model));
    assert_int_equal(steps, 0); /* no failed call enqueued a step */
    ts_assert_trains_like_reference(model, SPEC, IN, OUT);
    rp_optimizer_destroy(adam);
    rp_model_destroy(model);
}

/* ---- parameters ---------------------------------------------------------------------------- */

static void param_queries_reject_null_and_out_of_range(void **state) {
    (void)state;
    rp_model *model = good_model();
    size_t count = 0, index = 0;
    TS_OK(rp_param_count(&count, model));
    assert_int_equal(count, 4);
    const char *name = NULL;
    int64_t shape[8];
    int32_t ndim = 0;
    DLManagedTensor *t = NULL;
    TS_ERR(rp_param_count(NULL, model), RP_ERR_INVALID_ARGUMENT, "out_count|null");
    TS_ERR(rp_param_count(&count, NULL), RP_ERR_INVALID_ARGUMENT, "model|null");
    TS_ERR(rp_param_name(NULL, model, 0), RP_ERR_INVALID_ARGUMENT, "out_name|null");
    TS_ERR(rp_param_name(&name, NULL, 0), RP_ERR_INVALID_ARGUMENT, "model|null");
    TS_ERR(rp_param_name(&name, model, count), RP_ERR_INVALID_ARGUMENT, "index|range");
    TS_ERR(rp_param_find(NULL, model, "0.weight"), RP_ERR_INVALID_ARGUMENT, "out_index|null");
    TS_ERR(rp_param_find(&index, NULL, "0.weight"), RP_ERR_INVALID_ARGUMENT, "model|null");
    TS_ERR(rp_param_find(&index, model, NULL), RP_ERR_INVALID_ARGUMENT, "name|null");
    TS_ERR(rp_param_find(&index, model, "1.weight"), RP_ERR_INVALID_ARGUMENT, "1.weight");
    TS_ERR(rp_param_find(&index, model, ""), RP_ERR_INVALID_ARGUMENT, "name|param");
    TS_ERR(rp_param_shape(shape, NULL, 8, model, 0), RP_ERR_INVALID_ARGUMENT, "out_ndim|null");
    TS_ERR(rp_param_shape(shape, &ndim, 8, NULL, 0), RP_ERR_INVALID_ARGUMENT, "model|null");
    TS_ERR(rp_param_shape(shape, &ndim, 8, model, count), RP_ERR_INVALID_ARGUMENT, "index|range");
    TS_ERR(rp_param_shape(NULL, &ndim, 2, model, 0), RP_ERR_INVALID_ARGUMENT, "out_shape|null");
    TS_ERR(rp_param_shape(shape, &ndim, -1, model, 0), RP_ERR_INVALID_ARGUMENT, "capacity");
    TS_ERR(rp_param_master(NULL, model, 0), RP_ERR_INVALID_ARGUMENT, "out_tensor|null");
    TS_ERR(rp_param_master(&t, NULL, 0), RP_ERR_INVALID_ARGUMENT, "model|null");
    TS_ERR(rp_param_master(&t, model, count), RP_ERR_INVALID_ARGUMENT, "index|range");
    TS_ERR(rp_param_grad(NULL, model, 0), RP_ERR_INVALID_ARGUMENT, "out_tensor|null");
    TS_ERR(rp_param_grad(&t, NULL, 0), RP_ERR_INVALID_ARGUMENT, "model|null");
    TS_ERR(rp_param_grad(&t, model, count), RP_ERR_INVALID_ARGUMENT, "index|range");
    assert_null(t);

    /* Valid edge cases: capacity 0 with NULL shape gives the rank; a short capacity writes only
     * that many sizes. */
    TS_OK(rp_param_shape(NULL, &ndim, 0, model, 0));
    assert_int_equal(ndim, 2);
    shape[0] = shape[1] = -7;
    TS_OK(rp_param_shape(shape, &ndim, 1, model, 0));
    assert_int_equal(ndim, 2);
    assert_int_equal(shape[0], 16);
    assert_int_equal(shape[1], -7);
    TS_OK(rp_param_find(&index, model, "2.bias"));
    assert_int_equal(index, 3);
    ts_assert_trains_like_reference(model, SPEC, IN, OUT);
    rp_model_destroy(model);
}

/* ---- weights on disk ----------------------------------------------------------------------- */

static void write_bytes(const char *path, const void *data, size_t n) {
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    if (n)
        assert_int_equal(fwrite(data, 1, n, fp), n);
    fclose(fp);
}

static char *read_bytes(const char *path, size_t *n) {
    FILE *fp = fopen(path, "rb");
    assert_non_null(fp);
    fseek(fp, 0, SEEK_END);
    *n = (size_t)ftell(fp);
    fseek(fp, 0, SEEK_SET);
    char *b = malloc(*n + 1);
    assert_int_equal(fread(b, 1, *n, fp), *n);
    fclose(fp);
    return b;
}

/* Writes the model's parameters with the reference writer, tampering with tensor `bad`:
 * mode 0 transposes its shape, 1 leaves it out, 2 renames it, 3 adds one element. */
static void write_tampered(const char *path, rp_model *model, size_t bad, int mode) {
    ts_params *w = ts_masters(model);
    ref_st_entry e[8];
    int64_t shapes[8][8];
    size_t n = 0;
    float *longer = NULL;
    for (size_t i = 0; i < w->count; ++i) {
        int32_t nd = 0;
        TS_OK(rp_param_shape(shapes[i], &nd, 8, model, i));
        e[n] = (ref_st_entry){w->names[i], "F32", nd, shapes[i], w->data[i]};
        if (i == bad) {
            if (mode == 1)
                continue;
            if (mode == 0) {
                assert_int_equal(nd, 2);
                int64_t s = shapes[i][0];
                shapes[i][0] = shapes[i][1];
                shapes[i][1] = s;
            }
            if (mode == 2)
                e[n].name = "0.weigth";
            if (mode == 3) {
                longer = calloc((size_t)w->numel[i] + 1, sizeof(float));
                shapes[i][0] += 1;
                e[n].values = longer;
                assert_int_equal(nd, 1);
            }
        }
        ++n;
    }
    assert_int_equal(ref_st_write(path, e, n), 0);
    free(longer);
    ts_params_free(w);
}

static void save_and_load_reject_null_missing_corrupt_and_mismatched_files(void **state) {
    (void)state;
    char *dir = ts_tempdir();
    char good[4096], path[4096];
    snprintf(good, sizeof good, "%s/good.safetensors", dir);
    rp_model *model = good_model();
    ts_params *w0 = ts_masters(model);

    TS_ERR(rp_model_save(NULL, good), RP_ERR_INVALID_ARGUMENT, "model|null");
    TS_ERR(rp_model_save(model, NULL), RP_ERR_INVALID_ARGUMENT, "path|null");
    rp_status s = rp_model_save(model, "");
    assert_true(s == RP_ERR_INVALID_ARGUMENT || s == RP_ERR_IO);
    assert_true(strlen(rp_last_error_message()) > 0);
    TS_ERR(rp_model_load(NULL, good), RP_ERR_INVALID_ARGUMENT, "model|null");
    TS_ERR(rp_model_load(model, NULL), RP_ERR_INVALID_ARGUMENT, "path|null");

    snprintf(path, sizeof path, "%s/missing.safetensors", dir);
    TS_ERR(rp_model_load(model, path), RP_ERR_IO, "missing.safetensors");
    TS_ERR(rp_model_load(model, dir), RP_ERR_IO, "rp-test-"); /* a folder, not a file */

    TS_OK(rp_model_save(model, good));
    size_t n = 0;
    char *bytes = read_bytes(good, &n);

    snprintf(path, sizeof path, "%s/empty.safetensors", dir);
    write_bytes(path, "", 0);
    TS_ERR(rp_model_load(model, path), RP_ERR_IO, "empty.safetensors");

    snprintf(path, sizeof path, "%s/garbage.safetensors", dir);
    char garbage[512];
    for (size_t i = 0; i < sizeof garbage; ++i)
        garbage[i] = (char)(i * 131 + 7);
    write_bytes(path, garbage, sizeof garbage);
    TS_ERR(rp_model_load(model, path), RP_ERR_IO, "garbage.safetensors");

    snprintf(path, sizeof path, "%s/huge_header.safetensors", dir);
    unsigned char huge[16] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f, '{', '}'};
    write_bytes(path, huge, sizeof huge);
    TS_ERR(rp_model_load(model, path), RP_ERR_IO, "huge_header.safetensors");

    snprintf(path, sizeof path, "%s/not_json.safetensors", dir);
    char nj[8 + 16] = {16, 0, 0, 0, 0, 0, 0, 0};
    memcpy(nj + 8, "this is no json!", 16);
    write_bytes(path, nj, sizeof nj);
    TS_ERR(rp_model_load(model, path), RP_ERR_IO, "not_json.safetensors");

    snprintf(path, sizeof path, "%s/truncated.safetensors", dir);
    write_bytes(path, bytes, n / 2);
    TS_ERR(rp_model_load(model, path), RP_ERR_IO, "truncated.safetensors");
    snprintf(path, sizeof path, "%s/short_data.safetensors", dir);
    write_bytes(path, bytes, n - 4); /* header intact, last tensor 4 bytes short */
    TS_ERR(rp_model_load(model, path), RP_ERR_IO, "short_data.safetensors");

    /* Well-formed files that do not fit the model name the tensor. The bad tensor is the last
     * one, so a loader that wrote tensors as it went would already have changed the others. */
    snprintf(path, sizeof path, "%s/transposed.safetensors", dir);
    write_tampered(path, model, 2, 0);
    TS_ERR(rp_model_load(model, path), RP_ERR_IO, "2.weight");
    snprintf(path, sizeof path, "%s/lacking.safetensors", dir);
    write_tampered(path, model, 3, 1);
    TS_ERR(rp_model_load(model, path), RP_ERR_IO, "2.bias");
    snprintf(path, sizeof path, "%s/renamed.safetensors", dir);
    write_tampered(path, model, 0, 2);
    TS_ERR(rp_model_load(model, path), RP_ERR_IO, "0.weight");
    snprintf(path, sizeof path, "%s/longer.safetensors", dir);
    write_tampered(path, model, 3, 3);
    TS_ERR(rp_model_load(model, path), RP_ERR_IO, "2.bias");

    /* Nothing loaded, nothing changed. */
    assert_weights_unchanged(model, w0);
    free(bytes);
    ts_params_free(w0);
    ts_assert_trains_like_reference(model, SPEC, IN, OUT);
    /* And the good file still loads: back to the initial weights. */
    TS_OK(rp_model_load(model, good));
    rp_model *fresh = good_model();
    ts_params *a = ts_masters(model), *b = ts_masters(fresh);
    ts_assert_params_equal(a, b);
    ts_params_free(a);
    ts_params_free(b);
    rp_model_destroy(fresh);
    rp_model_destroy(model);
    ts_rmdir(dir);
    free(dir);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(status_string_log_callback_and_device_count_reject_bad_values),
        cmocka_unit_test(run_config_setters_reject_null_and_out_of_range_values),
        cmocka_unit_test(model_options_setters_reject_null_and_out_of_range_values),
        cmocka_unit_test(model_create_rejects_bad_specs_naming_the_layer),
        cmocka_unit_test(model_create_rejects_bad_plans_and_missing_gpus),
        cmocka_unit_test(model_queries_and_tensor_lists_reject_null_and_bad_index),
        cmocka_unit_test(losses_reject_unknown_kinds_null_functions_and_non_finite_scales),
        cmocka_unit_test(forward_and_training_reject_bad_input_tensors),
        cmocka_unit_test(training_rejects_bad_labels_and_loss_mismatches),
        cmocka_unit_test(optimizer_setters_reject_bad_values_and_keep_the_old_ones),
        cmocka_unit_test(step_synchronize_and_zero_grad_reject_null),
        cmocka_unit_test(param_queries_reject_null_and_out_of_range),
        cmocka_unit_test(save_and_load_reject_null_missing_corrupt_and_mismatched_files),
    };
    return cmocka_run_group_tests_name("bad_input", tests, setup, NULL);
}
