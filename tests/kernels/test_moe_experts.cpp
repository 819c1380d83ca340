// rp::kernels::moe_experts (src/kernels/moe_experts.*) against the experts' formula evaluated per
// (token, slot) without any sorting, in float64 under autograd: each token's chosen experts'
// gate_up and down matrices gathered and applied one token at a time, weighted and summed
// (transformers' Qwen3MoeExperts). Output and the gradients of x, the routing weights, gate_up
// and down, for both GEMM strategies (one GEMM per expert, and at::_grouped_mm), in fp32, bf16
// and fp64 (the unfused SwiGLU), with experts that receive no token, every token on one expert,
// and an empty batch; the two strategies against each other, and repeated runs bit for bit.
// RP_TEST_DEVICE=cuda runs them on a GPU, where Auto takes the grouped GEMM for bf16.
#include "kernel_test.h"
#include "kernels/moe_experts.h"

namespace {

using rp::kernels::ExpertGemms;

at::Tensor leaf(const at::Tensor &t) { return t.detach().clone().set_requires_grad(true); }

// fp32: the same products summed in other orders (GEMM blocking, the slot sum) over at most 64
// terms: a few ulps, 1e-5 relative, plus 1e-6 of the largest value for elements that
// cancellation makes small; fp64 the same at its precision (1e-12, 1e-13). bf16 against the fp64
// formula: the computation rounds to bf16 after gate_up, SwiGLU, down and the weighting
// (transformers' rounding points), each at most half an ulp (2^-8 relative), and those errors pass
// through the next GEMM: 4 ulps relative, plus 2 ulps of the largest value for the sums over slots
// and GEMM rows that cancel.
kt::Tol tol(at::ScalarType t) {
    if (t == at::kBFloat16)
        return {4 * 0x1p-8, 2 * 0x1p-8};
    if (t == at::kDouble)
        return {1e-12, 1e-13};
    return {1e-5, 1e-6};
}

struct Case {
    int64_t tokens, hidden, expert_hidden, experts, k;
    int64_t unused_expert; // never routed to (-1: none)
    bool one_expert;       // every token's first slot on expert 0 (k == 1)
};

struct Inputs {
    at::Tensor x, experts, weights, gate_up, down, gy;
};

Inputs make_inputs(const Case &c, at::ScalarType dtype, c10::Device device) {
    Inputs in;
    in.x = kt::randn({c.tokens, c.hidden}, dtype, device);
    // Distinct experts per token, as top-k gives them.
    at::Tensor scores = at::rand({c.tokens, c.experts}, at::kDouble);
    if (c.unused_expert >= 0)
        scores.select(1, c.unused_expert).fill_(-1.0);
    if (c.one_expert)
        scores.select(1, 0).fill_(2.0);
    in.experts = std::get<1>(scores.topk(c.k, -1)).to(device);
    in.weights = at::softmax(at::randn({c.tokens, c.k}, at::kDouble), -1).to(dtype).to(device);
    // Weights of the scale transformers initialises (0.02) keep the expert outputs far from
    // saturating silu; x of unit scale keeps them away from zero.
    in.gate_up = kt::randn({c.experts, 2 * c.expert_hidden, c.hidden}, dtype, device, 0.2);
    in.down = kt::randn({c.experts, c.hidden, c.expert_hidden}, dtype, device, 0.2);
    in.gy = kt::randn({c.tokens, c.hidden}, dtype, device);
    return in;
}

struct Result {
    at::Tensor y, dx, dweights, dgate_up, ddown;
};

Result run(const Inputs &in, ExpertGemms gemms) {
    at::Tensor x = leaf(in.x), w = leaf(in.weights), gu = leaf(in.gate_up), dn = leaf(in.down);
    at::Tensor y = rp::kernels::moe_experts(x, in.experts, w, gu, dn, gemms);
    Result r;
    r.y = y.detach();
    if (y.numel() == 0)
        return r;
    auto g = torch::autograd::grad({y}, {x, w, gu, dn}, {in.gy}, /*retain_graph=*/false,
                                   /*create_graph=*/false, /*allow_unused=*/true);
    r.dx = g[0];
    r.dweights = g[1];
    r.dgate_up = g[2];
    r.ddown = g[3];
    return r;
}

// The formula per (token, slot), in float64 on the CPU, from the same (rounded) inputs.
Result reference(const Inputs &in) {
    auto f64 = [](const at::Tensor &t) { return leaf(t.to(at::kCPU, at::kDouble)); };
    at::Tensor x = f64(in.x), w = f64(in.weights), gu = f64(in.gate_up), dn = f64(in.down);
    const at::Tensor experts = in.experts.to(at::kCPU);
    const int64_t tokens = x.size(0), k = experts.size(1), half = gu.size(1) / 2;
    std::vector<at::Tensor> rows;
    for (int64_t t = 0; t < tokens; ++t) {
        at::Tensor sum = at::zeros({x.size(1)}, x.options());
        for (int64_t j = 0; j < k; ++j) {
            const int64_t e = experts[t][j].item<int64_t>();
            at::Tensor h = at::mv(gu[e], x[t]);
            at::Tensor act = at::silu(h.narrow(0, 0, half)) * h.narrow(0, half, half);
            sum = sum + w[t][j] * at::mv(dn[e], act);
        }
        rows.push_back(sum);
    }
    at::Tensor y = at::stack(rows);
    auto g = torch::autograd::grad({y}, {x, w, gu, dn}, {in.gy.to(at::kCPU, at::kDouble)}, false,
                                   false, /*allow_unused=*/true);
    return {y.detach(), g[0], g[1], g[2], g[3]};
}

void compare(kt::Checker &c, const std::string &name, const Result &got, const Result &want,
             kt::Tol tol) {
    auto as = [&](const at::Tensor &w) { return w.to(got.y.scalar_type()); };
    c.close(name + " y", got.y, as(want.y), tol);
    if (got.y.numel() == 0)
        return;
    c.close(name + " dx", got.dx, as(want.dx), tol);
    c.close(name + " dweights", got.dweights, as(want.dweights), tol);
    c.close(name + " dgate_up", got.dgate_up, as(want.dgate_up), tol);
    c.close(name + " ddown", got.ddown, as(want.ddown), tol);
}

void identical(kt::Checker &c, const std::string &name, const Result &a, const Result &b) {
    c.close(name + " y", a.y, b.y, {0, 0});
    c.close(name + " dx", a.dx, b.dx, {0, 0});
    c.close(name + " dgate_up", a.dgate_up, b.dgate_up, {0, 0});
}

std::string describe(const Case &c, at::ScalarType dtype) {
    return std::string("moe_experts ") + c10::toString(dtype) + " tokens " +
           std::to_string(c.tokens) + " hidden " + std::to_string(c.hidden) + "/" +
           std::to_string(c.expert_hidden) + " top-" + std::to_string(c.k) + " of " +
           std::to_string(c.experts);
}

} // namespace

int main() {
    c10::Device device(c10::kCPU);
    if (!kt::test_device(device))
        return kt::kSkip;
    at::manual_seed(18);
    kt::Checker c;
    const std::vector<Case> cases = {
        {37, 32, 16, 6, 2, 3, false}, // expert 3 receives nothing
        {64, 64, 24, 8, 3, -1, false},
        {9, 32, 16, 4, 1, -1, true}, // every token on expert 0
        {5, 16, 8, 2, 2, -1, false}, // k == experts
    };
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kDouble}) {
        for (const Case &cs : cases) {
            const Inputs in = make_inputs(cs, dtype, device);
            const std::string name = describe(cs, dtype);
            const Result want = reference(in);
            const Result loop = run(in, ExpertGemms::Loop);
            compare(c, name + " loop", loop, want, tol(dtype));
            identical(c, name + " loop repeated", loop, run(in, ExpertGemms::Loop));
            if (dtype == at::kDouble)
                continue; // at::_grouped_mm takes float32, bfloat16 and float16
            const Result grouped = run(in, ExpertGemms::Grouped);
            compare(c, name + " grouped", grouped, want, tol(dtype));
            compare(c, name + " grouped vs loop", grouped, loop, tol(dtype));
            identical(c, name + " grouped repeated", grouped, run(in, ExpertGemms::Grouped));
            // What a model runs: Auto picks the grouped GEMM for bf16 on GPUs.
            compare(c, name + " auto", run(in, ExpertGemms::Auto), want, tol(dtype));
        }
        // A batch without tokens (the engine's shape check runs one): zeros [0, hidden].
        const Inputs empty = make_inputs({0, 32, 16, 4, 2, -1, false}, dtype, device);
        const Result none = run(empty, ExpertGemms::Auto);
        if (none.y.sizes() != at::IntArrayRef({0, 32}))
            c.fail(std::string("moe_experts ") + c10::toString(dtype) +
                   " empty batch: output is not [0, 32]");
    }
    return c.finish("test_moe_experts");
}
