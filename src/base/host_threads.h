// How many threads the engine's own host threads (the CPU optimizer, the gradient accumulator)
// give their OpenMP teams (ATen's parallel loops and ours).
#pragma once

namespace rp {

// `requested` (RP_OPTIMIZER_THREADS for the optimizer), when a positive count, decides.
// Otherwise, when several processes of one job share this host (`local_world_size`, torchrun's
// $LOCAL_WORLD_SIZE, above one), each takes an even share of the cores it may run on: every rank
// taking every core oversubscribes the host, and a rank's idle OpenMP threads spin on cores that
// the other rank's kernel-launching threads need. torchrun also sets OMP_NUM_THREADS=1 for each
// of several local ranks, which left these threads one core (measured on two H100s, bench/
// RESULTS.md round 13: the gradient accumulation after the pipeline took 472 ms instead of 81),
// so that case does not follow OpenMP's default. One process alone: OpenMP's default
// (`openmp_default`, which OMP_NUM_THREADS sets). Text that is not a positive count is unset.
int host_thread_count(const char *requested, const char *local_world_size, int cores,
                      int openmp_default);

// The cores this process may run on (its CPU affinity), at least 1.
int available_cores();

// Sizes the calling thread's OpenMP teams by host_thread_count (with $LOCAL_WORLD_SIZE, this
// process's cores and the thread's OpenMP default) and returns the count.
int use_host_threads(const char *requested);

} // namespace rp
