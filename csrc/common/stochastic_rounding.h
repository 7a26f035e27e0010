// Random bits for stochastic rounding, shared by the CPU kernel (csrc/adam/cpu_adam.cpp) and
// the PyTorch path (zeroengine/ops/lowp_adam.py, which computes the same bits in int64 ops).
//
// Counter-based: the bits of an element are a hash of (seed, step, stream, the element's index
// in the model), not a sequence drawn in order, so they are the same whichever rank owns the
// element at whatever world size or stage, and a resumed run draws what an uninterrupted one
// would. The mixer is MurmurHash3's 32-bit finaliser (a bijection with full avalanche);
// 32-bit multiplies vectorise on every x86-64 level.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define ZE_SR_HD __host__ __device__
#else
#define ZE_SR_HD
#endif

namespace zeroengine {

ZE_SR_HD inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

// Per (seed, step, stream): stream 0 the master weights, 1 exp_avg, 2 exp_avg_sq.
ZE_SR_HD inline uint32_t rounding_key(uint64_t seed, int64_t step, uint32_t stream) {
  uint32_t k = fmix32(static_cast<uint32_t>(seed) ^ 0x9E3779B9u);
  k = fmix32(k ^ static_cast<uint32_t>(seed >> 32));
  k = fmix32(k ^ static_cast<uint32_t>(static_cast<uint64_t>(step)));
  k = fmix32(k ^ static_cast<uint32_t>(static_cast<uint64_t>(step) >> 32));
  return fmix32(k ^ (stream * 0x27D4EB2Fu + 1u));
}

ZE_SR_HD inline uint32_t rounding_bits(uint32_t key, uint64_t index) {
  return fmix32(static_cast<uint32_t>(index) ^ fmix32(key ^ static_cast<uint32_t>(index >> 32)));
}

// fp32 -> bf16 bits, rounded up with probability (dropped bits) / 2^16: add 16 random bits
// below the kept ones and truncate. NaN stays a quiet NaN; a carry out of the largest finite
// value gives infinity, as rounding up would.
ZE_SR_HD inline uint16_t bf16_stochastic(float f, uint32_t random) {
#if defined(__CUDA_ARCH__)
  const uint32_t bits = __float_as_uint(f);
#else
  const uint32_t bits = __builtin_bit_cast(uint32_t, f);
#endif
  const uint32_t rounded = (bits + (random & 0xFFFFu)) >> 16;
  return (bits & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t{0x7FC0} : uint16_t(rounded);
}

}  // namespace zeroengine
