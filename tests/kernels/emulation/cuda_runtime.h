// Stand-in for the CUDA runtime header when src/kernels/*.cu are compiled as host C++ by the
// emulation test (tests/kernels/emulation/): a block's threads are std::threads, __syncthreads
// and __shfl_xor_sync are barriers, __shared__ variables are function statics (blocks run one
// after another). Only what our kernels use. Lanes that skip a shuffle their warp performs
// deadlock here, as they would misbehave on a GPU; the test's timeout reports it.
#pragma once
#include <math.h>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

typedef enum {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorNotSupported = 801
} cudaError_t;
typedef void *cudaStream_t;
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline const char *cudaGetErrorString(cudaError_t) { return "emulated CUDA error"; }

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct EmuDim3 {
    unsigned x = 1, y = 1, z = 1;
};
inline thread_local EmuDim3 threadIdx, blockIdx, blockDim, gridDim;

// A reusable barrier (C++17 has none).
class EmuBarrier {
  public:
    explicit EmuBarrier(int n) : n_(n) {}
    void wait() {
        std::unique_lock<std::mutex> lock(m_);
        const long gen = gen_;
        if (++count_ == n_) {
            count_ = 0;
            ++gen_;
            cv_.notify_all();
            return;
        }
        cv_.wait(lock, [&] { return gen_ != gen; });
    }

  private:
    std::mutex m_;
    std::condition_variable cv_;
    int n_, count_ = 0;
    long gen_ = 0;
};

struct EmuBlock {
    std::unique_ptr<EmuBarrier> block;
    std::vector<std::unique_ptr<EmuBarrier>> warps;
    float lanes[32][32];
    std::vector<float> dynamic_shared;
};
inline EmuBlock *emu_block = nullptr;

inline void __syncthreads() { emu_block->block->wait(); }

inline float __shfl_xor_sync(unsigned, float v, int offset) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    emu_block->lanes[warp][lane] = v;
    emu_block->warps[warp]->wait();
    const float other = emu_block->lanes[warp][lane ^ offset];
    emu_block->warps[warp]->wait();
    return other;
}

inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }

// `extern __shared__ float tile[];` becomes `float *tile = emu_dynamic_shared();`.
inline float *emu_dynamic_shared() { return emu_block->dynamic_shared.data(); }

// `kernel<<<grid, threads, shared, stream>>>(args)` becomes emu_launch(grid, threads, shared,
// stream, kernel, args). Refuses what a GPU would refuse (block shape, shared memory).
template <class Kernel, class... Args>
void emu_launch(long long grid, long long threads, size_t shared, cudaStream_t, Kernel kernel,
                Args... args) {
    if (grid <= 0 || threads <= 0 || threads > 1024 || threads % 32 != 0 || shared > 48 * 1024) {
        std::fprintf(stderr, "emulated launch refused: grid %lld, block %lld, shared %zu\n", grid,
                     threads, shared);
        std::abort();
    }
    for (long long b = 0; b < grid; ++b) {
        EmuBlock block;
        block.block = std::make_unique<EmuBarrier>(static_cast<int>(threads));
        for (long long w = 0; w < threads / 32; ++w)
            block.warps.push_back(std::make_unique<EmuBarrier>(32));
        // NaN-filled: a read of shared memory nobody wrote poisons the result.
        block.dynamic_shared.assign(shared / sizeof(float) + 1, nanf(""));
        emu_block = &block;
        std::vector<std::thread> threads_of_block;
        for (long long t = 0; t < threads; ++t)
            threads_of_block.emplace_back([&, t] {
                threadIdx.x = static_cast<unsigned>(t);
                blockIdx.x = static_cast<unsigned>(b);
                blockDim.x = static_cast<unsigned>(threads);
                gridDim.x = static_cast<unsigned>(grid);
                kernel(args...);
            });
        for (std::thread &t : threads_of_block)
            t.join();
    }
}
