#include "layers/builtin_layers.h"

#include <cmath>

namespace rp {

double Layer::cost_estimate() const {
    double numel = 0;
    for (const ParamSpec &p : params_) {
        double n = 1;
        for (int64_t d : p.shape)
            n *= static_cast<double>(d);
        numel += n;
    }
    return numel + 1024.0;
}

namespace {

ParamSpec linear_weight(const std::string &name, int64_t in, int64_t out) {
    return {name, {out, in}, InitKind::Uniform, 1.0 / std::sqrt(static_cast<double>(in))};
}
ParamSpec linear_bias(const std::string &name, int64_t in, int64_t out) {
    return {name, {out}, InitKind::Uniform, 1.0 / std::sqrt(static_cast<double>(in))};
}

at::Tensor apply_activation_flat(const std::string &kind, const at::Tensor &x) {
    if (kind == "relu")
        return at::relu(x);
    if (kind == "gelu")
        return at::gelu(x);
    if (kind == "gelu_tanh")
        return at::gelu(x, "tanh");
    if (kind == "silu")
        return at::silu(x);
    return at::tanh(x);
}

// Elementwise, so computed on a flat view: oneDNN's CPU kernels refuse some high-rank shapes
// (gelu at 16 dimensions) that the API accepts.
at::Tensor apply_activation(const std::string &kind, const at::Tensor &x) {
    if (x.dim() <= 4)
        return apply_activation_flat(kind, x);
    return apply_activation_flat(kind, x.reshape({-1})).view(x.sizes());
}

at::Tensor rms_norm(const at::Tensor &x, const at::Tensor &weight, double eps) {
    // Normalise in fp32 whatever the compute dtype: low-precision mean of squares loses digits.
    at::Tensor xf = x.to(at::kFloat);
    at::Tensor normed = xf * at::rsqrt(xf.pow(2).mean({-1}, true) + eps);
    return normed.to(x.scalar_type()) * weight;
}

class Linear final : public Layer {
  public:
    Linear(int64_t in, int64_t out, bool bias) : bias_(bias) {
        params_.push_back(linear_weight("weight", in, out));
        if (bias)
            params_.push_back(linear_bias("bias", in, out));
    }
    std::string type() const override { return "linear"; }
    at::Tensor forward(const std::vector<at::Tensor> &p, const at::Tensor &x,
                       const LayerContext &) const override {
        return bias_ ? at::linear(x, p[0], p[1]) : at::linear(x, p[0]);
    }

  private:
    bool bias_;
};

class Embedding final : public Layer {
  public:
    Embedding(int64_t num, int64_t dim) : num_(num) {
        params_.push_back({"weight", {num, dim}, InitKind::Normal, 1.0});
    }
    std::string type() const override { return "embedding"; }
    int64_t input_index_limit() const override { return num_; }
    bool looks_up_rows() const override { return true; }
    at::Tensor forward(const std::vector<at::Tensor> &p, const at::Tensor &x,
                       const LayerContext &lc) const override {
        return at::embedding(p[0], x, -1, false, embedding_row_gradient(lc, x, p[0]));
    }
    double cost_estimate() const override { return 1024.0; } // a gather, not a matmul

  private:
    int64_t num_;
};

class LayerNorm final : public Layer {
  public:
    LayerNorm(int64_t dim, double eps) : dim_(dim), eps_(eps) {
        params_.push_back({"weight", {dim}, InitKind::Ones, 0});
        params_.push_back({"bias", {dim}, InitKind::Zeros, 0});
    }
    std::string type() const override { return "layer_norm"; }
    at::Tensor forward(const std::vector<at::Tensor> &p, const at::Tensor &x,
                       const LayerContext &) const override {
        return at::layer_norm(x, {dim_}, p[0], p[1], eps_);
    }

  private:
    int64_t dim_;
    double eps_;
};

class RmsNorm final : public Layer {
  public:
    RmsNorm(int64_t dim, double eps) : eps_(eps) { params_.push_back({"weight", {dim}, InitKind::Ones, 0}); }
    std::string type() const override { return "rms_norm"; }
    at::Tensor forward(const std::vector<at::Tensor> &p, const at::Tensor &x,
                       const LayerContext &) const override {
        return rms_norm(x, p[0], eps_);
    }

  private:
    double eps_;
};

class Activation final : public Layer {
  public:
    explicit Activation(std::string kind) : kind_(std::move(kind)) {}
    std::string type() const override { return kind_ == "gelu_tanh" ? "gelu" : kind_; }
    at::Tensor forward(const std::vector<at::Tensor> &, const at::Tensor &x,
                       const LayerContext &) const override {
        return apply_activation(kind_, x);
    }

  private:
    std::string kind_;
};

class Dropout final : public Layer {
  public:
    explicit Dropout(double p) : p_(p) {}
    std::string type() const override { return "dropout"; }
    at::Tensor forward(const std::vector<at::Tensor> &, const at::Tensor &x,
                       const LayerContext &ctx) const override {
        if (!ctx.training || p_ == 0.0)
            return x;
        // The mask is drawn on the CPU from a generator seeded by the context, then moved to
        // x's device: identical masks on every device kind, and recompute replays them exactly.
        at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(ctx.dropout_seed);
        at::Tensor mask = at::empty(x.sizes(), x.options().device(at::kCPU).dtype(at::kFloat));
        mask.bernoulli_(1.0 - p_, gen);
        mask = mask.to(x.device(), x.scalar_type());
        return x * mask * (1.0 / (1.0 - p_));
    }

  private:
    double p_;
};

class ResidualMlp final : public Layer {
  public:
    ResidualMlp(int64_t dim, int64_t hidden, std::string activation, std::string norm, double eps)
        : dim_(dim), activation_(std::move(activation)), norm_(std::move(norm)), eps_(eps) {
        if (norm_ == "layer_norm") {
            params_.push_back({"norm.weight", {dim}, InitKind::Ones, 0});
            params_.push_back({"norm.bias", {dim}, InitKind::Zeros, 0});
        } else if (norm_ == "rms_norm") {
            params_.push_back({"norm.weight", {dim}, InitKind::Ones, 0});
        }
        params_.push_back(linear_weight("fc1.weight", dim, hidden));
        params_.push_back(linear_bias("fc1.bias", dim, hidden));
        params_.push_back(linear_weight("fc2.weight", hidden, dim));
        params_.push_back(linear_bias("fc2.bias", hidden, dim));
    }
    std::string type() const override { return "residual_mlp"; }
    at::Tensor forward(const std::vector<at::Tensor> &p, const at::Tensor &x,
                       const LayerContext &) const override {
        size_t i = 0;
        at::Tensor h = x;
        if (norm_ == "layer_norm") {
            h = at::layer_norm(x, {dim_}, p[0], p[1], eps_);
            i = 2;
        } else if (norm_ == "rms_norm") {
            h = rms_norm(x, p[0], eps_);
            i = 1;
        }
        h = apply_activation(activation_, at::linear(h, p[i], p[i + 1]));
        return x + at::linear(h, p[i + 2], p[i + 3]);
    }

  private:
    int64_t dim_;
    std::string activation_;
    std::string norm_;
    double eps_;
};

class Flatten final : public Layer {
  public:
    explicit Flatten(int64_t start_dim) : start_dim_(start_dim) {}
    std::string type() const override { return "flatten"; }
    at::Tensor forward(const std::vector<at::Tensor> &, const at::Tensor &x,
                       const LayerContext &) const override {
        return x.flatten(start_dim_);
    }

  private:
    int64_t start_dim_;
};

class Reshape final : public Layer {
  public:
    explicit Reshape(std::vector<int64_t> shape) : shape_(std::move(shape)) {}
    std::string type() const override { return "reshape"; }
    at::Tensor forward(const std::vector<at::Tensor> &, const at::Tensor &x,
                       const LayerContext &) const override {
        // Resolve -1 from the per-sample size, not the total, so an empty batch reshapes too.
        int64_t per_sample = 1, known = 1;
        for (int64_t d = 1; d < x.dim(); ++d)
            per_sample *= x.size(d);
        for (int64_t d : shape_)
            known *= d == -1 ? 1 : d;
        std::vector<int64_t> full{x.size(0)};
        for (int64_t d : shape_)
            full.push_back(d == -1 && known > 0 ? per_sample / known : d);
        return x.reshape(full);
    }

  private:
    std::vector<int64_t> shape_;
};

} // namespace

std::unique_ptr<Layer> make_linear(int64_t in, int64_t out, bool bias) {
    return std::make_unique<Linear>(in, out, bias);
}
std::unique_ptr<Layer> make_embedding(int64_t num, int64_t dim) {
    return std::make_unique<Embedding>(num, dim);
}
std::unique_ptr<Layer> make_layer_norm(int64_t dim, double eps) {
    return std::make_unique<LayerNorm>(dim, eps);
}
std::unique_ptr<Layer> make_rms_norm(int64_t dim, double eps) {
    return std::make_unique<RmsNorm>(dim, eps);
}
std::unique_ptr<Layer> make_activation(const std::string &kind) {
    return std::make_unique<Activation>(kind);
}
std::unique_ptr<Layer> make_dropout(double p) { return std::make_unique<Dropout>(p); }
std::unique_ptr<Layer> make_residual_mlp(int64_t dim, int64_t hidden, const std::string &activation,
                                         const std::string &norm, double eps) {
    return std::make_unique<ResidualMlp>(dim, hidden, activation, norm, eps);
}
std::unique_ptr<Layer> make_flatten(int64_t start_dim) { return std::make_unique<Flatten>(start_dim); }
std::unique_ptr<Layer> make_reshape(std::vector<int64_t> shape) {
    return std::make_unique<Reshape>(std::move(shape));
}

} // namespace rp
