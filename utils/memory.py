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
