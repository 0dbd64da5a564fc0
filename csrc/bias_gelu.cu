// bias + GELU(tanh) in plain CUDA: out = gelu_tanh(x + bias), x [rows, cols] row-major, bias [cols].
// No PyTorch header, so nvcc compiles it in seconds; bias_gelu_cuda.cpp calls bias_gelu_cuda_launch().
//
// Two kernels, so that notebook 06 can measure what each change buys:
//   bias_gelu_flat_kernel  the first version: the tensor as one flat array of 16-byte packs. Per pack one
//                          division (first % cols); per element a bias load, a wrap test and a precise expf.
//   bias_gelu_rows_kernel  2-D: a thread owns one 16-byte column pack and walks down the rows. It loads its
//                          bias pack once (one 16-byte load), and no index needs a division. The math is a
//                          template parameter: precise expf, ex2.approx (like __expf), or tanh.approx.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "bias_gelu_launch.h"

namespace {

// PyTorch builds extensions with __CUDA_NO_HALF_CONVERSIONS__ (and bf16's): convert explicitly.
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// ── The math: GELU(z) = 0.5 z (1 + tanh u) = z * sigmoid(2u), u = sqrt(2/pi) (z + 0.044715 z^3) ──────────────
enum class Math {
  kPrecise,     // expf: a few ulp in float32, about 10 instructions (range reduction + MUFU.EX2 + fix-ups)
  kFastExp,     // 2^k with ex2.approx, log2(e) folded into the polynomial: 4 float ops + MUFU.EX2
  kTanhApprox,  // tanh.approx.f32 (sm_75+): one MUFU op for the whole sigmoid, but 1 + tanh(u) cancels for z < 0
};

__device__ __forceinline__ float ex2_approx(float k) {  // 2^k, about 2 ulp, flushes subnormals to zero
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(k));
  return e;
}

__device__ __forceinline__ float rcp_approx(float d) {  // 1/d, about 1 ulp; 1/inf = 0
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  return r;
}

__device__ __forceinline__ float tanh_approx(float u) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  float t;
  asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(u));
  return t;
#else
  return tanhf(u);  // no tanh instruction before sm_75
#endif
}

template <Math M>
__device__ __forceinline__ float gelu_tanh(float z) {
  if constexpr (M == Math::kPrecise) {  // exactly the first version's arithmetic
    const float two_u = 1.5957691216057308f * (z + 0.044715f * z * z * z);
    return __fdividef(z, 1.0f + expf(-two_u));
  } else if constexpr (M == Math::kFastExp) {
    // e^(-2u) = 2^k with k = z (c1 + c2 z^2), c1 = -2 sqrt(2/pi) log2(e), c2 = 0.044715 c1
    constexpr float c1 = -2.302208198144325f, c2 = -0.10294323958002350f;
    const float k = z * fmaf(c2, z * z, c1);
    return z * rcp_approx(1.0f + ex2_approx(k));  // z very negative: 2^k = inf, 1/inf = 0, out = -0
  } else {
    constexpr float c1 = 0.7978845608028654f, c2 = 0.035677408136300125f;  // sqrt(2/pi), 0.044715 sqrt(2/pi)
    const float half_z = 0.5f * z;
    return fmaf(half_z, tanh_approx(z * fmaf(c2, z * z, c1)), half_z);
  }
}

// VEC elements in one aligned struct: the compiler loads and stores it with one 16-byte instruction.
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

// Round VEC floats into a pack; 16-bit types two at a time (one cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32 per pair).
template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> round_pack(const float (&y)[VEC]) {
  Pack<T, VEC> p;
  if constexpr (std::is_same_v<T, __nv_bfloat16> && VEC % 2 == 0) {
#pragma unroll
    for (int k = 0; k < VEC; k += 2) {
      *reinterpret_cast<__nv_bfloat162*>(&p.v[k]) = __floats2bfloat162_rn(y[k], y[k + 1]);
    }
  } else if constexpr (std::is_same_v<T, __half> && VEC % 2 == 0) {
#pragma unroll
    for (int k = 0; k < VEC; k += 2) {
      *reinterpret_cast<__half2*>(&p.v[k]) = __floats2half2_rn(y[k], y[k + 1]);
    }
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) p.v[k] = from_float<T>(y[k]);
  }
  return p;
}

constexpr int kThreads = 128;  // per block, both kernels
constexpr int kUnroll = 4;     // 16-byte loads each thread issues before any arithmetic: bytes in flight

// ── The first version: flat packs ──────────────────────────────────────────────────────────────────────────────
// A block owns kUnroll * blockDim.x packs of VEC consecutive elements of the flat [rows * cols] tensor; thread t
// takes packs t, t + blockDim.x, ... so that each step is one coalesced sweep. A pack that would run past the end
// becomes a scalar tail. Index is uint32_t below 2^31 elements: 64-bit division costs far more.
template <typename T, int VEC, typename Index>
__global__ void __launch_bounds__(kThreads) bias_gelu_flat_kernel(const T* __restrict__ x, const T* __restrict__ bias,
                                                                  T* __restrict__ out, Index n, Index cols) {
  const Index block_first = static_cast<Index>(blockIdx.x) * blockDim.x * kUnroll * VEC;
  Pack<T, VEC> in[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const Index first = block_first + (static_cast<Index>(u) * blockDim.x + threadIdx.x) * VEC;
    if (first + VEC <= n) in[u] = *reinterpret_cast<const Pack<T, VEC>*>(x + first);
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const Index first = block_first + (static_cast<Index>(u) * blockDim.x + threadIdx.x) * VEC;
    if (first + VEC <= n) {
      Pack<T, VEC> res;
      Index c = first % cols;  // one division per pack; then step along the row, wrapping at its end
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        res.v[k] = from_float<T>(gelu_tanh<Math::kPrecise>(to_float(in[u].v[k]) + to_float(bias[c])));
        if (++c == cols) c = 0;
      }
      *reinterpret_cast<Pack<T, VEC>*>(out + first) = res;
    } else {
      for (Index i = first; i < n; ++i) {
        out[i] = from_float<T>(gelu_tanh<Math::kPrecise>(to_float(x[i]) + to_float(bias[i % cols])));
      }
    }
  }
}

template <typename T>
cudaError_t launch_flat(const T* x, const T* bias, T* out, int64_t n, int64_t cols, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  // A view that starts mid-allocation may not be 16-byte aligned: then one element per access.
  const bool aligned = reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const int64_t per_block = int64_t{kThreads} * kUnroll * (aligned ? kVec : 1);
  const int64_t blocks = (n + per_block - 1) / per_block;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned int>(blocks));
  const bool small = n < (int64_t{1} << 31);
  if (aligned && small) {
    bias_gelu_flat_kernel<T, kVec, uint32_t><<<grid, kThreads, 0, stream>>>(x, bias, out, n, cols);
  } else if (aligned) {
    bias_gelu_flat_kernel<T, kVec, int64_t><<<grid, kThreads, 0, stream>>>(x, bias, out, n, cols);
  } else if (small) {
    bias_gelu_flat_kernel<T, 1, uint32_t><<<grid, kThreads, 0, stream>>>(x, bias, out, n, cols);
  } else {
    bias_gelu_flat_kernel<T, 1, int64_t><<<grid, kThreads, 0, stream>>>(x, bias, out, n, cols);
  }
  return cudaGetLastError();
}

// ── The fix: rows ──────────────────────────────────────────────────────────────────────────────────────────────
// Block (tx, ty) threads; thread (i, j) of block (bx, by, bz) owns the VEC columns starting at
// col = (bx * tx + i) * VEC and the kUnroll rows (group * kUnroll + u) * ty + j of its row group
// (group = bz * gridDim.y + by: y and z together, since each is at most 65535). It loads its bias pack once, issues
// its kUnroll row loads, then computes and stores. Offsets are row * cols + col: one 32 x 32 -> 64-bit
// multiply-add per pack, no division anywhere. The column blocks are blockIdx.x, so blocks that run at the same time
// cover whole rows, one contiguous stretch of memory. VEC > 1 needs cols % VEC == 0 and 16-byte aligned pointers
// (every row then starts on a 16-byte boundary); otherwise the launcher picks VEC = 1.
// [lesson: rows kernel]
template <typename T, int VEC, Math M>
__global__ void __launch_bounds__(kThreads) bias_gelu_rows_kernel(const T* __restrict__ x, const T* __restrict__ bias,
                                                                  T* __restrict__ out, uint32_t rows, uint32_t cols) {
  const uint32_t col = (blockIdx.x * blockDim.x + threadIdx.x) * VEC;
  const uint32_t first_row = (blockIdx.z * gridDim.y + blockIdx.y) * kUnroll * blockDim.y + threadIdx.y;
  if (col >= cols || first_row >= rows) return;
  float b[VEC];
  const Pack<T, VEC> bias_pack = *reinterpret_cast<const Pack<T, VEC>*>(bias + col);
#pragma unroll
  for (int k = 0; k < VEC; ++k) b[k] = to_float(bias_pack.v[k]);
  Pack<T, VEC> in[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const uint32_t row = first_row + u * blockDim.y;
    if (row < rows) in[u] = *reinterpret_cast<const Pack<T, VEC>*>(x + static_cast<uint64_t>(row) * cols + col);
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const uint32_t row = first_row + u * blockDim.y;
    if (row < rows) {
      float y[VEC];
#pragma unroll
      for (int k = 0; k < VEC; ++k) y[k] = gelu_tanh<M>(to_float(in[u].v[k]) + b[k]);
      *reinterpret_cast<Pack<T, VEC>*>(out + static_cast<uint64_t>(row) * cols + col) = round_pack<T, VEC>(y);
    }
  }
}

// [end lesson]

template <typename T, Math M>
cudaError_t launch_rows(const T* x, const T* bias, T* out, int64_t rows, int64_t cols, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vector = cols % kVec == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(bias) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const int vec = vector ? kVec : 1;
  const int64_t packs = cols / vec;  // per row
  int tx = 1;
  while (tx < kThreads && tx < packs) tx *= 2;  // threads across a row: up to 128, fewer for narrow rows
  const int ty = kThreads / tx;                 // the rest of the block takes more rows
  const int64_t col_blocks = (packs + tx - 1) / tx;
  const int64_t row_groups = (rows + int64_t{kUnroll} * ty - 1) / (int64_t{kUnroll} * ty);
  if (rows >= (int64_t{1} << 31) || cols >= (int64_t{1} << 31)) return cudaErrorInvalidConfiguration;
  const int64_t grid_y = row_groups < 65535 ? row_groups : 65535;  // row groups over y and z
  const int64_t grid_z = (row_groups + grid_y - 1) / grid_y;
  const dim3 grid(static_cast<unsigned int>(col_blocks), static_cast<unsigned int>(grid_y),
                  static_cast<unsigned int>(grid_z));
  const dim3 block(tx, ty);
  const auto r = static_cast<uint32_t>(rows), c = static_cast<uint32_t>(cols);
  if (vector) {
    bias_gelu_rows_kernel<T, kVec, M><<<grid, block, 0, stream>>>(x, bias, out, r, c);
  } else {
    bias_gelu_rows_kernel<T, 1, M><<<grid, block, 0, stream>>>(x, bias, out, r, c);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch(int variant, const void* x, const void* bias, void* out, int64_t rows, int64_t cols,
                   cudaStream_t stream) {
  if (variant == kBiasGeluBest) {  // float32 keeps the precise math; 16-bit outputs cannot tell ex2.approx apart
    variant = std::is_same_v<T, float> ? kBiasGeluRows : kBiasGeluRowsFastExp;
  }
  const T* xt = static_cast<const T*>(x);
  const T* bt = static_cast<const T*>(bias);
  T* ot = static_cast<T*>(out);
  switch (variant) {
    case kBiasGeluFlat: return launch_flat<T>(xt, bt, ot, rows * cols, cols, stream);
    case kBiasGeluRows: return launch_rows<T, Math::kPrecise>(xt, bt, ot, rows, cols, stream);
    case kBiasGeluRowsFastExp: return launch_rows<T, Math::kFastExp>(xt, bt, ot, rows, cols, stream);
    case kBiasGeluRowsTanhApprox: return launch_rows<T, Math::kTanhApprox>(xt, bt, ot, rows, cols, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t bias_gelu_cuda_launch(int dtype, int variant, const void* x, const void* bias, void* out, int64_t rows,
                                  int64_t cols, cudaStream_t stream) {
  switch (dtype) {
    case kBiasGeluFloat32: return launch<float>(variant, x, bias, out, rows, cols, stream);
    case kBiasGeluFloat16: return launch<__half>(variant, x, bias, out, rows, cols, stream);
    case kBiasGeluBFloat16: return launch<__nv_bfloat16>(variant, x, bias, out, rows, cols, stream);
    default: return cudaErrorInvalidValue;
  }
}
