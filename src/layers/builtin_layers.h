// The built-in layer types that a JSON spec can name (docs/semantics.md has the table).
#pragma once
#include <memory>
#include <string>

#include "engine/layer.h"

namespace rp {

std::unique_ptr<Layer> make_linear(int64_t in, int64_t out, bool bias);
std::unique_ptr<Layer> make_embedding(int64_t num, int64_t dim);
std::unique_ptr<Layer> make_layer_norm(int64_t dim, double eps);
std::unique_ptr<Layer> make_rms_norm(int64_t dim, double eps);
// kind: relu, gelu, gelu_tanh, silu, tanh
std::unique_ptr<Layer> make_activation(const std::string &kind);
std::unique_ptr<Layer> make_dropout(double p);
// activation as for make_activation; norm: layer_norm, rms_norm, none
std::unique_ptr<Layer> make_residual_mlp(int64_t dim, int64_t hidden, const std::string &activation,
                                         const std::string &norm, double eps);
std::unique_ptr<Layer> make_flatten(int64_t start_dim);
std::unique_ptr<Layer> make_reshape(std::vector<int64_t> shape);

} // namespace rp
