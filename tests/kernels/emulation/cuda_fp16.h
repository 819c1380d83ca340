// Stand-in for cuda_fp16.h in the emulation test: c10's half rounds to nearest even, as
// __float2half_rn does.
#pragma once
#include <c10/util/Half.h>
using __half = c10::Half;
inline float __half2float(__half v) { return static_cast<float>(v); }
inline __half __float2half_rn(float v) { return c10::Half(v); }
