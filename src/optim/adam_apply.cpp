#include "optim/adam_apply.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "base/error.h"

namespace rp {
namespace {

struct Span {
    uintptr_t begin, end; // [begin, end)
    size_t entry;
    const char *role;
};

std::string name_of(size_t entry, const char *role) {
    return std::string(role) + " " + std::to_string(entry);
}

std::string shape_str(at::IntArrayRef s) {
    std::string out = "[";
    for (size_t d = 0; d < s.size(); ++d)
        out += (d ? ", " : "") + std::to_string(s[d]);
    return out + "]";
}

void check_entry(const AdamTensors &e, size_t i) {
    const std::pair<const at::Tensor *, const char *> parts[] = {{&e.param, "param"},
                                                                 {&e.grad, "grad"},
                                                                 {&e.exp_avg, "exp_avg"},
                                                                 {&e.exp_avg_sq, "exp_avg_sq"}};
    for (const auto &[t, role] : parts) {
        require(t->defined(), name_of(i, role) + " is NULL");
        require(t->scalar_type() == at::kFloat, name_of(i, role) + " must be float32, got " +
                                                    std::string(c10::toString(t->scalar_type())));
        require(t->device().is_cpu(), name_of(i, role) + " must be in host memory");
        require(t->is_contiguous(), name_of(i, role) + " must be contiguous");
        require(t->sizes() == e.param.sizes(),
                name_of(i, role) + " has shape " + shape_str(t->sizes()) + ", param " +
                    std::to_string(i) + " has " + shape_str(e.param.sizes()));
    }
    require(e.step >= 1, "step " + std::to_string(i) +
                             " must be >= 1 (the 1-based number of "
                             "this update), got " +
                             std::to_string(e.step));
}

Span span_of(const at::Tensor &t, size_t entry, const char *role) {
    const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
    return {begin, begin + t.nbytes(), entry, role};
}

// Written memory must not overlap any other tensor of the call: the kernel reads and writes each
// element once with __restrict pointers, so an overlap would give an answer that depends on the
// thread split. Gradients may share memory with each other (they are only read).
void check_aliasing(const std::vector<AdamTensors> &entries) {
    std::vector<Span> written, read;
    for (size_t i = 0; i < entries.size(); ++i) {
        const AdamTensors &e = entries[i];
        if (e.param.numel() == 0)
            continue; // nothing is touched
        written.push_back(span_of(e.param, i, "param"));
        written.push_back(span_of(e.exp_avg, i, "exp_avg"));
        written.push_back(span_of(e.exp_avg_sq, i, "exp_avg_sq"));
        read.push_back(span_of(e.grad, i, "grad"));
    }
    auto by_begin = [](const Span &a, const Span &b) { return a.begin < b.begin; };
    std::sort(written.begin(), written.end(), by_begin);
    for (size_t k = 1; k < written.size(); ++k)
        require(written[k].begin >= written[k - 1].end,
                name_of(written[k].entry, written[k].role) + " overlaps " +
                    name_of(written[k - 1].entry, written[k - 1].role) +
                    " in memory (each tensor that is updated needs memory of its own)");
    for (const Span &g : read) {
        // The first written span that ends after g begins is the only candidate to check:
        // written spans are disjoint and sorted, so their ends are sorted too.
        auto it = std::upper_bound(written.begin(), written.end(), g.begin,
                                   [](uintptr_t x, const Span &w) { return x < w.end; });
        if (it != written.end())
            require(it->begin >= g.end, name_of(g.entry, g.role) + " overlaps " +
                                            name_of(it->entry, it->role) +
                                            " in memory (a gradient must not share memory "
                                            "with a tensor that is updated)");
    }
}

void check_hyper(const AdamWHyper &h) {
    // torch.optim.Adam's ranges (it accepts eps == 0).
    require(std::isfinite(h.lr) && h.lr >= 0,
            "lr must be finite and >= 0, got " + std::to_string(h.lr));
    require(h.beta1 >= 0 && h.beta1 < 1, "beta1 must be in [0, 1), got " + std::to_string(h.beta1));
    require(h.beta2 >= 0 && h.beta2 < 1, "beta2 must be in [0, 1), got " + std::to_string(h.beta2));
    require(std::isfinite(h.eps) && h.eps >= 0,
            "eps must be finite and >= 0, got " + std::to_string(h.eps));
    require(std::isfinite(h.weight_decay) && h.weight_decay >= 0,
            "weight_decay must be finite and >= 0, got " + std::to_string(h.weight_decay));
}

} // namespace

void adam_apply(const std::vector<AdamTensors> &entries, const AdamWHyper &h, bool decoupled) {
    check_hyper(h);
    for (size_t i = 0; i < entries.size(); ++i)
        check_entry(entries[i], i);
    check_aliasing(entries);
    for (const AdamTensors &e : entries) {
        float *p = e.param.data_ptr<float>();
        const float *g = e.grad.data_ptr<float>();
        float *m = e.exp_avg.data_ptr<float>();
        float *v = e.exp_avg_sq.data_ptr<float>();
        if (decoupled)
            adamw_update(p, g, m, v, e.param.numel(), h, e.step);
        else
            adam_l2_update(p, g, m, v, e.param.numel(), h, e.step);
    }
}

} // namespace rp
