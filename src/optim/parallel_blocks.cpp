#include "optim/parallel_blocks.h"

#include <cstdlib>
#include <cstring>

namespace rp {

bool optimizer_blocks_enabled() {
    static const bool enabled = [] {
        const char *v = std::getenv("RP_OPTIMIZER_BLOCKS");
        return !(v && std::strcmp(v, "0") == 0);
    }();
    return enabled;
}

} // namespace rp
