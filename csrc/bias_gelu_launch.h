// The one declaration of the CUDA launcher: bias_gelu.cu defines it, bias_gelu_cuda.cpp calls it.
// Plain C++ types only, so that the .cu file needs no PyTorch header.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

// Storage dtype of x, bias and out.
enum BiasGeluDtype : int { kBiasGeluFloat32 = 0, kBiasGeluFloat16 = 1, kBiasGeluBFloat16 = 2 };

// The kernel versions the notebook compares; kBiasGeluBest picks per dtype (see bias_gelu.cu).
enum BiasGeluVariant : int {
  kBiasGeluBest = -1,
  kBiasGeluFlat = 0,         // the first version: flat packs, a bias load and a wrap test per element, expf
  kBiasGeluRows = 1,         // 2-D: a thread keeps one bias pack for all its rows; no division; expf
  kBiasGeluRowsFastExp = 2,  // as 1, with __expf (ex2.approx): the default for float16 and bfloat16
  kBiasGeluRowsTanhApprox = 3,  // as 1, with tanh.approx.f32 in 0.5 z (1 + tanh u): fastest, least accurate
};

// out = gelu_tanh(x + bias) for x of n = rows * cols elements (row-major), bias of cols elements.
cudaError_t bias_gelu_cuda_launch(int dtype, int variant, const void* x, const void* bias, void* out, int64_t rows,
                                  int64_t cols, cudaStream_t stream);
