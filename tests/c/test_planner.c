/*
 * test_planner.c - the stage planner counts activation memory: under a memory cap, a training
 * call whose microbatches hold many tokens gets shorter stages and a shorter fused tail, one
 * with few tokens keeps the plan that weights alone give, and the plan never changes what is
 * computed. On CPU devices an explicit cap is not enforced but shapes the plan
 * (rp_model_options_set_gpu_memory_cap), so this runs without a GPU.
 *
 * The model is a Qwen3-shaped decoder stack in fp32: token embedding, six decoder layers (dim 64,
 * 4 query heads and 2 key/value heads of 16, qk_norm, MLP 512), a final RMSNorm; the loss is the
 * mean squared error of the hidden states. By the decoder layer's count
 * (DecoderLayer::activation_bytes_per_token), one layer keeps 8,432 bytes per token in fp32:
 * at 3,072 tokens per microbatch that is 25.9 MB, against weights and gradients of 0.9 MB. The
 * cap of 64 MiB lets a stage use three quarters of it, 50.3 MB: at stage grain a stage then
 * holds one decoder layer (its activations and half again for the backward's transient, 40 MB)
 * but not two (67 MB); at 32 tokens activations are negligible.
 */
#include "test_support.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define DECODER                                                                                    \
    "{\"type\": \"decoder_layer\", \"dim\": 64, \"heads\": 4, \"kv_heads\": 2, \"head_dim\": 16," \
    " \"hidden\": 512, \"qk_norm\": true, \"eps\": 1e-6},"
static const char *SPEC = "{\"layers\": ["
                          "{\"type\": \"token_embedding\", \"num\": 96, \"dim\": 64},"
                          DECODER DECODER DECODER DECODER DECODER DECODER
                          "{\"type\": \"rms_norm\", \"dim\": 64, \"eps\": 1e-6}]}";
enum { NUM_LAYERS = 8, DIM = 64, SEQ = 16, VOCAB = 96 };
static const int64_t CAP = 64 << 20;

/* A model on one CPU device; cap 0: none. */
static rp_model *model_with_cap(int64_t cap) {
    rp_model_options *o = NULL;
    TS_OK(rp_model_options_create(&o));
    TS_OK(rp_model_options_set_seed(o, 5));
    TS_OK(rp_model_options_set_devices(o, RP_DEVICE_CPU, 1));
    if (cap)
        TS_OK(rp_model_options_set_gpu_memory_cap(o, cap));
    rp_model *m = NULL;
    TS_OK(rp_model_create(&m, SPEC, o));
    rp_model_options_destroy(o);
    return m;
}

static int32_t plan_of(const rp_model *m, int32_t *counts) {
    int32_t n = 0;
    TS_OK(rp_model_stage_plan(counts, &n, NUM_LAYERS, m));
    assert_true(n >= 1 && n <= NUM_LAYERS);
    return n;
}

/* Layers 1..6 are the decoder layers: how many of them stage s holds. */
static int decoders_in_stage(const int32_t *counts, int32_t s) {
    int first = 0;
    for (int32_t i = 0; i < s; ++i)
        first += counts[i];
    int n = 0;
    for (int l = first; l < first + counts[s]; ++l)
        n += l >= 1 && l <= 6;
    return n;
}

/* One training call on `rows` sequences of SEQ tokens in `microbatches` microbatches; returns
 * the loss. */
static double train_call(rp_model *m, int64_t rows, int32_t microbatches, int32_t grain) {
    int64_t ids_shape[2] = {rows, SEQ};
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)(rows * SEQ));
    for (int64_t i = 0; i < rows * SEQ; ++i)
        ids[i] = (i * 7 + i / 5) % VOCAB;
    int64_t lab_shape[3] = {rows, SEQ, DIM};
    float *target = malloc(sizeof(float) * (size_t)(rows * SEQ * DIM));
    ts_fill_uniform(target, rows * SEQ * DIM, 11, -1.0f, 1.0f);
    DLManagedTensor *in = ts_i64(2, ids_shape, ids);
    DLManagedTensor *lab = ts_f32(3, lab_shape, target);
    const DLManagedTensor *inputs[1] = {in};
    rp_loss *loss = NULL;
    TS_OK(rp_loss_create(&loss, RP_LOSS_MSE));
    rp_run_config *cfg = ts_config(microbatches, grain);
    double l = 0;
    TS_OK(rp_forward_backward(&l, NULL, m, inputs, 1, lab, loss, cfg));
    rp_run_config_destroy(cfg);
    rp_loss_destroy(loss);
    ts_free(lab);
    ts_free(in);
    free(target);
    free(ids);
    return l;
}

static void short_sequences_keep_the_plan_weights_alone_give(void **state) {
    (void)state;
    rp_model *capped = model_with_cap(CAP), *free_model = model_with_cap(0);
    int32_t before[NUM_LAYERS], after[NUM_LAYERS], uncapped[NUM_LAYERS];
    int32_t n_before = plan_of(capped, before);
    train_call(capped, 2, 1, RP_GRAIN_STAGE); /* 32 tokens */
    int32_t n_after = plan_of(capped, after);
    int32_t n_uncapped = plan_of(free_model, uncapped);
    assert_int_equal(n_after, n_before);
    assert_memory_equal(after, before, sizeof(int32_t) * (size_t)n_before);
    assert_int_equal(n_after, n_uncapped);
    assert_memory_equal(after, uncapped, sizeof(int32_t) * (size_t)n_after);
    assert_int_equal(n_after, 2); /* the weights-only plan: two stages for one device */
    rp_model_destroy(capped);
    rp_model_destroy(free_model);
}

static void long_microbatches_under_a_small_cap_get_one_decoder_layer_per_stage(void **state) {
    (void)state;
    rp_model *m = model_with_cap(CAP);
    int32_t short_plan[NUM_LAYERS], long_plan[NUM_LAYERS];
    int32_t n_short = plan_of(m, short_plan);
    train_call(m, 192, 1, RP_GRAIN_STAGE); /* 3,072 tokens in one microbatch */
    int32_t n_long = plan_of(m, long_plan);
    assert_true(n_long > n_short);
    for (int32_t s = 0; s < n_long; ++s)
        assert_true(decoders_in_stage(long_plan, s) <= 1);
    assert_true(decoders_in_stage(long_plan, n_long - 1) <
                decoders_in_stage(short_plan, n_short - 1)); /* a shorter fused tail */
    /* The same tokens in 16 microbatches of 192: the microbatch in flight is what counts. */
    int32_t split_plan[NUM_LAYERS];
    train_call(m, 192, 16, RP_GRAIN_STAGE);
    int32_t n_split = plan_of(m, split_plan);
    assert_int_equal(n_split, n_short);
    assert_memory_equal(split_plan, short_plan, sizeof(int32_t) * (size_t)n_short);
    rp_model_destroy(m);
}

static void layer_grain_recompute_lets_backward_stages_grow_but_not_the_tail(void **state) {
    (void)state;
    rp_model *m = model_with_cap(CAP);
    int32_t stage_grain[NUM_LAYERS], layer_grain[NUM_LAYERS];
    train_call(m, 192, 1, RP_GRAIN_STAGE);
    int32_t n_stage = plan_of(m, stage_grain);
    train_call(m, 192, 1, RP_GRAIN_LAYER);
    int32_t n_layer = plan_of(m, layer_grain);
    /* A layer-grain backward stage keeps one layer's graph at a time, so stages may hold several
     * decoder layers; the tail keeps its whole graph at either grain. */
    assert_true(n_layer < n_stage);
    int most = 0;
    for (int32_t s = 0; s + 1 < n_layer; ++s)
        if (decoders_in_stage(layer_grain, s) > most)
            most = decoders_in_stage(layer_grain, s);
    assert_true(most >= 2);
    assert_true(decoders_in_stage(layer_grain, n_layer - 1) <= 1);
    rp_model_destroy(m);
}

/* Reference: the same model and data without a cap (the weights-only plan). The plans differ
 * only in where stages are cut; each layer runs the same fp32 operations on the same inputs
 * either way, so loss and gradients agree to fp32 rounding (1e-6). */
static void the_long_sequence_plan_computes_what_the_weights_only_plan_does(void **state) {
    (void)state;
    rp_model *capped = model_with_cap(CAP), *free_model = model_with_cap(0);
    double got = train_call(capped, 192, 1, RP_GRAIN_STAGE);
    double want = train_call(free_model, 192, 1, RP_GRAIN_STAGE);
    int32_t a[NUM_LAYERS], b[NUM_LAYERS];
    assert_true(plan_of(capped, a) != plan_of(free_model, b));
    assert_true(fabs(got - want) <= 1e-6 * fabs(want));
    TS_OK(rp_synchronize(capped));
    TS_OK(rp_synchronize(free_model));
    ts_params *ga = ts_grads(capped), *gb = ts_grads(free_model);
    ts_assert_params_close(ga, gb, 1e-6, "gradient");
    ts_params_free(ga);
    ts_params_free(gb);
    rp_model_destroy(capped);
    rp_model_destroy(free_model);
}

/* A caller-defined layer without parameters that passes its fp32 input on (a copy) and the
 * gradient back. */
static int32_t pass_forward(rp_tensor_list *out, void **context, const rp_layer_call *call,
                            const DLManagedTensor *const *inputs, size_t n_inputs,
                            void *user_data) {
    (void)context, (void)call, (void)n_inputs, (void)user_data;
    const DLTensor *x = &inputs[0]->dl_tensor;
    float *values = malloc(sizeof(float) * (size_t)ts_numel(x));
    ts_read_f32(x, values);
    rp_status s = rp_tensor_list_push(out, ts_f32(x->ndim, x->shape, values));
    free(values);
    return s == RP_OK ? 0 : 1;
}

static int32_t pass_backward(rp_tensor_list *input_grads, rp_tensor_list *param_grads,
                             void *context, const rp_layer_call *call,
                             const DLManagedTensor *const *output_grads, size_t n_outputs,
                             void *user_data) {
    (void)param_grads, (void)context, (void)call, (void)n_outputs, (void)user_data;
    return pass_forward(input_grads, NULL, call, output_grads, 1, NULL);
}

/* Four pass-through layers between two linear layers; `bytes` < 0: no declaration. */
static rp_model *caller_model(double bytes) {
    rp_layer_def *defs[4];
    for (int i = 0; i < 4; ++i) {
        TS_OK(rp_layer_def_create(&defs[i], "c:pass", pass_forward, pass_backward, NULL, NULL));
        if (bytes >= 0)
            TS_OK(rp_layer_def_set_activation_bytes(defs[i], bytes));
    }
    rp_model_options *o = NULL;
    TS_OK(rp_model_options_create(&o));
    TS_OK(rp_model_options_set_devices(o, RP_DEVICE_CPU, 1));
    TS_OK(rp_model_options_set_gpu_memory_cap(o, CAP));
    rp_model *m = NULL;
    TS_OK(rp_model_create_with_layers(&m,
                                      "{\"layers\": [{\"type\": \"linear\", \"in\": 8, \"out\": 8},"
                                      "{\"type\": \"caller\", \"def\": 0},"
                                      "{\"type\": \"caller\", \"def\": 1},"
                                      "{\"type\": \"caller\", \"def\": 2},"
                                      "{\"type\": \"caller\", \"def\": 3},"
                                      "{\"type\": \"linear\", \"in\": 8, \"out\": 8}]}",
                                      (const rp_layer_def *const *)defs, 4, o));
    rp_model_options_destroy(o);
    for (int i = 0; i < 4; ++i)
        rp_layer_def_destroy(defs[i]);
    return m;
}

/* 40 rows of 8 floats are 40 tokens. Declared 0.8 MB per token, a pass-through layer keeps 32 MB:
 * one with its backward transient (48 MB) fits the 50.3 MB a stage may use, two (80 MB) do not. Undeclared,
 * it is taken as wide as the linear layer before it (128 bytes per token): one plan of two. */
static void caller_layers_declare_their_activation_bytes(void **state) {
    (void)state;
    rp_model *declared = caller_model(0.8e6), *guessed = caller_model(-1);
    int64_t shape[2] = {40, 8};
    float values[320];
    ts_fill_uniform(values, 320, 3, -1.0f, 1.0f);
    DLManagedTensor *x = ts_f32(2, shape, values), *y = ts_f32(2, shape, NULL);
    const DLManagedTensor *inputs[1] = {x};
    rp_loss *mse = NULL;
    TS_OK(rp_loss_create(&mse, RP_LOSS_MSE));
    rp_run_config *one = ts_config(1, RP_GRAIN_STAGE);
    double a = 0, b = 0;
    TS_OK(rp_forward_backward(&a, NULL, declared, inputs, 1, y, mse, one));
    TS_OK(rp_forward_backward(&b, NULL, guessed, inputs, 1, y, mse, one));
    int32_t counts[NUM_LAYERS], n = 0;
    TS_OK(rp_model_stage_plan(counts, &n, NUM_LAYERS, declared));
    assert_true(n >= 4);
    TS_OK(rp_model_stage_plan(counts, &n, NUM_LAYERS, guessed));
    assert_int_equal(n, 2);
    assert_true(a == b); /* the same computation, cut elsewhere */

    rp_layer_def *def = NULL;
    TS_OK(rp_layer_def_create(&def, "c:pass", pass_forward, pass_backward, NULL, NULL));
    TS_ERR(rp_layer_def_set_activation_bytes(def, -1.0), RP_ERR_INVALID_ARGUMENT, "activation");
    TS_ERR(rp_layer_def_set_activation_bytes(def, NAN), RP_ERR_INVALID_ARGUMENT, "activation");
    TS_ERR(rp_layer_def_set_activation_bytes(NULL, 1.0), RP_ERR_INVALID_ARGUMENT, "NULL");
    rp_layer_def_destroy(def);
    rp_run_config_destroy(one);
    rp_loss_destroy(mse);
    ts_free(x);
    ts_free(y);
    rp_model_destroy(declared);
    rp_model_destroy(guessed);
}

/* rp_model_plan_stages, upstream's ModelExecutePlan.auto(model_memory_limit): a decoder layer's
 * weights and gradients are 886,016 bytes in fp32 (110,752 parameters: q 64x64, k and v 64x32,
 * o 64x64, q/k norms 16 each, two norms of 64, MLP 3 x 64x512), so a limit of 1,000,000 bytes
 * gives every decoder layer a stage of its own and 800,000 is under one layer alone. The
 * model's own plan is left as it was. */
static void plan_stages_keeps_each_stage_under_the_limit_and_changes_nothing(void **state) {
    (void)state;
    rp_model *m = model_with_cap(0);
    int32_t before[NUM_LAYERS], counts[NUM_LAYERS], after[NUM_LAYERS];
    const int32_t stages_before = plan_of(m, before);
    int32_t n = 0;
    TS_OK(rp_model_plan_stages(counts, &n, NUM_LAYERS, m, 1000000, 0));
    assert_true(n >= 6 && n <= NUM_LAYERS);
    int covered = 0;
    for (int32_t s = 0; s < n; ++s) {
        assert_true(decoders_in_stage(counts, s) <= 1);
        covered += counts[s];
    }
    assert_int_equal(covered, NUM_LAYERS);
    TS_OK(rp_model_plan_stages(counts, &n, NUM_LAYERS, m, 0, NUM_LAYERS));
    assert_int_equal(n, NUM_LAYERS); /* min_stages: one layer a stage */
    TS_OK(rp_model_plan_stages(counts, &n, NUM_LAYERS, m, 0, 100));
    assert_int_equal(n, NUM_LAYERS); /* capped at one per layer */
    TS_OK(rp_model_plan_stages(NULL, &n, 0, m, 0, 0));
    assert_true(n >= 1);               /* the count alone */
    TS_ERR(rp_model_plan_stages(counts, &n, NUM_LAYERS, m, 800000, 0), RP_ERR_INVALID_ARGUMENT,
           "layer 1 alone");
    TS_ERR(rp_model_plan_stages(counts, &n, NUM_LAYERS, m, -1, 0), RP_ERR_INVALID_ARGUMENT,
           "max_stage_bytes");
    TS_ERR(rp_model_plan_stages(counts, &n, NUM_LAYERS, m, 0, -1), RP_ERR_INVALID_ARGUMENT,
           "min_stages");
    TS_ERR(rp_model_plan_stages(counts, NULL, NUM_LAYERS, m, 0, 0), RP_ERR_INVALID_ARGUMENT,
           "out_num_stages");
    TS_ERR(rp_model_plan_stages(counts, &n, NUM_LAYERS, NULL, 0, 0), RP_ERR_INVALID_ARGUMENT,
           "NULL");
    assert_int_equal(plan_of(m, after), stages_before);
    assert_memory_equal(after, before, sizeof(int32_t) * (size_t)stages_before);
    rp_model_destroy(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(short_sequences_keep_the_plan_weights_alone_give),
        cmocka_unit_test(long_microbatches_under_a_small_cap_get_one_decoder_layer_per_stage),
        cmocka_unit_test(layer_grain_recompute_lets_backward_stages_grow_but_not_the_tail),
        cmocka_unit_test(the_long_sequence_plan_computes_what_the_weights_only_plan_does),
        cmocka_unit_test(caller_layers_declare_their_activation_bytes),
        cmocka_unit_test(plan_stages_keeps_each_stage_under_the_limit_and_changes_nothing),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
