// Include order matters: libtorch's dlpack.h first, so roundpipe.h's own DLPack declarations
// (guarded by the same include guard) step aside and both agree on one definition.
#pragma once
#include <ATen/DLConvertor.h>

#include "roundpipe.h"

#include "base/error.h"
