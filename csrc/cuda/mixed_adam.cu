// Multi-tensor Adam/AdamW with 16-bit masters and/or states on the GPU (the bf16/fp16 master
// keys): the CUDA twin of adam_step_mixed in csrc/adam/cpu_adam.cpp. Each element is widened to
// float, updated by adam_update (csrc/common/adam_coefficients.h) and rounded once into its
// storage: to nearest, or (bf16, stochastic) with the random bits of
// csrc/common/stochastic_rounding.h from (seed, step, the element's index in the model), so a
// GPU run rounds every element as the CPU kernel and the PyTorch path do.
//
// The master p is float32 (with bf16 states, and then optionally its bf16/fp16 copy), bfloat16
// or float16; the moments float32 or bfloat16; the gradient float32 or p's dtype, times
// grad_coef. Each tensor of a launch is one run of model indices: its tag is the model index of
// its first element.
#include "multi_tensor.cuh"
#include "../common/adam_coefficients.h"
#include "../common/stochastic_rounding.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace zeroengine {
namespace {

struct F32 {
  using T = float;
  __device__ static float load(const T* p, int64_t i) { return p[i]; }
  template <bool kStoch>
  __device__ static void store(T* p, int64_t i, float f, uint32_t) { p[i] = f; }
};
struct BF16 {
  using T = uint16_t;
  __device__ static float load(const T* p, int64_t i) {
    return __uint_as_float(static_cast<uint32_t>(p[i]) << 16);
  }
  template <bool kStoch>
  __device__ static void store(T* p, int64_t i, float f, uint32_t random) {
    if (kStoch) {
      p[i] = bf16_stochastic(f, random);
    } else {
      p[i] = __bfloat16_as_ushort(__float2bfloat16_rn(f));
    }
  }
};
struct F16 {
  using T = uint16_t;
  __device__ static float load(const T* p, int64_t i) {
    return __half2float(__ushort_as_half(p[i]));
  }
  template <bool kStoch>
  __device__ static void store(T* p, int64_t i, float f, uint32_t) {
    p[i] = __half_as_ushort(__float2half_rn(f));
  }
};

struct MixedArgs {
  AdamCoefficients c;
  float grad_coef;
  uint32_t key_p, key_m, key_v;
};

// Lists: p, g, m, v (and the low copy of an fp32 master: 5).
template <typename PT, typename ST, typename GT, typename LowT, int Lists, bool kStoch,
          bool kLerpFromM>
__global__ void __launch_bounds__(kThreads)
mixed_adam_kernel(TensorTable<Lists> table, MixedArgs a) {
  int64_t start, n;
  const int t = locate(table, start, n);
  auto* __restrict__ p = static_cast<typename PT::T*>(table.addr[0][t]) + start;
  const auto* __restrict__ g = static_cast<const typename GT::T*>(table.addr[1][t]) + start;
  auto* __restrict__ m = static_cast<typename ST::T*>(table.addr[2][t]) + start;
  auto* __restrict__ v = static_cast<typename ST::T*>(table.addr[3][t]) + start;
  typename LowT::T* __restrict__ low =
      Lists == 5 ? static_cast<typename LowT::T*>(table.addr[Lists - 1][t]) + start : nullptr;
  const uint64_t first = static_cast<uint64_t>(table.tag[t] + start);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    float mi = ST::load(m, i), vi = ST::load(v, i);
    const float grad = GT::load(g, i) * a.grad_coef;
    const float param = adam_update<kLerpFromM>(PT::load(p, i), grad, mi, vi, a.c);
    uint32_t rp = 0, rm = 0, rv = 0;
    if (kStoch) {
      const uint64_t index = first + static_cast<uint64_t>(i);
      rp = rounding_bits(a.key_p, index);
      rm = rounding_bits(a.key_m, index);
      rv = rounding_bits(a.key_v, index);
    }
    PT::template store<kStoch>(p, i, param, rp);
    ST::template store<kStoch>(m, i, mi, rm);
    ST::template store<kStoch>(v, i, vi, rv);
    if (Lists == 5) LowT::template store<false>(low, i, param, 0);
  }
}

template <typename PT, typename ST, typename GT, typename LowT, int Lists, bool kStoch>
void launch(const std::vector<std::vector<at::Tensor>>& lists, const MixedArgs& args,
            const std::vector<int64_t>& tags) {
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  multi_tensor_apply<Lists>(lists, [&](const TensorTable<Lists>& table, int blocks) {
    if (args.c.lerp_from_m) {
      mixed_adam_kernel<PT, ST, GT, LowT, Lists, kStoch, true>
          <<<blocks, kThreads, 0, stream>>>(table, args);
    } else {
      mixed_adam_kernel<PT, ST, GT, LowT, Lists, kStoch, false>
          <<<blocks, kThreads, 0, stream>>>(table, args);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }, &tags);
}

// The combinations csrc/adam/cpu_adam.cpp's pick_run builds; false for any other.
template <bool kStoch>
bool dispatch(const std::vector<std::vector<at::Tensor>>& lists, const MixedArgs& a,
              const std::vector<int64_t>& tags, at::ScalarType p, at::ScalarType s,
              at::ScalarType g, int low) {
  using at::kBFloat16;
  using at::kFloat;
  using at::kHalf;
  if (p == kFloat && s == kBFloat16 && g == kFloat) {
    if (low == 0) launch<F32, BF16, F32, F32, 4, kStoch>(lists, a, tags);
    else if (low == 1) launch<F32, BF16, F32, BF16, 5, kStoch>(lists, a, tags);
    else launch<F32, BF16, F32, F16, 5, kStoch>(lists, a, tags);
    return true;
  }
  if (p == kBFloat16 && low == 0) {
    if (s == kFloat && g == kFloat) launch<BF16, F32, F32, F32, 4, kStoch>(lists, a, tags);
    else if (s == kFloat && g == kBFloat16) launch<BF16, F32, BF16, F32, 4, kStoch>(lists, a, tags);
    else if (s == kBFloat16 && g == kFloat) launch<BF16, BF16, F32, F32, 4, kStoch>(lists, a, tags);
    else if (s == kBFloat16 && g == kBFloat16) launch<BF16, BF16, BF16, F32, 4, kStoch>(lists, a, tags);
    else return false;
    return true;
  }
  if (!kStoch && p == kHalf && s == kFloat && low == 0) {
    if (g == kFloat) launch<F16, F32, F32, F32, 4, false>(lists, a, tags);
    else if (g == kHalf) launch<F16, F32, F16, F32, 4, false>(lists, a, tags);
    else return false;
    return true;
  }
  return false;
}

void check_same(const std::vector<at::Tensor>& list, const char* name, at::Device device) {
  for (size_t i = 0; i < list.size(); ++i) {
    TORCH_CHECK(list[i].device() == device, name, "[", i, "] is on ", list[i].device());
    TORCH_CHECK(list[i].is_contiguous(), name, "[", i, "] is not contiguous");
    TORCH_CHECK(list[i].scalar_type() == list[0].scalar_type(), name, " differ in dtype");
  }
}

}  // namespace

// One step over tensors of one dtype combination; ``first_index``: per tensor, the model index
// of its first element (stochastic rounding). Returns false, doing nothing, for a combination
// not built here.
bool mixed_adam(std::vector<at::Tensor> params, std::vector<at::Tensor> grads,
                std::vector<at::Tensor> exp_avgs, std::vector<at::Tensor> exp_avg_sqs,
                std::vector<at::Tensor> low_copies, std::vector<int64_t> first_index,
                double lr, double beta1, double beta2, double eps, double weight_decay,
                int64_t step, bool adamw, bool bias_correction, double grad_coef,
                bool stochastic, int64_t seed) {
  if (params.empty()) return true;
  TORCH_CHECK(step >= 1, "step must be >= 1, got ", step);
  const at::Device device = params[0].device();
  TORCH_CHECK(device.is_cuda(), "mixed_adam runs on CUDA tensors; params[0] is on ", device);
  const c10::cuda::CUDAGuard guard(device);
  for (const auto* list : {&params, &grads, &exp_avgs, &exp_avg_sqs, &low_copies})
    check_same(*list, "tensors", device);
  TORCH_CHECK(exp_avgs[0].scalar_type() == exp_avg_sqs[0].scalar_type(),
              "exp_avg and exp_avg_sq differ in dtype");
  TORCH_CHECK(first_index.size() == params.size(), "one first_index per tensor");
  int low = 0;
  std::vector<std::vector<at::Tensor>> lists{params, grads, exp_avgs, exp_avg_sqs};
  if (!low_copies.empty()) {
    TORCH_CHECK(low_copies.size() == params.size(), "one low copy per tensor");
    low = low_copies[0].scalar_type() == at::kBFloat16 ? 1 : 2;
    lists.push_back(low_copies);
  }
  MixedArgs a;
  a.c = adam_coefficients(lr, beta1, beta2, eps, weight_decay, step, adamw, bias_correction);
  a.grad_coef = static_cast<float>(grad_coef);
  const uint64_t s = static_cast<uint64_t>(seed);
  a.key_p = rounding_key(s, step, 0);
  a.key_m = rounding_key(s, step, 1);
  a.key_v = rounding_key(s, step, 2);
  const auto p = params[0].scalar_type(), st = exp_avgs[0].scalar_type(),
             g = grads[0].scalar_type();
  return stochastic ? dispatch<true>(lists, a, first_index, p, st, g, low)
                    : dispatch<false>(lists, a, first_index, p, st, g, low);
}

}  // namespace zeroengine
