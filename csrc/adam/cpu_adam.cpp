// One-pass Adam/AdamW over flat fp32 buffers on the CPU: reads p, g, m, v once and writes
// p, m, v (and, when given, the bf16/fp16 copy of p the model computes with) in the same pass.
//
// Adam is memory-bound, so the only things that matter are touching each byte once and keeping
// every core's vector units fed: the loop body is plain scalar code that GCC vectorises, compiled
// three times by target_clones (AVX-512, AVX2+FMA, baseline x86-64) and picked at load time by
// the CPU's features; at::parallel_for splits the elements across torch's intra-op threads.
// Built with -fno-math-errno: otherwise sqrt must keep errno semantics and GCC will not
// vectorise the loop at all.
// The arithmetic follows torch.optim.AdamW's single-tensor path operation by operation (lerp for
// m, mul+addcmul for v, sqrt(v)/sqrt(bc2)+eps, addcdiv), so results agree to rounding.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>

namespace {

struct Hyper {
  float lr, beta1, beta2, eps, weight_decay, step_size, bc2_sqrt;
  bool adamw;
};

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ZE_CLONES __attribute__((target_clones("avx512f", "avx2,fma", "default")))
#else
#define ZE_CLONES
#endif

// kLow: also write the low-precision copy (a compile-time choice, so the plain loop has no
// per-element branch and vectorises cleanly).
template <typename Low, bool kLow>
ZE_CLONES void adam_range(float* __restrict p, const float* __restrict g, float* __restrict m,
                          float* __restrict v, Low* __restrict low, int64_t begin, int64_t end,
                          Hyper h) {
  const float one_minus_beta1 = 1.0f - h.beta1, one_minus_beta2 = 1.0f - h.beta2;
  const float decay = 1.0f - h.lr * h.weight_decay;
  for (int64_t i = begin; i < end; ++i) {
    float grad = g[i];
    float param = p[i];
    if (h.adamw) {
      param = param * decay;
    } else if (h.weight_decay != 0.0f) {
      grad = grad + param * h.weight_decay;  // Adam's L2 penalty enters the gradient
    }
    // torch's lerp(m, g, w) with w = 1 - beta1 < 0.5 is m + w * (g - m)
    const float mi = one_minus_beta1 < 0.5f ? m[i] + one_minus_beta1 * (grad - m[i])
                                            : grad - (grad - m[i]) * h.beta1;
    const float vi = v[i] * h.beta2 + one_minus_beta2 * grad * grad;
    const float denom = std::sqrt(vi) / h.bc2_sqrt + h.eps;
    param = param + (-h.step_size) * (mi / denom);
    m[i] = mi;
    v[i] = vi;
    p[i] = param;
    if constexpr (kLow) low[i] = static_cast<Low>(param);
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
  const double bc1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
  const double bc2 = bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(step)) : 1.0;
  Hyper h{static_cast<float>(lr), static_cast<float>(beta1), static_cast<float>(beta2),
          static_cast<float>(eps), static_cast<float>(weight_decay),
          static_cast<float>(lr / bc1), static_cast<float>(std::sqrt(bc2)), adamw};
  float *pp = p.data_ptr<float>(), *mp = m.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  const int64_t grain = 1 << 15;
  if (!low.has_value()) {
    at::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
      adam_range<float, false>(pp, gp, mp, vp, nullptr, b, e, h);
    });
    return;
  }
  at::Tensor out = *low;
  TORCH_CHECK(out.device().is_cpu() && out.is_contiguous() && out.numel() == n,
              "low-precision copy must be a contiguous CPU tensor of ", n, " elements");
  if (out.scalar_type() == at::kBFloat16) {
    auto* op = out.data_ptr<at::BFloat16>();
    at::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
      adam_range<c10::BFloat16, true>(pp, gp, mp, vp, op, b, e, h);
    });
  } else if (out.scalar_type() == at::kHalf) {
    auto* op = out.data_ptr<at::Half>();
    at::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
      adam_range<c10::Half, true>(pp, gp, mp, vp, op, b, e, h);
    });
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
