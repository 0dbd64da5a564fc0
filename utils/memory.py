"""How much memory your tensors take, and when: allocated / reserved / peak reports, a block that measures its
own peak, CUDA memory snapshots with an inline timeline plot, and what autograd keeps for backward, tensor by
tensor (:func:`saved_tensors_by_op`).

On CUDA every number comes from PyTorch's caching allocator: *allocated* is what live tensors occupy,
*reserved* is what the allocator holds from the driver (allocated plus its cache), and neither counts the CUDA
context or other processes, so ``nvidia-smi`` shows more. On CPU there is no allocator to ask: the numbers are
the process's resident set size (RSS) from the kernel, which counts everything the process holds (Python,
libraries, caches), not only tensors. Every result carries a ``what`` sentence saying which of these it is.

The snapshot helpers split the CUDA calls (:func:`record_memory_history`) from the pure functions that read a
snapshot dict (:func:`memory_timeline`, :func:`plot_memory_timeline`, :func:`peak_breakdown`,
:func:`segment_summary`), so the latter work anywhere.

For fitting more into memory (notebook 05 and later): a calculator that predicts a training step's memory from
sizes (:func:`predict_training_memory`, :func:`transformer_activations`, :func:`optimizer_state_bytes`); memory
over one step read at module boundaries (:func:`trace_step_memory`); activation checkpointing, full or selective,
with what backward recomputes counted (:class:`ActivationCheckpointing`, :class:`OpCounter`); out-of-memory
errors caught and released (:func:`try_step`) and the largest batch that fits found by bisection
(:func:`largest_batch`, :func:`fits_in_memory`); the allocator's fragmentation (:func:`fragmentation_demo`) and
which environment variable configures it, measured in a child process (:func:`allocator_probe`).
"""

from __future__ import annotations

import math
import pickle
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


# ----------------------------------------------------------------------------------------------------
# Predicting a training step's memory from sizes

#: What each optimizer :func:`optimizer_state_bytes` knows keeps, per parameter.
OPTIMIZER_STATE = {
    "sgd": "nothing (plain SGD)",
    "sgd_momentum": "one momentum buffer per value",
    "adam": "two moment estimates per value (exp_avg, exp_avg_sq)",
    "adamw": "two moment estimates per value (exp_avg, exp_avg_sq)",
    "adafactor": "a factored second moment: one value per row and per column of a matrix, one per value of a "
                 "vector; no momentum",
}
_STATE_VALUES_PER_VALUE = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2}

#: Parameters as :func:`optimizer_state_bytes` and :func:`predict_training_memory` take them: a model, tensors or
#: shapes, or just their number (not enough for Adafactor, whose state depends on the shapes).
Params = int | torch.nn.Module | Iterable[torch.Tensor | Sequence[int]]


def _param_shapes(params: Params) -> list[tuple[int, ...]] | None:
    """The shapes of trainable parameters, or None when only their number was given."""
    if isinstance(params, (bool, float)):
        raise TypeError(f"params must be a model, tensors, shapes or a number of values, got {params!r}")
    if isinstance(params, int):
        if params < 0:
            raise ValueError(f"a number of parameters cannot be negative, got {params}")
        return None
    if isinstance(params, torch.nn.Module):
        params = [p for p in params.parameters() if p.requires_grad]
    return [tuple(p.shape) if isinstance(p, torch.Tensor) else tuple(int(d) for d in p) for p in params]


def _param_count(params: Params) -> int:
    shapes = _param_shapes(params)
    return params if shapes is None else sum(math.prod(s) for s in shapes)  # type: ignore[return-value]


def optimizer_state_bytes(params: Params, optimizer: str = "adamw", *, bytes_per_value: int = 4) -> int:
    """Bytes of optimizer state for ``params`` (see :data:`OPTIMIZER_STATE`), at ``bytes_per_value`` per value.

    The state has the parameters' dtype (4 bytes for fp32). Step counters (one scalar per parameter tensor) are
    left out. ``adafactor`` needs the shapes (a model, tensors or shapes): for a matrix of r rows and c columns it
    keeps r + c values (``torch.optim.Adafactor``'s ``row_var`` and ``col_var``), for a vector one per value.

    Raises:
        ValueError: for an optimizer not in :data:`OPTIMIZER_STATE`, or ``adafactor`` given only a count.
    """
    if optimizer not in OPTIMIZER_STATE:
        raise ValueError(f"unknown optimizer {optimizer!r}: choose one of {sorted(OPTIMIZER_STATE)}")
    if optimizer != "adafactor":
        return _STATE_VALUES_PER_VALUE[optimizer] * _param_count(params) * bytes_per_value
    shapes = _param_shapes(params)
    if shapes is None:
        raise ValueError("adafactor's state depends on the parameters' shapes: pass the model, its parameters or "
                         "their shapes, not a count")
    values = 0
    for shape in shapes:
        if len(shape) >= 2:  # row_var: shape with the last dim 1; col_var: shape with the second-to-last dim 1
            values += math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]
        else:
            values += math.prod(shape)
    return values * bytes_per_value


@dataclass(frozen=True)
class ActivationEstimate:
    """What a forward pass keeps for backward (``saved``) and the short-lived buffers at the peak
    (``transient``), in bytes, each by what holds it. Build it with :func:`transformer_activations`."""

    saved: dict[str, int]
    transient: dict[str, int]

    @property
    def saved_bytes(self) -> int:
        return sum(self.saved.values())

    @property
    def transient_bytes(self) -> int:
        """The largest of the transient buffers: they live at different moments, so only one counts at the peak."""
        return max(self.transient.values(), default=0)


def transformer_activations(
    config: Any,
    batch: int,
    seq: int,
    *,
    amp: bool = False,
    checkpointing: str = "none",
    chunked_loss: bool = False,
    chunk_tokens: int = 2048,
    device_type: str = "cuda",
) -> ActivationEstimate:
    """Estimate the activation memory of one training step of ``utils.models.TransformerModel``.

    ``config`` is a ``TransformerConfig`` (anything with ``vocab_size``, ``d_model``, ``nhead``, ``num_layers``,
    ``dim_feedforward`` and ``dropout``). N = batch × seq tokens, D = d_model, F = dim_feedforward; matmul inputs
    and outputs take s = 4 bytes per value, 2 under 16-bit autocast (``amp=True``); the residual stream and the
    layer norms' inputs stay fp32 either way. Each post-norm ``TransformerEncoderLayer`` keeps, per token:

    * the in-projection's input, the attention's q, k, v and output (which is the out-projection's input), and
      the first linear layer's input: 6·D·s; the ReLU's output (the second linear layer's input): F·s;
    * the two layer norms' fp32 inputs, 8·D, and their mean and inverse deviation, 16; the attention's
      log-sum-exp, 4 per head.

    With dropout (``config.dropout > 0``) add its masks (one byte per value on a GPU: 2·D + F) and the second
    linear layer's separate input (F·s). This matches, to the byte, what autograd keeps with FlashAttention-style
    attention (FlashAttention, cuDNN, CPU flash); the memory-efficient kernel in fp32 keeps one more N·D copy per
    layer, and the math fallback (old GPUs, CPU with dropout) keeps the [seq × seq] attention matrix as well.

    ``checkpointing="full"`` (each layer under ``torch.utils.checkpoint``) keeps only each layer's fp32 input;
    backward recomputes one layer at a time (a transient of one layer's activations). ``"selective"`` keeps the
    layer inputs and the outputs of its four matmuls, 5·D·s + F·s per token, and recomputes the rest. Under
    autocast without checkpointing, the 16-bit copies of the matmul weights are kept too.

    The loss: the plain one keeps the fp32 log-probabilities, N·V·4 bytes (plus the 16-bit logits under CUDA
    autocast), and its backward briefly adds the fp32 gradients of log-probabilities and logits, N·V·8 (N·V·4
    under autocast); the chunked one (``utils.train.chunked_lm_loss``) keeps the gradients it computed in the
    forward pass, of the features (N·D·4) and of the head (V·D·4), and holds one chunk's logits at a time.

    Raises:
        ValueError: for a checkpointing mode other than "none", "full" or "selective", or non-positive sizes.
    """
    if checkpointing not in ("none", "full", "selective"):
        raise ValueError(f"checkpointing must be 'none', 'full' or 'selective', got {checkpointing!r}")
    if batch <= 0 or seq <= 0 or chunk_tokens <= 0:
        raise ValueError(f"batch, seq and chunk_tokens must be positive, got {batch}, {seq}, {chunk_tokens}")
    n, d, f, h = batch * seq, config.d_model, config.dim_feedforward, config.nhead
    v, layers, s = config.vocab_size, config.num_layers, 2 if amp else 4
    per_layer = n * (s * (6 * d + f) + 8 * d + 16 + 4 * h)
    if config.dropout > 0:
        per_layer += n * (s * f + 2 * d + f)
    layer_input = n * d * 4
    matmul_outputs = n * s * (5 * d + f)
    matmul_weights = layers * (4 * d * d + 2 * d * f)

    saved: dict[str, int] = {"embedding (token ids)": n * 8}
    transient: dict[str, int] = {}
    if checkpointing == "none":
        saved["layers"] = layers * per_layer
        if amp:
            saved["16-bit weight copies (autocast)"] = matmul_weights * 2
    else:
        kept = layer_input + (matmul_outputs if checkpointing == "selective" else 0)
        saved["layers (checkpointed)"] = layers * kept
        transient["one layer recomputed in backward"] = per_layer
    if chunked_loss:
        saved["chunked loss: gradients of features and head"] = n * d * 4 + (v * d + v) * 4
        chunk = min(chunk_tokens, n)
        transient["chunked loss: one chunk's logits"] = chunk * v * (2 * s + 4) + (v * d * s if amp else 0)
    else:
        saved["head input"] = n * d * s
        saved["loss: log-probabilities"] = n * v * 4 + (n * v * s if amp and device_type == "cuda" else 0) + n * 8
        if amp:
            saved["16-bit weight copies (autocast)"] = saved.get("16-bit weight copies (autocast)", 0) + v * d * 2
        transient["loss backward: gradients of log-probabilities and logits"] = n * v * (4 if amp else 8)
    return ActivationEstimate(saved, transient)


@dataclass(frozen=True)
class MemoryPrediction:
    """A training step's memory predicted from sizes, in bytes. Build it with :func:`predict_training_memory`.

    The parts do not all live at once: with ``zero_grad(set_to_none=True)`` the gradients appear during backward
    while the activations are freed, so :attr:`peak` (what the step needs at its worst moment) is below
    :attr:`sum_of_parts`.
    """

    weights: int
    gradients: int
    optimizer_state: int
    activations: int
    transient: int
    gradients_live_in_forward: bool = False  # zero_grad(set_to_none=False) keeps them allocated

    @property
    def parts(self) -> dict[str, int]:
        return {"weights": self.weights, "gradients": self.gradients, "optimizer state": self.optimizer_state,
                "activations": self.activations, "transient at the peak": self.transient}

    @property
    def static(self) -> int:
        """Weights, gradients and optimizer state: what stays between steps."""
        return self.weights + self.gradients + self.optimizer_state

    @property
    def sum_of_parts(self) -> int:
        return sum(self.parts.values())

    @property
    def peak(self) -> int:
        """The larger of: the end of the forward pass and the start of backward (weights, optimizer state,
        activations, the transient buffers, and the gradients only if they are kept through forward); the end of
        backward (weights, optimizer state and all gradients)."""
        forward = self.weights + self.optimizer_state + self.activations + self.transient
        if self.gradients_live_in_forward:
            forward += self.gradients
        return max(forward, self.static)

    def __str__(self) -> str:
        lines = [f"{name:22} {format_bytes(nbytes):>12}" for name, nbytes in self.parts.items()]
        lines.append(f"{'predicted peak':22} {format_bytes(self.peak):>12} (sum of the parts "
                     f"{format_bytes(self.sum_of_parts)})")
        return "\n".join(lines)


def predict_training_memory(
    params: Params,
    *,
    optimizer: str = "adamw",
    bytes_per_value: int = 4,
    activations: ActivationEstimate | int = 0,
    transient: int = 0,
    set_to_none: bool = True,
) -> MemoryPrediction:
    """Predict a training step's memory from the parameters, the optimizer and an activation estimate.

    Weights and gradients take ``bytes_per_value`` per parameter value (4: fp32; autocast keeps both fp32), the
    optimizer's state as :func:`optimizer_state_bytes` says; ``activations`` is a byte count or an
    :class:`ActivationEstimate` (whose transient buffers are added to ``transient``). ``set_to_none=False``
    (``zero_grad`` writing zeros) keeps the gradients allocated through the forward pass.

    The calculator behind the notebook's stacked bars: ``predict_training_memory(model, optimizer="adamw",
    activations=transformer_activations(config, 32, 256)).peak``.
    """
    if isinstance(activations, ActivationEstimate):
        transient += activations.transient_bytes
        activations = activations.saved_bytes
    if activations < 0 or transient < 0 or bytes_per_value <= 0:
        raise ValueError("activations and transient must be >= 0 and bytes_per_value > 0")
    values = _param_count(params)
    return MemoryPrediction(weights=values * bytes_per_value, gradients=values * bytes_per_value,
                            optimizer_state=optimizer_state_bytes(params, optimizer, bytes_per_value=bytes_per_value),
                            activations=int(activations), transient=int(transient),
                            gradients_live_in_forward=not set_to_none)


def plot_stacked_memory(bars: dict[str, dict[str, int]], *, title: str,
                        peaks: dict[str, int] | None = None) -> Figure:
    """One stacked bar per entry of ``bars`` (bar label → {part: bytes}); a part has the same colour in every
    bar, and a part missing from a bar counts as 0. ``peaks`` (bar label → bytes) draws each bar's peak as a
    black line across it: the parts of a training step do not all live at once, so the peak can lie below the
    top of the stack. Returns a closed Figure."""
    import matplotlib.pyplot as plt

    parts = list(dict.fromkeys(part for stack in bars.values() for part in stack))
    totals = [sum(max(0, v) for v in stack.values()) for stack in bars.values()]
    top = max([*totals, *(peaks or {}).values(), 1])
    unit, scale = ("GiB", 2**30) if top >= 2**30 else ("MiB", 2**20)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = list(bars)
    bottoms = [0.0] * len(labels)
    for i, part in enumerate(parts):
        heights = [max(0, bars[label].get(part, 0)) / scale for label in labels]
        ax.bar(labels, heights, bottom=bottoms, color=plt.get_cmap("tab10")(i % 10), label=part, width=0.55)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    for i, label in enumerate(labels):
        if peaks and label in peaks:
            ax.hlines(peaks[label] / scale, i - 0.36, i + 0.36, color="black", linewidth=2.2)
            ax.annotate(f"peak {format_bytes(peaks[label])}", (i + 0.38, peaks[label] / scale), va="center",
                        fontsize=8)
    ax.set_ylabel(f"memory ({unit})")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.set_xlim(-0.6, len(labels) - 0.1)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    plt.close(fig)
    return fig


# ----------------------------------------------------------------------------------------------------
# Out of memory: catch it, release, carry on; the largest batch that fits


#: What the message of a RuntimeError that means "out of memory" contains, besides torch.OutOfMemoryError: the CPU
#: allocator's refusal, a CUDA call that failed for memory outside PyTorch's allocator (``CUDA error: out of
#: memory``, e.g. loading a kernel's code on first use when the allocator has taken the whole GPU), and cuBLAS
#: failing to allocate its own memory.
_OUT_OF_MEMORY_MESSAGES = ("can't allocate memory", "CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED")


def is_out_of_memory(err: BaseException) -> bool:
    """True for ``torch.OutOfMemoryError`` (PyTorch's CUDA allocator could not serve a request) and for the
    RuntimeErrors that mean the same from elsewhere: the CPU allocator's "can't allocate memory" (a request the
    operating system refused), ``CUDA error: out of memory`` (a CUDA call, such as loading a kernel's code on its
    first use, found no memory left outside the allocator: recoverable, unlike most CUDA errors) and cuBLAS's
    ``CUBLAS_STATUS_ALLOC_FAILED``."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and any(m in str(err) for m in _OUT_OF_MEMORY_MESSAGES)


@dataclass(frozen=True)
class StepOutcome:
    """What :func:`try_step` saw: whether the step ran, and the memory before, during and after the error."""

    ok: bool
    error: str | None = None  # the first line of the out-of-memory message
    before_bytes: int = 0  # allocated before the step (CUDA: memory_allocated; CPU: RSS)
    held_bytes: int = 0  # allocated while the error was being handled: what the failed step still held
    after_bytes: int = 0  # allocated after releasing


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


def try_step(fn: Callable[[], object], device: torch.device | str, *, release: Sequence[Any] = ()) -> StepOutcome:
    """Run ``fn()``; if it runs out of memory, release what it held and return instead of raising.

    Inside the ``except`` block the exception's traceback still references the failed call's frames, and with
    them every tensor they created: that is what ``held_bytes`` measures. Once the block is left they go; then
    :func:`release_memory` drops the gradients of ``release`` (models or optimizers), collects garbage and empties
    the cache. Errors other than running out of memory propagate unchanged.
    """
    dev = get_device(device)

    def allocated() -> int:
        return torch.cuda.memory_allocated(dev) if dev.type == "cuda" else _cpu_rss_now()[0]

    before = allocated()
    message, held = None, 0
    try:
        fn()
    except (torch.OutOfMemoryError, RuntimeError) as err:
        if not is_out_of_memory(err):
            raise
        message, held = (str(err).strip().splitlines() or ["out of memory"])[0], allocated()
    if message is None:
        return StepOutcome(ok=True, before_bytes=before, after_bytes=allocated())
    release_memory(dev, *release)
    return StepOutcome(ok=False, error=message, before_bytes=before, held_bytes=held, after_bytes=allocated())


def fits_in_memory(run: Callable[[int], object], device: torch.device | str, *,
                   release: Sequence[Any] = ()) -> Callable[[int], bool]:
    """``fits(batch)``: True if ``run(batch)`` finished, False if it ran out of memory (released by
    :func:`try_step`, so the next attempt starts clean). For :func:`largest_batch`."""
    def fits(batch: int) -> bool:
        outcome = try_step(lambda: run(batch), device, release=release)
        if outcome.ok:
            release_memory(device, *release)  # the next, larger attempt starts from the same state
        return outcome.ok

    return fits


@dataclass(frozen=True)
class BatchSearch:
    """What :func:`largest_batch` found: the largest batch that fitted, and every batch it tried, in order."""

    largest: int  # 0 if not even 1 fits
    tried: tuple[tuple[int, bool], ...]
    limit: int

    @property
    def limit_reached(self) -> bool:
        """True when the limit itself fitted: the true largest batch may be larger."""
        return self.largest == self.limit

    def __str__(self) -> str:
        steps = ", ".join(f"{b}{'✓' if ok else '✗'}" for b, ok in self.tried)
        bound = " (the limit: larger ones were not tried)" if self.limit_reached else ""
        return f"largest batch {self.largest:,}{bound} after {len(self.tried)} tries: {steps}"


def largest_batch(fits: Callable[[int], bool], *, start: int = 1, limit: int = 1 << 16,
                  resolution: float = 0.0) -> BatchSearch:
    """The largest batch ``b`` in [1, ``limit``] with ``fits(b)``, assuming that a batch fits if a larger one does.

    Doubles from ``start`` until a batch fails (or ``limit`` is reached), then bisects between the last batch
    that fitted and the first that failed: about 2·log₂(answer) calls. With ``resolution`` > 0 it stops once the
    gap is at most that fraction of the batch that fitted (0.05: within 5%), saving the last few, largest tries.
    Wrap a training step with :func:`fits_in_memory` to search on a real GPU.

    Raises:
        ValueError: for ``start`` outside [1, limit] or a negative resolution.
    """
    if not 1 <= start <= limit:
        raise ValueError(f"need 1 <= start <= limit, got start={start}, limit={limit}")
    if resolution < 0:
        raise ValueError(f"resolution must be >= 0, got {resolution}")
    tried: list[tuple[int, bool]] = []

    def attempt(batch: int) -> bool:
        ok = bool(fits(batch))
        tried.append((batch, ok))
        return ok

    good, bad = 0, None
    batch = start
    while True:  # grow: start, 2·start, 4·start, ... until a failure or the limit
        if attempt(batch):
            good = batch
            if batch == limit:
                return BatchSearch(good, tuple(tried), limit)
            batch = min(2 * batch, limit)
        else:
            bad = batch
            break
    while bad - good > max(1, resolution * good):  # bisect (good fits, bad does not)
        middle = (good + bad) // 2
        if attempt(middle):
            good = middle
        else:
            bad = middle
    return BatchSearch(good, tuple(tried), limit)


# ----------------------------------------------------------------------------------------------------
# Activation checkpointing, selective, with what backward recomputes counted

#: ATen matrix multiplies: the ops a "keep the matmuls" selective-checkpointing policy names.
MATMUL_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_scaled_mm"})


def op_name(op: Any) -> str:
    """'aten.addmm.default' for an OpOverload, 'aten.addmm' for an OpOverloadPacket, else str()."""
    name = getattr(op, "_name", None) or str(op)  # OpOverloadPacket._name: 'aten::addmm'
    overload = getattr(op, "_overloadname", None)
    name = name.replace("::", ".")
    return f"{name}.{overload}" if overload and not name.endswith(f".{overload}") else name


def _is_view(op: Any) -> bool:
    return bool(getattr(op, "is_view", False))


def is_matmul(op: Any) -> bool:
    """True for an ATen matrix multiply (an overload of one of :data:`MATMUL_OPS`)."""
    packet = getattr(op, "overloadpacket", op)
    return getattr(packet, "__name__", "").split(".")[-1] in MATMUL_OPS


class OpCounter(TorchDispatchMode):
    """Count the ATen operators that run inside a ``with`` block, by overload (``aten.addmm.default``)::

        with utils.memory.OpCounter() as ops:
            model(x)
        ops.matmuls()   # {aten.addmm.default: 7, aten.mm.default: 2}

    A ``TorchDispatchMode``: it sees the operators as PyTorch dispatches them, after composite ones such as
    ``linear`` have been decomposed — which is what a selective-checkpointing policy sees too.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))

    def matmuls(self) -> dict[Any, int]:
        return {op: n for op, n in self.counts.items() if is_matmul(op)}

    def compute_ops(self) -> Counter:
        """The counts without view and aliasing operators (views, detach, ...), which move no data."""
        return Counter({op: n for op, n in self.counts.items() if not _is_view(op)})


class ActivationCheckpointing:
    """Run ``modules`` under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` inside a ``with``
    block, optionally selective, and count what backward recomputes::

        ac = ActivationCheckpointing(model.encoder.layers, save=[torch.ops.aten.addmm.default])
        with ac:
            loss = step()
        ac.recomputed_matmuls()   # 0: the policy kept them
        ac.unmatched()            # named ops that never ran: a policy that matches nothing recomputes everything

    Each module's ``forward`` is replaced, for the block only, by a checkpointed call of the original: the module,
    its weights and its ``state_dict`` stay as they are. Without ``save`` every activation inside each module is
    recomputed in backward (full checkpointing); with ``save`` (ATen overloads, e.g. ``torch.ops.aten.mm.default``)
    the outputs of those operators are kept and the rest recomputed (selective checkpointing,
    ``torch.utils.checkpoint.create_selective_checkpoint_contexts``). A policy receives the overload
    (``aten.mm.default``); a name that never matches — the packet ``torch.ops.aten.mm``, or ``aten.linear.default``,
    which is decomposed before dispatch — silently saves nothing: :meth:`unmatched` lists such names.

    Counting: ``saved`` holds the operators whose outputs the policy kept during forward; ``recomputed`` the
    operators backward ran again, seen by an :class:`OpCounter` placed under the selective-checkpointing cache, so
    an output served from the cache is not counted. ``reset()`` clears both. The counter is a Python dispatch mode
    that every recomputed operator passes through, which costs host time: set ``counting = False`` (or pass
    ``counting=False``) before timing steps, so that the time measured is checkpointing's own.
    """

    def __init__(self, modules: Iterable[torch.nn.Module], *, save: Iterable[Any] | None = None,
                 counting: bool = True) -> None:
        self.modules = list(modules)
        if not self.modules:
            raise ValueError("ActivationCheckpointing needs at least one module")
        self.save = None if save is None else list(save)
        self.counting = counting
        self.saved: Counter = Counter()
        self.recomputed: Counter = Counter()
        self._patched: list[torch.nn.Module] = []

    @property
    def selective(self) -> bool:
        return self.save is not None

    def reset(self) -> None:
        self.saved.clear()
        self.recomputed.clear()

    def _policy(self, ctx, op, *args, **kwargs):
        from torch.utils.checkpoint import CheckpointPolicy

        keep = op in self.save  # type: ignore[operator]
        if keep and not getattr(ctx, "is_recompute", False):
            self.saved[op] += 1
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    def _contexts(self):
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        if self.selective:
            forward_ctx, recompute_ctx = create_selective_checkpoint_contexts(self._policy)
        else:
            forward_ctx, recompute_ctx = nullcontext(), nullcontext()
        if not self.counting:
            return forward_ctx, recompute_ctx
        counter = OpCounter()

        @contextmanager
        def recompute():
            try:  # the counter first, then the cache on top of it: cached outputs never reach the counter
                with counter, recompute_ctx:
                    yield
            finally:  # checkpoint stops a recomputation early by raising through this block
                self.recomputed.update(counter.counts)

        return forward_ctx, recompute()

    def __enter__(self) -> ActivationCheckpointing:
        from torch.utils.checkpoint import checkpoint

        for module in self.modules:
            if "forward" in module.__dict__:
                raise RuntimeError(f"{type(module).__name__}.forward is already replaced (nested checkpointing?)")
            original = module.forward

            def forward(*args, _original=original, **kwargs):
                if not torch.is_grad_enabled():  # nothing to save for backward: plain forward
                    return _original(*args, **kwargs)
                return checkpoint(_original, *args, use_reentrant=False, context_fn=self._contexts, **kwargs)

            module.forward = forward
            self._patched.append(module)
        return self

    def __exit__(self, *exc) -> None:
        for module in self._patched:
            del module.forward  # the class's forward again
        self._patched.clear()

    def recomputed_matmuls(self) -> int:
        return sum(n for op, n in self.recomputed.items() if is_matmul(op))

    def recomputed_compute_ops(self) -> int:
        """Recomputed operators other than views (which move no data)."""
        return sum(n for op, n in self.recomputed.items() if not _is_view(op))

    def unmatched(self) -> list[str]:
        """Names in ``save`` that matched no operator during the forward passes since the last ``reset()``."""
        if not self.selective:
            return []
        return [op_name(op) for op in self.save if self.saved[op] == 0]  # type: ignore[union-attr]


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


# ----------------------------------------------------------------------------------------------------
# Reading a snapshot: who holds the peak, the allocator's segments, its settings


def _frame_label(frames: list[dict[str, Any]]) -> str:
    """'forward · linear.py:forward', 'backward · ...', 'optimizer step · adamw.py:_multi_tensor_adamw' for an
    allocation's Python stack (innermost frame first, as the snapshot stores it). Backward on a GPU runs on
    autograd's own C++ thread, whose allocations carry no Python stack: they get a label of their own."""
    if not frames:  # allocated on a thread without Python frames: on a GPU, autograd runs backward on its own thread
        return "no Python stack (a C++ thread, e.g. autograd's backward)"
    files = [f.get("filename", "").replace("\\", "/") for f in frames]
    names = [f.get("name", "") for f in frames]
    if any("/torch/optim/" in p for p in files):
        phase = "optimizer step"
    elif any(n in ("_engine_run_backward", "backward") and "/autograd/" in p or p.endswith("/_tensor.py")
             and n == "backward" for p, n in zip(files, names, strict=True)):
        phase = "backward"
    else:
        phase = "forward"
    inner = frames[0]
    where = f"{Path(inner.get('filename', '?')).name}:{inner.get('name', '?')}"
    return f"{phase} · {where}"


@dataclass(frozen=True)
class PeakBreakdown:
    """The tensors live at a snapshot's peak, grouped by the code that allocated them (largest first)."""

    peak_bytes: int
    event_index: int  # position of the event at the peak in the device's trace
    before_recording_bytes: int  # live at the peak but allocated before recording started (no stack known)
    by_source: list[tuple[str, int, int]]  # (source label, bytes, tensors)

    def rows(self, top: int = 8) -> list[dict[str, object]]:
        """Table rows: the ``top`` sources, the rest summed, and what was there before recording."""
        rows = [{"allocated by": label, "tensors": count, "bytes at the peak": format_bytes(nbytes),
                 "share": f"{nbytes / self.peak_bytes:.0%}" if self.peak_bytes else "—"}
                for label, nbytes, count in self.by_source[:top]]
        rest = self.by_source[top:]
        if rest:
            nbytes = sum(b for _, b, _ in rest)
            rows.append({"allocated by": f"{len(rest)} other places", "tensors": sum(c for *_, c in rest),
                         "bytes at the peak": format_bytes(nbytes),
                         "share": f"{nbytes / self.peak_bytes:.0%}" if self.peak_bytes else "—"})
        rows.append({"allocated by": "before recording (weights, optimizer state, ...)", "tensors": "—",
                     "bytes at the peak": format_bytes(self.before_recording_bytes),
                     "share": f"{self.before_recording_bytes / self.peak_bytes:.0%}" if self.peak_bytes else "—"})
        return rows


def peak_breakdown(snapshot: dict[str, Any], *, device_index: int | None = None) -> PeakBreakdown:
    """Find the peak of a recorded snapshot and attribute it to the tensors live at that moment.

    Replays the trace as :func:`memory_timeline` does (an ``alloc`` adds, a ``free_completed`` removes), keeping
    each live allocation's size and the Python stack recorded with it; at the highest level, the live
    allocations are grouped by :func:`_frame_label` — phase (forward, backward, optimizer step) and the innermost
    Python frame that allocated them. Memory allocated before recording started has no stack: it is reported as
    one amount (the weights and optimizer state, typically).
    """
    index, trace = _trace_for(snapshot, device_index)
    events, levels = memory_timeline(snapshot, device_index=index)
    if not events:
        return PeakBreakdown(0, -1, 0, [])
    at = levels.index(max(levels))
    peak_event = events[at]
    live: dict[int, tuple[int, str]] = {}
    freed_from_before = 0
    for event in trace[:peak_event + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], _frame_label(event.get("frames", [])))
        elif event["action"] == "free_completed":
            if event["addr"] in live:
                del live[event["addr"]]
            else:  # allocated before recording started
                freed_from_before += event["size"]
    first = trace[events[0]]
    level_before_recording = levels[0] - (first["size"] if first["action"] == "alloc" else -first["size"])
    before = max(0, level_before_recording - freed_from_before)
    groups: dict[str, list[int]] = {}
    for size, label in live.values():
        entry = groups.setdefault(label, [0, 0])
        entry[0] += size
        entry[1] += 1
    by_source = sorted(((label, b, c) for label, (b, c) in groups.items()), key=lambda r: r[1], reverse=True)
    return PeakBreakdown(levels[at], peak_event, before, by_source)


def segment_summary(snapshot: dict[str, Any]) -> dict[str, int]:
    """The allocator's state in a snapshot (``torch.cuda.memory._snapshot()``): ``segments`` (cudaMalloc'd
    pieces), ``reserved``, ``allocated`` (blocks in use), ``cached`` (free blocks kept for reuse) and
    ``largest_free_block``: the largest request the cache can serve without asking the driver for more."""
    reserved = allocated = largest = 0
    segments = snapshot.get("segments", [])
    for segment in segments:
        reserved += segment["total_size"]
        for block in segment["blocks"]:
            if block["state"] in _LIVE_BLOCK_STATES:
                allocated += block["size"]
            elif block["state"] == "inactive":
                largest = max(largest, block["size"])
    return {"segments": len(segments), "reserved": reserved, "allocated": allocated,
            "cached": reserved - allocated, "largest_free_block": largest}


def expandable_segments_enabled(snapshot: dict[str, Any]) -> bool | None:
    """Whether the CUDA allocator that took ``snapshot`` uses expandable segments: its ``allocator_settings``
    (recorded since PyTorch 2.1), else any segment marked ``is_expandable``; None when the snapshot says neither
    (no setting recorded and no segment to look at)."""
    settings = snapshot.get("allocator_settings")
    if isinstance(settings, dict) and "expandable_segments" in settings:
        return bool(settings["expandable_segments"])
    flags = [s["is_expandable"] for s in snapshot.get("segments", []) if "is_expandable" in s]
    return any(flags) if flags else None


# ----------------------------------------------------------------------------------------------------
# The allocator's settings: which environment variable this PyTorch reads, measured in a child process

#: The environment variables that configure PyTorch's CUDA caching allocator, and which releases read them
#: (from PyTorch's source and issue tracker; the notebook measures what the installed version does).
ALLOC_CONF_VARS = {
    "PYTORCH_CUDA_ALLOC_CONF": "the original name, read by every release that has these options; from 2.9 on "
                               "a deprecated alias of PYTORCH_ALLOC_CONF that still works and warns once",
    "PYTORCH_ALLOC_CONF": "the device-generic name, read from 2.9 on; in 2.9 its "
                          "expandable_segments option did not reach the CUDA allocator, without a warning "
                          "(pytorch/pytorch#183387, reported on 2.9.1; honoured by 2.11)",
}

MiB = 2**20


def fragmentation_demo(device: torch.device | str, *, tensors: int = 10, tensor_mib: int = 48,
                       big_mib: int = 288) -> list[dict[str, object]]:
    """Allocate ``tensors`` × ``tensor_mib`` MiB, free them all, then ask for one ``big_mib`` MiB tensor, then
    ``empty_cache()``; returns one row per stage with the allocated and reserved bytes above those at the start
    (CUDA only).

    With the default allocator each tensor of 10 MiB or more gets a segment (one cudaMalloc) of its own; freed
    segments stay cached, but free memory in different segments cannot be joined, so the big request needs a new
    segment though enough memory is cached: reserved grows past what is allocated (fragmentation) until
    ``empty_cache()`` returns the unused segments. With ``expandable_segments:True`` the tensors share one
    segment that grows; the freed space is contiguous and serves the big request.
    """
    dev = get_device(device)
    if dev.type != "cuda":
        raise RuntimeError("the caching allocator is a CUDA feature: there is nothing to fragment on CPU")
    rows: list[dict[str, object]] = []

    def stage(what: str) -> None:
        torch.cuda.synchronize(dev)
        rows.append({"stage": what, "allocated": torch.cuda.memory_allocated(dev),
                     "reserved": torch.cuda.memory_reserved(dev)})

    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    base_allocated, base_reserved = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)
    stage("start")
    parts = [torch.empty(tensor_mib * MiB, dtype=torch.uint8, device=dev) for _ in range(tensors)]
    stage(f"{tensors} tensors of {tensor_mib} MiB")
    del parts
    stage("all of them freed")
    big = torch.empty(big_mib * MiB, dtype=torch.uint8, device=dev)
    stage(f"one tensor of {big_mib} MiB")
    torch.cuda.empty_cache()
    stage("empty_cache()")
    del big
    torch.cuda.empty_cache()
    for row in rows:  # above what was there at the start
        row["allocated"] = int(row["allocated"]) - base_allocated  # type: ignore[call-overload]
        row["reserved"] = int(row["reserved"]) - base_reserved  # type: ignore[call-overload]
    return rows


def _allocator_probe_main() -> None:  # pragma: no cover - runs in the child process on a GPU
    """The child process of :func:`allocator_probe`: run :func:`fragmentation_demo`, print JSON."""
    import json

    device = torch.device("cuda")
    torch.zeros(1, device=device)  # initialise CUDA (and the allocator, which reads its settings now)
    rows = fragmentation_demo(device)
    snapshot = torch.cuda.memory._snapshot()
    print(json.dumps({"torch": torch.__version__, "expandable_segments": expandable_segments_enabled(snapshot),
                      "rows": rows}))


@dataclass(frozen=True)
class ProbeResult:
    """What a child process with one allocator setting measured (:func:`allocator_probe`)."""

    variable: str | None  # the environment variable set, or None for the defaults
    value: str | None
    torch_version: str
    expandable_segments: bool | None  # what the allocator really used
    rows: list[dict[str, object]]
    warnings: list[str]  # the child's warnings about the variable (e.g. deprecation)

    def reserved_after(self, stage_prefix: str) -> int:
        return next(int(r["reserved"]) for r in self.rows if str(r["stage"]).startswith(stage_prefix))


def allocator_probe(variable: str | None, value: str = "expandable_segments:True", *,
                    timeout_s: float = 180.0) -> ProbeResult:
    """Run :func:`fragmentation_demo` in a fresh Python process with ``variable=value`` set (and the other
    allocator variables removed), and return what it measured and whether its allocator really used expandable
    segments. The allocator reads its settings once, when CUDA starts, so each setting needs its own process.

    Raises:
        RuntimeError: if the child fails or prints no result (its stderr's tail is in the message).
        subprocess.TimeoutExpired: past ``timeout_s``.
    """
    import json
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ALLOC_CONF_VARS}
    if variable is not None:
        env[variable] = value
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    done = subprocess.run([sys.executable, "-c", "import utils.memory as m; m._allocator_probe_main()"],
                          capture_output=True, text=True, timeout=timeout_s, env=env, cwd=root)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"the allocator probe with {variable}={value} failed (exit {done.returncode}): {tail}")
    data = json.loads(lines[-1])
    warnings = [line.strip() for line in done.stderr.splitlines() if "ALLOC_CONF" in line]
    return ProbeResult(variable, value if variable else None, data["torch"], data["expandable_segments"],
                       data["rows"], warnings)
