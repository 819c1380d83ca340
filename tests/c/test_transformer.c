/*
 * test_transformer.c - Qwen3 and Llama models through the pipeline against a plain libtorch
 * implementation (reference/transformer_reference.cpp).
 *
 * Tiny models (2 decoder layers, hidden 64, 4 query heads : 2 key-value heads, vocabulary 96),
 * tied and untied, are built from config.json text (rp_model_create_from_hf_config), saved with
 * rp_model_save_hf, and the reference loads that directory with its own readers. Both then
 * compute the logits, the causal-LM loss (mean over the batch's targets) and every gradient,
 * with several microbatch counts, 1-3 CPU devices, both recompute grains, with and without
 * padding masks and position ids. fp32 throughout: relative 1e-4 (norm-based), the accuracy of
 * fp32 after a few hundred accumulated roundings.
 * With RP_TEST_DEVICE=cuda the models run on GPUs (at most the visible number; exit 77, skipped,
 * without one) against the same CPU reference.
 */
#define _GNU_SOURCE
#include "test_support.h"

#include "reference/transformer_reference.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { B = 6, T = 10, V = 96, NUM_LAYERS = 2 };

static const char *QWEN3 =
    "{\"architectures\": [\"Qwen3ForCausalLM\"], \"model_type\": \"qwen3\", \"vocab_size\": 96,"
    " \"hidden_size\": 64, \"intermediate_size\": 80, \"num_hidden_layers\": 2,"
    " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 24,"
    " \"rms_norm_eps\": 1e-6, \"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": "
    "1000000.0}, \"tie_word_embeddings\": false, \"initializer_range\": 0.1,"
    " \"hidden_act\": \"silu\", \"use_sliding_window\": false, \"dtype\": \"float32\"}";

static const char *QWEN3_TIED =
    "{\"architectures\": [\"Qwen3ForCausalLM\"], \"vocab_size\": 96, \"hidden_size\": 64,"
    " \"intermediate_size\": 80, \"num_hidden_layers\": 2, \"num_attention_heads\": 4,"
    " \"num_key_value_heads\": 2, \"head_dim\": 16, \"rms_norm_eps\": 1e-5, \"rope_theta\": "
    "10000, \"tie_word_embeddings\": true, \"initializer_range\": 0.1}";

/* Llama 3.1-style rope scaling, the legacy "rope_scaling" spelling, biases in attention. */
static const char *LLAMA =
    "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 96, \"hidden_size\": 64,"
    " \"intermediate_size\": 80, \"num_hidden_layers\": 2, \"num_attention_heads\": 4,"
    " \"num_key_value_heads\": 2, \"rms_norm_eps\": 1e-5, \"rope_theta\": 500000.0,"
    " \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": 1.0,"
    " \"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 8},"
    " \"attention_bias\": true, \"mlp_bias\": true, \"tie_word_embeddings\": false,"
    " \"initializer_range\": 0.1}";

static const char *LLAMA_TIED =
    "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 96, \"hidden_size\": 64,"
    " \"intermediate_size\": 80, \"num_hidden_layers\": 2, \"num_attention_heads\": 4,"
    " \"num_key_value_heads\": 2, \"tie_word_embeddings\": true, \"initializer_range\": 0.1}";

/* ---- data ------------------------------------------------------------------------------- */

typedef struct batch {
    int64_t ids[B * T], mask[B * T], positions[B * T], labels[B * T];
} batch;

/* Rows of different lengths: right padding, one left-padded row, targets removed on padding and
 * on a "prompt". Position ids count real tokens (left padding starts at 0 on the first one). */
static void make_batch(batch *b, uint64_t seed) {
    static const int len[B] = {10, 7, 10, 3, 8, 10};
    float r[B * T];
    ts_fill_uniform(r, B * T, seed, 0.f, (float)V);
    for (int i = 0; i < B; ++i) {
        int pos = 0;
        for (int t = 0; t < T; ++t) {
            int k = i * T + t;
            b->ids[k] = (int64_t)r[k] % V;
            int real = i == 4 ? t >= T - len[i] : t < len[i];
            b->mask[k] = real;
            b->positions[k] = real ? pos++ : 0;
            b->labels[k] = real ? b->ids[k] : -100;
        }
    }
    b->labels[2 * T + 4] = b->labels[2 * T + 5] = -100;
}

/* ---- models ----------------------------------------------------------------------------- */

static rp_model *hf_model(const char *config, int32_t devices, uint64_t seed) {
    return ts_hf_model_with_options(config, ts_options(seed, devices));
}

/* The reference holding the model's current weights, read back from rp_model_save_hf. */
static ref_lm *reference_of(rp_model *m) {
    char *dir = ts_tempdir();
    TS_OK(rp_model_save_hf(m, dir));
    ref_lm *ref = ref_lm_load(dir);
    if (!ref) {
        print_error("reference: %s\n", ref_lm_last_error());
        fail();
    }
    ts_rmdir(dir);
    free(dir);
    return ref;
}

/* ---- comparisons ------------------------------------------------------------------------ */

typedef struct fb_case {
    int32_t devices, microbatches, grain;
    int32_t n_inputs; /* 1: ids; 2: + mask; 3: + position ids */
} fb_case;

static void make_inputs(DLManagedTensor **in, const batch *b) {
    int64_t shape[2] = {B, T};
    in[0] = ts_i64(2, shape, b->ids);
    in[1] = ts_i64(2, shape, b->mask);
    in[2] = ts_i64(2, shape, b->positions);
}

static void assert_rel(const char *what, const float *got, const float *want, int64_t n,
                       double tol) {
    double e = ts_rel_err(got, want, n, 1e-6);
    if (!(e <= tol)) {
        print_error("%s: relative error %.3g > %.1g\n", what, e, tol);
        fail();
    }
}

static void compare_case(const char *config, const fb_case *c) {
    rp_model *m = hf_model(config, c->devices, 11);
    ref_lm *ref = reference_of(m);
    batch b;
    make_batch(&b, 5);
    /* Without a mask the batch has no padding: every token is real. */
    batch *use = &b;
    batch full = b;
    if (c->n_inputs == 1)
        for (int k = 0; k < B * T; ++k) {
            full.mask[k] = 1;
            full.positions[k] = k % T;
            full.labels[k] = full.ids[k];
        }
    if (c->n_inputs == 1)
        use = &full;
    DLManagedTensor *in[3];
    make_inputs(in, use);
    int64_t shape[2] = {B, T};
    DLManagedTensor *lab = ts_i64(2, shape, use->labels);
    rp_run_config *cfg = ts_config(c->microbatches, c->grain);
    rp_loss *loss = NULL;
    TS_OK(rp_loss_create(&loss, RP_LOSS_CAUSAL_LM));

    double got = 0, want = 0;
    const DLManagedTensor *inputs[3] = {in[0], in[1], in[2]};
    TS_OK(rp_forward_backward(&got, NULL, m, inputs, (size_t)c->n_inputs, lab, loss, cfg));
    static float want_logits[B * T * V], got_logits[B * T * V];
    const int64_t *mask = c->n_inputs >= 2 ? use->mask : NULL;
    const int64_t *pos = c->n_inputs >= 3 ? use->positions : NULL;
    if (ref_lm_run(ref, use->ids, mask, pos, use->labels, B, T, want_logits, &want) != 0) {
        print_error("reference: %s\n", ref_lm_last_error());
        fail();
    }
    if (!(fabs(got - want) <= 1e-4 * fabs(want))) {
        print_error("loss %.9g, reference %.9g\n", got, want);
        fail();
    }

    ts_params *g = ts_grads(m);
    for (size_t i = 0; i < g->count; ++i) {
        char name[256];
        ts_hf_name(name, sizeof name, g->names[i], NUM_LAYERS);
        assert_int_equal(ref_lm_numel(ref, name), g->numel[i]);
        float *rg = malloc(sizeof(float) * (size_t)g->numel[i]);
        assert_int_equal(ref_lm_grad(ref, name, rg, g->numel[i]), 0);
        char what[320];
        snprintf(what, sizeof what, "gradient of %s (%s)", g->names[i], name);
        assert_rel(what, g->data[i], rg, g->numel[i], 1e-4);
        free(rg);
    }

    rp_tensor_list *outs = NULL;
    TS_OK(rp_forward(&outs, m, inputs, (size_t)c->n_inputs, cfg));
    DLManagedTensor *o = NULL;
    TS_OK(rp_tensor_list_get(&o, outs, 0));
    assert_int_equal(o->dl_tensor.ndim, 3);
    assert_int_equal(o->dl_tensor.shape[2], V);
    ts_read_f32(&o->dl_tensor, got_logits);
    assert_rel("logits", got_logits, want_logits, B * T * V, 1e-4);

    ts_free(o);
    rp_tensor_list_destroy(outs);
    ts_params_free(g);
    rp_loss_destroy(loss);
    rp_run_config_destroy(cfg);
    ts_free(lab);
    for (int i = 0; i < 3; ++i)
        ts_free(in[i]);
    ref_lm_destroy(ref);
    rp_model_destroy(m);
}

static const fb_case CASES[] = {
    {1, 1, RP_GRAIN_STAGE, 1}, {2, 2, RP_GRAIN_LAYER, 2}, {3, 3, RP_GRAIN_STAGE, 3},
    {2, 6, RP_GRAIN_LAYER, 3}, {3, 2, RP_GRAIN_LAYER, 1},
};

static void run_cases(const char *config) {
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; ++i) {
        print_message("  devices %d, microbatches %d, grain %d, inputs %d\n", CASES[i].devices,
                      CASES[i].microbatches, CASES[i].grain, CASES[i].n_inputs);
        compare_case(config, &CASES[i]);
    }
}

static void qwen3_logits_loss_and_grads_match_reference(void **state) {
    (void)state;
    run_cases(QWEN3);
}
static void qwen3_tied_logits_loss_and_grads_match_reference(void **state) {
    (void)state;
    run_cases(QWEN3_TIED);
}
static void llama_with_llama3_rope_and_biases_matches_reference(void **state) {
    (void)state;
    run_cases(LLAMA);
}
static void llama_tied_logits_loss_and_grads_match_reference(void **state) {
    (void)state;
    run_cases(LLAMA_TIED);
}

/* The tied head shares the embedding: one parameter fewer, one master, gradient of both uses. */
static void tied_model_has_one_shared_embedding_parameter(void **state) {
    (void)state;
    rp_model *tied = hf_model(QWEN3_TIED, 1, 1), *untied = hf_model(QWEN3, 1, 1);
    size_t nt = 0, nu = 0;
    TS_OK(rp_param_count(&nt, tied));
    TS_OK(rp_param_count(&nu, untied));
    assert_int_equal(nt + 1, nu);
    size_t idx = 0;
    TS_OK(rp_param_find(&idx, untied, "4.weight")); /* the untied head */
    TS_ERR(rp_param_find(&idx, tied, "4.weight"), RP_ERR_INVALID_ARGUMENT, "4.weight");
    rp_model_destroy(tied);
    rp_model_destroy(untied);
}

/* The loss is the mean over the whole call's targets: the same number for any microbatch
 * count, and RP_LOSS_OUTPUT returns the summed token losses instead. */
static void causal_lm_loss_is_batch_mean_and_output_loss_is_the_sum(void **state) {
    (void)state;
    batch b;
    make_batch(&b, 9);
    DLManagedTensor *in[3];
    make_inputs(in, &b);
    int64_t shape[2] = {B, T};
    DLManagedTensor *lab = ts_i64(2, shape, b.labels);
    const DLManagedTensor *inputs[2] = {in[0], in[1]};
    int targets = 0;
    for (int i = 0; i < B; ++i)
        for (int t = 1; t < T; ++t)
            targets += b.labels[i * T + t] != -100;
    double loss1 = 0, loss6 = 0, sum = 0;
    rp_loss *lm = NULL, *out = NULL;
    TS_OK(rp_loss_create(&lm, RP_LOSS_CAUSAL_LM));
    TS_OK(rp_loss_create(&out, RP_LOSS_OUTPUT));
    rp_model *m = hf_model(LLAMA, 2, 3);
    rp_run_config *c1 = ts_config(1, 0), *c6 = ts_config(6, 0);
    TS_OK(rp_forward_backward(&loss1, NULL, m, inputs, 2, lab, lm, c1));
    TS_OK(rp_forward_backward(&loss6, NULL, m, inputs, 2, lab, lm, c6));
    TS_OK(rp_forward_backward(&sum, NULL, m, inputs, 2, lab, out, c6));
    assert_true(fabs(loss1 - loss6) <= 1e-5 * fabs(loss1));
    assert_true(fabs(sum - loss1 * targets) <= 1e-5 * fabs(sum));

    /* No target at all: the loss is 0 and so are the gradients. */
    int64_t none[B * T];
    for (int k = 0; k < B * T; ++k)
        none[k] = -100;
    DLManagedTensor *lab_none = ts_i64(2, shape, none);
    TS_OK(rp_zero_grad(m));
    double zero = 1;
    TS_OK(rp_forward_backward(&zero, NULL, m, inputs, 2, lab_none, lm, c6));
    assert_true(zero == 0.0);
    ts_params *g = ts_grads(m);
    for (size_t i = 0; i < g->count; ++i)
        for (int64_t k = 0; k < g->numel[i]; ++k)
            assert_true(g->data[i][k] == 0.0f);
    ts_params_free(g);
    ts_free(lab_none);
    rp_run_config_destroy(c1);
    rp_run_config_destroy(c6);
    rp_loss_destroy(lm);
    rp_loss_destroy(out);
    rp_model_destroy(m);
    ts_free(lab);
    for (int i = 0; i < 3; ++i)
        ts_free(in[i]);
}

/* The loss computed a few tokens at a time (chunk_tokens 7 of 60, a ragged last chunk), in a
 * model written as a JSON spec, matches the reference like the unchunked head. */
static void spec_model_with_small_loss_chunks_matches_reference(void **state) {
    (void)state;
    static const char *SPEC =
        "{\"layers\": ["
        "{\"type\": \"token_embedding\", \"num\": 96, \"dim\": 64},"
        "{\"type\": \"decoder_layer\", \"dim\": 64, \"heads\": 4, \"kv_heads\": 2, \"hidden\": 80,"
        " \"eps\": 1e-5, \"rope_theta\": 500000.0, \"rope_type\": \"llama3\", \"rope_factor\": 8.0,"
        " \"rope_low_freq_factor\": 1.0, \"rope_high_freq_factor\": 4.0,"
        " \"rope_original_max_positions\": 8, \"attention_bias\": true, \"mlp_bias\": true},"
        "{\"type\": \"decoder_layer\", \"dim\": 64, \"heads\": 4, \"kv_heads\": 2, \"hidden\": 80,"
        " \"eps\": 1e-5, \"rope_theta\": 500000.0, \"rope_type\": \"llama3\", \"rope_factor\": 8.0,"
        " \"rope_low_freq_factor\": 1.0, \"rope_high_freq_factor\": 4.0,"
        " \"rope_original_max_positions\": 8, \"attention_bias\": true, \"mlp_bias\": true},"
        "{\"type\": \"rms_norm\", \"dim\": 64, \"eps\": 1e-5},"
        "{\"type\": \"lm_head\", \"dim\": 64, \"vocab\": 96, \"chunk_tokens\": 7}]}";
    rp_model *hf = hf_model(LLAMA, 1, 21);
    ref_lm *ref = reference_of(hf);
    char *dir = ts_tempdir();
    char path[4096];
    snprintf(path, sizeof path, "%s/w.safetensors", dir);
    TS_OK(rp_model_save(hf, path)); /* same layers, so the same parameter names */
    rp_model *m = ts_model(SPEC, 0, 2, NULL, 0);
    TS_OK(rp_model_load(m, path));

    batch b;
    make_batch(&b, 13);
    DLManagedTensor *in[3];
    make_inputs(in, &b);
    int64_t shape[2] = {B, T};
    DLManagedTensor *lab = ts_i64(2, shape, b.labels);
    const DLManagedTensor *inputs[3] = {in[0], in[1], in[2]};
    rp_loss *loss = NULL;
    TS_OK(rp_loss_create(&loss, RP_LOSS_CAUSAL_LM));
    rp_run_config *cfg = ts_config(1, 0);
    double got = 0, want = 0;
    TS_OK(rp_forward_backward(&got, NULL, m, inputs, 3, lab, loss, cfg));
    assert_int_equal(ref_lm_run(ref, b.ids, b.mask, b.positions, b.labels, B, T, NULL, &want), 0);
    assert_true(fabs(got - want) <= 1e-4 * fabs(want));
    ts_params *g = ts_grads(m);
    for (size_t i = 0; i < g->count; ++i) {
        char name[256];
        ts_hf_name(name, sizeof name, g->names[i], NUM_LAYERS);
        float *rg = malloc(sizeof(float) * (size_t)g->numel[i]);
        assert_int_equal(ref_lm_grad(ref, name, rg, g->numel[i]), 0);
        assert_rel(name, g->data[i], rg, g->numel[i], 1e-4);
        free(rg);
    }
    ts_params_free(g);
    rp_run_config_destroy(cfg);
    rp_loss_destroy(loss);
    ts_free(lab);
    for (int i = 0; i < 3; ++i)
        ts_free(in[i]);
    rp_model_destroy(m);
    rp_model_destroy(hf);
    ref_lm_destroy(ref);
    ts_rmdir(dir);
    free(dir);
}

/* Training from C: a few AdamW steps on a repeated sequence lower the loss. */
static void a_few_adamw_steps_lower_the_loss(void **state) {
    (void)state;
    rp_model *m = hf_model(QWEN3_TIED, 2, 4);
    batch b;
    make_batch(&b, 17);
    DLManagedTensor *in[3];
    make_inputs(in, &b);
    int64_t shape[2] = {B, T};
    DLManagedTensor *lab = ts_i64(2, shape, b.labels);
    const DLManagedTensor *inputs[2] = {in[0], in[1]};
    rp_loss *loss = NULL;
    TS_OK(rp_loss_create(&loss, RP_LOSS_CAUSAL_LM));
    rp_optimizer *opt = NULL;
    TS_OK(rp_optimizer_create(&opt, RP_OPTIMIZER_ADAMW));
    TS_OK(rp_optimizer_set_learning_rate(opt, 3e-3));
    double first = 0, last = 0;
    for (int it = 0; it < 8; ++it) {
        double l = 0;
        TS_OK(rp_forward_backward(&l, NULL, m, inputs, 2, lab, loss, NULL));
        TS_OK(rp_step(m, opt, 1));
        if (it == 0)
            first = l;
        last = l;
    }
    TS_OK(rp_synchronize(m));
    assert_true(last < 0.9 * first);
    rp_optimizer_destroy(opt);
    rp_loss_destroy(loss);
    ts_free(lab);
    for (int i = 0; i < 3; ++i)
        ts_free(in[i]);
    rp_model_destroy(m);
}

int main(void) {
    if (ts_gpu_missing())
        return 77;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(qwen3_logits_loss_and_grads_match_reference),
        cmocka_unit_test(qwen3_tied_logits_loss_and_grads_match_reference),
        cmocka_unit_test(llama_with_llama3_rope_and_biases_matches_reference),
        cmocka_unit_test(llama_tied_logits_loss_and_grads_match_reference),
        cmocka_unit_test(tied_model_has_one_shared_embedding_parameter),
        cmocka_unit_test(causal_lm_loss_is_batch_mean_and_output_loss_is_the_sum),
        cmocka_unit_test(spec_model_with_small_loss_chunks_matches_reference),
        cmocka_unit_test(a_few_adamw_steps_lower_the_loss),
    };
    return cmocka_run_group_tests_name("transformer", tests, NULL, NULL);
}
