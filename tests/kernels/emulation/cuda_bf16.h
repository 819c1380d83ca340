// Stand-in for cuda_bf16.h in the emulation test: c10's bfloat16 rounds to nearest even, as
// __float2bfloat16_rn does.
#pragma once
#include <c10/util/BFloat16.h>
using __nv_bfloat16 = c10::BFloat16;
inline float __bfloat162float(__nv_bfloat16 v) { return static_cast<float>(v); }
inline __nv_bfloat16 __float2bfloat16_rn(float v) { return c10::BFloat16(v); }
