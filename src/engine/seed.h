// Deterministic seeds. Dropout masks and initial weights are pure functions of the model seed
// and their coordinates, so recompute replays them exactly and no result depends on the
// number of devices or on thread timing. docs/semantics.md states the rule for users.
#pragma once
#include <cstdint>

namespace rp {

// SplitMix64's finaliser: a cheap bijective mixer with good avalanche.
inline uint64_t mix(uint64_t x) {
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

inline uint64_t dropout_seed(uint64_t seed, uint64_t call, uint64_t layer, uint64_t microbatch) {
    return mix(mix(mix(mix(seed) ^ call) ^ layer) ^ microbatch);
}

inline uint64_t init_seed(uint64_t seed, uint64_t layer) {
    return mix(mix(seed) ^ (0x1000000ULL + layer));
}

} // namespace rp
