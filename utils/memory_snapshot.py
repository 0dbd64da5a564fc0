"""CUDA memory snapshots: record every allocation and free inside a block, with the Python stack that made it
(:func:`record_memory_history`); draw the memory over time inline (:func:`plot_memory_timeline`) or save the
snapshot for https://pytorch.org/memory_viz (:func:`save_snapshot`); and read it: who holds the peak
(:func:`peak_breakdown`), the allocator's segments (:func:`segment_summary`) and whether it used expandable
segments (:func:`expandable_segments_enabled`).

A snapshot is the dict of ``torch.cuda.memory._snapshot()``: ``segments`` (the allocator's memory when it was
taken) and ``device_traces`` (the alloc/free events recorded, one list per device). Only
:func:`record_memory_history` calls CUDA; the functions that read a snapshot dict (:func:`memory_timeline`,
:func:`plot_memory_timeline`, :func:`peak_breakdown`, :func:`segment_summary`, :func:`expandable_segments_enabled`)
are pure, so they work anywhere.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from utils.env import get_device
from utils.memory import format_bytes

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# A block's "state" in a snapshot's segments while the allocator still counts it as allocated. The C++
# binding writes "active_pending_free" (torch/csrc/cuda/Module.cpp); _snapshot()'s docstring says
# "active_awaiting_free": accept both.
_LIVE_BLOCK_STATES = ("active_allocated", "active_pending_free", "active_awaiting_free")


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

    On CPU raises RuntimeError: there is no caching allocator to record; use :func:`utils.memory.track_peak`.
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

    def negligible(self, min_share: float) -> list[tuple[str, int, int]]:
        """The sources that hold less than ``min_share`` of the peak (e.g. 0.001: under 0.1%), largest first."""
        return [source for source in self.by_source if source[1] < min_share * self.peak_bytes]

    def rows(self, top: int = 8, *, min_share: float = 0.0) -> list[dict[str, object]]:
        """Table rows: the ``top`` sources, the rest summed, and what was there before recording. Sources under
        ``min_share`` of the peak (:meth:`negligible`) are left out of both: say how many, next to the table."""
        small = self.negligible(min_share)
        kept = [source for source in self.by_source if source not in small]
        rows = [{"allocated by": label, "tensors": count, "bytes at the peak": format_bytes(nbytes),
                 "share": f"{nbytes / self.peak_bytes:.0%}" if self.peak_bytes else "—"}
                for label, nbytes, count in kept[:top]]
        rest = kept[top:]
        if rest:
            nbytes = sum(b for _, b, _ in rest)
            rows.append({"allocated by": f"{len(rest)} other places", "tensors": sum(c for *_, c in rest),
                         "bytes at the peak": format_bytes(nbytes),
                         "share": f"{nbytes / self.peak_bytes:.0%}" if self.peak_bytes else "—"})
        rows.append({"allocated by": "before recording (weights, optimizer state, ...)", "tensors": "—",
                     "bytes at the peak": format_bytes(self.before_recording_bytes),
                     "share": f"{self.before_recording_bytes / self.peak_bytes:.0%}" if self.peak_bytes else "—"})
        return rows

    def summary(self, peak_allocated_bytes: int | None = None, *, min_share: float = 0.0) -> str:
        """Sentences from the breakdown: the share of the peak allocated in the forward pass, in backward (with or
        without a Python stack: autograd's own thread on a GPU records none), and before recording; the sources
        left out under ``min_share``; and, given ``peak_allocated_bytes`` (``max_memory_allocated`` over the same
        kind of step), how the snapshot's peak compares: it adds up the sizes requested, the counter the
        allocator's blocks, rounded up."""
        if not self.peak_bytes:
            return "The snapshot recorded no allocation."
        share = {phase: sum(b for label, b, _ in self.by_source if label.startswith(phase)) / self.peak_bytes
                 for phase in ("forward", "backward", "no Python stack")}
        text = (f"At the peak (event {self.event_index:,} of the trace): {share['forward']:.0%} allocated in the "
                f"forward pass, {share['backward'] + share['no Python stack']:.0%} in backward, "
                f"{self.before_recording_bytes / self.peak_bytes:.0%} before the step (weights, optimizer state, "
                "workspaces).")
        small = self.negligible(min_share) if min_share else []
        if small:
            text += (f" Left out of the table: {len(small)} place(s) under {min_share:.1%} of the peak, "
                     f"{format_bytes(sum(b for _, b, _ in small))} in all.")
        if peak_allocated_bytes is not None:
            gap = self.peak_bytes - peak_allocated_bytes
            text += (f" The snapshot's peak counts the whole process, workspace and weights included: "
                     f"{format_bytes(self.peak_bytes)}, against "
                     f"{format_bytes(peak_allocated_bytes)} from max_memory_allocated: " + (
                         f"{format_bytes(-gap)} less: the snapshot adds up the sizes requested, the counter the "
                         "allocator's blocks, rounded up." if gap <= 0 else
                         f"{format_bytes(gap)} more: more tensors were live during this step."))
        return text


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
