#include "kernels/moe_experts.h"

#include <vector>

#include "kernels/dispatch.h"
#include "kernels/swiglu.h"

namespace rp::kernels {
namespace {

// silu(gate) * up of one projection's output [rows, 2 * expert_hidden] (gate half first).
at::Tensor activate(const at::Tensor &gate_up_out) {
    const int64_t half = gate_up_out.size(-1) / 2;
    at::Tensor gate = gate_up_out.narrow(-1, 0, half), up = gate_up_out.narrow(-1, half, half);
    return supported_dtype(gate.scalar_type()) ? swiglu(gate, up) : at::silu(gate) * up;
}

// rows [n, hidden] sorted by expert, `counts` rows per expert (on the device): the experts'
// outputs [n, hidden], one GEMM pair per non-empty expert. Splitting and unbinding (rather than
// narrowing and selecting per expert) keeps the backward one concatenation and one stack,
// whatever the number of experts.
at::Tensor loop_gemms(const at::Tensor &rows, const at::Tensor &counts, const at::Tensor &gate_up,
                      const at::Tensor &down) {
    const at::Tensor host = counts.to(at::kCPU); // the slice sizes: a synchronisation on GPUs
    const std::vector<int64_t> sizes(host.data_ptr<int64_t>(),
                                     host.data_ptr<int64_t>() + host.numel());
    const std::vector<at::Tensor> slices = rows.split_with_sizes(sizes);
    const std::vector<at::Tensor> gate_ups = gate_up.unbind(0), downs = down.unbind(0);
    std::vector<at::Tensor> outs;
    for (size_t e = 0; e < sizes.size(); ++e)
        if (sizes[e] > 0)
            outs.push_back(at::linear(activate(at::linear(slices[e], gate_ups[e])), downs[e]));
    return at::cat(outs);
}

// The same in two grouped GEMMs; offsets are the cumulated counts, read on the device.
at::Tensor grouped_gemms(const at::Tensor &rows, const at::Tensor &counts,
                         const at::Tensor &gate_up, const at::Tensor &down) {
    const at::Tensor offsets = counts.cumsum(0).to(at::kInt);
    at::Tensor h = at::_grouped_mm(rows, gate_up.transpose(1, 2), offsets);
    return at::_grouped_mm(activate(h), down.transpose(1, 2), offsets);
}

} // namespace

bool grouped_gemm_applies(const at::Tensor &x, const at::Tensor &gate_up) {
    const int64_t hidden = gate_up.size(2), expert_hidden = gate_up.size(1) / 2;
    return x.is_cuda() && x.scalar_type() == at::kBFloat16 && hidden % 8 == 0 &&
           expert_hidden % 8 == 0;
}

at::Tensor moe_experts(const at::Tensor &x, const at::Tensor &experts, const at::Tensor &weights,
                       const at::Tensor &gate_up, const at::Tensor &down, ExpertGemms gemms) {
    TORCH_CHECK_VALUE(x.dim() == 2, "moe_experts: x must be [tokens, hidden], got ", x.sizes());
    const int64_t tokens = x.size(0), hidden = x.size(1);
    TORCH_CHECK_VALUE(gate_up.dim() == 3 && gate_up.size(2) == hidden && gate_up.size(1) % 2 == 0,
                      "moe_experts: gate_up must be [experts, 2 * expert_hidden, ", hidden,
                      "], got ", gate_up.sizes());
    const int64_t num_experts = gate_up.size(0), expert_hidden = gate_up.size(1) / 2;
    TORCH_CHECK_VALUE(down.dim() == 3 && down.size(0) == num_experts && down.size(1) == hidden &&
                          down.size(2) == expert_hidden,
                      "moe_experts: down must be [", num_experts, ", ", hidden, ", ", expert_hidden,
                      "], got ", down.sizes());
    TORCH_CHECK_VALUE(experts.dim() == 2 && experts.size(0) == tokens &&
                          experts.scalar_type() == at::kLong,
                      "moe_experts: experts must be int64 [", tokens, ", k], got ",
                      c10::toString(experts.scalar_type()), " ", experts.sizes());
    TORCH_CHECK_VALUE(
        weights.sizes() == experts.sizes() && weights.scalar_type() == x.scalar_type(),
        "moe_experts: weights must be ", c10::toString(x.scalar_type()), " ", experts.sizes(),
        ", got ", c10::toString(weights.scalar_type()), " ", weights.sizes());
    const int64_t k = experts.size(1), n = tokens * k;
    if (n == 0)
        return at::zeros({tokens, hidden}, x.options());

    // The (token, slot) pairs ordered by expert; stable, so each expert's rows keep token order.
    const at::Tensor flat = experts.reshape({n});
    const at::Tensor order = std::get<1>(flat.sort(/*stable=*/true, 0, /*descending=*/false));
    const at::Tensor counts =
        at::zeros({num_experts}, flat.options()).scatter_add_(0, flat, at::ones_like(flat));
    // Each token once per slot, then permuted: gathering each token k times instead would
    // back-propagate through atomic adds, whose order (and so bf16 rounding) varies between runs
    // on GPUs; this way the backward is a permutation and a sum over the slots.
    const at::Tensor rows =
        x.unsqueeze(1).expand({tokens, k, hidden}).reshape({n, hidden}).index_select(0, order);
    const bool grouped = gemms == ExpertGemms::Grouped ||
                         (gemms == ExpertGemms::Auto && grouped_gemm_applies(x, gate_up));
    const at::Tensor out = grouped ? grouped_gemms(rows, counts, gate_up, down)
                                   : loop_gemms(rows, counts, gate_up, down);

    // Weighted in x's dtype as transformers does, back in (token, slot) order, summed over slots.
    const at::Tensor weighted = out * weights.reshape({n}).index_select(0, order).unsqueeze(1);
    const at::Tensor inverse =
        at::empty_like(order).scatter_(0, order, at::arange(n, order.options()));
    return weighted.index_select(0, inverse).view({tokens, k, hidden}).sum(1);
}

} // namespace rp::kernels
