// bias + GELU(tanh) on the CPU: the same arithmetic as the GPU kernels, one chunk of rows per task.
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "bias_gelu_checks.h"

namespace {

inline float gelu_tanh(float z) {  // 0.5 z (1 + tanh(u)) == z * sigmoid(2u), u = sqrt(2/pi) (z + 0.044715 z^3)
  const float two_u = 1.5957691216057308f * (z + 0.044715f * z * z * z);
  return z / (1.0f + std::exp(-two_u));
}

template <typename T>
void bias_gelu_rows(const T* x, const T* bias, T* out, int64_t row_begin, int64_t row_end, int64_t cols) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    const T* x_row = x + r * cols;
    T* out_row = out + r * cols;
    for (int64_t c = 0; c < cols; ++c) {
      out_row[c] = static_cast<T>(gelu_tanh(static_cast<float>(x_row[c]) + static_cast<float>(bias[c])));
    }
  }
}

template <typename T>
void run(const at::Tensor& x, const at::Tensor& bias, at::Tensor& out, int64_t rows, int64_t cols) {
  const T* xp = x.const_data_ptr<T>();
  const T* bp = bias.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  const int64_t grain = std::max<int64_t>(1, 32768 / cols);  // rows per task: about 32K elements
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) { bias_gelu_rows(xp, bp, op, begin, end, cols); });
}

at::Tensor bias_gelu_cpu(const at::Tensor& x, const at::Tensor& bias) {
  check_bias_gelu_inputs(x, bias, c10::DeviceType::CPU, "bias_gelu_cpu");
  at::Tensor out = at::empty_like(x);
  if (x.numel() == 0) return out;
  const int64_t cols = x.size(-1);
  const int64_t rows = x.numel() / cols;
  switch (x.scalar_type()) {
    case at::kFloat: run<float>(x, bias, out, rows, cols); break;
    case at::kHalf: run<c10::Half>(x, bias, out, rows, cols); break;
    default: run<c10::BFloat16>(x, bias, out, rows, cols); break;
  }
  return out;
}

}  // namespace

// The schema, then the kernel for CPU tensors: registered per dispatch key (not as a catch-all), so that a fake
// implementation can be added from Python (utils/bias_gelu.py) and torch.compile can trace a call to the op.
TORCH_LIBRARY_FRAGMENT(course_ext, m) { m.def("bias_gelu_cpu(Tensor x, Tensor bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(course_ext, CPU, m) { m.impl("bias_gelu_cpu", &bias_gelu_cpu); }
