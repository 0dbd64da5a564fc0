"""The course's one timing harness, and the measured peaks that results are put against.

``bench(fn)`` runs ``fn`` in blocks of calls long enough that the clock's own cost is negligible (under the
standard library's ``timeit.Timer``, as ``torch.utils.benchmark.Timer`` does), synchronises the GPU at the block
boundaries (its clock calls ``torch.cuda.synchronize(device)`` before reading ``timeit.default_timer``), and
reports the median and inter-quartile range of the per-call time over at least ``min_blocks`` blocks. Time is
wall-clock per call, so launch overhead and host work count, as they do in a real loop.

``compare(baseline, candidate)`` turns two timings into a verdict that respects their noise: "1.29× faster",
"slower: it takes 1.18× as long", or "no difference beyond the noise". Notebooks print it instead of writing a
verdict into prose. ``retimed(reference, again)`` applies the same rule to one piece of work timed twice in a run:
a guard that says when the conditions changed in between.

``first_call(fn)`` times one synchronised call instead, for the one-off costs that the warm-up keeps out of
``bench`` (a first call that compiles, builds or autotunes), to be reported next to the steady state.

Rules it enforces or helps with: warm-up calls run before timing; at least ``min_blocks`` blocks are measured, so
the spread means something; callers pass the same inputs to every variant (the closure holds them); throughput
helpers turn a timing into GB/s or TFLOP/s and a percentage of a peak measured on the same machine.

Peaks come in two kinds (:func:`matmul_rate`): a *burst*, tens of milliseconds after the GPU rested, at the boost
clock a short job sees; and a *sustained* rate, seconds of back-to-back work, which is what a long job gets once
the power or thermal limit has lowered the clock. Both carry the SM clock, power and throttle reasons read while
they ran (:func:`utils.env.gpu_conditions`). Later notebooks divide by the sustained rate: their own
measurements are seconds of steady work under the same limits.
"""

from __future__ import annotations

import math
import statistics
import time
import timeit
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

import torch

from utils.env import GpuConditions, get_device, gpu_conditions, synchronize

T = TypeVar("T")


@dataclass(frozen=True)
class Timing:
    """Per-call time of one function: the median and inter-quartile range over measured blocks."""

    label: str
    median_s: float
    iqr_s: float
    block_times_s: tuple[float, ...]  # per-call time within each measured block
    calls_per_block: int
    device: str

    @property
    def median_ms(self) -> float:
        return self.median_s * 1e3

    @property
    def iqr_ms(self) -> float:
        return self.iqr_s * 1e3

    @property
    def spread(self) -> float:
        """IQR / median: 0.02 means the middle half of the blocks lie within 2% of each other."""
        return self.iqr_s / self.median_s if self.median_s > 0 else math.nan

    @property
    def calls(self) -> int:
        return len(self.block_times_s) * self.calls_per_block

    @property
    def quartiles_s(self) -> tuple[float, float]:
        """(first, third) quartile of the per-call block times: the middle half of the blocks lies between."""
        if len(self.block_times_s) < 2:
            return self.median_s, self.median_s
        q1, _, q3 = statistics.quantiles(self.block_times_s, n=4, method="inclusive")
        return q1, q3

    def __str__(self) -> str:
        return (f"{self.label}: {format_seconds(self.median_s)} median, IQR {format_seconds(self.iqr_s)} "
                f"({len(self.block_times_s)} blocks × {self.calls_per_block} calls, {self.device})")


def format_seconds(seconds: float) -> str:
    """Human units: '812 ns', '3.41 µs', '12.7 ms', '1.93 s'."""
    if not math.isfinite(seconds):
        return str(seconds)
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def bench(
    fn: Callable[[], object],
    *,
    label: str | None = None,
    device: torch.device | str | None = None,
    warmup: int = 3,
    min_run_time: float = 0.5,
    min_blocks: int = 7,
) -> Timing:
    """Time ``fn()`` (no arguments: close over the inputs) and return its per-call :class:`Timing`.

    Args:
        fn: the work to time. It must be callable with no arguments.
        label: name shown in tables; defaults to the function's name.
        device: where the work runs, for synchronisation; default ``utils.env.get_device()``.
        warmup: calls made (and synchronised) before any timing: they absorb one-time costs such as CUDA context
            and cuBLAS handle creation, autotuning and compilation — report those separately.
        min_run_time: seconds of measurement at least; blocks last about ``min_run_time / min_blocks``.
        min_blocks: measured blocks at least, so that the median and IQR rest on several samples even when one
            call is slower than ``min_run_time`` (then each block is one call).

    Raises:
        TypeError: if ``fn`` is not callable.
        ValueError: for a negative warmup, a non-positive min_run_time or fewer than 1 block.
    """
    if not callable(fn):
        raise TypeError(f"bench() needs a callable taking no arguments, got {type(fn).__name__}: {fn!r:.60}")
    if warmup < 0 or min_run_time <= 0 or min_blocks < 1:
        raise ValueError(f"bench(): need warmup >= 0, min_run_time > 0, min_blocks >= 1 "
                         f"(got {warmup}, {min_run_time}, {min_blocks})")
    device = get_device(device)
    label = label or getattr(fn, "__name__", "fn")
    for _ in range(warmup):
        fn()
    synchronize(device)

    # The blocks run under the standard library's timeit.Timer, as torch.utils.benchmark.Timer's do, with a clock
    # that synchronises the device being timed (that Timer's default syncs only the current one). Not through
    # torch's Timer itself: its timeit(number) first runs max(number // 100, 2) untimed calls, which for a call of a
    # second (a whole generation, a training epoch) tripled the time spent. The blocking policy is ours:
    # blocked_autorange can settle on a single block lasting all of min_run_time, which leaves no spread to report.
    def synchronised_clock() -> float:
        synchronize(device)
        return timeit.default_timer()

    timer = timeit.Timer(stmt=fn, timer=synchronised_clock)
    per_block_s = min_run_time / min_blocks
    one_call_s = timer.timeit(number=1)  # the probe: up to 3 single calls, fewer when one already fills a block
    for _ in range(2):
        if one_call_s >= 2 * per_block_s:
            break
        one_call_s = min(one_call_s, timer.timeit(number=1))
    block = max(1, math.ceil(per_block_s / max(one_call_s, 1e-7)))
    times: list[float] = []
    while len(times) < min_blocks or sum(times) * block < min_run_time:
        times.append(timer.timeit(number=block) / block)
    return _timing_from(label, times, block, device)


def first_call(fn: Callable[[], T], *, device: torch.device | str | None = None) -> tuple[float, T]:
    """Seconds of one call of ``fn()``, synchronised before and after, and what it returned.

    For the one-off costs that :func:`bench` keeps out of steady state on purpose (its warm-up absorbs them): a
    first call that compiles, builds an extension or autotunes. Report them beside the steady-state time, never
    inside it. One reading of ``time.perf_counter``, no repeats: a later call of the same ``fn`` measures
    something else (the cached result).

    Raises:
        TypeError: if ``fn`` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"first_call() needs a callable taking no arguments, got {type(fn).__name__}")
    device = get_device(device)
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return time.perf_counter() - start, result


def _timing_from(label: str, times: Sequence[float], calls_per_block: int, device: torch.device) -> Timing:
    if len(times) >= 2:
        q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    else:
        q1 = q3 = times[0]
    return Timing(label=label, median_s=statistics.median(times), iqr_s=q3 - q1,
                  block_times_s=tuple(times), calls_per_block=calls_per_block, device=str(device))


def gbps(bytes_moved: float, timing: Timing) -> float:
    """Achieved bandwidth in GB/s (10⁹ bytes/s) for a call that must move ``bytes_moved`` bytes."""
    return bytes_moved / timing.median_s / 1e9


def tflops(flops: float, timing: Timing) -> float:
    """Achieved arithmetic rate in TFLOP/s (10¹² FLOP/s) for a call that does ``flops`` operations."""
    return flops / timing.median_s / 1e12


def per_second(count: float, timing: Timing) -> float:
    """Items (tokens, images, steps …) per second for a call that processes ``count`` of them."""
    return count / timing.median_s


def percent_of(value: float, peak: float) -> float:
    """``value`` as a percentage of ``peak`` (e.g. achieved GB/s of the copy bandwidth measured here)."""
    if peak <= 0:
        raise ValueError(f"peak must be positive, got {peak}")
    return 100.0 * value / peak


def speedup_table(timings: Sequence[Timing], *, baseline: int = 0) -> list[dict[str, object]]:
    """Rows for a comparison table: label, median, IQR, speed-up against ``timings[baseline]`` and the verdict
    of :func:`compare` (faster / slower / within the noise).

    Pass the rows to ``utils.plot.table`` to print them.
    """
    if not timings:
        raise ValueError("speedup_table() needs at least one Timing")
    base = timings[baseline]
    return [
        {"variant": t.label, "median": format_seconds(t.median_s), "IQR": format_seconds(t.iqr_s),
         "speed-up": _ratio(base.median_s / t.median_s),
         "verdict": "baseline" if i == baseline else compare(base, t).short}
        for i, t in enumerate(timings)
    ]


def _ratio(x: float) -> str:
    """A speed-up or ratio: '1.29×', '0.85×', '0.0012×', '11,401×'."""
    if x >= 1000:
        return f"{x:,.0f}×"
    return f"{x:.2f}×" if x >= 0.1 else f"{x:.2g}×"


# ── Verdicts: two timings and their noise → what a reader may conclude ──────────────────────────────────────

#: Below this relative difference two timings are called the same even when their blocks do not overlap:
#: on a GPU the same code measured again a minute later (other clocks, another thermal state) differs by a few
#: percent, more than the spread inside one measurement shows.
MIN_EFFECT = 0.05


@dataclass(frozen=True)
class Comparison:
    """How ``candidate`` compares with ``baseline``: the speed-up and whether it is beyond the noise.

    ``speedup`` is baseline time / candidate time (above 1: the candidate is faster). The difference counts as
    real (``outcome`` "faster" or "slower") only when the middle halves of the two sets of blocks do not overlap
    *and* the medians differ by at least ``min_effect``; otherwise the outcome is "same".
    """

    baseline: Timing
    candidate: Timing
    min_effect: float = MIN_EFFECT

    @property
    def speedup(self) -> float:
        return self.baseline.median_s / self.candidate.median_s

    @property
    def outcome(self) -> Literal["faster", "slower", "same"]:
        (b1, b3), (c1, c3) = self.baseline.quartiles_s, self.candidate.quartiles_s
        if c3 < b1 and self.speedup >= 1 + self.min_effect:
            return "faster"
        if c1 > b3 and 1 / self.speedup >= 1 + self.min_effect:
            return "slower"
        return "same"

    @property
    def short(self) -> str:
        """'1.29× faster', '1.18× slower' or 'same (noise)': for a table column."""
        if self.outcome == "faster":
            return f"{_ratio(self.speedup)} faster"
        if self.outcome == "slower":
            return f"{_ratio(1 / self.speedup)} slower"
        return "same (noise)"

    @property
    def verdict(self) -> str:
        """A phrase for a sentence, e.g. 'no difference beyond the noise (1.02×; the middle halves of their timings
        overlap)'."""
        if self.outcome == "faster":
            return f"{_ratio(self.speedup)} faster"
        if self.outcome == "slower":
            return f"slower: it takes {_ratio(1 / self.speedup)} as long"
        why = ("the middle halves of their timings overlap" if self._overlap() else
               f"under the {self.min_effect:.0%} that separates real differences from run-to-run drift")
        return f"no difference beyond the noise ({_ratio(self.speedup)}; {why})"

    def _overlap(self) -> bool:
        (b1, b3), (c1, c3) = self.baseline.quartiles_s, self.candidate.quartiles_s
        return not (c3 < b1 or c1 > b3)

    def explain(self, expected: Literal["faster", "slower", "same"] = "faster", *, why: str | None = None) -> str:
        """The verdict against an expectation: 'as expected, 1.29× faster' or, when the measurement disagrees,
        the verdict followed by ``why`` — the reason the notebook measured (e.g. 'the GPU is idle 60% of the
        step')."""
        label = f"{self.candidate.label} vs {self.baseline.label}: "
        if self.outcome == expected:
            return label + f"{self.verdict}, as expected"
        return label + self.verdict + (f" — {why}" if why else "")

    def __str__(self) -> str:
        return f"{self.candidate.label} vs {self.baseline.label}: {self.verdict}"


def compare(baseline: Timing, candidate: Timing, *, min_effect: float = MIN_EFFECT) -> Comparison:
    """Compare two timings of the same work: see :class:`Comparison` for what counts as beyond the noise.

    Raises:
        TypeError: if either is not a :class:`Timing`.
        ValueError: for a ``min_effect`` outside [0, 1) or a non-positive median.
    """
    if not isinstance(baseline, Timing) or not isinstance(candidate, Timing):
        raise TypeError(f"compare() takes two Timing objects from bench(), got {type(baseline).__name__} and "
                        f"{type(candidate).__name__}")
    if not 0 <= min_effect < 1:
        raise ValueError(f"min_effect must be in [0, 1), got {min_effect}")
    if baseline.median_s <= 0 or candidate.median_s <= 0:
        raise ValueError("compare() needs positive median times")
    return Comparison(baseline, candidate, min_effect)


def retimed(reference: Timing, again: Timing, *, then: str = "before", now: str = "now") -> tuple[bool, str]:
    """A guard for timings taken later in a run: the same work timed earlier (``reference``) and ``again`` now.

    If the two differ beyond the noise, whatever changed in between (the clock under a power or thermal limit,
    other processes on the host, a finished ``torch.profiler`` session that left its hooks attached) also weighs
    on everything timed beside ``again``: those timings compare with each other, not with the earlier ones.

    Returns ``(changed, text)``: ``changed`` by :func:`compare`'s rule (the middle halves of the two sets of blocks
    apart *and* the medians at least :data:`MIN_EFFECT` apart); ``text`` gives both medians with their IQRs, named
    by ``now`` and ``then`` (e.g. "here", "in section 5"), and, when changed, a ⚠ warning that says which way.

    Raises:
        TypeError: if either is not a :class:`Timing`.
    """
    c = compare(reference, again)
    text = (f"{again.label}: {format_seconds(again.median_s)} (IQR {format_seconds(again.iqr_s)}) {now}, "
            f"{format_seconds(reference.median_s)} (IQR {format_seconds(reference.iqr_s)}) {then}")
    if c.outcome == "same":
        return False, text + " — the same within the noise"
    ratio, way = (1 / c.speedup, "slower") if c.outcome == "slower" else (c.speedup, "faster")
    return True, (text + f" — ⚠ {_ratio(ratio)} {way} {now}, beyond the noise: the conditions changed in between, "
                         f"so compare what was timed {now} with each other, not with what was timed {then}")


# ── Peaks measured on this machine ─────────────────────────────────────────────────────────────────────────


#: Seconds of back-to-back work behind a sustained rate on a GPU (after half a second of heating up).
SUSTAINED_S = 2.0
#: Seconds of work behind a burst rate, measured after the GPU rested for a second.
BURST_S = 0.05


@dataclass(frozen=True)
class Rate:
    """A measured rate (e.g. 2,950 GB/s) with the timing it came from and the GPU's state while it ran."""

    name: str
    value: float
    unit: str
    timing: Timing
    conditions: GpuConditions | None = None

    def __str__(self) -> str:
        text = f"{self.name}: {self.value:.4g} {self.unit} ({format_seconds(self.timing.median_s)} per call)"
        if self.conditions is not None and self.conditions.samples:
            text += f"; {self.conditions}"
        return text


def copy_bandwidth(device: torch.device | str | None = None, *, nbytes: int | None = None) -> Rate:
    """Device-memory copy bandwidth: ``dst.copy_(src)`` on a buffer far larger than the caches.

    Counts bytes read plus bytes written (2 × nbytes), the convention of STREAM-copy and of every
    "% of copy bandwidth" in this course. Default size: 1 GiB on a GPU (fits any card with 4 GiB), 256 MiB on CPU.
    """
    device = get_device(device)
    if nbytes is None:
        nbytes = 1 << 30 if device.type == "cuda" else 256 << 20
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    with gpu_conditions(device) as conditions:
        timing = bench(lambda: dst.copy_(src), label="copy", device=device, min_run_time=0.3)
    return Rate("copy bandwidth (read + write)", gbps(2 * src.nbytes, timing), "GB/s", timing, conditions)


def matmul_rate(
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    *,
    n: int | None = None,
    tf32: bool = False,
    kind: Literal["sustained", "burst"] = "sustained",
) -> Rate:
    """Dense matmul rate of an n×n×n product on random data (2·n³ FLOP per call), with the GPU's state meanwhile.

    ``kind="sustained"`` (default): half a second of products to heat up, then at least :data:`SUSTAINED_S`
    seconds measured — the rate a long job holds under the GPU's power and thermal limits, and the one later
    notebooks divide by. ``kind="burst"``: after a one-second rest, about :data:`BURST_S` seconds of products —
    the boost-clock rate a short job sees. On a CPU both are shorter (0.5 s and 0.1 s): there is no GPU power
    cap to reach, and the run time of the CPU notebooks is budgeted.

    ``tf32=True`` lets fp32 matmuls use TF32 tensor cores (``torch.set_float32_matmul_precision("high")``);
    the previous setting is restored afterwards. Default n: 8192 on a GPU, 1024 on CPU.

    Raises:
        ValueError: for a ``kind`` other than "sustained" or "burst".
    """
    if kind not in ("sustained", "burst"):
        raise ValueError(f"kind must be 'sustained' or 'burst', got {kind!r}")
    device = get_device(device)
    on_gpu = device.type == "cuda"
    n = n or (8192 if on_gpu else 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    name = "tf32" if (tf32 and dtype == torch.float32) else str(dtype).removeprefix("torch.")
    try:
        if kind == "burst":
            for _ in range(2):  # cuBLAS handle and kernel selection, before the rest
                a @ b
            synchronize(device)
            time.sleep(1.0 if on_gpu else 0.0)
            with gpu_conditions(device) as conditions:
                timing = bench(lambda: a @ b, label=f"matmul {name}", device=device, warmup=1, min_blocks=5,
                               min_run_time=BURST_S if on_gpu else 0.1)
        else:
            heat_until = time.perf_counter() + (0.5 if on_gpu else 0.05)
            while time.perf_counter() < heat_until:
                a @ b
                synchronize(device)
            with gpu_conditions(device) as conditions:
                timing = bench(lambda: a @ b, label=f"matmul {name}", device=device, warmup=0, min_blocks=10,
                               min_run_time=SUSTAINED_S if on_gpu else 0.5)
    finally:
        torch.set_float32_matmul_precision(previous)
    return Rate(f"matmul {name} (n={n}), {kind}", tflops(2 * n**3, timing), "TFLOP/s", timing, conditions)


def host_to_device_bandwidth(
    nbytes: int, *, pinned: bool, device: torch.device | str | None = None
) -> Rate:
    """Host → GPU copy bandwidth for one ``nbytes`` buffer, from pageable or pinned (page-locked) host memory.

    Raises:
        RuntimeError: on a CPU device, where there is no host-to-device copy to measure.
    """
    device = get_device(device)
    if device.type != "cuda":
        raise RuntimeError("host-to-device bandwidth needs a CUDA device; on CPU there is no copy to measure")
    host = torch.randn(max(nbytes // 4, 1)).pin_memory() if pinned else torch.randn(max(nbytes // 4, 1))
    dst = torch.empty(host.shape, device=device)
    timing = bench(lambda: dst.copy_(host, non_blocking=pinned), label="H2D", device=device, min_run_time=0.2)
    kind = "pinned" if pinned else "pageable"
    return Rate(f"host→device {kind}", gbps(host.nbytes, timing), "GB/s", timing)
