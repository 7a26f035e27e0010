// Flatten / unflatten on the GPU: many tensors into or out of one flat buffer in one launch per
// ~36 tensors (a loop of copy_ calls costs one launch and a few microseconds of host time per
// tensor, which dominates for the hundreds of small parameters a model has). Copies convert
// between float32, bfloat16 and float16 on the way, so gathering an fp32 master into a bf16
// buffer is the same single pass.
#include "multi_tensor.cuh"
#include "../common/flatten_checks.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace zeroengine {
namespace {

template <typename S, typename D>
__global__ void __launch_bounds__(kThreads) copy_kernel(TensorTable<2> table) {
  int64_t start, n;
  const int t = locate(table, start, n);
  const S* __restrict__ src = static_cast<const S*>(table.addr[0][t]) + start;
  D* __restrict__ dst = static_cast<D*>(table.addr[1][t]) + start;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = static_cast<D>(src[i]);
}

template <typename S, typename D>
void launch_copy(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst) {
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  multi_tensor_apply<2>({src, dst}, [&](const TensorTable<2>& table, int blocks) {
    copy_kernel<S, D><<<blocks, kThreads, 0, stream>>>(table);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

template <typename S>
void dispatch_dst(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst,
                  at::ScalarType d) {
  switch (d) {
    case at::kFloat: return launch_copy<S, float>(src, dst);
    case at::kBFloat16: return launch_copy<S, c10::BFloat16>(src, dst);
    case at::kHalf: return launch_copy<S, c10::Half>(src, dst);
    default: TORCH_CHECK(false, "flatten copies float32, bfloat16 or float16, got ", d);
  }
}

// dst[i] = src[i] (converted) for every pair; all on one CUDA device, contiguous, same numel.
void multi_copy(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst) {
  if (src.empty()) return;
  const at::Device device = src[0].device();
  TORCH_CHECK(device.is_cuda(), "the CUDA flatten needs CUDA tensors, got ", device);
  const c10::cuda::CUDAGuard guard(device);
  const auto s = src[0].scalar_type(), d = dst[0].scalar_type();
  for (size_t i = 0; i < src.size(); ++i) {
    TORCH_CHECK(src[i].device() == device && dst[i].device() == device, "tensor ", i,
                " is not on ", device);
    TORCH_CHECK(src[i].scalar_type() == s && dst[i].scalar_type() == d, "tensor ", i,
                " has another dtype than tensor 0");
    TORCH_CHECK(src[i].is_contiguous() && dst[i].is_contiguous(), "tensor ", i,
                " is not contiguous");
  }
  switch (s) {
    case at::kFloat: return dispatch_dst<float>(src, dst, d);
    case at::kBFloat16: return dispatch_dst<c10::BFloat16>(src, dst, d);
    case at::kHalf: return dispatch_dst<c10::Half>(src, dst, d);
    default: TORCH_CHECK(false, "flatten copies float32, bfloat16 or float16, got ", s);
  }
}

std::vector<at::Tensor> slices(const at::Tensor& flat, const std::vector<at::Tensor>& tensors,
                               const std::vector<int64_t>& offsets) {
  std::vector<at::Tensor> out;
  out.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i)
    out.push_back(flat.narrow(0, offsets[i], tensors[i].numel()));
  return out;
}

}  // namespace

void cuda_flatten_into(const std::vector<at::Tensor>& tensors, at::Tensor flat,
                       const std::vector<int64_t>& offsets) {
  check_flatten_args(tensors, flat, offsets, /*writes_tensors=*/false);
  std::vector<at::Tensor> sources;
  sources.reserve(tensors.size());
  for (const auto& t : tensors) sources.push_back(t.contiguous().view({-1}));
  multi_copy(sources, slices(flat, tensors, offsets));
}

void cuda_unflatten_from(at::Tensor flat, const std::vector<at::Tensor>& tensors,
                         const std::vector<int64_t>& offsets) {
  check_flatten_args(tensors, flat, offsets, /*writes_tensors=*/true);
  std::vector<at::Tensor> targets;
  targets.reserve(tensors.size());
  for (const auto& t : tensors) targets.push_back(t.view({-1}));
  multi_copy(slices(flat, tensors, offsets), targets);
}

}  // namespace zeroengine
