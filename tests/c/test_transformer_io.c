/*
 * test_transformer_io.c - Hugging Face directories in and out, and the errors around them.
 *
 * Checkpoints are written and read back with the reference's own safetensors code
 * (reference/reference.cpp), so a file that RoundPipe writes is checked by another reader and a
 * file RoundPipe reads was made by another writer. Every failing load must name the file and
 * the tensor and leave the model's weights bitwise unchanged.
 */
#define _GNU_SOURCE
#include "test_support.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *LLAMA_TIED =
    "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 40, \"hidden_size\": 32,"
    " \"intermediate_size\": 48, \"num_hidden_layers\": 2, \"num_attention_heads\": 4,"
    " \"num_key_value_heads\": 2, \"tie_word_embeddings\": true, \"torch_dtype\": \"float32\"}";

/* Layer 0 sparse (4 experts, top-2), layer 1 dense (mlp_only_layers). */
static const char *QWEN3_MOE =
    "{\"architectures\": [\"Qwen3MoeForCausalLM\"], \"vocab_size\": 40, \"hidden_size\": 32,"
    " \"intermediate_size\": 48, \"num_hidden_layers\": 2, \"num_attention_heads\": 4,"
    " \"num_key_value_heads\": 2, \"head_dim\": 8, \"num_experts\": 4,"
    " \"num_experts_per_tok\": 2, \"moe_intermediate_size\": 16, \"mlp_only_layers\": [1],"
    " \"norm_topk_prob\": true, \"output_router_logits\": false, \"dtype\": \"float32\"}";

enum { NUM_LAYERS = 2 };

/* ---- helpers ---------------------------------------------------------------------------- */

static rp_model *hf_model(const char *config, uint64_t seed, int32_t dtype) {
    rp_model_options *opts = ts_options(seed, 2);
    TS_OK(rp_model_options_set_model_dtype(opts, dtype));
    return ts_hf_model_with_options(config, opts);
}

static rp_model *load_dir(const char *dir) {
    rp_model_options *opts = NULL;
    TS_OK(rp_model_options_create(&opts));
    TS_OK(rp_model_options_set_devices(opts, ts_device_kind(), ts_devices(2)));
    rp_model *m = NULL;
    TS_OK(rp_model_create_from_hf(&m, dir, opts));
    rp_model_options_destroy(opts);
    return m;
}

static char *path_in(const char *dir, const char *name) {
    char *p = malloc(4096);
    snprintf(p, 4096, "%s/%s", dir, name);
    return p;
}

static char *read_file(const char *path, long *size) {
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
    buf[n] = '\0';
    fclose(f);
    if (size)
        *size = n;
    return buf;
}

static void write_file(const char *path, const char *data, long n) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(data, 1, (size_t)n, f), (size_t)n);
    fclose(f);
}

static void write_text(const char *dir, const char *name, const char *text) {
    char *p = path_in(dir, name);
    write_file(p, text, (long)strlen(text));
    free(p);
}

/* Shape of parameter `index` of `m`. */
static int32_t shape_of(rp_model *m, size_t index, int64_t *shape) {
    int32_t nd = 0;
    TS_OK(rp_param_shape(shape, &nd, 8, m, index));
    return nd;
}

typedef struct ckpt_opts {
    const char *skip;      /* Hugging Face name left out */
    const char *bad_shape; /* written with its last dimension one short */
    const char *dtype;     /* "F32", "BF16", "F16" */
    const char *extra;     /* an extra tensor name (1 element), NULL for none */
} ckpt_opts;

/* A single-file checkpoint of `m`'s weights written by the reference's writer. */
static void write_ckpt(const char *dir, rp_model *m, const char *config, const ckpt_opts *o) {
    ts_params *w = ts_masters(m);
    ref_st_entry *e = calloc(w->count + 1, sizeof *e);
    char(*names)[256] = calloc(w->count, 256);
    int64_t(*shapes)[8] = calloc(w->count + 1, sizeof *shapes);
    size_t n = 0;
    for (size_t i = 0; i < w->count; ++i) {
        ts_hf_name(names[i], 256, w->names[i], NUM_LAYERS);
        if (o->skip && !strcmp(o->skip, names[i]))
            continue;
        int32_t nd = shape_of(m, i, shapes[n]);
        if (o->bad_shape && !strcmp(o->bad_shape, names[i]))
            shapes[n][nd - 1] -= 1;
        e[n] = (ref_st_entry){names[i], o->dtype, nd, shapes[n], w->data[i]};
        ++n;
    }
    static const float one = 1.f;
    if (o->extra) {
        shapes[n][0] = 1;
        e[n++] = (ref_st_entry){o->extra, "F32", 1, shapes[n - 1], &one};
    }
    char *p = path_in(dir, "model.safetensors");
    assert_int_equal(ref_st_write(p, e, n), 0);
    write_text(dir, "config.json", config);
    free(p);
    free(e);
    free(names);
    free(shapes);
    ts_params_free(w);
}

static const ckpt_opts PLAIN = {NULL, NULL, "F32", NULL};

/* ---- round trips ------------------------------------------------------------------------ */

/* A model saved with rp_model_save_hf into a fresh directory: its model.safetensors path and
 * its config.json text. */
typedef struct saved_dir {
    char *dir, *st_path, *cfg;
} saved_dir;

static void save_to_fresh_dir(saved_dir *s, rp_model *m) {
    s->dir = ts_tempdir();
    TS_OK(rp_model_save_hf(m, s->dir));
    s->st_path = path_in(s->dir, "model.safetensors");
    char *cfg_path = path_in(s->dir, "config.json");
    s->cfg = read_file(cfg_path, NULL);
    free(cfg_path);
}

static void saved_dir_free(saved_dir *s) {
    free(s->cfg);
    free(s->st_path);
    ts_rmdir(s->dir);
    free(s->dir);
}

/* Every parameter of `w` is in `st` under its Hugging Face name with `w`'s values bit for bit,
 * stored as `dtype` (NULL: any). */
static void assert_stored_bitwise(ref_st *st, const ts_params *w, const char *dtype) {
    for (size_t i = 0; i < w->count; ++i) {
        char name[256];
        ts_hf_name(name, sizeof name, w->names[i], NUM_LAYERS);
        if (dtype)
            assert_string_equal(ref_st_dtype(st, name), dtype);
        float *v = malloc(sizeof(float) * (size_t)w->numel[i]);
        assert_int_equal(ref_st_get_f32(st, name, v, w->numel[i]), 0);
        assert_memory_equal(v, w->data[i], sizeof(float) * (size_t)w->numel[i]);
        free(v);
    }
}

static void saved_directory_has_hf_names_config_and_reloads_bitwise(void **state) {
    (void)state;
    const char *configs[2] = {TS_QWEN3_CONFIG, LLAMA_TIED};
    for (int c = 0; c < 2; ++c) {
        rp_model *a = hf_model(configs[c], 7, RP_DTYPE_F32);
        saved_dir s;
        save_to_fresh_dir(&s, a);
        assert_int_equal(ts_dir_entries(s.dir), 2); /* config.json + model.safetensors, no temp */
        ref_st *st = ref_st_open(s.st_path);
        assert_non_null(st);
        ts_params *w = ts_masters(a);
        assert_int_equal(ref_st_count(st), w->count);
        assert_stored_bitwise(st, w, "F32");
        /* Tied: the head is the embedding and is not stored, as transformers saves it. */
        assert_true((ref_st_dtype(st, "lm_head.weight") == NULL) == (c == 1));
        ref_st_close(st);
        assert_true(
            ts_contains(s.cfg, c == 0 ? "\"dtype\": \"float32\"" : "\"torch_dtype\": \"float32\""));
        assert_true(ts_contains(s.cfg, c == 0 ? "Qwen3ForCausalLM" : "LlamaForCausalLM"));
        rp_model *b = load_dir(s.dir);
        ts_params *wb = ts_masters(b);
        ts_assert_params_equal(wb, w);
        ts_params_free(wb);
        ts_params_free(w);
        saved_dir_free(&s);
        rp_model_destroy(a);
        rp_model_destroy(b);
    }
}

static void bf16_model_saves_bf16_tensors_and_a_bf16_config(void **state) {
    (void)state;
    rp_model *a = hf_model(TS_QWEN3_CONFIG, 3, RP_DTYPE_BF16);
    saved_dir s;
    save_to_fresh_dir(&s, a);
    ref_st *st = ref_st_open(s.st_path);
    assert_non_null(st);
    assert_string_equal(ref_st_dtype(st, "model.layers.1.mlp.down_proj.weight"), "BF16");
    ref_st_close(st);
    assert_true(ts_contains(s.cfg, "\"dtype\": \"bfloat16\""));
    /* Loaded into an fp32 model: exactly the bf16 values another reader finds in the file. */
    rp_model *b = load_dir(s.dir);
    ts_params *wb = ts_masters(b);
    st = ref_st_open(s.st_path);
    assert_stored_bitwise(st, wb, NULL);
    ref_st_close(st);
    ts_params_free(wb);
    saved_dir_free(&s);
    rp_model_destroy(a);
    rp_model_destroy(b);
}

/* Three shards in three dtypes, a tied head stored anyway, an index: RoundPipe loads the values
 * the reference reads from the files, and saves back the same shards. */
static void sharded_checkpoint_in_mixed_dtypes_loads_and_saves_in_the_same_shards(void **state) {
    (void)state;
    char *dir = ts_tempdir(), *out = ts_tempdir();
    rp_model *a = hf_model(LLAMA_TIED, 5, RP_DTYPE_F32);
    ts_params *w = ts_masters(a);
    static const char *shard_names[3] = {"model-00001-of-00003.safetensors",
                                         "model-00002-of-00003.safetensors",
                                         "model-00003-of-00003.safetensors"};
    static const char *dtypes[3] = {"F32", "BF16", "F16"};
    ref_st_entry e[3][32];
    size_t n[3] = {0, 0, 0};
    char names[32][256];
    int64_t shapes[33][8];
    char index[8192] = "{\"metadata\": {\"total_size\": 0}, \"weight_map\": {";
    for (size_t i = 0; i < w->count; ++i) {
        ts_hf_name(names[i], 256, w->names[i], NUM_LAYERS);
        int s = (int)(i % 3);
        int32_t nd = shape_of(a, i, shapes[i]);
        e[s][n[s]++] = (ref_st_entry){names[i], dtypes[s], nd, shapes[i], w->data[i]};
        char item[512];
        snprintf(item, sizeof item, "%s\"%s\": \"%s\"", i ? ", " : "", names[i], shard_names[s]);
        strcat(index, item);
    }
    /* A tied checkpoint that still stores the head: accepted, not used. */
    e[2][n[2]++] = (ref_st_entry){"lm_head.weight", "F16", 2, shapes[0], w->data[0]};
    strcat(index, ", \"lm_head.weight\": \"model-00003-of-00003.safetensors\"}}");
    for (int s = 0; s < 3; ++s) {
        char *p = path_in(dir, shard_names[s]);
        assert_int_equal(ref_st_write(p, e[s], n[s]), 0);
        free(p);
    }
    write_text(dir, "model.safetensors.index.json", index);
    write_text(dir, "config.json", LLAMA_TIED);

    rp_model *b = load_dir(dir);
    ts_params *wb = ts_masters(b);
    for (size_t i = 0; i < w->count; ++i) {
        int s = (int)(i % 3);
        char *p = path_in(dir, shard_names[s]);
        ref_st *st = ref_st_open(p);
        float *v = malloc(sizeof(float) * (size_t)w->numel[i]);
        assert_int_equal(ref_st_get_f32(st, names[i], v, w->numel[i]), 0);
        assert_memory_equal(wb->data[i], v, sizeof(float) * (size_t)w->numel[i]);
        free(v);
        ref_st_close(st);
        free(p);
    }
    TS_OK(rp_model_save_hf(b, out));
    assert_int_equal(ts_dir_entries(out), 5); /* three shards, the index, config.json */
    for (int s = 0; s < 3; ++s) {
        char *p = path_in(out, shard_names[s]);
        ref_st *st = ref_st_open(p);
        assert_non_null(st);
        ref_st_close(st);
        free(p);
    }
    char *idx_path = path_in(out, "model.safetensors.index.json");
    char *idx = read_file(idx_path, NULL);
    assert_true(ts_contains(idx, "\"model.layers.1.mlp.up_proj.weight\": \"model-000"));
    assert_false(ts_contains(idx, "lm_head.weight"));
    rp_model *c = load_dir(out);
    ts_params *wc = ts_masters(c);
    ts_assert_params_equal(wc, wb);
    free(idx);
    free(idx_path);
    ts_params_free(wc);
    ts_params_free(wb);
    ts_params_free(w);
    rp_model_destroy(a);
    rp_model_destroy(b);
    rp_model_destroy(c);
    ts_rmdir(dir);
    ts_rmdir(out);
    free(dir);
    free(out);
}

/* ---- errors: named file and tensor, nothing half-loaded ---------------------------------- */

typedef struct fixture {
    rp_model *target;  /* the model loads are tried on */
    ts_params *before; /* its weights */
    rp_model *source;  /* other weights, written into the broken checkpoints */
    char *dir;
} fixture;

static int setup(void **state) {
    static fixture f;
    f.target = hf_model(TS_QWEN3_CONFIG, 1, RP_DTYPE_F32);
    f.before = ts_masters(f.target);
    f.source = hf_model(TS_QWEN3_CONFIG, 2, RP_DTYPE_F32);
    f.dir = ts_tempdir();
    *state = &f;
    return 0;
}

static int teardown(void **state) {
    fixture *f = *state;
    ts_params_free(f->before);
    rp_model_destroy(f->target);
    rp_model_destroy(f->source);
    ts_rmdir(f->dir);
    free(f->dir);
    return 0;
}

static int fresh_dir(void **state) {
    fixture *f = *state;
    ts_rmdir(f->dir);
    mkdir(f->dir, 0700);
    return 0;
}

/* Loading `dir` fails with `status`, into the target and as a new model; the target is unchanged.
 */
#define ASSERT_LOAD_FAILS(f, status, ...)                                                          \
    do {                                                                                           \
        TS_ERR(rp_model_load_hf((f)->target, (f)->dir), status, __VA_ARGS__);                      \
        rp_model *fresh_ = NULL;                                                                   \
        TS_ERR(rp_model_create_from_hf(&fresh_, (f)->dir, NULL), status, __VA_ARGS__);             \
        assert_null(fresh_);                                                                       \
        ts_params *now_ = ts_masters((f)->target);                                                 \
        ts_assert_params_equal(now_, (f)->before);                                                 \
        ts_params_free(now_);                                                                      \
    } while (0)

static void good_checkpoints_load_into_the_target_and_back(void **state) {
    fixture *f = *state;
    char *orig = ts_tempdir();
    TS_OK(rp_model_save_hf(f->target, orig));
    write_ckpt(f->dir, f->source, TS_QWEN3_CONFIG, &PLAIN);
    TS_OK(rp_model_load_hf(f->target, f->dir));
    ts_params *now = ts_masters(f->target), *src = ts_masters(f->source);
    ts_assert_params_equal(now, src);
    ts_params_free(now);
    TS_OK(rp_model_load_hf(f->target, orig));
    now = ts_masters(f->target);
    ts_assert_params_equal(now, f->before);
    ts_params_free(now);
    ts_params_free(src);
    ts_rmdir(orig);
    free(orig);
}

/* A plain checkpoint of the source model in the fixture's directory, for a test to break: its
 * model.safetensors file's path (*path) and bytes (returned, *size of them). */
static char *read_plain_checkpoint(const fixture *f, char **path, long *size) {
    write_ckpt(f->dir, f->source, TS_QWEN3_CONFIG, &PLAIN);
    *path = path_in(f->dir, "model.safetensors");
    return read_file(*path, size);
}

static void corrupt_header_is_an_io_error_naming_the_file(void **state) {
    fixture *f = *state;
    char *p = NULL;
    long n = 0;
    char *buf = read_plain_checkpoint(f, &p, &n);
    memcpy(buf + 8, "#garbage#!", 10);
    write_file(p, buf, n);
    ASSERT_LOAD_FAILS(f, RP_ERR_IO, "model.safetensors", "corrupt");
    free(buf);
    free(p);
}

static void truncated_file_is_an_io_error_naming_file_and_tensor(void **state) {
    fixture *f = *state;
    char *p = NULL;
    long n = 0;
    char *buf = read_plain_checkpoint(f, &p, &n);
    write_file(p, buf, n - 100);
    ASSERT_LOAD_FAILS(f, RP_ERR_IO, "model.safetensors", "tensor \"", "truncated");
    write_file(p, buf, 5); /* not even a header length */
    ASSERT_LOAD_FAILS(f, RP_ERR_IO, "model.safetensors", "truncated");
    free(buf);
    free(p);
}

static void wrong_shape_is_an_io_error_naming_file_and_tensor(void **state) {
    fixture *f = *state;
    ckpt_opts o = {NULL, "model.layers.1.mlp.up_proj.weight", "F32", NULL};
    write_ckpt(f->dir, f->source, TS_QWEN3_CONFIG, &o);
    ASSERT_LOAD_FAILS(f, RP_ERR_IO, "model.safetensors", "model.layers.1.mlp.up_proj.weight",
                      "shape [48, 31]", "expects [48, 32]");
}

static void missing_tensor_is_an_io_error_naming_it(void **state) {
    fixture *f = *state;
    ckpt_opts o = {"model.norm.weight", NULL, "BF16", "model.extra.weight"};
    write_ckpt(f->dir, f->source, TS_QWEN3_CONFIG, &o);
    ASSERT_LOAD_FAILS(f, RP_ERR_IO, "model.safetensors", "missing tensor \"model.norm.weight\"");
}

static void missing_shard_and_index_gaps_are_io_errors(void **state) {
    fixture *f = *state;
    TS_OK(rp_model_save_hf(f->source, f->dir));
    char *single = path_in(f->dir, "model.safetensors"), *shard = path_in(f->dir, "a.safetensors");
    assert_int_equal(rename(single, shard), 0);
    /* The index names a second shard that is not there. */
    write_text(f->dir, "model.safetensors.index.json",
               "{\"weight_map\": {\"model.norm.weight\": \"b.safetensors\","
               " \"model.embed_tokens.weight\": \"a.safetensors\"}}");
    ASSERT_LOAD_FAILS(f, RP_ERR_IO, "b.safetensors", "missing shard", "model.norm.weight");
    /* An index that maps no file to a tensor. */
    write_text(f->dir, "model.safetensors.index.json",
               "{\"weight_map\": {\"model.embed_tokens.weight\": \"a.safetensors\"}}");
    ASSERT_LOAD_FAILS(f, RP_ERR_IO, "model.safetensors.index.json", "model.layers.0.");
    write_text(f->dir, "model.safetensors.index.json", "{\"weight_map\": [");
    ASSERT_LOAD_FAILS(f, RP_ERR_IO, "model.safetensors.index.json", "JSON");
    free(single);
    free(shard);
}

static void directory_without_weights_or_config_is_an_io_error(void **state) {
    fixture *f = *state;
    write_text(f->dir, "config.json", TS_QWEN3_CONFIG);
    ASSERT_LOAD_FAILS(f, RP_ERR_IO, "model.safetensors");
    char *cfg = path_in(f->dir, "config.json");
    unlink(cfg);
    rp_model *m = NULL;
    TS_ERR(rp_model_create_from_hf(&m, f->dir, NULL), RP_ERR_IO, "config.json");
    write_text(f->dir, "config.json", "{\"architectures\": [");
    TS_ERR(rp_model_create_from_hf(&m, f->dir, NULL), RP_ERR_IO, "config.json", "JSON");
    assert_null(m);
    free(cfg);
}

static void unsupported_architectures_and_features_are_rejected_by_name(void **state) {
    fixture *f = *state;
    rp_model *m = NULL;
    write_text(f->dir, "config.json",
               "{\"architectures\": [\"MistralForCausalLM\"], \"vocab_size\": 40}");
    TS_ERR(rp_model_create_from_hf(&m, f->dir, NULL), RP_ERR_INVALID_ARGUMENT, "config.json",
           "MistralForCausalLM", "not supported");
    static const struct {
        const char *config, *needle;
    } bad[] = {
        {"{\"architectures\": [\"GPT2LMHeadModel\"]}", "GPT2LMHeadModel"},
        {"{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 40, \"hidden_size\": 32,"
         " \"intermediate_size\": 48, \"num_hidden_layers\": 1, \"num_attention_heads\": 4,"
         " \"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0}}",
         "yarn"},
        {"{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 40, \"hidden_size\": 32,"
         " \"intermediate_size\": 48, \"num_hidden_layers\": 1, \"num_attention_heads\": 4,"
         " \"hidden_act\": \"gelu\"}",
         "hidden_act"},
        {"{\"architectures\": [\"Qwen3ForCausalLM\"], \"vocab_size\": 40, \"hidden_size\": 32,"
         " \"intermediate_size\": 48, \"num_hidden_layers\": 1, \"num_attention_heads\": 4,"
         " \"use_sliding_window\": true}",
         "use_sliding_window"},
        {"{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 40, \"hidden_size\": 32,"
         " \"intermediate_size\": 48, \"num_hidden_layers\": 1, \"num_attention_heads\": 4,"
         " \"num_key_value_heads\": 3}",
         "num_key_value_heads"},
        {"{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 32}", "vocab_size"},
        {"[1, 2]", "object"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; ++i)
        TS_ERR(rp_model_create_from_hf_config(&m, bad[i].config, NULL), RP_ERR_INVALID_ARGUMENT,
               bad[i].needle);
    TS_ERR(rp_model_create_from_hf_config(&m, "{nope", NULL), RP_ERR_INVALID_ARGUMENT, "JSON");
    assert_null(m);
}

/* QWEN3_MOE with `key` set to `value` (the key's last occurrence wins in the parser). */
static char *moe_with(const char *key, const char *value) {
    char *config = malloc(4096);
    snprintf(config, 4096, "%.*s, \"%s\": %s}", (int)(strlen(QWEN3_MOE) - 1), QWEN3_MOE, key,
             value);
    return config;
}

static void unsupported_qwen3_moe_values_are_rejected_by_key(void **state) {
    (void)state;
    static const struct {
        const char *key, *value, *needle;
    } bad[] = {
        {"output_router_logits", "true", "output_router_logits"},
        {"num_experts_per_tok", "5", "num_experts_per_tok"},
        {"num_experts", "-4", "num_experts"},
        {"num_local_experts", "8", "num_local_experts"},
        {"moe_intermediate_size", "0", "moe_intermediate_size"},
        {"decoder_sparse_step", "0", "decoder_sparse_step"},
        {"mlp_only_layers", "[2]", "mlp_only_layers"},
        {"mlp_only_layers", "[0.5]", "mlp_only_layers"},
        {"norm_topk_prob", "1", "norm_topk_prob"},
        {"router_aux_loss_coef", "\"x\"", "router_aux_loss_coef"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; ++i) {
        char *config = moe_with(bad[i].key, bad[i].value);
        rp_model *m = NULL;
        TS_ERR(rp_model_create_from_hf_config(&m, config, NULL), RP_ERR_INVALID_ARGUMENT,
               bad[i].needle);
        assert_null(m);
        free(config);
    }
    /* A zero coefficient leaves transformers' loss unchanged: accepted. */
    char *config = moe_with("router_aux_loss_coef", "0.0, \"output_router_logits\": true");
    rp_model *m = NULL;
    TS_OK(rp_model_create_from_hf_config(&m, config, NULL));
    rp_model_destroy(m);
    free(config);
}

/* LoRA on a Qwen3-MoE model: adapters on the attention projections of both layers (the sparse
 * one included), everything else frozen, and it trains; the MLP modules, which PEFT adapts
 * through wrappers of its own on these models, are refused by name before anything exists. */
static void qwen3_moe_lora_adapts_attention_and_refuses_mlp_targets(void **state) {
    (void)state;
    static const char *refused[] = {"q_proj,gate_proj", "down_proj", "all-linear"};
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; ++i) {
        rp_model_options *opts = NULL;
        TS_OK(rp_model_options_create(&opts));
        TS_OK(rp_model_options_set_lora(opts, 4, 8.0, 0.0, refused[i]));
        rp_model *m = NULL;
        TS_ERR(rp_model_create_from_hf_config(&m, QWEN3_MOE, opts), RP_ERR_INVALID_ARGUMENT,
               "not supported", "q_proj,k_proj,v_proj,o_proj");
        assert_null(m);
        rp_model_options_destroy(opts);
    }
    rp_model_options *opts = NULL;
    TS_OK(rp_model_options_create(&opts));
    TS_OK(rp_model_options_set_devices(opts, ts_device_kind(), ts_devices(2)));
    TS_OK(rp_model_options_set_lora(opts, 4, 8.0, 0.0, "q_proj,o_proj"));
    rp_model *m = NULL;
    TS_OK(rp_model_create_from_hf_config(&m, QWEN3_MOE, opts));
    rp_model_options_destroy(opts);
    size_t count = 0, trainable = 0;
    TS_OK(rp_param_count(&count, m));
    for (size_t i = 0; i < count; ++i) {
        const char *name = NULL;
        int32_t kind = -1;
        TS_OK(rp_param_name(&name, m, i));
        TS_OK(rp_param_kind_of(&kind, m, i));
        const int adapter = strstr(name, ".lora_") != NULL;
        assert_int_equal(kind, adapter ? RP_PARAM_TRAINABLE : RP_PARAM_FROZEN);
        trainable += (size_t)adapter;
    }
    assert_int_equal(trainable, 2 * 2 * NUM_LAYERS); /* A and B of q_proj and o_proj, per layer */
    size_t index = 0;
    TS_OK(rp_param_find(&index, m, "1.self_attn.o_proj.lora_B.weight"));
    TS_OK(rp_param_find(&index, m, "1.mlp.experts.gate_up_proj"));

    int64_t shape[2] = {4, 5};
    int64_t ids[20] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 39, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19};
    DLManagedTensor *in = ts_i64(2, shape, ids), *lab = ts_i64(2, shape, ids);
    const DLManagedTensor *inputs[1] = {in};
    rp_loss *lm = NULL;
    TS_OK(rp_loss_create(&lm, RP_LOSS_CAUSAL_LM));
    double loss = 0;
    TS_OK(rp_forward_backward(&loss, NULL, m, inputs, 1, lab, lm, NULL));
    assert_true(isfinite(loss) && loss > 0);
    rp_loss_destroy(lm);
    ts_free(in);
    ts_free(lab);
    rp_model_destroy(m);
}

/* ---- arguments -------------------------------------------------------------------------- */

static void bad_arguments_give_messages_and_the_model_still_trains(void **state) {
    fixture *f = *state;
    rp_model *m = NULL;
    TS_ERR(rp_model_create_from_hf(NULL, f->dir, NULL), RP_ERR_INVALID_ARGUMENT, "out_model");
    TS_ERR(rp_model_create_from_hf(&m, NULL, NULL), RP_ERR_INVALID_ARGUMENT, "dir");
    TS_ERR(rp_model_create_from_hf_config(&m, NULL, NULL), RP_ERR_INVALID_ARGUMENT, "config_json");
    TS_ERR(rp_model_load_hf(NULL, f->dir), RP_ERR_INVALID_ARGUMENT, "model");
    TS_ERR(rp_model_save_hf(NULL, f->dir), RP_ERR_INVALID_ARGUMENT, "model");
    TS_ERR(rp_model_load_hf(f->target, NULL), RP_ERR_INVALID_ARGUMENT, "dir");
    TS_ERR(rp_model_save_hf(f->target, NULL), RP_ERR_INVALID_ARGUMENT, "dir");
    TS_ERR(rp_model_save_hf(f->target, "/nonexistent-rp/parent/dir"), RP_ERR_IO,
           "/nonexistent-rp/parent/dir");
    rp_model *spec =
        ts_model("{\"layers\": [{\"type\": \"linear\", \"in\": 2, \"out\": 2}]}", 0, 1, NULL, 0);
    TS_ERR(rp_model_save_hf(spec, f->dir), RP_ERR_STATE, "Hugging Face");
    TS_ERR(rp_model_load_hf(spec, f->dir), RP_ERR_STATE, "Hugging Face");
    rp_loss *lm = NULL;
    TS_OK(rp_loss_create(&lm, RP_LOSS_CAUSAL_LM));
    TS_ERR(rp_loss_create(&lm, 4), RP_ERR_INVALID_ARGUMENT, "RP_LOSS_CAUSAL_LM");
    float x[4] = {0};
    int64_t xs[2] = {2, 2};
    DLManagedTensor *xin = ts_f32(2, xs, x), *xl = ts_i64(2, xs, NULL);
    const DLManagedTensor *xinputs[1] = {xin};
    TS_ERR(rp_forward_backward(NULL, NULL, spec, xinputs, 1, xl, lm, NULL), RP_ERR_INVALID_ARGUMENT,
           "lm_head");
    rp_model_destroy(spec);

    int64_t shape[2] = {4, 5};
    int64_t ids[20] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 39, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19};
    int64_t bad_ids[20] = {0, 1, 2, 3, 40, 5, 6, 7, 8, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    int64_t bad_labels[20] = {0, 1, -100, 3, 4, 5, 6, -7, 8, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    DLManagedTensor *in = ts_i64(2, shape, ids), *lab = ts_i64(2, shape, ids);
    DLManagedTensor *bin = ts_i64(2, shape, bad_ids), *blab = ts_i64(2, shape, bad_labels);
    float fl[20] = {0};
    DLManagedTensor *flab = ts_f32(2, shape, fl);
    int64_t short_shape[2] = {4, 4};
    DLManagedTensor *slab = ts_i64(2, short_shape, ids);
    DLManagedTensor *bad_mask = ts_i64(2, short_shape, NULL);
    const DLManagedTensor *inputs[1] = {in}, *binputs[1] = {bin}, *minputs[2] = {in, bad_mask};
    rp_tensor_list *outs = NULL;
    TS_ERR(rp_forward(&outs, f->target, binputs, 1, NULL), RP_ERR_INVALID_ARGUMENT, "token id 40",
           "[0, 40)");
    TS_ERR(rp_forward_backward(NULL, NULL, f->target, inputs, 1, blab, lm, NULL),
           RP_ERR_INVALID_ARGUMENT, "-7");
    TS_ERR(rp_forward_backward(NULL, NULL, f->target, inputs, 1, flab, lm, NULL),
           RP_ERR_INVALID_ARGUMENT, "integer labels");
    TS_ERR(rp_forward_backward(NULL, NULL, f->target, inputs, 1, slab, lm, NULL),
           RP_ERR_INVALID_ARGUMENT, "shape");
    TS_ERR(rp_forward_backward(NULL, NULL, f->target, inputs, 1, NULL, lm, NULL),
           RP_ERR_INVALID_ARGUMENT, "needs labels");
    TS_ERR(rp_forward(&outs, f->target, minputs, 2, NULL), RP_ERR_INVALID_ARGUMENT,
           "attention mask");
    assert_null(outs);
    ts_params *now = ts_masters(f->target);
    ts_assert_params_equal(now, f->before);
    ts_params_free(now);
    /* Still usable. */
    double loss = 0;
    TS_OK(rp_forward_backward(&loss, NULL, f->target, inputs, 1, lab, lm, NULL));
    assert_true(isfinite(loss) && loss > 0);
    TS_OK(rp_zero_grad(f->target));
    rp_loss_destroy(lm);
    ts_free(in);
    ts_free(lab);
    ts_free(bin);
    ts_free(blab);
    ts_free(flab);
    ts_free(slab);
    ts_free(bad_mask);
    ts_free(xin);
    ts_free(xl);
}

static void bad_transformer_specs_name_the_layer(void **state) {
    (void)state;
    static const struct {
        const char *spec, *needle;
    } bad[] = {
        {"{\"layers\": [{\"type\": \"decoder_layer\", \"dim\": 32, \"heads\": 4, \"kv_heads\": 3,"
         " \"hidden\": 8}]}",
         "layer 0 (decoder_layer)"},
        {"{\"layers\": [{\"type\": \"decoder_layer\", \"dim\": 30, \"heads\": 4, \"hidden\": 8}]}",
         "head_dim"},
        {"{\"layers\": [{\"type\": \"decoder_layer\", \"dim\": 32, \"heads\": 4, \"hidden\": 8,"
         " \"rope_type\": \"yarn\"}]}",
         "rope_type"},
        {"{\"layers\": [{\"type\": \"decoder_layer\", \"dim\": 32, \"heads\": 4, \"hidden\": 8,"
         " \"qk_nrom\": true}]}",
         "qk_nrom"},
        {"{\"layers\": [{\"type\": \"token_embedding\", \"num\": 8, \"dim\": 4},"
         " {\"type\": \"lm_head\", \"dim\": 4, \"vocab\": 8, \"tied_to\": \"7.weight\"}]}",
         "7.weight"},
        {"{\"layers\": [{\"type\": \"token_embedding\", \"num\": 8, \"dim\": 4},"
         " {\"type\": \"lm_head\", \"dim\": 4, \"vocab\": 9, \"tied_to\": \"0.weight\"}]}",
         "shape"},
        {"{\"layers\": [{\"type\": \"lm_head\", \"dim\": 4, \"vocab\": 8, \"chunk_tokens\": -1}]}",
         "chunk_tokens"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; ++i) {
        rp_model *m = NULL;
        TS_ERR(rp_model_create(&m, bad[i].spec, NULL), RP_ERR_INVALID_ARGUMENT, bad[i].needle);
        assert_null(m);
    }
}

int main(void) {
    const struct CMUnitTest round_trips[] = {
        cmocka_unit_test(saved_directory_has_hf_names_config_and_reloads_bitwise),
        cmocka_unit_test(bf16_model_saves_bf16_tensors_and_a_bf16_config),
        cmocka_unit_test(sharded_checkpoint_in_mixed_dtypes_loads_and_saves_in_the_same_shards),
        cmocka_unit_test(bad_transformer_specs_name_the_layer),
        cmocka_unit_test(unsupported_qwen3_moe_values_are_rejected_by_key),
        cmocka_unit_test(qwen3_moe_lora_adapts_attention_and_refuses_mlp_targets),
    };
    const struct CMUnitTest errors[] = {
        cmocka_unit_test_setup(good_checkpoints_load_into_the_target_and_back, fresh_dir),
        cmocka_unit_test_setup(corrupt_header_is_an_io_error_naming_the_file, fresh_dir),
        cmocka_unit_test_setup(truncated_file_is_an_io_error_naming_file_and_tensor, fresh_dir),
        cmocka_unit_test_setup(wrong_shape_is_an_io_error_naming_file_and_tensor, fresh_dir),
        cmocka_unit_test_setup(missing_tensor_is_an_io_error_naming_it, fresh_dir),
        cmocka_unit_test_setup(missing_shard_and_index_gaps_are_io_errors, fresh_dir),
        cmocka_unit_test_setup(directory_without_weights_or_config_is_an_io_error, fresh_dir),
        cmocka_unit_test_setup(unsupported_architectures_and_features_are_rejected_by_name,
                               fresh_dir),
        cmocka_unit_test_setup(bad_arguments_give_messages_and_the_model_still_trains, fresh_dir),
    };
    int failed = cmocka_run_group_tests_name("transformer_io round trips", round_trips, NULL, NULL);
    failed += cmocka_run_group_tests_name("transformer_io errors", errors, setup, teardown);
    return failed;
}
