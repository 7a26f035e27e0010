// Flatten / unflatten many tensors into / out of one flat buffer in a single call.
//
// On CPU the copies are split by *elements* across at::parallel_for threads, so one big tensor
// is shared between threads instead of serialising the call behind it. On CUDA each copy is an
// asynchronous kernel already; a plain loop (without Python's per-tensor overhead) is enough.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "../common/flatten_checks.h"

namespace {

// Calls copy(i, lo, len) for element ranges [lo, lo+len) of tensor i, covering every element
// exactly once, spread over threads on CPU.
template <typename Copy>
void for_each_range(const std::vector<at::Tensor>& tensors, const at::Tensor& flat, Copy copy) {
  std::vector<int64_t> starts(tensors.size() + 1, 0);  // prefix sums of numel
  for (size_t i = 0; i < tensors.size(); ++i) starts[i + 1] = starts[i] + tensors[i].numel();
  const int64_t total = starts.back();
  if (total == 0) return;
  if (!flat.device().is_cpu()) {
    for (size_t i = 0; i < tensors.size(); ++i)
      if (tensors[i].numel() > 0) copy(i, 0, tensors[i].numel());
    return;
  }
  const int64_t grain = 1 << 16;  // elements: below this a thread costs more than it saves
  at::parallel_for(0, total, grain, [&](int64_t begin, int64_t end) {
    // first tensor whose range [starts[i], starts[i+1]) contains `begin`
    size_t i = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
    for (int64_t pos = begin; pos < end && i < tensors.size(); ++i) {
      const int64_t lo = pos - starts[i];
      const int64_t len = std::min(end, starts[i + 1]) - pos;
      if (len > 0) copy(i, lo, len);
      pos += std::max<int64_t>(len, 0);
    }
  });
}

}  // namespace

// into: flat[off:off+n] = t for each tensor (flatten); else t = flat[off:off+n] (unflatten).
static void copy_between(const std::vector<at::Tensor>& tensors, at::Tensor flat,
                         const std::vector<int64_t>& offsets, bool into) {
  zeroengine::check_flatten_args(tensors, flat, offsets, /*writes_tensors=*/!into);
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> views;  // flat views of the tensors (a copy only for a source)
  views.reserve(tensors.size());
  for (const auto& t : tensors) views.push_back(into ? t.reshape({-1}) : t.view({-1}));
  for_each_range(views, flat, [&](size_t i, int64_t lo, int64_t len) {
    at::Tensor part = flat.narrow(0, offsets[i] + lo, len);
    at::Tensor mine = views[i].narrow(0, lo, len);
    if (into) {
      part.copy_(mine);
    } else {
      mine.copy_(part);
    }
  });
}

void flatten_into(const std::vector<at::Tensor>& tensors, at::Tensor flat,
                  const std::vector<int64_t>& offsets) {
  copy_between(tensors, flat, offsets, /*into=*/true);
}

void unflatten_from(at::Tensor flat, const std::vector<at::Tensor>& tensors,
                    const std::vector<int64_t>& offsets) {
  copy_between(tensors, flat, offsets, /*into=*/false);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zeroengine flatten/unflatten of many tensors into one flat buffer";
  m.def("flatten_into", &flatten_into, "flat[off:off+n] = t for each tensor",
        py::arg("tensors"), py::arg("flat"), py::arg("offsets"));
  m.def("unflatten_from", &unflatten_from, "t = flat[off:off+n] for each tensor",
        py::arg("flat"), py::arg("tensors"), py::arg("offsets"));
}
