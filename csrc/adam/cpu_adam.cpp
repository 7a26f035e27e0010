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

#include "../common/adam_coefficients.h"

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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zeroengine one-pass CPU Adam/AdamW";
  m.def("adam_step", &adam_step, "one Adam/AdamW step over flat fp32 buffers", py::arg("param"),
        py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("step"), py::arg("adamw"), py::arg("bias_correction"),
        py::arg("low") = py::none());
}
