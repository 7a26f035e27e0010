// Blockwise symmetric int8 quantization on CUDA (the quantized collectives: qwZ / qgZ). One
// thread block per quantization block: a shared-memory max of |x|, then every thread
// quantizes its elements. Same arithmetic as csrc/quant/quantize.cpp and the PyTorch
// fallback (zeroengine/ops/quantize.py), so all three give the same bytes.
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "../common/quant_common.h"

namespace zeroengine {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void quantize_kernel(const T* __restrict__ x, int8_t* __restrict__ q,
                                float* __restrict__ scales, int64_t n, int64_t block) {
  __shared__ float partial[kThreads];
  const int64_t lo = static_cast<int64_t>(blockIdx.x) * block;
  const int64_t hi = min(n, lo + block);
  float amax = 0.f;
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x)
    amax = fmaxf(amax, fabsf(static_cast<float>(x[i])));
  partial[threadIdx.x] = amax;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) partial[threadIdx.x] = fmaxf(partial[threadIdx.x], partial[threadIdx.x + s]);
    __syncthreads();
  }
  const float scale = block_scale(partial[0]);
  if (threadIdx.x == 0) scales[blockIdx.x] = scale;
  const float divisor = safe_divisor(scale);
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x)
    q[i] = static_cast<int8_t>(clamp127(nearbyintf(__fdiv_rn(static_cast<float>(x[i]), divisor))));
}

template <typename T>
__global__ void dequantize_kernel(const int8_t* __restrict__ q, const float* __restrict__ scales,
                                  T* __restrict__ out, int64_t n, int64_t block, bool accumulate) {
  const int64_t lo = static_cast<int64_t>(blockIdx.x) * block;
  const int64_t hi = min(n, lo + block);
  const float scale = scales[blockIdx.x];
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    const float v = __fmul_rn(static_cast<float>(q[i]), scale);
    out[i] = accumulate ? static_cast<T>(__fadd_rn(static_cast<float>(out[i]), v)) : static_cast<T>(v);
  }
}

void check(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace

void cuda_quantize_int8(at::Tensor x, at::Tensor q, at::Tensor scales, int64_t block) {
  check(x, "x"); check(q, "q"); check(scales, "scales");
  const int64_t n = x.numel();
  TORCH_CHECK(block > 0, "block must be positive");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.numel() == n, "q must be int8 with x's numel");
  const int64_t blocks = (n + block - 1) / block;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == blocks,
              "scales must be float32 with one element per block");
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_int8", [&] {
    quantize_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
        x.data_ptr<scalar_t>(), q.data_ptr<int8_t>(), scales.data_ptr<float>(), n, block);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void cuda_dequantize_int8(at::Tensor q, at::Tensor scales, at::Tensor out, int64_t block,
                          bool accumulate) {
  check(q, "q"); check(scales, "scales"); check(out, "out");
  const int64_t n = q.numel();
  TORCH_CHECK(block > 0, "block must be positive");
  TORCH_CHECK(q.scalar_type() == at::kChar && out.numel() == n, "out must have q's numel");
  const int64_t blocks = (n + block - 1) / block;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == blocks,
              "scales must be float32 with one element per block");
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "dequantize_int8", [&] {
    dequantize_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
        q.data_ptr<int8_t>(), scales.data_ptr<float>(), out.data_ptr<scalar_t>(), n, block,
        accumulate);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace zeroengine
