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

// The CPU optimizer's count: host_thread_count, except that one process alone in standard mode
// (`beside_whole_calls`: each step runs beside the whole next call, which it need only keep pace
// with) takes half of OpenMP's default. Its threads share the host with the device workers'
// kernel launches and the uploads, and fewer of them slow the devices less: with half the cores,
// Qwen3-1.7B in standard mode ran 2.6-5.9% faster (bench/RESULTS.md: one H200 host of 16 cores in
// round 2; two H200s on 32 cores in rounds 16 and 30), while 24 of 32 gained nothing (rounds 19
// and 30). Memory-saving mode keeps every thread: its in-call updates set the pace, and half of 16
// cores cost its Qwen3-8B run 22% (round 2).
int optimizer_thread_count(const char *requested, const char *local_world_size, int cores,
                           int openmp_default, bool beside_whole_calls);

// The cores this process may run on (its CPU affinity), at least 1.
int available_cores();

// Sizes the calling thread's OpenMP teams by host_thread_count (with $LOCAL_WORLD_SIZE, this
// process's cores and the thread's OpenMP default) and returns the count.
int use_host_threads(const char *requested);

// Sizes the calling thread's OpenMP teams by optimizer_thread_count, with $RP_OPTIMIZER_THREADS,
// $LOCAL_WORLD_SIZE, this process's cores and the thread's OpenMP default; returns the count.
int use_optimizer_threads(bool beside_whole_calls);

} // namespace rp
