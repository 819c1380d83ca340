#include "engine/final_gradients.h"

#include <torch/csrc/autograd/variable.h>

#include "base/error.h"
#include "kernels/nonfinite.h"

namespace rp {
namespace {

// Gradients leave the device in the model dtype (half the bytes for bf16); the accumulator widens
// them to fp32 on the host as they land. With each group goes one number per gradient that says
// whether any element is inf or nan (rp::kernels::nonfinite_flag: 0 or +inf, from one read of
// the gradient on the device), so the host is spared a second pass over the bytes.
// A row gradient (an embedding's sparse COO tensor, LayerContext::row_gradients) travels as its
// row indices and its rows, and lands as a sparse host tensor of the same rows.
// `interim`: an earlier microbatch's rows (GradAccumulator::add).
void download_group(CallContext &ctx, std::vector<std::pair<size_t, at::Tensor>> grads,
                    std::vector<at::Tensor> checks, DeviceLane &lane, size_t job,
                    std::shared_ptr<void> after, bool interim) {
    if (grads.empty())
        return;
    std::vector<at::Tensor> device;
    for (const auto &g : grads) {
        if (g.second.is_sparse()) {
            device.push_back(g.second._indices().contiguous());
            device.push_back(g.second._values().contiguous());
        } else {
            device.push_back(g.second);
        }
    }
    const size_t num_grad_tensors = device.size();
    device.insert(device.end(), checks.begin(), checks.end());
    Transfer host = lane.download(device, job, Payload::Gradients, std::move(after));
    size_t next = 0;
    for (auto &g : grads) {
        if (g.second.is_sparse()) {
            const at::Tensor &rows = host.tensors[next++];
            const at::Tensor &values = host.tensors[next++];
            g.second = at::_sparse_coo_tensor_unsafe(rows, values, g.second.sizes());
        } else {
            g.second = host.tensors[next++];
        }
    }
    std::vector<at::Tensor> landed_checks(
        host.tensors.begin() + static_cast<long>(num_grad_tensors), host.tensors.end());
    ctx.gradients->add(std::move(grads), std::move(landed_checks), std::move(host), lane, interim);
}

// The non-finite check (see download_group); a row gradient's covers its rows. (It was a float64
// sum before: ATen widens a bf16 tensor to a float64 copy for such a sum, 18 bytes of device
// memory traffic per element against the flag's 2, in the last microbatch of every stage.)
at::Tensor nonfinite_check(const at::Tensor &grad) {
    return kernels::nonfinite_flag(grad.is_sparse() ? grad._values() : grad);
}

int64_t bytes_of(const at::Tensor &grad) {
    if (grad.is_sparse())
        return static_cast<int64_t>(grad._values().nbytes() + grad._indices().nbytes());
    return static_cast<int64_t>(grad.nbytes());
}

} // namespace

void send_row_gradients(CallContext &ctx, const std::vector<std::pair<size_t, at::Tensor>> &leaves,
                        DeviceLane &lane, size_t job, size_t m) {
    if (!ctx.row_gradients || m + 1 == ctx.num_microbatches()) // the last: FinalGradients's
        return;
    at::NoGradGuard no_grad;
    std::vector<std::pair<size_t, at::Tensor>> grads;
    std::vector<at::Tensor> checks;
    for (const auto &leaf : leaves) {
        const at::Tensor g = leaf.second.grad();
        if (!g.defined() || !g.is_sparse())
            continue;
        checks.push_back(nonfinite_check(g));
        grads.emplace_back(leaf.first, g);
        leaf.second.mutable_grad() = at::Tensor(); // the next microbatch's rows start afresh
    }
    download_group(ctx, std::move(grads), std::move(checks), lane, job, lane.mark_compute(),
                   /*interim=*/true);
}

struct FinalGradients::Hook final : torch::autograd::PostAccumulateGradHook {
    Hook(FinalGradients *owner, size_t leaf) : owner_(owner), leaf_(leaf) {}
    void operator()(const torch::autograd::Variable &tensor) override {
        const at::Tensor g = tensor.grad();
        if (!g.defined()) // nothing accumulated (a caller layer gave no gradient)
            return;
        at::NoGradGuard no_grad;
        at::Tensor check = nonfinite_check(g);
        std::lock_guard<std::mutex> lock(owner_->mutex_);
        owner_->add(leaf_, g, std::move(check));
        if (owner_->bytes_ >= kGroupBytes)
            owner_->flush();
    }
    FinalGradients *owner_;
    size_t leaf_;
};

FinalGradients::FinalGradients(CallContext &ctx,
                               const std::vector<std::pair<size_t, at::Tensor>> &leaves,
                               DeviceLane &lane, size_t job)
    : ctx_(ctx), leaves_(leaves), lane_(lane), job_(job), sent_(leaves.size(), false) {
    for (size_t i = 0; i < leaves_.size(); ++i)
        torch::autograd::impl::set_post_acc_grad_hooks(leaves_[i].second,
                                                       std::make_unique<Hook>(this, i));
}

FinalGradients::~FinalGradients() {
    for (auto &leaf : leaves_)
        torch::autograd::impl::set_post_acc_grad_hooks(leaf.second, nullptr);
}

void FinalGradients::finish() {
    std::lock_guard<std::mutex> lock(mutex_);
    flush();
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < leaves_.size(); ++i) {
        const at::Tensor g = leaves_[i].second.grad();
        if (!sent_[i] && g.defined())
            add(i, g, nonfinite_check(g));
    }
    flush();
}

void FinalGradients::add(size_t leaf, const at::Tensor &grad, at::Tensor check) {
    sent_[leaf] = true;
    grads_.emplace_back(leaves_[leaf].first, grad);
    checks_.push_back(std::move(check));
    bytes_ += bytes_of(grad);
}

void FinalGradients::flush() {
    if (grads_.empty())
        return;
    std::shared_ptr<void> ready = lane_.mark_compute();
    if (ctx_.device_reduction)
        ready = average_over_ranks();
    download_group(ctx_, std::move(grads_), std::move(checks_), lane_, job_, std::move(ready),
                   /*interim=*/false);
    grads_.clear();
    checks_.clear();
    bytes_ = 0;
}

std::shared_ptr<void> FinalGradients::average_over_ranks() {
    // One collective per group: the gradients side by side in one buffer (a copy in device
    // memory, cheap next to the transfer), their non-finite flags in another (summed). The
    // downloads then read the averages; a flag is inf when any rank's gradients held inf or
    // nan, so every rank makes the same skip decision.
    // The call gives no row gradients when it reduces (GradAccumulator::takes_row_gradients).
    std::vector<at::Tensor> flat_parts;
    for (const auto &g : grads_) {
        require(!g.second.is_sparse(), "a row gradient reached the device reduction");
        flat_parts.push_back(g.second.reshape(-1));
    }
    at::Tensor flat = at::cat(flat_parts);
    at::Tensor flags = at::stack(checks_);
    std::shared_ptr<void> ready = ctx_.device_reduction->average_on_device(flat, flags);
    int64_t offset = 0;
    for (auto &g : grads_) {
        const int64_t n = g.second.numel();
        g.second = flat.narrow(0, offset, n).view(g.second.sizes());
        offset += n;
    }
    checks_ = flags.unbind(0);
    return ready;
}

} // namespace rp
