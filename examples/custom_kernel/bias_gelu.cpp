// bias_gelu(x, bias) = gelu(x + bias), the exact (erf) GELU, fused into one pass over x.
// The operator's schema and its CPU kernel. The CUDA kernel is in bias_gelu_cuda.cu and is
// registered for the same operator where it is built. Only light torch headers are
// included: <torch/extension.h> would triple the build time.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>

namespace {

at::Tensor bias_gelu_cpu(const at::Tensor& x, const at::Tensor& bias) {
  TORCH_CHECK(bias.dim() == 1 && x.dim() >= 1 && x.size(-1) == bias.size(0),
              "bias_gelu: x's last dimension (", x.dim() ? x.size(-1) : 0,
              ") must equal the length of the 1-d bias (", bias.numel(), ")");
  TORCH_CHECK(x.scalar_type() == at::kFloat && bias.scalar_type() == at::kFloat,
              "bias_gelu: float32 tensors only, got ", x.scalar_type(), " and ",
              bias.scalar_type());
  TORCH_INTERNAL_ASSERT(x.device().is_cpu() && bias.device().is_cpu());
  const at::Tensor xc = x.contiguous();
  const at::Tensor bc = bias.contiguous();
  at::Tensor y = at::empty_like(xc);
  const float* xp = xc.const_data_ptr<float>();
  const float* bp = bc.const_data_ptr<float>();
  float* yp = y.mutable_data_ptr<float>();
  const int64_t cols = bc.numel();
  const int64_t rows = cols ? xc.numel() / cols : 0;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * cols;
      float* yr = yp + r * cols;
      for (int64_t c = 0; c < cols; ++c) {
        const float v = xr[c] + bp[c];
        yr[c] = 0.5f * v * (1.0f + std::erf(v * static_cast<float>(M_SQRT1_2)));
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(ad_examples, m) { m.def("bias_gelu(Tensor x, Tensor bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(ad_examples, CPU, m) { m.impl("bias_gelu", &bias_gelu_cpu); }
