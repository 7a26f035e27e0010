// The per-step coefficients of Adam/AdamW, computed once on the host for both kernels (CPU:
// csrc/adam/cpu_adam.cpp, CUDA: csrc/cuda/fused_adam.cu), so they cannot drift apart.
//
// Everything derived from the hyperparameters is taken in double and rounded to float once, as
// torch.optim.AdamW's Python code computes its scalars in double before its kernels see them:
// in float, 1 - 0.9999f is off by 1.7e-4 relative, and 1 - lr * wd loses digits too.
// The reference these must match, operation by operation, is the PyTorch path in
// zeroengine/ops/cpu_adam.py (_adam_torch), which follows torch.optim.AdamW; adam_update below
// is the per-element arithmetic both kernels run.
#pragma once

#include <cmath>
#include <cstdint>

namespace zeroengine {

struct AdamCoefficients {
  float beta2, eps;
  float decay;            // AdamW: 1 - lr * weight_decay (decoupled); Adam: 1
  float l2;               // Adam: weight_decay (added to the gradient as L2); AdamW: 0
  float one_minus_beta1;  // lerp weight for m
  float lerp_rest;        // 1 - (1 - beta1) in float, torch's second lerp form
  bool lerp_from_m;       // torch's lerp(m, g, w): m + w * (g - m) if w < 0.5, else
                          // g - (g - m) * (1 - w)
  float one_minus_beta2;
  float step_size;        // lr / bias_correction1
  float inv_bc2_sqrt;     // 1 / sqrt(bias_correction2): a multiply where torch.optim.AdamW
                          // divides by sqrt(bc2) (at most 1 ulp apart, one divide less)
};

// step: the step number after this update (1 for the first).
inline AdamCoefficients adam_coefficients(double lr, double beta1, double beta2, double eps,
                                          double weight_decay, int64_t step, bool adamw,
                                          bool bias_correction) {
  const double bc1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
  const double bc2 = bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(step)) : 1.0;
  AdamCoefficients c;
  c.beta2 = static_cast<float>(beta2);
  c.eps = static_cast<float>(eps);
  c.decay = adamw ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  c.l2 = adamw ? 0.0f : static_cast<float>(weight_decay);
  c.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  c.lerp_rest = 1.0f - c.one_minus_beta1;
  c.lerp_from_m = c.one_minus_beta1 < 0.5f;
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.step_size = static_cast<float>(lr / bc1);
  c.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  return c;
}

#if defined(__CUDACC__)
#define ZE_HOST_DEVICE __host__ __device__
#else
#define ZE_HOST_DEVICE
#endif

// One element, in torch's operation order and with torch's roundings (as its CPU kernels in
// torch 2.13 compute them, measured): g.add(p, alpha=wd) is fma(p, wd, g); lerp is
// fma(w, g - m, m) for w < 0.5, else fma(w - 1, g - m, g); addcmul is fma(value * g, g, v);
// addcdiv is p + (value * m) / denom; everything else is rounded one operation at a time (the
// sources are compiled without contraction: -ffp-contract=off, nvcc -fmad=false).
// ``grad0`` is the gradient as the optimizer sees it (unscaled); returns the new parameter.
template <bool kLerpFromM>
ZE_HOST_DEVICE inline float adam_update(float param0, float grad0, float& m, float& v,
                                        const AdamCoefficients& c) {
  // Both weight-decay forms as arithmetic with neutral values (x * 1 and fma(x, 0, g) are
  // exact), so the element has no control flow and CPU loops over it vectorise.
  const float grad = std::fma(param0, c.l2, grad0);
  const float param = param0 * c.decay;
  const float diff = grad - m;
  m = kLerpFromM ? std::fma(c.one_minus_beta1, diff, m) : std::fma(-c.lerp_rest, diff, grad);
  v = std::fma(c.one_minus_beta2 * grad, grad, v * c.beta2);
  const float denom = std::sqrt(v) * c.inv_bc2_sqrt + c.eps;
  return param + ((-c.step_size) * m) / denom;
}

}  // namespace zeroengine
