// A parallel loop over [begin, end) whose threads take fixed-size blocks from a shared counter
// instead of one equal share each (at::parallel_for's split). During a training call the
// optimizer's threads share the host's cores with the device workers, the uploaders and the
// caller: a thread that loses its core for a while holds up a whole equal-share loop, while here
// the others take its blocks. The arithmetic of an element does not depend on which thread or
// block runs it (the optimizer's kernels key their rounding on the element's index), so results
// are bit for bit those of any other split.
#pragma once
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "base/env_switch.h"

namespace rp {

// Elements (or their rows' worth) a thread takes at a time in the optimizer's loops: small
// enough that a thread slowed for a while leaves its share to the others, large enough that the
// counter is touched rarely (a 50 M-element matrix is 763 blocks).
constexpr int64_t kOptimizerBlock = 1 << 16;

// Whether the optimizer's loops take blocks from a shared counter (parallel_blocks) or one equal
// share per thread: RP_OPTIMIZER_BLOCKS=0 asks for the equal shares, to measure what the blocks
// give. Read once (an inline function's static is one for the whole program).
inline bool optimizer_blocks_enabled() {
    static const bool enabled = env_switch_on("RP_OPTIMIZER_BLOCKS");
    return enabled;
}

// fn(b, e) over consecutive pieces [b, e) of [begin, end), each `block` long but the last, on the
// calling thread's OpenMP threads (omp_get_max_threads). fn must not throw.
template <class Fn> void parallel_blocks(int64_t begin, int64_t end, int64_t block, const Fn &fn) {
    if (end <= begin)
        return;
    block = std::max<int64_t>(1, block);
    const int64_t blocks = (end - begin + block - 1) / block;
    const int threads = static_cast<int>(std::min<int64_t>(blocks, omp_get_max_threads()));
    if (threads <= 1 || omp_in_parallel()) {
        fn(begin, end);
        return;
    }
    std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(threads)
    {
        for (int64_t k = next.fetch_add(1, std::memory_order_relaxed); k < blocks;
             k = next.fetch_add(1, std::memory_order_relaxed)) {
            const int64_t b = begin + k * block;
            fn(b, std::min(end, b + block));
        }
    }
}

// fn over [begin, end) on the optimizer's threads: blocks of `block` from a shared counter, or
// at::parallel_for's equal shares (at least `grain` each) with RP_OPTIMIZER_BLOCKS=0.
template <class Fn>
void optimizer_parallel_for(int64_t begin, int64_t end, int64_t block, int64_t grain,
                            const Fn &fn) {
    if (optimizer_blocks_enabled())
        parallel_blocks(begin, end, block, fn);
    else
        at::parallel_for(begin, end, grain, fn);
}

} // namespace rp
