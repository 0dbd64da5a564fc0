"""How much memory your tensors take, and when: allocated / reserved / peak reports (:func:`memory_stats`), a block
that measures its own peak (:func:`track_peak`), what autograd keeps for backward, tensor by tensor
(:func:`saved_tensors_by_op`), memory over one training step read at module boundaries (:func:`trace_step_memory`),
and giving back what a step left behind (:func:`release_memory`). :func:`format_bytes` is the course's one byte
formatter.

On CUDA every number comes from PyTorch's caching allocator: *allocated* is what live tensors occupy,
*reserved* is what the allocator holds from the driver (allocated plus its cache), and neither counts the CUDA
context or other processes, so ``nvidia-smi`` shows more. On CPU there is no allocator to ask: the numbers are
the process's resident set size (RSS) from the kernel, which counts everything the process holds (Python,
libraries, caches), not only tensors. Every result carries a ``what`` sentence saying which of these it is.

Beside it, one concern each, and importing from it (never the other way): :mod:`utils.memory_snapshot` (CUDA
memory snapshots, their timeline and who holds the peak), :mod:`utils.memory_calculator` (a training step's memory
predicted from sizes), :mod:`utils.checkpointing` (activation checkpointing with what backward recomputes counted),
:mod:`utils.out_of_memory` (out-of-memory errors caught and released; the largest batch that fits) and
:mod:`utils.allocator` (the caching allocator's fragmentation and the environment variable that configures it).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from utils.env import get_device

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_PROC_STATUS = Path("/proc/self/status")
_PROC_CLEAR_REFS = Path("/proc/self/clear_refs")


def format_bytes(n: int | float) -> str:
    """Format a byte count in binary units: ``0 B``, ``512 B``, ``1.50 KiB``, ``3.25 GiB``; keeps the sign."""
    sign = "-" if n < 0 else ""
    value, unit = float(abs(n)), 0
    # Move up while the value would print as 1024 (B) or 1024.00 (KiB and up) or more in this unit.
    while unit < len(_UNITS) - 1 and (round(value, 2) if unit else round(value)) >= 1024:
        value /= 1024
        unit += 1
    return f"{sign}{value:.2f} {_UNITS[unit]}" if unit else f"{sign}{round(value)} B"


# ----------------------------------------------------------------------------------------------------
# Devices and the CPU's numbers


def _parse_proc_status(text: str) -> dict[str, int]:
    """The ``Vm*`` lines of ``/proc/self/status`` (``VmRSS:\\t 1234 kB``) as a dict of bytes."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if key.startswith("Vm") and len(fields) == 2 and fields[1] == "kB":
            out[key] = int(fields[0]) * 1024
    return out


def _proc_rss() -> tuple[int, int] | None:
    """(current RSS, RSS high-water mark) in bytes from /proc, or None where there is no /proc (not Linux)."""
    try:
        status = _parse_proc_status(_PROC_STATUS.read_text())
        return status["VmRSS"], status["VmHWM"]
    except (OSError, KeyError):
        return None


def _rusage_peak_rss() -> int | None:
    """The process's lifetime peak RSS in bytes from ``getrusage``; None where there is none (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def _reset_rss_peak() -> bool:
    """Reset the kernel's RSS high-water mark (VmHWM) to the current RSS; True if it worked (Linux >= 4.0)."""
    try:
        _PROC_CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


_CPU_STATS_WHAT = (
    "process resident set size (RSS) from /proc: allocated = current RSS, reserved = current RSS, "
    "peak = high-water mark; includes everything the process holds, not only tensors"
)
_CPU_RUSAGE_WHAT = (
    "process peak resident set size from getrusage (no /proc on this OS, so current RSS is unknown): "
    "allocated, reserved and peak all show the lifetime high-water mark; includes everything the process "
    "holds, not only tensors"
)
_CPU_NONE_WHAT = "not available: this OS has neither /proc nor getrusage, so all numbers are 0"


# ----------------------------------------------------------------------------------------------------
# memory_stats


@dataclass(frozen=True)
class MemoryStats:
    """Memory in use on one device, in bytes, and a sentence saying what the numbers measure."""

    device: str
    allocated_bytes: int
    reserved_bytes: int
    peak_allocated_bytes: int
    what: str

    def __str__(self) -> str:
        return (
            f"{self.device}: allocated {format_bytes(self.allocated_bytes)} · "
            f"reserved {format_bytes(self.reserved_bytes)} · peak {format_bytes(self.peak_allocated_bytes)}\n"
            f"  ({self.what})"
        )


def memory_stats(device: torch.device | str) -> MemoryStats:
    """Allocated, reserved and peak memory on ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``, torch.device).

    CUDA: ``torch.cuda.memory_allocated`` / ``memory_reserved`` / ``max_memory_allocated`` (peak since the
    program started or since the last ``torch.cuda.reset_peak_memory_stats``). CPU: the process's RSS and its
    high-water mark from ``/proc/self/status``; elsewhere the lifetime peak from ``getrusage``. Raises
    ValueError for a device type other than cpu/cuda, RuntimeError for cuda when CUDA is not available.
    """
    dev = get_device(device)
    if dev.type == "cuda":
        return MemoryStats(
            device=str(dev),
            allocated_bytes=torch.cuda.memory_allocated(dev),
            reserved_bytes=torch.cuda.memory_reserved(dev),
            peak_allocated_bytes=torch.cuda.max_memory_allocated(dev),
            what=f"PyTorch caching allocator on {dev}: allocated = live tensors, "
            "reserved = held by the cache, peak since last reset",
        )
    rss = _proc_rss()
    if rss is not None:
        current, high_water = rss
        return MemoryStats("cpu", current, current, high_water, _CPU_STATS_WHAT)
    peak = _rusage_peak_rss()
    if peak is not None:
        return MemoryStats("cpu", peak, peak, peak, _CPU_RUSAGE_WHAT)
    return MemoryStats("cpu", 0, 0, 0, _CPU_NONE_WHAT)


# ----------------------------------------------------------------------------------------------------
# track_peak


@dataclass
class PeakMemory:
    """What :func:`track_peak` measured, in bytes; the fields are filled when the ``with`` block ends."""

    device: str
    start_bytes: int = 0
    end_bytes: int = 0
    peak_bytes: int = 0  # the highest level reached inside the block
    peak_increase_bytes: int = 0  # peak_bytes - start_bytes: what the block needed on top of what was there
    what: str = ""

    def __str__(self) -> str:
        return (
            f"{self.device}: peak {format_bytes(self.peak_bytes)} (+{format_bytes(self.peak_increase_bytes)} "
            f"over the {format_bytes(self.start_bytes)} at the start), "
            f"{format_bytes(self.end_bytes)} at the end\n  ({self.what})"
        )


@contextmanager
def track_peak(device: torch.device | str) -> Iterator[PeakMemory]:
    """Measure the peak memory reached inside a ``with`` block::

        with track_peak(device) as mem:
            loss = model(x).sum(); loss.backward()
        print(mem.peak_increase_bytes)

    CUDA: synchronizes, calls ``torch.cuda.reset_peak_memory_stats(device)`` (which also resets the peak that
    :func:`memory_stats` reports), and reads ``max_memory_allocated`` after synchronizing at the end: tensors
    only, exact. CPU (Linux): resets the kernel's RSS high-water mark through ``/proc/self/clear_refs`` and
    reads it back at the end: the whole process, to the page. Where the mark cannot be reset the peak is
    the process's lifetime high-water mark, and ``what`` says so. The fields are filled even if the block
    raises (e.g. an out-of-memory error that you catch outside the block).
    """
    dev = get_device(device)
    result = PeakMemory(device=str(dev))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        result.start_bytes = torch.cuda.memory_allocated(dev)
        result.what = (
            f"PyTorch caching allocator on {dev}: start/end = memory allocated by live tensors, "
            "peak = max_memory_allocated inside the block (after reset_peak_memory_stats)"
        )
        try:
            yield result
        finally:
            torch.cuda.synchronize(dev)
            result.end_bytes = torch.cuda.memory_allocated(dev)
            result.peak_bytes = torch.cuda.max_memory_allocated(dev)
            result.peak_increase_bytes = result.peak_bytes - result.start_bytes
        return

    on_linux = _proc_rss() is not None
    was_reset = on_linux and _reset_rss_peak()  # sets the mark to the current RSS
    result.start_bytes = _cpu_rss_now()[0]
    result.what = _cpu_peak_what(on_linux, was_reset, available=result.start_bytes > 0)
    try:
        yield result
    finally:
        result.end_bytes, high_water = _cpu_rss_now()
        result.peak_bytes = max(high_water, result.start_bytes, result.end_bytes)
        result.peak_increase_bytes = result.peak_bytes - result.start_bytes


def _cpu_rss_now() -> tuple[int, int]:
    """(current RSS, high-water mark) in bytes: /proc, else getrusage's lifetime peak for both, else zeros."""
    rss = _proc_rss()
    if rss is not None:
        return rss
    peak = _rusage_peak_rss() or 0
    return peak, peak


def _cpu_peak_what(on_linux: bool, was_reset: bool, *, available: bool) -> str:
    """The ``what`` sentence of a CPU :class:`PeakMemory`."""
    if on_linux:
        peak = ("RSS high-water mark inside the block (reset at the start through /proc/self/clear_refs)"
                if was_reset else "RSS high-water mark of the whole process lifetime (it could not be reset "
                "here), so it may predate the block")
        return ("process resident set size (RSS) from /proc: start/end = current RSS, peak = " + peak
                + "; includes everything the process holds, not only tensors")
    if available:
        return ("process lifetime peak RSS from getrusage (no /proc on this OS): start, end and peak all "
                "show that high-water mark, so the increase is a lower bound; includes everything the "
                "process holds")
    return _CPU_NONE_WHAT


# ----------------------------------------------------------------------------------------------------
# Giving memory back


def release_memory(device: torch.device | str, *holders: Any) -> None:
    """Give back what a failed (or finished) step left behind: ``holder.zero_grad(set_to_none=True)`` for each
    model or optimizer passed (gradients of a half-done backward), a garbage collection (reference cycles that
    hold tensors), and on CUDA ``torch.cuda.empty_cache()`` (cached blocks back to the driver)."""
    import gc

    for holder in holders:
        holder.zero_grad(set_to_none=True)
    gc.collect()
    dev = get_device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------------
# What autograd keeps for backward, tensor by tensor


@dataclass(frozen=True)
class SavedTensor:
    """One tensor autograd keeps for the backward pass: the backward node that keeps it, under which name."""

    op: str  # the backward node, e.g. "LogSoftmaxBackward0" (the forward op was log_softmax)
    name: str  # the saved variable, e.g. "result" or "mat1"
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int  # of its storage, counted once however many nodes share it


def saved_tensors_by_op(
    output: torch.Tensor, *, exclude: tuple[torch.Tensor, ...] | list[torch.Tensor] = ()
) -> list[SavedTensor]:
    """Every tensor the autograd graph behind ``output`` keeps for backward, attributed to the node that keeps it.

    Walks the graph from ``output.grad_fn`` and reads each node's ``_saved_<name>`` tensors (the attributes
    PyTorch's generated backward nodes expose). A storage kept by several nodes (log_softmax's result is also
    nll_loss's input) is counted once, for the node that produced it (the one that keeps it as its ``result``);
    tensors sharing a storage with one of ``exclude`` (pass the model's parameters) are left out: they exist
    anyway. Largest first.

    Call it after the forward pass and before ``backward()``, which frees what it reads. Not for graphs with
    activation checkpointing: there reading a saved tensor *recomputes* it, so the walk would list (and allocate)
    tensors that were never kept; count those with ``torch.autograd.graph.saved_tensors_hooks`` during forward.

    Raises:
        ValueError: if ``output`` has no autograd graph (computed without grad, or a leaf).
    """
    if output.grad_fn is None:
        raise ValueError("output has no autograd graph: compute it with gradients enabled, before backward()")
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    seen_nodes: set = set()
    by_storage: dict[int, SavedTensor] = {}
    stack = [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen_nodes:
            continue
        seen_nodes.add(node)
        for attr in sorted(a for a in dir(node) if a.startswith("_saved_")):
            try:
                value = getattr(node, attr)
            except RuntimeError:  # freed already (after backward), or not a tensor
                continue
            for t in (value if isinstance(value, (list, tuple)) else [value]):
                if not isinstance(t, torch.Tensor):
                    continue
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key in excluded or storage.nbytes() == 0:
                    continue
                record = SavedTensor(type(node).__name__, attr.removeprefix("_saved_"), t.dtype, tuple(t.shape),
                                     storage.nbytes())
                # a storage kept by several nodes belongs to the op that produced it (its saved "result")
                if key not in by_storage or (record.name.startswith("result")
                                             and not by_storage[key].name.startswith("result")):
                    by_storage[key] = record
        stack.extend(fn for fn, _ in node.next_functions)
    return sorted(by_storage.values(), key=lambda s: s.nbytes, reverse=True)


def saved_bytes_by(saved: list[SavedTensor], *, key: str = "op") -> dict[str, int]:
    """Sum :func:`saved_tensors_by_op` rows by ``"op"``, ``"dtype"`` or ``"op+dtype"``; largest first."""
    if key not in ("op", "dtype", "op+dtype"):
        raise ValueError(f"key must be 'op', 'dtype' or 'op+dtype', got {key!r}")
    totals: dict[str, int] = {}
    for s in saved:
        dtype = str(s.dtype).removeprefix("torch.")
        label = s.op if key == "op" else dtype if key == "dtype" else f"{s.op} ({dtype})"
        totals[label] = totals.get(label, 0) + s.nbytes
    return dict(sorted(totals.items(), key=lambda kv: kv[1], reverse=True))


# ----------------------------------------------------------------------------------------------------
# Memory over one step, read at module boundaries


@dataclass
class MemoryTrace:
    """Memory read after each named module's forward and backward and after the optimizer step."""

    device: str
    what: str
    labels: list[str] = field(default_factory=list)
    phases: list[str] = field(default_factory=list)  # "start", "forward", "backward", "optimizer"
    allocated_bytes: list[int] = field(default_factory=list)

    def mark(self, label: str, phase: str) -> None:
        """Read the memory now and append it under ``label``."""
        dev = torch.device(self.device)
        value = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else _cpu_rss_now()[0]
        self.labels.append(label)
        self.phases.append(phase)
        self.allocated_bytes.append(value)

    def summary(self, peak_increase_bytes: int | None = None) -> str:
        """One sentence from the readings, each above the first: the level at the end of the forward pass, the
        highest reading (and where it was taken), the last. With ``peak_increase_bytes`` (:func:`track_peak`'s over
        the same step) the true peak beside them: it also sees the short-lived buffers between two readings."""
        start = self.allocated_bytes[0]
        forward = [i for i, p in enumerate(self.phases) if p == "forward"]
        highest = max(range(len(self.allocated_bytes)), key=self.allocated_bytes.__getitem__)
        parts = []
        if forward:
            parts.append(f"{format_bytes(self.allocated_bytes[forward[-1]] - start)} at the end of the forward pass")
        parts.append(f"{format_bytes(self.allocated_bytes[highest] - start)} at the highest reading "
                     f"({self.labels[highest]}, {self.phases[highest]})")
        parts.append(f"{format_bytes(self.allocated_bytes[-1] - start)} at the last ({self.labels[-1]})")
        text = "Above the first reading: " + " · ".join(parts) + "."
        if peak_increase_bytes is not None:
            text += (f" The step's peak, which also sees what lives between two readings: "
                     f"{format_bytes(peak_increase_bytes)} above the start.")
        return text


@contextmanager
def trace_step_memory(device: torch.device | str, modules: dict[str, torch.nn.Module],
                      optimizer: torch.optim.Optimizer | None = None) -> Iterator[MemoryTrace]:
    """Record memory after each module's forward and backward (hooks) and after ``optimizer.step()``::

        with trace_step_memory(device, {"layer 0": model.layers[0], ...}, optimizer) as trace:
            train_step(...)
        plot_memory_trace(trace)

    CUDA: ``torch.cuda.memory_allocated`` (host-side bookkeeping: no synchronisation, so the readings are taken in
    the order the work was queued). CPU: the process's resident set size, which counts pages the process holds:
    it rises as new tensors touch fresh pages but does not fall when tensors are freed, because the C library
    keeps freed memory for reuse. The first reading, "start", is taken on entry; the hooks are removed on exit.
    """
    dev = get_device(device)
    what = ("torch.cuda.memory_allocated: bytes of live tensors" if dev.type == "cuda" else
            "process resident set size (RSS): pages the process holds, which freed tensors do not give back")
    trace = MemoryTrace(device=str(dev), what=what)
    handles = []
    for name, module in modules.items():
        handles.append(module.register_forward_hook(lambda m, a, o, name=name: trace.mark(name, "forward")))
        handles.append(module.register_full_backward_hook(
            lambda m, gi, go, name=name: trace.mark(name, "backward")))
    if optimizer is not None:
        handles.append(optimizer.register_step_post_hook(lambda opt, a, k: trace.mark("optimizer step",
                                                                                      "optimizer")))
    trace.mark("start", "start")
    try:
        with warnings.catch_warnings():  # a module whose inputs need no gradient (an embedding) is fine here
            warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
            yield trace
    finally:
        for handle in handles:
            handle.remove()


_PHASE_COLOURS = {"start": "#999999", "forward": "#4C72B0", "backward": "#DD8452", "optimizer": "#55A868"}


def plot_memory_trace(trace: MemoryTrace, *, title: str = "Memory over one training step") -> Figure:
    """The readings of a :class:`MemoryTrace` as a line, each point coloured by phase and labelled. Returns a
    closed Figure."""
    import matplotlib.pyplot as plt

    peak = max(trace.allocated_bytes, default=0)
    unit, scale = ("GiB", 2**30) if peak >= 2**30 else ("MiB", 2**20)
    values = [b / scale for b in trace.allocated_bytes]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    x = list(range(len(values)))
    ax.plot(x, values, color="#333333", linewidth=1.0, zorder=1)
    for phase, colour in _PHASE_COLOURS.items():
        at = [i for i, p in enumerate(trace.phases) if p == phase]
        if at:
            ax.scatter(at, [values[i] for i in at], color=colour, s=28, zorder=2, label=phase)
    ax.set_xticks(x, [f"{label} ({'fwd' if phase == 'forward' else 'bwd'})" if phase in ("forward", "backward")
                      else label
                      for label, phase in zip(trace.labels, trace.phases, strict=True)],
                  rotation=60, ha="right", fontsize=8)
    ax.set_ylabel(f"memory ({unit})")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    plt.close(fig)
    return fig



# ----------------------------------------------------------------------------------------------------
# The parts of one training step, measured between its phases


@dataclass(frozen=True)
class StepParts:
    """What :func:`measure_step_parts` read, in bytes, with a sentence saying what the numbers are."""

    device: str
    parts: dict[str, int]  # cuBLAS workspace (GPU), weights, activations, optimizer state, gradients, transient
    peak_bytes: int  # a whole later step's peak, above what was allocated before the model (workspace excluded)
    peak_allocated_bytes: int  # everything allocated at that peak (not only above the start)
    cache_bytes: int | None  # GPU: the allocator's cache at the peak (peak reserved − peak allocated)
    outside_bytes: int | None  # GPU: used memory (mem_get_info) − reserved: context, libraries, other processes
    what: str

    #: The parts whose size is exact (a number of values × 4 bytes): the allocator must count what sizes predict.
    EXACT = ("weights", "gradients", "optimizer state")

    def rows(self, predicted: Any) -> list[dict[str, object]]:
        """Table rows, part by part, beside a :class:`utils.memory_calculator.MemoryPrediction` and their ratio
        (on a GPU; RSS on a CPU measures the process, so no ratio is shown)."""
        expected = dict(predicted.parts)
        on_gpu = self.device.startswith("cuda")
        rows = [{"part": name, "predicted": format_bytes(expected[name]) if name in expected else "—",
                 "measured": format_bytes(nbytes),
                 "measured / predicted": f"{nbytes / expected[name]:.2f}" if on_gpu and expected.get(name) else "—"}
                for name, nbytes in self.parts.items()]
        rows.append({"part": "peak of a step", "predicted": format_bytes(predicted.peak),
                     "measured": format_bytes(self.peak_bytes),
                     "measured / predicted": f"{self.peak_bytes / predicted.peak:.2f}" if on_gpu else "—"})
        return rows

    def check(self, predicted: Any, tolerance: float = 0.02) -> str:
        """On a GPU: the exact parts (weights, gradients, optimizer state) must equal the prediction within
        ``tolerance`` (the allocator rounds blocks up, by at most 1 MiB per tensor); returns the sentence that says
        so, with the worst part. On a CPU, where RSS measures the whole process, says what the numbers are instead.

        Raises:
            AssertionError: on a GPU, for an exact part further off than ``tolerance``.
        """
        if not self.device.startswith("cuda"):
            return ("On a CPU each reading is the process's resident set size: it rises when tensors touch new "
                    "pages, not when they are freed, and it counts the libraries' own buffers. So the parts are "
                    "rough, and no ratio to the prediction is drawn.")
        expected = dict(predicted.parts)
        off = {name: self.parts[name] / expected[name] - 1 for name in self.EXACT}
        for name, error in off.items():
            assert abs(error) <= tolerance, (f"{name}: {format_bytes(self.parts[name])} measured, "
                                             f"{format_bytes(expected[name])} predicted ({error:+.1%})")
        worst = max(off, key=lambda name: abs(off[name]))
        return (f"Weights, gradients and optimizer state: the allocator counts what the sizes predict, to within "
                f"{abs(off[worst]):.1%} ({worst}). It hands out whole blocks, rounded up.")


def measure_step_parts(new_model: Any, make_optimizer: Any, inputs: torch.Tensor, targets: torch.Tensor,
                       device: torch.device | str) -> StepParts:
    """Read a training step's memory between its phases, from a clean start:

    * on a GPU, the **cuBLAS workspace** first: a tiny matmul forward and backward (cuBLAS gives each thread that
      runs one a workspace, through PyTorch's allocator: yours, and the thread autograd runs backward on);
    * the **weights** as ``new_model()`` builds the model; the **activations** over the forward pass and the loss
      (``utils.train.lm_loss``); after backward, AdamW's **optimizer state** at its first ``step()`` (created
      lazily); the **gradients** freed by ``zero_grad(set_to_none=True)``;
    * the **peak** of a whole later step (``utils.train.train_step``) after one more complete step, so that
      one-time costs stay out; like :func:`check_steps`' peaks it counts from just before the model is built, so
      the cuBLAS workspace (a once-per-process cost, listed on its own) is not in it, and one baseline has one peak
      wherever it is printed; what the peak holds beyond weights, state and activations is the **transient at the
      peak** (above all the loss's backward);
    * on a GPU also the allocator's **cache** at the peak (``max_memory_reserved − max_memory_allocated``) and what
      lies **outside** it: ``mem_get_info``'s used memory − ``memory_reserved``, the CUDA context and the libraries'
      code — and any other process on the GPU, which this process cannot tell apart.

    On a CPU each reading is the process's RSS (:func:`memory_stats`): rough, and it does not fall when tensors are
    freed. The model and optimizer are released before returning.
    """
    from utils.train import lm_loss, train_step

    dev = get_device(device)
    on_gpu = dev.type == "cuda"

    def allocated() -> int:
        return memory_stats(dev).allocated_bytes

    release_memory(dev)
    start = allocated()
    parts: dict[str, int] = {}
    if on_gpu:  # this process's first matmuls, forward and backward, with a bias like the model's layers
        w = torch.ones(64, 64, device=dev, requires_grad=True)
        torch.nn.functional.linear(w, w, w[0]).sum().backward()
        del w
        parts["cuBLAS workspace"] = allocated() - start
    model = new_model()
    parts["weights"] = allocated() - start - parts.get("cuBLAS workspace", 0)
    optimizer = make_optimizer(model.parameters())
    before = allocated()
    loss = lm_loss(model(inputs), targets)
    parts["activations"] = allocated() - before
    loss.backward()
    del loss
    before = allocated()
    optimizer.step()
    parts["optimizer state"] = allocated() - before
    before = allocated()
    optimizer.zero_grad(set_to_none=True)
    parts["gradients"] = before - allocated()
    train_step(model, optimizer, inputs, targets)  # one complete step: one-time costs stay out of the peak
    optimizer.zero_grad(set_to_none=True)
    with track_peak(dev) as step:
        train_step(model, optimizer, inputs, targets)
    peak = max(0, step.peak_bytes - start - parts.get("cuBLAS workspace", 0))  # the step's own, as check_steps
    static = parts["weights"] + parts["optimizer state"]
    parts["transient at the peak"] = max(0, peak - static - parts["activations"])
    cache = outside = None
    if on_gpu:
        cache = torch.cuda.max_memory_reserved(dev) - step.peak_bytes
        free, total = torch.cuda.mem_get_info(dev)
        outside = (total - free) - torch.cuda.memory_reserved(dev)
    del model, optimizer
    release_memory(dev)
    return StepParts(str(dev), parts, peak, step.peak_bytes, cache, outside, step.what)


# ----------------------------------------------------------------------------------------------------
# Variants of a training step, each checked against the baseline's loss, gradients and update


@dataclass(frozen=True)
class StepCheck:
    """One variant's two steps against the baseline's, from the same weights on the same batch."""

    label: str
    losses: tuple[float, float]  # steps 1 and 2
    loss_errors: tuple[float, ...]  # relative difference from the baseline's loss, per step compared
    grad_errors: tuple[float, ...]  # relative difference (norm) from the baseline's gradients, per step compared
    update_error: float | None  # relative difference of the weights' change over both steps; None: not compared
    peak_bytes: int  # step 2's peak above what was allocated before the model was built (RSS: never below 0)
    checked: str  # what was compared, in words
    kind: str = "exact"  # "reference", "exact", "low precision" or "own update"


@dataclass(frozen=True)
class StepChecks:
    """Every variant's :class:`StepCheck` (:func:`check_steps`); the first is the baseline."""

    checks: dict[str, StepCheck]
    what: str  # what the peaks measure

    @property
    def baseline(self) -> str:
        return next(iter(self.checks))

    def peak(self, label: str) -> int:
        return self.checks[label].peak_bytes

    def rows(self) -> list[dict[str, object]]:
        base = self.checks[self.baseline].peak_bytes

        def err(x: float | None) -> str:
            return "—" if x is None else f"{x:.0e}"

        return [{"variant": c.label, "peak": format_bytes(c.peak_bytes),
                 "vs baseline": f"{c.peak_bytes / base:.0%}" if base else "—",
                 "loss, steps 1 → 2": f"{c.losses[0]:.4f} → {c.losses[1]:.4f}",
                 "loss diff.": " / ".join(err(e) for e in c.loss_errors),
                 "gradients diff.": " / ".join(err(e) for e in c.grad_errors), "update diff.": err(c.update_error),
                 "checked": c.checked} for c in self.checks.values()]

    def summary(self) -> str:
        """What was checked, from the checks themselves: how many variants of each kind, and what for each."""
        kinds: dict[str, list[StepCheck]] = {}
        for c in self.checks.values():
            kinds.setdefault(c.kind, []).append(c)
        said = {"exact": "the loss and gradients of both steps and the weights' change",
                "low precision": "the loss and gradients of both steps, within 16-bit rounding (not the change: "
                                 "rounding flips the sign of tiny gradients, and AdamW moves each weight by ± lr)",
                "own update": "the first step's loss and gradients (the update differs by design)"}
        parts = [f"{len(kinds[k])} × {what} ({', '.join(c.checked for c in kinds[k][:1])})"
                 for k, what in said.items() if k in kinds]
        n = sum(len(v) for k, v in kinds.items() if k != "reference")
        return (f"✅ {n} variants against the baseline, from its weights on its batch: " + "; ".join(parts)
                + ". The second step runs on the first update, so it checks the optimizer's path. Every variant's "
                "second loss is below its first: its update trains.")


def _relative(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """‖a − b‖ / ‖b‖ over lists of tensors (one synchronisation)."""
    diff = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x.float() - y) for x, y in zip(a, b,
                                                                                                      strict=True)]))
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(y) for y in b]))
    return (diff / norm.clamp_min(1e-30)).item()


def check_steps(
    variants: dict[str, tuple[Any, Any]],
    new_model: Any,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    device: torch.device | str,
    *,
    low_precision: tuple[str, ...] | list[str] = (),
    own_update: tuple[str, ...] | list[str] = (),
    tolerance: float = 1e-4,
    low_precision_tolerance: float = 0.05,
) -> StepChecks:
    """Run two steps of every variant from the same weights on the same batch, check each against the first (the
    baseline), and measure the peak of its second step.

    ``variants``: label → ``(make_optimizer, step)``, with ``step(model, optimizer, inputs, targets)`` one training
    step (``utils.train.train_step`` or a variant of it) and ``make_optimizer(params)``. For each, from a clean
    start: ``new_model()``, its optimizer, step 1, step 2 (under :func:`track_peak`: the peak above what was
    allocated before the model was built, with the optimizer's state present and whatever the first step left
    behind). Compared with the baseline's, relative differences:

    * the loss of both steps, and the gradients (norm of the difference over the norm; clipped, as the step leaves
      them) of both steps: step 2 runs on the weights step 1 updated, so it checks the variant's optimizer path;
    * the weights' change over the two steps;
    * within ``tolerance`` for the loss and the first gradients, 30 times that for what follows an update
      (AdamW's first steps move each weight by about ± lr whatever the gradient's size, so a rounding difference
      in a tiny gradient moves its weight by up to 2 lr: an H100 shows about 3e-4 on the fp32 variants, against
      1.0 for an update that did not happen); for ``low_precision`` variants (16-bit autocast) within
      ``low_precision_tolerance``, the update left out (the same sign flips, on many more gradients);
    * ``own_update`` variants (an optimizer that updates differently by design, e.g. Adafactor): the first step's
      loss and gradients only.

    Every variant's second loss must also be below its first: the update trains. The references (the initial
    weights, the baseline's gradients and update) stay on the device, allocated before each variant's model is
    built, so they are outside every measured peak; the baseline's first gradients wait on the host while its own
    second step is measured.

    Raises:
        AssertionError: naming the variant and the quantity that differs beyond its tolerance.
    """
    dev = get_device(device)
    first = new_model()  # the initial weights, kept on the device for the whole run: in every variant's baseline
    initial = [p.detach().float().clone() for p in first.parameters()]
    del first
    after_update = 30 * tolerance
    reference: dict[str, Any] = {}
    checks: dict[str, StepCheck] = {}
    what = ""
    for label, (make_optimizer, step) in variants.items():
        low, own = label in low_precision, label in own_update
        limits = [low_precision_tolerance] * 2 if low else [tolerance, after_update]
        release_memory(dev)
        base_level = memory_stats(dev).allocated_bytes
        model = new_model()
        optimizer = make_optimizer(model.parameters())
        losses = [float(step(model, optimizer, inputs, targets))]
        grads = [p.grad for p in model.parameters()]
        if not reference:  # the baseline's: on the host while its second step is measured
            reference = {"losses": losses, "grads": [[g.detach().float().cpu() for g in grads]]}
            grad_errors = [0.0]
        else:
            grad_errors = [_relative(grads, reference["grads"][0])]
        del grads
        with track_peak(dev) as mem:
            losses.append(float(step(model, optimizer, inputs, targets)))
        what = mem.what
        grads = [p.grad.detach().float() for p in model.parameters()]
        update = [p.detach().float() - w for p, w in zip(model.parameters(), initial, strict=True)]
        if len(reference["grads"]) == 1:
            reference["grads"] = [[g.to(dev) for g in reference["grads"][0]], [g.clone() for g in grads]]
            reference["update"] = update
        grad_errors.append(_relative(grads, reference["grads"][1]))
        update_error = None if (own or low) else _relative(update, reference["update"])
        del model, optimizer, grads, update
        loss_errors = [abs(a - b) / abs(b) for a, b in zip(losses, reference["losses"], strict=True)]
        n = 1 if own else 2
        for i in range(n):
            assert loss_errors[i] <= limits[i], (f"{label}: step {i + 1}'s loss is {loss_errors[i]:.1e} off "
                                                 f"(> {limits[i]:.0e})")
            assert grad_errors[i] <= limits[i], (f"{label}: step {i + 1}'s gradients are {grad_errors[i]:.1e} off "
                                                 f"(> {limits[i]:.0e})")
        if update_error is not None:
            assert update_error <= after_update, (f"{label}: its update is {update_error:.1e} off "
                                                  f"(> {after_update:.0e})")
        assert losses[1] < losses[0], f"{label}: the loss did not fall after its update ({losses[0]} → {losses[1]})"
        if not checks:
            kind, checked = "reference", "the reference"
        elif own:
            kind, checked = "own update", f"step 1 within {tolerance:.0e}; the loss falls"
        elif low:
            kind, checked = "low precision", f"steps 1–2 within {low_precision_tolerance:.0%}"
        else:
            kind, checked = "exact", f"step 1 {tolerance:.0e}, then {after_update:.0e}"
        checks[label] = StepCheck(label, (losses[0], losses[1]), tuple(loss_errors[:n]), tuple(grad_errors[:n]),
                                  update_error, max(0, mem.peak_bytes - base_level), checked, kind)
    del reference, initial
    release_memory(dev)
    return StepChecks(checks, what)


# ----------------------------------------------------------------------------------------------------
# Inference: what a forward pass holds under each gradient mode


@dataclass(frozen=True)
class ForwardMemory:
    """What :func:`forward_memory` measured: per mode, the peak and what stays held while the output lives
    (bytes), and ``calls``: one forward pass under that mode, to time."""

    peaks: dict[str, int]
    held: dict[str, int]
    calls: dict[str, Any]
    what: str

    def rows(self) -> list[dict[str, object]]:
        return [{"mode": label, "peak above the start": format_bytes(self.peaks[label]),
                 "held while the output lives": format_bytes(self.held[label])} for label in self.peaks]


def forward_memory(model: torch.nn.Module, inputs: torch.Tensor, modes: dict[str, Any],
                   device: torch.device | str) -> ForwardMemory:
    """One forward pass of ``model(inputs)`` under each mode (label → a context manager factory such as
    ``torch.no_grad``): the peak above the start and what stays allocated while the output lives. Every output is
    checked against the first (``assert_close``, 1e-3): a mode changes what is kept, not what is computed.

    Raises:
        AssertionError: when an output differs from the first mode's.
    """
    dev = get_device(device)

    def call(mode: Any) -> Any:
        def forward() -> torch.Tensor:
            with mode():
                return model(inputs)
        return forward

    calls = {label: call(mode) for label, mode in modes.items()}
    peaks, held, reference, what = {}, {}, None, ""
    for label, forward in calls.items():
        release_memory(dev)
        before = memory_stats(dev).allocated_bytes
        with track_peak(dev) as mem:
            out = forward()
            held[label] = memory_stats(dev).allocated_bytes - before
        peaks[label], what = mem.peak_bytes - before, mem.what
        reference = out.detach() if reference is None else reference
        torch.testing.assert_close(out.detach(), reference, rtol=1e-3, atol=1e-3,
                                   msg=lambda m, label=label: f"{label}: the output differs: {m}")
        del out
    return ForwardMemory(peaks, held, calls, what)


def optimizer_memory(new_model: Any, optimizers: dict[str, Any], inputs: torch.Tensor, targets: torch.Tensor,
                     device: torch.device | str) -> list[dict[str, object]]:
    """Per optimizer (label → ``make_optimizer(params)``), on a fresh model after one training step: the bytes of
    its state (every tensor it keeps per parameter, step counters left out) and the temporaries of one ``step()``
    with gradients present (:func:`track_peak` around it). The default multi-tensor ("foreach") AdamW computes on
    whole lists of tensors and allocates temporaries as large as the parameters; the fused one updates in place;
    Adafactor keeps a row and a column per matrix. Table rows."""
    from utils.train import lm_loss, train_step

    dev = get_device(device)
    rows = []
    for label, make in optimizers.items():
        release_memory(dev)
        model = new_model()
        optimizer = make(model.parameters())
        train_step(model, optimizer, inputs, targets)  # creates the state
        lm_loss(model(inputs), targets).backward()
        with track_peak(dev) as mem:
            optimizer.step()
        state = sum(t.nbytes for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())
        rows.append({"optimizer": label, "state": format_bytes(state),
                     "step()'s temporaries": format_bytes(mem.peak_increase_bytes)
                     + ("" if dev.type == "cuda" else " (RSS)")})
        del model, optimizer
    release_memory(dev)
    return rows
