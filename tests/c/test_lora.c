/*
 * test_lora.c - LoRA adapters on Hugging Face models (rp_model_options_set_lora) against the
 * plain libtorch reference (reference/transformer_reference.cpp), which reads the base model
 * with its own readers and the adapters from the PEFT directory rp_model_save_lora writes.
 *
 * Each case: a tiny base model is saved as a Hugging Face directory; a LoRA model is built from
 * it, its B matrices made random (PEFT starts them at zero, which would leave A without a
 * gradient), and its adapters saved; the reference loads base + adapters. Then logits, loss and
 * adapter gradients of padded batches over several microbatches and CPU devices, and 10 AdamW
 * steps, must agree. fp32 throughout: relative 1e-4 (norm-based), as the full-model tests.
 * Frozen weights must stay bit-identical; save / load / merge round trips and bad adapter files
 * are checked too. With RP_TEST_DEVICE=cuda the models run on GPUs against the same reference.
 */
#define _GNU_SOURCE
#include "test_support.h"

#include "reference/transformer_reference.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { B = 4, T = 9, V = 80, STEPS = 10 };

static const char *QWEN3 =
    "{\"architectures\": [\"Qwen3ForCausalLM\"], \"vocab_size\": 80, \"hidden_size\": 48,"
    " \"intermediate_size\": 72, \"num_hidden_layers\": 2, \"num_attention_heads\": 4,"
    " \"num_key_value_heads\": 2, \"head_dim\": 16, \"rms_norm_eps\": 1e-6, \"rope_theta\": "
    "10000, \"tie_word_embeddings\": false, \"initializer_range\": 0.1}";

/* Biases in the projections: the adapter adds to x W^T + b. Tied embeddings stay frozen. */
static const char *LLAMA_TIED =
    "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 80, \"hidden_size\": 48,"
    " \"intermediate_size\": 72, \"num_hidden_layers\": 2, \"num_attention_heads\": 4,"
    " \"num_key_value_heads\": 2, \"attention_bias\": true, \"mlp_bias\": true,"
    " \"tie_word_embeddings\": true, \"initializer_range\": 0.1}";

/* ---- fixtures --------------------------------------------------------------------------- */

typedef struct batch {
    int64_t ids[B * T], mask[B * T], positions[B * T], labels[B * T];
} batch;

/* Right padding in two rows; labels follow the real tokens. */
static void make_batch(batch *b, uint64_t seed) {
    static const int len[B] = {9, 6, 9, 4};
    float r[B * T];
    ts_fill_uniform(r, B * T, seed, 0.f, (float)V);
    for (int i = 0; i < B; ++i)
        for (int t = 0; t < T; ++t) {
            const int k = i * T + t, real = t < len[i];
            b->ids[k] = (int64_t)r[k] % V;
            b->mask[k] = real;
            b->positions[k] = real ? t : 0;
            b->labels[k] = real ? b->ids[k] : -100;
        }
}

static rp_model_options *options(int32_t rank, double alpha, double dropout, const char *targets,
                                 int32_t devices) {
    rp_model_options *opts = NULL;
    TS_OK(rp_model_options_create(&opts));
    TS_OK(rp_model_options_set_seed(opts, 3));
    TS_OK(rp_model_options_set_devices(opts, ts_device_kind(), ts_devices(devices)));
    if (rank > 0)
        TS_OK(rp_model_options_set_lora(opts, rank, alpha, dropout, targets));
    return opts;
}

/* A base model's Hugging Face directory (random weights). Caller frees and removes it. */
static char *base_dir(const char *config) {
    rp_model_options *opts = options(0, 0, 0, NULL, 1);
    rp_model *m = NULL;
    TS_OK(rp_model_create_from_hf_config(&m, config, opts));
    char *dir = ts_tempdir();
    TS_OK(rp_model_save_hf(m, dir));
    rp_model_destroy(m);
    rp_model_options_destroy(opts);
    return dir;
}

static rp_model *lora_model(const char *dir, int32_t rank, double alpha, double dropout,
                            const char *targets, int32_t devices) {
    rp_model_options *opts = options(rank, alpha, dropout, targets, devices);
    rp_model *m = NULL;
    TS_OK(rp_model_create_from_hf(&m, dir, opts));
    rp_model_options_destroy(opts);
    return m;
}

static int is_adapter(const rp_model *m, size_t i) {
    int32_t kind = -1;
    TS_OK(rp_param_kind_of(&kind, m, i));
    return kind == RP_PARAM_TRAINABLE;
}

static const char *hf_name(const rp_model *m, size_t i) {
    const char *name = NULL;
    TS_OK(rp_param_hf_name(&name, m, i));
    return name;
}

/* B of every adapter random (uniform +-0.2), so that A has a gradient from the first call. */
static void randomize_b(rp_model *m, uint64_t seed) {
    size_t count = 0;
    TS_OK(rp_param_count(&count, m));
    for (size_t i = 0; i < count; ++i) {
        if (!strstr(hf_name(m, i), ".lora_B."))
            continue;
        int64_t shape[2];
        int32_t nd = 0;
        TS_OK(rp_param_shape(shape, &nd, 2, m, i));
        float *v = malloc(sizeof(float) * (size_t)(shape[0] * shape[1]));
        ts_fill_uniform(v, shape[0] * shape[1], seed + i, -0.2f, 0.2f);
        ts_set_master(m, i, v, shape[0] * shape[1]);
        free(v);
    }
}

/* The reference: the base directory plus the model's current adapters. */
static ref_lm *reference_of(const char *base, rp_model *m) {
    char *adapter = ts_tempdir();
    TS_OK(rp_model_save_lora(m, adapter, base));
    ref_lm *ref = ref_lm_load(base);
    if (!ref || ref_lm_load_adapter(ref, adapter) != 0) {
        print_error("reference: %s\n", ref_lm_last_error());
        fail();
    }
    ts_rmdir(adapter);
    free(adapter);
    return ref;
}

static void assert_rel(const char *what, const float *got, const float *want, int64_t n,
                       double tol) {
    const double e = ts_rel_err(got, want, n, 1e-6);
    if (!(e <= tol)) {
        print_error("%s: relative error %.3g > %.1g\n", what, e, tol);
        fail();
    }
}

static void read_param(rp_model *m, size_t i, int grad, float **out, int64_t *numel) {
    DLManagedTensor *t = NULL;
    TS_OK(grad ? rp_param_grad(&t, m, i) : rp_param_master(&t, m, i));
    *numel = ts_numel(&t->dl_tensor);
    *out = malloc(sizeof(float) * (size_t)(*numel ? *numel : 1));
    ts_read_f32(&t->dl_tensor, *out);
    ts_free(t);
}

/* Every adapter's gradient (or weight) against the reference's. */
static void assert_adapters_match(rp_model *m, ref_lm *ref, int grad, double tol) {
    TS_OK(rp_synchronize(m));
    size_t count = 0, adapters = 0;
    TS_OK(rp_param_count(&count, m));
    for (size_t i = 0; i < count; ++i) {
        if (!is_adapter(m, i))
            continue;
        ++adapters;
        float *got = NULL;
        int64_t n = 0;
        read_param(m, i, grad, &got, &n);
        const char *name = hf_name(m, i);
        assert_int_equal(ref_lm_numel(ref, name), n);
        float *want = malloc(sizeof(float) * (size_t)n);
        assert_int_equal(grad ? ref_lm_grad(ref, name, want, n) : ref_lm_weight(ref, name, want, n),
                         0);
        char what[320];
        snprintf(what, sizeof what, "%s of %s", grad ? "gradient" : "weight", name);
        assert_rel(what, got, want, n, tol);
        free(got);
        free(want);
    }
    assert_true(adapters > 0);
}

typedef struct call {
    DLManagedTensor *in[3], *labels;
    rp_run_config *config;
    rp_loss *loss;
} call;

static void call_init(call *c, const batch *b, int32_t microbatches, int32_t grain) {
    int64_t shape[2] = {B, T};
    c->in[0] = ts_i64(2, shape, b->ids);
    c->in[1] = ts_i64(2, shape, b->mask);
    c->in[2] = ts_i64(2, shape, b->positions);
    c->labels = ts_i64(2, shape, b->labels);
    c->config = ts_config(microbatches, grain);
    TS_OK(rp_loss_create(&c->loss, RP_LOSS_CAUSAL_LM));
}

static void call_free(call *c) {
    for (int i = 0; i < 3; ++i)
        ts_free(c->in[i]);
    ts_free(c->labels);
    rp_run_config_destroy(c->config);
    rp_loss_destroy(c->loss);
}

static double train_call(rp_model *m, const call *c) {
    double loss = 0;
    const DLManagedTensor *inputs[3] = {c->in[0], c->in[1], c->in[2]};
    TS_OK(rp_forward_backward(&loss, NULL, m, inputs, 3, c->labels, c->loss, c->config));
    return loss;
}

/* One built-in AdamW step (PyTorch's defaults but the learning rate). */
static void adamw_step(rp_model *m, double lr, int32_t is_async) {
    rp_optimizer *adamw = NULL;
    TS_OK(rp_optimizer_create(&adamw, RP_OPTIMIZER_ADAMW));
    TS_OK(rp_optimizer_set_learning_rate(adamw, lr));
    TS_OK(rp_step(m, adamw, is_async));
    rp_optimizer_destroy(adamw);
}

static void logits_of(rp_model *m, const call *c, float *out) {
    const DLManagedTensor *inputs[3] = {c->in[0], c->in[1], c->in[2]};
    rp_tensor_list *outs = NULL;
    TS_OK(rp_forward(&outs, m, inputs, 3, c->config));
    DLManagedTensor *t = NULL;
    TS_OK(rp_tensor_list_get(&t, outs, 0));
    assert_int_equal(ts_numel(&t->dl_tensor), B * T * V);
    ts_read_f32(&t->dl_tensor, out);
    ts_free(t);
    rp_tensor_list_destroy(outs);
}

/* Snapshot of the frozen parameters' values, to prove training leaves them bit for bit. */
static ts_params *frozen_snapshot(rp_model *m) {
    ts_params *all = ts_masters(m);
    size_t kept = 0;
    for (size_t i = 0; i < all->count; ++i) {
        if (is_adapter(m, i)) {
            free(all->names[i]);
            free(all->data[i]);
            continue;
        }
        all->names[kept] = all->names[i];
        all->data[kept] = all->data[i];
        all->numel[kept] = all->numel[i];
        ++kept;
    }
    all->count = kept;
    return all;
}

/* ---- equality with the reference ----------------------------------------------------------- */

static void matches_reference(const char *config, const char *targets, int32_t devices,
                              int32_t microbatches, int32_t grain) {
    char *base = base_dir(config);
    rp_model *m = lora_model(base, 4, 8.0, 0.0, targets, devices);
    randomize_b(m, 17);
    ref_lm *ref = reference_of(base, m);
    ts_params *frozen = frozen_snapshot(m);
    batch b;
    make_batch(&b, 5);
    call c;
    call_init(&c, &b, microbatches, grain);

    static float got_logits[B * T * V], want_logits[B * T * V];
    logits_of(m, &c, got_logits);
    double want = 0;
    for (int step = 0; step < STEPS; ++step) {
        const double got = train_call(m, &c);
        if (ref_lm_run(ref, b.ids, b.mask, b.positions, b.labels, B, T,
                       step == 0 ? want_logits : NULL, &want) != 0) {
            print_error("reference: %s\n", ref_lm_last_error());
            fail();
        }
        if (step == 0) {
            assert_rel("logits", got_logits, want_logits, B * T * V, 1e-4);
            assert_adapters_match(m, ref, 1, 1e-4);
        }
        if (!(fabs(got - want) <= 1e-4 * fabs(want))) {
            print_error("step %d: loss %.9g, reference %.9g\n", step, got, want);
            fail();
        }
        adamw_step(m, 1e-2, /*is_async=*/0);
        assert_int_equal(ref_lm_step_adamw(ref, 1e-2, 0.9, 0.999, 1e-8, 1e-2), 0);
    }
    assert_adapters_match(m, ref, 0, 1e-4);
    /* Frozen: no gradient to ask for, and every value as it was, bit for bit. */
    size_t count = 0;
    TS_OK(rp_param_count(&count, m));
    for (size_t i = 0; i < count; ++i)
        if (!is_adapter(m, i)) {
            DLManagedTensor *g = NULL;
            TS_ERR(rp_param_grad(&g, m, i), RP_ERR_INVALID_ARGUMENT, "frozen");
            break;
        }
    ts_params *after = frozen_snapshot(m);
    ts_assert_params_equal(after, frozen);

    ts_params_free(after);
    ts_params_free(frozen);
    call_free(&c);
    ref_lm_destroy(ref);
    rp_model_destroy(m);
    ts_rmdir(base);
    free(base);
}

static void qwen3_all_linear_matches_reference(void **state) {
    (void)state;
    matches_reference(QWEN3, "all-linear", 2, 3, RP_GRAIN_STAGE);
}

static void llama_tied_some_targets_match_reference(void **state) {
    (void)state;
    matches_reference(LLAMA_TIED, "q_proj, v_proj,down_proj", 3, 2, RP_GRAIN_LAYER);
}

/* ---- save, load, merge --------------------------------------------------------------------- */

static void saved_adapters_reload_and_merged_weights_load_as_a_plain_model(void **state) {
    (void)state;
    char *base = base_dir(QWEN3);
    rp_model *m = lora_model(base, 8, 16.0, 0.0, "q_proj,o_proj,up_proj", 2);
    randomize_b(m, 29);
    batch b;
    make_batch(&b, 7);
    call c;
    call_init(&c, &b, 2, 0);
    train_call(m, &c);
    adamw_step(m, 1e-3, /*is_async=*/1);
    static float trained[B * T * V], reloaded[B * T * V], merged[B * T * V];
    TS_OK(rp_synchronize(m));
    logits_of(m, &c, trained);

    int32_t rank = 0;
    double alpha = 0, dropout = 1;
    const char *targets = NULL;
    TS_OK(rp_model_lora(&rank, &alpha, &dropout, &targets, m));
    assert_int_equal(rank, 8);
    assert_true(alpha == 16.0 && dropout == 0.0);
    assert_string_equal(targets, "q_proj,o_proj,up_proj");

    /* The adapters alone, into a fresh model of the same base: the same logits. */
    char *adapter = ts_tempdir();
    TS_OK(rp_model_save_lora(m, adapter, NULL));
    rp_model *fresh = lora_model(base, 8, 16.0, 0.1, "up_proj,q_proj,o_proj", 2);
    TS_OK(rp_model_load_lora(fresh, adapter));
    logits_of(fresh, &c, reloaded);
    assert_rel("logits after rp_model_load_lora", reloaded, trained, B * T * V, 1e-6);

    /* Merged: a plain Hugging Face directory that a model without adapters, and the
     * reference, read as the same function. */
    char *out = ts_tempdir();
    TS_OK(rp_model_save_hf(m, out));
    rp_model_options *plain = options(0, 0, 0, NULL, 2);
    rp_model *merged_model = NULL;
    TS_OK(rp_model_create_from_hf(&merged_model, out, plain));
    logits_of(merged_model, &c, merged);
    assert_rel("logits of the merged model", merged, trained, B * T * V, 1e-5);
    ref_lm *ref = ref_lm_load(out);
    assert_non_null(ref);
    assert_int_equal(ref_lm_run(ref, b.ids, b.mask, b.positions, NULL, B, T, merged, NULL), 0);
    assert_rel("reference logits of the merged directory", merged, trained, B * T * V, 1e-4);

    ref_lm_destroy(ref);
    rp_model_destroy(merged_model);
    rp_model_options_destroy(plain);
    rp_model_destroy(fresh);
    call_free(&c);
    rp_model_destroy(m);
    ts_rmdir(out);
    ts_rmdir(adapter);
    ts_rmdir(base);
    free(out);
    free(adapter);
    free(base);
}

/* ---- dropout ------------------------------------------------------------------------------ */

static void adapter_grads(rp_model *m, const call *c, ts_params **out) {
    TS_OK(rp_zero_grad(m));
    train_call(m, c);
    ts_params *all = ts_masters(m); /* names and sizes; data replaced by gradients below */
    size_t kept = 0;
    for (size_t i = 0; i < all->count; ++i) {
        free(all->data[i]);
        if (!is_adapter(m, i)) {
            free(all->names[i]);
            continue;
        }
        all->names[kept] = all->names[i];
        read_param(m, i, 1, &all->data[kept], &all->numel[kept]);
        ++kept;
    }
    all->count = kept;
    *out = all;
}

/* Masks come from the model seed and the call's coordinates: the same on every run and in the
 * recompute of backward, so two equal models on the stage and the layer grains (different
 * recompute schedules) give the same gradients; and they do change the gradients. */
static void dropout_is_replayed_exactly_by_the_recompute(void **state) {
    (void)state;
    char *base = base_dir(QWEN3);
    batch b;
    make_batch(&b, 9);
    call stage, layer;
    call_init(&stage, &b, 2, RP_GRAIN_STAGE);
    call_init(&layer, &b, 2, RP_GRAIN_LAYER);
    rp_model *m = lora_model(base, 4, 8.0, 0.3, "all-linear", 2);
    rp_model *twin = lora_model(base, 4, 8.0, 0.3, "all-linear", 2);
    rp_model *none = lora_model(base, 4, 8.0, 0.0, "all-linear", 2);
    randomize_b(m, 41);
    randomize_b(twin, 41);
    randomize_b(none, 41);
    ts_params *g_stage = NULL, *g_layer = NULL, *g_again = NULL, *g_none = NULL;
    adapter_grads(m, &stage, &g_stage);
    adapter_grads(twin, &layer, &g_layer);
    adapter_grads(none, &stage, &g_none);
    ts_assert_params_close(g_layer, g_stage, 1e-5, "gradients of the two grains under dropout");
    /* The next call draws new masks (the call index is part of the seed). */
    adapter_grads(m, &stage, &g_again);
    double differ = 0, differ_again = 0;
    for (size_t i = 0; i < g_stage->count; ++i) {
        const int64_t n = g_stage->numel[i];
        differ = fmax(differ, ts_rel_err(g_stage->data[i], g_none->data[i], n, 1e-6));
        differ_again = fmax(differ_again, ts_rel_err(g_stage->data[i], g_again->data[i], n, 1e-6));
    }
    assert_true(differ > 1e-2);
    assert_true(differ_again > 1e-2);
    ts_params_free(g_stage);
    ts_params_free(g_layer);
    ts_params_free(g_again);
    ts_params_free(g_none);
    rp_model_destroy(m);
    rp_model_destroy(twin);
    rp_model_destroy(none);
    call_free(&stage);
    call_free(&layer);
    ts_rmdir(base);
    free(base);
}

/* ---- host memory ---------------------------------------------------------------------------- */

/* bf16 model after a built-in step (optimizer state allocated): frozen parameters cost their 2
 * bytes, adapters the full trainable cost (fp32 master 4, two bf16 weight copies 4, two fp32
 * gradients 8, AdamW moments 8: 24 bytes). */
static void frozen_parameters_cost_their_held_bytes(void **state) {
    (void)state;
    rp_model_options *opts = options(4, 8.0, 0.0, "all-linear", 2);
    TS_OK(rp_model_options_set_model_dtype(opts, RP_DTYPE_BF16));
    rp_model *m = NULL;
    TS_OK(rp_model_create_from_hf_config(&m, QWEN3, opts));
    rp_model_options_destroy(opts);
    batch b;
    make_batch(&b, 3);
    call c;
    call_init(&c, &b, 2, 0);
    train_call(m, &c);
    adamw_step(m, 1e-3, /*is_async=*/0);
    int64_t bytes = 0, elements = 0, base = 0, adapters = 0;
    TS_OK(rp_model_host_state_bytes(&bytes, &elements, m));
    size_t count = 0;
    TS_OK(rp_param_count(&count, m));
    for (size_t i = 0; i < count; ++i)
        *(is_adapter(m, i) ? &adapters : &base) += ts_param_numel(m, i);
    assert_int_equal(elements, base + adapters);
    if (!((double)bytes <= 2.1 * (double)base + 24.0 * (double)adapters)) {
        print_error("host state %lld bytes for %lld frozen + %lld adapter elements\n",
                    (long long)bytes, (long long)base, (long long)adapters);
        fail();
    }
    assert_true(bytes >= 2 * base + 24 * adapters); /* what the layout must hold */
    call_free(&c);
    rp_model_destroy(m);
}

/* ---- bad input ------------------------------------------------------------------------------ */

static void bad_lora_options_are_refused_by_name(void **state) {
    (void)state;
    rp_model_options *opts = NULL;
    TS_OK(rp_model_options_create(&opts));
    TS_ERR(rp_model_options_set_lora(opts, -1, 8, 0, NULL), RP_ERR_INVALID_ARGUMENT, "rank");
    TS_ERR(rp_model_options_set_lora(opts, 4, 0, 0, NULL), RP_ERR_INVALID_ARGUMENT, "alpha");
    TS_ERR(rp_model_options_set_lora(opts, 4, NAN, 0, NULL), RP_ERR_INVALID_ARGUMENT, "alpha");
    TS_ERR(rp_model_options_set_lora(opts, 4, 8, 1.0, NULL), RP_ERR_INVALID_ARGUMENT, "dropout");
    TS_ERR(rp_model_options_set_lora(opts, 4, 8, 0, "q_proj,lm_head"), RP_ERR_INVALID_ARGUMENT,
           "lm_head", "q_proj, k_proj|q_proj,k_proj");
    TS_ERR(rp_model_options_set_lora(NULL, 4, 8, 0, NULL), RP_ERR_INVALID_ARGUMENT, "options");
    /* A model built from a spec has no layer with adapters: refused, naming its layer types. */
    TS_OK(rp_model_options_set_lora(opts, 4, 8, 0, NULL));
    rp_model *m = NULL;
    TS_ERR(rp_model_create(&m, "{\"layers\": [{\"type\": \"linear\", \"in\": 4, \"out\": 4}]}",
                           opts),
           RP_ERR_INVALID_ARGUMENT, "linear", "LoRA");
    assert_null(m);
    rp_model_options_destroy(opts);
    /* A model without adapters: no adapters to save or load. */
    rp_model_options *plain = options(0, 0, 0, NULL, 1);
    TS_OK(rp_model_create_from_hf_config(&m, QWEN3, plain));
    rp_model_options_destroy(plain);
    int32_t rank = -1;
    const char *targets = NULL;
    TS_OK(rp_model_lora(&rank, NULL, NULL, &targets, m));
    assert_int_equal(rank, 0);
    assert_string_equal(targets, "");
    char *dir = ts_tempdir();
    TS_ERR(rp_model_save_lora(m, dir, NULL), RP_ERR_INVALID_ARGUMENT, "no LoRA");
    TS_ERR(rp_model_load_lora(m, dir), RP_ERR_INVALID_ARGUMENT, "no LoRA");
    rp_model_destroy(m);
    ts_rmdir(dir);
    free(dir);
}

static void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

/* The adapter file of `m` rewritten with its tensors, tensor `change` given shape [rows, cols]
 * (when >= 0), and optionally one more tensor called `extra`. */
static void rewrite_adapters(const char *src, const char *dst, int change, int64_t rows,
                             int64_t cols, const char *extra, int drop_last) {
    char path[1024];
    snprintf(path, sizeof path, "%s/adapter_model.safetensors", src);
    ref_st *st = ref_st_open(path);
    assert_non_null(st);
    size_t n = ref_st_count(st);
    ref_st_entry *e = calloc(n + 1, sizeof *e);
    int64_t(*shapes)[2] = calloc(n + 1, sizeof *shapes);
    float **values = calloc(n + 1, sizeof *values);
    size_t out = 0;
    for (size_t i = 0; i < n; ++i) {
        if (drop_last && i == n - 1)
            break;
        const char *name = ref_st_name(st, i);
        int32_t nd = ref_st_shape(st, name, shapes[out], 2);
        assert_int_equal(nd, 2);
        const int64_t numel = shapes[out][0] * shapes[out][1];
        values[out] = calloc((size_t)(numel > rows * cols ? numel : rows * cols) + 1, sizeof(float));
        assert_int_equal(ref_st_get_f32(st, name, values[out], numel), 0);
        if ((int)i == change) {
            shapes[out][0] = rows;
            shapes[out][1] = cols;
        }
        e[out] = (ref_st_entry){name, "F32", 2, shapes[out], values[out]};
        ++out;
    }
    if (extra) {
        shapes[out][0] = shapes[out][1] = 2;
        values[out] = calloc(4, sizeof(float));
        e[out] = (ref_st_entry){extra, "F32", 2, shapes[out], values[out]};
        ++out;
    }
    snprintf(path, sizeof path, "%s/adapter_model.safetensors", dst);
    assert_int_equal(ref_st_write(path, e, out), 0);
    for (size_t i = 0; i < out; ++i)
        free(values[i]);
    free(values);
    free(shapes);
    free(e);
    ref_st_close(st);
}

static void copy_config(const char *src, const char *dst, const char *from, const char *to) {
    char path[1024];
    snprintf(path, sizeof path, "%s/adapter_config.json", src);
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    static char text[1 << 16], changed[1 << 16];
    size_t len = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[len] = 0;
    const char *at = from ? strstr(text, from) : NULL;
    if (from)
        assert_non_null(at);
    if (at)
        snprintf(changed, sizeof changed, "%.*s%s%s", (int)(at - text), text, to,
                 at + strlen(from));
    else
        snprintf(changed, sizeof changed, "%s", text);
    snprintf(path, sizeof path, "%s/adapter_config.json", dst);
    write_text(path, changed);
}

/* Each bad adapter directory is refused with a message naming the key or the tensor; the model
 * keeps its weights bit for bit and still trains like the reference. */
static void mismatched_adapter_files_are_refused_by_name(void **state) {
    (void)state;
    char *base = base_dir(QWEN3);
    rp_model *m = lora_model(base, 4, 8.0, 0.0, "q_proj,v_proj", 2);
    randomize_b(m, 53);
    char *good = ts_tempdir(), *bad = ts_tempdir();
    TS_OK(rp_model_save_lora(m, good, base));
    ts_params *before = ts_masters(m);

    /* config.json keys: rank, alpha, targets, DoRA. */
    rewrite_adapters(good, bad, -1, 0, 0, NULL, 0);
    copy_config(good, bad, "\"r\": 4", "\"r\": 8");
    TS_ERR(rp_model_load_lora(m, bad), RP_ERR_INVALID_ARGUMENT, "\"r\"", "adapter_config.json");
    copy_config(good, bad, "\"lora_alpha\": 8.0", "\"lora_alpha\": 16.0");
    TS_ERR(rp_model_load_lora(m, bad), RP_ERR_INVALID_ARGUMENT, "lora_alpha");
    copy_config(good, bad, "\"q_proj\",", "\"k_proj\",");
    TS_ERR(rp_model_load_lora(m, bad), RP_ERR_INVALID_ARGUMENT, "target_modules", "k_proj");
    copy_config(good, bad, "\"use_dora\": false", "\"use_dora\": true");
    TS_ERR(rp_model_load_lora(m, bad), RP_ERR_INVALID_ARGUMENT, "use_dora");
    copy_config(good, bad, "\"LORA\"", "\"IA3\"");
    TS_ERR(rp_model_load_lora(m, bad), RP_ERR_INVALID_ARGUMENT, "peft_type");

    /* Tensors: a wrong shape, an unknown tensor, a missing one. */
    copy_config(good, bad, NULL, NULL);
    rewrite_adapters(good, bad, 1, 5, 4, NULL, 0);
    TS_ERR(rp_model_load_lora(m, bad), RP_ERR_INVALID_ARGUMENT, "base_model.model.model.layers.",
           "shape");
    rewrite_adapters(good, bad, -1, 0, 0,
                     "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight", 0);
    TS_ERR(rp_model_load_lora(m, bad), RP_ERR_INVALID_ARGUMENT, "mlp.up_proj.lora_A.weight",
           "not an adapter");
    rewrite_adapters(good, bad, -1, 0, 0, NULL, 1);
    TS_ERR(rp_model_load_lora(m, bad), RP_ERR_INVALID_ARGUMENT, "missing");
    /* No files at all. */
    char *empty = ts_tempdir();
    TS_ERR(rp_model_load_lora(m, empty), RP_ERR_IO, "adapter_config.json");

    ts_params *after = ts_masters(m);
    ts_assert_params_equal(after, before);
    /* The good directory still loads: the model was left usable. */
    TS_OK(rp_model_load_lora(m, good));

    ts_params_free(after);
    ts_params_free(before);
    rp_model_destroy(m);
    ts_rmdir(empty);
    ts_rmdir(bad);
    ts_rmdir(good);
    ts_rmdir(base);
    free(empty);
    free(bad);
    free(good);
    free(base);
}

int main(void) {
    if (ts_gpu_missing())
        return 77;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(qwen3_all_linear_matches_reference),
        cmocka_unit_test(llama_tied_some_targets_match_reference),
        cmocka_unit_test(saved_adapters_reload_and_merged_weights_load_as_a_plain_model),
        cmocka_unit_test(dropout_is_replayed_exactly_by_the_recompute),
        cmocka_unit_test(frozen_parameters_cost_their_held_bytes),
        cmocka_unit_test(bad_lora_options_are_refused_by_name),
        cmocka_unit_test(mismatched_adapter_files_are_refused_by_name),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
