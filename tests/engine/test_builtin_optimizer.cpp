// The built-in AdamW with bf16 state (memory-saving mode, src/optim/builtin_optimizer.cpp) and
// the gradients it is given: a parameter's own gradient buffer is zeroed by the pass that reads
// it (the next call accumulates into it), a lent download (BuiltinOptimizer::step's `lent`) is
// read and left as it was (it goes back to the staging pool). Checked against libtorch's
// torch::optim::AdamW for the first step (moments start at zero, so bf16 storage of the moments
// does not enter it yet), and the two kinds of gradient give bit-identical weights.
// Also the update of a table's rows in two parts (adamw_update_bf16_state_rows: the rows a mask
// marks with their gradient, then the others with a zero gradient, nothing read) against the
// whole update of the same table whose unmarked rows' gradient is zero: bit for bit.
// And the loops' split over threads: parallel_blocks covers each index once, and the update on
// several threads (blocks from a shared counter) gives the bits of the update on one.
#include <omp.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include "optim/adamw_kernel.h"
#include "optim/builtin_optimizer.h"
#include "optim/parallel_blocks.h"
#include "optim/sgd_kernel.h"

static int failures = 0;

static void expect(bool ok, const char *what) {
    if (!ok) {
        std::fprintf(stderr, "FAIL: %s\n", what);
        ++failures;
    }
}

namespace {

struct Run {
    std::vector<at::Tensor> params, grads, lives;
};

// Three parameters: several parallel chunks and bf16 blocks, one block with a tail, a few
// elements. Values from a fixed seed.
Run make_run() {
    at::manual_seed(7);
    Run r;
    for (int64_t n : {70000, 5000, 33}) {
        r.params.push_back(at::randn({n}, at::kFloat));
        r.grads.push_back(at::randn({n}, at::kFloat).to(at::kBFloat16));
        r.lives.push_back(at::zeros({n}, at::kBFloat16));
    }
    return r;
}

// A step over every parameter named, or over `which`, refreshing the weight copies `lives`.
rp::StepArrays arrays(const std::vector<at::Tensor> &params, const std::vector<at::Tensor> &grads,
                      const std::vector<at::Tensor> &lives, std::vector<size_t> which = {}) {
    rp::StepArrays a;
    a.params = params;
    a.grads = grads;
    a.lives = lives;
    a.which = std::move(which);
    return a;
}

uint16_t *bits(const at::Tensor &t) {
    return reinterpret_cast<uint16_t *>(t.data_ptr<at::BFloat16>());
}

// One table updated whole, one in two parts; several steps, so the moments carry over.
void check_rows_in_parts() {
    const rp::AdamWHyper h{1e-3, 0.9, 0.999, 1e-8, 1e-2};
    // A width of a whole number of blocks (an embedding's), and odd ones, whose rows start
    // anywhere within a vector and a block of the whole update's pass.
    for (int64_t width : {4096, 4099, 37}) {
        const int64_t rows = 97;
        at::manual_seed(11);
        at::Tensor p_whole = at::randn({rows, width}), p_parts = p_whole.clone();
        const at::Tensor p_start = p_whole.clone();
        at::Tensor m_whole = at::zeros({rows, width}, at::kBFloat16), m_parts = m_whole.clone();
        at::Tensor v_whole = m_whole.clone(), v_parts = m_whole.clone();
        at::Tensor w_whole = m_whole.clone(), w_parts = m_whole.clone();
        for (int64_t step = 1; step <= 3; ++step) {
            at::Tensor used = at::rand({rows}).lt(0.3).to(at::kByte); // rows a call's tokens used
            at::Tensor g =
                (at::randn({rows, width}) * used.unsqueeze(1).to(at::kFloat)).to(at::kBFloat16);
            at::Tensor g_parts = g.clone();
            rp::GradSpan whole_grad;
            whole_grad.bf16 = bits(g);
            rp::adamw_update_bf16_state(p_whole.data_ptr<float>(), whole_grad, bits(m_whole),
                                        bits(v_whole), rows * width, h, step, 5, bits(w_whole),
                                        true);
            rp::GradSpan used_grad;
            used_grad.bf16 = bits(g_parts);
            const uint8_t *mask = used.data_ptr<uint8_t>();
            rp::adamw_update_bf16_state_rows(p_parts.data_ptr<float>(), used_grad, bits(m_parts),
                                             bits(v_parts), 0, rows, width, mask, 1, h, step, 5,
                                             bits(w_parts), true);
            rp::adamw_update_bf16_state_rows(p_parts.data_ptr<float>(), rp::GradSpan(),
                                             bits(m_parts), bits(v_parts), 0, rows, width, mask, 0,
                                             h, step, 5, bits(w_parts), false);
            expect(g_parts.eq(0).all().item<bool>(),
                   "rows in parts: the used rows' gradient zeroed");
        }
        expect(p_parts.equal(p_whole), "rows in parts: the same master weights bit for bit");
        for (auto [a, b] : {std::pair{m_parts, m_whole}, {v_parts, v_whole}, {w_parts, w_whole}})
            expect(a.view(at::kShort).equal(b.view(at::kShort)),
                   "rows in parts: the same moments and weight copy bit for bit");
        expect(!p_whole.equal(p_start), "rows in parts: the steps moved the weights");
    }
}

// BuiltinOptimizer's split update of a table (split_next_update, serve_deferred_rows,
// finish_deferred_rows) against the same optimizer updating the whole table, over three steps
// with a small parameter beside it: bit for bit, the table reported done only once its deferred
// rows are, and a split dropped when the step does not update the table.
void check_split_update() {
    const rp::OptimizerSettings s{rp::OptimizerKind::AdamW, 1e-3, 0.9, 0.999, 1e-8, 1e-2, 0.0};
    const int64_t rows = 53, width = 4099;
    at::manual_seed(13);
    std::vector<at::Tensor> p_whole{at::randn({rows, width}), at::randn({300})};
    std::vector<at::Tensor> p_split{p_whole[0].clone(), p_whole[1].clone()};
    auto zeros_bf16 = [](const at::Tensor &t) { return at::zeros_like(t, at::kBFloat16); };
    std::vector<at::Tensor> w_whole{zeros_bf16(p_whole[0]), zeros_bf16(p_whole[1])};
    std::vector<at::Tensor> w_split{zeros_bf16(p_whole[0]), zeros_bf16(p_whole[1])};
    rp::BuiltinOptimizer whole(rp::OptimizerKind::AdamW, true),
        split(rp::OptimizerKind::AdamW, true);
    for (int step = 1; step <= 3; ++step) {
        const at::Tensor used = at::rand({rows}).lt(0.3).to(at::kByte);
        const at::Tensor next = at::rand({rows}).lt(0.3).to(at::kByte); // the next call's rows
        const at::Tensor g =
            (at::randn({rows, width}) * used.unsqueeze(1).to(at::kFloat)).to(at::kBFloat16);
        const at::Tensor small = at::randn({300}).to(at::kBFloat16);
        std::vector<at::Tensor> g_whole{g.clone(), small.clone()},
            g_split{g.clone(), small.clone()};
        whole.step(arrays(p_whole, g_whole, w_whole), s);
        std::vector<int> done(2, 0);
        auto count = [&](size_t i, bool) { ++done[i]; };
        split.split_next_update(0, used);
        split.step(arrays(p_split, g_split, w_split, {0}), s, count);
        expect(done[0] == 0 && split.has_deferred_rows(),
               "split update: the table is not done while rows are deferred");
        split.step(arrays(p_split, g_split, w_split, {1}), s, count);
        if (step != 2) // step 2: nobody asks for the next call's rows first
            split.serve_deferred_rows(next);
        expect(done[0] == 0, "split update: serving rows does not finish the table");
        split.finish_deferred_rows(count);
        expect(done[0] == 1 && done[1] == 1 && !split.has_deferred_rows(),
               "split update: each parameter reported done once");
        expect(g_split[0].eq(0).all().item<bool>(), "split update: the used rows' gradient zeroed");
    }
    expect(p_split[0].equal(p_whole[0]) && p_split[1].equal(p_whole[1]),
           "split update: the same master weights bit for bit");
    expect(w_split[0].view(at::kShort).equal(w_whole[0].view(at::kShort)),
           "split update: the same weight copy bit for bit");
    // A split for a step that does not update the table is dropped: the table's next update is
    // whole, nothing deferred.
    split.split_next_update(0, at::ones({rows}, at::kByte));
    std::vector<at::Tensor> g_zero{at::zeros({rows, width}, at::kBFloat16),
                                   at::zeros({300}, at::kBFloat16)};
    split.step(arrays(p_split, g_zero, w_split, {1}), s);
    split.step(arrays(p_split, g_zero, w_split), s);
    expect(!split.has_deferred_rows(), "split update: dropped by a step that does not update it");
}

// parallel_blocks hands out every index of a range exactly once, in blocks of the size asked
// (the last one shorter), on more than one thread when there are several blocks.
void check_parallel_blocks() {
    omp_set_num_threads(4);
    const int64_t begin = 5, end = 5 + 10 * 1000 + 7;
    std::vector<std::atomic<int>> seen(end);
    std::atomic<int> wrong_size{0};
    std::vector<std::atomic<int>> by_thread(4);
    std::atomic<int> blocks_taken{0};
    rp::parallel_blocks(begin, end, 1000, [&](int64_t b, int64_t e) {
        if (e - b != 1000 && e != end)
            ++wrong_size;
        ++by_thread[omp_get_thread_num()];
        for (int64_t i = b; i < e; ++i)
            ++seen[i];
        // The first block is held until another block is taken (by another thread, since this
        // one is busy here), for at most 10 s: on a loaded machine one thread could otherwise
        // take every block before the others start.
        if (blocks_taken.fetch_add(1) == 0) {
            const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
            while (blocks_taken.load() == 1 && std::chrono::steady_clock::now() < until)
                std::this_thread::yield();
        }
    });
    bool once = true;
    for (int64_t i = 0; i < end; ++i)
        once = once && seen[i].load() == (i >= begin ? 1 : 0);
    expect(once, "parallel_blocks: each index of the range once, none outside it");
    expect(wrong_size.load() == 0, "parallel_blocks: blocks of the size asked but the last");
    int threads_used = 0;
    for (const auto &n : by_thread)
        threads_used += n.load() > 0;
    expect(threads_used > 1, "parallel_blocks: more than one thread took blocks");
}

// The bf16-state update of a parameter of several blocks (kOptimizerBlock) on four threads
// against the same update on one (which runs the whole range at once), over three steps: bit
// for bit, since an element's rounding is keyed on its index in the parameter.
void check_thread_split() {
    const rp::AdamWHyper h{1e-3, 0.9, 0.999, 1e-8, 1e-2};
    const int64_t n = 4 * rp::kOptimizerBlock + 1234;
    struct State {
        at::Tensor p, m, v, w;
    };
    auto run = [&](int threads) {
        omp_set_num_threads(threads);
        at::manual_seed(17);
        State st{at::randn({n}), at::zeros({n}, at::kBFloat16), at::zeros({n}, at::kBFloat16),
                 at::zeros({n}, at::kBFloat16)};
        for (int64_t step = 1; step <= 3; ++step) {
            at::Tensor g = at::randn({n}).to(at::kBFloat16);
            rp::GradSpan grad;
            grad.bf16 = bits(g);
            rp::adamw_update_bf16_state(st.p.data_ptr<float>(), grad, bits(st.m), bits(st.v), n, h,
                                        step, 3, bits(st.w), true);
        }
        return st;
    };
    const State one = run(1), four = run(4);
    omp_set_num_threads(4);
    expect(four.p.equal(one.p), "thread split: the same master weights bit for bit");
    for (auto [a, b] : {std::pair{four.m, one.m}, {four.v, one.v}, {four.w, one.w}})
        expect(a.view(at::kShort).equal(b.view(at::kShort)),
               "thread split: the same moments and weight copy bit for bit");
}

// Stochastic rounding as bf16_convert.h specifies it, written out here rather than called: 16
// bits of noise added below the kept half of the fp32 pattern, the top half kept.
uint16_t round_by_hand(uint32_t fp32_bits, uint32_t noise16) {
    return static_cast<uint16_t>((fp32_bits + noise16) >> 16);
}

// The memory-saving update (one pass: moments widened, updated and rounded back in registers)
// against the same update from its parts: the fp32 kernel rp::adamw_update, which the first-step
// check below holds to torch::optim::AdamW, on the widened moments and gradient; the moments then
// rounded as bf16_convert.h specifies (one hash of the element's index and the step's salt, its
// low half for exp_avg, its high half for exp_avg_sq); the weight copy a tensor copy of the
// master. Bit for bit, over three steps, for fp32, bf16 and zero gradients, a length that ends
// inside a block, and an inf and a NaN gradient, whose weights alone become NaN.
void check_one_pass_against_parts() {
    const rp::AdamWHyper h{1e-3, 0.9, 0.999, 1e-8, 1e-2};
    const int64_t n = rp::kBf16Block * 3 + 77;
    const uint64_t param_index = 5;
    enum Kind { F32, BF16, ZERO };
    for (Kind kind : {F32, BF16, ZERO}) {
        at::manual_seed(23 + kind);
        const at::Tensor start = at::randn({n});
        at::Tensor p = start.clone(), p_ref = start.clone();
        at::Tensor m = at::zeros({n}, at::kBFloat16), v = at::zeros({n}, at::kBFloat16);
        at::Tensor m_ref = m.clone(), v_ref = v.clone(), w = at::zeros({n}, at::kBFloat16);
        for (int64_t step = 1; step <= 3; ++step) {
            at::Tensor g32 = kind == ZERO ? at::zeros({n}) : at::randn({n});
            if (kind != ZERO && step == 2) {
                g32[10] = INFINITY;
                g32[n - 1] = NAN;
            }
            at::Tensor g16 = g32.to(at::kBFloat16);
            rp::GradSpan grad; // ZERO: no array
            if (kind == F32)
                grad.f32 = g32.data_ptr<float>();
            else if (kind == BF16)
                grad.bf16 = bits(g16);
            // The gradient the parts read: the same values in fp32 (a bf16 one widened exactly).
            at::Tensor g_parts = kind == BF16 ? g16.to(at::kFloat) : g32.clone();
            rp::adamw_update_bf16_state(p.data_ptr<float>(), grad, bits(m), bits(v), n, h, step,
                                        param_index, bits(w), false);

            at::Tensor m32 = m_ref.to(at::kFloat), v32 = v_ref.to(at::kFloat);
            rp::adamw_update(p_ref.data_ptr<float>(), g_parts.data_ptr<float>(),
                             m32.data_ptr<float>(), v32.data_ptr<float>(), n, h, step);
            const uint32_t salt = rp::rounding_salt(step, param_index, 0);
            const uint32_t *mb = reinterpret_cast<const uint32_t *>(m32.data_ptr<float>());
            const uint32_t *vb = reinterpret_cast<const uint32_t *>(v32.data_ptr<float>());
            uint16_t *mr = bits(m_ref), *vr = bits(v_ref);
            for (int64_t i = 0; i < n; ++i) {
                const uint32_t noise = rp::rounding_hash(static_cast<uint32_t>(i) ^ salt);
                mr[i] = round_by_hand(mb[i], noise & 0xFFFFU);
                vr[i] = round_by_hand(vb[i], noise >> 16);
            }
            expect(p.view(at::kInt).equal(p_ref.view(at::kInt)),
                   "one pass: the master weights of the parts, bit for bit");
            expect(m.view(at::kShort).equal(m_ref.view(at::kShort)) &&
                       v.view(at::kShort).equal(v_ref.view(at::kShort)),
                   "one pass: the moments of the parts, bit for bit");
            // A NaN's bits in a tensor copy vary with its code path (bf16_convert.h): NaN is
            // checked as NaN.
            const at::Tensor nan = p_ref.isnan();
            const at::Tensor same = w.view(at::kShort).eq(p_ref.to(at::kBFloat16).view(at::kShort));
            expect(same.logical_or(nan).all().item<bool>() && w.to(at::kFloat).isnan().equal(nan),
                   "one pass: the weight copy is the master in bf16");
        }
        if (kind != ZERO)
            expect(std::isnan(p[10].item<float>()) && std::isnan(p[n - 1].item<float>()),
                   "one pass: an inf or a NaN gradient makes its weight NaN, as torch's does");
        expect(p.isfinite().sum().item<int64_t>() == n - (kind == ZERO ? 0 : 2),
               "one pass: no other weight became non-finite");
        expect((p - start).abs().nan_to_num(0).max().item<double>() > 1e-5,
               "one pass: the steps moved the weights (the comparison is not vacuous)");
    }
}

// The memory-saving SGD (bf16 momentum buffer, one pass, the weight copy written and the gradient
// zeroed in it) against its parts: the fp32 kernel rp::sgd_update (held to torch::optim::SGD by
// c_memory_saving and c_optimizer) on the widened buffer and gradient, the buffer rounded as
// bf16_convert.h specifies (the low half of one hash per element), the weight copy a tensor copy
// of the master. Bit for bit over three steps (the first seeds the buffer), with momentum and
// without, fp32 and bf16 gradients. Then BuiltinOptimizer's SGD step reports such an update
// published, zeroes its own gradient buffer and leaves a lent download as it was.
void check_sgd_one_pass_against_parts() {
    const int64_t n = rp::kBf16Block * 2 + 301;
    const uint64_t param_index = 4;
    for (double momentum : {0.9, 0.0})
        for (bool bf16_grad : {true, false}) {
            const rp::SgdHyper h{0.05, momentum, 0.01};
            at::manual_seed(31);
            const at::Tensor start = at::randn({n});
            at::Tensor p = start.clone(), p_ref = start.clone();
            at::Tensor buf = at::zeros({n}, at::kBFloat16), buf_ref = buf.clone();
            at::Tensor w = at::zeros({n}, at::kBFloat16);
            for (int64_t step = 1; step <= 3; ++step) {
                at::Tensor g = at::randn({n});
                at::Tensor g16 = g.to(at::kBFloat16);
                at::Tensor g_parts = bf16_grad ? g16.to(at::kFloat) : g.clone();
                rp::GradSpan grad;
                if (bf16_grad)
                    grad.bf16 = bits(g16);
                else
                    grad.f32 = g.data_ptr<float>();
                uint16_t *buf_bits = momentum != 0.0 ? bits(buf) : nullptr;
                rp::sgd_update_bf16_state(p.data_ptr<float>(), grad, buf_bits, n, h, step == 1,
                                          step, param_index, bits(w), true);

                at::Tensor buf32 = buf_ref.to(at::kFloat);
                rp::sgd_update(p_ref.data_ptr<float>(), g_parts.data_ptr<float>(),
                               momentum != 0.0 ? buf32.data_ptr<float>() : nullptr, n, h,
                               step == 1);
                const uint32_t salt = rp::rounding_salt(step, param_index, 2);
                const uint32_t *bb = reinterpret_cast<const uint32_t *>(buf32.data_ptr<float>());
                uint16_t *br = bits(buf_ref);
                for (int64_t i = 0; momentum != 0.0 && i < n; ++i)
                    br[i] = round_by_hand(
                        bb[i], rp::rounding_hash(static_cast<uint32_t>(i) ^ salt) & 0xFFFFU);

                expect(p.view(at::kInt).equal(p_ref.view(at::kInt)),
                       "SGD one pass: the master weights of the parts, bit for bit");
                expect(buf.view(at::kShort).equal(buf_ref.view(at::kShort)),
                       "SGD one pass: the momentum buffer of the parts, bit for bit");
                expect(w.view(at::kShort).equal(p_ref.to(at::kBFloat16).view(at::kShort)),
                       "SGD one pass: the weight copy is the master in bf16");
                expect((bf16_grad ? g16.eq(0) : g.eq(0)).all().item<bool>(),
                       "SGD one pass: the gradient is zeroed");
            }
            expect((p - start).abs().max().item<double>() > 1e-3,
                   "SGD one pass: the steps moved the weights (the comparison is not vacuous)");
        }

    // Through BuiltinOptimizer: parameter 0 lent, 1 its own buffer; both published.
    Run run = make_run();
    for (at::Tensor &g : run.grads)
        g = g.clone();
    const at::Tensor lent_before = run.grads[0].clone();
    const rp::OptimizerSettings s{rp::OptimizerKind::Sgd, 0.05, 0.9, 0.999, 1e-8, 0.01, 0.9};
    rp::BuiltinOptimizer opt(rp::OptimizerKind::Sgd, /*bf16_state=*/true);
    rp::StepArrays a = arrays(run.params, run.grads, run.lives, {0, 1});
    a.lent = {1, 0, 0};
    std::vector<int> published(3, -1);
    opt.step(a, s, [&](size_t i, bool p) { published[i] = p ? 1 : 0; });
    expect(published[0] == 1 && published[1] == 1 && published[2] == -1,
           "SGD with bf16 state reports its updates published");
    expect(run.grads[0].equal(lent_before), "SGD: a lent gradient is left as it was");
    expect(run.grads[1].eq(0).all().item<bool>(), "SGD: an own gradient buffer is zeroed");
    for (size_t i : {0, 1})
        expect(
            run.lives[i].view(at::kShort).equal(run.params[i].to(at::kBFloat16).view(at::kShort)),
            "SGD: the weight copy is the master in bf16");
}

} // namespace

int main() {
    const rp::OptimizerSettings s{rp::OptimizerKind::AdamW, 1e-3, 0.9, 0.999, 1e-8, 1e-2, 0.0};

    // Parameters 0 and 2 lent, 1 its own buffer.
    Run lent = make_run();
    std::vector<at::Tensor> lent_before;
    for (const at::Tensor &g : lent.grads)
        lent_before.push_back(g.clone());
    std::vector<at::Tensor> params_before;
    for (const at::Tensor &p : lent.params)
        params_before.push_back(p.clone());
    rp::BuiltinOptimizer lent_opt(rp::OptimizerKind::AdamW, /*bf16_state=*/true);
    std::vector<bool> published(3, false);
    rp::StepArrays lent_arrays = arrays(lent.params, lent.grads, lent.lives);
    lent_arrays.lent = {1, 0, 1};
    lent_opt.step(lent_arrays, s, [&](size_t i, bool p) { published[i] = p; });
    expect(lent.grads[0].equal(lent_before[0]), "a lent gradient is left as it was");
    expect(lent.grads[2].equal(lent_before[2]), "a lent gradient (a few elements) is left");
    expect(lent.grads[1].eq(0).all().item<bool>(), "an own gradient buffer is zeroed");
    for (size_t i = 0; i < 3; ++i)
        expect(published[i], "each update is reported published (weight copy written)");

    // Every gradient its own buffer: all zeroed, the same weights bit for bit.
    Run own = make_run();
    rp::BuiltinOptimizer own_opt(rp::OptimizerKind::AdamW, /*bf16_state=*/true);
    own_opt.step(arrays(own.params, own.grads, own.lives), s);
    for (size_t i = 0; i < 3; ++i) {
        expect(own.grads[i].eq(0).all().item<bool>(), "without `lent` every gradient is zeroed");
        expect(own.params[i].equal(lent.params[i]), "lent or not, the same master weights");
        expect(own.lives[i].view(at::kShort).equal(lent.lives[i].view(at::kShort)),
               "lent or not, the same weight copy");
        // The weight copy is the master rounded to the nearest bf16.
        expect(
            lent.lives[i].view(at::kShort).equal(lent.params[i].to(at::kBFloat16).view(at::kShort)),
            "the weight copy is the master in bf16");
    }

    // The first step against libtorch's AdamW on the same fp32 values and widened gradients.
    // Both compute in fp32; the order of operations differs, so allow a few ulps of the
    // update's size (lr = 1e-3: the first step moves each weight by about lr).
    for (size_t i = 0; i < 3; ++i) {
        at::Tensor p = params_before[i].clone().set_requires_grad(true);
        p.mutable_grad() = lent_before[i].to(at::kFloat);
        torch::optim::AdamW ref({p}, torch::optim::AdamWOptions(s.lr)
                                         .betas(std::make_tuple(s.beta1, s.beta2))
                                         .eps(s.eps)
                                         .weight_decay(s.weight_decay));
        ref.step();
        const double diff = (p.detach() - lent.params[i]).abs().max().item<double>();
        if (diff > 1e-6)
            std::fprintf(stderr, "parameter %zu: max |ours - torch| = %g\n", i, diff);
        expect(diff <= 1e-6, "the first step equals torch::optim::AdamW");
        expect((lent.params[i] - params_before[i]).abs().max().item<double>() > 5e-4,
               "the step moved the weights (the comparison is not vacuous)");
    }

    check_rows_in_parts();
    check_split_update();
    check_parallel_blocks();
    check_thread_split();
    check_one_pass_against_parts();
    check_sgd_one_pass_against_parts();

    if (failures)
        std::fprintf(stderr, "%d check(s) failed\n", failures);
    else
        std::printf("builtin optimizer: lent and own gradients ok\n");
    return failures ? 1 : 0;
}
