// Independent libtorch reference for the RoundPipe C tests. It deliberately shares nothing with
// src/: the spec is parsed here, each layer is written from the table in docs/semantics.md with
// plain torch ops, autograd runs over the whole microbatch (no recompute, no stages), and the
// optimizer is libtorch's own torch::optim::AdamW / SGD. Agreement with the engine therefore
// checks the pipeline, recompute, gradient accumulation and the CPU optimizer kernels.
#include "reference.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

using json = nlohmann::json;

namespace {

thread_local std::string g_error;

struct Layer {
    std::string type;
    // Local parameter names in the order of docs/semantics.md, and the tensors.
    std::vector<std::string> names;
    std::vector<torch::Tensor> params;
    // Arguments (only those of the layer's type are meaningful).
    int64_t in = 0, out = 0, num = 0, dim = 0, hidden = 0, start_dim = 1;
    bool bias = true;
    double eps = 1e-5, p = 0.0;
    std::string approximate = "none", activation = "gelu", norm = "layer_norm";
    std::vector<int64_t> shape;

    torch::Tensor &param(const std::string &name) {
        for (size_t i = 0; i < names.size(); ++i)
            if (names[i] == name)
                return params[i];
        throw std::runtime_error("reference: layer has no parameter " + name);
    }
    void add(const std::string &name, std::vector<int64_t> sizes) {
        names.push_back(name);
        params.push_back(torch::zeros(sizes, torch::kFloat32).requires_grad_(true));
    }
};

int64_t positive(const json &l, const char *key, size_t index) {
    if (!l.contains(key) || !l[key].is_number_integer() || l[key].get<int64_t>() <= 0)
        throw std::runtime_error("reference: layer " + std::to_string(index) + ": bad '" + key +
                                 "'");
    return l[key].get<int64_t>();
}

torch::Tensor activate(const std::string &kind, const torch::Tensor &x,
                       const std::string &approximate = "none") {
    if (kind == "relu")
        return torch::relu(x);
    if (kind == "silu")
        return torch::silu(x);
    if (kind == "tanh")
        return torch::tanh(x);
    if (kind == "gelu")
        return torch::gelu(x, approximate);
    throw std::runtime_error("reference: unknown activation " + kind);
}

torch::Tensor rms_norm(const torch::Tensor &x, const torch::Tensor &w, double eps) {
    return x / torch::sqrt(x.pow(2).mean({-1}, /*keepdim=*/true) + eps) * w;
}

} // namespace

struct ref_model {
    uint64_t seed = 0;
    std::vector<Layer> layers;
    std::vector<std::string> names; // global names "<layer>.<name>"
    std::vector<torch::Tensor> params;
    std::map<std::string, size_t> index;
    std::unique_ptr<torch::optim::AdamW> adamw;
    std::unique_ptr<torch::optim::SGD> sgd;

    torch::Tensor &find(const std::string &name) {
        auto it = index.find(name);
        if (it == index.end())
            throw std::runtime_error("reference: no parameter " + name);
        return params[it->second];
    }

    torch::Tensor run_layer(size_t l, const torch::Tensor &x, bool train, int64_t call,
                            int64_t microbatch) {
        Layer &L = layers[l];
        const std::string &t = L.type;
        if (t == "linear")
            return torch::linear(x, L.param("weight"), L.bias ? L.param("bias") : torch::Tensor());
        if (t == "embedding")
            return torch::embedding(L.param("weight"), x);
        if (t == "layer_norm")
            return torch::layer_norm(x, {L.dim}, L.param("weight"), L.param("bias"), L.eps);
        if (t == "rms_norm")
            return rms_norm(x, L.param("weight"), L.eps);
        if (t == "relu" || t == "silu" || t == "tanh")
            return activate(t, x);
        if (t == "gelu")
            return activate(t, x, L.approximate);
        if (t == "dropout") {
            if (!train)
                return x;
            // docs/semantics.md: generator seeded with mix(mix(mix(mix(seed) ^ k) ^ l) ^ m),
            // mask = bernoulli(1 - p) drawn with Tensor.bernoulli_ into an fp32 CPU tensor of
            // the activation's shape, output x * mask / (1 - p).
            uint64_t s = ref_mix(seed);
            s = ref_mix(s ^ static_cast<uint64_t>(call));
            s = ref_mix(s ^ static_cast<uint64_t>(l));
            s = ref_mix(s ^ static_cast<uint64_t>(microbatch));
            at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(s);
            torch::Tensor mask = torch::empty(x.sizes(), torch::kFloat32);
            mask.bernoulli_(1.0 - L.p, gen);
            return x * mask / (1.0 - L.p);
        }
        if (t == "residual_mlp") {
            torch::Tensor h = x;
            if (L.norm == "layer_norm")
                h = torch::layer_norm(x, {L.dim}, L.param("norm.weight"), L.param("norm.bias"),
                                      L.eps);
            else if (L.norm == "rms_norm")
                h = rms_norm(x, L.param("norm.weight"), L.eps);
            h = torch::linear(h, L.param("fc1.weight"), L.param("fc1.bias"));
            h = activate(L.activation, h);
            h = torch::linear(h, L.param("fc2.weight"), L.param("fc2.bias"));
            return x + h;
        }
        if (t == "flatten")
            return x.flatten(L.start_dim);
        if (t == "reshape") {
            std::vector<int64_t> s{x.size(0)};
            s.insert(s.end(), L.shape.begin(), L.shape.end());
            return x.reshape(s);
        }
        throw std::runtime_error("reference: unknown layer type " + t);
    }

    torch::Tensor run(const torch::Tensor &x0, bool train, int64_t call, int64_t microbatch) {
        torch::Tensor x = x0;
        for (size_t l = 0; l < layers.size(); ++l)
            x = run_layer(l, x, train, call, microbatch);
        return x;
    }
};

namespace {

Layer parse_layer(const json &l, size_t i) {
    if (!l.is_object() || !l.contains("type") || !l["type"].is_string())
        throw std::runtime_error("reference: layer " + std::to_string(i) + " has no type");
    Layer L;
    L.type = l["type"].get<std::string>();
    const std::string &t = L.type;
    if (t == "linear") {
        L.in = positive(l, "in", i);
        L.out = positive(l, "out", i);
        L.bias = l.value("bias", true);
        L.add("weight", {L.out, L.in});
        if (L.bias)
            L.add("bias", {L.out});
    } else if (t == "embedding") {
        L.num = positive(l, "num", i);
        L.dim = positive(l, "dim", i);
        L.add("weight", {L.num, L.dim});
    } else if (t == "layer_norm") {
        L.dim = positive(l, "dim", i);
        L.eps = l.value("eps", 1e-5);
        L.add("weight", {L.dim});
        L.add("bias", {L.dim});
    } else if (t == "rms_norm") {
        L.dim = positive(l, "dim", i);
        L.eps = l.value("eps", 1e-6);
        L.add("weight", {L.dim});
    } else if (t == "relu" || t == "silu" || t == "tanh") {
    } else if (t == "gelu") {
        L.approximate = l.value("approximate", std::string("none"));
    } else if (t == "dropout") {
        L.p = l.value("p", 0.0);
    } else if (t == "residual_mlp") {
        L.dim = positive(l, "dim", i);
        L.hidden = positive(l, "hidden", i);
        L.activation = l.value("activation", std::string("gelu"));
        L.norm = l.value("norm", std::string("layer_norm"));
        L.eps = l.value("eps", 1e-5);
        if (L.norm == "layer_norm") {
            L.add("norm.weight", {L.dim});
            L.add("norm.bias", {L.dim});
        } else if (L.norm == "rms_norm") {
            L.add("norm.weight", {L.dim});
        } else if (L.norm != "none") {
            throw std::runtime_error("reference: unknown norm " + L.norm);
        }
        L.add("fc1.weight", {L.hidden, L.dim});
        L.add("fc1.bias", {L.hidden});
        L.add("fc2.weight", {L.dim, L.hidden});
        L.add("fc2.bias", {L.dim});
    } else if (t == "flatten") {
        L.start_dim = l.value("start_dim", int64_t{1});
    } else if (t == "reshape") {
        L.shape = l.at("shape").get<std::vector<int64_t>>();
    } else {
        throw std::runtime_error("reference: unknown layer type " + t);
    }
    return L;
}

torch::Tensor from_ref(const ref_tensor &t) {
    std::vector<int64_t> shape(t.shape, t.shape + t.ndim);
    auto dtype = t.is_int64 ? torch::kInt64 : torch::kFloat32;
    // Clone: the caller's buffer is only borrowed.
    return torch::from_blob(const_cast<void *>(t.data), shape, dtype).clone();
}

std::vector<torch::Tensor> split(const torch::Tensor &t, int64_t n, int32_t dim) {
    if (dim == REF_SPLIT_REPLICATE || t.dim() == 0)
        return std::vector<torch::Tensor>(n, t);
    if (t.size(dim) < n)
        throw std::runtime_error("reference: fewer rows than microbatches");
    return torch::tensor_split(t, n, dim);
}

torch::Tensor merge(const std::vector<torch::Tensor> &outs) {
    if (outs[0].dim() == 0)
        return torch::stack(outs).mean();
    return torch::cat(outs, 0);
}

int write_output(const torch::Tensor &merged, float *out, int64_t cap, int64_t *out_numel) {
    torch::Tensor m = merged.detach().to(torch::kFloat32).contiguous();
    if (out_numel)
        *out_numel = m.numel();
    if (out) {
        if (m.numel() > cap)
            throw std::runtime_error("reference: output buffer too small");
        std::memcpy(out, m.data_ptr<float>(), sizeof(float) * m.numel());
    }
    return 0;
}

template <class F> int guard(F &&f) {
    try {
        g_error.clear();
        return f();
    } catch (const std::exception &e) {
        g_error = e.what();
        return -1;
    }
}

void copy_out(const torch::Tensor &t, float *out, int64_t numel) {
    torch::Tensor c = t.detach().to(torch::kFloat32).contiguous();
    if (c.numel() != numel)
        throw std::runtime_error("reference: numel mismatch");
    std::memcpy(out, c.data_ptr<float>(), sizeof(float) * numel);
}

} // namespace

extern "C" {

const char *ref_last_error(void) { return g_error.c_str(); }

uint64_t ref_mix(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

ref_model *ref_create(const char *spec_json, uint64_t seed) {
    ref_model *result = nullptr;
    guard([&] {
        auto m = std::make_unique<ref_model>();
        m->seed = seed;
        json spec = json::parse(spec_json);
        const json &layers = spec.at("layers");
        for (size_t i = 0; i < layers.size(); ++i) {
            m->layers.push_back(parse_layer(layers[i], i));
            Layer &L = m->layers.back();
            for (size_t j = 0; j < L.names.size(); ++j) {
                std::string name = std::to_string(i) + "." + L.names[j];
                m->index[name] = m->params.size();
                m->names.push_back(name);
                m->params.push_back(L.params[j]);
                L.params[j].mutable_grad() = torch::zeros_like(L.params[j]);
            }
        }
        result = m.release();
        return 0;
    });
    return result;
}

void ref_destroy(ref_model *model) { delete model; }

size_t ref_param_count(const ref_model *model) { return model->params.size(); }

const char *ref_param_name(const ref_model *model, size_t index) {
    return index < model->names.size() ? model->names[index].c_str() : nullptr;
}

int64_t ref_param_numel(const ref_model *model, const char *name) {
    auto it = model->index.find(name);
    return it == model->index.end() ? -1 : model->params[it->second].numel();
}

int32_t ref_param_shape(const ref_model *model, const char *name, int64_t *out_shape,
                        int32_t capacity) {
    auto it = model->index.find(name);
    if (it == model->index.end())
        return -1;
    const torch::Tensor &p = model->params[it->second];
    for (int32_t d = 0; d < p.dim() && d < capacity; ++d)
        out_shape[d] = p.size(d);
    return static_cast<int32_t>(p.dim());
}

int ref_set_param(ref_model *model, const char *name, const float *data, int64_t numel) {
    return guard([&] {
        torch::Tensor &p = model->find(name);
        if (p.numel() != numel)
            throw std::runtime_error("reference: numel mismatch");
        torch::NoGradGuard ng;
        p.copy_(torch::from_blob(const_cast<float *>(data), p.sizes(), torch::kFloat32));
        return 0;
    });
}

int ref_get_param(const ref_model *model, const char *name, float *out, int64_t numel) {
    return guard([&] {
        copy_out(const_cast<ref_model *>(model)->find(name), out, numel);
        return 0;
    });
}

int ref_get_grad(const ref_model *model, const char *name, float *out, int64_t numel) {
    return guard([&] {
        copy_out(const_cast<ref_model *>(model)->find(name).grad(), out, numel);
        return 0;
    });
}

void ref_zero_grad(ref_model *model) {
    for (auto &p : model->params)
        p.mutable_grad().zero_();
}

int ref_forward_backward(ref_model *model, double *out_loss, float *out_output,
                         int64_t output_capacity, int64_t *out_output_numel, const ref_fb_args *a) {
    return guard([&] {
        torch::Tensor x = from_ref(a->input);
        std::vector<torch::Tensor> xs = split(x, a->num_microbatch, a->input_split_dim);
        std::vector<torch::Tensor> ys;
        if (a->labels)
            ys = split(from_ref(*a->labels), a->num_microbatch, a->label_split_dim);
        double total = 0.0;
        std::vector<torch::Tensor> outs;
        for (int64_t m = 0; m < a->num_microbatch; ++m) {
            torch::Tensor out = model->run(xs[m], /*train=*/true, a->call_index, m);
            torch::Tensor loss;
            switch (a->loss_kind) {
            case REF_LOSS_OUTPUT:
                if (out.numel() != 1)
                    throw std::runtime_error("reference: output not scalar");
                loss = out.reshape({});
                break;
            case REF_LOSS_MSE:
                loss = (out - ys.at(m)).pow(2).mean();
                break;
            case REF_LOSS_CROSS_ENTROPY:
                loss = torch::nll_loss(torch::log_softmax(out, 1), ys.at(m));
                break;
            default:
                throw std::runtime_error("reference: unknown loss kind");
            }
            loss = loss * a->scale;
            if (loss.requires_grad())
                loss.backward(); // a model without parameters has none

            total += loss.item<double>();
            outs.push_back(out.detach());
        }
        if (out_loss)
            *out_loss = total;
        return write_output(merge(outs), out_output, output_capacity, out_output_numel);
    });
}

int ref_forward(ref_model *model, float *out_output, int64_t output_capacity,
                int64_t *out_output_numel, const ref_tensor *input, int32_t num_microbatch) {
    return guard([&] {
        torch::NoGradGuard ng;
        std::vector<torch::Tensor> xs = split(from_ref(*input), num_microbatch, 0);
        std::vector<torch::Tensor> outs;
        for (int64_t m = 0; m < num_microbatch; ++m)
            outs.push_back(model->run(xs[m], /*train=*/false, 0, m));
        return write_output(merge(outs), out_output, output_capacity, out_output_numel);
    });
}

int ref_step_adamw(ref_model *model, double lr, double beta1, double beta2, double eps,
                   double weight_decay) {
    return guard([&] {
        auto opts = torch::optim::AdamWOptions(lr)
                        .betas(std::make_tuple(beta1, beta2))
                        .eps(eps)
                        .weight_decay(weight_decay);
        if (!model->adamw)
            model->adamw = std::make_unique<torch::optim::AdamW>(model->params, opts);
        else
            static_cast<torch::optim::AdamWOptions &>(model->adamw->param_groups()[0].options()) =
                opts;
        model->adamw->step();
        ref_zero_grad(model);
        return 0;
    });
}

int ref_step_sgd(ref_model *model, double lr, double momentum, double weight_decay) {
    return guard([&] {
        auto opts = torch::optim::SGDOptions(lr).momentum(momentum).weight_decay(weight_decay);
        if (!model->sgd)
            model->sgd = std::make_unique<torch::optim::SGD>(model->params, opts);
        else
            static_cast<torch::optim::SGDOptions &>(model->sgd->param_groups()[0].options()) = opts;
        model->sgd->step();
        ref_zero_grad(model);
        return 0;
    });
}

} // extern "C"

// ---------------------------------------------------------------------------------------------
// safetensors: 8-byte little-endian header length, JSON header, raw little-endian data.

struct ref_st {
    std::vector<std::string> names;
    std::map<std::string, std::string> dtypes;
    std::map<std::string, torch::Tensor> tensors; // fp32 copies
    std::map<std::string, std::vector<int64_t>> shapes;
};

namespace {

torch::ScalarType st_dtype(const std::string &d, size_t *size) {
    if (d == "F32")
        return *size = 4, torch::kFloat32;
    if (d == "F64")
        return *size = 8, torch::kFloat64;
    if (d == "F16")
        return *size = 2, torch::kFloat16;
    if (d == "BF16")
        return *size = 2, torch::kBFloat16;
    if (d == "I64")
        return *size = 8, torch::kInt64;
    throw std::runtime_error("reference: unsupported safetensors dtype " + d);
}

} // namespace

extern "C" {

ref_st *ref_st_open(const char *path) {
    ref_st *result = nullptr;
    guard([&] {
        std::ifstream f(path, std::ios::binary);
        if (!f)
            throw std::runtime_error(std::string("reference: cannot open ") + path);
        std::vector<char> bytes((std::istreambuf_iterator<char>(f)),
                                std::istreambuf_iterator<char>());
        if (bytes.size() < 8)
            throw std::runtime_error("reference: file too short");
        uint64_t n = 0;
        for (int i = 7; i >= 0; --i)
            n = (n << 8) | static_cast<unsigned char>(bytes[i]);
        if (n > bytes.size() - 8)
            throw std::runtime_error("reference: header too long");
        json header = json::parse(bytes.begin() + 8, bytes.begin() + 8 + n);
        const char *data = bytes.data() + 8 + n;
        size_t data_len = bytes.size() - 8 - n;
        auto st = std::make_unique<ref_st>();
        for (auto it = header.begin(); it != header.end(); ++it) {
            if (it.key() == "__metadata__")
                continue;
            const json &e = it.value();
            size_t esize = 0;
            auto dtype = st_dtype(e.at("dtype").get<std::string>(), &esize);
            auto shape = e.at("shape").get<std::vector<int64_t>>();
            auto offs = e.at("data_offsets").get<std::vector<uint64_t>>();
            int64_t numel = 1;
            for (int64_t s : shape)
                numel *= s;
            if (offs.size() != 2 || offs[1] > data_len || offs[1] - offs[0] != numel * esize)
                throw std::runtime_error("reference: bad data_offsets for " + it.key());
            torch::Tensor t = torch::empty(shape, dtype);
            std::memcpy(t.data_ptr(), data + offs[0], numel * esize);
            st->names.push_back(it.key());
            st->dtypes[it.key()] = e.at("dtype").get<std::string>();
            st->shapes[it.key()] = shape;
            st->tensors[it.key()] = t.to(torch::kFloat32);
        }
        result = st.release();
        return 0;
    });
    return result;
}

void ref_st_close(ref_st *file) { delete file; }

size_t ref_st_count(const ref_st *file) { return file->names.size(); }

const char *ref_st_name(const ref_st *file, size_t index) {
    return index < file->names.size() ? file->names[index].c_str() : nullptr;
}

const char *ref_st_dtype(const ref_st *file, const char *name) {
    auto it = file->dtypes.find(name);
    return it == file->dtypes.end() ? nullptr : it->second.c_str();
}

int32_t ref_st_shape(const ref_st *file, const char *name, int64_t *out_shape, int32_t capacity) {
    auto it = file->shapes.find(name);
    if (it == file->shapes.end())
        return -1;
    for (int32_t d = 0; d < static_cast<int32_t>(it->second.size()) && d < capacity; ++d)
        out_shape[d] = it->second[d];
    return static_cast<int32_t>(it->second.size());
}

int ref_st_get_f32(const ref_st *file, const char *name, float *out, int64_t numel) {
    return guard([&] {
        auto it = file->tensors.find(name);
        if (it == file->tensors.end())
            throw std::runtime_error("reference: no tensor " + std::string(name));
        copy_out(it->second, out, numel);
        return 0;
    });
}

int ref_st_write(const char *path, const ref_st_entry *entries, size_t n) {
    return guard([&] {
        json header = json::object();
        std::string data;
        for (size_t i = 0; i < n; ++i) {
            const ref_st_entry &e = entries[i];
            std::vector<int64_t> shape(e.shape, e.shape + e.ndim);
            size_t esize = 0;
            auto dtype = st_dtype(e.dtype, &esize);
            torch::Tensor t =
                torch::from_blob(const_cast<float *>(e.values), shape, torch::kFloat32).to(dtype);
            size_t begin = data.size();
            data.append(static_cast<const char *>(t.data_ptr()), t.numel() * esize);
            header[e.name] = {
                {"dtype", e.dtype}, {"shape", shape}, {"data_offsets", {begin, data.size()}}};
        }
        std::string h = header.dump();
        while (h.size() % 8)
            h += ' ';
        std::ofstream f(path, std::ios::binary | std::ios::trunc);
        if (!f)
            throw std::runtime_error(std::string("reference: cannot write ") + path);
        uint64_t len = h.size();
        unsigned char lb[8];
        for (int i = 0; i < 8; ++i)
            lb[i] = static_cast<unsigned char>(len >> (8 * i));
        f.write(reinterpret_cast<const char *>(lb), 8);
        f.write(h.data(), h.size());
        f.write(data.data(), data.size());
        if (!f)
            throw std::runtime_error(std::string("reference: write failed ") + path);
        return 0;
    });
}

} // extern "C"
