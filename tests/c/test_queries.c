/*
 * test_queries.c - what the engine decides, asked through the API instead of re-derived: the
 * stage plan, the resolved run configuration, the microbatch split rule for one tensor and the
 * Hugging Face names of parameters. Expectations are written out by hand from roundpipe.h and
 * docs/semantics.md (and, for names, from transformers' module paths).
 */
#include "test_support.h"

#include <string.h>

static const char *SPEC = "{\"layers\": ["
                          "{\"type\": \"linear\", \"in\": 8, \"out\": 16},"
                          "{\"type\": \"relu\"},"
                          "{\"type\": \"linear\", \"in\": 16, \"out\": 16},"
                          "{\"type\": \"relu\"},"
                          "{\"type\": \"linear\", \"in\": 16, \"out\": 4}]}";

static void stage_plan_returns_an_explicit_plan_unchanged(void **state) {
    (void)state;
    static const int32_t plan[] = {2, 1, 2};
    rp_model *m = ts_model(SPEC, 1, 2, plan, 3);
    int32_t counts[8] = {0}, n = -1;
    TS_OK(rp_model_stage_plan(counts, &n, 8, m));
    assert_int_equal(n, 3);
    assert_memory_equal(counts, plan, sizeof plan);
    /* capacity smaller than the plan: the count is still reported, nothing written past it */
    int32_t one[2] = {-7, -7};
    TS_OK(rp_model_stage_plan(one, &n, 1, m));
    assert_int_equal(n, 3);
    assert_int_equal(one[0], 2);
    assert_int_equal(one[1], -7);
    TS_OK(rp_model_stage_plan(NULL, &n, 0, m));
    assert_int_equal(n, 3);
    TS_ERR(rp_model_stage_plan(NULL, &n, 2, m), RP_ERR_INVALID_ARGUMENT, "NULL");
    TS_ERR(rp_model_stage_plan(counts, NULL, 8, m), RP_ERR_INVALID_ARGUMENT, "NULL");
    TS_ERR(rp_model_stage_plan(counts, &n, -1, m), RP_ERR_INVALID_ARGUMENT, "negative");
    TS_ERR(rp_model_stage_plan(counts, &n, 8, NULL), RP_ERR_INVALID_ARGUMENT, "NULL");
    rp_model_destroy(m);
}

static void automatic_stage_plan_covers_every_layer_in_num_stages_stages(void **state) {
    (void)state;
    rp_model *m = ts_model(SPEC, 1, 2, NULL, 0);
    int32_t counts[8] = {0}, n = -1, stages = -1, layers = -1;
    TS_OK(rp_model_stage_plan(counts, &n, 8, m));
    TS_OK(rp_model_num_stages(&stages, m));
    TS_OK(rp_model_num_layers(&layers, m));
    assert_int_equal(n, stages);
    int32_t sum = 0;
    for (int32_t s = 0; s < n; ++s) {
        assert_true(counts[s] >= 1);
        sum += counts[s];
    }
    assert_int_equal(sum, layers);
    rp_model_destroy(m);
}

static void check_resolved(rp_run_config *c, int32_t num_microbatch, int32_t grain,
                           int32_t merge) {
    int32_t v = -5, type = -5, id = -5;
    TS_OK(rp_run_config_get_num_microbatch(&v, c));
    assert_int_equal(v, num_microbatch);
    TS_OK(rp_run_config_get_recompute_grain(&v, c));
    assert_int_equal(v, grain);
    TS_OK(rp_run_config_get_merge_output(&v, c));
    assert_int_equal(v, merge);
    TS_OK(rp_run_config_get_output_device(&type, &id, c));
    assert_int_equal(type, kDLCPU);
    assert_int_equal(id, 0);
}

/* Defaults: num_devices + 1 microbatches, stage grain, merged outputs on the CPU; a per-call
 * field wins over the model's, which wins over the default. */
static void resolved_run_config_overlays_call_on_model_on_defaults(void **state) {
    (void)state;
    for (int32_t d = 1; d <= 3; ++d) {
        rp_model *m = ts_model(SPEC, 1, d, NULL, 0);
        rp_run_config *r = NULL;
        TS_OK(rp_model_resolve_run_config(&r, m, NULL));
        check_resolved(r, d + 1, RP_GRAIN_STAGE, 1);
        rp_run_config_destroy(r);
        rp_model_destroy(m);
    }
    rp_run_config *model_cfg = ts_config(5, RP_GRAIN_LAYER);
    rp_model_options *o = NULL;
    TS_OK(rp_model_options_create(&o));
    TS_OK(rp_model_options_set_devices(o, RP_DEVICE_CPU, 2));
    TS_OK(rp_model_options_set_run_config(o, model_cfg));
    rp_model *m = NULL;
    TS_OK(rp_model_create(&m, SPEC, o));
    rp_model_options_destroy(o);
    rp_run_config *r = NULL;
    TS_OK(rp_model_resolve_run_config(&r, m, NULL));
    check_resolved(r, 5, RP_GRAIN_LAYER, 1);
    rp_run_config_destroy(r);
    rp_run_config *call = ts_config(7, 0);
    TS_OK(rp_run_config_set_merge_output(call, 0));
    TS_OK(rp_model_resolve_run_config(&r, m, call));
    check_resolved(r, 7, RP_GRAIN_LAYER, 0);
    rp_run_config_destroy(r);
    /* unset fields of a fresh configuration read as unset */
    rp_run_config *fresh = NULL;
    TS_OK(rp_run_config_create(&fresh));
    int32_t v = 9, type = 9, id = 9;
    TS_OK(rp_run_config_get_num_microbatch(&v, fresh));
    assert_int_equal(v, 0);
    TS_OK(rp_run_config_get_recompute_grain(&v, fresh));
    assert_int_equal(v, RP_GRAIN_DEFAULT);
    TS_OK(rp_run_config_get_merge_output(&v, fresh));
    assert_int_equal(v, -1);
    TS_OK(rp_run_config_get_output_device(&type, &id, fresh));
    assert_int_equal(type, 0);
    TS_ERR(rp_run_config_get_num_microbatch(NULL, fresh), RP_ERR_INVALID_ARGUMENT, "NULL");
    TS_ERR(rp_model_resolve_run_config(NULL, m, NULL), RP_ERR_INVALID_ARGUMENT, "NULL");
    rp_run_config_destroy(fresh);
    rp_run_config_destroy(call);
    rp_run_config_destroy(model_cfg);
    rp_model_destroy(m);
}

static int64_t piece_rows(rp_tensor_list *pieces, size_t i, float *first_value) {
    DLManagedTensor *t = NULL;
    TS_OK(rp_tensor_list_get(&t, pieces, i));
    int64_t rows = t->dl_tensor.ndim == 0 ? -1 : t->dl_tensor.shape[0];
    *first_value = *(const float *)((const char *)t->dl_tensor.data + t->dl_tensor.byte_offset);
    ts_free(t);
    return rows;
}

/* torch.tensor_split of 5 rows into 3: 2, 2, 1 rows. */
static void split_rule_matches_tensor_split_and_replicates_scalars(void **state) {
    (void)state;
    float x[5 * 2] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
    int64_t shape[2] = {5, 2};
    DLManagedTensor *t = ts_f32(2, shape, x);
    rp_tensor_list *pieces = NULL;
    TS_OK(rp_split_microbatches(&pieces, t, 0, 3));
    size_t n = 0;
    TS_OK(rp_tensor_list_size(&n, pieces));
    assert_int_equal(n, 3);
    static const int64_t rows[3] = {2, 2, 1};
    static const float first[3] = {0, 4, 8};
    for (size_t i = 0; i < 3; ++i) {
        float f = -1;
        assert_int_equal(piece_rows(pieces, i, &f), rows[i]);
        assert_true(f == first[i]);
    }
    rp_tensor_list_destroy(pieces);
    /* along dim 1: two pieces of one column each */
    TS_OK(rp_split_microbatches(&pieces, t, 1, 2));
    float f = -1;
    assert_int_equal(piece_rows(pieces, 1, &f), 5);
    assert_true(f == 1);
    rp_tensor_list_destroy(pieces);
    /* replicate: every piece is the whole tensor */
    TS_OK(rp_split_microbatches(&pieces, t, RP_SPLIT_REPLICATE, 4));
    TS_OK(rp_tensor_list_size(&n, pieces));
    assert_int_equal(n, 4);
    assert_int_equal(piece_rows(pieces, 3, &f), 5);
    rp_tensor_list_destroy(pieces);
    TS_ERR(rp_split_microbatches(&pieces, t, 0, 6), RP_ERR_INVALID_ARGUMENT, "fewer");
    TS_ERR(rp_split_microbatches(&pieces, t, 2, 2), RP_ERR_INVALID_ARGUMENT, "dimension");
    TS_ERR(rp_split_microbatches(&pieces, t, 0, 0), RP_ERR_INVALID_ARGUMENT, "num_microbatch");
    TS_ERR(rp_split_microbatches(&pieces, NULL, 0, 2), RP_ERR_INVALID_ARGUMENT, "NULL");
    ts_free(t);
    float s = 3.5f;
    DLManagedTensor *scalar = ts_f32(0, NULL, &s);
    TS_OK(rp_split_microbatches(&pieces, scalar, 0, 3));
    TS_OK(rp_tensor_list_size(&n, pieces));
    assert_int_equal(n, 3);
    assert_int_equal(piece_rows(pieces, 2, &f), -1);
    assert_true(f == 3.5f);
    rp_tensor_list_destroy(pieces);
    ts_free(scalar);
    /* The engine only slices: any dtype libtorch knows, e.g. bool masks of 3 rows into 2. */
    int64_t mshape[1] = {3};
    DLManagedTensor *b = ts_raw((DLDataType){kDLBool, 8, 1}, (DLDevice){kDLCPU, 0}, 1, mshape,
                                NULL, 3);
    uint8_t *mask = (uint8_t *)b->dl_tensor.data;
    mask[0] = 1;
    mask[2] = 1;
    TS_OK(rp_split_microbatches(&pieces, b, 0, 2));
    DLManagedTensor *second = NULL;
    TS_OK(rp_tensor_list_get(&second, pieces, 1));
    assert_int_equal(second->dl_tensor.shape[0], 1);
    assert_int_equal(second->dl_tensor.dtype.code, kDLBool);
    assert_int_equal(*((const uint8_t *)second->dl_tensor.data + second->dl_tensor.byte_offset),
                     1);
    ts_free(second);
    rp_tensor_list_destroy(pieces);
    ts_free(b);
}

static const char *LLAMA_UNTIED =
    "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 40, \"hidden_size\": 16,"
    " \"intermediate_size\": 24, \"num_hidden_layers\": 2, \"num_attention_heads\": 4,"
    " \"num_key_value_heads\": 2, \"tie_word_embeddings\": false}";

/* transformers' LlamaForCausalLM state_dict keys, in module order. */
static const char *LLAMA_NAMES[] = {
    "model.embed_tokens.weight",
    "model.layers.0.input_layernorm.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.post_attention_layernorm.weight",
    "model.layers.0.mlp.gate_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
};

static int name_in(const char *name, const char *const *names, size_t n) {
    for (size_t i = 0; i < n; ++i)
        if (strcmp(name, names[i]) == 0)
            return 1;
    return 0;
}

static void hf_names_are_the_transformers_state_dict_keys(void **state) {
    (void)state;
    rp_model_options *o = NULL;
    TS_OK(rp_model_options_create(&o));
    TS_OK(rp_model_options_set_devices(o, RP_DEVICE_CPU, 1));
    rp_model *m = NULL;
    TS_OK(rp_model_create_from_hf_config(&m, LLAMA_UNTIED, o));
    rp_model_options_destroy(o);
    size_t count = 0;
    TS_OK(rp_param_count(&count, m));
    /* embedding, 9 per decoder layer, final norm, untied head */
    assert_int_equal(count, 1 + 2 * 9 + 1 + 1);
    const char *name = NULL;
    for (size_t i = 0; i < 10; ++i) {
        TS_OK(rp_param_hf_name(&name, m, i));
        assert_true(name_in(name, LLAMA_NAMES, 10));
    }
    TS_OK(rp_param_hf_name(&name, m, 0));
    assert_string_equal(name, "model.embed_tokens.weight");
    TS_OK(rp_param_hf_name(&name, m, count - 2));
    assert_string_equal(name, "model.norm.weight");
    TS_OK(rp_param_hf_name(&name, m, count - 1));
    assert_string_equal(name, "lm_head.weight");
    /* the second decoder layer's parameters carry index 1 */
    for (size_t i = 10; i < 19; ++i) {
        TS_OK(rp_param_hf_name(&name, m, i));
        assert_true(strncmp(name, "model.layers.1.", 15) == 0);
    }
    TS_ERR(rp_param_hf_name(&name, m, count), RP_ERR_INVALID_ARGUMENT, "out of range");
    TS_ERR(rp_param_hf_name(NULL, m, 0), RP_ERR_INVALID_ARGUMENT, "NULL");
    rp_model_destroy(m);
    rp_model *plain = ts_model(SPEC, 1, 1, NULL, 0);
    TS_ERR(rp_param_hf_name(&name, plain, 0), RP_ERR_STATE, "Hugging Face");
    rp_model_destroy(plain);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(stage_plan_returns_an_explicit_plan_unchanged),
        cmocka_unit_test(automatic_stage_plan_covers_every_layer_in_num_stages_stages),
        cmocka_unit_test(resolved_run_config_overlays_call_on_model_on_defaults),
        cmocka_unit_test(split_rule_matches_tensor_split_and_replicates_scalars),
        cmocka_unit_test(hf_names_are_the_transformers_state_dict_keys),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
