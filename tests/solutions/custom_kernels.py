"""Solutions to notebook 06's exercises, and plausible wrong answers for tests/test_exercises.py.

The Triton kernels are defined with the interpreter switched on when there is no GPU (Triton reads
TRITON_INTERPRET when a kernel is decorated), and the variable is restored afterwards so that nothing else in the
test session changes.
"""

import os

import torch
import triton
import triton.language as tl


def _jit(fn):
    """@triton.jit, in Triton's CPU interpreter when there is no GPU."""
    if torch.cuda.is_available():
        return triton.jit(fn)
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return triton.jit(fn)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


# 1 · x read and out written (rows × cols each), scale and shift read once (cols each)
def affine_bytes(rows, cols, itemsize):
    return (2 * rows * cols + 2 * cols) * itemsize


# 2 · bytes a fused kernel must move over the bandwidth
def fused_floor_s(x, bias, copy_gbps):
    return (2 * x.numel() + bias.numel()) * x.element_size() / (copy_gbps * 1e9)


# 3 · one program per BLOCK_R × BLOCK_C tile, masked at the edges
@_jit
def bias_relu_kernel(x_ptr, b_ptr, out_ptr, n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r[:, None] < n_rows) & (c[None, :] < n_cols)
    offsets = r[:, None] * n_cols + c[None, :]
    z = tl.load(x_ptr + offsets, mask=mask) + tl.load(b_ptr + c, mask=c < n_cols)[None, :]
    tl.store(out_ptr + offsets, tl.maximum(z, 0.0), mask=mask)


def bias_relu(x, bias):
    out = torch.empty_like(x)
    grid = (triton.cdiv(x.shape[0], 16), triton.cdiv(x.shape[1], 64))
    bias_relu_kernel[grid](x, bias, out, x.shape[0], x.shape[1], BLOCK_R=16, BLOCK_C=64)
    return out


@_jit
def _unmasked_kernel(x_ptr, b_ptr, out_ptr, n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offsets = r[:, None] * n_cols + c[None, :]
    z = tl.load(x_ptr + offsets) + tl.load(b_ptr + c)[None, :]
    tl.store(out_ptr + offsets, tl.maximum(z, 0.0))


def _bias_relu_unmasked(x, bias):
    out = torch.empty_like(x)
    grid = (triton.cdiv(x.shape[0], 16), triton.cdiv(x.shape[1], 64))
    _unmasked_kernel[grid](x, bias, out, x.shape[0], x.shape[1], BLOCK_R=16, BLOCK_C=64)
    return out


@_jit
def _relu_then_bias_kernel(x_ptr, b_ptr, out_ptr, n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r[:, None] < n_rows) & (c[None, :] < n_cols)
    offsets = r[:, None] * n_cols + c[None, :]
    x = tl.load(x_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, tl.maximum(x, 0.0) + tl.load(b_ptr + c, mask=c < n_cols)[None, :], mask=mask)


def _bias_relu_wrong_order(x, bias):
    out = torch.empty_like(x)
    grid = (triton.cdiv(x.shape[0], 16), triton.cdiv(x.shape[1], 64))
    _relu_then_bias_kernel[grid](x, bias, out, x.shape[0], x.shape[1], BLOCK_R=16, BLOCK_C=64)
    return out


def _bias_relu_last_column_lost(x, bias):
    """Masks one column short: cols < n_cols - 1."""
    out = bias_relu(x, bias)
    out[:, -1] = 0.0
    return out


CASES = {
    "affine_bytes": ([affine_bytes], [
        ("forgets scale and shift", [lambda r, c, i: 2 * r * c * i], "scale and shift"),
        ("counts only the reads", [lambda r, c, i: (r * c + 2 * c) * i], "only what is read"),
        ("reads scale and shift per element", [lambda r, c, i: 4 * r * c * i], "once"),
        ("forgets the element size", [lambda r, c, i: 2 * r * c + 2 * c], "element size"),
    ]),
    "fused_floor_s": ([fused_floor_s], [
        ("uses eager's bytes", [lambda x, b, g: (4 * x.numel() + b.numel()) * x.element_size() / (g * 1e9)],
         "eager"),
        ("counts only the reads", [lambda x, b, g: (x.numel() + b.numel()) * x.element_size() / (g * 1e9)],
         "only the reads"),
        ("forgets the 10⁹", [lambda x, b, g: (2 * x.numel() + b.numel()) * x.element_size() / g], "units"),
        ("assumes 2-byte elements", [lambda x, b, g: (2 * x.numel() + b.numel()) * 2 / (g * 1e9)], "element size"),
    ]),
    "bias_relu": ([bias_relu], [
        ("has no mask", [_bias_relu_unmasked], "no mask"),
        ("applies the ReLU before the bias", [_bias_relu_wrong_order], "before the relu"),
        ("loses the last column", [_bias_relu_last_column_lost], "edges"),
        ("uses PyTorch instead of a kernel", [lambda x, b: torch.relu(x + b)], "no triton kernel"),
    ]),
}
