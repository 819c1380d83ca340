// Plain libtorch Qwen3 / Llama for the transformer tests (see transformer_reference.h). Written
// from the Hugging Face model definitions, deliberately unlike src/layers/transformer_layers.cpp:
// explicit attention matrices, rotation of (i, i + d/2) pairs from angles computed in double,
// loss from torch's cross_entropy over the full logits.
#include "transformer_reference.h"

#include "reference.h"

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

using json = nlohmann::json;

namespace {

thread_local std::string g_error;

template <typename F> int guarded(F &&f) {
    try {
        g_error.clear();
        f();
        return 0;
    } catch (const std::exception &e) {
        g_error = e.what();
        return -1;
    }
}

torch::Tensor rms(const torch::Tensor &x, const torch::Tensor &w, double eps) {
    return x / torch::sqrt(x.pow(2).mean({-1}, /*keepdim=*/true) + eps) * w;
}

template <typename T> T get_or(const json &c, const char *key, T fallback) {
    return c.contains(key) && !c[key].is_null() ? c[key].get<T>() : fallback;
}

} // namespace

struct ref_lm {
    bool qwen3 = false, tied = false;
    int64_t vocab = 0, hidden = 0, layers = 0, heads = 0, kv_heads = 0, head_dim = 0;
    double eps = 1e-6;
    std::vector<double> inv_freq;           // per rotated pair
    std::map<std::string, torch::Tensor> w; // leaves, Hugging Face names
    double lora_scaling = 0.0;              // alpha / r once adapters are loaded
    std::unique_ptr<torch::optim::AdamW> adamw;

    torch::Tensor p(const std::string &name) {
        auto it = w.find(name);
        if (it == w.end())
            throw std::runtime_error("reference: no tensor " + name);
        return it->second;
    }
    bool has(const std::string &name) const { return w.count(name) > 0; }
    torch::Tensor lin(const torch::Tensor &x, const std::string &prefix) {
        torch::Tensor y = torch::matmul(x, p(prefix + ".weight").t());
        if (has(prefix + ".bias"))
            y = y + p(prefix + ".bias");
        if (has(prefix + ".lora_A.weight")) // PEFT's LoRA Linear: base + scaling * B(A(x))
            y = y + torch::matmul(torch::matmul(x, p(prefix + ".lora_A.weight").t()),
                                  p(prefix + ".lora_B.weight").t()) *
                        lora_scaling;
        return y;
    }

    // x [B, H, T, d]; angles [B, T, d/2]: the pair (i, i + d/2) turns by angle i.
    static torch::Tensor rotate(const torch::Tensor &x, const torch::Tensor &cos,
                                const torch::Tensor &sin) {
        const int64_t h = x.size(-1) / 2;
        torch::Tensor a = x.narrow(-1, 0, h), b = x.narrow(-1, h, h);
        torch::Tensor c = cos.unsqueeze(1), s = sin.unsqueeze(1);
        return torch::cat({a * c - b * s, b * c + a * s}, -1);
    }

    torch::Tensor forward(const torch::Tensor &ids, const torch::Tensor &mask,
                          const torch::Tensor &positions) {
        const int64_t B = ids.size(0), T = ids.size(1);
        torch::Tensor x = p("model.embed_tokens.weight").index_select(0, ids.reshape(-1));
        x = x.reshape({B, T, hidden});
        torch::Tensor freq = torch::tensor(inv_freq, torch::kFloat64);
        torch::Tensor angle = positions.to(torch::kFloat64).unsqueeze(-1) * freq; // [B, T, d/2]
        torch::Tensor cos = angle.cos().to(torch::kFloat32), sin = angle.sin().to(torch::kFloat32);
        torch::Tensor i = torch::arange(T).unsqueeze(1), j = torch::arange(T).unsqueeze(0);
        torch::Tensor allowed =
            ((j <= i).unsqueeze(0) & (mask != 0).unsqueeze(1)) | (j == i).unsqueeze(0); // [B, T, T]
        for (int64_t l = 0; l < layers; ++l) {
            const std::string pre = "model.layers." + std::to_string(l) + ".";
            torch::Tensor h = rms(x, p(pre + "input_layernorm.weight"), eps);
            torch::Tensor q = lin(h, pre + "self_attn.q_proj").reshape({B, T, heads, head_dim});
            torch::Tensor k = lin(h, pre + "self_attn.k_proj").reshape({B, T, kv_heads, head_dim});
            torch::Tensor v = lin(h, pre + "self_attn.v_proj").reshape({B, T, kv_heads, head_dim});
            if (qwen3) {
                q = rms(q, p(pre + "self_attn.q_norm.weight"), eps);
                k = rms(k, p(pre + "self_attn.k_norm.weight"), eps);
            }
            q = rotate(q.permute({0, 2, 1, 3}), cos, sin);
            k = rotate(k.permute({0, 2, 1, 3}), cos, sin);
            v = v.permute({0, 2, 1, 3});
            k = k.repeat_interleave(heads / kv_heads, 1);
            v = v.repeat_interleave(heads / kv_heads, 1);
            torch::Tensor scores = torch::matmul(q, k.transpose(-1, -2)) / std::sqrt(head_dim);
            scores = scores.masked_fill(~allowed.unsqueeze(1), -INFINITY);
            torch::Tensor attn = torch::matmul(torch::softmax(scores, -1), v); // [B, H, T, d]
            attn = attn.permute({0, 2, 1, 3}).reshape({B, T, heads * head_dim});
            x = x + lin(attn, pre + "self_attn.o_proj");
            torch::Tensor h2 = rms(x, p(pre + "post_attention_layernorm.weight"), eps);
            torch::Tensor mlp =
                torch::silu(lin(h2, pre + "mlp.gate_proj")) * lin(h2, pre + "mlp.up_proj");
            x = x + lin(mlp, pre + "mlp.down_proj");
        }
        x = rms(x, p("model.norm.weight"), eps);
        torch::Tensor head = tied ? p("model.embed_tokens.weight") : p("lm_head.weight");
        return torch::matmul(x, head.t()); // [B, T, V]
    }
};

extern "C" {

const char *ref_lm_last_error(void) { return g_error.c_str(); }

ref_lm *ref_lm_load(const char *dir) {
    auto m = std::make_unique<ref_lm>();
    int rc = guarded([&] {
        const std::string d = dir;
        std::ifstream f(d + "/config.json");
        if (!f)
            throw std::runtime_error("reference: no " + d + "/config.json");
        std::stringstream text;
        text << f.rdbuf();
        json c = json::parse(text.str());
        const std::string arch = c["architectures"][0].get<std::string>();
        m->qwen3 = arch == "Qwen3ForCausalLM";
        if (!m->qwen3 && arch != "LlamaForCausalLM")
            throw std::runtime_error("reference: architecture " + arch);
        m->vocab = c["vocab_size"].get<int64_t>();
        m->hidden = c["hidden_size"].get<int64_t>();
        m->layers = c["num_hidden_layers"].get<int64_t>();
        m->heads = c["num_attention_heads"].get<int64_t>();
        m->kv_heads = get_or<int64_t>(c, "num_key_value_heads", m->heads);
        m->head_dim = get_or<int64_t>(c, "head_dim", m->qwen3 ? 128 : m->hidden / m->heads);
        m->eps = get_or<double>(c, "rms_norm_eps", 1e-6);
        m->tied = get_or<bool>(c, "tie_word_embeddings", false);
        json rope =
            c.contains("rope_parameters") && c["rope_parameters"].is_object() ? c["rope_parameters"]
            : c.contains("rope_scaling") && c["rope_scaling"].is_object()     ? c["rope_scaling"]
                                                                              : json::object();
        const double theta =
            get_or<double>(rope, "rope_theta", get_or<double>(c, "rope_theta", 1e4));
        std::string type =
            get_or<std::string>(rope, "rope_type", get_or<std::string>(rope, "type", "default"));
        // Llama 3.1: long wavelengths slowed down by `factor`, short ones kept, a smooth blend
        // between the two bands.
        for (int64_t i = 0; i < m->head_dim / 2; ++i) {
            double f = 1.0 / std::pow(theta, 2.0 * static_cast<double>(i) / m->head_dim);
            if (type == "linear") {
                f /= rope["factor"].get<double>();
            } else if (type == "llama3") {
                const double factor = rope["factor"].get<double>();
                const double low = rope["low_freq_factor"].get<double>();
                const double high = rope["high_freq_factor"].get<double>();
                const double old =
                    get_or<double>(rope, "original_max_position_embeddings",
                                   get_or<double>(c, "max_position_embeddings", 2048));
                const double wavelen = 2.0 * M_PI / f;
                if (wavelen > old / low) {
                    f /= factor;
                } else if (wavelen >= old / high) {
                    const double smooth = (old / wavelen - low) / (high - low);
                    f = (1.0 - smooth) * f / factor + smooth * f;
                }
            } else if (type != "default") {
                throw std::runtime_error("reference: rope type " + type);
            }
            m->inv_freq.push_back(f);
        }
        ref_st *st = ref_st_open((d + "/model.safetensors").c_str());
        if (!st)
            throw std::runtime_error(ref_last_error());
        for (size_t i = 0; i < ref_st_count(st); ++i) {
            const char *name = ref_st_name(st, i);
            int64_t shape[8];
            int32_t nd = ref_st_shape(st, name, shape, 8);
            std::vector<int64_t> sizes(shape, shape + nd);
            torch::Tensor t = torch::empty(sizes, torch::kFloat32);
            if (ref_st_get_f32(st, name, t.data_ptr<float>(), t.numel()) != 0) {
                ref_st_close(st);
                throw std::runtime_error(ref_last_error());
            }
            m->w[name] = t.requires_grad_(true);
        }
        ref_st_close(st);
    });
    return rc == 0 ? m.release() : nullptr;
}

void ref_lm_destroy(ref_lm *model) { delete model; }

int64_t ref_lm_vocab(const ref_lm *model) { return model->vocab; }

int ref_lm_run(ref_lm *m, const int64_t *ids, const int64_t *mask, const int64_t *positions,
               const int64_t *labels, int64_t batch, int64_t seq, float *out_logits,
               double *out_loss) {
    return guarded([&] {
        auto wrap = [&](const int64_t *p) {
            return torch::from_blob(const_cast<int64_t *>(p), {batch, seq}, torch::kInt64).clone();
        };
        torch::Tensor id = wrap(ids);
        torch::Tensor mk = mask ? wrap(mask) : torch::ones({batch, seq}, torch::kInt64);
        torch::Tensor pos = positions ? wrap(positions) : torch::arange(seq).expand({batch, seq});
        for (auto &kv : m->w)
            kv.second.mutable_grad() = torch::Tensor();
        torch::Tensor logits = m->forward(id, mk, pos);
        if (out_logits)
            std::memcpy(out_logits, logits.detach().contiguous().data_ptr<float>(),
                        sizeof(float) * logits.numel());
        if (!labels)
            return;
        torch::Tensor target = wrap(labels).narrow(1, 1, seq - 1).reshape(-1);
        torch::Tensor pred = logits.narrow(1, 0, seq - 1).reshape({-1, m->vocab});
        torch::Tensor loss = torch::nn::functional::cross_entropy(
            pred, target, torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100));
        loss.backward();
        if (out_loss)
            *out_loss = loss.item<double>();
    });
}

int ref_lm_load_adapter(ref_lm *m, const char *dir) {
    return guarded([&] {
        const std::string d = dir;
        std::ifstream f(d + "/adapter_config.json");
        if (!f)
            throw std::runtime_error("reference: no " + d + "/adapter_config.json");
        std::stringstream text;
        text << f.rdbuf();
        json c = json::parse(text.str());
        m->lora_scaling = c["lora_alpha"].get<double>() / c["r"].get<double>();
        ref_st *st = ref_st_open((d + "/adapter_model.safetensors").c_str());
        if (!st)
            throw std::runtime_error(ref_last_error());
        const std::string prefix = "base_model.model.";
        std::vector<torch::Tensor> adapters;
        for (size_t i = 0; i < ref_st_count(st); ++i) {
            const std::string name = ref_st_name(st, i);
            int64_t shape[8];
            int32_t nd = ref_st_shape(st, name.c_str(), shape, 8);
            torch::Tensor t = torch::empty(std::vector<int64_t>(shape, shape + nd), torch::kFloat32);
            if (ref_st_get_f32(st, name.c_str(), t.data_ptr<float>(), t.numel()) != 0) {
                ref_st_close(st);
                throw std::runtime_error(ref_last_error());
            }
            if (name.compare(0, prefix.size(), prefix) != 0) {
                ref_st_close(st);
                throw std::runtime_error("reference: adapter tensor " + name);
            }
            m->w[name.substr(prefix.size())] = t.requires_grad_(true);
            adapters.push_back(t);
        }
        ref_st_close(st);
        for (auto &kv : m->w) // the base model is frozen under LoRA
            if (kv.first.find(".lora_") == std::string::npos)
                kv.second.requires_grad_(false);
        m->adamw.reset();
    });
}

int ref_lm_step_adamw(ref_lm *m, double lr, double beta1, double beta2, double eps,
                      double weight_decay) {
    return guarded([&] {
        if (!m->adamw) {
            std::vector<torch::Tensor> trainable;
            for (auto &kv : m->w)
                if (kv.second.requires_grad())
                    trainable.push_back(kv.second);
            m->adamw = std::make_unique<torch::optim::AdamW>(
                trainable, torch::optim::AdamWOptions(lr)
                               .betas({beta1, beta2})
                               .eps(eps)
                               .weight_decay(weight_decay));
        }
        m->adamw->step();
    });
}

int64_t ref_lm_numel(const ref_lm *m, const char *name) {
    auto it = m->w.find(name);
    return it == m->w.end() ? -1 : it->second.numel();
}

static int copy_out(const ref_lm *m, const char *name, float *out, int64_t numel, bool grad) {
    return guarded([&] {
        auto it = m->w.find(name);
        if (it == m->w.end())
            throw std::runtime_error(std::string("reference: no tensor ") + name);
        torch::Tensor t = grad ? it->second.grad() : it->second.detach();
        if (!t.defined())
            t = torch::zeros_like(it->second);
        if (t.numel() != numel)
            throw std::runtime_error(std::string("reference: size mismatch for ") + name);
        std::memcpy(out, t.contiguous().data_ptr<float>(), sizeof(float) * numel);
    });
}

int ref_lm_weight(const ref_lm *m, const char *name, float *out, int64_t numel) {
    return copy_out(m, name, out, numel, false);
}

int ref_lm_grad(const ref_lm *m, const char *name, float *out, int64_t numel) {
    return copy_out(m, name, out, numel, true);
}

} // extern "C"
