// One-pass Adam/AdamW over flat fp32 buffers on the CPU: reads p, g, m, v once and writes
// p, m, v (and, when given, the bf16/fp16 copy of p the model computes with) in the same pass.
//
// Adam is memory-bound, so the only things that matter are touching each byte once and keeping
// every core's vector units fed: the loop body is plain scalar code that GCC vectorises, compiled
// three times by target_clones (x86-64-v4 = AVX-512, x86-64-v3 = AVX2+FMA, baseline x86-64;
// note "avx2,fma" in one string would make two clones, AVX2 without FMA) and picked at load time by
// the CPU's features; at::parallel_for splits the elements across torch's intra-op threads.
// Built with -fno-math-errno: otherwise sqrt must keep errno semantics and GCC will not
// vectorise the loop at all.
// The arithmetic is adam_update of csrc/common/adam_coefficients.h, shared with the CUDA kernel:
// torch.optim.AdamW's single-tensor path operation by operation (lerp for m, mul+addcmul for v,
// sqrt(v)/sqrt(bc2)+eps, addcdiv), within one float32 ulp of it (tests/test_cpu_adam.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../common/adam_coefficients.h"
#include "../common/stochastic_rounding.h"
#include "mixed_avx2.h"

namespace {

using zeroengine::AdamCoefficients;

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ZE_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ZE_CLONES
#endif

// The low-precision copy is written as raw 16-bit patterns by branch-free converters GCC can
// vectorise: c10::BFloat16/Half's own constructors branch per element (NaN, subnormals), which
// keeps the whole loop scalar and made the copy-out pass 4x slower than the update itself.
// Both round to nearest even, bit for bit what torch's .to(dtype) gives.
struct ToBFloat16 {
  static inline uint16_t convert(float f) {
    const uint32_t bits = __builtin_bit_cast(uint32_t, f);
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    return (bits & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t{0x7FC0} : uint16_t(rounded);
  }
};

// float -> IEEE half, round to nearest even, all three cases computed and one selected (GCC 12
// does not vectorise a float -> _Float16 cast without AVX512-FP16). Subnormal results: adding
// 0.5 (as a float) lines the 10 mantissa bits up at the bottom, so the FPU does the rounding.
struct ToHalf {
  static inline uint16_t convert(float f) {
    uint32_t x = __builtin_bit_cast(uint32_t, f);
    const uint32_t sign = x & 0x80000000u;
    x ^= sign;
    constexpr uint32_t kF32Inf = 255u << 23, kOverflow = (127u + 16u) << 23;
    constexpr uint32_t kMinNormal = 113u << 23;                    // 2^-14
    constexpr uint32_t kMagic = ((127u - 15u) + (23u - 10u) + 1u) << 23;  // 0.5f
    const uint32_t subnormal =
        __builtin_bit_cast(uint32_t, __builtin_bit_cast(float, x) +
                                         __builtin_bit_cast(float, kMagic)) - kMagic;
    const uint32_t normal = (x + (15u << 23) - (127u << 23) + 0xFFFu + ((x >> 13) & 1u)) >> 13;
    // Selection by bit masks: GCC leaves nested ?: here as control flow, which stops it from
    // vectorising the loop. x has no sign bit now, so signed compares are exact (AVX2 has
    // only signed ones).
    const int32_t xs = static_cast<int32_t>(x);
    const uint32_t nan = -static_cast<uint32_t>(xs > int32_t{kF32Inf});
    const uint32_t over = -static_cast<uint32_t>(xs >= int32_t{kOverflow});
    const uint32_t tiny = -static_cast<uint32_t>(xs < int32_t{kMinNormal});
    const uint32_t special = 0x7C00u | (nan & 0x0200u);  // inf, or a quiet NaN
    const uint32_t out = (over & special) |
                         (~over & ((tiny & subnormal) | (~tiny & normal)));
    return static_cast<uint16_t>(out | (sign >> 16));
  }
};

// kLow: also write the low-precision copy; kLerpFromM: which of torch's two lerp formulas
// applies (1 - beta1 < 0.5 or not). Both are compile-time choices: a loop-invariant ?: over
// floating-point arms stays control flow in GCC (it may not speculate FP ops that could trap),
// and control flow stops vectorisation.
template <typename Convert, bool kLow, bool kLerpFromM>
ZE_CLONES void adam_range(float* __restrict p, const float* __restrict g, float* __restrict m,
                          float* __restrict v, uint16_t* __restrict low, int64_t begin,
                          int64_t end, AdamCoefficients c) {
  for (int64_t i = begin; i < end; ++i) {
    float mi = m[i], vi = v[i];
    const float param = zeroengine::adam_update<kLerpFromM>(p[i], g[i], mi, vi, c);
    m[i] = mi;
    v[i] = vi;
    p[i] = param;
    if constexpr (kLow) low[i] = Convert::convert(param);
  }
}

template <typename Convert, bool kLow>
void adam_parallel(float* p, const float* g, float* m, float* v, uint16_t* low, int64_t n,
                   const AdamCoefficients& c) {
  const int64_t grain = 1 << 15;
  at::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
    if (c.lerp_from_m) {
      adam_range<Convert, kLow, true>(p, g, m, v, low, b, e, c);
    } else {
      adam_range<Convert, kLow, false>(p, g, m, v, low, b, e, c);
    }
  });
}

// -- masters and states in 16 bits (adam_step_mixed) -----------------------------------------
// Storage kinds: how a float is read from and written to one buffer. ``store`` takes 32 random
// bits, used only where rounding is stochastic (kStoch) and the storage is bf16.
inline float bf16_load(uint16_t b) { return __builtin_bit_cast(float, uint32_t(b) << 16); }

// IEEE half -> float, branch-free (normal, subnormal and inf/NaN by selection), exact.
inline float half_load(uint16_t h) {
  const uint32_t w = uint32_t(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized =
      __builtin_bit_cast(float, (two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = __builtin_bit_cast(float, (two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t denorm = -static_cast<uint32_t>(two_w < (1u << 27));
  const uint32_t bits = (denorm & __builtin_bit_cast(uint32_t, denormalized)) |
                        (~denorm & __builtin_bit_cast(uint32_t, normalized));
  return __builtin_bit_cast(float, sign | bits);
}

struct F32 {
  using T = float;
  static inline float load(const T* p, int64_t i) { return p[i]; }
  template <bool kStoch>
  static inline void store(T* p, int64_t i, float f, uint32_t) { p[i] = f; }
};
struct BF16 {
  using T = uint16_t;
  static inline float load(const T* p, int64_t i) { return bf16_load(p[i]); }
  template <bool kStoch>
  static inline void store(T* p, int64_t i, float f, uint32_t random) {
    p[i] = kStoch ? zeroengine::bf16_stochastic(f, random) : ToBFloat16::convert(f);
  }
};
struct F16 {
  using T = uint16_t;
  static inline float load(const T* p, int64_t i) { return half_load(p[i]); }
  template <bool kStoch>
  static inline void store(T* p, int64_t i, float f, uint32_t) { p[i] = ToHalf::convert(f); }
};
struct NoLow {};  // no low-precision copy (LowT below)

struct RoundingKeys {
  uint32_t param, exp_avg, exp_avg_sq;
};

// One Adam step over [begin, end) whose first element has index ``index0`` in the model
// (where the random bits of stochastic rounding come from; the range lies within one 2^32
// block of indices, whose upper half ``keys`` already holds: rounding_bits' inner hash): everything read is widened to
// float, adam_update runs in float as in adam_range, and the results are rounded into their
// storage (to nearest, or stochastically with kStoch). LowT: the bf16/fp16 copy of an fp32
// master (offload's copy-out), or NoLow.
template <typename PT, typename ST, typename GT, typename LowT, bool kStoch, bool kLerpFromM>
ZE_CLONES void mixed_range(typename PT::T* __restrict p, const typename GT::T* __restrict g,
                           typename ST::T* __restrict m, typename ST::T* __restrict v,
                           uint16_t* __restrict low, int64_t begin, int64_t end, uint64_t index0,
                           AdamCoefficients c, float grad_coef, RoundingKeys keys) {
  for (int64_t i = begin; i < end; ++i) {
    float mi = ST::load(m, i), vi = ST::load(v, i);
    const float grad = GT::load(g, i) * grad_coef;
    const float param = zeroengine::adam_update<kLerpFromM>(PT::load(p, i), grad, mi, vi, c);
    uint32_t rp = 0, rm = 0, rv = 0;
    if constexpr (kStoch) {  // rounding_bits with its inner hash (the index's upper half) hoisted
      const uint32_t index = static_cast<uint32_t>(index0 + static_cast<uint64_t>(i - begin));
      rp = zeroengine::fmix32(index ^ keys.param);
      rm = zeroengine::fmix32(index ^ keys.exp_avg);
      rv = zeroengine::fmix32(index ^ keys.exp_avg_sq);
    }
    PT::template store<kStoch>(p, i, param, rp);
    ST::template store<kStoch>(m, i, mi, rm);
    ST::template store<kStoch>(v, i, vi, rv);
    if constexpr (!std::is_same_v<LowT, NoLow>) low[i] = LowT::convert(param);
  }
}

struct MixedArgs {
  void* p;
  const void* g;
  void* m;
  void* v;
  uint16_t* low;
  AdamCoefficients c;
  float grad_coef;
  RoundingKeys keys;
};

// -- the AVX2 path (mixed_avx2.h has the why) --------------------------------------------------
bool avx2_enabled = true;  // tests switch it off to compare the two paths (use_avx2 below)

#ifdef ZE_HAVE_AVX2_PATH
template <typename K> struct Avx2Kind { using type = void; };
template <> struct Avx2Kind<F32> { using type = zeroengine::avx2::F32; };
template <> struct Avx2Kind<BF16> { using type = zeroengine::avx2::BF16; };
#endif

// Runs the whole 16-element blocks of [b, end) through the AVX2 kernel where this CPU and the
// storage kinds allow (fp32/bf16 everywhere, a bf16 copy-out or none) and returns how many
// elements it did; 0 leaves everything to mixed_range.
template <typename PT, typename ST, typename GT, typename LowT, bool kStoch>
int64_t avx2_blocks(const MixedArgs& a, int64_t b, int64_t end, uint64_t first,
                    const RoundingKeys& keys) {
#ifdef ZE_HAVE_AVX2_PATH
  using P = typename Avx2Kind<PT>::type;
  using S = typename Avx2Kind<ST>::type;
  using G = typename Avx2Kind<GT>::type;
  constexpr bool kLow = std::is_same_v<LowT, ToBFloat16>;
  if constexpr (!std::is_void_v<P> && !std::is_void_v<S> && !std::is_void_v<G> &&
                (kLow || std::is_same_v<LowT, NoLow>)) {
    const int64_t blocks = (end - b) / 16;
    if (!avx2_enabled || blocks == 0 || !zeroengine::avx2::supported()) return 0;
    auto* p = static_cast<typename PT::T*>(a.p);
    auto* g = static_cast<const typename GT::T*>(a.g);
    auto* m = static_cast<typename ST::T*>(a.m);
    auto* v = static_cast<typename ST::T*>(a.v);
    const auto index = static_cast<uint32_t>(first);
    if (a.c.lerp_from_m) {
      zeroengine::avx2::range<P, S, G, kLow, kStoch, true>(
          p, g, m, v, a.low, b, blocks, index, a.c, a.grad_coef, keys.param, keys.exp_avg,
          keys.exp_avg_sq);
    } else {
      zeroengine::avx2::range<P, S, G, kLow, kStoch, false>(
          p, g, m, v, a.low, b, blocks, index, a.c, a.grad_coef, keys.param, keys.exp_avg,
          keys.exp_avg_sq);
    }
    return 16 * blocks;
  }
#endif
  return 0;
}

// Elements [begin, begin + n) of the buffers, the first one at ``index0`` in the model.
template <typename PT, typename ST, typename GT, typename LowT, bool kStoch>
void mixed_run(const MixedArgs& a, int64_t begin, int64_t n, uint64_t index0) {
  auto* p = static_cast<typename PT::T*>(a.p);
  auto* g = static_cast<const typename GT::T*>(a.g);
  auto* m = static_cast<typename ST::T*>(a.m);
  auto* v = static_cast<typename ST::T*>(a.v);
  at::parallel_for(begin, begin + n, 1 << 15, [&](int64_t b, int64_t e) {
    while (b < e) {  // pieces within one 2^32 block of model indices (almost always one)
      uint64_t first = index0 + static_cast<uint64_t>(b - begin);
      const uint64_t block_left = (uint64_t{1} << 32) - (first & 0xFFFFFFFFu);
      const int64_t end = static_cast<uint64_t>(e - b) > block_left
          ? b + static_cast<int64_t>(block_left) : e;
      RoundingKeys keys = a.keys;
      if constexpr (kStoch) {
        const uint32_t upper = static_cast<uint32_t>(first >> 32);
        keys = {zeroengine::fmix32(a.keys.param ^ upper),
                zeroengine::fmix32(a.keys.exp_avg ^ upper),
                zeroengine::fmix32(a.keys.exp_avg_sq ^ upper)};
      }
      const int64_t vectorised = avx2_blocks<PT, ST, GT, LowT, kStoch>(a, b, end, first, keys);
      b += vectorised;  // the rest (under 16 elements, or all without AVX2) below
      first += static_cast<uint64_t>(vectorised);
      if (a.c.lerp_from_m) {
        mixed_range<PT, ST, GT, LowT, kStoch, true>(p, g, m, v, a.low, b, end, first, a.c,
                                                    a.grad_coef, keys);
      } else {
        mixed_range<PT, ST, GT, LowT, kStoch, false>(p, g, m, v, a.low, b, end, first, a.c,
                                                     a.grad_coef, keys);
      }
      b = end;
    }
  });
}

using RunFn = void (*)(const MixedArgs&, int64_t, int64_t, uint64_t);

// The instantiations that exist: fp32 master with bf16 states (and a bf16/fp16 copy-out);
// bf16 master with fp32 or bf16 states and fp32 or bf16 gradients; fp16 master (fp32
// states, round to nearest) with fp32 or fp16 gradients.
template <bool kStoch>
RunFn pick_run(at::ScalarType p, at::ScalarType s, at::ScalarType g, int low) {
  using at::kBFloat16;
  using at::kFloat;
  using at::kHalf;
  if (p == kFloat && s == kBFloat16 && g == kFloat) {
    if (low == 0) return &mixed_run<F32, BF16, F32, NoLow, kStoch>;
    if (low == 1) return &mixed_run<F32, BF16, F32, ToBFloat16, kStoch>;
    return &mixed_run<F32, BF16, F32, ToHalf, kStoch>;
  }
  if (p == kBFloat16 && low == 0) {
    if (s == kFloat && g == kFloat) return &mixed_run<BF16, F32, F32, NoLow, kStoch>;
    if (s == kFloat && g == kBFloat16) return &mixed_run<BF16, F32, BF16, NoLow, kStoch>;
    if (s == kBFloat16 && g == kFloat) return &mixed_run<BF16, BF16, F32, NoLow, kStoch>;
    if (s == kBFloat16 && g == kBFloat16) return &mixed_run<BF16, BF16, BF16, NoLow, kStoch>;
  }
  if (!kStoch && p == kHalf && s == kFloat && low == 0) {
    if (g == kFloat) return &mixed_run<F16, F32, F32, NoLow, false>;
    if (g == kHalf) return &mixed_run<F16, F32, F16, NoLow, false>;
  }
  return nullptr;
}

ZE_CLONES void split_range(const uint32_t* __restrict x, uint16_t* __restrict w,
                           uint16_t* __restrict r, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const uint32_t bits = x[i];
    const uint32_t low = bits & 0xFFFFu;
    const uint32_t even_tie = -static_cast<uint32_t>(low == 0x8000u) &
                              -static_cast<uint32_t>(((bits >> 16) & 1u) == 0u);
    r[i] = static_cast<uint16_t>((even_tie & 0x7FFFu) | (~even_tie & low));
  }
  if (w != nullptr) {
    for (int64_t i = begin; i < end; ++i) {
      w[i] = ToBFloat16::convert(__builtin_bit_cast(float, x[i]));
    }
  }
}

ZE_CLONES void join_range(const uint16_t* __restrict w, const uint16_t* __restrict r,
                          uint32_t* __restrict x, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const uint32_t upper = (static_cast<uint32_t>(w[i]) - (r[i] >> 15)) & 0xFFFFu;
    x[i] = (upper << 16) | r[i];
  }
}

void check(const at::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.numel() == n, name, " has ", t.numel(), " elements, expected ", n);
}

}  // namespace

// step: the step number after this update (1 for the first step).
void adam_step(at::Tensor p, at::Tensor g, at::Tensor m, at::Tensor v, double lr, double beta1,
               double beta2, double eps, double weight_decay, int64_t step, bool adamw,
               bool bias_correction, c10::optional<at::Tensor> low) {
  const int64_t n = p.numel();
  check(p, "param", n);
  check(g, "grad", n);
  check(m, "exp_avg", n);
  check(v, "exp_avg_sq", n);
  TORCH_CHECK(step >= 1, "step must be >= 1, got ", step);
  const AdamCoefficients h = zeroengine::adam_coefficients(lr, beta1, beta2, eps, weight_decay,
                                                           step, adamw, bias_correction);
  float *pp = p.data_ptr<float>(), *mp = m.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  if (!low.has_value()) {
    adam_parallel<ToBFloat16, false>(pp, gp, mp, vp, nullptr, n, h);
    return;
  }
  at::Tensor out = *low;
  TORCH_CHECK(out.device().is_cpu() && out.is_contiguous() && out.numel() == n,
              "low-precision copy must be a contiguous CPU tensor of ", n, " elements");
  if (out.scalar_type() == at::kBFloat16) {
    auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    adam_parallel<ToBFloat16, true>(pp, gp, mp, vp, op, n, h);
  } else if (out.scalar_type() == at::kHalf) {
    auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::Half>());
    adam_parallel<ToHalf, true>(pp, gp, mp, vp, op, n, h);
  } else {
    TORCH_CHECK(false, "low-precision copy must be bfloat16 or float16, got ", out.scalar_type());
  }
}

void check_mixed(const at::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.numel() == n, name, " has ", t.numel(), " elements, expected ", n);
}

// One Adam/AdamW step with the master (``p``: fp32, bf16 or fp16) and the moments (``m``,
// ``v``: fp32 or bf16) in their storage dtypes and the gradient (fp32, or p's dtype) times
// ``grad_coef``, all computed in float and rounded once into storage. ``stochastic``: bf16
// results are rounded stochastically, with bits from (seed, step, model index); ``runs``
// (int64 [k, 3]: first element, count, index in the model of the first) then names the
// elements to update, which must not overlap; without it, all of them (indices from 0).
// ``low``: with an fp32 master, its bf16/fp16 copy written in the same pass.
bool adam_step_mixed(at::Tensor p, at::Tensor g, at::Tensor m, at::Tensor v, double lr,
                     double beta1, double beta2, double eps, double weight_decay, int64_t step,
                     bool adamw, bool bias_correction, double grad_coef, bool stochastic,
                     int64_t seed, c10::optional<at::Tensor> runs,
                     c10::optional<at::Tensor> low) {
  const int64_t n = p.numel();
  check_mixed(p, "param", n);
  check_mixed(g, "grad", n);
  check_mixed(m, "exp_avg", n);
  check_mixed(v, "exp_avg_sq", n);
  TORCH_CHECK(m.scalar_type() == v.scalar_type(), "exp_avg and exp_avg_sq differ in dtype");
  TORCH_CHECK(step >= 1, "step must be >= 1, got ", step);
  int low_kind = 0;
  uint16_t* low_ptr = nullptr;
  if (low.has_value()) {
    check_mixed(*low, "low-precision copy", n);
    TORCH_CHECK(low->scalar_type() == at::kBFloat16 || low->scalar_type() == at::kHalf,
                "low-precision copy must be bfloat16 or float16");
    low_kind = low->scalar_type() == at::kBFloat16 ? 1 : 2;
    low_ptr = reinterpret_cast<uint16_t*>(low->data_ptr());
  }
  const RunFn run = stochastic
      ? pick_run<true>(p.scalar_type(), m.scalar_type(), g.scalar_type(), low_kind)
      : pick_run<false>(p.scalar_type(), m.scalar_type(), g.scalar_type(), low_kind);
  if (run == nullptr) return false;  // not a combination built here: the caller's fallback
  MixedArgs a;
  a.p = p.data_ptr();
  a.g = g.data_ptr();
  a.m = m.data_ptr();
  a.v = v.data_ptr();
  a.low = low_ptr;
  a.c = zeroengine::adam_coefficients(lr, beta1, beta2, eps, weight_decay, step, adamw,
                                      bias_correction);
  a.grad_coef = static_cast<float>(grad_coef);
  const uint64_t s = static_cast<uint64_t>(seed);
  a.keys = {zeroengine::rounding_key(s, step, 0), zeroengine::rounding_key(s, step, 1),
            zeroengine::rounding_key(s, step, 2)};
  if (!runs.has_value()) {
    run(a, 0, n, 0);
    return true;
  }
  const at::Tensor r = runs->contiguous();
  TORCH_CHECK(r.scalar_type() == at::kLong && r.dim() == 2 && r.size(1) == 3,
              "runs must be an int64 tensor of shape [k, 3]");
  const int64_t* rp = r.data_ptr<int64_t>();
  for (int64_t k = 0; k < r.size(0); ++k) {
    const int64_t first = rp[3 * k], count = rp[3 * k + 1];
    TORCH_CHECK(first >= 0 && count >= 0 && first + count <= n, "run ", k, " out of range");
    run(a, first, count, static_cast<uint64_t>(rp[3 * k + 2]));
  }
  return true;
}

// -- remainders (bf16.store_param_remainders; zeroengine/core/master_bits.py has the why) ------
// fp32 master -> its bf16 weight (round to nearest even; skipped without ``weight``) and the
// int16 remainder, its lower half, except that a value exactly halfway whose upper half is
// even is stored as 0x7FFF (one fp32 ulp nearer the weight, which it still rounds to).
void split_master(at::Tensor master, c10::optional<at::Tensor> weight, at::Tensor remainder) {
  const int64_t n = master.numel();
  TORCH_CHECK(master.scalar_type() == at::kFloat, "master must be float32");
  check_mixed(master, "master", n);
  check_mixed(remainder, "remainder", n);
  TORCH_CHECK(remainder.scalar_type() == at::kShort, "remainder must be int16");
  uint16_t* w = nullptr;
  if (weight.has_value()) {
    check_mixed(*weight, "weight", n);
    TORCH_CHECK(weight->scalar_type() == at::kBFloat16, "weight must be bfloat16");
    w = reinterpret_cast<uint16_t*>(weight->data_ptr());
  }
  const uint32_t* x = reinterpret_cast<const uint32_t*>(master.data_ptr<float>());
  uint16_t* r = reinterpret_cast<uint16_t*>(remainder.data_ptr<int16_t>());
  at::parallel_for(0, n, 1 << 16, [&](int64_t b, int64_t e) {
    split_range(x, w, r, b, e);
  });
}

// The inverse: ``out`` (float32) from the bf16 ``weight`` and its int16 ``remainder``.
void join_master(at::Tensor weight, at::Tensor remainder, at::Tensor out) {
  const int64_t n = out.numel();
  TORCH_CHECK(out.scalar_type() == at::kFloat && weight.scalar_type() == at::kBFloat16 &&
              remainder.scalar_type() == at::kShort,
              "join_master takes bfloat16 weights, int16 remainders and a float32 output");
  check_mixed(out, "out", n);
  check_mixed(weight, "weight", n);
  check_mixed(remainder, "remainder", n);
  const uint16_t* w = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  const uint16_t* r = reinterpret_cast<const uint16_t*>(remainder.data_ptr<int16_t>());
  uint32_t* x = reinterpret_cast<uint32_t*>(out.data_ptr<float>());
  at::parallel_for(0, n, 1 << 16, [&](int64_t b, int64_t e) { join_range(w, r, x, b, e); });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zeroengine one-pass CPU Adam/AdamW";
  m.def("adam_step", &adam_step, "one Adam/AdamW step over flat fp32 buffers", py::arg("param"),
        py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("step"), py::arg("adamw"), py::arg("bias_correction"),
        py::arg("low") = py::none());
  m.def("adam_step_mixed", &adam_step_mixed,
        "one Adam/AdamW step with 16-bit masters and/or states; False: combination not built",
        py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
        py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("step"), py::arg("adamw"), py::arg("bias_correction"),
        py::arg("grad_coef"), py::arg("stochastic"), py::arg("seed"),
        py::arg("runs") = py::none(), py::arg("low") = py::none());
  m.def("use_avx2", [](bool on) { const bool was = avx2_enabled; avx2_enabled = on; return was; },
        "switch adam_step_mixed's AVX2 kernel on or off (tests); returns the previous setting",
        py::arg("on"));
  m.def("avx2_available", []() {
#ifdef ZE_HAVE_AVX2_PATH
    return zeroengine::avx2::supported();
#else
    return false;
#endif
  }, "whether adam_step_mixed has its AVX2 kernel on this CPU");
  m.def("split_master", &split_master, "fp32 master -> bf16 weight + int16 remainder",
        py::arg("master"), py::arg("weight"), py::arg("remainder"));
  m.def("join_master", &join_master, "bf16 weight + int16 remainder -> fp32 master",
        py::arg("weight"), py::arg("remainder"), py::arg("out"));
}
