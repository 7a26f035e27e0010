// Python bindings of the CUDA kernels (zeroengine._cuda_ext). Built by setup.py when torch has
// CUDA and nvcc is found; otherwise zeroengine/ops/cuda_kernels.py JIT-builds the same sources
// on first use, or falls back to PyTorch ops.
#include <torch/extension.h>

#include <vector>

namespace zeroengine {
void fused_adam(std::vector<at::Tensor> params, std::vector<at::Tensor> grads,
                std::vector<at::Tensor> exp_avgs, std::vector<at::Tensor> exp_avg_sqs,
                std::vector<at::Tensor> low_copies, double lr, double beta1, double beta2,
                double eps, double weight_decay, int64_t step, bool adamw,
                bool bias_correction, double grad_coef, at::Tensor found_nonfinite);
bool mixed_adam(std::vector<at::Tensor> params, std::vector<at::Tensor> grads,
                std::vector<at::Tensor> exp_avgs, std::vector<at::Tensor> exp_avg_sqs,
                std::vector<at::Tensor> low_copies, std::vector<int64_t> first_index,
                double lr, double beta1, double beta2, double eps, double weight_decay,
                int64_t step, bool adamw, bool bias_correction, double grad_coef,
                bool stochastic, int64_t seed);
void cuda_flatten_into(const std::vector<at::Tensor>& tensors, at::Tensor flat,
                       const std::vector<int64_t>& offsets);
void cuda_unflatten_from(at::Tensor flat, const std::vector<at::Tensor>& tensors,
                         const std::vector<int64_t>& offsets);
void cuda_quantize_int8(at::Tensor x, at::Tensor q, at::Tensor scales, int64_t block);
void cuda_dequantize_int8(at::Tensor q, at::Tensor scales, at::Tensor out, int64_t block,
                          bool accumulate);
}  // namespace zeroengine

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zeroengine CUDA kernels: multi-tensor fused Adam/AdamW, flatten/unflatten and "
          "blockwise int8 quantization";
  m.def("fused_adam", &zeroengine::fused_adam,
        "Adam/AdamW over fp32 masters with gradient unscale, inf/NaN check and low-precision "
        "copy-out in one pass",
        py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"),
        py::arg("low_copies"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("step"), py::arg("adamw"), py::arg("bias_correction"),
        py::arg("grad_coef"), py::arg("found_nonfinite"));
  m.def("mixed_adam", &zeroengine::mixed_adam,
        "Adam/AdamW with 16-bit masters and/or states, computed in fp32 and rounded (to "
        "nearest or stochastically); False: a dtype combination not built",
        py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"),
        py::arg("low_copies"), py::arg("first_index"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("step"),
        py::arg("adamw"), py::arg("bias_correction"), py::arg("grad_coef"),
        py::arg("stochastic"), py::arg("seed"));
  m.def("flatten_into", &zeroengine::cuda_flatten_into, "flat[off:off+n] = t for each tensor",
        py::arg("tensors"), py::arg("flat"), py::arg("offsets"));
  m.def("unflatten_from", &zeroengine::cuda_unflatten_from, "t = flat[off:off+n] for each tensor",
        py::arg("flat"), py::arg("tensors"), py::arg("offsets"));
  m.def("quantize_int8", &zeroengine::cuda_quantize_int8,
        "blockwise symmetric int8: q = round(x / (max|block| / 127)), one fp32 scale per block",
        py::arg("x"), py::arg("q"), py::arg("scales"), py::arg("block"));
  m.def("dequantize_int8", &zeroengine::cuda_dequantize_int8,
        "out (+)= q * the scale of its block", py::arg("q"), py::arg("scales"), py::arg("out"),
        py::arg("block"), py::arg("accumulate"));
}
