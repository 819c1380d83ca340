#include "shape.h"

#include <vector>

#include "util.h"

namespace tb {
namespace {

const std::vector<Shape> kShapes = {
    {"tiny", 64, 4, 4, 2, 16, 192, 512, true, 4, 64, 2},
    {"tiny-moe", 64, 2, 4, 2, 16, 192, 512, true, 4, 64, 2, 8, 2, 32},
    {"qwen3-0.6b", 1024, 28, 16, 8, 128, 3072, 151936, true, 8, 4096, 4},
    {"qwen3-1.7b", 2048, 28, 16, 8, 128, 6144, 151936, true, 8, 4096, 4},
    {"qwen3-8b", 4096, 36, 32, 8, 128, 12288, 151936, false, 8, 4096, 4},
    {"qwen3-32b", 5120, 64, 64, 8, 128, 25600, 151936, false, 8, 4096, 4},
    {"qwen3-30b-a3b", 2048, 48, 32, 4, 128, 6144, 151936, false, 8, 4096, 4, 128, 8, 768},
};

// `experts` of the MLP's experts take part (all of them: stored; top_k: computed per token).
int64_t decoder_layer_params(const Shape &s, int64_t experts) {
    const int64_t q = s.heads * s.head_dim, kv = s.kv_heads * s.head_dim;
    const int64_t attention = q * s.hidden + 2 * kv * s.hidden + s.hidden * q + 2 * s.head_dim;
    const int64_t mlp = s.moe() ? s.experts * s.hidden + experts * 3 * s.hidden * s.moe_intermediate
                                : 3 * s.hidden * s.intermediate;
    return attention + mlp + 2 * s.hidden;
}

} // namespace

const Shape *find_shape(const std::string &name) {
    for (const Shape &s : kShapes)
        if (s.name == name)
            return &s;
    return nullptr;
}

std::string shape_names() {
    std::string names;
    for (const Shape &s : kShapes)
        names += (names.empty() ? "" : "|") + s.name;
    return names;
}

int64_t total_params(const Shape &s) {
    return s.vocab * s.hidden + s.layers * decoder_layer_params(s, s.experts) + s.hidden +
           (s.tied ? 0 : s.vocab * s.hidden);
}

int64_t flop_params(const Shape &s) {
    return total_params(s) - (s.tied ? 0 : s.vocab * s.hidden) -
           s.layers * (decoder_layer_params(s, s.experts) - decoder_layer_params(s, s.top_k));
}

int64_t lora_params(const Shape &s, int rank, const std::string &targets) {
    const int64_t q = s.heads * s.head_dim, kv = s.kv_heads * s.head_dim;
    struct Projection {
        const char *name;
        int64_t in, out;
    };
    const Projection projections[] = {{"q_proj", s.hidden, q},         {"k_proj", s.hidden, kv},
                                      {"v_proj", s.hidden, kv},        {"o_proj", q, s.hidden},
                                      {"gate_proj", s.hidden, s.intermediate},
                                      {"up_proj", s.hidden, s.intermediate},
                                      {"down_proj", s.intermediate, s.hidden}};
    int64_t per_layer = 0;
    for (const Projection &p : projections)
        if (targets == "all-linear" || ("," + targets + ",").find("," + std::string(p.name) + ",") !=
                                           std::string::npos)
            per_layer += rank * (p.in + p.out);
    return s.layers * per_layer;
}

double attention_forward_flops(const Shape &s, int64_t batch, int64_t seq) {
    return 2.0 * static_cast<double>(seq) * seq * s.heads * s.head_dim * s.layers * batch;
}

std::string hf_config_json(const Shape &s) {
    json c;
    c["architectures"] = json::array({s.moe() ? "Qwen3MoeForCausalLM" : "Qwen3ForCausalLM"});
    c["model_type"] = s.moe() ? "qwen3_moe" : "qwen3";
    if (s.moe()) {
        c["num_experts"] = s.experts;
        c["num_experts_per_tok"] = s.top_k;
        c["moe_intermediate_size"] = s.moe_intermediate;
        c["norm_topk_prob"] = true;
        c["decoder_sparse_step"] = 1;
        c["mlp_only_layers"] = json::array();
        c["output_router_logits"] = false;
    }
    c["vocab_size"] = s.vocab;
    c["hidden_size"] = s.hidden;
    c["intermediate_size"] = s.intermediate;
    c["num_hidden_layers"] = s.layers;
    c["num_attention_heads"] = s.heads;
    c["num_key_value_heads"] = s.kv_heads;
    c["head_dim"] = s.head_dim;
    c["hidden_act"] = "silu";
    c["max_position_embeddings"] = 40960;
    c["rms_norm_eps"] = 1e-6;
    c["rope_theta"] = 1000000.0;
    c["tie_word_embeddings"] = s.tied;
    c["use_sliding_window"] = false;
    c["attention_bias"] = false;
    c["attention_dropout"] = 0.0;
    c["initializer_range"] = 0.02;
    c["torch_dtype"] = "bfloat16";
    return c.dump();
}

} // namespace tb
