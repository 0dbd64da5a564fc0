"""How the course measures: one timing of one thing, one comparison of several, a sweep over sizes, and the peaks
(matmul rate, copy bandwidth) that results are put against. The protocol is explained once, in notebook 00 and
README ("How the course measures"); every notebook calls it in one line.

``bench(fn)`` times one thing: blocks of calls long enough that the clock's cost is negligible, the GPU
synchronised at block boundaries, warm-up first; it returns the median per-call time and the band (the quartiles)
of the blocks. Use it for a rate (a copy, a matmul), never for an A-against-B verdict.

``compare({"A": a, "B": b, ...})`` is the one way the course compares. It warms every variant up, then times them
**in alternating rounds**, one block of each per round, the order reversed every other round, so that every
variant sees the same process state: a clock that sags under a power cap, a host that gets busier, a cache that
warms. Each round gives a speed-up per variant (the baseline's block over the variant's); the verdict comes from
those paired ratios — their median and its band (a 95% confidence interval, :func:`median_interval`) — with three
outcomes:

* **resolved difference**: the band excludes 1 and the median differs by more than the resolution — "1.62× faster";
* **resolved null**: the whole band lies within ± the resolution — "no difference larger than 3%";
* **inconclusive**: anything else — "could not resolve a 3% effect here (1.04×, band 0.95–1.12×)", never reported
  as a tip that "did not hold".

A drift that would have made a baseline timed sections earlier look slower or faster moves both sides of every
round alike, so it cancels in the ratios: no guard has to detect it after the fact.

``sweep(factories, sizes, bytes_moved=...)`` runs one comparison per size, checks every variant against a reference
first, and gives GB/s (or TFLOP/s) per variant and size against a limit measured here, as a table and a plot.

Recording is part of the measuring call: ``compare(..., record={"stream_overlap_speedup": "overlapped"})`` writes
the figure with :func:`utils.results.record`, so a lesson holds no bookkeeping cell.

Timing never follows a profile in the same process: a finished ``torch.profiler`` session can leave CUPTI attached
and slow host-bound code, so :func:`bench` and :func:`compare` refuse to run after one
(:func:`utils.profile.assert_not_profiled`). Take the timings first; profile to explain them afterwards.

Peaks come in two kinds (:func:`matmul_rate`): a *burst*, tens of milliseconds after the GPU rested, at the boost
clock a short job sees; and a *sustained* rate, seconds of back-to-back work, which is what a long job gets once
the power or thermal limit has lowered the clock. Both carry the SM clock, power and throttle reasons read while
they ran (:func:`utils.env.gpu_conditions`). Later notebooks divide by the sustained rate.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import torch

from utils.env import GpuConditions, get_device, gpu_conditions, synchronize
from utils.profile import assert_not_profiled
from utils.results import figure

T = TypeVar("T")

#: The default resolution of a comparison: effects smaller than this are reported as "no difference larger than
#: 3%" when the band allows it. On a GPU, paired rounds resolve a few percent; a host-bound loop on a busy CPU may not.
RESOLUTION = 0.03
#: The coverage a verdict's band must reach before it resolves anything (:class:`Verdict`).
CONFIDENCE = 0.95


# ── One timing ─────────────────────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class Timing:
    """Per-call time of one function: the median and the band (quartiles) over measured blocks."""

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
        """(first, third) quartile of the per-call block times: the band of this timing."""
        return _quartiles(self.block_times_s)

    def __str__(self) -> str:
        q1, q3 = self.quartiles_s
        return (f"{self.label}: {format_seconds(self.median_s)} median, band {format_seconds(q1)}–"
                f"{format_seconds(q3)} ({len(self.block_times_s)} blocks × {self.calls_per_block} calls, "
                f"{self.device})")


def format_seconds(seconds: float) -> str:
    """Human units, three significant figures kept (a trailing zero too): '812 ns', '3.41 µs', '58.0 ms', '1.93 s';
    a value that rounds up to 1,000 of a unit moves to the next ('1.00 ms', never '1e+03 µs')."""
    if not math.isfinite(seconds) or seconds == 0:
        return "0 ns" if seconds == 0 else str(seconds)
    units = (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9))
    for i, (unit, scale) in enumerate(units):
        if abs(seconds) >= scale or unit == "ns":
            value = seconds / scale
            if i and abs(float(f"{value:.3g}")) >= 1000:
                unit, value = units[i - 1][0], seconds / units[i - 1][1]
            return (f"{value:,.0f}" if abs(value) >= 999.5 else f"{value:#.3g}".rstrip(".")) + f" {unit}"
    raise AssertionError("unreachable")


def _quartiles(values: Sequence[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def _synchronised_clock(device: torch.device) -> Callable[[], float]:
    def clock() -> float:
        synchronize(device)
        return time.perf_counter()

    return clock


def _block(fn: Callable[[], object], calls: int, clock: Callable[[], float]) -> float:
    """Per-call seconds of ``calls`` back-to-back calls, the garbage collector paused (as ``timeit`` does)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        start = clock()
        for _ in range(calls):
            fn()
        return (clock() - start) / calls
    finally:
        if was_enabled:
            gc.enable()


def _probe(fn: Callable[[], object], clock: Callable[[], float], enough_s: float) -> float:
    """One call's time: up to three single calls (the fastest), fewer when one already lasts ``enough_s``."""
    best = _block(fn, 1, clock)
    for _ in range(2):
        if best >= enough_s:
            break
        best = min(best, _block(fn, 1, clock))
    return max(best, 1e-7)


def _calls_per_block(per_block_s: float, one_call_s: float) -> int:
    """Calls that fill a block of ``per_block_s`` (at least one; 1e-6 of slack for a ratio that rounds up)."""
    return max(1, math.ceil(per_block_s / one_call_s - 1e-6))


def _check_callable(fn: object, who: str) -> None:
    if not callable(fn):
        raise TypeError(f"{who} needs a callable taking no arguments, got {type(fn).__name__}: {fn!r:.60}")


def bench(
    fn: Callable[[], object],
    *,
    label: str | None = None,
    device: torch.device | str | None = None,
    warmup: int = 3,
    min_run_time: float = 0.5,
    min_blocks: int = 7,
    clock: Callable[[], float] | None = None,
) -> Timing:
    """Time ``fn()`` (no arguments: close over the inputs) and return its per-call :class:`Timing`.

    For one rate or one cost. To say whether one thing is faster than another, use :func:`compare`, which times
    them together.

    Args:
        fn: the work to time.
        label: name shown in tables; defaults to the function's name.
        device: where the work runs, for synchronisation; default ``utils.env.get_device()``.
        warmup: calls made (and synchronised) before any timing: CUDA context and cuBLAS handles, autotuning and
            compilation stay out (report those with :func:`first_call`).
        min_run_time: seconds of measurement at least; blocks last about ``min_run_time / min_blocks``.
        min_blocks: measured blocks at least, so that the median and band rest on several samples even when one
            call is slower than ``min_run_time`` (then each block is one call).
        clock: seconds since any origin; default: synchronise ``device``, then ``time.perf_counter()``.

    Raises:
        TypeError: if ``fn`` is not callable.
        ValueError: for a negative warmup, a non-positive min_run_time or fewer than 1 block.
        utils.profile.ProfiledProcessError: when a profiler session already ran in this process.
    """
    _check_callable(fn, "bench()")
    if warmup < 0 or min_run_time <= 0 or min_blocks < 1:
        raise ValueError(f"bench(): need warmup >= 0, min_run_time > 0, min_blocks >= 1 "
                         f"(got {warmup}, {min_run_time}, {min_blocks})")
    assert_not_profiled("utils.bench.bench")
    device = get_device(device)
    label = label or getattr(fn, "__name__", "fn")
    clock = clock or _synchronised_clock(device)
    for _ in range(warmup):
        fn()
    synchronize(device)
    per_block_s = min_run_time / min_blocks
    calls = _calls_per_block(per_block_s, _probe(fn, clock, 2 * per_block_s))
    times: list[float] = []
    while len(times) < min_blocks or sum(times) * calls < min_run_time:
        times.append(_block(fn, calls, clock))
    return _timing_from(label, times, calls, device)


def first_call(fn: Callable[[], T], *, device: torch.device | str | None = None) -> tuple[float, T]:
    """Seconds of one call of ``fn()``, synchronised before and after, and what it returned.

    For the one-off costs that :func:`bench` and :func:`compare` keep out of the steady state on purpose (their
    warm-up absorbs them): a first call that compiles, builds an extension or autotunes. Report them beside the
    steady-state time, never inside it.

    Raises:
        TypeError: if ``fn`` is not callable.
    """
    _check_callable(fn, "first_call()")
    device = get_device(device)
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return time.perf_counter() - start, result


def _timing_from(label: str, times: Sequence[float], calls_per_block: int, device: torch.device | str) -> Timing:
    q1, q3 = _quartiles(times)
    return Timing(label=label, median_s=statistics.median(times), iqr_s=q3 - q1, block_times_s=tuple(times),
                  calls_per_block=calls_per_block, device=str(device))


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


def percent_text(pct: float) -> str:
    """A percentage with the digits that matter: '88%', '4.7%', '0.14%'."""
    return f"{pct:.0f}%" if pct >= 10 else f"{pct:.2g}%"


def ratio_text(x: float) -> str:
    """A speed-up or ratio: '1.29×', '0.85×', '0.0012×', '11,401×'."""
    if x >= 1000:
        return f"{x:,.0f}×"
    return f"{x:.2f}×" if x >= 0.1 else f"{x:.2g}×"


def near_edge_text(x: float, resolution: float = RESOLUTION) -> str:
    """A ratio in a verdict: three decimals near 1, so that a band that excludes 1 never reads "1.00" and a median
    prints with the digits of its band; and as many decimals (up to 4) as keep it on its side of every edge the
    verdict reads — 1, 1 + ``resolution`` and 1 / (1 + ``resolution``) — so that 1.0303 never reads "1.03"."""
    edges = (1.0, 1 + resolution, 1 / (1 + resolution))
    digits = 3 if 0.99 <= x <= 1.01 and x != 1 else 2
    if x < 0.1 or x >= 1000:
        return ratio_text(x)
    while digits < 4 and any(x != e and (x - e) * (round(x, digits) - e) <= 0 for e in edges):
        digits += 1
    return f"{x:.{digits}f}×"


# ── The verdict of a comparison ────────────────────────────────────────────────────────────────────────────

Outcome = Literal["faster", "slower", "same", "inconclusive"]


@dataclass(frozen=True)
class Verdict:
    """How ``variant`` compares with ``baseline``, from the speed-ups of paired rounds (baseline / variant).

    ``band`` is a confidence interval of the median speed-up (:func:`median_interval`, 95% from 6 rounds up).
    ``outcome`` is "faster" or "slower" (a resolved difference: the band excludes 1 and the median differs from 1
    by more than ``resolution``), "same" (a resolved null: the whole band lies within ± ``resolution``) or
    "inconclusive" (neither). Fewer than 6 rounds give a band of less than 95% coverage (3 rounds: 75%, their
    whole range): a difference then resolves only where every round lies beyond the resolution (a null, only
    where every round lies within it, as always), and the text says so, or how much the band holds.
    """

    variant: str
    baseline: str
    speedup: float  # the median of the per-round ratios
    band: tuple[float, float]  # a confidence interval of that median (:func:`median_interval`)
    resolution: float
    rounds: int
    confidence: float = CONFIDENCE  # the interval's coverage

    @property
    def outcome(self) -> Outcome:
        lo, hi = self.band
        r = self.resolution
        if self.few_rounds and (lo > 1 + r or hi < 1 / (1 + r)):  # the band is the whole range: every round beyond
            return "faster" if lo > 1 else "slower"
        if not self.few_rounds and lo > 1 and self.speedup > 1 + r:
            return "faster"
        if not self.few_rounds and hi < 1 and 1 / self.speedup > 1 + r:
            return "slower"
        if lo >= 1 / (1 + r) and hi <= 1 + r:
            return "same"
        return "inconclusive"

    @property
    def few_rounds(self) -> bool:
        """Too few rounds (under 6) for the band to reach :data:`CONFIDENCE`: it is then their whole range."""
        return self.confidence < CONFIDENCE - 1e-9

    @property
    def band_text(self) -> str:
        """The band in the orientation of the headline: as speed-ups, or for a slower variant as slow-downs
        ("2.62× slower (band 2.33–2.94×)")."""
        lo, hi = self.band
        if self.outcome == "slower":
            lo, hi = 1 / hi, 1 / lo

        return f"band {near_edge_text(lo, self.resolution).rstrip('×')}–{near_edge_text(hi, self.resolution)}"

    @property
    def short(self) -> str:
        """'1.62× faster', '1.18× slower', 'no difference > 3%' or 'inconclusive': for a table column."""
        outcome = self.outcome
        if outcome == "faster":  # by more than the resolution: 1.0315 reads "1.032×", never "1.03×"
            return f"{near_edge_text(self.speedup, self.resolution)} faster"
        if outcome == "slower":
            return f"{near_edge_text(1 / self.speedup, self.resolution)} slower"
        if outcome == "same":
            return f"no difference > {self.resolution:.0%}"
        return "inconclusive"

    @property
    def text(self) -> str:
        """The verdict as a phrase, with the band it rests on."""
        outcome = self.outcome
        if outcome in ("faster", "slower"):
            every = f", every one of {self.rounds} rounds beyond {self.resolution:.0%}" if self.few_rounds else ""
            return f"{self.short} ({self.band_text}{every})"
        median = near_edge_text(self.speedup, self.resolution)
        if outcome == "same":
            return f"no difference larger than {self.resolution:.0%} ({median}, {self.band_text})"
        few = f": a {self.confidence:.0%} interval, too few rounds for {CONFIDENCE:.0%}" if self.few_rounds else ""
        return (f"could not resolve a {self.resolution:.0%} effect here ({median}, {self.band_text}, {self.rounds} "
                f"rounds{few})")

    def explain(self, **reasons: str) -> str:
        """The verdict followed by the measured reason given for *its* outcome, e.g.
        ``verdict.explain(slower=f"pinning runs in the main thread: {pin_ms} ms per epoch")``.

        Keys are outcomes ("faster", "slower", "same", "inconclusive"): a notebook passes a reason for each
        outcome it can explain from its measurements, and the one printed is always the one that matches the
        result. Without a reason for the outcome, the verdict stands alone.

        Raises:
            ValueError: for a key that is not an outcome.
        """
        unknown = set(reasons) - {"faster", "slower", "same", "inconclusive"}
        if unknown:
            raise ValueError(f"explain(): reasons are keyed by outcome (faster, slower, same, inconclusive), "
                             f"got {sorted(unknown)}")
        reason = reasons.get(self.outcome)
        return f"{self}" + (f" — {reason}" if reason else "")

    def __str__(self) -> str:
        return f"{self.variant} vs {self.baseline}: {self.text}"


def verdict_from_ratios(variant: str, baseline: str, ratios: Sequence[float], *,
                        resolution: float = RESOLUTION) -> Verdict:
    """The :class:`Verdict` of per-round speed-ups (baseline time / variant time, one per paired round).

    Raises:
        ValueError: for fewer than 2 ratios, a non-positive ratio or a resolution outside (0, 1).
    """
    if len(ratios) < 2:
        raise ValueError(f"a verdict needs at least 2 paired rounds, got {len(ratios)}")
    if any(not (r > 0 and math.isfinite(r)) for r in ratios):
        raise ValueError(f"speed-up ratios must be positive and finite, got {list(ratios)}")
    if not 0 < resolution < 1:
        raise ValueError(f"resolution must be in (0, 1), e.g. 0.03 for 3%, got {resolution}")
    low, high, confidence = median_interval(ratios)
    return Verdict(variant, baseline, statistics.median(ratios), (low, high), resolution, len(ratios), confidence)


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """A distribution-free confidence interval of the median: ``(low, high, coverage)``.

    The k-th smallest and k-th largest values bound the median with probability 1 − 2·P(Binomial(n, ½) < k),
    whatever the distribution (the sign test's interval); k is the largest that keeps that at ``confidence``.
    With fewer than 6 values no k reaches 95%: the interval is then the whole range, and ``coverage`` says how
    much less it holds (e.g. 0.875 for 4 values).

    Why not the quartiles: with 10 rounds of pure noise the quartiles of the ratios exclude 1 about a third of the
    time, which would turn noise into "faster" or "slower"; this interval does so at most 5% of the time.
    """
    xs = sorted(values)
    n = len(xs)
    below = 0.0  # P(Binomial(n, 1/2) <= k - 1)
    k, coverage = 1, 1 - 2 * 0.5**n
    for j in range(1, n // 2 + 1):
        below += math.comb(n, j - 1) * 0.5**n
        if 1 - 2 * below >= confidence:
            k, coverage = j, 1 - 2 * below
        else:
            break
    return xs[k - 1], xs[n - k], coverage


# ── Comparing variants: alternating rounds ──────────────────────────────────────────────────────────────────

#: what a recorded figure of a comparison is: a variant's per-call time, its speed-up or its rate
Quantity = Literal["time", "speedup", "rate"]


@dataclass(frozen=True)
class Work:
    """What one call does, to turn times into a rate: ``amount`` of ``unit`` (bytes → GB/s, FLOP → TFLOP/s,
    anything else → ``unit``/s)."""

    amount: float | Mapping[str, float]
    unit: str

    def of(self, variant: str) -> float:
        if isinstance(self.amount, Mapping):
            if variant not in self.amount:
                raise ValueError(f"no amount of work given for variant {variant!r}")
            return float(self.amount[variant])
        return float(self.amount)

    @property
    def rate_unit(self) -> str:
        return {"bytes": "GB/s", "FLOP": "TFLOP/s"}.get(self.unit, f"{self.unit}/s")

    def rate(self, variant: str, seconds: float) -> float:
        scale = {"bytes": 1e9, "FLOP": 1e12}.get(self.unit, 1.0)
        return self.of(variant) / seconds / scale


def _work(bytes_moved, flops, items) -> Work | None:
    given = [w for w in (bytes_moved, flops, items) if w is not None]
    if len(given) > 1:
        raise ValueError("give at most one of bytes_moved, flops and items")
    if bytes_moved is not None:
        return Work(bytes_moved, "bytes")
    if flops is not None:
        return Work(flops, "FLOP")
    if items is not None:
        if not (isinstance(items, tuple) and len(items) == 2 and isinstance(items[1], str)):
            raise ValueError(f"items is (count, 'unit'), e.g. (4000, 'images'), got {items!r}")
        return Work(items[0], items[1])
    return None


def _limit_value(limit) -> float | None:
    if limit is None:
        return None
    value = limit.value if isinstance(limit, Rate) else float(limit)
    if not value > 0:
        raise ValueError(f"a limit must be positive, got {value}")
    return value


@dataclass(frozen=True)
class Comparison:
    """Variants timed together in alternating rounds: one :class:`Timing` per variant (one block per round) and
    one :class:`Verdict` per variant against the baseline, from the paired rounds. Build it with :func:`compare`
    (or :meth:`from_rounds` for rounds timed elsewhere, e.g. by alternating ``torchrun`` launches).

    In Jupyter a cell that ends with a Comparison shows its table and verdicts.
    """

    timings: dict[str, Timing]
    baseline: str
    resolution: float = RESOLUTION
    work: Work | None = None
    limit: float | None = None
    limit_name: str = "limit"
    title: str | None = None

    # ── construction from rounds measured elsewhere ──
    @classmethod
    def from_rounds(cls, rounds: Mapping[str, Sequence[float]], *, baseline: str | None = None,
                    resolution: float = RESOLUTION, device: str = "", calls_per_round: int = 1,
                    **options) -> Comparison:
        """A comparison of per-call times measured elsewhere in alternating rounds: ``rounds[variant][i]`` is the
        variant's per-call seconds in round ``i``; every variant has the same number of rounds (≥ 2).

        Raises:
            ValueError: for fewer than two variants, unequal or too few rounds, a non-positive time, or a baseline
                that is not a variant.
        """
        if len(rounds) < 2:
            raise ValueError(f"a comparison needs at least two variants, got {list(rounds)}")
        lengths = {name: len(times) for name, times in rounds.items()}
        if len(set(lengths.values())) != 1 or min(lengths.values()) < 2:
            raise ValueError(f"every variant needs the same number of rounds, at least 2: got {lengths}")
        for name, times in rounds.items():
            if any(not (t > 0 and math.isfinite(t)) for t in times):
                raise ValueError(f"times must be positive and finite: {name!r} has {list(times)}")
        baseline = next(iter(rounds)) if baseline is None else baseline
        if baseline not in rounds:
            raise ValueError(f"baseline {baseline!r} is not one of the variants {list(rounds)}")
        timings = {name: _timing_from(name, list(times), calls_per_round, device) for name, times in rounds.items()}
        return cls(timings, baseline, resolution, **options)

    # ── the numbers ──
    @property
    def variants(self) -> list[str]:
        return list(self.timings)

    @property
    def rounds(self) -> int:
        return len(self.timings[self.baseline].block_times_s)

    def ratios(self, variant: str, against: str | None = None) -> list[float]:
        """Per-round speed-ups of ``variant``: the per-call time of ``against`` (default: the baseline) over the
        variant's, round by round."""
        base = self._timing(against or self.baseline).block_times_s
        return [b / v for b, v in zip(base, self._timing(variant).block_times_s, strict=True)]

    def verdict(self, variant: str | None = None, against: str | None = None) -> Verdict:
        """The verdict of ``variant`` (default: the only, or last, variant besides the baseline) against the
        baseline, or against another variant of the same rounds (``against``: the stage a change was made to)."""
        variant = self._default(variant)
        against = against or self.baseline
        return verdict_from_ratios(variant, against, self.ratios(variant, against), resolution=self.resolution)

    def speedup(self, variant: str | None = None, against: str | None = None) -> float:
        """The median per-round speed-up of ``variant`` over the baseline (or ``against``): the number every
        verdict uses."""
        return self.verdict(variant, against).speedup

    def time_s(self, variant: str | None = None) -> float:
        """The per-call seconds of ``variant``: the baseline's median, and for every other variant the baseline's
        median divided by the variant's speed-up (the median of the per-round ratios). So a table, a rate, a
        recorded time and a verdict all rest on one number per variant, and two close variants are never ordered
        one way by their times and the other way by their speed-ups. (A variant's own median can differ from it by
        the drift the alternating rounds cancel.) Its band: :meth:`time_band_s`."""
        variant = self._default(variant)
        base = self._timing(self.baseline).median_s
        return base if variant == self.baseline else base / self.speedup(variant)

    def time_band_s(self, variant: str | None = None) -> tuple[float, float]:
        """The band of :meth:`time_s`: the baseline's quartiles, and for every other variant the baseline's median
        over the ends of its speed-up's band (:class:`Verdict`), so the band belongs to the number it surrounds."""
        variant = self._default(variant)
        if variant == self.baseline:
            return self._timing(variant).quartiles_s
        base, (lo, hi) = self._timing(self.baseline).median_s, self.verdict(variant).band
        return base / hi, base / lo

    def rate(self, variant: str | None = None) -> float:
        """Work per second of ``variant`` at its median time (GB/s, TFLOP/s or items/s).

        Raises:
            ValueError: when the comparison was given no work (bytes_moved, flops or items).
        """
        if self.work is None:
            raise ValueError("this comparison has no rate: pass bytes_moved=, flops= or items= to compare()")
        variant = self._default(variant) if variant is None else variant
        return self.work.rate(variant, self.time_s(variant))

    @property
    def fastest(self) -> str:
        """The variant with the shortest time per call (:meth:`time_s`: the largest speed-up)."""
        return min(self.timings, key=self.time_s)

    def _timing(self, variant: str) -> Timing:
        if variant not in self.timings:
            raise KeyError(f"{variant!r} is not a variant of this comparison: {self.variants}")
        return self.timings[variant]

    def _default(self, variant: str | None) -> str:
        if variant is not None:
            self._timing(variant)
            return variant
        others = [v for v in self.timings if v != self.baseline]
        return others[-1]

    # ── what a reader sees ──
    def rows(self) -> list[dict[str, object]]:
        """Table rows: variant, median time per call, its band, rate and % of the limit (when given), speed-up
        over the baseline and the verdict."""
        rows = []
        for name in self.timings:
            q1, q3 = self.time_band_s(name)
            row: dict[str, object] = {"variant": name, "per call": format_seconds(self.time_s(name)),
                                      "band": f"{format_seconds(q1)}–{format_seconds(q3)}"}
            if self.work is not None:
                rate = self.rate(name)
                row[self.work.rate_unit] = _number(rate)
                if self.limit is not None:
                    row[f"% of {self.limit_name}"] = percent_text(percent_of(rate, self.limit))
            if name == self.baseline:
                row["speed-up"], row["verdict"] = "1.00×", "baseline"
            else:
                v = self.verdict(name)
                row["speed-up"], row["verdict"] = ratio_text(v.speedup), v.short
            rows.append(row)
        return rows

    def table(self) -> None:
        """Print the table (the title says rounds and resolution)."""
        from utils.plot import format_table

        print(format_table(self.rows(), title=self._title()))

    def _title(self) -> str:
        head = f"{self.title}: " if self.title else ""
        return (f"{head}{len(self.timings)} variants timed in {self.rounds} alternating rounds "
                f"(speed-up: median of the per-round ratios; per call: the baseline's ÷ speed-up, band from the "
                f"speed-up's; verdicts resolve ±{self.resolution:.0%})")

    def plot(self, *, title: str | None = None, log: bool | None = None):
        """Horizontal bars of the median time per call (or the rate, when work was given), each with its band;
        the limit as a line. A log axis is chosen when the bars span more than 20× (``log`` forces it); the title
        then says so."""
        from utils.plot import bar

        names = self.variants
        if self.work is not None:
            values = [self.rate(n) for n in names]
            bands = [tuple(self.work.rate(n, s) for s in reversed(self.time_band_s(n))) for n in names]
            label = self.work.rate_unit
        else:
            values = [self.time_s(n) * 1e3 for n in names]
            bands = [tuple(s * 1e3 for s in self.time_band_s(n)) for n in names]
            label = "time per call (ms), median and band"
        errors = [(max(v - lo, 0.0), max(hi - v, 0.0)) for v, (lo, hi) in zip(values, bands, strict=True)]
        log = log if log is not None else max(values) > 20 * min(values)
        title = title or self.title or "Variants timed in alternating rounds"
        return bar(names, values, errors=errors, horizontal=True, ylabel=label, log=log,
                   reference=self.limit if self.work is not None else None,
                   reference_label=self.limit_name if self.limit is not None else None,
                   title=title + (" (log scale)" if log and "log" not in title else ""))

    def __str__(self) -> str:
        from utils.plot import format_table

        lines = [format_table(self.rows(), title=self._title())]
        lines += [str(self.verdict(v)) for v in self.timings if v != self.baseline]
        return "\n".join(lines)

    def _repr_pretty_(self, printer, cycle: bool) -> None:  # IPython: a cell ending with a Comparison shows it
        printer.text(str(self))

    # ── recording ──
    def record(self, figures: Mapping[str, str | tuple[str, Quantity]]) -> None:
        """Record figures with :func:`utils.results.record`: ``{figure name: variant}`` records the variant's
        speed-up over the baseline (unit "x", with its band, and the band's coverage where few rounds leave it
        below 95%), or for the baseline its time per call (unit "s");
        ``{figure name: (variant, quantity)}`` picks the quantity: "time", "speedup" or "rate". A rate carries the
        comparison's limit; a time carries it as the least time the work takes at the limit's rate.

        Raises:
            ValueError: for an unknown quantity or a rate without work; KeyError for an unknown variant.
        """
        from utils import results

        for name, spec in figures.items():
            variant, quantity = (spec, None) if isinstance(spec, str) else spec
            self._timing(variant)
            quantity = quantity or ("time" if variant == self.baseline else "speedup")
            if quantity == "time":  # with a rate limit, the limit as a time: the least this work can take
                floor = None
                if self.limit is not None and self.work is not None:
                    floor = self.time_s(variant) * self.rate(variant) / self.limit  # the work at the limit's rate
                results.record(name, self.time_s(variant), "s", band=self.time_band_s(variant), limit=floor,
                               limit_name=self.limit_name if floor is not None else None)
            elif quantity == "speedup":
                v = self.verdict(variant)
                results.record(name, v.speedup, "x", band=v.band, coverage=v.confidence if v.few_rounds else None)
            elif quantity == "rate":
                band = self.time_band_s(variant)
                lo, hi = (self.work.rate(variant, s) for s in reversed(band)) if self.work else (0, 0)
                results.record(name, self.rate(variant), self.work.rate_unit, band=(lo, hi), limit=self.limit,
                               limit_name=self.limit_name if self.limit is not None else None)
            else:
                raise ValueError(f"record(): quantity is 'time', 'speedup' or 'rate', got {quantity!r}")


def _number(x: float) -> str:
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.3g}"


def compare(
    variants: Mapping[str, Callable[[], object]],
    *,
    baseline: str | None = None,
    rounds: int | None = None,
    min_run_time: float = 1.0,
    warmup: int = 2,
    resolution: float = RESOLUTION,
    device: torch.device | str | None = None,
    bytes_moved: float | Mapping[str, float] | None = None,
    flops: float | Mapping[str, float] | None = None,
    items: tuple[float, str] | None = None,
    limit: Rate | float | None = None,
    limit_name: str | None = None,
    title: str | None = None,
    record: Mapping[str, str | tuple[str, Quantity]] | None = None,
    clock: Callable[[], float] | None = None,
    progress: bool | None = None,
) -> Comparison:
    """Time every variant in alternating rounds and return the :class:`Comparison` (one number and one verdict
    per variant). The course's one way to say "A is faster than B".

    Args:
        variants: name → a callable without arguments (close over the inputs: the same inputs for every variant).
            Two at least; the first is the baseline unless ``baseline`` names another.
        rounds: paired rounds; each times one block of every variant, the order reversed every other round.
            Default: 12 on a GPU, 6 on a CPU (CPU runs are CI's, sized to finish quickly; 6 rounds still give a 97%
            interval, the whole range).
        min_run_time: seconds of measurement in all (after warm-up); a block lasts about
            ``min_run_time / (rounds × variants)``, at least one call.
        warmup: calls of each variant first (compilation, autotuning, allocator growth stay out).
        resolution: the smallest effect the verdict should resolve (0.03: 3%).
        bytes_moved / flops / items: the work of one call (a number, or one per variant), for a rate column:
            GB/s, TFLOP/s, or ``(count, "images")`` → images/s.
        limit, limit_name: a rate measured on this machine (a :class:`Rate` or a number in the rate's unit) to put
            each rate against ("% of copy bandwidth").
        title: what is compared, for the table and plot.
        record: figures to record (:meth:`Comparison.record`).
        clock: seconds since any origin; default: synchronise the device, then ``time.perf_counter()``.
        progress: show a progress bar over the rounds; default: when the measurement will take over 5 s.

    Raises:
        TypeError: if a variant is not callable.
        ValueError: for fewer than two variants, fewer than 2 rounds, a non-positive min_run_time, a negative
            warmup, an unknown baseline or a resolution outside (0, 1).
        utils.profile.ProfiledProcessError: when a profiler session already ran in this process.
    """
    if not isinstance(variants, Mapping) or len(variants) < 2:
        raise ValueError("compare() needs a dict of at least two variants, name → callable")
    for name, fn in variants.items():
        _check_callable(fn, f"compare(): variant {name!r}")
    device = get_device(device)
    rounds = rounds if rounds is not None else (12 if device.type == "cuda" else 6)
    if rounds < 2 or min_run_time <= 0 or warmup < 0:
        raise ValueError(f"compare(): need rounds >= 2, min_run_time > 0, warmup >= 0 "
                         f"(got {rounds}, {min_run_time}, {warmup})")
    if not 0 < resolution < 1:
        raise ValueError(f"resolution must be in (0, 1), e.g. 0.03 for 3%, got {resolution}")
    baseline = next(iter(variants)) if baseline is None else baseline
    if baseline not in variants:
        raise ValueError(f"baseline {baseline!r} is not one of the variants {list(variants)}")
    work = _work(bytes_moved, flops, items)
    limit_value = _limit_value(limit)
    assert_not_profiled("utils.bench.compare")
    clock = clock or _synchronised_clock(device)
    names = list(variants)

    for name in names:
        for _ in range(warmup):
            variants[name]()
    synchronize(device)
    per_block_s = min_run_time / (rounds * len(names))
    calls = {name: _calls_per_block(per_block_s, _probe(variants[name], clock, 2 * per_block_s)) for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    order = list(range(rounds))
    if progress is None:
        progress = rounds * len(names) * per_block_s > 5.0
    if progress:
        from tqdm.auto import tqdm

        order = tqdm(order, desc=f"{title or 'comparison'}: rounds", leave=False)
    for r in order:
        for name in (names if r % 2 == 0 else reversed(names)):
            times[name].append(_block(variants[name], calls[name], clock))
    timings = {name: _timing_from(name, times[name], calls[name], device) for name in names}
    result = Comparison(timings, baseline, resolution, work, limit_value,
                        limit_name or (limit.name if isinstance(limit, Rate) else "limit"), title)
    if record:
        result.record(record)
    return result


# ── A sweep: one comparison per size, each variant checked first ───────────────────────────────────────────


@dataclass(frozen=True)
class Sweep:
    """Rates of several variants over sizes, each size a :class:`Comparison`. Build it with :func:`sweep`."""

    sizes: list[int]
    comparisons: list[Comparison]
    checked: dict[str, str]  # variant → what its outputs were checked against, or why not
    size_label: str = "size"
    format_size: Callable[[int], str] = str
    title: str | None = None

    @property
    def variants(self) -> list[str]:
        return self.comparisons[0].variants

    @property
    def unit(self) -> str:
        work = self.comparisons[0].work
        return work.rate_unit if work is not None else "s"

    def rates(self, variant: str) -> list[float]:
        """The variant's rate at every size (its time per call, in seconds, when no work was given)."""
        if self.comparisons[0].work is None:
            return [c.time_s(variant) for c in self.comparisons]
        return [c.rate(variant) for c in self.comparisons]

    def rows(self) -> list[dict[str, object]]:
        rows = []
        for size, c in zip(self.sizes, self.comparisons, strict=True):
            row: dict[str, object] = {self.size_label: self.format_size(size)}
            for v in self.variants:
                row[f"{v} ({self.unit})"] = _number(c.rate(v) if c.work else c.time_s(v))
            for v in self.variants[1:] if len(self.variants) == 2 else []:
                row["verdict"] = c.verdict(v).short
            rows.append(row)
        return rows

    def table(self) -> None:
        from utils.plot import format_table

        print(format_table(self.rows(), title=self._title()))
        for variant, how in self.checked.items():
            print(f"  {variant}: {how}")

    def _title(self) -> str:
        c = self.comparisons[0]
        limit = f"; {c.limit_name} {_number(c.limit)} {self.unit}" if c.limit is not None else ""
        return (f"{self.title + ': ' if self.title else ''}{len(self.variants)} variants × {len(self.sizes)} sizes, "
                f"each size timed in {c.rounds} alternating rounds{limit}")

    def plot(self, *, title: str | None = None, logy: bool = False):
        """One line per variant, rate against size (log x), the limit as a dashed line."""
        from utils.plot import curves

        c = self.comparisons[0]
        hlines = {f"{c.limit_name} ({_number(c.limit)} {self.unit})": c.limit} if c.limit is not None else None
        return curves({v: (self.sizes, self.rates(v)) for v in self.variants}, xlabel=f"{self.size_label} (log scale)",
                      ylabel=self.unit, logx=True, logy=logy, hlines=hlines, xticks=self.format_size,
                      title=title or self.title or f"{self.unit} by {self.size_label}")

    def __str__(self) -> str:
        from utils.plot import format_table

        return "\n".join([format_table(self.rows(), title=self._title()),
                          *(f"  {v}: {how}" for v, how in self.checked.items())])

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        printer.text(str(self))


def sweep(
    factories: Mapping[str, Callable[[int], Callable[[], object]]],
    sizes: Sequence[int],
    *,
    reference: Callable[[int], object] | None = None,
    reference_variant: str | None = None,
    check: Callable[[object, object], None] | None = None,
    bytes_moved: Callable[[int], float] | None = None,
    flops: Callable[[int], float] | None = None,
    limit: Rate | float | None = None,
    limit_name: str | None = None,
    size_label: str = "size",
    format_size: Callable[[int], str] = str,
    title: str | None = None,
    rounds: int = 6,
    min_run_time: float = 0.3,
    resolution: float = RESOLUTION,
    device: torch.device | str | None = None,
    record: Mapping[str, str] | None = None,
    progress: bool = True,
) -> Sweep:
    """Sizes × variants → a rate per variant and size, against a limit measured here, each variant checked first.

    Args:
        factories: name → a function of the size that prepares the inputs and returns the call to time.
        sizes: the sizes, in increasing order.
        reference: a function of the size that returns the expected output; every variant's output at every size is
            checked against it before timing (``check``, default ``torch.testing.assert_close``). Without it the
            sweep says that nothing was checked.
        reference_variant: the variant whose output ``reference`` returns (e.g. bf16 against fp8): checking it would
            compare it with itself, so it is not checked and is said to be the reference.
        bytes_moved / flops: the work of one call as a function of the size (→ GB/s or TFLOP/s).
        limit, limit_name: the rate to put every point against (a :class:`Rate` measured here, or a number).
        rounds, min_run_time, resolution: per size, as in :func:`compare`.
        record: ``{figure name: variant}``: records that variant's rate at the largest size (with the limit).

    Raises:
        ValueError: for no sizes, sizes out of order, fewer than two variants, a ``reference_variant`` that is not
            one of them, or a variant whose output differs from the reference (the message names the variant and
            the size).
    """
    if not sizes or list(sizes) != sorted(sizes):
        raise ValueError(f"sweep() needs sizes in increasing order, got {list(sizes)}")
    if len(factories) < 2:
        raise ValueError("sweep() needs at least two variants")
    if reference_variant is not None and reference_variant not in factories:
        raise ValueError(f"sweep(): reference_variant {reference_variant!r} is not one of {list(factories)}")
    check = check or (lambda actual, expected: torch.testing.assert_close(actual, expected))
    comparisons = []
    steps = sizes
    if progress:
        from tqdm.auto import tqdm

        steps = tqdm(sizes, desc=f"{title or 'sweep'}: sizes", leave=False)
    for size in steps:
        fns = {name: make(size) for name, make in factories.items()}
        if reference is not None:
            expected = reference(size)
            for name, fn in fns.items():
                if name == reference_variant:
                    continue
                try:
                    check(fn(), expected)
                except AssertionError as err:
                    raise ValueError(f"sweep(): {name!r} differs from the reference at {size_label} "
                                     f"{format_size(size)}: {str(err).splitlines()[0]}") from err
        comparisons.append(compare(fns, rounds=rounds, min_run_time=min_run_time, resolution=resolution,
                                   device=device, limit=limit, limit_name=limit_name, title=title,
                                   bytes_moved=bytes_moved(size) if bytes_moved else None,
                                   flops=flops(size) if flops else None, progress=False))
        del fns
    checked = {name: ("the reference, not checked: the others are checked against it" if name == reference_variant
                      else "checked against the reference at every size" if reference is not None
                      else "not checked: no reference was given") for name in factories}
    result = Sweep(list(sizes), comparisons, checked, size_label, format_size, title)
    if record:
        largest = comparisons[-1]
        largest.record({name: (variant, "rate" if largest.work else "time") for name, variant in record.items()})
    return result


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
    notes: dict[str, object] = field(default_factory=dict)

    def __str__(self) -> str:
        text = f"{self.name}: {figure(self.value)} {self.unit} ({format_seconds(self.timing.median_s)} per call)"
        if self.conditions is not None and self.conditions.samples:
            text += f"; {self.conditions}"
        return text

    def record(self, name: str, **kwargs) -> Rate:
        """Record this rate as a headline figure (:func:`utils.results.record`); returns itself."""
        from utils import results

        results.record(name, self.value, self.unit, band=_rate_band(self), **kwargs)
        return self


def _rate_band(rate: Rate) -> tuple[float, float]:
    q1, q3 = rate.timing.quartiles_s
    return rate.value * rate.timing.median_s / q3, rate.value * rate.timing.median_s / q1


#: Clock readings a burst needs before the clock is put against the drop from burst to sustained.
MIN_CLOCK_SAMPLES = 8


def burst_vs_sustained(burst: Rate, sustained: Rate, *, label: str | None = None, resolution: float = 0.03) -> str:
    """The verdict on a burst and a sustained rate of the same work (:func:`utils.bench.matmul_rate`), printed from
    their numbers: does this GPU hold its rate under sustained work, and does the SM clock explain a drop?

    The two are measured under different conditions on purpose (after a rest; after seconds of heating), so they
    are not a paired comparison (``utils.bench.compare``): their rates, bands (from the quartiles of their blocks)
    and clocks are put side by side. The outcome is one of:

    * **holds its rate**: the sustained rate lies within ± ``resolution`` of the burst;
    * **not resolved**: further apart than that, but the two bands overlap;
    * **falls** (or **rises**) to a share of the burst.

    A fall is put against the SM clock's: the same share (within 5 points) means the clock, held back by a power or
    thermal limit, accounts for it; a smaller fall than the clock's means that per clock cycle the sustained run did
    more work, so something besides the clock held the burst back. That per-clock reading is made only when both
    multiplied the same size: a burst is sized so that one product lasts at most 5 ms, so on a slow GPU it may
    multiply smaller matrices, which run further below the peak — the text then says so. ``label`` (e.g. "bf16
    matmul") starts the text.
    """
    b, s, unit = burst.value, sustained.value, sustained.unit
    ratio = s / b
    (b_lo, b_hi), (s_lo, s_hi) = _rate_band(burst), _rate_band(sustained)
    head = f"{label + ': s' if label else 'S'}ustained {s:,.4g} {unit} is {ratio:.0%} of the burst's {b:,.4g}"
    if abs(ratio - 1) <= resolution:
        outcome, text = "holds", f"this device holds its rate under sustained work (within ±{resolution:.0%})"
    elif b_lo <= s_hi and s_lo <= b_hi:
        outcome, text = "unresolved", (f"but their bands overlap (burst {b_lo:,.4g}–{b_hi:,.4g}, sustained "
                                       f"{s_lo:,.4g}–{s_hi:,.4g}): the difference is not resolved beyond their noise")
    else:
        outcome = "falls" if ratio < 1 else "rises"
        text = f"the rate {outcome} under sustained work"
    lines = [f"{head}{',' if outcome == 'unresolved' else ':'} {text}."]
    n_burst, n_sustained = burst.notes.get("n"), sustained.notes.get("n")
    same_size = n_burst == n_sustained
    bc = burst.conditions.sm_clock_mhz if burst.conditions else None
    sc = sustained.conditions.sm_clock_mhz if sustained.conditions else None
    if bc and sc:
        clock_ratio = sc / bc
        held = ", ".join(sustained.conditions.reasons()) or "nothing the driver reports"
        power, cap = sustained.conditions.power_w, sustained.conditions.power_limit_w
        watts = ""
        if power:
            watts = f"; board power {power:,.0f} W" + (f" of a {cap:,.0f} W limit" if cap else "") + (
                " (NVML's readings may overshoot the cap by a few percent)" if cap and power > cap else "")
        lines.append(f"SM clock: {bc:,.0f} MHz in the burst, {sc:,.0f} MHz sustained ({clock_ratio:.0%}), held back "
                     f"by {held}{watts}.")
        few = len(burst.conditions.samples) < MIN_CLOCK_SAMPLES
        if outcome == "falls" and same_size and few:
            lines.append(f"The burst gave {len(burst.conditions.samples)} clock readings, too few to tell whether the "
                         "clock accounts for the drop.")
        elif outcome == "falls" and same_size:
            if abs(clock_ratio - ratio) < 0.05:
                lines.append("The clock accounts for the drop: the rate fell as far as the clock did.")
            elif ratio > clock_ratio:
                lines.append(f"The rate fell less than the clock: per GHz the sustained run did more work "
                             f"({s / sc * 1e3:,.4g} against {b / bc * 1e3:,.4g} {unit} per GHz in the burst): "
                             "either something besides the clock held the burst back, or the burst's few clock "
                             "readings overstate its clock.")
            else:
                lines.append("The rate fell further than the clock: something besides the SM clock (the memory "
                             "clock, another process) slowed the sustained run.")
    else:
        conditions = sustained.conditions
        why = (conditions.unavailable if conditions is not None else None) or "nothing was sampled"
        lines.append(f"No clock readings ({why}): the two rates are the only evidence.")
    if not same_size:
        lines.append(f"The burst multiplied {n_burst}×{n_burst} matrices (sized so that one product lasts at most "
                     f"5 ms), the sustained run {n_sustained}×{n_sustained}: a smaller product runs further below the "
                     "peak, so the two rates differ by size as well as by clock.")
    return "\n".join(lines)


def copy_bandwidth(device: torch.device | str | None = None, *, nbytes: int | None = None,
                   record: str | None = None) -> Rate:
    """Device-memory copy bandwidth: ``dst.copy_(src)`` on a buffer far larger than the caches.

    Counts bytes read plus bytes written (2 × nbytes), the convention of STREAM-copy and of every
    "% of copy bandwidth" in this course. Default size: 1 GiB on a GPU (fits any card with 4 GiB), 256 MiB on CPU.
    ``record``: a figure name to record the rate under.
    """
    device = get_device(device)
    if nbytes is None:
        nbytes = 1 << 30 if device.type == "cuda" else 256 << 20
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    with gpu_conditions(device) as conditions:
        timing = bench(lambda: dst.copy_(src), label="copy", device=device, min_run_time=0.3)
    rate = Rate("copy bandwidth (read + write)", gbps(2 * src.nbytes, timing), "GB/s", timing, conditions)
    return rate.record(record) if record else rate


def _burst_n(a_b: Callable[[int], tuple[torch.Tensor, torch.Tensor]], n: int, device: torch.device,
             budget_s: float) -> tuple[int, torch.Tensor, torch.Tensor]:
    """The largest n (halving from ``n``, not below 1024) whose product lasts at most ``budget_s``: a burst must be
    short on a slow GPU too (an 8192³ fp32 product takes about a quarter of a second on a T4)."""
    while True:
        a, b = a_b(n)
        for _ in range(2):  # cuBLAS handle and kernel selection
            a @ b
        synchronize(device)
        start = time.perf_counter()
        a @ b
        synchronize(device)
        if time.perf_counter() - start <= budget_s or n <= 1024:
            return n, a, b
        n //= 2


def matmul_rate(
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    *,
    n: int | None = None,
    tf32: bool = False,
    kind: Literal["sustained", "burst"] = "sustained",
    record: str | None = None,
) -> Rate:
    """Dense matmul rate of an n×n×n product on random data (2·n³ FLOP per call), with the GPU's state meanwhile.

    ``kind="sustained"`` (default): half a second of products to heat up, then at least :data:`SUSTAINED_S`
    seconds measured — the rate a long job holds under the GPU's power and thermal limits, and the one later
    notebooks divide by. ``kind="burst"``: after a one-second rest, about :data:`BURST_S` seconds of products —
    the boost-clock rate a short job sees; n is halved until one product lasts at most a tenth of that, so the
    burst stays short on a slow GPU. On a CPU both are shorter (0.5 s and 0.1 s).

    ``tf32=True`` lets fp32 matmuls use TF32 tensor cores (``torch.set_float32_matmul_precision("high")``);
    the previous setting is restored afterwards. Default n: 8192 on a GPU, 1024 on CPU. ``record``: a figure name
    to record the rate under.

    Raises:
        ValueError: for a ``kind`` other than "sustained" or "burst".
    """
    if kind not in ("sustained", "burst"):
        raise ValueError(f"kind must be 'sustained' or 'burst', got {kind!r}")
    device = get_device(device)
    on_gpu = device.type == "cuda"
    n = n or (8192 if on_gpu else 1024)

    def operands(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))

    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    name = "tf32" if (tf32 and dtype == torch.float32) else str(dtype).removeprefix("torch.")
    try:
        if kind == "burst":
            n, a, b = _burst_n(operands, n, device, BURST_S / 10) if on_gpu else (n, *operands(n))
            time.sleep(1.0 if on_gpu else 0.0)
            with gpu_conditions(device, interval_s=0.004) as conditions:  # about a dozen readings in a 50 ms burst
                timing = bench(lambda: a @ b, label=f"matmul {name}", device=device, warmup=1, min_blocks=5,
                               min_run_time=BURST_S if on_gpu else 0.1)
        else:
            a, b = operands(n)
            heat_until = time.perf_counter() + (0.5 if on_gpu else 0.05)
            while time.perf_counter() < heat_until:
                a @ b
                synchronize(device)
            with gpu_conditions(device) as conditions:
                timing = bench(lambda: a @ b, label=f"matmul {name}", device=device, warmup=0, min_blocks=10,
                               min_run_time=SUSTAINED_S if on_gpu else 0.5)
    finally:
        torch.set_float32_matmul_precision(previous)
    rate = Rate(f"matmul {name} (n={n}), {kind}", tflops(2 * n**3, timing), "TFLOP/s", timing, conditions,
                {"n": n, "kind": kind})
    return rate.record(record) if record else rate


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
