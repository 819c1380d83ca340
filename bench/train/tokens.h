// Random tokens: one batch per step from a seeded generator, the same for both systems, and a
// borrowed DLPack view of them for the C API.
#pragma once

#include <roundpipe.h>

#include <cstdint>
#include <vector>

namespace tb {

struct TokenStream {
    uint64_t state;
    int64_t vocab;
    uint64_t next() { // splitmix64
        uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
        return z ^ (z >> 31);
    }
    void fill(std::vector<int64_t> &ids) {
        for (int64_t &t : ids)
            t = static_cast<int64_t>(next() % static_cast<uint64_t>(vocab));
    }
};

// The stream both systems draw their batches from.
inline TokenStream token_stream(uint64_t seed, int64_t vocab) {
    return TokenStream{seed * 7919 + 17, vocab};
}

// A borrowed DLPack view of a caller-owned int64 array [batch, seq].
struct DlI64 {
    DLManagedTensor managed{};
    int64_t shape[2];
    DlI64(int64_t *data, int64_t b, int64_t t) {
        shape[0] = b;
        shape[1] = t;
        managed.dl_tensor.data = data;
        managed.dl_tensor.device = {kDLCPU, 0};
        managed.dl_tensor.ndim = 2;
        managed.dl_tensor.dtype = {kDLInt, 64, 1};
        managed.dl_tensor.shape = shape;
        managed.dl_tensor.strides = nullptr;
        managed.dl_tensor.byte_offset = 0;
        managed.manager_ctx = nullptr;
        managed.deleter = nullptr;
    }
    DlI64(const DlI64 &) = delete;
};

} // namespace tb
