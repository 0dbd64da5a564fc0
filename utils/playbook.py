"""The performance playbook: the tips the guides give, what each promises and which bottleneck it removes; whether
a promise held where it was measured; and the profiler reading that says which tip to try next.

    findings = utils.playbook.Findings()
    findings.measured("tf32", utils.bench.compare(fp32_timing, tf32_timing), why="...")  # prints the verdict
    utils.plot.table(findings.rows())                     # claim · what the guide promises · measured here · holds?
    print(utils.playbook.diagnose(profile))               # "launch-bound: ... → try CUDA graphs (...)"

:func:`diagnose` reads a :class:`utils.profile.StepProfile`: a step whose GPU waits for the host at least half the
time is *launch-bound* and gains from fewer launches (CUDA graphs, fused optimizers, compile); otherwise the kind of
kernel that takes the most GPU time names the tip (convolutions: ``channels_last`` and ``cudnn.benchmark``; matmuls:
TF32 or bf16 autocast; attention: a fused SDPA backend; elementwise and reductions: ``torch.compile``'s fusion).
On a CPU only the tips that exist there are named.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from utils.bench import Comparison, format_seconds
from utils.profile import Kernel, StepProfile, kind_of


@dataclass(frozen=True)
class Tip:
    """One tip of the playbook: what to change, what the guides promise, and which bottleneck it removes."""

    key: str
    name: str
    promise: str  # what the guide promises, in its words ("beyond the guide" tips: what to expect)
    promised_speedup: float | None  # the least speed-up the promise states; None where it names no number
    addresses: str  # the bottleneck it removes: launch, matmul, conv, attention, other, data, or "" (behaviour)
    how: str  # the change, in one line of code
    on_cpu: bool  # whether the tip exists on a CPU


TIPS: dict[str, Tip] = {t.key: t for t in (
    Tip("tf32", "TF32 matmuls", "3× faster matmuls, minimal accuracy loss", 3.0, "matmul",
        "torch.set_float32_matmul_precision('high')", False),
    Tip("channels_last", "channels_last", "10–30% faster convolutions", 1.1, "conv",
        "model.to(memory_format=torch.channels_last)", True),
    Tip("cudnn_benchmark", "cudnn.benchmark", "auto-tuned convolutions, faster with fixed input sizes", None, "conv",
        "torch.backends.cudnn.benchmark = True", False),
    Tip("pinned_memory", "pinned memory + non_blocking", "faster CPU→GPU transfers", None, "data",
        "DataLoader(..., pin_memory=True); x.to(device, non_blocking=True)", False),
    Tip("set_to_none", "zero_grad(set_to_none=True)", "faster: it avoids a memset", None, "launch",
        "optimizer.zero_grad(set_to_none=True)", True),
    Tip("compile", "torch.compile", "20–40% faster with zero code changes", 1.2, "other", "torch.compile(model)", True),
    Tip("to_device", ".to(device) vs .cuda()", "the same copy; .to(device) also runs without a GPU", None, "",
        "x.to(device)", True),
    Tip("cuda_graphs", "CUDA graphs", "(beyond the guide) launch overhead gone: faster launch-bound steps", None,
        "launch", "torch.cuda.graph / make_graphed_callables / utils.train.GraphedStep", False),
    Tip("fused_optimizer", "fused optimizer", "(beyond the guide) fewer optimizer kernels: a faster update", None,
        "launch", "torch.optim.AdamW(params, fused=True)", True),
    Tip("sdpa", "fused attention (SDPA)", "(beyond the guide) flash / memory-efficient attention faster than math",
        None, "attention", "F.scaled_dot_product_attention(q, k, v, is_causal=True)", True),
    Tip("determinism", "deterministic algorithms", "(beyond the guide) bit-identical runs, at a cost in speed", None,
        "", "torch.use_deterministic_algorithms(True)", True),
)}

#: The tips that address each bottleneck, best first (what :func:`diagnose` names).
TIPS_FOR: dict[str, tuple[str, ...]] = {
    "launch": ("cuda_graphs", "fused_optimizer", "compile"),
    "conv": ("channels_last", "cudnn_benchmark"),
    "matmul": ("tf32",),
    "attention": ("sdpa",),
    "other": ("compile",),
    "overhead": ("compile",),
}

#: Convolution kernels (cuDNN's implicit-GEMM, Winograd and FFT kernels, its fprop/dgrad/wgrad names) and operators.
CONV = re.compile(r"conv(?!ert)|fprop|dgrad|wgrad|winograd|implicit_(?:gemm|convolve)|fft2d_|flip_filter",
                  re.IGNORECASE)


def kind_of_kernel(name: str) -> str:
    """'conv', 'matmul', 'attention' or 'other': :func:`utils.profile.kind_of` with convolutions told apart."""
    return "conv" if CONV.search(name) else kind_of(name)


def time_by_class(profile: StepProfile) -> dict[str, float]:
    """Seconds per step of convolution, matmul, attention and other kernels (operators on a CPU)."""
    out = {"conv": 0.0, "matmul": 0.0, "attention": 0.0, "other": 0.0}
    for k in profile.kernels:
        out[kind_of_kernel(k.name)] += k.duration_us / 1e6 / profile.steps
    return out


def step_row(profile: StepProfile, label: str) -> dict[str, object]:
    """``profile.summary_row(label)`` with convolutions in a column of their own: :meth:`StepProfile.time_by_kind`
    counts cuDNN's implicit-GEMM convolution kernels (``xmma_fprop_implicit_gemm``, ...) as matmuls."""
    row = profile.summary_row(label)
    for kind in ("matmul", "attention", "other"):
        row.pop(kind, None)
    return row | {kind: format_seconds(seconds) for kind, seconds in time_by_class(profile).items()}


@dataclass(frozen=True)
class Diagnosis:
    """What bounds a step, and the tips that address it (best first; empty where none of them applies here)."""

    bound: str  # "launch-bound", "partly launch-bound", "GPU-bound", "overhead-bound", "compute-bound"
    largest: str  # "launch" (idle time), "overhead" (CPU: time between operators) or a kind of kernel
    share: float  # the share of the step (idle) or of the busy time (a kind of kernel) it takes
    tips: tuple[Tip, ...]
    on_gpu: bool

    @property
    def tip(self) -> Tip | None:
        """The first tip to try, or None."""
        return self.tips[0] if self.tips else None

    def __str__(self) -> str:
        where = {"launch": f"the GPU waits for the host {self.share:.0%} of the step",
                 "overhead": f"Python and dispatch between operators take {self.share:.0%} of the step"}.get(
            self.largest, f"{self.largest} {'kernels' if self.on_gpu else 'operators'} take {self.share:.0%} of "
                          f"the {'GPU' if self.on_gpu else 'operator'} time")
        if not self.tips:
            return f"{self.bound}: {where} → no tip of this playbook applies on this device"
        first, rest = self.tips[0], ", ".join(t.name for t in self.tips[1:])
        return (f"{self.bound}: {where} → try {first.name} ({first.how})" + (f"; also {rest}" if rest else ""))


def diagnose(profile: StepProfile) -> Diagnosis:
    """The largest bottleneck of a profiled step and the tips that address it.

    On a GPU: idle at least half the step → launch-bound (CUDA graphs, fused optimizer, compile); otherwise the kind
    of kernel with the most GPU time decides, and a step idle at least a fifth of the time is called partly
    launch-bound, with CUDA graphs added to its tips. On a CPU "idle" is Python and dispatch between operators:
    at least half of the step → overhead-bound (compile); otherwise the largest kind of operator decides, and only
    tips that exist on a CPU are named.

    Raises:
        TypeError: for anything but a StepProfile.
    """
    if not isinstance(profile, StepProfile):
        raise TypeError(f"diagnose() reads a utils.profile.StepProfile, got {type(profile).__name__}")
    kinds = time_by_class(profile)
    busy = sum(kinds.values())
    largest = max(kinds, key=kinds.get)
    share = kinds[largest] / busy if busy > 0 else 0.0
    idle = profile.idle_fraction
    if profile.on_gpu:
        if idle >= 0.5:
            return Diagnosis("launch-bound", "launch", idle, _tips("launch", True), True)
        keys = TIPS_FOR[largest] + (("cuda_graphs",) if idle >= 0.2 else ())
        bound = "partly launch-bound" if idle >= 0.2 else "GPU-bound"
        return Diagnosis(bound, largest, share, tuple(TIPS[k] for k in keys), True)
    if idle >= 0.5:
        return Diagnosis("overhead-bound", "overhead", idle, _tips("overhead", False), False)
    return Diagnosis("compute-bound", largest, share, _tips(largest, False), False)


def _tips(bottleneck: str, on_gpu: bool) -> tuple[Tip, ...]:
    return tuple(TIPS[k] for k in TIPS_FOR[bottleneck] if on_gpu or TIPS[k].on_cpu)


# ── Whether a promise held: findings, their table and their chart ──────────────────────────────────────────────


def speedup_band(comparison: Comparison) -> tuple[float, float]:
    """The speed-ups the middle halves of the two timings allow: (baseline Q1 / candidate Q3, baseline Q3 /
    candidate Q1). A band that straddles 1 is a difference within the noise."""
    (b1, b3), (c1, c3) = comparison.baseline.quartiles_s, comparison.candidate.quartiles_s
    return b1 / c3, b3 / c1


def holds(comparison: Comparison, tip: Tip, expected: Literal["faster", "slower", "same"] = "faster") -> str:
    """'yes', 'partly: …' or 'no: …': whether the measured comparison bears the tip's promise out."""
    outcome, speedup = comparison.outcome, comparison.speedup
    if outcome == expected:
        if expected == "faster" and tip.promised_speedup and speedup < tip.promised_speedup:
            return f"partly: faster, but under the promised {tip.promised_speedup:g}×"
        return "yes"
    if outcome == "same":
        return "no: no difference beyond the noise"
    return f"no: {comparison.short}"


@dataclass(frozen=True)
class Finding:
    """One row of the playbook's summary: a claim, what was measured, and whether it held."""

    tip: Tip
    label: str
    measured: str
    holds: str
    comparison: Comparison | None = None
    workload: str | None = None  # the model it was measured on ("MLP", ...); None for a benchmark of its own


class Findings:
    """The claims checked in one run, in order: each measured (a comparison), observed (behaviour) or skipped."""

    def __init__(self) -> None:
        self._found: dict[str, Finding] = {}

    def _add(self, finding: Finding) -> Finding:
        self._found[finding.label] = finding
        return finding

    def _tip(self, key: str) -> Tip:
        if key not in TIPS:
            raise KeyError(f"no tip {key!r}: choose one of {', '.join(TIPS)}")
        return TIPS[key]

    def measured(self, key: str, comparison: Comparison, *, label: str | None = None, why: str | None = None,
                 expected: Literal["faster", "slower", "same"] = "faster", workload: str | None = None) -> Finding:
        """Record a measured claim and print its verdict (with ``why``, the measured reason, when the expectation
        fails). ``workload`` names the model it was measured on, if any (see :meth:`measured_for`)."""
        if not isinstance(comparison, Comparison):
            raise TypeError(f"measured() takes a utils.bench.Comparison, got {type(comparison).__name__}")
        tip = self._tip(key)
        print(comparison.explain(expected, why=why))
        return self._add(Finding(tip, label or tip.name, comparison.short, holds(comparison, tip, expected),
                                 comparison, workload))

    def observed(self, key: str, measured: str, holds: str, *, label: str | None = None,
                 workload: str | None = None) -> Finding:
        """Record a claim about behaviour (not speed), with what was seen and whether it held."""
        tip = self._tip(key)
        return self._add(Finding(tip, label or tip.name, measured, holds, workload=workload))

    def skipped(self, key: str, reason: str, *, label: str | None = None, workload: str | None = None) -> Finding:
        """Record a claim not measured on this device, and print why."""
        tip = self._tip(key)
        finding = self._add(Finding(tip, label or tip.name, f"skipped: {reason}", "not measured here",
                                    workload=workload))
        print(f"{finding.label}: skipped — {reason}")
        return finding

    def measured_for(self, key: str, workload: str) -> str:
        """What this run timed of tip ``key`` on ``workload``, for a "measured here" column: that workload's own
        verdicts, each with its label ("torch.compile · MLP: 1.29× faster"); else a clear "not timed on <workload>"
        followed by what was timed elsewhere, each labelled ("torch.compile · MLP: 1.61× slower"); or "not timed in
        this run".

        Raises:
            KeyError: for an unknown tip.
        """
        self._tip(key)
        timed = [f for f in self if f.tip.key == key and f.comparison is not None]
        own = [f for f in timed if f.workload == workload]
        labelled = "; ".join(f"{f.label}: {f.measured}" for f in own or timed)
        if own:
            return labelled
        return f"not timed on {workload}; {labelled}" if timed else "not timed in this run"

    def __getitem__(self, label: str) -> Finding:
        return self._found[label]

    def __contains__(self, label: str) -> bool:
        return label in self._found

    def __iter__(self) -> Iterator[Finding]:
        return iter(self._found.values())

    def __len__(self) -> int:
        return len(self._found)

    def rows(self) -> list[dict[str, str]]:
        """Table rows: claim · what the guide promises · measured here · holds?"""
        if not self._found:
            raise ValueError("no findings recorded yet")
        return [{"claim": f.label, "what the guide promises": f.tip.promise, "measured here": f.measured,
                 "holds?": f.holds} for f in self]

    def chart(self, *, title: str):
        """Speed-up per measured claim on a log axis, each with its noise band (:func:`speedup_band`) and the line
        of no change; bars coloured by verdict. Returns a closed matplotlib Figure (None when nothing was timed)."""
        timed = [f for f in self if f.comparison is not None]
        if not timed:
            return None
        import matplotlib.pyplot as plt
        import matplotlib.ticker

        speedups = [f.comparison.speedup for f in timed]
        bands = [speedup_band(f.comparison) for f in timed]
        colours = {"faster": "#4C72B0", "slower": "#C44E52", "same": "#999999"}
        fig, ax = plt.subplots(figsize=(8.0, 0.45 * len(timed) + 1.8))
        rows = range(len(timed))
        ax.barh(rows, [s - 1 for s in speedups], left=1.0, color=[colours[f.comparison.outcome] for f in timed])
        low = [s - lo for s, (lo, _) in zip(speedups, bands, strict=True)]
        high = [hi - s for s, (_, hi) in zip(speedups, bands, strict=True)]
        ax.errorbar(speedups, list(rows), xerr=[low, high], fmt="none", ecolor="black", capsize=3, linewidth=1)
        for i, f in enumerate(timed):
            ax.annotate(f.comparison.short, (max(1.0, bands[i][1]), i), xytext=(4, 0), textcoords="offset points",
                        va="center", fontsize=8)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log")
        low_end, high_end = min(0.8, *(lo for lo, _ in bands)) / 1.2, max(1.25, *(hi for _, hi in bands)) * 2.5
        ax.set_xlim(low_end, high_end)
        ticks = [t for t in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
                 if low_end <= t <= high_end]
        ax.set_xticks(ticks, [f"{t:g}×" for t in ticks])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_yticks(list(rows), [f.label for f in timed])
        ax.invert_yaxis()
        ax.set_xlabel("speed-up over the baseline (log scale); whiskers: the noise band from the quartiles")
        ax.set_title(title)
        ax.grid(axis="x", alpha=0.3, which="both")
        fig.tight_layout()
        plt.close(fig)
        return fig


# ── Reading a torch.profiler profile: idle gaps, the ranges they fall in ───────────────────────────────────────


@dataclass(frozen=True)
class Gap:
    """A stretch with no kernel running: when it began (µs after the first kernel), how long, what came next."""

    start_us: float
    duration_us: float
    next_kernel: str
    inside: str | None  # the record_function range it lies in, if any


def annotation_ranges(prof: torch.profiler.profile, *, on_gpu: bool) -> list[tuple[str, float, float]]:
    """(name, start µs, end µs) of every ``record_function`` range of a finished profile: on a GPU as drawn on the
    GPU's timeline (around the kernels launched inside), on a CPU as the host ran them."""
    from torch.autograd import DeviceType

    wanted = DeviceType.CUDA if on_gpu else DeviceType.CPU
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if getattr(e, "is_user_annotation", False) and e.device_type == wanted]


def idle_gaps(kernels: Sequence[Kernel], *, ranges: Sequence[tuple[str, float, float]] = (), top: int = 5,
              min_us: float = 0.0) -> list[Gap]:
    """The ``top`` longest gaps between consecutive kernels (kernels on two streams that overlap leave no gap),
    longest first, each with the kernel that ended it and the range (from :func:`annotation_ranges`) it began in.

    Raises:
        ValueError: for a negative ``top``.
    """
    if top < 0:
        raise ValueError(f"top must be >= 0, got {top}")
    ordered = sorted(kernels, key=lambda k: k.start_us)
    if not ordered:
        return []
    origin, end, gaps = ordered[0].start_us, ordered[0].end_us, []
    for k in ordered[1:]:
        if k.start_us - end > min_us:
            inside = next((name for name, s, e in ranges if s <= end < e), None)
            gaps.append(Gap(end - origin, k.start_us - end, k.name, inside))
        end = max(end, k.end_us)
    return sorted(gaps, key=lambda g: g.duration_us, reverse=True)[:top]


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Keep what C++ writes to stderr (the profiler's 'profiler_start/stop' lines, a CPU-only machine's failed GPU
    count) out of the notebook, for the duration of the block. Python exceptions are unaffected."""
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


# ── Numbers: relative error, and formats emulated by rounding ──────────────────────────────────────────────────


def relative_error(result: torch.Tensor, reference: torch.Tensor) -> float:
    """‖result − reference‖ / ‖reference‖ in float64 (on the reference's device).

    Raises:
        ValueError: for tensors of different shapes.
    """
    if result.shape != reference.shape:
        raise ValueError(f"shapes differ: {list(result.shape)} vs {list(reference.shape)}")
    ref = reference.detach().double()
    diff = result.detach().to(ref.device, torch.float64) - ref
    return (diff.norm() / ref.norm().clamp_min(1e-300)).item()
