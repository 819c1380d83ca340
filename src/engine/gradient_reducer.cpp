#include "engine/gradient_reducer.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "engine/data_parallel.h"

namespace rp {

void GradientReducer::begin_call(const std::vector<int> &jobs_per_param) {
    pending_ = jobs_per_param;
    parts_.assign(pending_.size(), {});
    sources_.assign(pending_.size(), {});
    buckets_.clear();
    next_ = 0;
    int64_t bytes = 0;
    for (size_t p = pending_.size(); p-- > 0;) {
        if (pending_[p] == 0)
            continue;
        if (buckets_.empty() || bytes >= kBucketBytes) {
            buckets_.emplace_back();
            bytes = 0;
        }
        buckets_.back().push_back(p);
        bytes += store_.at(p).master.numel() * 4;
    }
}

void GradientReducer::receive(std::shared_ptr<GradientDownload> download) {
    for (const auto &g : download->grads) {
        parts_.at(g.first).push_back(g.second);
        sources_[g.first].push_back(download);
    }
}

void GradientReducer::job_done(const std::vector<size_t> &params) {
    std::vector<size_t> seen;
    for (size_t p : params) {
        if (std::find(seen.begin(), seen.end(), p) != seen.end())
            continue; // a parameter two layers of the job share: one job
        seen.push_back(p);
        if (p < pending_.size() && pending_[p] > 0)
            --pending_[p];
    }
}

bool GradientReducer::next_ready() const {
    if (finished())
        return false;
    for (size_t p : buckets_[next_])
        if (pending_[p] > 0)
            return false;
    return true;
}

GradientReducer::Bucket GradientReducer::take_next() {
    Bucket b;
    b.params = buckets_[next_++];
    for (size_t p : b.params) {
        b.parts.push_back(std::move(parts_[p]));
        for (auto &d : sources_[p]) {
            if (std::find(b.downloads.begin(), b.downloads.end(), d) == b.downloads.end())
                b.downloads.push_back(d);
            if (!d->checked) { // a download's checks count once, in its first bucket
                d->checked = true;
                b.checks.insert(b.checks.end(), d->checks.begin(), d->checks.end());
            }
        }
        sources_[p].clear();
    }
    return b;
}

GradientReducer::Reduced GradientReducer::reduce(const Bucket &b, DataParallel &dp) const {
    for (const auto &d : b.downloads)
        d->lane->wait(d->ready); // the download has landed
    double check = 0.0;
    for (const at::Tensor &c : b.checks)
        check += c.item<double>();
    int64_t total = 0;
    for (size_t p : b.params)
        total += store_.at(p).master.numel();
    const int64_t count = static_cast<int64_t>(b.params.size());
    // [gradients..., one presence per parameter, the non-finite flag]
    at::Tensor flat = at::empty({total + count + 1}, at::kFloat);
    float *presence = flat.data_ptr<float>() + total;
    int64_t offset = 0;
    for (int64_t i = 0; i < count; ++i) {
        const int64_t n = store_.at(b.params[i]).master.numel();
        at::Tensor slot = flat.narrow(0, offset, n);
        const auto &parts = b.parts[i];
        if (parts.empty())
            slot.zero_();
        for (size_t k = 0; k < parts.size(); ++k) {
            if (k == 0)
                slot.copy_(parts[k].reshape(-1));
            else
                slot.add_(parts[k].reshape(-1).to(at::kFloat));
        }
        presence[i] = parts.empty() ? 0.0f : 1.0f;
        offset += n;
    }
    presence[count] = std::isfinite(check) ? 0.0f : std::numeric_limits<float>::quiet_NaN();
    dp.sum(flat);
    Reduced r;
    r.nonfinite = !std::isfinite(presence[count]);
    r.scale = 1.0 / dp.world_size();
    offset = 0;
    for (int64_t i = 0; i < count; ++i) {
        const at::Tensor &master = store_.at(b.params[i]).master;
        if (presence[i] > 0.0f) // some rank had a gradient for it
            r.grads.emplace_back(b.params[i],
                                 flat.narrow(0, offset, master.numel()).view(master.sizes()));
        offset += master.numel();
    }
    return r;
}

} // namespace rp
