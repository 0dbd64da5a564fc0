"""Bias + GELU fused into one kernel, in Triton and in CUDA C++, registered as PyTorch operators (notebook 06).

The op: ``out = gelu_tanh(x + bias)`` for an activation ``x`` of shape ``[..., cols]`` and a ``bias`` of shape
``[cols]``: the epilogue of a Transformer MLP's first linear layer. Eager PyTorch runs it as two kernels (``add``,
then ``gelu``) and sends the intermediate ``x + bias`` through device memory; one fused kernel reads ``x`` once and
writes ``out`` once, so it moves half the bytes. Every implementation here computes in float32 and rounds once:

- :func:`reference`: the eager PyTorch definition; :func:`bytes_moved` (what a fused kernel must move) and
  :func:`operator_bytes` (what the operators a function runs really read and write).
- :data:`bias_gelu_kernel` (Triton, autotuned): launched by :func:`bias_gelu_triton_launch`.
- The C++ and CUDA kernels live in ``csrc/`` as real files (:func:`extension_spec` lists them) and are built by
  :mod:`utils.extension` (own build directory, this GPU's arch only, a deadline, a stale-lock guard):
  ``torch.ops.course_ext.bias_gelu_cpu`` / ``bias_gelu_cuda`` / ``bias_gelu_cuda_variant``. :func:`bias_gelu_cpu`,
  :func:`bias_gelu_cuda` and :func:`bias_gelu_cuda_variant` build on first use and call them. The CUDA file
  keeps the kernel's versions side by side (:data:`CUDA_VARIANTS`) so that notebook 06 can measure each change;
  :func:`cuda_kernel_usage` reads their registers from ptxas, :func:`ncu_report` their instruction counts
  from Nsight Compute, and :func:`issue_table` puts those against what the SMs can issue at the copy bandwidth.
- Two first-class operators with a fake (meta) implementation and autograd: ``course::bias_gelu_triton``
  (:func:`bias_gelu_triton`, ``torch.library.triton_op``: torch.compile sees the Triton kernel) and
  ``course::bias_gelu_cpp`` (:func:`bias_gelu_cpp`, ``torch.library.custom_op`` with one kernel per device type:
  the C++ extension on CPU, the CUDA extension on GPUs; opaque to torch.compile).

Mixed precision: the operators accept a ``bias`` in another floating dtype than ``x`` and round it to ``x``'s
dtype first, as ``nn.Linear`` does with its own bias under autocast. So in a model under
``torch.autocast(dtype=torch.bfloat16)`` a Linear's bf16 output and an fp32 bias parameter work, the output is
bf16, and the bias gradient comes back in fp32. (``torch.library.register_autocast``, from torch 2.7, would cast
every input to one dtype fixed when registering; this rule follows ``x`` instead, so fp16 autocast on a GPU
without bf16 keeps fp16.) The raw launchers and the C++ operators keep requiring one dtype.

What notebook 06 calls, each a lesson's one line: :func:`toolchain` (what can run here, and why not: no Triton, a
GPU older than sm_70 or without bf16 in Triton, no C++ compiler or ninja, no nvcc, no GPU), :func:`import_triton`
(Triton, or stand-ins whose kernels say why they cannot run), :func:`register_triton` (the reader's kernel wired
into ``course::bias_gelu_triton`` and checked), :func:`build_cpp` (the C++ extension for this device, built and
checked, or the reason it is skipped), :func:`traffic` (the bytes eager moves and a fused kernel must), and the
checks :func:`check_outputs`, :func:`check_operator` and :func:`check_in_model`. A path that cannot run here is a
:class:`Kernel` whose ``why_not`` says why; no later cell calls it.

Triton: this module imports ``triton`` (when installed). On a machine without a GPU Triton can only run in its
interpreter, which must be switched on *before* the first ``import triton`` in the process: set
``os.environ["TRITON_INTERPRET"] = "1"`` before importing this module. ``import utils`` does not import it.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import textwrap
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from utils import extension

try:  # Triton ships on Linux (and with Windows wheels of some builds); without it the Triton path says so.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is installed with CUDA builds of torch on Linux
    triton = None

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""The dtypes every kernel here accepts (x and bias share one; the operators round bias to x's)."""

SQRT_2_OVER_PI = 0.7978845608028654
GELU_CUBIC = 0.044715

REPO_ROOT = extension.REPO_ROOT
BUILD_ROOT = extension.BUILD_ROOT
"""Where the C++ extensions are built: the repository's git-ignored build/ folder."""


# ── 1 · The op in plain PyTorch, its checks and the bytes it must move ───────────────────────────────────────


def reference(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Eager PyTorch: ``gelu(x + bias, approximate="tanh")``, two kernels with an intermediate in memory."""
    return torch.nn.functional.gelu(x + bias, approximate="tanh")


def reference_exact(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The same function in float64 and in the form ``z · sigmoid(2u)``, as a yardstick for relative errors.

    ``0.5 z (1 + tanh u)`` cancels for negative z: ``1 + tanh u`` is a tiny difference of two numbers near 1, so
    even float64 loses all its digits once the GELU falls below about 1e-16 · |z|; the sigmoid form keeps them.
    """
    z = x.double() + bias.double()
    return z * torch.sigmoid(2 * SQRT_2_OVER_PI * (z + GELU_CUBIC * z * z * z))


def bytes_moved(x: torch.Tensor, bias: torch.Tensor) -> int:
    """Bytes a fused kernel must move: read x and bias once, write the output (x's dtype) once."""
    return 2 * x.numel() * x.element_size() + bias.numel() * bias.element_size()


def eager_bytes_moved(x: torch.Tensor, bias: torch.Tensor) -> int:
    """Bytes eager moves when x and bias share a dtype: ``add`` reads x and bias and writes x + bias; ``gelu``
    reads it back and writes out. (:func:`operator_bytes` counts them from what eager runs instead.)"""
    return (4 * x.numel() + bias.numel()) * x.element_size()


def operator_bytes(fn) -> list[dict[str, object]]:
    """Run ``fn()`` and return every ATen operator it ran, with the bytes it read (its input tensors) and wrote
    (its output tensors), as the operators really ran: shapes, dtypes (type promotion, autocast) and all.

    A ``TorchDispatchMode`` sees each operator below autograd and autocast with its real tensors, the level at
    which kernels are launched. Counting each input once and each output once is exact for elementwise
    operators (add, gelu, ...), the ones eager bias + GELU runs. Views (outputs that share an input's memory)
    move nothing and are left out. Returns rows ``{"operator", "inputs", "output dtype", "read_bytes",
    "written_bytes"}``.
    """
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    rows: list[dict[str, object]] = []

    def describe(t: torch.Tensor) -> str:
        return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            shared = {t.untyped_storage().data_ptr() for t in inputs}
            if outputs and all(t.untyped_storage().data_ptr() in shared for t in outputs):
                return out  # a view: no bytes move
            rows.append({"operator": func.name().split(".")[0],
                         "inputs": " + ".join(describe(t) for t in inputs),
                         "output dtype": ", ".join(str(t.dtype).removeprefix("torch.") for t in outputs),
                         "read_bytes": sum(t.numel() * t.element_size() for t in inputs),
                         "written_bytes": sum(t.numel() * t.element_size() for t in outputs)})
            return out

    with Recorder():
        fn()
    return rows


def tolerance(dtype: torch.dtype, *, roundings: int = 1) -> dict[str, float]:
    """``torch.testing.assert_close`` tolerances for a kernel's output against :func:`reference` computed in
    float32 from the same inputs.

    float32: rtol 1e-5, atol 1e-6 (the kernels use exp where PyTorch uses tanh; a few float32 ulps apart).
    float16 / bfloat16: rtol = the dtype's eps (1 ulp at 1.0), atol 1e-5: rounding the float32 result once to
    the output dtype costs at most half an ulp, so this allows twice that.

    ``roundings=2`` is eager PyTorch's case in 16 bits: ``add`` rounds ``z = x + bias`` before ``gelu`` rounds its
    output. Half an ulp of ``z`` reaches the output through GELU's slope, which is small where the output is: it
    stays under 0.06 eps in absolute terms, so atol grows to eps / 8.
    """
    if roundings not in (1, 2):
        raise ValueError(f"roundings is 1 (a fused kernel) or 2 (eager: after add, after gelu), got {roundings}")
    if dtype == torch.float32:
        return {"rtol": 1e-5, "atol": 1e-6}
    if dtype in (torch.float16, torch.bfloat16):
        eps = torch.finfo(dtype).eps
        return {"rtol": eps, "atol": 1e-5 if roundings == 1 else eps / 8}
    raise ValueError(f"no tolerance for {dtype}: the kernels support {SUPPORTED_DTYPES}")


def check_inputs(x: torch.Tensor, bias: torch.Tensor, *, device_type: str | None = None,
                 same_dtype: bool = True) -> None:
    """Raise a clear error unless ``x [..., cols]`` and ``bias [cols]`` suit the kernels of this module.

    Every entry point calls this before launching anything, so bad inputs fail the same way on every device
    (the C++ kernels repeat the checks with ``TORCH_CHECK`` for callers of ``torch.ops.course_ext``).

    Args:
        device_type: the device type the caller's kernel needs ("cpu" or "cuda"); None accepts any.
        same_dtype: require bias in x's dtype (the kernels); False accepts any supported dtype (the operators,
            which round bias to x's dtype).

    Raises:
        TypeError: for a non-tensor, or a dtype other than float32 / float16 / bfloat16, or (same_dtype) x and
            bias of different dtypes.
        ValueError: for the wrong device, mismatched shapes, or a non-contiguous tensor.
    """
    for name, t in (("x", x), ("bias", bias)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"bias_gelu: {name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("x", x), ("bias", bias)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"bias_gelu: {name} must be float32, float16 or bfloat16, got {t.dtype}")
    if same_dtype and bias.dtype != x.dtype:
        raise TypeError(f"bias_gelu: x and bias must have the same dtype, got {x.dtype} and {bias.dtype} (the "
                        "operators course::bias_gelu_* round bias to x's dtype for you)")
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
    """The autotuner's candidates: tile height x width and warps; one tile when interpreting (no tuning); none
    without Triton."""
    if triton is None:
        return []
    if TRITON_INTERPRETED:  # numpy runs each program: large tiles, nothing to tune
        return [triton.Config({"BLOCK_R": 64, "BLOCK_C": 1024})]
    return [triton.Config({"BLOCK_R": r, "BLOCK_C": c}, num_warps=w)
            for r, c, w in ((1, 2048, 4), (1, 4096, 8), (4, 1024, 4), (8, 1024, 8), (16, 512, 8))]


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


_CURRENT_TRITON = [bias_gelu_kernel]
"""The Triton kernel ``course::bias_gelu_triton`` launches: this module's, or the reader's (:func:`register_triton`)."""


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


# ── 3 · The C++ and CUDA extensions (sources in csrc/, built by utils.extension) ─────────────────────────────

CSRC = extension.CSRC
CPU_SOURCES = (CSRC / "bias_gelu_cpu.cpp",)
CUDA_SOURCES = (CSRC / "bias_gelu_cuda.cpp", CSRC / "bias_gelu.cu")
HEADERS = (CSRC / "bias_gelu_checks.h", CSRC / "bias_gelu_launch.h")

CUDA_VARIANTS = {
    "flat (first version)": 0,
    "rows": 1,
    "rows + fast exp": 2,
    "rows + tanh.approx": 3,
}
"""The versions of the CUDA kernel in csrc/bias_gelu.cu (``variant`` of ``course_ext::bias_gelu_cuda_variant``):

- ``flat (first version)``: the tensor as one flat array of 16-byte packs; per pack a division (``% cols``), per
  element a scalar bias load and a wrap test; precise ``expf``.
- ``rows``: 2-D; each thread loads one 16-byte bias pack once and keeps it for all its rows; offsets without
  division; the same math as the first version, so the same bits.
- ``rows + fast exp``: ``ex2.approx`` with log2(e) folded into the polynomial, ``rcp.approx``: a few float32
  ulps off, invisible after rounding to 16 bits. ``bias_gelu_cuda`` uses it for float16 / bfloat16, and
  ``rows`` for float32.
- ``rows + tanh.approx``: ``0.5 z (1 + tanh u)`` with the hardware tanh: fewest instructions, but ``1 + tanh u``
  cancels for negative z, where the relative error grows to many percent: measured, not used.
"""

CUDA_BEST = {torch.float32: "rows", torch.float16: "rows + fast exp", torch.bfloat16: "rows + fast exp"}
"""The variant ``bias_gelu_cuda`` runs for each dtype."""


def extension_spec(kind: str, *, arch: str | None = None) -> extension.ExtensionSpec:
    """The :class:`utils.extension.ExtensionSpec` of the ``"cpu"`` or ``"cuda"`` extension.

    ``arch`` (e.g. "9.0") defaults to the current GPU's; passing it builds without a GPU (nvcc suffices). The
    CUDA build passes ``-Xptxas=-v`` so that its log holds every kernel's registers (:func:`cuda_kernel_usage`).
    """
    if kind == "cpu":
        return extension.ExtensionSpec("bias_gelu_cpu_ext", CPU_SOURCES, HEADERS[:1])
    if kind == "cuda":
        return extension.ExtensionSpec("bias_gelu_cuda_ext", CUDA_SOURCES, HEADERS,
                                       extra_cuda_cflags=("-O3", "-Xptxas=-v"), arch=arch or extension.cuda_arch())
    raise ValueError(f"kind must be 'cpu' or 'cuda', got {kind!r}")


def build_extension(kind: str, *, timeout_s: float = extension.DEFAULT_TIMEOUT_S, root: Path = BUILD_ROOT,
                    arch: str | None = None) -> Path:
    """Build (if needed) and load the ``"cpu"`` or ``"cuda"`` extension; return the path of its shared library.

    Afterwards ``torch.ops.course_ext.bias_gelu_<kind>`` exists. See :func:`utils.extension.build`.
    """
    library = extension.build(extension_spec(kind, arch=arch), timeout_s=timeout_s, root=root)
    _register_raw_fakes(kind)
    return library


_RAW_FAKES: set[str] = set()


def _register_raw_fakes(kind: str) -> None:
    """Fake implementations of the raw ``course_ext`` operators, so that torch.compile can trace a call to them
    (notebook 06 measures the Python layer of ``custom_op`` against them). Once per process."""
    names = ["bias_gelu_cpu"] if kind == "cpu" else ["bias_gelu_cuda", "bias_gelu_cuda_variant"]
    for name in names:
        if name in _RAW_FAKES:
            continue
        torch.library.register_fake(f"course_ext::{name}")(lambda x, bias, *args: torch.empty_like(x))
        _RAW_FAKES.add(name)


def _loaded(kind: str) -> bool:
    return f"bias_gelu_{kind}_ext" in extension._LOADED


def bias_gelu_cpu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The C++ CPU kernel (built on first use): ``torch.ops.course_ext.bias_gelu_cpu`` after the checks."""
    check_inputs(x, bias, device_type="cpu")
    if not _loaded("cpu"):
        build_extension("cpu")
    return torch.ops.course_ext.bias_gelu_cpu(x, bias)


def bias_gelu_cuda(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The CUDA C++ kernel (built on first use), the best variant for x's dtype (:data:`CUDA_BEST`)."""
    check_inputs(x, bias, device_type="cuda")
    if not _loaded("cuda"):
        build_extension("cuda", arch=extension.cuda_arch(x.device))
    return torch.ops.course_ext.bias_gelu_cuda(x, bias)


def bias_gelu_cuda_variant(x: torch.Tensor, bias: torch.Tensor, variant: str) -> torch.Tensor:
    """One named version of the CUDA kernel (:data:`CUDA_VARIANTS`), for comparing them."""
    if variant not in CUDA_VARIANTS:
        raise ValueError(f"unknown CUDA variant {variant!r}: choose one of {list(CUDA_VARIANTS)}")
    check_inputs(x, bias, device_type="cuda")
    if not _loaded("cuda"):
        build_extension("cuda", arch=extension.cuda_arch(x.device))
    return torch.ops.course_ext.bias_gelu_cuda_variant(x, bias, CUDA_VARIANTS[variant])


_CUDA_TYPE_NAMES = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}


def cuda_kernel_usage(dtype: torch.dtype, *, arch: str | None = None) -> dict[str, extension.KernelUsage]:
    """Registers and spills of each variant's vector kernel for ``dtype`` (16-byte packs), from ptxas -v in the
    CUDA build's log: ``{variant name: KernelUsage}``; {} when the log has none (see
    :func:`utils.extension.ptxas_usage`)."""
    vec = 16 // dtype.itemsize
    wanted = {f"bias_gelu_flat_kernel<{_CUDA_TYPE_NAMES[dtype]}, {vec}, unsigned int>": "flat (first version)"}
    for name, number in list(CUDA_VARIANTS.items())[1:]:
        wanted[f"bias_gelu_rows_kernel<{_CUDA_TYPE_NAMES[dtype]}, {vec}, ((anonymous namespace)::Math){number - 1}>"] \
            = name
    directory = extension.build_directory(extension_spec("cuda", arch=arch))
    found = {}
    for usage in extension.ptxas_usage(directory):
        for signature, name in wanted.items():
            if signature in usage.kernel:
                found[name] = usage
    return {name: found[name] for name in CUDA_VARIANTS if name in found}


_NCU_CHILD = r"""
import json, sys
import torch
from utils import bias_gelu as bg
args = json.loads(sys.argv[1])
dtype = getattr(torch, args["dtype"])
x = torch.randn(args["rows"], args["cols"], device="cuda", dtype=dtype)
bias = torch.randn(args["cols"], device="cuda", dtype=dtype)
compiled = torch.compile(bg.reference, dynamic=False)
runs = [("eager", lambda: bg.reference(x, bias)), ("torch.compile", lambda: compiled(x, bias))]
if bg.triton is not None:
    runs.append(("Triton", lambda: bg.bias_gelu_triton_launch(x, bias)))
runs += [(f"CUDA {name}", lambda name=name: bg.bias_gelu_cuda_variant(x, bias, name)) for name in bg.CUDA_VARIANTS]
for _, fn in runs:  # builds, autotunes and compiles outside the profiled range
    fn()
torch.cuda.synchronize()
torch.cuda.profiler.start()
for _, fn in runs:
    fn()
torch.cuda.synchronize()
torch.cuda.profiler.stop()
print("LABELS " + json.dumps([label for label, _ in runs]))
"""

NCU_METRICS = (
    "gpu__time_duration.sum",  # ns
    "smsp__inst_executed.sum",  # warp instructions issued and executed
    "dram__bytes_read.sum", "dram__bytes_write.sum",
    "smsp__issue_active.avg.pct_of_peak_sustained_active",  # % of cycles a scheduler issued an instruction
    "sm__cycles_elapsed.avg.per_second",  # the SM clock while the kernel ran (Hz)
    "launch__registers_per_thread",
    "sm__warps_active.avg.pct_of_peak_sustained_active",  # achieved occupancy
)


def ncu_report(rows: int, cols: int, dtype: torch.dtype, *, timeout_s: float = 300.0) -> list[dict[str, object]]:
    """Nsight Compute's counters for one call of every version on ``x [rows, cols]``: eager (two kernels, labelled
    "eager: add" and "eager: gelu"), torch.compile's fused kernel, Triton and each CUDA variant (labelled "CUDA
    <variant>"), in a child process (``ncu --clock-control none``). One row per kernel launch:
    ``{"label", "kernel", <NCU_METRICS>}``.

    Raises:
        RuntimeError / TimeoutError: as :func:`utils.extension.run_ncu` (no ncu, no permission, a failure).
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env.pop("TRITON_INTERPRET", None)
    args = json.dumps({"rows": rows, "cols": cols, "dtype": str(dtype).removeprefix("torch.")})
    log = BUILD_ROOT / "ncu" / "bias_gelu.log"
    print(f"Nsight Compute: one call of each kernel, in a child process (about half a minute; at most "
          f"{timeout_s:.0f} s) ...", flush=True)
    launches = extension.run_ncu([sys.executable, "-c", _NCU_CHILD, args], metrics=NCU_METRICS,
                                 timeout_s=timeout_s, env=env, log_path=log, profile_from_start=False)
    labels = json.loads(next(line for line in log.read_text().splitlines() if line.startswith("LABELS "))[7:])
    expanded = [part for label in labels for part in (("eager: add", "eager: gelu") if label == "eager" else (label,))]
    if len(expanded) != len(launches):
        raise RuntimeError(f"ncu profiled {len(launches)} kernels, expected {len(expanded)} ({labels}); see {log}")
    return [{"label": label, **launch} for label, launch in zip(expanded, launches, strict=True)]


def issue_table(launches: list[dict[str, object]], x: torch.Tensor, *, sm_count: int,
                copy_gbps: float) -> list[dict[str, object]]:
    """Table rows from :func:`ncu_report`: per kernel, the instructions it issued per element of ``x`` (and per
    byte moved: 2 × the element size, read and write) against the issue budget per element, with the share of
    cycles a scheduler issued, registers, achieved occupancy, DRAM bytes and the SM clock.

    The budget is what the SMs can issue while the copy bandwidth moves one element: ``sm_count`` × 4 schedulers
    × 32 threads × the SM clock the kernel ran at, over the elements per second ``copy_gbps`` moves.
    """
    n, per_element = x.numel(), 2 * x.element_size()
    rows = []
    for launch in launches:
        clock_hz = float(launch["sm__cycles_elapsed.avg.per_second"])
        budget = sm_count * 4 * 32 * clock_hz / (copy_gbps * 1e9 / per_element)
        per_elem = float(launch["smsp__inst_executed.sum"]) * 32 / n  # warp instructions × 32 threads
        dram = float(launch["dram__bytes_read.sum"]) + float(launch["dram__bytes_write.sum"])
        rows.append({"kernel": launch["label"], "instructions / element": f"{per_elem:.1f}",
                     "per byte": f"{per_elem / per_element:.1f}", "budget / element": f"{budget:.0f}",
                     "issue busy": f"{float(launch['smsp__issue_active.avg.pct_of_peak_sustained_active']):.0f}%",
                     "registers": int(float(launch["launch__registers_per_thread"])),
                     "occupancy": f"{float(launch['sm__warps_active.avg.pct_of_peak_sustained_active']):.0f}%",
                     "DRAM": f"{dram / 1e6:,.0f} MB", "SM clock": f"{clock_hz / 1e6:,.0f} MHz"})
    return rows


# ── 4 · Operators: torch.library.custom_op / triton_op, fake implementations, autograd ──────────────────────


def _bias_like_x(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """bias in x's dtype, after the checks: a bf16 activation from an autocast Linear and an fp32 bias work."""
    check_inputs(x, bias, same_dtype=False)
    return bias.to(x.dtype)


@torch.library.custom_op("course::bias_gelu_cpp", mutates_args=())
def bias_gelu_cpp(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x + bias) by the C++ extensions: one kernel per device type, registered below."""
    raise NotImplementedError(f"course::bias_gelu_cpp has kernels for cpu and cuda tensors, not {x.device.type}")


@bias_gelu_cpp.register_kernel("cpu")
def _bias_gelu_cpp_cpu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return bias_gelu_cpu(x, _bias_like_x(x, bias))


@bias_gelu_cpp.register_kernel("cuda")
def _bias_gelu_cpp_cuda(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return bias_gelu_cuda(x, _bias_like_x(x, bias))


@bias_gelu_cpp.register_fake
def _bias_gelu_fake(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """What torch.compile and opcheck trace with: same checks, an output of the right shape, dtype and device."""
    check_inputs(x, bias, same_dtype=False)
    return torch.empty_like(x)


@torch.library.triton_op("course::bias_gelu_triton", mutates_args=())
def bias_gelu_triton(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x + bias) by the Triton kernel; torch.compile sees the kernel through wrap_triton.

    triton_op registers this function itself as the fake implementation: with fake tensors the wrapped
    kernel launch is recorded, not run.
    """
    bias = _bias_like_x(x, bias)
    _require_triton(x)
    return _triton_forward(x, bias, torch.library.wrap_triton(_CURRENT_TRITON[0]))


def gelu_tanh_grad(z: torch.Tensor) -> torch.Tensor:
    """d/dz of z * sigmoid(2u(z)), u = sqrt(2/pi) (z + 0.044715 z^3), in plain PyTorch (compile fuses it)."""
    s = torch.sigmoid(2 * SQRT_2_OVER_PI * (z + GELU_CUBIC * z * z * z))
    return s + z * s * (1 - s) * 2 * SQRT_2_OVER_PI * (1 + 3 * GELU_CUBIC * z * z)


def _setup_context(ctx, inputs, output) -> None:
    x, bias = inputs
    ctx.save_for_backward(x, bias)  # recompute x + bias in backward rather than keep a second activation


def _backward(ctx, grad_out: torch.Tensor):
    x, bias = ctx.saved_tensors
    z = x.float() + bias.to(x.dtype).float()  # the forward's z: bias rounded to x's dtype first
    grad_z = grad_out.float() * gelu_tanh_grad(z)
    return grad_z.to(x.dtype), grad_z.reshape(-1, z.shape[-1]).sum(0).to(bias.dtype)


bias_gelu_cpp.register_autograd(_backward, setup_context=_setup_context)
bias_gelu_triton.register_autograd(_backward, setup_context=_setup_context)


def source_of(obj) -> str:
    """The Python source of a function or a Triton kernel (tests compare the notebook's kernel with this module's)."""
    fn = obj
    while hasattr(fn, "fn"):  # Autotuner → JITFunction / InterpretedFunction → the Python function
        fn = fn.fn
    return textwrap.dedent(inspect.getsource(fn))


def cuda_excerpt(path: Path = CSRC / "bias_gelu.cu") -> str:
    """The part of the CUDA file a lesson shows: the lines between ``// [lesson: ...]`` and ``// [end lesson]``."""
    lines = Path(path).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("// [lesson:"))
    end = next(i for i, line in enumerate(lines) if line.startswith("// [end lesson]"))
    return "\n".join(lines[start + 1:end]).strip("\n") + "\n"


# ── 5 · What notebook 06 calls: what runs here, the reader's kernel wired in, the checks ─────────────────────


class MissingKernel:
    """What ``@triton.jit`` gives where Triton cannot run (:func:`import_triton`): launching it raises the reason."""

    def __init__(self, why_not: str) -> None:
        self.why_not = why_not

    def __getitem__(self, grid):
        raise RuntimeError(f"this Triton kernel cannot run here: {self.why_not}")


class _StandIn:
    """A stand-in for ``triton`` or ``triton.language`` where Triton is not installed: the decorators return a
    :class:`MissingKernel`, and any other name (``tl.constexpr`` in a signature) is a harmless placeholder."""

    def __init__(self, why_not: str) -> None:
        self._why_not = why_not

    def jit(self, fn=None, **options):
        return MissingKernel(self._why_not) if fn is not None else (lambda f: MissingKernel(self._why_not))

    def autotune(self, *args, **kwargs):
        return lambda kernel: kernel if isinstance(kernel, MissingKernel) else MissingKernel(self._why_not)

    heuristics = autotune

    def __getattr__(self, name: str):
        return object


TRITON_MISSING = "Triton is not installed (it ships for Linux; pip install triton)"


def import_triton():
    """``(triton, triton.language)``, or where Triton is not installed (macOS, Windows) two stand-ins: a kernel
    cell still runs, and its kernel is a :class:`MissingKernel` that says why it cannot run."""
    if triton is None:
        return _StandIn(TRITON_MISSING), _StandIn(TRITON_MISSING)
    return triton, tl


def triton_dtypes(device: torch.device | str) -> tuple[torch.dtype, ...]:
    """The dtypes the Triton kernel can run in on ``device``: no bf16 in the CPU interpreter (numpy has none) or
    on a GPU before sm_80 (Triton has no bf16 there, e.g. on a T4, sm_75)."""
    device = torch.device(device)
    if device.type == "cpu" or torch.cuda.get_device_capability(device) < (8, 0):
        return (torch.float32, torch.float16)
    return SUPPORTED_DTYPES


def _dtype_names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


@dataclass(frozen=True)
class Toolchain:
    """What can run on this machine for notebook 06, each path with the reason it cannot (None: it can)."""

    device: torch.device
    triton_why_not: str | None
    triton_dtypes: tuple[torch.dtype, ...]
    cpp_kind: str  # "cpu" or "cuda": the C++ extension for this device's tensors
    cpp_why_not: str | None
    compile_why_not: str | None  # torch.compile here (on a CPU, Inductor generates C++; on a GPU, Triton)
    dtype: torch.dtype = torch.float32  # the notebook's activation dtype: bf16 where native, fp16 before sm_80

    def rows(self) -> list[dict[str, str]]:
        arch = "" if self.device.type == "cpu" else f" for sm_{''.join(map(str, torch.cuda.get_device_capability()))}"
        mode = "its CPU interpreter" if self.device.type == "cpu" else f"compiled{arch}"
        return [
            {"path": "Triton kernel", "here": f"skipped: {self.triton_why_not}" if self.triton_why_not else
             f"{mode}, in {_dtype_names(self.triton_dtypes)}"},
            {"path": f"C++ extension ({self.cpp_kind})", "here": f"skipped: {self.cpp_why_not}" if self.cpp_why_not
             else "built below (or loaded from an earlier build)"},
            {"path": "torch.compile", "here": f"skipped: {self.compile_why_not}" if self.compile_why_not else "yes"},
        ]

    def table(self) -> None:
        from utils.plot import table

        table(self.rows(), title=f"What runs on {self.device}")


def toolchain(device: torch.device | str) -> Toolchain:
    """Detect what notebook 06 can run on ``device`` and why not, in words: Triton (installed; compute capability
    7.0+; on a CPU only its interpreter, TRITON_INTERPRET=1 before the first import), the dtypes it runs in, the C++
    extension for this device's tensors (:func:`utils.extension.why_not_buildable`: a compiler, ninja, and for
    CUDA nvcc; an earlier build needs none of them), and torch.compile (a C++ compiler on a CPU, Triton on a GPU)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    cc = torch.cuda.get_device_capability(device) if cuda else None
    if triton is None:
        triton_why = TRITON_MISSING
    elif cuda and TRITON_INTERPRETED:
        triton_why = "TRITON_INTERPRET=1 is set: Triton would run its CPU interpreter, not this GPU"
    elif cuda and cc < (7, 0):
        triton_why = f"Triton needs compute capability 7.0 or newer, this GPU is sm_{cc[0]}{cc[1]}"
    elif not cuda and not TRITON_INTERPRETED:
        triton_why = ("on a CPU Triton runs only in its interpreter, switched on by TRITON_INTERPRET=1 before the "
                      "first `import triton`: restart the kernel and run from the top")
    else:
        triton_why = None
    kind = "cuda" if cuda else "cpu"
    built = False
    try:
        spec = extension_spec(kind)
        built = (extension.build_directory(spec) / "build.ok").exists() and extension.library_path(spec).exists()
    except (ValueError, RuntimeError, AssertionError):
        pass
    cpp_why = None if built else extension.why_not_buildable(cuda=cuda)
    if cuda and triton is None:
        compile_why = "on a GPU Inductor generates Triton, and Triton is not installed"
    elif cuda and cc < (7, 0):
        compile_why = f"Inductor's Triton needs compute capability 7.0 or newer, this GPU is sm_{cc[0]}{cc[1]}"
    elif cuda:
        compile_why = None
    else:
        compile_why = None if extension.find_cxx() else "on a CPU Inductor generates C++, and no C++ compiler is here"
    dtype = torch.float32 if not cuda else torch.bfloat16 if cc >= (8, 0) else torch.float16
    return Toolchain(device, triton_why, triton_dtypes(device) if triton_why is None else (), kind, cpp_why,
                     compile_why, dtype)


@dataclass
class Kernel:
    """One implementation of bias + GELU as it stands on this machine: a plain launcher (check, allocate, launch),
    its ``torch.library`` operator, and ``why_not`` where it cannot run (then both are None)."""

    name: str
    launch: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    op: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    why_not: str | None = None
    dtypes: tuple[torch.dtype, ...] = ()
    checks: list[dict[str, str]] = field(default_factory=list)

    @property
    def available(self) -> bool:
        return self.why_not is None


def check_kernel(launch, device: torch.device | str, dtypes, *, shape=(1823, 781),
                 name: str = "kernel") -> list[dict[str, str]]:
    """Run ``launch(x, bias)`` on an irregular shape, and on a view one element into its allocation (not 16-byte
    aligned), in each dtype, against :func:`reference` in float32 from the same inputs, within :func:`tolerance`.
    Rows for a table, with eager's own error (it rounds twice) beside.

    Raises:
        ValueError: where an output differs, naming the dtype, the input and the largest error.
    """
    if not dtypes:
        raise ValueError(f"{name}: no dtype to check: a check that checks nothing must not pass")
    rows = []
    for dt in dtypes:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(shape, generator=gen).to(device, dt)
        b = torch.randn(shape[-1], generator=gen).to(device, dt)
        shifted = torch.empty(x.numel() + 1, device=device, dtype=dt)[1:].view(shape).copy_(x)
        ref = reference(x.float(), b.float())
        errors = []
        for what, inp in (("aligned", x), ("offset by one element", shifted)):
            err = (launch(inp, b).float() - ref).abs()
            try:
                torch.testing.assert_close(launch(inp, b).float(), ref, **tolerance(dt))
            except AssertionError:
                raise ValueError(f"{name} differs from the float32 reference in {dt} on x {list(shape)} "
                                 f"({what}): largest error {err.max():.3g}, tolerance {tolerance(dt)}") from None
            errors.append(err.max().item())
        rows.append({"kernel": name, "dtype": str(dt).removeprefix("torch."), "aligned + offset": "✓",
                     "max |error|": f"{max(errors):.1e}",
                     "tolerance": f"{tolerance(dt)['rtol']:.0e} × |expected| + {tolerance(dt)['atol']:.0e}",
                     "eager's max |error|": _eager_error(reference(x, b).float(), ref)})
    return rows


def _eager_error(eager: torch.Tensor, ref: torch.Tensor) -> str:
    """Eager's largest error against the float32 reference: "0 (the reference)" where eager is that reference (in
    float32), so a 0e+00 never reads as a measurement."""
    err = (eager - ref).abs().max().item()
    return f"{err:.1e}" if err > 0 else "0 (the reference)"


def register_triton(kernel, kit: Toolchain, *, example: tuple[torch.Tensor, torch.Tensor] | None = None) -> Kernel:
    """Wire a Triton kernel with the signature of this module's ``bias_gelu_kernel`` into a launcher and into the
    operator ``course::bias_gelu_triton`` (``torch.library.triton_op``, fake implementation, autograd), then check
    it (:func:`check_kernel`, in the dtypes Triton runs in here) and print the checks. With ``example``, its first
    call there is timed apart (compiling and autotuning every configuration). Calling it again with an edited
    kernel replaces the one the operator launches.

    Returns a :class:`Kernel`; where Triton cannot run here, one whose ``why_not`` says why (printed).

    Raises:
        ValueError: the kernel's output differs from the reference (see :func:`check_kernel`).
    """
    why = kit.triton_why_not or getattr(kernel, "why_not", None)
    if why:
        print(f"Triton kernel: skipped, {why}")
        return Kernel("Triton", why_not=why)
    _CURRENT_TRITON[0] = kernel

    def launch(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        check_inputs(x, bias)
        _require_triton(x)
        return _triton_forward(x, bias, kernel)

    rows = check_kernel(launch, kit.device, kit.triton_dtypes, name="Triton")
    from utils.plot import table

    table(rows, title=f"Triton against the float32 reference, x [1823, 781] on {kit.device}")
    if example is not None:
        start = time.perf_counter()
        launch(*example)
        if kit.device.type == "cuda":
            torch.cuda.synchronize(kit.device)
        configs, chosen = getattr(kernel, "configs", []), getattr(kernel, "best_config", None)
        how = ("interpreted" if TRITON_INTERPRETED else f"compiling and timing {len(configs)} tile configurations"
               if len(configs) > 1 else "compiling it")
        tile = (f"; chosen: BLOCK_R={chosen.kwargs.get('BLOCK_R')}, BLOCK_C={chosen.kwargs.get('BLOCK_C')}, "
                f"{chosen.num_warps} warps" if chosen is not None and len(configs) > 1 else "")
        print(f"First call on x {list(example[0].shape)}: {time.perf_counter() - start:.2f} s ({how}){tile}. Later "
              "calls with this shape reuse it.")
    return Kernel("Triton", launch, bias_gelu_triton, None, kit.triton_dtypes, rows)


def build_cpp(kit: Toolchain, *, timeout_s: float = 600.0) -> Kernel:
    """Build (or load an earlier build of) the C++ extension for this device's tensors, check its kernel in every
    dtype (:func:`check_kernel`) and print what happened. Where it cannot build, or the build fails, print why
    and return a :class:`Kernel` whose ``why_not`` says so: no later cell calls it."""
    name = f"C++ ({kit.cpp_kind})"
    if kit.cpp_why_not:
        print(f"{name}: skipped, {kit.cpp_why_not}")
        return Kernel(name, why_not=kit.cpp_why_not)
    spec = extension_spec(kit.cpp_kind)
    directory = extension.build_directory(spec)
    was_built = (directory / "build.ok").exists()
    if not was_built:
        print(f"{spec.name}: compiling {', '.join(p.name for p in spec.sources)} (a minute or two the first time; "
              "later runs load the build) ...", flush=True)
    start = time.perf_counter()
    try:
        build_extension(kit.cpp_kind, timeout_s=timeout_s)
    except (RuntimeError, TimeoutError) as err:
        print(f"{name}: the build failed, so its kernel is skipped below:\n{err}")
        return Kernel(name, why_not=f"the build failed ({str(err).splitlines()[0][:120]})")
    print(f"{spec.name}: {'loaded an earlier build' if was_built else 'compiled'} in "
          f"{time.perf_counter() - start:.1f} s, from {', '.join(p.name for p in spec.sources)} for "
          f"{spec.arch and 'sm_' + spec.arch.replace('.', '') or 'this CPU'}, in {directory.relative_to(REPO_ROOT)}")
    launch = bias_gelu_cuda if kit.cpp_kind == "cuda" else bias_gelu_cpu
    rows = check_kernel(launch, kit.device, SUPPORTED_DTYPES, name=name)
    from utils.plot import table

    table(rows, title=f"{name} against the float32 reference, x [1823, 781]")
    return Kernel(name, launch, bias_gelu_cpp, None, SUPPORTED_DTYPES, rows)


@dataclass(frozen=True)
class Traffic:
    """The bytes eager bias + GELU moves, operator by operator (:func:`operator_bytes`), and those a fused kernel
    must move (:func:`bytes_moved`)."""

    ops: list[dict[str, object]]
    fused_bytes: int

    @property
    def eager_bytes(self) -> int:
        return sum(op["read_bytes"] + op["written_bytes"] for op in self.ops)

    @property
    def ratio(self) -> float:
        return self.eager_bytes / self.fused_bytes

    def table(self, title: str | None = None) -> None:
        from utils.plot import table

        table([{"operator": op["operator"], "inputs": op["inputs"], "output": op["output dtype"],
                "reads": f"{op['read_bytes'] / 1e6:,.1f} MB", "writes": f"{op['written_bytes'] / 1e6:,.1f} MB"}
               for op in self.ops], title=title)
        print(self)

    def __str__(self) -> str:
        return (f"eager runs {' → '.join(str(op['operator']).removeprefix('aten::') for op in self.ops)} and moves "
                f"{self.eager_bytes / 1e6:,.1f} MB; a fused kernel must move {self.fused_bytes / 1e6:,.1f} MB (read x "
                f"and bias once, write out once): {self.ratio:.2f}× fewer bytes.")

    def parts(self, comparison, name: str, eager: str = "eager") -> str:
        """How ``name``'s speed-up over eager in ``comparison`` splits into fewer bytes and a faster stream, both
        measured: speed-up = bytes ratio × (the kernel's rate / eager's rate, each for the bytes it really moves).
        The comparison's rates must be for :attr:`fused_bytes`, its limit the copy bandwidth."""
        speedup = comparison.speedup(name, against=eager)
        eager_real = self.eager_bytes / comparison.time_s(eager) / 1e9
        pct = (lambda gbps: f"{100 * gbps / comparison.limit:.0f}%") if comparison.limit else (lambda g: f"{g:,.0f}")
        return (f"{name}: {speedup:.2f}× eager = {self.ratio:.2f}× fewer bytes × {speedup / self.ratio:.2f}× the "
                f"rate (it streams at {pct(comparison.rate(name))} of copy bandwidth, eager's kernels at "
                f"{pct(eager_real)} for the bytes they move)")


def traffic(x: torch.Tensor, bias: torch.Tensor, *, autocast: torch.dtype | None = None) -> Traffic:
    """Count what eager bias + GELU moves on ``x`` and ``bias`` (under ``torch.autocast`` to ``autocast`` if given,
    where ``add`` promotes a 16-bit x and an fp32 bias to fp32), against what a fused kernel must move."""
    with torch.autocast(x.device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
        ops = operator_bytes(lambda: reference(x, bias))
    fused = bytes_moved(x, bias) if autocast is None else 2 * x.numel() * x.element_size() + bias.numel() * 2
    return Traffic(ops, fused)


def check_outputs(fns: Mapping[str, Callable[[], torch.Tensor]], x: torch.Tensor, bias: torch.Tensor,
                  *, roundings: Mapping[str, int] | None = None) -> str:
    """Check every ``fns[name]()`` against :func:`reference` in float32 of ``x`` and ``bias``, within
    :func:`tolerance` (``roundings``: 2 for eager-like code that rounds ``x + bias`` first; default 1). Returns
    what was checked, for a notebook to print.

    Raises:
        ValueError: naming the first variant that differs.
    """
    ref = reference(x.float(), bias.float())
    for name, fn in fns.items():
        tol = tolerance(x.dtype, roundings=(roundings or {}).get(name, 1))
        try:
            torch.testing.assert_close(fn().float(), ref, **tol)
        except AssertionError as err:
            raise ValueError(f"{name} differs from the float32 reference: {str(err).splitlines()[0]}") from None
    return (f"All {len(fns)} match the float32 reference on x {list(x.shape)} "
            f"(utils.bias_gelu.tolerance: rtol {tolerance(x.dtype)['rtol']:.0e} for {str(x.dtype)[6:]}).")


def check_operator(op, device: torch.device | str, dtypes) -> dict[str, str]:
    """``torch.library.opcheck`` on three samples (float32 with gradients; ``dtypes[-1]`` on a 3-D x; a 16-bit x
    with a float32 bias and gradients, as under autocast), then the gradients against PyTorch's autograd through
    :func:`reference` in float32. One row for a table.

    Raises:
        AssertionError: a test of opcheck failed, or a gradient differs (rtol = atol = 1e-4).
    """
    device = torch.device(device)
    low = dtypes[-1]
    samples = [(torch.randn(8, 40, device=device, requires_grad=True), torch.randn(40, device=device,
                                                                                   requires_grad=True)),
               (torch.randn(2, 3, 24, device=device, dtype=low), torch.randn(24, device=device, dtype=low))]
    if low != torch.float32:
        samples.append((torch.randn(8, 40, device=device, dtype=low, requires_grad=True),
                        torch.randn(40, device=device, requires_grad=True)))
    tests = 0
    for args in samples:
        report = torch.library.opcheck(op, args)
        assert all(v == "SUCCESS" for v in report.values()), report
        tests += len(report)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(257, 781, generator=gen).to(device).requires_grad_()
    b = torch.randn(781, generator=gen).to(device).requires_grad_()
    upstream = torch.randn(257, 781, generator=gen).to(device)
    want = torch.autograd.grad(reference(x, b), (x, b), upstream)
    got = torch.autograd.grad(op(x, b), (x, b), upstream)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    return {"operator": str(op._qualname if hasattr(op, "_qualname") else op), "opcheck": f"{tests} tests passed "
            f"on {len(samples)} samples", "d/dx max |error|": f"{(got[0] - want[0]).abs().max():.1e}",
            "d/dbias max |error|": f"{(got[1] - want[1]).abs().max():.1e}"}


def check_in_model(make_block: Callable[[Callable], torch.nn.Module], op, h: torch.Tensor, *, compiled: bool,
                   amp_dtype: torch.dtype | None = None) -> dict[str, str]:
    """Forward and backward of ``make_block(op)`` (optionally ``torch.compile(..., fullgraph=True)``, optionally
    under ``torch.autocast`` to ``amp_dtype``) against ``make_block(reference)`` in eager, from the same weights.
    Returns a row for a table; the first call's seconds include the compile.

    Raises:
        AssertionError: outputs or gradients differ (float32: rtol 1e-4; autocast: within 2% of the largest value).
    """
    import warnings

    def run(act, compile_it):
        torch.manual_seed(0)
        block = make_block(act).to(h.device)
        fn = torch.compile(block, fullgraph=True) if compile_it else block
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*TensorFloat32")
            with torch.autocast(h.device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
                out = fn(h)
            out.float().square().sum().backward()
        if h.device.type == "cuda":
            torch.cuda.synchronize(h.device)
        return out, dict(block.named_parameters()), time.perf_counter() - start

    ref_out, ref_params, _ = run(reference, False)
    out, params, seconds = run(op, compiled)
    if amp_dtype is None:
        torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
        for name, p in params.items():
            torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=1e-3, atol=1e-3)
    else:
        for got, want in ((out.float(), ref_out.float()), (params["bias"].grad, ref_params["bias"].grad)):
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    return {"operator": str(getattr(op, "_qualname", getattr(op, "__name__", op))),
            "run": ("compiled, fullgraph" if compiled else "eager") + (f", autocast {str(amp_dtype)[6:]}"
                                                                        if amp_dtype else ", float32"),
            "first call (fwd + bwd)": f"{seconds:.1f} s", "output dtype": str(out.dtype)[6:],
            "bias grad dtype": str(params["bias"].grad.dtype)[6:],
            "max |out − eager's|": f"{(out.float() - ref_out.float()).abs().max():.1e}", "matches eager": "✓"}


def issue_budget(sm_count: int, sm_clock_mhz: float, copy_gbps: float, element_size: int) -> float:
    """Instructions per element the SMs can issue while the copy bandwidth moves one element of bias + GELU (read
    and write: 2 × ``element_size`` bytes): ``sm_count`` × 4 schedulers × 32 threads × the SM clock, over the
    elements per second. A kernel that needs a good share of it cannot keep enough loads in flight."""
    return sm_count * 4 * 32 * sm_clock_mhz * 1e6 / (copy_gbps * 1e9 / (2 * element_size))


def math_accuracy(device: torch.device | str = "cuda") -> list[dict[str, str]]:
    """What each CUDA version's math costs in accuracy (:data:`CUDA_VARIANTS`): the largest relative error against
    :func:`reference_exact` (float64, of the inputs the kernel sees) on z from −8 to 4, in float32 and bf16, and
    the share of bf16 outputs bit-identical to the precise version's. Rows for a table; needs the CUDA extension.

    Expect: ``rows`` as accurate as the first version (the same bits), ``rows + fast exp`` a few float32 ulps off
    and nearly all bf16 bits the same, ``rows + tanh.approx`` many percent off in the negative tail (``1 + tanh u``
    cancels), which is why ``bias_gelu_cuda`` never uses it."""
    z = torch.linspace(-8, 4, 120_001, device=device)[None]
    zero = torch.zeros(z.shape[-1], device=device)
    precise = bias_gelu_cuda_variant(z.bfloat16(), zero.bfloat16(), "rows")
    rows = []
    for name in CUDA_VARIANTS:
        row = {"version": name}
        for dt in (torch.float32, torch.bfloat16):
            exact = reference_exact(z.to(dt), zero)
            out = bias_gelu_cuda_variant(z.to(dt), zero.to(dt), name).double()
            rel = ((out - exact).abs() / exact.abs())[exact.abs() > 1e-30]
            row[f"{str(dt).removeprefix('torch.')} max rel. error"] = f"{rel.max():.1e}"
        same = (bias_gelu_cuda_variant(z.bfloat16(), zero.bfloat16(), name) == precise).float().mean()
        row["bf16 bits = precise's"] = f"{same:.2%}"
        rows.append(row)
    return rows
