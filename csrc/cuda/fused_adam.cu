// Multi-tensor fused Adam/AdamW over fp32 master shards on the GPU, one pass per element:
// read g (fp32, bf16 or fp16), unscale/clip it by one coefficient, update p, m, v in fp32 and
// write the bf16/fp16 copy of p the model computes with. Per element that is 16 B read and
// 12-14 B written, the least any Adam can move, in one launch per ~36 tensors.
//
// Non-finite gradients: an element whose (scaled) gradient is inf/NaN is left untouched and sets
// *found_nonfinite, so one bad value cannot poison the master weights; the caller decides to
// skip or raise (a global overflow check before the step skips it altogether).
//
// The coefficients come from csrc/common/adam_coefficients.h and the arithmetic is the CPU
// kernel's (csrc/adam/cpu_adam.cpp) operation by operation, both following torch.optim.AdamW
// (its two lerp forms, v*beta2 + (1-beta2)*g*g, sqrt(v)/sqrt(bc2) + eps, p -= lr/bc1 * m/denom).
#include "multi_tensor.cuh"
#include "../common/adam_coefficients.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace zeroengine {
namespace {

struct AdamArgs {
  AdamCoefficients c;
  float grad_coef;      // 1 / loss scale, times the clip coefficient
  int* found_nonfinite;  // device flag, set to 1 on any inf/NaN gradient
};

template <typename G, typename L, int Lists, bool kLerpFromM>
__global__ void __launch_bounds__(kThreads)
adam_kernel(TensorTable<Lists> table, AdamArgs a) {
  int64_t start, n;
  const int t = locate(table, start, n);
  float* __restrict__ p = static_cast<float*>(table.addr[0][t]) + start;
  const G* __restrict__ g = static_cast<const G*>(table.addr[1][t]) + start;
  float* __restrict__ m = static_cast<float*>(table.addr[2][t]) + start;
  float* __restrict__ v = static_cast<float*>(table.addr[3][t]) + start;
  L* __restrict__ low = Lists == 5 ? static_cast<L*>(table.addr[Lists - 1][t]) + start : nullptr;
  const AdamCoefficients& c = a.c;
  bool bad = false;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float scaled = static_cast<float>(g[i]) * a.grad_coef;
    if (!isfinite(scaled)) {
      bad = true;
      continue;
    }
    float mi = m[i], vi = v[i];
    const float param = adam_update<kLerpFromM>(p[i], scaled, mi, vi, c);
    p[i] = param;
    m[i] = mi;
    v[i] = vi;
    if (Lists == 5) low[i] = static_cast<L>(param);
  }
  if (bad) *a.found_nonfinite = 1;  // a benign race: every writer writes 1
}

template <typename G, typename L, int Lists>
void launch_adam(const std::vector<std::vector<at::Tensor>>& lists, const AdamArgs& args) {
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  multi_tensor_apply<Lists>(lists, [&](const TensorTable<Lists>& table, int blocks) {
    if (args.c.lerp_from_m) {
      adam_kernel<G, L, Lists, true><<<blocks, kThreads, 0, stream>>>(table, args);
    } else {
      adam_kernel<G, L, Lists, false><<<blocks, kThreads, 0, stream>>>(table, args);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

template <typename G>
void dispatch_low(const std::vector<std::vector<at::Tensor>>& lists, const AdamArgs& args,
                  c10::optional<at::ScalarType> low) {
  if (!low) return launch_adam<G, float, 4>(lists, args);
  if (*low == at::kBFloat16) return launch_adam<G, c10::BFloat16, 5>(lists, args);
  if (*low == at::kHalf) return launch_adam<G, c10::Half, 5>(lists, args);
  TORCH_CHECK(false, "low-precision copies must be bfloat16 or float16, got ", *low);
}

void check_list(const std::vector<at::Tensor>& list, const char* name, at::Device device,
                c10::optional<at::ScalarType> dtype) {
  for (size_t i = 0; i < list.size(); ++i) {
    const auto& t = list[i];
    TORCH_CHECK(t.device() == device, name, "[", i, "] is on ", t.device(), ", params[0] on ",
                device);
    TORCH_CHECK(t.is_contiguous(), name, "[", i, "] is not contiguous");
    if (dtype) TORCH_CHECK(t.scalar_type() == *dtype, name, "[", i, "] is ", t.scalar_type(),
                           ", expected ", *dtype);
  }
}

}  // namespace

void fused_adam(std::vector<at::Tensor> params, std::vector<at::Tensor> grads,
                std::vector<at::Tensor> exp_avgs, std::vector<at::Tensor> exp_avg_sqs,
                std::vector<at::Tensor> low_copies, double lr, double beta1, double beta2,
                double eps, double weight_decay, int64_t step, bool adamw,
                bool bias_correction, double grad_coef, at::Tensor found_nonfinite) {
  if (params.empty()) return;
  TORCH_CHECK(step >= 1, "step must be >= 1, got ", step);
  const at::Device device = params[0].device();
  TORCH_CHECK(device.is_cuda(), "fused_adam runs on CUDA tensors; params[0] is on ", device);
  const c10::cuda::CUDAGuard guard(device);
  check_list(params, "params", device, at::kFloat);
  check_list(exp_avgs, "exp_avgs", device, at::kFloat);
  check_list(exp_avg_sqs, "exp_avg_sqs", device, at::kFloat);
  check_list(grads, "grads", device, grads.empty() ? c10::nullopt
                                                   : c10::make_optional(grads[0].scalar_type()));
  check_list(low_copies, "low_copies", device, low_copies.empty() ? c10::nullopt
      : c10::make_optional(low_copies[0].scalar_type()));
  TORCH_CHECK(low_copies.empty() || low_copies.size() == params.size(), "got ",
              low_copies.size(), " low-precision copies for ", params.size(), " params");
  TORCH_CHECK(found_nonfinite.device() == device &&
              found_nonfinite.scalar_type() == at::kInt && found_nonfinite.numel() == 1,
              "found_nonfinite must be a one-element int32 tensor on ", device);
  AdamArgs a;
  a.c = adam_coefficients(lr, beta1, beta2, eps, weight_decay, step, adamw, bias_correction);
  a.grad_coef = static_cast<float>(grad_coef);
  a.found_nonfinite = found_nonfinite.data_ptr<int>();

  std::vector<std::vector<at::Tensor>> lists{params, grads, exp_avgs, exp_avg_sqs};
  c10::optional<at::ScalarType> low;
  if (!low_copies.empty()) {
    lists.push_back(low_copies);
    low = low_copies[0].scalar_type();
  }
  switch (grads[0].scalar_type()) {
    case at::kFloat: return dispatch_low<float>(lists, a, low);
    case at::kBFloat16: return dispatch_low<c10::BFloat16>(lists, a, low);
    case at::kHalf: return dispatch_low<c10::Half>(lists, a, low);
    default: TORCH_CHECK(false, "gradients must be float32, bfloat16 or float16, got ",
                         grads[0].scalar_type());
  }
}

}  // namespace zeroengine
