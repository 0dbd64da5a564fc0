// The PyTorch side of the CUDA kernel: checks, device guard, output allocation, stream, launch, error check.
// Compiled by the host compiler; the kernels are in bias_gelu.cu, which includes no PyTorch header.
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <string>

#include "bias_gelu_checks.h"
#include "bias_gelu_launch.h"

namespace {

at::Tensor run(const at::Tensor& x, const at::Tensor& bias, int64_t variant, const char* op) {
  check_bias_gelu_inputs(x, bias, c10::DeviceType::CUDA, op);
  // Numbers go into messages as std::string: streaming an int64_t into TORCH_CHECK's message crashed the process
  // (SIGSEGV) instead of raising with torch 2.11's headers, as streaming x.sizes() did (see bias_gelu_checks.h).
  TORCH_CHECK(variant >= kBiasGeluBest && variant <= kBiasGeluRowsTanhApprox, op,
              ": variant must be -1 (the best for the dtype) or 0..3, got ", std::to_string(variant));
  const c10::cuda::CUDAGuard guard(x.device());  // launch on x's GPU, whichever is current
  at::Tensor out = at::empty_like(x);
  if (x.numel() == 0) return out;
  const int64_t cols = x.size(-1);
  const int64_t rows = x.numel() / cols;
  TORCH_CHECK(rows < (int64_t{1} << 31) && cols < (int64_t{1} << 31), op,
              ": rows and cols must each be below 2^31, got ", std::to_string(rows), " rows of ", std::to_string(cols));
  const int dtype = x.scalar_type() == at::kFloat ? kBiasGeluFloat32
                    : x.scalar_type() == at::kHalf ? kBiasGeluFloat16 : kBiasGeluBFloat16;
  const cudaError_t err = bias_gelu_cuda_launch(dtype, static_cast<int>(variant), x.const_data_ptr(),
                                                bias.const_data_ptr(), out.mutable_data_ptr(), rows, cols,
                                                c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

at::Tensor bias_gelu_cuda(const at::Tensor& x, const at::Tensor& bias) {
  return run(x, bias, kBiasGeluBest, "bias_gelu_cuda");
}

at::Tensor bias_gelu_cuda_variant(const at::Tensor& x, const at::Tensor& bias, int64_t variant) {
  return run(x, bias, variant, "bias_gelu_cuda_variant");
}

}  // namespace

// The schemas, then the kernels for CUDA tensors: registered per dispatch key (not as a catch-all), so that a fake
// implementation can be added from Python (utils/bias_gelu.py) and torch.compile can trace a call to the ops.
TORCH_LIBRARY_FRAGMENT(course_ext, m) {
  m.def("bias_gelu_cuda(Tensor x, Tensor bias) -> Tensor");
  m.def("bias_gelu_cuda_variant(Tensor x, Tensor bias, int variant) -> Tensor");
}

TORCH_LIBRARY_IMPL(course_ext, CUDA, m) {
  m.impl("bias_gelu_cuda", &bias_gelu_cuda);
  m.impl("bias_gelu_cuda_variant", &bias_gelu_cuda_variant);
}
