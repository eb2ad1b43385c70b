// The CUDA kernel of ad_examples::bias_gelu (schema and CPU kernel: bias_gelu.cpp).
// ad.load_extension builds this file only where torch has CUDA, nvcc matches it and a GPU
// is here, for that GPU's architecture.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>

namespace {

__global__ void bias_gelu_kernel(const float* __restrict__ x, const float* __restrict__ bias,
                                 float* __restrict__ y, int64_t n, int64_t cols) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += stride) {
    const float v = x[i] + bias[i % cols];
    y[i] = 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
  }
}

at::Tensor bias_gelu_cuda(const at::Tensor& x, const at::Tensor& bias) {
  TORCH_CHECK(bias.dim() == 1 && x.dim() >= 1 && x.size(-1) == bias.size(0),
              "bias_gelu: x's last dimension (", x.dim() ? x.size(-1) : 0,
              ") must equal the length of the 1-d bias (", bias.numel(), ")");
  TORCH_CHECK(x.scalar_type() == at::kFloat && bias.scalar_type() == at::kFloat,
              "bias_gelu: float32 tensors only, got ", x.scalar_type(), " and ",
              bias.scalar_type());
  TORCH_CHECK(x.device() == bias.device(), "bias_gelu: x is on ", x.device(),
              " but bias is on ", bias.device());
  const c10::cuda::CUDAGuard guard(x.device());  // launch on x's GPU, not the current one
  const at::Tensor xc = x.contiguous();
  const at::Tensor bc = bias.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t n = xc.numel();
  if (n == 0) return y;
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((n + threads - 1) / threads, 65535);
  bias_gelu_kernel<<<blocks, threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      xc.const_data_ptr<float>(), bc.const_data_ptr<float>(), y.mutable_data_ptr<float>(), n,
      bc.numel());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(ad_examples, CUDA, m) { m.impl("bias_gelu", &bias_gelu_cuda); }
