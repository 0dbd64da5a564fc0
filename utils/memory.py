"""How much memory your tensors take, and when: allocated / reserved / peak reports, a block that measures its
own peak, CUDA memory snapshots with an inline timeline plot, and what autograd keeps for backward, tensor by
tensor (:func:`saved_tensors_by_op`).

On CUDA every number comes from PyTorch's caching allocator: *allocated* is what live tensors occupy,
*reserved* is what the allocator holds from the driver (allocated plus its cache), and neither counts the CUDA
context or other processes, so ``nvidia-smi`` shows more. On CPU there is no allocator to ask: the numbers are
the process's resident set size (RSS) from the kernel, which counts everything the process holds (Python,
libraries, caches), not only tensors. Every result carries a ``what`` sentence saying which of these it is.

The snapshot helpers split the CUDA calls (:func:`record_memory_history`) from the pure functions that read a
snapshot dict (:func:`memory_timeline`, :func:`plot_memory_timeline`), so the latter work anywhere.
"""

from __future__ import annotations

import pickle
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from utils.env import get_device

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_PROC_STATUS = Path("/proc/self/status")
_PROC_CLEAR_REFS = Path("/proc/self/clear_refs")

# A block's "state" in a snapshot's segments while the allocator still counts it as allocated. The C++
# binding writes "active_pending_free" (torch/csrc/cuda/Module.cpp); _snapshot()'s docstring says
# "active_awaiting_free": accept both.
_LIVE_BLOCK_STATES = ("active_allocated", "active_pending_free", "active_awaiting_free")


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
# Memory snapshots (CUDA)


@dataclass
class MemoryHistory:
    """What :func:`record_memory_history` recorded; ``snapshot`` is filled when the ``with`` block ends.

    ``snapshot`` is the dict of ``torch.cuda.memory._snapshot()``: ``segments`` (the allocator's memory now)
    and ``device_traces`` (one list of alloc/free events per device; ``device_traces[device_index]`` is ours).
    """

    device: str
    device_index: int
    snapshot: dict[str, Any] | None = None


@contextmanager
def record_memory_history(
    device: torch.device | str, *, max_entries: int = 100_000
) -> Iterator[MemoryHistory]:
    """Record every CUDA allocation and free inside a ``with`` block, with the Python stack that made it::

        with record_memory_history(device) as history:
            train_step()
        plot_memory_timeline(history.snapshot)
        save_snapshot(history.snapshot, "step.pickle")  # then open it at https://pytorch.org/memory_viz

    Uses ``torch.cuda.memory._record_memory_history(enabled="all", stacks="python", max_entries=...)`` at the
    start (Python frames only: symbolizing C++ frames can make the snapshot take minutes) and, at the end,
    ``torch.cuda.memory._snapshot()`` then ``_record_memory_history(enabled=None)``, which stops recording and
    clears the recorded events. Only the last ``max_entries`` events are kept (each costs a few KB of host
    memory). The snapshot is taken even if the block raises, so an out-of-memory error can be examined.
    These are PyTorch's underscore (semi-private) APIs, the ones its own memory-snapshot guide uses.

    On CPU raises RuntimeError: there is no caching allocator to record; use :func:`track_peak`.
    """
    dev = get_device(device)
    if dev.type != "cuda":
        raise RuntimeError(
            "memory history recording needs a CUDA device; on CPU use track_peak, which measures RSS"
        )
    history = MemoryHistory(device=str(dev), device_index=dev.index)
    torch.cuda.memory._record_memory_history(enabled="all", stacks="python", max_entries=max_entries)
    try:
        yield history
    finally:
        try:
            history.snapshot = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)


def _trace_for(snapshot: dict[str, Any], device_index: int | None) -> tuple[int, list[dict[str, Any]]]:
    """(device index, trace) of the device asked for, or of the only device whose trace has events."""
    traces = snapshot.get("device_traces")
    if traces is None:
        raise ValueError("not a memory snapshot: it has no 'device_traces' (see torch.cuda.memory._snapshot)")
    if device_index is not None:
        if not 0 <= device_index < len(traces):
            raise ValueError(f"device_index {device_index} out of range: {len(traces)} device trace(s)")
        return device_index, traces[device_index]
    with_events = [i for i, trace in enumerate(traces) if trace]
    if len(with_events) > 1:
        raise ValueError(f"the snapshot has events on devices {with_events}: pass device_index=")
    index = with_events[0] if with_events else 0
    return index, traces[index] if traces else []


def memory_timeline(
    snapshot: dict[str, Any], *, device_index: int | None = None
) -> tuple[list[int], list[int]]:
    """Bytes allocated by live tensors after each allocation and free in a snapshot's trace.

    Reads ``snapshot["device_traces"][device_index]`` (by default the only device with events): an ``alloc``
    adds its ``size``, a ``free_completed`` subtracts it (a ``free_requested`` is not free yet: another stream
    may still be using the memory), and other actions (``segment_alloc``, ``segment_free``, ``snapshot``,
    ``oom``, ...) are not tensor allocations and are skipped. Returns ``(event_indices, live_bytes)``: the
    position of each counted event in that trace, and the bytes live just after it.

    Tensors allocated before recording started do not appear in the trace. When the snapshot has
    ``segments`` (real ones do), their live blocks give the bytes allocated when the snapshot was taken, from
    which the level before the first event follows, so the series is absolute; without ``segments`` (e.g. a
    hand-made dict) it starts from 0, i.e. it counts only what was allocated since recording started. Sizes
    are the sizes requested, as in the trace; ``memory_allocated()`` counts them rounded up (to at least a
    multiple of 512 bytes), so it reads a little higher.
    """
    index, trace = _trace_for(snapshot, device_index)
    event_indices: list[int] = []
    changes: list[int] = []
    for i, event in enumerate(trace):
        if event["action"] == "alloc":
            change = event["size"]
        elif event["action"] == "free_completed":
            change = -event["size"]
        else:
            continue
        event_indices.append(i)
        changes.append(change)

    baseline = 0
    if "segments" in snapshot:
        live_at_snapshot = sum(
            block.get("requested_size", block["size"])
            for segment in snapshot["segments"]
            if segment.get("device", index) == index
            for block in segment["blocks"]
            if block["state"] in _LIVE_BLOCK_STATES
        )
        baseline = live_at_snapshot - sum(changes)

    live_bytes: list[int] = []
    level = baseline
    for change in changes:
        level += change
        live_bytes.append(level)
    return event_indices, live_bytes


def plot_memory_timeline(
    snapshot: dict[str, Any], *, title: str = "Memory allocated over time", device_index: int | None = None
) -> Figure:
    """A step plot of the bytes live tensors occupy after each allocation/free event, with the peak marked.

    The series comes from :func:`memory_timeline`; the y axis is in GiB, or MiB when the peak is under 1 GiB.
    Returns a closed matplotlib Figure: make it a cell's last expression to show it once; ``fig.savefig``
    works. ``device_index`` is passed on to :func:`memory_timeline`.
    """
    import matplotlib.pyplot as plt

    events, live_bytes = memory_timeline(snapshot, device_index=device_index)
    peak = max(live_bytes, default=0)
    unit, scale = ("GiB", 2**30) if peak >= 2**30 else ("MiB", 2**20)

    fig, ax = plt.subplots(figsize=(8, 4))
    if events:
        ax.step(events, [b / scale for b in live_bytes], where="post", color="#4C72B0", linewidth=1.5)
        at = live_bytes.index(peak)
        ax.plot(events[at], peak / scale, "o", color="#C44E52")
        right_half = events[at] > (events[0] + events[-1]) / 2  # put the label on the side with room
        ax.annotate(f"peak {format_bytes(peak)}", (events[at], peak / scale),
                    xytext=(-6 if right_half else 6, 4), textcoords="offset points",
                    ha="right" if right_half else "left", color="#C44E52", fontsize=9)
        ax.set_ylim(bottom=min(0.0, min(live_bytes) / scale), top=peak / scale * 1.12 or 1.0)
    else:
        ax.text(0.5, 0.5, "no allocations or frees were recorded", transform=ax.transAxes, ha="center")
    ax.set_xlabel("event number in the allocator's trace (allocations and frees)")
    ax.set_ylabel(f"allocated by live tensors ({unit})")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    plt.close(fig)
    return fig


def save_snapshot(snapshot: dict[str, Any], path: str | Path) -> Path:
    """Pickle a snapshot to ``path`` (what ``torch.cuda.memory._dump_snapshot`` writes) and return the path.

    Drag the file onto https://pytorch.org/memory_viz to explore it: every allocation over time, with the
    Python stack that made it (the "Active Memory Timeline" view is the detailed version of
    :func:`plot_memory_timeline`). Only unpickle snapshot files you trust: a pickle can run code when loaded.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        pickle.dump(snapshot, f)
    return path


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
