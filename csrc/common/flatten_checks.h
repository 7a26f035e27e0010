// The argument checks of flatten_into / unflatten_from, shared by the CPU (csrc/flatten) and
// CUDA (csrc/cuda/flatten.cu) kernels. zeroengine/ops/flatten.py checks the same before it
// dispatches (its PyTorch fallback needs them too); these stay because the extension functions
// are callable on their own and an offset past the end would write out of bounds.
#pragma once

#include <torch/extension.h>

#include <vector>

namespace zeroengine {

inline void check_flatten_args(const std::vector<at::Tensor>& tensors, const at::Tensor& flat,
                               const std::vector<int64_t>& offsets, bool writes_tensors) {
  TORCH_CHECK(tensors.size() == offsets.size(), "got ", tensors.size(), " tensors but ",
              offsets.size(), " offsets");
  TORCH_CHECK(flat.dim() == 1 && flat.is_contiguous(), "flat must be a contiguous 1-D tensor");
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(offsets[i] >= 0 && offsets[i] + tensors[i].numel() <= flat.numel(), "tensor ",
                i, " of ", tensors[i].numel(), " elements at offset ", offsets[i],
                " overruns the flat buffer of ", flat.numel());
    TORCH_CHECK(tensors[i].device() == flat.device(), "tensor ", i, " is on ",
                tensors[i].device(), ", the flat buffer on ", flat.device());
    TORCH_CHECK(!writes_tensors || tensors[i].is_contiguous(),
                "unflatten_from writes into contiguous tensors only");
  }
}

}  // namespace zeroengine
