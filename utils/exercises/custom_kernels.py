"""Checks for the exercises of notebook 06 · Custom kernels.

Importing this module imports no Triton: ``import utils`` must leave the reader free to switch Triton's CPU
interpreter on (``TRITON_INTERPRET=1``) before the first kernel is defined.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import torch

from utils.exercises import Miss, close, exercise

# Bytes worked out by hand for each case (not from a formula): x read and out written, rows × cols elements each,
# plus scale and shift read once, cols elements each.
_AFFINE_CASES = [((1000, 512, 2), 2_050_048, "x [1000, 512] in bf16"), ((1, 1, 4), 16, "x [1, 1] in float32"),
                 ((4096, 4096, 2), 67_125_248, "x [4096, 4096] in fp16"), ((3, 7, 4), 224, "x [3, 7] in float32")]


@exercise("1 · Bytes of a fused op")
def affine_bytes(answer) -> str:
    """``answer(rows, cols, itemsize)``: the bytes a fused ``out = x * scale + shift`` must move, for x of
    ``[rows, cols]`` and per-column ``scale`` and ``shift``, all in one dtype of ``itemsize`` bytes."""
    for (rows, cols, itemsize), expected, what in _AFFINE_CASES:
        got = answer(rows, cols, itemsize)
        if got is None:
            raise NotImplementedError("affine_bytes returns None: return a number of bytes")
        got = float(got)
        if close(got, expected):
            continue
        elements = rows * cols
        if close(got, 2 * elements * itemsize):
            raise Miss(f"for {what} it counts x and out but not scale and shift: each is read once, "
                       f"cols = {cols} elements")
        if close(got, elements * itemsize + 2 * cols * itemsize):
            raise Miss(f"for {what} it counts only what is read: the output is written back, as many bytes as x")
        if close(got, 2 * elements * itemsize + 2 * elements * itemsize):
            raise Miss(f"for {what} it reads scale and shift once per element: a fused kernel reads each of them "
                       "once (they are [cols]), however many rows share them")
        if close(got * itemsize, expected) or close(got, expected * itemsize):
            raise Miss(f"for {what} the element size is off: multiply element counts by itemsize = {itemsize}")
        raise Miss(f"for {what} a fused kernel must move {expected:,} bytes; yours says {got:,.0f}")
    return "x read and out written once, scale and shift read once each."


# Worked out by hand for each case: the floor, (2 · x elements + bias elements) · element size over the bandwidth,
# and two plausible miscounts of it: only the reads (x + bias), and eager's traffic (4 · x elements + bias).
_FLOOR_CASES = [  # (x shape, dtype, GB/s, floor s, reads-only s, eager s)
    ((1024, 1024), torch.bfloat16, 1000.0, 4.196352e-06, 2.0992e-06, 8.390656e-06),
    ((10, 100), torch.float32, 0.5, 1.68e-05, 8.8e-06, 3.28e-05),
    ((3, 5, 8), torch.float16, 2.0, 2.48e-07, 1.28e-07, 4.88e-07),
]


@exercise("2 · The floor")
def fused_floor_s(answer, *, copy_gbps: float | None = None, x_shape=None, dtype: torch.dtype | None = None,
                  best_s: float | None = None, best_name: str | None = None) -> str:
    """``answer(x, bias, copy_gbps)``: the least time, in seconds, any kernel can take for gelu(x + bias) on a
    device whose copy bandwidth (read + write) is ``copy_gbps`` GB/s."""
    for shape, dt, gbps, expected, reads_only, eager in _FLOOR_CASES:
        x = torch.empty(shape, dtype=dt)
        bias = torch.empty(shape[-1], dtype=dt)
        got = answer(x, bias, gbps)
        if got is None:
            raise NotImplementedError("fused_floor_s returns None: return seconds")
        got = float(got)
        what = f"x {list(shape)} {str(dt).removeprefix('torch.')} at {gbps:g} GB/s"
        if close(got, expected, rel=1e-3):
            continue
        if close(got, eager, rel=1e-3):
            raise Miss(f"for {what} that is eager's traffic (x + bias written and read back): a fused kernel reads "
                       "x and bias once and writes out once")
        if close(got, reads_only, rel=1e-3):
            raise Miss(f"for {what} it counts only the reads: the output is written back too")
        if any(close(got, expected * f, rel=1e-3) for f in (1e9, 1e-9, 1e3, 1e-3, 1e6, 1e-6)):
            raise Miss(f"for {what} the units are off: bytes / (GB/s × 10⁹ bytes per GB) gives seconds")
        if any(close(got, expected * size / dt.itemsize, rel=1e-3) for size in (1, 2, 4, 8) if size != dt.itemsize):
            raise Miss(f"for {what} the element size is off: use x.element_size() ({dt.itemsize} bytes)")
        raise Miss(f"for {what} the floor is {expected:.4g} s; yours says {got:.4g} s")
    here = ""
    if copy_gbps and x_shape is not None and dtype is not None:
        x = torch.empty(x_shape, dtype=dtype)
        floor = float(answer(x, torch.empty(x_shape[-1], dtype=dtype), copy_gbps))
        here = f" Here: {floor * 1e6:,.1f} µs for x {list(x_shape)} at the measured {copy_gbps:,.0f} GB/s"
        if best_s:
            here += f"; the best kernel ({best_name}) took {best_s / floor:.2f}× that."
        else:
            here += "."
    return "bytes a fused kernel must move over the bandwidth." + here


# ── 3 · A Triton kernel ────────────────────────────────────────────────────────────────────────────────────────

_RELU_SHAPES = [(37, 29), (1, 1), (130, 1000), (64, 64), (5, 2049)]


def _triton_kernels(fn) -> list:
    """Triton kernels (``@triton.jit``, possibly autotuned) that ``fn`` refers to by a global name."""
    names = set()
    codes = [getattr(fn, "__code__", None)]
    while codes:
        code = codes.pop()
        if code is None:
            continue
        names.update(code.co_names)
        codes.extend(c for c in code.co_consts if inspect.iscode(c))
    found = []
    for name in sorted(names):
        obj = getattr(fn, "__globals__", {}).get(name)
        inner = obj
        while inner is not None and type(inner).__name__ == "Autotuner":
            inner = getattr(inner, "fn", None)
        if type(inner).__name__ in ("JITFunction", "InterpretedFunction"):
            found.append((name, inner))
    return found


def _kernel_source(kernel) -> str:
    src = getattr(kernel, "src", None)
    if not src:
        src = inspect.getsource(getattr(kernel, "fn", kernel))
    return textwrap.dedent(src)


def _unmasked_accesses(source: str) -> list[str]:
    """``tl.load`` / ``tl.store`` calls without a mask (keyword or positional) or a boundary check."""
    missing = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("load", "store")):
            continue
        keywords = {k.arg for k in node.keywords}
        positional_mask = len(node.args) >= (2 if node.func.attr == "load" else 3)
        if not ({"mask", "boundary_check"} & keywords or positional_mask):
            missing.append(f"tl.{node.func.attr} on line {node.lineno} of the kernel")
    return missing


@exercise("3 · Your own Triton kernel")
def bias_relu(answer, *, device: torch.device | str | None = None) -> str:
    """``answer(x, bias)``: ``relu(x + bias)`` for x ``[rows, cols]`` and bias ``[cols]``, computed by a Triton
    kernel; tried on irregular shapes against ``torch.relu(x + bias)``. On a CPU it runs in Triton's interpreter.

    A kernel whose loads or stores lack a mask is not run: on the edge tiles it would read and write past the
    tensors' ends, which can corrupt memory and crash the process (or, on a GPU, end the CUDA context).
    """
    if device is None:  # where the reader's kernel can run: a GPU if there is one, else Triton's interpreter
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    kernels = _triton_kernels(answer)
    for name, kernel in kernels:
        unmasked = _unmasked_accesses(_kernel_source(kernel))
        if unmasked:
            raise Miss(f"{name}: {', '.join(unmasked)} has no mask, so the tiles at the right and bottom edges "
                       "read and write past the end of the tensors (not run: that can crash the process); "
                       "pass mask=(rows < n_rows) & (cols < n_cols)")
        if device.type == "cpu" and type(kernel).__name__ == "JITFunction":
            raise Miss(f"{name} was compiled for a GPU, but the check runs on the CPU: Triton's interpreter must be "
                       "on (TRITON_INTERPRET=1) when the kernel is defined; section 1 sets it on a machine "
                       "without a GPU: run the notebook from the top")
    gen = torch.Generator().manual_seed(6)
    for shape in _RELU_SHAPES:
        x = torch.randn(shape, generator=gen).to(device)
        b = torch.randn(shape[-1], generator=gen).to(device)
        out = answer(x, b)
        if out is None:
            raise NotImplementedError("bias_relu returns None: return the output tensor")
        if not isinstance(out, torch.Tensor) or out.shape != x.shape:
            raise Miss(f"for x {list(shape)} it returns {getattr(out, 'shape', type(out).__name__)}; expected a "
                       f"tensor of shape {list(shape)}")
        expected = torch.relu(x + b)
        if torch.allclose(out, expected, rtol=1e-6, atol=1e-6):
            continue
        if torch.allclose(out, torch.relu(x), rtol=1e-6, atol=1e-6):
            raise Miss(f"for x {list(shape)} the output is relu(x): the bias is missing")
        if torch.allclose(out, torch.relu(x) + b, rtol=1e-6, atol=1e-6):
            raise Miss(f"for x {list(shape)} the output is relu(x) + bias: add the bias before the ReLU")
        bad = ~torch.isclose(out, expected, rtol=1e-6, atol=1e-6)
        where = bad.nonzero()[0].tolist()
        raise Miss(f"for x {list(shape)} {int(bad.sum())} of {x.numel()} values differ from torch.relu(x + bias), "
                   f"the first at {where}: if they are at the edges, look at the masks; if everywhere, the "
                   "arithmetic or the offsets")
    if not kernels:
        raise Miss("the results match, but bias_relu launches no Triton kernel: write one with @triton.jit "
                   "(a global function your launcher calls)")
    return (f"matches torch.relu(x + bias) on {', '.join(str(list(s)) for s in _RELU_SHAPES)} on {device}"
            + (" (Triton's interpreter)." if device.type == "cpu" else "."))
