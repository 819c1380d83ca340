#include "base/thread_name.h"

#include <pthread.h>

namespace rp {

void name_this_thread(const std::string &name) {
    constexpr size_t kMaxLength = 15; // TASK_COMM_LEN less the terminating zero
    const std::string kept = name.substr(0, kMaxLength);
    pthread_setname_np(pthread_self(), kept.c_str()); // fails only for a too-long name
}

} // namespace rp
