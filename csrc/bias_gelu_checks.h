// Input checks shared by the CPU and the CUDA kernel of bias + GELU: a clear error instead of garbage.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

// "[8, 16]": shapes written out by hand, because streaming x.sizes() into TORCH_CHECK's message crashed the
// process (SIGSEGV) instead of raising with torch 2.11's headers.
inline std::string shape_text(const at::Tensor& t) {
  std::string text = "[";
  for (int64_t d = 0; d < t.dim(); ++d) text += (d ? ", " : "") + std::to_string(t.size(d));
  return text + "]";
}

inline void check_bias_gelu_inputs(const at::Tensor& x, const at::Tensor& bias, c10::DeviceType device_type,
                                   const char* op) {
  TORCH_CHECK(x.device().type() == device_type && bias.device() == x.device(), op, ": expected x and bias on one ",
              c10::DeviceTypeName(device_type), " device, got x on ", x.device(), " and bias on ", bias.device());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16,
              op, ": x must be float32, float16 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(bias.scalar_type() == x.scalar_type(), op, ": x and bias must have the same dtype, got ",
              x.scalar_type(), " and ", bias.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && bias.dim() == 1 && bias.size(0) == x.size(-1), op,
              ": need x [..., cols] and bias [cols], got x ", shape_text(x), " and bias ", shape_text(bias));
  TORCH_CHECK(x.is_contiguous() && bias.is_contiguous(), op, ": x and bias must be contiguous");
}
