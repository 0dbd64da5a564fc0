"""Bias + GELU fused into one kernel, in Triton and in CUDA C++, registered as PyTorch operators (notebook 06).

The op: ``out = gelu_tanh(x + bias)`` for an activation ``x`` of shape ``[..., cols]`` and a ``bias`` of shape
``[cols]``: the epilogue of a Transformer MLP's first linear layer. Eager PyTorch runs it as two kernels (``add``,
then ``gelu``) and sends the intermediate ``x + bias`` through device memory; one fused kernel reads ``x`` once and
writes ``out`` once, so it moves half the bytes. Every implementation here computes in float32 and rounds once:

- :func:`reference`: the eager PyTorch definition, and :func:`bytes_moved` / :func:`eager_bytes_moved`.
- :data:`bias_gelu_kernel` (Triton, autotuned): launched by :func:`bias_gelu_triton_launch`.
- :data:`CPU_SOURCE`, :data:`CUDA_WRAPPER_SOURCE` + :data:`CUDA_KERNEL_SOURCE` (C++ / CUDA C++), built by
  :func:`build_extension` with ``torch.utils.cpp_extension.load_inline`` and exposed as the raw operators
  ``torch.ops.course_ext.bias_gelu_cpu`` / ``bias_gelu_cuda``; :func:`bias_gelu_cpu` / :func:`bias_gelu_cuda`
  build on first use and call them.
- Two first-class operators with a fake (meta) implementation and autograd: ``course::bias_gelu_triton``
  (:func:`bias_gelu_triton`, ``torch.library.triton_op``: torch.compile sees the Triton kernel) and
  ``course::bias_gelu_cpp`` (:func:`bias_gelu_cpp`, ``torch.library.custom_op`` with one kernel per device type:
  the C++ extension on CPU, the CUDA extension on GPUs; opaque to torch.compile).

Triton: this module imports ``triton`` (when installed). On a machine without a GPU Triton can only run in its
interpreter, which must be switched on *before* the first ``import triton`` in the process: set
``os.environ["TRITON_INTERPRET"] = "1"`` before importing this module. ``import utils`` does not import it.

Building C++ extensions (:func:`build_extension`):

- light headers: the sources include ``ATen/core/Tensor.h`` and ``torch/library.h`` and register their operator
  with ``TORCH_LIBRARY_FRAGMENT`` (``is_python_module=False``, no pybind11), instead of ``torch/extension.h``.
  On a 2-core machine the CPU extension built in 7 s this way and in 32 s with ``torch/extension.h`` + pybind11.
  The ``.cu`` file includes no PyTorch header at all: nvcc compiles plain CUDA and a C++ file calls it.
- one build directory per (sources, flags, torch, CUDA, GPU arch), under the repository's git-ignored ``build/``:
  a change of any of them builds afresh, next to the old build instead of over it.
- only for the detected GPU's arch (``TORCH_CUDA_ARCH_LIST`` from ``torch.cuda.get_device_capability()``).
- in a child process, in its own process group, with a deadline: on timeout the whole group (Python, ninja,
  c++/nvcc) is killed. A thread with a deadline would not bound anything: the compiler would keep running.
- stale locks: ``load_inline`` serialises builds of one directory with a file named ``lock``. Where it uses
  ``FileBaton`` (PyTorch before its switch to an OS lock, pytorch/pytorch#189245) the file's mere existence
  blocks, so a build killed half-way (a timeout, Ctrl-C, an out-of-memory kill) leaves a lock that makes every
  later build wait forever. Each build here first takes this module's own OS lock on the directory
  (:func:`build_guard`, ``flock``: the kernel releases it when its holder dies, however it dies); holding it
  means no other build of the directory is running, so a ``lock`` file found then is stale and is removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import torch

try:  # Triton ships on Linux (and with Windows wheels of some builds); without it the Triton path says so.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is installed with CUDA builds of torch on Linux
    triton = None

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""The dtypes every kernel here accepts (x and bias share one)."""

SQRT_2_OVER_PI = 0.7978845608028654
GELU_CUBIC = 0.044715

REPO_ROOT = Path(__file__).resolve().parents[1]
BUILD_ROOT = REPO_ROOT / "build" / "bias_gelu"
"""Where the C++ extensions are built: the repository's git-ignored build/ folder."""

DEFAULT_BUILD_TIMEOUT_S = 300.0
"""The longest a build may take by default (it takes 5-20 s on a 2-core machine)."""


# ── 1 · The op in plain PyTorch, its checks and the bytes it must move ───────────────────────────────────────


def reference(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Eager PyTorch: ``gelu(x + bias, approximate="tanh")``, two kernels with an intermediate in memory."""
    return torch.nn.functional.gelu(x + bias, approximate="tanh")


def bytes_moved(x: torch.Tensor, bias: torch.Tensor) -> int:
    """Bytes a fused kernel must move: read x and bias once, write the output once."""
    return (2 * x.numel() + bias.numel()) * x.element_size()


def eager_bytes_moved(x: torch.Tensor, bias: torch.Tensor) -> int:
    """Bytes eager moves: ``add`` reads x and bias and writes x + bias; ``gelu`` reads it back and writes out."""
    return (4 * x.numel() + bias.numel()) * x.element_size()


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """``torch.testing.assert_close`` tolerances for a kernel's output against :func:`reference` computed in
    float32 from the same inputs.

    float32: rtol 1e-5, atol 1e-6 (the kernels use exp where PyTorch uses tanh; a few float32 ulps apart).
    float16 / bfloat16: rtol = the dtype's eps (1 ulp at 1.0), atol 1e-5: rounding the float32 result once to
    the output dtype costs at most half an ulp, so this allows twice that.
    """
    if dtype == torch.float32:
        return {"rtol": 1e-5, "atol": 1e-6}
    if dtype in (torch.float16, torch.bfloat16):
        return {"rtol": torch.finfo(dtype).eps, "atol": 1e-5}
    raise ValueError(f"no tolerance for {dtype}: the kernels support {SUPPORTED_DTYPES}")


def check_inputs(x: torch.Tensor, bias: torch.Tensor, *, device_type: str | None = None) -> None:
    """Raise a clear error unless ``x [..., cols]`` and ``bias [cols]`` suit the kernels of this module.

    Every entry point calls this before launching anything, so bad inputs fail the same way on every device
    (the C++ kernels repeat the checks with ``TORCH_CHECK`` for callers of ``torch.ops.course_ext``).

    Args:
        device_type: the device type the caller's kernel needs ("cpu" or "cuda"); None accepts any.

    Raises:
        TypeError: for a non-tensor, or a dtype other than float32 / float16 / bfloat16, or x and bias of
            different dtypes.
        ValueError: for the wrong device, mismatched shapes, or a non-contiguous tensor.
    """
    for name, t in (("x", x), ("bias", bias)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"bias_gelu: {name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"bias_gelu: x must be float32, float16 or bfloat16, got {x.dtype}")
    if bias.dtype != x.dtype:
        raise TypeError(f"bias_gelu: x and bias must have the same dtype, got {x.dtype} and {bias.dtype}")
    if device_type is not None and x.device.type != device_type:
        hint = "move them with .to('cuda')" if device_type == "cuda" else f"use the {x.device.type} kernel"
        raise ValueError(f"bias_gelu: this kernel needs {device_type} tensors, got x on {x.device}: {hint}")
    if bias.device != x.device:
        raise ValueError(f"bias_gelu: x and bias must be on one device, got {x.device} and {bias.device}")
    if x.dim() < 1 or bias.dim() != 1 or bias.shape[0] != x.shape[-1]:
        raise ValueError(f"bias_gelu: need x [..., cols] and bias [cols], got x {list(x.shape)} and bias "
                         f"{list(bias.shape)}")
    if not (x.is_contiguous() and bias.is_contiguous()):
        raise ValueError("bias_gelu: x and bias must be contiguous (the kernels index them as flat arrays): "
                         "call .contiguous() first")


# ── 2 · Triton ───────────────────────────────────────────────────────────────────────────────────────────────

TRITON_INTERPRETED = triton is not None and os.environ.get("TRITON_INTERPRET") == "1"
"""True when Triton runs its CPU interpreter (TRITON_INTERPRET=1 was set before this module was imported)."""


def triton_configs() -> list:
    """The autotuner's candidates: tile height x width and warps; one tile when interpreting (no tuning)."""
    if TRITON_INTERPRETED:  # numpy runs each program: large tiles, nothing to tune
        return [triton.Config({"BLOCK_R": 64, "BLOCK_C": 1024})]
    return [triton.Config({"BLOCK_R": r, "BLOCK_C": c}, num_warps=w)
            for r, c, w in ((1, 2048, 4), (4, 1024, 4), (8, 1024, 8), (16, 512, 8))]


if triton is not None:

    @triton.autotune(configs=triton_configs(), key=["n_rows", "n_cols"])
    @triton.jit
    def bias_gelu_kernel(x_ptr, bias_ptr, out_ptr, n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        # One program computes a BLOCK_R x BLOCK_C tile of out = gelu_tanh(x + bias).
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # int64: > 2^31 elements is fine
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        col_ok = cols < n_cols  # edge tiles hang over the tensor: masked loads and stores
        mask = (rows[:, None] < n_rows) & col_ok[None, :]
        offsets = rows[:, None] * n_cols + cols[None, :]
        x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
        b = tl.load(bias_ptr + cols, mask=col_ok).to(tl.float32)  # one bias row per tile, broadcast
        z = x + b[None, :]
        two_u = 1.5957691216057308 * (z + 0.044715 * z * z * z)  # 2u, u = sqrt(2/pi) (z + 0.044715 z^3)
        y = z * tl.sigmoid(two_u)  # 0.5 z (1 + tanh(u)) == z * sigmoid(2u)
        tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)

else:  # pragma: no cover
    bias_gelu_kernel = None


def _require_triton(x: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError("bias_gelu: Triton is not installed (pip install triton; it ships for Linux)")
    if x.device.type == "cpu" and not TRITON_INTERPRETED:
        raise ValueError("bias_gelu: Triton compiles for GPUs; for CPU tensors set TRITON_INTERPRET=1 before the "
                         "first `import triton` in the process (its interpreter), or use a CUDA tensor")
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"bias_gelu: the Triton kernel runs on CUDA (or CPU via its interpreter), not {x.device}")


def _triton_forward(x: torch.Tensor, bias: torch.Tensor, kernel) -> torch.Tensor:
    """Allocate the output and launch ``kernel`` (the Triton kernel, or it wrapped by torch.library.wrap_triton)."""
    out = torch.empty_like(x)
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols if n_cols else 0
    if out.numel() == 0:  # nothing to compute; a grid with a zero dimension is not launchable
        return out

    def grid(meta):
        return (triton.cdiv(n_rows, meta["BLOCK_R"]), triton.cdiv(n_cols, meta["BLOCK_C"]))

    kernel[grid](x, bias, out, n_rows, n_cols)
    return out


def bias_gelu_triton_launch(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The Triton kernel through a plain Python launcher (no operator, no autograd): check, allocate, launch."""
    check_inputs(x, bias)
    _require_triton(x)
    return _triton_forward(x, bias, bias_gelu_kernel)


# ── 3 · C++ and CUDA C++ sources ────────────────────────────────────────────────────────────────────────────

CHECKS_SOURCE = r"""
// Input checks shared by the CPU and the CUDA kernel: a clear error instead of garbage.
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
              ": need x [..., cols] and bias [cols], got x ", shape_text(x), " and bias ",
              shape_text(bias));
  TORCH_CHECK(x.is_contiguous() && bias.is_contiguous(), op, ": x and bias must be contiguous");
}
"""

CPU_SOURCE = r"""
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

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

TORCH_LIBRARY_FRAGMENT(course_ext, m) {
  m.def("bias_gelu_cpu(Tensor x, Tensor bias) -> Tensor", &bias_gelu_cpu);
}
"""

CUDA_KERNEL_SOURCE = r"""
// Plain CUDA: no PyTorch header, so nvcc compiles it in seconds. The C++ file below calls the launcher.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace {

// PyTorch builds with __CUDA_NO_HALF_CONVERSIONS__: convert explicitly.
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

__device__ __forceinline__ float gelu_tanh(float z) {  // z * sigmoid(2u), u = sqrt(2/pi) (z + 0.044715 z^3)
  const float two_u = 1.5957691216057308f * (z + 0.044715f * z * z * z);
  return __fdividef(z, 1.0f + expf(-two_u));
}

// VEC elements in one aligned struct: the compiler loads and stores it with one 16-byte instruction.
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

// A block owns UNROLL * blockDim.x packs of VEC consecutive elements of the flat [rows * cols] tensor; thread t
// takes packs t, t + blockDim.x, ... so that each step is one coalesced sweep. All UNROLL 16-byte loads are issued
// before any arithmetic: more bytes in flight per thread, which is what hides the memory latency. A pack that would
// run past the end becomes a scalar tail. Index is uint32_t below 2^31 elements: 64-bit division costs far more.
template <typename T, int VEC, int UNROLL, typename Index>
__global__ void bias_gelu_kernel(const T* __restrict__ x, const T* __restrict__ bias, T* __restrict__ out,
                                 Index n, Index cols) {
  const Index block_first = static_cast<Index>(blockIdx.x) * blockDim.x * UNROLL * VEC;
  Pack<T, VEC> in[UNROLL];
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const Index first = block_first + (static_cast<Index>(u) * blockDim.x + threadIdx.x) * VEC;
    if (first + VEC <= n) in[u] = *reinterpret_cast<const Pack<T, VEC>*>(x + first);
  }
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const Index first = block_first + (static_cast<Index>(u) * blockDim.x + threadIdx.x) * VEC;
    if (first + VEC <= n) {
      Pack<T, VEC> res;
      Index c = first % cols;  // one division per pack; then step along the row, wrapping at its end
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        res.v[k] = from_float<T>(gelu_tanh(to_float(in[u].v[k]) + to_float(bias[c])));
        if (++c == cols) c = 0;
      }
      *reinterpret_cast<Pack<T, VEC>*>(out + first) = res;
    } else {
      for (Index i = first; i < n; ++i) out[i] = from_float<T>(gelu_tanh(to_float(x[i]) + to_float(bias[i % cols])));
    }
  }
}

constexpr int kThreads = 128;
constexpr int kUnroll = 4;

template <typename T, int VEC>
void launch_vec(const T* x, const T* bias, T* out, int64_t n, int64_t cols, unsigned int blocks,
                cudaStream_t stream) {
  if (n < (int64_t{1} << 31)) {
    bias_gelu_kernel<T, VEC, kUnroll, uint32_t><<<blocks, kThreads, 0, stream>>>(
        x, bias, out, static_cast<uint32_t>(n), static_cast<uint32_t>(cols));
  } else {
    bias_gelu_kernel<T, VEC, kUnroll, int64_t><<<blocks, kThreads, 0, stream>>>(x, bias, out, n, cols);
  }
}

template <typename T>
cudaError_t launch(const void* x, const void* bias, void* out, int64_t n, int64_t cols, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);  // 4 floats or 8 halves per 16-byte access
  // A view that starts mid-allocation may not be 16-byte aligned: then one element per access.
  const bool aligned = reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const int64_t per_block = int64_t{kThreads} * kUnroll * (aligned ? kVec : 1);
  const int64_t blocks = (n + per_block - 1) / per_block;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const T* xt = static_cast<const T*>(x);
  const T* bt = static_cast<const T*>(bias);
  T* ot = static_cast<T*>(out);
  if (aligned) {
    launch_vec<T, kVec>(xt, bt, ot, n, cols, static_cast<unsigned int>(blocks), stream);
  } else {
    launch_vec<T, 1>(xt, bt, ot, n, cols, static_cast<unsigned int>(blocks), stream);
  }
  return cudaGetLastError();
}

}  // namespace

// dtype: 0 float32, 1 float16, 2 bfloat16.
cudaError_t bias_gelu_cuda_launch(int dtype, const void* x, const void* bias, void* out, int64_t n, int64_t cols,
                                  cudaStream_t stream) {
  switch (dtype) {
    case 0: return launch<float>(x, bias, out, n, cols, stream);
    case 1: return launch<__half>(x, bias, out, n, cols, stream);
    case 2: return launch<__nv_bfloat16>(x, bias, out, n, cols, stream);
    default: return cudaErrorInvalidValue;
  }
}
"""

CUDA_WRAPPER_SOURCE = r"""
// The PyTorch side of the CUDA kernel: checks, device guard, output allocation, stream, launch, error check.
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

cudaError_t bias_gelu_cuda_launch(int dtype, const void* x, const void* bias, void* out, int64_t n, int64_t cols,
                                  cudaStream_t stream);

namespace {

at::Tensor bias_gelu_cuda(const at::Tensor& x, const at::Tensor& bias) {
  check_bias_gelu_inputs(x, bias, c10::DeviceType::CUDA, "bias_gelu_cuda");
  const c10::cuda::CUDAGuard guard(x.device());  // launch on x's GPU, whichever is current
  at::Tensor out = at::empty_like(x);
  if (x.numel() == 0) return out;
  const int dtype = x.scalar_type() == at::kFloat ? 0 : x.scalar_type() == at::kHalf ? 1 : 2;
  const cudaError_t err = bias_gelu_cuda_launch(dtype, x.const_data_ptr(), bias.const_data_ptr(),
                                                out.mutable_data_ptr(), x.numel(), x.size(-1),
                                                c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "bias_gelu_cuda: kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(course_ext, m) {
  m.def("bias_gelu_cuda(Tensor x, Tensor bias) -> Tensor", &bias_gelu_cuda);
}
"""


# ── 4 · Building: own directory, stale locks, a deadline ─────────────────────────────────────────────────────


def cuda_arch_list(device: torch.device | str | None = None) -> str:
    """``TORCH_CUDA_ARCH_LIST`` for the detected GPU only, e.g. "9.0" on an H100 (sm_90)."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}.{minor}"


def extension_spec(kind: str, *, arch: str | None = None) -> dict:
    """The ``load_inline`` arguments of the ``"cpu"`` or ``"cuda"`` extension, plus the CUDA arch to build for.

    ``arch`` (e.g. "9.0") defaults to the current GPU's; passing it builds without a GPU (nvcc suffices).
    """
    if kind == "cpu":
        return {"name": "bias_gelu_cpu_ext", "cpp_sources": [CHECKS_SOURCE, CPU_SOURCE], "cuda_sources": [],
                "extra_cflags": ["-O3"], "extra_cuda_cflags": [], "arch": None}
    if kind == "cuda":
        return {"name": "bias_gelu_cuda_ext", "cpp_sources": [CHECKS_SOURCE, CUDA_WRAPPER_SOURCE],
                "cuda_sources": [CUDA_KERNEL_SOURCE], "extra_cflags": ["-O3"], "extra_cuda_cflags": ["-O3"],
                "arch": arch or cuda_arch_list()}
    raise ValueError(f"kind must be 'cpu' or 'cuda', got {kind!r}")


def build_directory(spec: dict, root: Path = BUILD_ROOT) -> Path:
    """``root/<name>-<hash>``: the hash covers sources, flags, arch and the torch / CUDA / Python versions."""
    key = json.dumps([spec, torch.__version__, torch.version.cuda, sys.version_info[:2]], sort_keys=True)
    return Path(root) / f"{spec['name']}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


@contextlib.contextmanager
def build_guard(directory: Path, *, timeout_s: float | None = None) -> Iterator[bool]:
    """Hold this module's OS lock on ``directory`` for one build; yield True if a stale ``lock`` was removed.

    The lock is ``flock`` on ``directory/build.flock``: the kernel releases it when the holding process dies, so
    it can never go stale. While it is held no other build of the directory runs, so torch's ``lock`` file, if
    present, was left by an interrupted build: it is removed before ``load_inline`` would wait on it forever.

    Raises:
        TimeoutError: another build held the directory for more than ``timeout_s`` seconds (None: wait).
    """
    import fcntl  # POSIX only, as is this course's build path (Linux, Colab)

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "build.flock", "w") as guard:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        waiting = False
        while True:
            try:
                fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waiting:
                    print(f"waiting for another build of {directory}", flush=True)
                    waiting = True
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"another build of {directory} is running (it holds "
                                       f"{directory / 'build.flock'}) and did not finish in {timeout_s} s") from None
                time.sleep(0.05)
        stale = directory / "lock"
        removed = stale.exists()
        stale.unlink(missing_ok=True)
        yield removed  # the OS lock is released when the file closes, here or when the process dies


def run_with_deadline(cmd: list[str], *, timeout_s: float, log_path: Path, env: dict | None = None) -> int:
    """Run ``cmd`` in its own process group with output to ``log_path``; kill the whole group at the deadline.

    Returns the exit status. Raises TimeoutError after killing every process of the group (the child and
    whatever it started: ninja, the compilers), which a thread with a deadline could not do. An interrupt
    (Ctrl-C, Jupyter's stop button) kills the group too, then propagates.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=hasattr(os, "killpg"))
        try:
            return proc.wait(timeout=timeout_s)
        except BaseException as err:  # the deadline, or Ctrl-C / a kernel interrupt: stop the whole group
            if hasattr(os, "killpg"):
                os.killpg(proc.pid, signal.SIGKILL)  # the group: Python, ninja, c++ / nvcc
            else:  # pragma: no cover
                proc.kill()
            proc.wait()
            if isinstance(err, subprocess.TimeoutExpired):
                raise TimeoutError(f"{Path(cmd[0]).name} did not finish within {timeout_s:.0f} s and was killed "
                                   f"with its children; its output is in {log_path}") from None
            raise


_CHILD = r"""
import inspect, json, sys
from pathlib import Path
from torch.utils.cpp_extension import load_inline
from utils.bias_gelu import build_guard
spec = json.loads(Path(sys.argv[1]).read_text())
if "no_implicit_headers" not in inspect.signature(load_inline).parameters:  # older torch: it adds its header
    spec.pop("no_implicit_headers")
with build_guard(Path(spec["build_directory"])) as removed:
    if removed:
        print("removed a stale lock left by an interrupted build")
    load_inline(**spec)
"""

_LOADED: dict[str, Path] = {}


def build_extension(kind: str, *, timeout_s: float = DEFAULT_BUILD_TIMEOUT_S, root: Path = BUILD_ROOT,
                    arch: str | None = None) -> Path:
    """Build (if needed) and load the ``"cpu"`` or ``"cuda"`` extension; return the path of its shared library.

    Afterwards ``torch.ops.course_ext.bias_gelu_<kind>`` exists. A finished build is reused, also by another
    process; a new build runs in a child process that is killed at ``timeout_s``. ``arch`` as in
    :func:`extension_spec`.

    Raises:
        TimeoutError: the build did not finish in time (its partial output stays; the next call resumes it).
        RuntimeError: the build failed (the message ends with the compiler's last lines), or "cuda" was asked
            for without nvcc or a CUDA build of torch.
    """
    spec = extension_spec(kind, arch=arch)
    directory = build_directory(spec, root)
    library = directory / f"{spec['name']}.so"
    if _LOADED.get(kind) == library:
        return library
    done = directory / "build.ok"  # written only after a child process built and loaded the library
    if not (done.exists() and library.exists()):
        _build_in_child(spec, directory, timeout_s)
        done.write_text(library.name)
    try:
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError) as err:
        raise RuntimeError(f"loading {library} failed (after changing a source in this session, restart the "
                           f"kernel: an operator cannot be registered twice): {err}") from err
    _LOADED[kind] = library
    return library


def _build_in_child(spec: dict, directory: Path, timeout_s: float) -> None:
    from utils.env import find_nvcc

    env = dict(os.environ)
    if spec["cuda_sources"]:
        nvcc = find_nvcc()
        if nvcc is None or torch.version.cuda is None:
            raise RuntimeError(f"the CUDA extension needs nvcc (the CUDA toolkit) and a CUDA build of torch; found "
                               f"nvcc={nvcc}, torch CUDA {torch.version.cuda}")
        env["TORCH_CUDA_ARCH_LIST"] = spec["arch"]  # this GPU's arch only: one device compile, not one per arch
        env.setdefault("CUDA_HOME", str(Path(nvcc).resolve().parents[1]))  # the toolkit that nvcc belongs to
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)  # for utils
    directory.mkdir(parents=True, exist_ok=True)
    args = {k: v for k, v in spec.items() if k != "arch"}
    args.update(build_directory=str(directory), is_python_module=False, no_implicit_headers=True, verbose=True)
    spec_path = directory / "spec.json"
    spec_path.write_text(json.dumps(args))
    log = directory / "build.log"
    try:
        status = run_with_deadline([sys.executable, "-c", _CHILD, str(spec_path)], timeout_s=timeout_s,
                                   log_path=log, env=env)
    except TimeoutError as err:
        if "waiting for another build" in log.read_text(errors="replace"):
            raise TimeoutError(f"{err}; it was waiting for another build of the same directory, which holds "
                               f"{directory / 'build.flock'}") from None
        raise
    output = log.read_text(errors="replace").splitlines()
    if "removed a stale lock left by an interrupted build" in output:
        print(f"removed a stale lock left by an interrupted build in {directory}")
    if status != 0:
        tail = "\n".join(output[-25:])
        raise RuntimeError(f"building {spec['name']} failed (exit {status}); full log {log}:\n{tail}")


def bias_gelu_cpu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The C++ CPU kernel (built on first use): ``torch.ops.course_ext.bias_gelu_cpu`` after the checks."""
    check_inputs(x, bias, device_type="cpu")
    if "cpu" not in _LOADED:
        build_extension("cpu")
    return torch.ops.course_ext.bias_gelu_cpu(x, bias)


def bias_gelu_cuda(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The CUDA C++ kernel (built on first use): ``torch.ops.course_ext.bias_gelu_cuda`` after the checks."""
    check_inputs(x, bias, device_type="cuda")
    if "cuda" not in _LOADED:
        build_extension("cuda", arch=cuda_arch_list(x.device))
    return torch.ops.course_ext.bias_gelu_cuda(x, bias)


# ── 5 · Operators: torch.library.custom_op / triton_op, fake implementations, autograd ──────────────────────


@torch.library.custom_op("course::bias_gelu_cpp", mutates_args=())
def bias_gelu_cpp(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x + bias) by the C++ extensions: one kernel per device type, registered below."""
    raise NotImplementedError(f"course::bias_gelu_cpp has kernels for cpu and cuda tensors, not {x.device.type}")


@bias_gelu_cpp.register_kernel("cpu")
def _bias_gelu_cpp_cpu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return bias_gelu_cpu(x, bias)


@bias_gelu_cpp.register_kernel("cuda")
def _bias_gelu_cpp_cuda(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return bias_gelu_cuda(x, bias)


@bias_gelu_cpp.register_fake
def _bias_gelu_fake(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """What torch.compile and opcheck trace with: same checks, an output of the right shape, dtype and device."""
    check_inputs(x, bias)
    return torch.empty_like(x)


@torch.library.triton_op("course::bias_gelu_triton", mutates_args=())
def bias_gelu_triton(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x + bias) by the Triton kernel; torch.compile sees the kernel through wrap_triton.

    triton_op registers this function itself as the fake implementation: with fake tensors the wrapped
    kernel launch is recorded, not run.
    """
    check_inputs(x, bias)
    _require_triton(x)
    return _triton_forward(x, bias, torch.library.wrap_triton(bias_gelu_kernel))


def gelu_tanh_grad(z: torch.Tensor) -> torch.Tensor:
    """d/dz of z * sigmoid(2u(z)), u = sqrt(2/pi) (z + 0.044715 z^3), in plain PyTorch (compile fuses it)."""
    s = torch.sigmoid(2 * SQRT_2_OVER_PI * (z + GELU_CUBIC * z * z * z))
    return s + z * s * (1 - s) * 2 * SQRT_2_OVER_PI * (1 + 3 * GELU_CUBIC * z * z)


def _setup_context(ctx, inputs, output) -> None:
    x, bias = inputs
    ctx.save_for_backward(x, bias)  # recompute x + bias in backward rather than keep a second activation


def _backward(ctx, grad_out: torch.Tensor):
    x, bias = ctx.saved_tensors
    z = x.float() + bias.float()
    grad_z = grad_out.float() * gelu_tanh_grad(z)
    return grad_z.to(x.dtype), grad_z.reshape(-1, z.shape[-1]).sum(0).to(bias.dtype)


bias_gelu_cpp.register_autograd(_backward, setup_context=_setup_context)
bias_gelu_triton.register_autograd(_backward, setup_context=_setup_context)


def source_of(obj) -> str:
    """The Python source of a function or a Triton kernel (for the notebook to print)."""
    fn = obj
    while hasattr(fn, "fn"):  # Autotuner → JITFunction / InterpretedFunction → the Python function
        fn = fn.fn
    return textwrap.dedent(inspect.getsource(fn))


def operators_source() -> str:
    """The source of section 5 of this module: the two operators, their fake implementation and autograd."""
    text = inspect.getsource(sys.modules[__name__])
    start = text.index("@torch.library.custom_op(")
    return text[start:text.index("def source_of(")].rstrip() + "\n"
