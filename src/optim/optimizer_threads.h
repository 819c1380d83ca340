// How many threads the CPU optimizer's parallel loops use.
#pragma once

namespace rp {

// RP_OPTIMIZER_THREADS (`requested`), when a positive count, decides. Otherwise, when several
// processes of one job share this host (`local_world_size`, torchrun's $LOCAL_WORLD_SIZE, above
// one), each takes an even share of the cores it may run on: every rank taking every core
// oversubscribes the host, and a rank's idle OpenMP threads spin on cores that the other rank's
// kernel-launching threads need. torchrun also sets OMP_NUM_THREADS=1 for each of several local
// ranks, which would leave the optimizer one thread, so that case does not follow OpenMP's
// default. One process alone: OpenMP's default (`openmp_default`, which OMP_NUM_THREADS sets).
// Text that is not a positive count counts as unset.
int optimizer_thread_count(const char *requested, const char *local_world_size, int cores,
                           int openmp_default);

// The cores this process may run on (its CPU affinity), at least 1.
int available_cores();

} // namespace rp
