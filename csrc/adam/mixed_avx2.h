// The 16-bit Adam step (adam_step_mixed) written with AVX2 intrinsics, 16 elements at a time.
//
// Why not the compiler's vectorisation of mixed_range, as for the fp32 step: widening a bf16 to
// a float is `bits << 16` and rounding back takes two more shifts per value, so GCC's loop runs
// ~40 vector shifts per 16 elements. On CPUs with one vector-shift pipe (AMD Zen 1: every 256-bit
// op is two 128-bit halves and shifts issue on one pipe) that made the step with bf16 master and
// moments 2.2x *slower* than the fp32 one it was meant to beat, for fewer bytes moved. Here:
//  - a bf16 load is an in-lane unpack with zeros (the value lands in the upper half of a dword,
//    no shift), which leaves elements in the order {0-3, 8-11} ("lo") and {4-7, 12-15} ("hi");
//    fp32 arrays are loaded in the same order by 128-bit halves, and the in-lane pack of the
//    store puts everything back in order, so the element-wise arithmetic never sees it;
//  - round-to-nearest-even adds 0x7FFF plus the kept part's lowest bit, taken as a compare
//    (-1 or 0) instead of a shift; one shift per value remains before the pack.
// The arithmetic is adam_update's, operation for operation (each intrinsic is one IEEE-rounded
// operation, the fmas where it has std::fma), so results are bitwise those of mixed_range
// (tests/test_cpu_adam.py compares the two paths on the same inputs, NaN and infinity included).
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#define ZE_HAVE_AVX2_PATH 1
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "../common/adam_coefficients.h"

namespace zeroengine::avx2 {

#define ZE_AVX2 __attribute__((target("avx2,fma"), always_inline)) inline

struct Pair {
  __m256 lo, hi;  // elements {0-3, 8-11} and {4-7, 12-15} of a 16-element block
};

// -- storage kinds ---------------------------------------------------------------------------
struct F32 {
  using T = float;
  ZE_AVX2 static Pair load(const float* p) {
    return {_mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(p)), _mm_loadu_ps(p + 8), 1),
            _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(p + 4)), _mm_loadu_ps(p + 12),
                                 1)};
  }
  ZE_AVX2 static void store(float* p, Pair x, __m256i, __m256i) {
    _mm_storeu_ps(p, _mm256_castps256_ps128(x.lo));
    _mm_storeu_ps(p + 8, _mm256_extractf128_ps(x.lo, 1));
    _mm_storeu_ps(p + 4, _mm256_castps256_ps128(x.hi));
    _mm_storeu_ps(p + 12, _mm256_extractf128_ps(x.hi, 1));
  }
};

// bits of a float rounded to bf16 and shifted down (nearest even, or with random low bits).
template <bool kStoch>
ZE_AVX2 __m256i bf16_round(__m256 f, __m256i random) {
  const __m256i bits = _mm256_castps_si256(f);
  __m256i sum;
  if constexpr (kStoch) {
    sum = _mm256_add_epi32(bits, _mm256_and_si256(random, _mm256_set1_epi32(0xFFFF)));
  } else {
    const __m256i bit16 = _mm256_set1_epi32(0x10000);
    const __m256i odd = _mm256_cmpeq_epi32(_mm256_and_si256(bits, bit16), bit16);  // -1 or 0
    sum = _mm256_sub_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), odd);
  }
  return _mm256_srli_epi32(sum, 16);
}

struct BF16 {
  using T = uint16_t;
  ZE_AVX2 static Pair load(const uint16_t* p) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i zero = _mm256_setzero_si256();
    return {_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, x)),
            _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, x))};
  }
  // random_lo/hi: 32 random bits per element (stochastic rounding), else unused.
  template <bool kStoch>
  ZE_AVX2 static void store_rounded(uint16_t* p, Pair x, __m256i random_lo, __m256i random_hi) {
    const __m256i packed = _mm256_packus_epi32(bf16_round<kStoch>(x.lo, random_lo),
                                               bf16_round<kStoch>(x.hi, random_hi));
    const __m256i nan = _mm256_packs_epi32(_mm256_castps_si256(_mm256_cmp_ps(x.lo, x.lo, _CMP_UNORD_Q)),
                                           _mm256_castps_si256(_mm256_cmp_ps(x.hi, x.hi, _CMP_UNORD_Q)));
    const __m256i out = _mm256_blendv_epi8(packed, _mm256_set1_epi16(0x7FC0), nan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), out);
  }
};

// -- the arithmetic: zeroengine::adam_update, operation for operation -------------------------
struct Coefficients {
  __m256 l2, decay, one_minus_beta1, minus_lerp_rest, one_minus_beta2, beta2, inv_bc2_sqrt, eps,
      minus_step_size, grad_coef;
  ZE_AVX2 explicit Coefficients(const AdamCoefficients& c, float grad_coef_)
      : l2(_mm256_set1_ps(c.l2)), decay(_mm256_set1_ps(c.decay)),
        one_minus_beta1(_mm256_set1_ps(c.one_minus_beta1)),
        minus_lerp_rest(_mm256_set1_ps(-c.lerp_rest)),
        one_minus_beta2(_mm256_set1_ps(c.one_minus_beta2)), beta2(_mm256_set1_ps(c.beta2)),
        inv_bc2_sqrt(_mm256_set1_ps(c.inv_bc2_sqrt)), eps(_mm256_set1_ps(c.eps)),
        minus_step_size(_mm256_set1_ps(-c.step_size)), grad_coef(_mm256_set1_ps(grad_coef_)) {}
};

template <bool kLerpFromM>
ZE_AVX2 __m256 update(__m256 param0, __m256 grad0, __m256& m, __m256& v, const Coefficients& c) {
  const __m256 grad = _mm256_fmadd_ps(param0, c.l2, grad0);
  const __m256 param = _mm256_mul_ps(param0, c.decay);
  const __m256 diff = _mm256_sub_ps(grad, m);
  m = kLerpFromM ? _mm256_fmadd_ps(c.one_minus_beta1, diff, m)
                 : _mm256_fmadd_ps(c.minus_lerp_rest, diff, grad);
  v = _mm256_fmadd_ps(_mm256_mul_ps(c.one_minus_beta2, grad), grad, _mm256_mul_ps(v, c.beta2));
  const __m256 denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(v), c.inv_bc2_sqrt), c.eps);
  return _mm256_add_ps(param, _mm256_div_ps(_mm256_mul_ps(c.minus_step_size, m), denom));
}

// MurmurHash3's fmix32 (csrc/common/stochastic_rounding.h) on 8 lanes.
ZE_AVX2 __m256i fmix32(__m256i h) {
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(0x85EBCA6Bu)));
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(0xC2B2AE35u)));
  return _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
}

template <typename S, bool kStoch>
ZE_AVX2 void store(typename S::T* p, Pair x, __m256i index_lo, __m256i index_hi, uint32_t key) {
  if constexpr (kStoch && std::is_same_v<S, BF16>) {
    const __m256i k = _mm256_set1_epi32(static_cast<int>(key));
    S::template store_rounded<true>(p, x, fmix32(_mm256_xor_si256(index_lo, k)),
                                    fmix32(_mm256_xor_si256(index_hi, k)));
  } else if constexpr (std::is_same_v<S, BF16>) {
    S::template store_rounded<false>(p, x, index_lo, index_hi);
  } else {
    S::store(p, x, index_lo, index_hi);
  }
}

// Elements [begin, begin + 16 * blocks) of one piece (see mixed_run): the first at model index
// ``index0`` (its lower 32 bits, which is all fmix32 takes once keys hold the upper half).
// Low: write the bf16 copy of an fp32 master to ``low`` too.
template <typename PT, typename ST, typename GT, bool kLow, bool kStoch, bool kLerpFromM>
__attribute__((target("avx2,fma"))) void range(typename PT::T* __restrict p,
                                               const typename GT::T* __restrict g,
                                               typename ST::T* __restrict m,
                                               typename ST::T* __restrict v,
                                               uint16_t* __restrict low, int64_t begin,
                                               int64_t blocks, uint32_t index0,
                                               const AdamCoefficients& coefficients,
                                               float grad_coef, uint32_t key_p, uint32_t key_m,
                                               uint32_t key_v) {
  const Coefficients c(coefficients, grad_coef);
  // lane offsets of the lo/hi order
  __m256i index_lo = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(index0)),
                                      _mm256_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11));
  __m256i index_hi = _mm256_add_epi32(index_lo, _mm256_set1_epi32(4));
  const __m256i sixteen = _mm256_set1_epi32(16);
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t i = begin + 16 * b;
    Pair mm = ST::load(m + i), vv = ST::load(v + i), pp = PT::load(p + i), gg = GT::load(g + i);
    gg.lo = _mm256_mul_ps(gg.lo, c.grad_coef);
    gg.hi = _mm256_mul_ps(gg.hi, c.grad_coef);
    pp.lo = update<kLerpFromM>(pp.lo, gg.lo, mm.lo, vv.lo, c);
    pp.hi = update<kLerpFromM>(pp.hi, gg.hi, mm.hi, vv.hi, c);
    store<PT, kStoch>(p + i, pp, index_lo, index_hi, key_p);
    store<ST, kStoch>(m + i, mm, index_lo, index_hi, key_m);
    store<ST, kStoch>(v + i, vv, index_lo, index_hi, key_v);
    if constexpr (kLow) BF16::store_rounded<false>(low + i, pp, index_lo, index_hi);
    index_lo = _mm256_add_epi32(index_lo, sixteen);
    index_hi = _mm256_add_epi32(index_hi, sixteen);
  }
}

#undef ZE_AVX2

// Where the CPU has AVX-512 the compiler's x86-64-v4 clone of mixed_range runs instead: 16
// floats per instruction and shifts on more than one port (measured there at 1.03x the fp32
// step, before this kernel existed; this one was measured on AVX2 machines only).
inline bool supported() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          !__builtin_cpu_supports("avx512f");
  return yes;
}

}  // namespace zeroengine::avx2
#endif
