// Flatten / unflatten many tensors into / out of one flat buffer in a single call.
//
// On CPU the copies are split by *elements* across at::parallel_for threads, so one big tensor
// is shared between threads instead of serialising the call behind it. On CUDA each copy is an
// asynchronous kernel already; a plain loop (without Python's per-tensor overhead) is enough.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace {

void check(const std::vector<at::Tensor>& tensors, const at::Tensor& flat,
           const std::vector<int64_t>& offsets) {
  TORCH_CHECK(tensors.size() == offsets.size(), "got ", tensors.size(), " tensors but ",
              offsets.size(), " offsets");
  TORCH_CHECK(flat.dim() == 1 && flat.is_contiguous(), "flat must be a contiguous 1-D tensor");
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(offsets[i] >= 0 && offsets[i] + tensors[i].numel() <= flat.numel(),
                "tensor ", i, " of ", tensors[i].numel(), " elements at offset ", offsets[i],
                " overruns the flat buffer of ", flat.numel());
    TORCH_CHECK(tensors[i].device() == flat.device(), "tensor ", i, " is on ",
                tensors[i].device(), " but the flat buffer is on ", flat.device());
  }
}

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

void flatten_into(const std::vector<at::Tensor>& tensors, at::Tensor flat,
                  const std::vector<int64_t>& offsets) {
  check(tensors, flat, offsets);
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> sources;
  sources.reserve(tensors.size());
  for (const auto& t : tensors) sources.push_back(t.reshape({-1}));
  for_each_range(sources, flat, [&](size_t i, int64_t lo, int64_t len) {
    flat.narrow(0, offsets[i] + lo, len).copy_(sources[i].narrow(0, lo, len));
  });
}

void unflatten_from(at::Tensor flat, const std::vector<at::Tensor>& tensors,
                    const std::vector<int64_t>& offsets) {
  check(tensors, flat, offsets);
  at::NoGradGuard no_grad;
  for (const auto& t : tensors)
    TORCH_CHECK(t.is_contiguous(), "unflatten_from writes into contiguous tensors only");
  std::vector<at::Tensor> targets;
  targets.reserve(tensors.size());
  for (const auto& t : tensors) targets.push_back(t.view({-1}));
  for_each_range(targets, flat, [&](size_t i, int64_t lo, int64_t len) {
    targets[i].narrow(0, lo, len).copy_(flat.narrow(0, offsets[i] + lo, len));
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zeroengine flatten/unflatten of many tensors into one flat buffer";
  m.def("flatten_into", &flatten_into, "flat[off:off+n] = t for each tensor",
        py::arg("tensors"), py::arg("flat"), py::arg("offsets"));
  m.def("unflatten_from", &unflatten_from, "t = flat[off:off+n] for each tensor",
        py::arg("flat"), py::arg("tensors"), py::arg("offsets"));
}
