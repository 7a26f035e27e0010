// Shared by the CPU and CUDA int8 quantizers: the scale of a block and the divisor used for
// it, so both produce the bytes zeroengine/ops/quantize.py's PyTorch fallback produces.
#pragma once

#include <cfloat>

#ifdef __CUDACC__
#define ZE_HOST_DEVICE __host__ __device__
#else
#define ZE_HOST_DEVICE
#endif

namespace zeroengine {

// max|x| / 127: the block's largest magnitude maps to +-127 (symmetric; -128 unused).
ZE_HOST_DEVICE inline float block_scale(float amax) { return amax / 127.f; }

// An all-zero block has scale 0; dividing by FLT_MIN instead keeps its elements 0.
ZE_HOST_DEVICE inline float safe_divisor(float scale) { return scale > FLT_MIN ? scale : FLT_MIN; }

// Rounded quotients stay in [-127, 127]; the clamp only guards against a last-ulp overshoot.
ZE_HOST_DEVICE inline float clamp127(float v) { return v > 127.f ? 127.f : (v < -127.f ? -127.f : v); }

}  // namespace zeroengine
