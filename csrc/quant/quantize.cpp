// Blockwise symmetric int8 quantization for the quantized collectives (ZeRO++ qwZ / qgZ).
//
// Each block of `block` elements gets one fp32 scale, max|x| / 127; an element is stored as
// round(x / scale) in [-127, 127], so it comes back within scale / 2 = max|x| / 254 of its
// value. The arithmetic is torch's, operation for operation (x / scale, rounding half to
// even), so this kernel and the PyTorch fallback (zeroengine/ops/quantize.py) give the same
// bytes. Blocks are independent: at::parallel_for spreads them over threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cfloat>
#include <cmath>

#include "../common/quant_common.h"

namespace {

template <typename T>
void quantize_blocks(const T* x, int8_t* q, float* scales, int64_t n, int64_t block) {
  const int64_t blocks = (n + block - 1) / block;
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * block, hi = std::min(n, lo + block);
      float amax = 0.f;
      for (int64_t i = lo; i < hi; ++i) amax = std::max(amax, std::fabs(static_cast<float>(x[i])));
      const float scale = zeroengine::block_scale(amax);
      scales[b] = scale;
      const float divisor = zeroengine::safe_divisor(scale);
      for (int64_t i = lo; i < hi; ++i)
        q[i] = static_cast<int8_t>(zeroengine::clamp127(std::nearbyint(static_cast<float>(x[i]) / divisor)));
    }
  });
}

template <typename T>
void dequantize_blocks(const int8_t* q, const float* scales, T* out, int64_t n, int64_t block,
                       bool accumulate) {
  const int64_t blocks = (n + block - 1) / block;
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * block, hi = std::min(n, lo + block);
      const float scale = scales[b];
      for (int64_t i = lo; i < hi; ++i) {
        const float v = static_cast<float>(q[i]) * scale;
        out[i] = accumulate ? static_cast<T>(static_cast<float>(out[i]) + v) : static_cast<T>(v);
      }
    }
  });
}

void check(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace

// x (float32/bfloat16/float16, any shape) -> q (int8, x.numel()) and scales (float32, blocks).
static void quantize_int8(at::Tensor x, at::Tensor q, at::Tensor scales, int64_t block) {
  check(x, "x"); check(q, "q"); check(scales, "scales");
  const int64_t n = x.numel();
  TORCH_CHECK(block > 0, "block must be positive");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.numel() == n, "q must be int8 with x's numel");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == (n + block - 1) / block,
              "scales must be float32 with one element per block");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_int8", [&] {
    quantize_blocks<scalar_t>(x.data_ptr<scalar_t>(), q.data_ptr<int8_t>(),
                              scales.data_ptr<float>(), n, block);
  });
}

// out (float32/bfloat16/float16) = q * scale of its block, or += with accumulate.
static void dequantize_int8(at::Tensor q, at::Tensor scales, at::Tensor out, int64_t block,
                            bool accumulate) {
  check(q, "q"); check(scales, "scales"); check(out, "out");
  const int64_t n = q.numel();
  TORCH_CHECK(block > 0, "block must be positive");
  TORCH_CHECK(q.scalar_type() == at::kChar && out.numel() == n, "out must have q's numel");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == (n + block - 1) / block,
              "scales must be float32 with one element per block");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "dequantize_int8", [&] {
    dequantize_blocks<scalar_t>(q.data_ptr<int8_t>(), scales.data_ptr<float>(),
                                out.data_ptr<scalar_t>(), n, block, accumulate);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zeroengine blockwise int8 quantize/dequantize (quantized collectives)";
  m.def("quantize_int8", &quantize_int8, py::arg("x"), py::arg("q"), py::arg("scales"),
        py::arg("block"));
  m.def("dequantize_int8", &dequantize_int8, py::arg("q"), py::arg("scales"), py::arg("out"),
        py::arg("block"), py::arg("accumulate"));
}
