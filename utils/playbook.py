"""The performance playbook: the tips the guides give, what each promises and which bottleneck it removes; whether
a promise held where it was measured; and the profiler reading that says which tip to try next.

    findings = utils.playbook.Findings()
    tf32 = utils.bench.compare({"fp32": fp32_step, "tf32": tf32_step})   # alternating rounds, three outcomes
    findings.measured("tf32", tf32, same="the step is 5% matmul")          # prints the verdict and its reason
    findings.explain("TF32 matmuls", unexpected=utils.playbook.profile_change(fp32_prof, tf32_prof))  # later
    utils.plot.table(findings.rows())                     # claim · what the guide promises · measured here · outcome
    print(utils.playbook.diagnose(profile))               # "launch-bound: ... → try CUDA graphs (...)"
    print(utils.playbook.profile_change(nchw, nhwc, kind="conv"))  # what changed between two variants' profiles

A finding's verdict is one of the three outcomes of :mod:`utils.bench` (faster or slower, no difference larger
than the resolution, inconclusive), and the summary table shows that outcome (:attr:`Finding.outcome`), never "did
not hold" for noise. :func:`holds` still reads a verdict against the promise (yes, partly, no, inconclusive).

The workloads (:func:`workloads`: MLP, Transformer, ResNet-50) and their training step (:meth:`Workload.step`) are
shared by notebooks 07 and 07b; :func:`same_first_step` checks a variant's first step against its reference, and
:func:`explain_by_profiles` profiles every comparison's variants after all timings and prints what changed;
:func:`same_step_apart` reads one step timed in several comparisons against the protocol's resolution.

:func:`diagnose` reads a :class:`utils.profile.StepProfile`: a step whose GPU waits for the host at least half the
time is *launch-bound* and gains from fewer launches (CUDA graphs, fused optimizers; compile where it measured
faster), and so is, partly, a step whose idle time outlasts every kind of kernel; otherwise the kind of kernel that
takes the most GPU time names the tip (convolutions: ``channels_last`` and ``cudnn.benchmark``; fp32 matmuls: TF32
where the GPU has it, else bf16 or fp16 autocast — none for a step whose matmuls already run in 16 bits under
autocast; attention: a fused SDPA backend; elementwise and reductions: ``torch.compile``'s fusion). On a CPU only
the tips that exist there are named. Given the run's findings, a tip measured slower on that step comes last, marked
so. Kernels are put down to ``record_function`` ranges by when the host launched them (:func:`range_totals`), which
is right for backward too, whose kernels autograd launches from threads of its own.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import math
import os
import re
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch

from utils import extension as _extension  # noqa: F401  (its import quiets a CPU-only CUDA_HOME notice)
from utils.bench import Comparison, Outcome, Verdict, format_seconds, ratio_text
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
        "torch.backends.cuda.matmul.fp32_precision = 'tf32'", False),
    Tip("channels_last", "channels_last", "10–30% faster convolutions", 1.1, "conv",
        "model.to(memory_format=torch.channels_last)", True),
    Tip("cudnn_benchmark", "cudnn.benchmark", "auto-tuned convolutions, faster with fixed input sizes", None, "conv",
        "torch.backends.cudnn.benchmark = True", False),
    Tip("pinned_memory", "pinned memory + non_blocking", "faster CPU→GPU transfers", None, "data",
        "DataLoader(..., pin_memory=True); x.to(device, non_blocking=True)", False),
    Tip("set_to_none", "zero_grad(set_to_none=True)", "faster: it avoids a memset", None, "launch",
        "optimizer.zero_grad(set_to_none=True)", True),
    Tip("compile", "torch.compile", "20–40% faster with zero code changes", 1.2, "other", "torch.compile(model)", True),
    Tip("to_device", ".cuda() vs .to(device)", "the same copy; .to(device) also runs without a GPU", None, "",
        "x.to(device)", True),  # named as timed: .cuda() the variant, .to(device) (the advice) the baseline
    Tip("cuda_graphs", "CUDA graphs", "(beyond the guide) launch overhead gone: faster launch-bound steps", None,
        "launch", "torch.cuda.graph / make_graphed_callables / utils.train.GraphedStep", False),
    Tip("fused_optimizer", "fused optimizer", "(beyond the guide) fewer optimizer kernels: a faster update", None,
        "launch", "torch.optim.AdamW(params, fused=True)", True),
    Tip("sdpa", "fused attention (SDPA)", "(beyond the guide) fused attention backends faster than math", None,
        "attention", "F.scaled_dot_product_attention(q, k, v, is_causal=True)", True),
    Tip("determinism", "deterministic algorithms", "(beyond the guide) bit-identical runs, at a cost in speed", None,
        "", "torch.use_deterministic_algorithms(True)", True),
    Tip("autocast", "bf16/fp16 autocast", "(notebook 03) 16-bit matmuls on the tensor cores", None, "matmul",
        "torch.autocast('cuda', dtype=torch.bfloat16)", False),
)}

#: The tips that address each bottleneck, best first (what :func:`diagnose` names).
TIPS_FOR: dict[str, tuple[str, ...]] = {
    "launch": ("cuda_graphs", "fused_optimizer", "compile"),
    "conv": ("channels_last", "cudnn_benchmark"),
    "matmul": ("tf32", "autocast"),  # for fp32 matmuls; diagnose() drops what the step's precision rules out
    "attention": ("sdpa",),
    "other": ("compile",),
    "overhead": ("compile",),
}

#: Convolution kernels (cuDNN's implicit-GEMM, Winograd and FFT kernels, its fprop/dgrad/wgrad names) and operators.
CONV = re.compile(r"conv(?!ert)|fprop|dgrad|wgrad|winograd|implicit_(?:gemm|convolve)|fft2d_|flip_filter",
                  re.IGNORECASE)
#: Kernels that only convert a tensor between the NCHW and NHWC layouts (cuDNN's nchwToNhwcKernel, ...).
LAYOUT_CONVERSION = re.compile(r"nchw.*nhwc|nhwc.*nchw", re.IGNORECASE)


def kind_of_kernel(name: str, op: str = "") -> str:
    """'conv', 'matmul', 'attention' or 'other': :func:`utils.profile.kind_of` with convolutions told apart — by the
    kernel's name, or by the operator that launched it (``op``, e.g. ``aten::cudnn_convolution``): cuDNN runs some
    convolutions with kernels named like plain GEMMs. Layout conversions count as 'other' wherever they run."""
    if LAYOUT_CONVERSION.search(name):
        return "other"
    if kind_of(name) == "attention":  # cuDNN's attention kernels are named like its convolutions ("…_fprop_…")
        return "attention"
    if CONV.search(name) or CONV.search(op):
        return "conv"
    return kind_of(name)


def time_by_class(profile: StepProfile) -> dict[str, float]:
    """Seconds per step of convolution, matmul, attention and other kernels (operators on a CPU)."""
    out = {"conv": 0.0, "matmul": 0.0, "attention": 0.0, "other": 0.0}
    for k in profile.kernels:
        out[kind_of_kernel(k.name, k.op)] += k.duration_us / 1e6 / profile.steps
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
    idle: float = 0.0  # the share of the step the device waits for the host (CPU: time between operators)
    no_tip: str = "none of them exists on this device"  # why ``tips`` is empty, where it is
    per_kernel_us: float = 0.0  # the step's time over its kernels (operators on a CPU): the host's cost only where
    # the step is launch-bound; the host's own cost per call is ``launch_us``, measured apart
    launch_us: tuple[tuple[str, float], ...] = ()  # host µs per call measured apart (e.g. ATen's and Inductor's)
    conversions: float = 0.0  # the share of the busy time spent converting between NCHW and NHWC (GPU)
    slower: tuple[str, ...] = ()  # keys of the tips this run measured slower on this step: named last, marked so

    @property
    def host_note(self) -> str:
        """The step's time per launch, and the host's cost per call measured apart, for a step that waits for the
        host: "50 µs of step time per kernel; host per call: ATen op 4.2 µs, compiled call 11.8 µs on this CPU" —
        what a reader on a faster CPU can scale by."""
        what = "kernel" if self.on_gpu else "operator"
        apart = host_per_call(dict(self.launch_us))
        per = times_a_call(self.per_kernel_us / 1e6, dict(self.launch_us))
        return f"{format_seconds(self.per_kernel_us / 1e6)} of step time per {what}{per}" + (
            f"; {apart}" if apart else "")

    @property
    def tip(self) -> Tip | None:
        """The first tip to try, or None."""
        return self.tips[0] if self.tips else None

    @property
    def largest_share(self) -> str:
        """The largest item with its share and what the share is of: "idle 96% of the step" (idle time, a share of
        the step) or "other 79% of the GPU time" (a kind of kernel, a share of the kernels' time)."""
        if self.largest in ("launch", "overhead"):
            return f"{'idle' if self.largest == 'launch' else 'overhead'} {self.share:.0%} of the step"
        return f"{self.largest} {self.share:.0%} of the {'GPU' if self.on_gpu else 'operator'} time"

    def __str__(self) -> str:
        longer = ", longer than any kind of kernel runs" if self.share < 0.5 else ""
        where = {"launch": f"the GPU waits for the host {self.share:.0%} of the step{longer}",
                 "overhead": f"Python and dispatch between operators take {self.share:.0%} of the step"}.get(
            self.largest, f"{self.largest} {'kernels' if self.on_gpu else 'operators'} take {self.share:.0%} of "
                          f"the {'GPU' if self.on_gpu else 'operator'} time")
        if self.bound == "partly launch-bound" and self.largest not in ("launch", "overhead"):
            where += f", and the GPU waits for the host {self.idle:.0%} of the step"
        if self.conversions >= LAYOUT_CONVERSION_SHARE:
            where += f"; NCHW↔NHWC layout conversions take {self.conversions:.0%} of the GPU time"
        if self.bound in ("launch-bound", "partly launch-bound", "overhead-bound") and self.per_kernel_us > 0:
            where += f" ({self.host_note})"
        if not self.tips:
            return f"{self.bound}: {where} → no tip of this playbook applies: {self.no_tip}"
        first, rest = self.tips[0], ", ".join(self.tip_name(t) for t in self.tips[1:])
        how = first.how + ("; measured slower here" if first.key in self.slower else "")
        return f"{self.bound}: {where} → try {first.name} ({how})" + (f"; also {rest}" if rest else "")

    def tip_name(self, tip: Tip | None = None) -> str:
        """The name of ``tip`` (default: the first tip), with " (measured slower here)" where this run measured it
        slower on this step; "nothing to try" where there is no tip."""
        tip = tip or self.tip
        if tip is None:
            return "nothing to try"
        return tip.name + (" (measured slower here)" if tip.key in self.slower else "")


def diagnose(profile: StepProfile, *, amp: torch.dtype | None = None, tf32: bool = True,
             launch_us: Mapping[str, float] | None = None, findings: Findings | None = None,
             workload: str | None = None) -> Diagnosis:
    """The largest bottleneck of a profiled step and the tips that address it.

    Every reading of a step that waits for the host (launch-bound, partly launch-bound, overhead-bound) carries the
    host's cost per launch: the step's time over its kernels (operators on a CPU), and ``launch_us``, host µs per
    call measured apart (e.g. ``{"ATen op": 4.2, "compiled call": 11.8}``), so that a reader whose CPU is faster or
    slower can scale the result.

    ``amp`` is the 16-bit dtype the step runs under autocast (``torch.bfloat16`` or ``torch.float16``; None for an
    fp32 step), ``tf32`` whether the GPU has TF32 tensor cores (``utils.env.capabilities(device).tf32``). They
    decide the tip for matmuls: TF32 changes fp32 matmuls only, so a step under autocast gets no matmul tip (its
    matmuls already run in 16 bits), and an fp32 step on a GPU without TF32 gets bf16/fp16 autocast.

    On a GPU: idle at least half the step → launch-bound (CUDA graphs, fused optimizer, compile). A step idle at
    least a fifth of the time is partly launch-bound: when its idle time is longer than the time of any kind of
    kernel, the idle time is the largest item and fewer launches come first (then the tips for its largest kind of
    kernel); otherwise the kind of kernel with the most GPU time decides, with CUDA graphs added to its tips. A step
    idle less than that is GPU-bound: its largest kind of kernel decides. Where the kind of kernel decides and
    NCHW↔NHWC layout conversions (cuDNN's ``nchwToNhwcKernel``, ...) take :data:`LAYOUT_CONVERSION_SHARE` of the GPU
    time or more, ``channels_last`` comes first: the convolutions' inputs arrive in the other layout. On a CPU "idle"
    is Python and dispatch between operators: at least half of the step → overhead-bound (compile); otherwise the
    largest kind of operator decides, and only tips that exist on a CPU are named.

    ``findings`` and ``workload`` (the step's model, as its findings name it): a tip this run timed on that
    workload and measured slower, never faster (e.g. default-mode compile on a launch-bound MLP), is named last and
    marked "(measured slower here)" (:attr:`Diagnosis.slower`): the diagnosis never recommends, unmarked, what the
    same run measured slower.

    Raises:
        TypeError: for anything but a StepProfile.
    """
    d = _diagnose(profile, amp=amp, tf32=tf32, launch_us=launch_us)
    if findings is None or workload is None:
        return d
    slower = tuple(t.key for t in d.tips if _measured_slower(findings.timed_on(t.key, workload)))
    return replace(d, tips=tuple(sorted(d.tips, key=lambda t: t.key in slower)), slower=slower)


def _measured_slower(found: Sequence[Finding]) -> bool:
    outcomes = {f.verdict.outcome for f in found}
    return "slower" in outcomes and "faster" not in outcomes


def _diagnose(profile: StepProfile, *, amp: torch.dtype | None, tf32: bool,
              launch_us: Mapping[str, float] | None) -> Diagnosis:
    if not isinstance(profile, StepProfile):
        raise TypeError(f"diagnose() reads a utils.profile.StepProfile, got {type(profile).__name__}")
    kinds = time_by_class(profile)
    busy = sum(kinds.values())
    largest = max(kinds, key=kinds.get)
    share = kinds[largest] / busy if busy > 0 else 0.0
    idle = profile.idle_fraction
    gpu = profile.on_gpu
    converting = sum(k.duration_us for k in profile.kernels if LAYOUT_CONVERSION.search(k.name)) / 1e6 / profile.steps
    conversions = converting / busy if gpu and busy > 0 else 0.0
    host = {"per_kernel_us": profile.wall_s * 1e6 / profile.kernels_per_step if profile.kernels else 0.0,
            "launch_us": tuple((launch_us or {}).items()), "conversions": conversions}

    def tips(bottleneck: str) -> tuple[str, ...]:
        keys = TIPS_FOR[bottleneck]
        if bottleneck == "matmul":  # TF32 for fp32 matmuls where the GPU has it, else 16-bit autocast; none in 16 bits
            keys = () if amp is not None else tuple(k for k in keys if k != "tf32" or tf32)
        return tuple(k for k in keys if gpu or TIPS[k].on_cpu)

    no_tip = (f"its matmuls already run in {str(amp).removeprefix('torch.')} under autocast (TF32 changes fp32 "
              "matmuls only)" if largest == "matmul" and amp is not None else "none of them exists on this device")
    if gpu:
        if idle >= 0.5:
            return Diagnosis("launch-bound", "launch", idle, _tips(tips("launch")), True, idle, **host)
        if idle >= 0.2 and profile.idle_s >= kinds[largest]:
            keys = tips("launch") + tuple(k for k in tips(largest) if k not in TIPS_FOR["launch"])
            return Diagnosis("partly launch-bound", "launch", idle, _tips(keys), True, idle, **host)
        keys = tips(largest) + (("cuda_graphs",) if idle >= 0.2 else ())
        if conversions >= LAYOUT_CONVERSION_SHARE:  # the convolutions' inputs arrive in NCHW: channels_last first
            keys = ("channels_last",) + tuple(k for k in keys if k != "channels_last")
        bound = "partly launch-bound" if idle >= 0.2 else "GPU-bound"
        return Diagnosis(bound, largest, share, _tips(keys), True, idle, no_tip, **host)
    if idle >= 0.5:
        return Diagnosis("overhead-bound", "overhead", idle, _tips(tips("overhead")), False, idle, **host)
    return Diagnosis("compute-bound", largest, share, _tips(tips(largest)), False, idle, no_tip, **host)


def _tips(keys: Sequence[str]) -> tuple[Tip, ...]:
    return tuple(TIPS[k] for k in keys)


def host_per_call(launch_us: Mapping[str, float] | None) -> str:
    """"host per call: ATen op 4.2 µs, compiled call 11.8 µs on this CPU" from host µs per call measured apart
    (e.g. a tiny kernel's ``x + 1`` timed on the host's clock alone); "" for none — what a reader whose CPU is
    faster or slower scales a host-bound reading by."""
    if not launch_us:
        return ""
    return "host per call: " + ", ".join(f"{name} {format_seconds(us / 1e6)}" for name, us in launch_us.items()) + \
        " on this CPU"


def times_a_call(per_launch_s: float, launch_us: Mapping[str, float] | None) -> str:
    """", 2.1× an ATen op": a step's time per launch against the first host cost per call measured apart, so a
    reader does not scale a host-bound step by the bare call alone (a real step's operators cost the host more than
    ``x + 1``); "" without one."""
    name, us = next(iter(launch_us.items())) if launch_us else ("", 0.0)
    if us <= 0:
        return ""
    return f", {per_launch_s * 1e6 / us:.1f}× {'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


#: The share of a step's GPU time in NCHW↔NHWC conversions from which :func:`diagnose` names channels_last first.
LAYOUT_CONVERSION_SHARE = 0.05

#: On a CPU, a change of the operators' busy time under 20% is not read as a cause: a few-step profile of operators
#: is that noisy. A GPU's kernel times repeat far closer (the same step profiled twice: within about 1%).
UNRESOLVED = 1.2


def profile_change(before: StepProfile, after: StepProfile, *, kind: str | None = None,
                   launch_us: Mapping[str, float] | None = None, waits_for: str | None = None) -> str:
    """What changed between the profiles of two variants of a step, in measured numbers — the time of one class of
    kernels (``kind``: 'conv', 'matmul', 'attention' or 'other'; see :func:`time_by_class`), the device's busy
    time, kernels per step and the idle share — followed by what it means when the second step's device did less
    work but the step did not follow: it waits for the host (host-bound). A busy time that changed by under 5% is
    said as it is: "did not change", "shrank by only 2%", "did not shrink (it grew 3%)"; on a CPU, operators whose
    time shrank by under 20% (:data:`UNRESOLVED`) are "unresolved by a 2-step profile", never a cause (a few steps
    of operators profiled are that noisy), and so is a GPU step whose busy time is mostly copies (the host stages
    them); a GPU's kernel times repeat within about 1%, so there a shrink of 5% or more is read; a class of kernels
    whose time changed by under 0.5% is "(unchanged)".

    Where the GPU's work did not change resolvably but the GPU waits for the host a fifth of the step or more, the
    reading goes on with that wait, before → after ("the GPU's wait for the host went 1.87 ms → 2.31 ms per step:
    host-bound, the host sets the pace"): what a change of the step's time then comes from. Every host-bound reading
    carries the host's cost per call measured apart (``launch_us``, e.g. ``{"ATen op": 11.0, "compiled call":
    50.2}``; :func:`host_per_call`) beside the step's launches and its time per launch ("927 launches per step,
    33.2 µs of the step each; host per call: ATen op 11 µs on this CPU"), so that a reader on a faster or slower CPU
    can scale it. A shrink carried by copies ("Memcpy ..."; the other kernels kept their count and changed less) is
    said as such: "the copies shrank 8.19× (8 → 8 per epoch, ...); the kernels unchanged (...)". Where the step
    got faster (by over 3%) and its wait for the host did not grow, the saving is split into its two measured parts
    and nothing is called host-bound: "...; the step saved 5.6 ms: 1.3 ms less GPU work, 4.3 ms less waiting for the
    host (526 → 383 kernels per step)".
    ``waits_for`` says what the GPU waits for when it is not only launches ("the loader's batches and the step's
    launches"). A host-bound
    reading names no cure: the host's pace varies with the process's state (the same step can wait far less in
    another part of the same run), and a profile cannot say which host work a remedy would remove.

    e.g. "conv kernels 3.18 ms → 2.54 ms per step (1.25× faster); GPU busy 27.5 ms → 15.1 ms, 999 → 927 kernels;
    GPU idle 17% → 52% of the step: the GPU work shrank 1.82×, but the GPU waits for the host 52% of the step
    (host-bound in these rounds: the GPU waited for the host, whose pace can vary within a run; 927 launches per
    step, 34 µs of the step each; host per call: ATen op 11 µs on this CPU)".

    Raises:
        TypeError: for anything but two StepProfiles.
        ValueError: for an unknown ``kind``.
    """
    if not isinstance(before, StepProfile) or not isinstance(after, StepProfile):
        raise TypeError(f"profile_change() compares two utils.profile.StepProfile, got {type(before).__name__} and "
                        f"{type(after).__name__}")
    if kind is not None and kind not in ("conv", "matmul", "attention", "other"):
        raise ValueError(f"kind must be 'conv', 'matmul', 'attention' or 'other', got {kind!r}")
    unit, gpu = after.unit, after.on_gpu
    work, waiting = ("GPU", "the GPU waits for the host") if gpu else (
        "operator", "Python and dispatch between operators take")
    host = host_per_call(launch_us)
    if host and after.kernels:  # beside the host's cost per call: the step's launches and its time per launch
        one = round(after.kernels_per_step) == 1  # one launch (a copy): its time per launch is the step's
        calls = ("launch" if one else "launches") if gpu else ("operator" if one else "operators")
        per = after.wall_s / after.kernels_per_step
        each = "" if one else f", {format_seconds(per)} of the {unit} each{times_a_call(per, launch_us)}"
        host = f"{after.kernels_per_step:,.0f} {calls} per {unit}{each}; {host}"
    parts = []
    if kind is not None:
        k0, k1 = time_by_class(before)[kind], time_by_class(after)[kind]
        ratio = "" if not (k0 > 0 and k1 > 0) else " (unchanged)" if _ratio(k0 / k1) == _ratio(1.0) else (
            f" ({_ratio(k0 / k1)} faster)" if k0 > k1 else f" ({_ratio(k1 / k0)} slower)")
        parts.append(f"{kind} {'kernels' if gpu else 'operators'} {format_seconds(k0)} → {format_seconds(k1)} per "
                     f"{unit}{ratio}")
    counted = "kernels" if gpu else "operators"
    parts.append(f"{work} busy {format_seconds(before.busy_s)} → {format_seconds(after.busy_s)}, "
                 f"{before.kernels_per_step:.0f} → {after.kernels_per_step:.0f} {counted}")
    text = "; ".join(parts) + (f"; {work} idle {before.idle_fraction:.0%} → {after.idle_fraction:.0%} of the {unit}"
                               if gpu else f"; the rest of the {unit} {before.idle_fraction:.0%} → "
                                           f"{after.idle_fraction:.0%}")
    shrank = before.busy_s / after.busy_s if after.busy_s > 0 else math.inf
    change = after.busy_s / before.busy_s - 1 if before.busy_s > 0 else 0.0
    if shrank < 1.05:  # under 5%: said as it is, by how much and which way
        lost, work_lost = after.wall_s - before.wall_s, after.busy_s - before.busy_s
        split_loss = ""
        if gpu and lost > 0.03 * before.wall_s and 0 < work_lost < lost:  # slower: the loss in its two parts
            split_loss = (f"; the {unit} lost {format_seconds(lost)}: {format_seconds(work_lost)} more GPU work, "
                          f"{format_seconds(lost - work_lost)} more waiting for the host")
        return text + (f": the {work} work did not change" if f"{abs(change):.0%}" == "0%" else
                       f": the {work} work shrank by only {-change:.0%}" if change < 0 else
                       f": the {work} work did not shrink (it grew {change:.0%})") + split_loss + \
            _host_wait(before, after, host)
    saved, work_saved = before.wall_s - after.wall_s, before.busy_s - after.busy_s
    split = after.idle_fraction >= 0.2 and saved > 0.03 * before.wall_s and saved >= work_saved
    copies = sum(k.duration_us for k in before.kernels if COPY.search(k.name)) / 1e6 / before.steps
    noisy = not gpu or copies >= 0.5 * before.busy_s  # operators on a CPU, or copies that the host stages
    if gpu and noisy and Counter(k.name for k in before.kernels) == Counter(k.name for k in after.kernels) and \
            before.steps == after.steps:  # the very same copies: their time follows the host's staging, not the work
        return text + (f": the same copies in both ({after.kernels_per_step:,.0f} per {unit}); a copy's time "
                       "follows how the host stages it, so its change is not read as a cause") + \
            _host_wait(before, after, host)
    if shrank < UNRESOLVED and noisy:  # a shift such a profile cannot tell from its own noise: no cause read
        steps = min(before.steps, after.steps)
        return text + (f": the {work} work shrank {-change:.0%}, unresolved by a {steps}-step profile (a shift "
                       f"under {UNRESOLVED - 1:.0%} can be the profile's own noise)") + _host_wait(before, after, host)
    if shrank < UNRESOLVED and not split:  # a GPU's smaller shrink, read as measured; the host's wait beside it
        return text + f": the {work} work shrank {-change:.0%}" + _host_wait(before, after, host)
    if split:
        # the step got faster and its wait did not grow: the saving split into its two measured parts
        wait = "waiting for the host" if gpu else "time between operators"
        return text + (f": {_shrank_text(before, after, shrank)}; the {unit} saved {format_seconds(saved)}: "
                       f"{format_seconds(work_saved)} less {work} work, {format_seconds(saved - work_saved)} less "
                       f"{wait} ({before.kernels_per_step:,.0f} → {after.kernels_per_step:,.0f} {counted} per {unit})")
    if after.idle_fraction >= 0.2:
        remedy = ""
        if gpu:
            why = f"the GPU waited for {waits_for}" if waits_for else (
                "the GPU waited for the host, whose pace can vary within a run")
            bound = "host-bound" if after.idle_fraction >= 0.5 else "partly host-bound"  # as diagnose() says it
            remedy = f" ({bound} in these rounds: {why}" + (f"; {host}" if host else "") + ")"
        return (text + f": {_shrank_text(before, after, shrank)}, but {waiting} {after.idle_fraction:.0%} of the "
                       f"{unit}{remedy}")
    return text


#: The profiler's names of copies between host and device memory ("Memcpy HtoD (Pageable -> Device)", ...).
COPY = re.compile(r"^Memcpy\b")


def _shrank_text(before: StepProfile, after: StepProfile, shrank: float) -> str:
    """"the GPU work shrank 1.82×"; or, where the kernels other than copies kept their count and the copies carry
    most of the change, what the counts say: "the copies shrank 8.19× (8 → 8 per epoch, 46.3 ms → 5.65 ms); the
    kernels unchanged (7432 → 7432 per epoch, 122 ms → 121 ms)" (a time within 5% is "unchanged")."""
    work = "GPU" if after.on_gpu else "operator"
    if not after.on_gpu:
        return f"the {work} work shrank {_ratio(shrank)}"
    parts = []
    for p in (before, after):
        copies = [k for k in p.kernels if COPY.search(k.name)]
        parts.append((len(copies) / p.steps, sum(k.duration_us for k in copies) / 1e6 / p.steps,
                      (len(p.kernels) - len(copies)) / p.steps,
                      sum(k.duration_us for k in p.kernels if not COPY.search(k.name)) / 1e6 / p.steps))
    (c0, cs0, k0, ks0), (c1, cs1, k1, ks1) = parts

    def changed(a: float, b: float) -> str:
        return "unchanged" if max(a, b) / min(a, b) < 1.05 else f"shrank {_ratio(a / b)}" if a > b else \
            f"grew {_ratio(b / a)}"

    copies_lead = abs(cs0 - cs1) >= abs(ks0 - ks1)  # the copies carry most of the change
    if not (round(k0) == round(k1) and min(cs0, cs1, ks0, ks1) > 0 and copies_lead
            and changed(cs0, cs1) != "unchanged"):
        return f"the {work} work shrank {_ratio(shrank)}"
    return (f"the copies {changed(cs0, cs1)} ({c0:,.0f} → {c1:,.0f} per {after.unit}, {format_seconds(cs0)} → "
            f"{format_seconds(cs1)}); the kernels {changed(ks0, ks1)} ({k0:,.0f} → {k1:,.0f} per {after.unit}, "
            f"{format_seconds(ks0)} → {format_seconds(ks1)})")


def _host_wait(before: StepProfile, after: StepProfile, host: str) -> str:
    """"; the GPU's wait for the host went 1.87 ms → 2.31 ms per step: host-bound, the host sets the pace (host per
    call: ...)" for a GPU step that waits for the host a fifth of the time or more (before or after); else ""."""
    if not after.on_gpu or max(before.idle_fraction, after.idle_fraction) < 0.2:
        return ""
    bound = ": host-bound, the host sets the pace" if after.idle_fraction >= 0.5 else ""
    return (f"; the GPU's wait for the host went {format_seconds(before.idle_s)} → {format_seconds(after.idle_s)} "
            f"per {after.unit}{bound}" + (f" ({host})" if host else ""))


def _ratio(x: float) -> str:
    return f"{x:.2f}×"


def same_step_apart(readings: Mapping[str, StepProfile], *, resolution: float, what: str = "the step") -> str:
    """The same step, timed in several comparisons (``readings``: where → its profile, whose ``wall_s`` is the time
    that comparison measured): whether its time agrees between them, read against the protocol's ``resolution``
    (e.g. 0.03) and the GPU's work in each profile.

    e.g. "the channels_last step took 30.8 ms in section 2, 33.3 ms in section 3, 30.1 ms in section 5, with GPU
    busy 15.2 ms, 15.2 ms, 15.2 ms. With the same GPU work (within ±3%) it took 11% longer in section 3 than in
    section 5, beyond the ±3% the protocol resolves: the host slowed there, its wait grew 16% (14.9 ms → 17.3 ms
    per step). Each comparison's verdict uses its own number, timed in rounds that alternate with its partner".

    Raises:
        ValueError: for fewer than two readings, or a resolution outside (0, 1).
    """
    if len(readings) < 2:
        raise ValueError(f"same_step_apart() compares two readings or more, got {len(readings)}")
    if not 0 < resolution < 1:
        raise ValueError(f"resolution must lie in (0, 1), got {resolution}")
    where, profiles = list(readings), list(readings.values())
    unit, work = profiles[0].unit, "GPU" if profiles[0].on_gpu else "operator"
    seen = (f"{what} took " + ", ".join(f"{format_seconds(p.wall_s)} in {w}" for w, p in readings.items())
            + f", with {work} busy " + ", ".join(format_seconds(p.busy_s) for p in profiles))

    def apart(values: Sequence[float]) -> float:
        return max(values) / min(values) - 1 if min(values) > 0 else math.inf

    busy, wall = apart([p.busy_s for p in profiles]), apart([p.wall_s for p in profiles])
    within = f"the ±{resolution:.0%} the protocol resolves"
    if busy > resolution:
        reading = (f"The {work} work differs by {busy:.0%}, more than {within}: the host's share cannot be told "
                   "apart")
    elif wall <= resolution:
        reading = f"Its time and its {work} work agree within {within}: the host kept its pace"
    else:
        slow = max(range(len(profiles)), key=lambda i: profiles[i].wall_s)
        fast = min(range(len(profiles)), key=lambda i: profiles[i].wall_s)
        waits = profiles[fast].idle_s, profiles[slow].idle_s
        grew = f", its wait grew {waits[1] / waits[0] - 1:.0%}" if waits[0] > 0 else ""
        reading = (f"With the same {work} work (within ±{resolution:.0%}) it took {wall:.0%} longer in {where[slow]} "
                   f"than in {where[fast]}, beyond {within}: the host slowed there{grew} "
                   f"({format_seconds(waits[0])} → {format_seconds(waits[1])} per {unit})")
    return (f"{seen}. {reading}. Each comparison's verdict uses its own number, timed in rounds that alternate with "
            "its partner")


# ── Whether a promise held: findings, their table and their chart ──────────────────────────────────────────────

Expected = Literal["faster", "slower", "same"]
_RESOLVED: tuple[Outcome, ...] = ("faster", "slower", "same")


def holds(verdict: Verdict, tip: Tip, expected: Expected = "faster") -> str:
    """'yes', 'yes: within the band of the promised …', 'partly: …', 'no: …' or 'inconclusive: …': whether the
    verdict bears the tip's promise out. A gain under the promised one is 'partly' only when the whole band of the
    speed-up lies under the promise; an inconclusive verdict is never a 'no'."""
    outcome, speedup = verdict.outcome, verdict.speedup
    if outcome == "inconclusive":
        return f"inconclusive: could not resolve a {verdict.resolution:.0%} effect"
    if outcome == expected:
        promised = tip.promised_speedup
        if expected == "faster" and promised and speedup < promised:
            if verdict.band[1] < promised:  # even the band's top end falls short
                return f"partly: faster, but under the promised {promised:g}×"
            return f"yes: within the band of the promised {promised:g}×"
        return "yes"
    return f"no: {verdict.short}"


def measured_text(verdict: Verdict) -> str:
    """What a verdict measured, for a table cell: '1.62× faster', '1.18× slower', 'no difference > 3%', or for an
    inconclusive one its median and band ('inconclusive: 1.30×, band 0.40–2.20×')."""
    if verdict.outcome == "inconclusive":
        return f"inconclusive: {ratio_text(verdict.speedup)}, {verdict.band_text}"
    return verdict.short


def _reasons(expected: Expected, unexpected: str | None, reasons: dict[str, str]) -> dict[str, str]:
    """Reasons keyed by outcome: ``unexpected`` for every resolved outcome but the expected one, then ``reasons``."""
    return {o: unexpected for o in _RESOLVED if o != expected and unexpected} | reasons


def _names(side: str, variant: str) -> bool:
    side, variant = side.strip().lower(), variant.strip().lower()
    return bool(side and variant) and (variant in side or side in variant)


def _check_label_order(label: str, verdict: Verdict) -> None:
    """A label "A vs B" must name the verdict's variant first and its baseline second, as the verdict reads
    ("A vs B: 1.03× slower" says A is the slower one).

    Raises:
        ValueError: where the side before " vs " names the baseline and the side after it the variant.
    """
    if " vs " not in label:
        return
    first, second = label.split(" vs ", 1)
    first = first.rsplit(" · ", 1)[-1]  # "SDPA · flash vs math": the variant follows the tip's name
    swapped = _names(first, verdict.baseline) and _names(second, verdict.variant)
    if swapped and not (_names(first, verdict.variant) and _names(second, verdict.baseline)):
        raise ValueError(f"the label {label!r} names the baseline ({verdict.baseline!r}) first: its verdict reads "
                         f"{verdict.variant!r} vs {verdict.baseline!r}; name the variant first")


@dataclass(frozen=True)
class Finding:
    """One row of the playbook's summary: a claim, what was measured, and whether it held."""

    tip: Tip
    label: str
    measured: str
    holds: str
    verdict: Verdict | None = None  # None for a claim about behaviour, or one not measured here
    workload: str | None = None  # the model it was measured on ("MLP", ...); None for a benchmark of its own
    comparison: Comparison | None = None  # the comparison the verdict came from, when given one
    expected: Expected = "faster"

    @property
    def outcome(self) -> str:
        """The protocol's outcome in words — "faster", "slower", "no difference", "inconclusive" (with "under the
        promised 3×" where the whole band falls short of a promised number) — for a timed claim; what was seen for
        a claim about behaviour; "not measured here" for one skipped. Never "did not hold" for noise."""
        if self.verdict is None:
            return self.holds
        words = {"faster": "faster", "slower": "slower", "same": "no difference", "inconclusive": "inconclusive"}
        text = words[self.verdict.outcome]
        if self.holds.startswith("partly"):
            text += f", {self.holds.removeprefix('partly: faster, but ')}"
        return text


class Findings:
    """The claims checked in one run, in order: each measured (a verdict), observed (behaviour) or skipped."""

    def __init__(self) -> None:
        self._found: dict[str, Finding] = {}

    def _add(self, finding: Finding) -> Finding:
        self._found[finding.label] = finding
        return finding

    def _tip(self, key: str) -> Tip:
        if key not in TIPS:
            raise KeyError(f"no tip {key!r}: choose one of {', '.join(TIPS)}")
        return TIPS[key]

    def measured(self, key: str, result: Comparison | Verdict, *, variant: str | None = None,
                 against: str | None = None, label: str | None = None, expected: Expected = "faster",
                 workload: str | None = None, unexpected: str | None = None, promised: bool = True,
                 **reasons: str) -> Finding:
        """Record a timed claim and print its verdict, with the measured reason given for the outcome it had.

        ``result`` is a :class:`utils.bench.Comparison` (``variant``: which of its variants, default the last;
        ``against``: another of its variants to compare with, default its baseline: ``Comparison.verdict``) or a
        :class:`Verdict`.
        ``reasons`` are keyed by outcome, as :meth:`utils.bench.Verdict.explain` takes them, so that a printed
        reason always matches the result; ``unexpected`` is the reason for each resolved outcome other than
        ``expected``, the outcome the tip promises ("slower" for a cost). ``workload`` names the model it was
        measured on, if any (see :meth:`measured_for`). ``promised=False`` for a measurement the tip's promised
        number is not about (TF32 promises 3× faster *matmuls*; a whole step gains only as much as its matmuls
        weigh): its outcome is then never "under the promised 3×".

        Raises:
            TypeError: for a result that is neither a Comparison nor a Verdict.
            KeyError: for an unknown tip or variant.
            ValueError: for a reason keyed by anything but an outcome, or a label "A vs B" that names the verdict's
                baseline first and its variant second (:func:`_check_label_order`): the table would then put the
                verdict's "slower" on the wrong side.
        """
        tip = self._tip(key)
        if isinstance(result, Comparison):
            verdict, comparison = result.verdict(variant, against), result
        elif isinstance(result, Verdict):
            verdict, comparison = result, None
        else:
            raise TypeError(f"measured() takes a utils.bench.Comparison or Verdict, got {type(result).__name__}")
        _check_label_order(label or tip.name, verdict)
        held = holds(verdict, tip if promised else replace(tip, promised_speedup=None), expected)
        line = verdict.explain(**_reasons(expected, unexpected, reasons))
        print(line + (f" ({held.removeprefix('partly: faster, but ')})" if held.startswith("partly") else ""))
        return self._add(Finding(tip, label or tip.name, measured_text(verdict), held, verdict, workload, comparison,
                                 expected))

    def explain(self, label: str, *, unexpected: str | None = None, **reasons: str) -> str:
        """Print (and return) the verdict of the timed finding ``label`` with the reason for the outcome it had:
        ``reasons`` keyed by outcome, and ``unexpected`` for each resolved outcome other than the expected one —
        why a tip did not pay, e.g. read from profiles taken after every timing (:func:`profile_change`).

        Raises:
            KeyError: for an unknown label; ValueError: for a finding without a verdict.
        """
        finding = self[label]
        if finding.verdict is None:
            raise ValueError(f"{label!r} has no timed verdict to explain ({finding.holds})")
        line = finding.verdict.explain(**_reasons(finding.expected, unexpected, reasons))
        print(line)
        return line

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

    def timed_on(self, key: str, workload: str) -> list[Finding]:
        """The timed findings (those with a verdict) of tip ``key`` on ``workload``, in order.

        Raises:
            KeyError: for an unknown tip.
        """
        self._tip(key)
        return [f for f in self if f.tip.key == key and f.verdict is not None and f.workload == workload]

    def measured_for(self, key: str, workload: str) -> str:
        """What this run timed of tip ``key`` on ``workload``, for a "measured here" column: that workload's own
        verdicts, each with its label ("torch.compile · MLP: 1.29× faster"), and what was observed of it there
        without a verdict (a finding recorded with :meth:`observed`, e.g. "torch.compile · ResNet-50: 1.13×
        (host disturbed)"); else a clear "not timed on <workload>" followed by what was timed elsewhere, each under
        the workload it was timed on ("not timed on ResNet-50; on MLP: torch.compile · MLP: 1.61× slower"; "in a
        benchmark of its own" for a finding without one); or "not timed in this run". Skipped findings count as
        nothing seen.

        Raises:
            KeyError: for an unknown tip.
        """
        self._tip(key)
        own = [f for f in self if f.tip.key == key and f.workload == workload
               and (f.verdict is not None or not f.holds.startswith("not measured"))]
        if own:
            return "; ".join(f"{f.label}: {f.measured}" for f in own)
        elsewhere: dict[str | None, list[Finding]] = {}
        for f in self:
            if f.tip.key == key and f.verdict is not None:
                elsewhere.setdefault(f.workload, []).append(f)
        if not elsewhere:
            return "not timed in this run"
        return f"not timed on {workload}; " + "; ".join(
            ("in a benchmark of its own: " if where is None else f"on {where}: ")
            + "; ".join(f"{f.label}: {f.measured}" for f in found) for where, found in elsewhere.items())

    def __getitem__(self, label: str) -> Finding:
        return self._found[label]

    def __contains__(self, label: str) -> bool:
        return label in self._found

    def __iter__(self) -> Iterator[Finding]:
        return iter(self._found.values())

    def __len__(self) -> int:
        return len(self._found)

    def rows(self) -> list[dict[str, str]]:
        """Table rows: claim · what the guide promises · measured here · outcome (:attr:`Finding.outcome`: one of
        the protocol's outcomes for a timing)."""
        if not self._found:
            raise ValueError("no findings recorded yet")
        return [{"claim": f.label, "what the guide promises": f.tip.promise, "measured here": f.measured,
                 "outcome": f.outcome} for f in self]

    def counts(self) -> str:
        """The claims by outcome, in words: "9 claims: 4 faster, 1 slower, 2 no difference, 1 inconclusive, 1 seen
        (behaviour or a cost), 0 not measured here" — an inconclusive verdict is counted as such, never as a miss."""
        if not self._found:
            raise ValueError("no findings recorded yet")
        timed = [f.verdict.outcome for f in self if f.verdict is not None]
        skipped = sum(f.verdict is None and f.holds == "not measured here" for f in self)
        seen = len(self) - len(timed) - skipped
        parts = [f"{timed.count(o)} {w}" for o, w in (("faster", "faster"), ("slower", "slower"),
                                                        ("same", "no difference"), ("inconclusive", "inconclusive"))]
        return (f"{len(self)} claims: " + ", ".join(parts) + f", {seen} seen without a timing (a behaviour or a "
                f"cost), {skipped} not measured here")

    def chart(self, *, title: str):
        """Speed-up per timed claim on a log axis, each with its band (the 95% interval of the median per-round
        speed-up) and the line of no change; bars coloured by outcome, each labelled with its verdict (a bar with
        no resolved difference with its ratio too: "1.17×, inconclusive"), and a legend of the outcomes' colours.
        Returns a closed matplotlib Figure (None when nothing was timed)."""
        timed = [f for f in self if f.verdict is not None]
        if not timed:
            return None
        import matplotlib.patches
        import matplotlib.pyplot as plt
        import matplotlib.ticker

        speedups = [f.verdict.speedup for f in timed]
        bands = [f.verdict.band for f in timed]
        colours = {"faster": "#4C72B0", "slower": "#C44E52", "same": "#999999", "inconclusive": "#DDBB77"}
        fig, ax = plt.subplots(figsize=(8.0, 0.45 * len(timed) + 1.8))
        rows = range(len(timed))
        ax.barh(rows, [s - 1 for s in speedups], left=1.0, color=[colours[f.verdict.outcome] for f in timed])
        low = [s - lo for s, (lo, _) in zip(speedups, bands, strict=True)]
        high = [hi - s for s, (_, hi) in zip(speedups, bands, strict=True)]
        ax.errorbar(speedups, list(rows), xerr=[low, high], fmt="none", ecolor="black", capsize=3, linewidth=1)
        for i, f in enumerate(timed):  # a bar without a resolved difference still has a length: its ratio is named
            v = f.verdict
            text = v.short if v.outcome in ("faster", "slower") else f"{ratio_text(v.speedup)}, {v.short}"
            ax.annotate(text, (max(1.0, bands[i][1]), i), xytext=(4, 0), textcoords="offset points", va="center",
                        fontsize=8)
        ax.axvline(1.0, color="black", linewidth=0.8)
        words = {"faster": "faster", "slower": "slower", "same": "no difference", "inconclusive": "inconclusive"}
        shown = [o for o in colours if any(f.verdict.outcome == o for f in timed)]  # the outcomes that occur
        ax.legend(handles=[matplotlib.patches.Patch(color=colours[o], label=words[o]) for o in shown],
                  title="outcome", loc="best", fontsize=8, title_fontsize=8)
        ax.set_xscale("log")
        low_end, high_end = min(0.8, *(lo for lo, _ in bands)) / 1.2, max(1.25, *(hi for _, hi in bands)) * 2.5
        ax.set_xlim(low_end, high_end)
        ticks = [t for t in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
                 if low_end <= t <= high_end]
        if min(ticks) >= 1 and any(s < 1 for s in speedups):  # slower bars and no tick under 1×: finer ones,
            # as many as the axis has room for (beyond one and a half decades, 0.6× 0.8× 1× run together)
            finer = (0.6, 0.8) if high_end / low_end < 30 else (0.7,)
            ticks = [t for t in finer if t >= low_end] + ticks
        ax.set_xticks(ticks, [f"{t:g}×" for t in ticks])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_yticks(list(rows), [f.label for f in timed])
        ax.invert_yaxis()
        ax.set_xlabel("speed-up over the baseline (log scale); whiskers: 95% interval of the median per-round "
                      "speed-up")
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
    inside: str | None  # the record_function range the host launched the next kernel in (see idle_gaps), if any


def annotation_ranges(prof: torch.profiler.profile, *, on_gpu: bool = False) -> list[tuple[str, float, float]]:
    """(name, start µs, end µs) of every ``record_function`` range of a finished profile, in the order they began.

    ``on_gpu=False`` (the default): as the host ran them — the ranges to attribute kernels to by when they were
    launched (:func:`range_totals`, :func:`idle_gaps`). ``on_gpu=True``: as the profiler draws them on the GPU's
    timeline, around the kernels launched from the thread that opened the range; a range whose kernels another
    thread launches (``backward``: autograd runs it on threads of its own) looks almost empty there."""
    from torch.autograd import DeviceType

    wanted = DeviceType.CUDA if on_gpu else DeviceType.CPU
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if getattr(e, "is_user_annotation", False) and e.device_type == wanted]


def _launched(k: Kernel) -> float:
    """When the host launched a kernel (its start where the profile has no launch time: a CPU operator)."""
    return k.start_us if k.launched_us is None else k.launched_us


def _innermost(ranges: Sequence[tuple[str, float, float]], t: float) -> str | None:
    inside = [(e - s, name) for name, s, e in ranges if s <= t < e]
    return min(inside)[1] if inside else None


@dataclass(frozen=True)
class RangeTotal:
    """What the kernels launched inside one ``record_function`` range took, summed over its calls."""

    name: str
    calls: int
    span_us: float  # the range's own duration on the host, summed
    kernels: int
    device_us: float  # the kernels' time on the device, summed


def range_totals(kernels: Sequence[Kernel], ranges: Sequence[tuple[str, float, float]]) -> dict[str, RangeTotal]:
    """Per range name: its calls, its time on the host, and the kernels launched inside it with their device time.

    A kernel belongs to every range whose host interval contains the moment it was launched (``Kernel.launched_us``;
    for a CPU operator, its start), whichever thread launched it — so ``backward``, whose kernels autograd launches
    from its own threads while the calling thread waits inside the range, gets its kernels. Nested ranges each count
    the kernels inside them. ``ranges`` as from :func:`annotation_ranges` (host side)."""
    ordered = sorted(kernels, key=_launched)
    launched = [_launched(k) for k in ordered]
    out: dict[str, RangeTotal] = {}
    for name, start, end in ranges:
        inside = ordered[bisect.bisect_left(launched, start):bisect.bisect_left(launched, end)]
        prev = out.get(name, RangeTotal(name, 0, 0.0, 0, 0.0))
        out[name] = RangeTotal(name, prev.calls + 1, prev.span_us + end - start, prev.kernels + len(inside),
                               prev.device_us + sum(k.duration_us for k in inside))
    return out


def outside_ranges(kernels: Sequence[Kernel], ranges: Sequence[tuple[str, float, float]], *,
                   negligible: float = 1e-6) -> RangeTotal | None:
    """The kernels launched inside none of ``ranges`` (as :func:`range_totals` attributes them), as a RangeTotal
    named "(outside these ranges)" with no calls and no host span; None when there are none, or when their device
    time is under ``negligible`` of all the kernels' time — a row for them would only show rounding.

    Counted from the kernels themselves, not as all the kernels minus the ranges' totals: that difference leaves a
    float residue (1e-9 ns) where nothing is outside, and counts nested ranges' kernels twice.
    """
    outside = [k for k in kernels if not any(s <= _launched(k) < e for _, s, e in ranges)]
    device_us = sum(k.duration_us for k in outside)
    if not outside or device_us < negligible * sum(k.duration_us for k in kernels):
        return None
    return RangeTotal("(outside these ranges)", 0, 0.0, len(outside), device_us)


def idle_gaps(kernels: Sequence[Kernel], *, ranges: Sequence[tuple[str, float, float]] = (), top: int = 5,
              min_us: float = 0.0) -> list[Gap]:
    """The ``top`` longest gaps between consecutive kernels (kernels on two streams that overlap leave no gap),
    longest first, each with the kernel that ended it and the innermost range (from :func:`annotation_ranges`,
    host side) in which the host launched that kernel — what the GPU was waiting for. For a kernel without a
    launch time (a CPU operator), the range the gap began in.

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
            inside = _innermost(ranges, end if k.launched_us is None else k.launched_us)
            gaps.append(Gap(end - origin, k.start_us - end, k.name, inside))
        end = max(end, k.end_us)
    return sorted(gaps, key=lambda g: g.duration_us, reverse=True)[:top]


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Keep what C++ writes to stderr (the profiler's 'profiler_start/stop' lines, a CPU-only machine's failed GPU
    count) out of the notebook, for the duration of the block, and the profiler's own Python warning that it
    "clears events at the end of each cycle" (PyTorch 2.10–2.11 give it to every first session; it is not the
    reader's concern). Python exceptions and every other warning are unaffected."""
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*Profiler clears events")
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@contextlib.contextmanager
def no_accumulate_grad_stream_warning() -> Iterator[None]:
    """Keep autograd's "The AccumulateGrad node's stream does not match ..." warning off for the block.

    ``torch.cuda.make_graphed_callables`` keeps its capture's autograd graph alive, with each parameter's
    ``AccumulateGrad`` node on the side stream it captured on; every later eager backward through the graphed module
    then accumulates on that stream, and PyTorch 2.10 and later warn about it (the gradients are right). Uses
    ``torch.autograd.graph.set_warn_on_accumulate_grad_stream_mismatch`` where it exists (the switch is
    process-wide and has no getter: it is set back to PyTorch's default, on), else a filter on that one message.
    """
    switch = getattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch", None)
    if switch is None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The AccumulateGrad node's stream does not match")
            yield
        return
    switch(False)
    try:
        yield
    finally:
        switch(True)


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


# ── The workloads the tips are measured on, their training step, and the check of a variant against it ─────────

#: Tolerances of a first step against its reference, by autocast dtype: (loss, gradients), relative.
FIRST_STEP_TOLERANCE: dict[torch.dtype | None, tuple[float, float]] = {
    None: (1e-4, 1e-3), torch.bfloat16: (2e-2, 1e-1), torch.float16: (1e-2, 5e-2)}
_SAME = object()


def _classify_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits against the labels, for images ([B, classes]) and tokens ([B, T, vocab])."""
    return torch.nn.functional.cross_entropy(model(x).flatten(0, -2), y.flatten())


@dataclass
class Workload:
    """A model with its initial weights (never trained), one batch, and its optimizer: what a tip is measured on.

    ``step()`` builds the usual training step on a fresh copy of the initial weights — ``zero_grad``, forward and
    loss under autocast (``amp``; None: fp32), backward (through a ``GradScaler`` with fp16), optimizer step — so
    that no variant disturbs another. ``layout`` is the memory format of 4-D models and images (ResNet-50:
    ``torch.channels_last`` once a notebook has measured it faster).
    """

    name: str
    model: torch.nn.Module
    x: torch.Tensor
    y: torch.Tensor
    optimizer: Callable[..., torch.optim.Optimizer]
    optimizer_name: str
    amp: torch.dtype | None = None
    layout: torch.memory_format = torch.contiguous_format
    _noise: float | None = None

    def fresh(self) -> torch.nn.Module:
        """A copy of the initial weights, in ``layout``."""
        model = copy.deepcopy(self.model)
        return model.to(memory_format=self.layout) if self.x.dim() == 4 else model

    def inputs(self) -> torch.Tensor:
        return self.x.contiguous(memory_format=self.layout) if self.x.dim() == 4 else self.x

    def step(self, *, model: torch.nn.Module | None = None, x: torch.Tensor | None = None, amp=_SAME,
             set_to_none: bool = True, annotate: bool = False, **optimizer_options) -> Callable[..., torch.Tensor]:
        """A training step on ``model`` (default: a fresh copy); call it as ``step()`` (this workload's batch, or
        ``x`` where given, e.g. in another memory format) or ``step(x, y)``; it returns the loss, detached.
        ``step.model`` and ``step.optimizer`` are what it trains;
        ``annotate=True`` marks its phases (zero_grad, forward, backward, optimizer) with ``record_function``."""
        amp = self.amp if amp is _SAME else amp
        model = self.fresh() if model is None else model
        optimizer = self.optimizer(model.parameters(), **optimizer_options)
        scaler = torch.amp.GradScaler(self.x.device.type) if amp == torch.float16 else None
        mark = torch.profiler.record_function if annotate else (lambda _: contextlib.nullcontext())
        x0, y0 = self.inputs() if x is None else x, self.y

        def step(x: torch.Tensor = x0, y: torch.Tensor = y0) -> torch.Tensor:
            with mark("zero_grad"):
                optimizer.zero_grad(set_to_none=set_to_none)
            with mark("forward"), torch.autocast(x.device.type, dtype=amp, enabled=amp is not None):
                loss = _classify_loss(model, x, y)
            with mark("backward"):
                (loss if scaler is None else scaler.scale(loss)).backward()
            with mark("optimizer"):
                if scaler is None:
                    optimizer.step()
                else:
                    scaler.step(optimizer)
                    scaler.update()
            return loss.detach()

        step.model, step.optimizer = model, optimizer
        return step

    def row(self) -> dict[str, str]:
        from utils.models import count_parameters

        return {"workload": self.name, "parameters": f"{count_parameters(self.model) / 1e6:.2f} M",
                "parameter tensors": str(len(list(self.model.parameters()))), "batch": str(list(self.x.shape)),
                "optimizer": self.optimizer_name}

    def autocast_noise(self) -> float:
        """How far autocast's first-step gradients lie from fp32's on this workload (0 without autocast)."""
        if self._noise is None:
            low = first_step(self.step())[1] if self.amp is not None else None
            self._noise = 0.0 if low is None else relative_error(low, first_step(self.step(amp=None))[1])
        return self._noise


def workloads(device: torch.device | str, amp: torch.dtype | None) -> dict[str, Workload]:
    """The three workloads of notebooks 07 and 07b, sized for the device, with random data (nothing downloaded):

    * **MLP** (the seed's, batch 64 of MNIST-sized images, Adam): a few small kernels per step;
    * **Transformer** (the seed's language model, dropout 0 so that two variants compare number for number,
      AdamW): matmuls and attention with normalisation and elementwise kernels between them;
    * **ResNet-50** (torchvision, randomly initialised, ``zero_init_residual=True`` as in Goyal et al.'s recipe,
      without which a fresh ResNet-50's gradients blow up; SGD with momentum 0.9): convolutions, batch norm and
      activations. On a CPU at 48 px (its last stage 2×2): at 32 px that stage is 1×1, and batch norm over 2 values
      amplifies rounding.

    A GPU with 30 GiB or more gets the larger batches (Transformer 16 × 256 tokens, ResNet-50 64 × 224²).
    """
    import torchvision

    from utils.data import synthetic_tokens
    from utils.env import by_device, capabilities
    from utils.models import MLP, TransformerConfig, TransformerModel

    device = torch.device(device)
    big = device.type == "cuda" and capabilities(device).total_memory_bytes >= 30 * 2**30
    torch.manual_seed(0)
    config = by_device(device, cuda=TransformerConfig(dropout=0.0), cpu=TransformerConfig(
        vocab_size=256, d_model=64, nhead=4, num_layers=1, dim_feedforward=256, dropout=0.0))
    t_batch, t_seq = by_device(device, cpu=(4, 32), cuda=(16 if big else 8, 256))
    r_batch, r_size = by_device(device, cpu=(2, 48), cuda=(64 if big else 32, 224))
    resnet = torchvision.models.resnet50(weights=None, zero_init_residual=True)
    return {
        "MLP": Workload("MLP", MLP().to(device), torch.randn(64, 1, 28, 28, device=device),
                        torch.randint(0, 10, (64,), device=device), torch.optim.Adam, "Adam", amp),
        "Transformer": Workload("Transformer", TransformerModel(config).to(device),
                                *synthetic_tokens(t_batch, t_seq, config.vocab_size, device=device),
                                torch.optim.AdamW, "AdamW", amp),
        "ResNet-50": Workload("ResNet-50", resnet.to(device), torch.randn(r_batch, 3, r_size, r_size, device=device),
                              torch.randint(0, 1000, (r_batch,), device=device),
                              lambda params, **kw: torch.optim.SGD(params, lr=0.1, momentum=0.9, **kw),
                              "SGD, momentum 0.9", amp),
    }


def within(context: Callable[[], contextlib.AbstractContextManager], step: Callable) -> Callable:
    """``step`` with every call run inside ``context()`` — a settings switch such as TF32 or cudnn.benchmark — so
    that two settings can alternate round by round. Keeps ``step.model`` and ``step.optimizer``."""
    def run(*args):
        with context():
            return step(*args)

    run.__dict__.update(getattr(step, "__dict__", {}))
    return run


def first_step(step: Callable[[], torch.Tensor]) -> tuple[float, torch.Tensor | None]:
    """The loss and the gradients (flattened, fp32) of a step's first call; gradients None when they are not
    finite (with fp16, the GradScaler's first scale can overflow: it then skips the step)."""
    loss = float(step())
    grads = torch.cat([p.grad.detach().float().flatten() for p in step.model.parameters() if p.grad is not None])
    return loss, grads if bool(grads.isfinite().all()) else None


def same_first_step(variant: Callable, reference: Callable, workload: Workload, *, what: str = "the variant") -> str:
    """Check that ``variant``'s first step gives ``reference``'s loss and gradients (both fresh steps from the same
    weights, on the same batch) up to rounding, and say by how much they differ.

    Tolerances (relative): 1e-4 for the loss and 1e-3 for the gradients in fp32; under 16-bit autocast, where each
    operation rounds coarsely, 2e-2 and 1e-1 (bf16) or 1e-2 and 5e-2 (fp16) — or, where larger, autocast's own
    distance from fp32 on the workload (:meth:`Workload.autocast_noise`; a tenth of it for the loss). Gradients
    that a GradScaler skipped (not finite) are said to be, not compared.

    Raises:
        AssertionError: when the two differ beyond the tolerance.
    """
    got, expected = first_step(variant), first_step(reference)
    loss_tol, grad_tol = FIRST_STEP_TOLERANCE[workload.amp]
    noise = workload.autocast_noise()
    loss_tol, grad_tol = max(loss_tol, noise / 10), max(grad_tol, noise)
    loss_err = abs(got[0] / expected[0] - 1) if expected[0] else abs(got[0])
    both = got[1] is not None and expected[1] is not None
    grad_err = relative_error(got[1], expected[1]) if both else 0.0
    if not (loss_err <= loss_tol and grad_err <= grad_tol):
        raise AssertionError(f"{what}: loss differs by {loss_err:.1e} (tolerance {loss_tol:.0e}), gradients by "
                             f"{grad_err:.1e} (tolerance {grad_tol:.0e})")
    return (f"{what} computes the same first step: loss {loss_err:.0e}, "
            + (f"gradients {grad_err:.0e}" if both else "gradients not finite (fp16 scale), not compared")
            + f" (tolerances {loss_tol:.0e}, {grad_tol:.0e})")


# ── After every timing: each comparison's variants profiled, and what changed printed for every outcome ──────


@dataclass(frozen=True)
class ToProfile:
    """The steps a comparison timed (name → callable, the comparison's variant names), to profile after every
    timing of the process; ``kind`` the class of kernels the tip acts on ('conv', 'matmul', ...), if any."""

    steps: Mapping[str, Callable[[], object]]
    comparison: Comparison
    kind: str | None = None
    unit: str = "step"
    profiled_steps: int | None = None
    waits_for: str | None = None  # what the GPU waits for when it waits for the host, where not only launches


def explain_by_profiles(findings: Findings, pairs: Mapping[str, ToProfile], *, steps: int = 5,
                        progress: bool = True, launch_us: Mapping[str, float] | None = None,
                        ) -> dict[str, dict[str, StepProfile]]:
    """Profile every comparison's variants (:func:`utils.profile.profile_steps`, against the time the comparison
    measured for each) and print, for every finding whose verdict came from that comparison, its verdict and what
    changed between the two profiles (:func:`profile_change`) — whatever the outcome, so that a gain, a null and an
    inconclusive result are all read against the GPU's work. ``launch_us``: the host's µs per call measured apart
    (``{"ATen op": 11.0}``), printed beside every host-bound reading. Returns the profiles, key → variant →
    StepProfile.

    Call it after every timing of the process: a profile slows host-bound code after it, and ``utils.bench``
    refuses to time once one has run.
    """
    from utils.profile import profile_steps

    out: dict[str, dict[str, StepProfile]] = {}
    items = list(pairs.items())
    if progress:
        from tqdm.auto import tqdm

        items = tqdm(items, desc="profiles", leave=False)
    for key, pair in items:
        out[key] = {name: profile_steps(step, step_s=pair.comparison.time_s(name), unit=pair.unit,
                                        steps=pair.profiled_steps or steps)
                    for name, step in pair.steps.items()}
        for f in findings:
            v = f.verdict
            if f.comparison is pair.comparison and {v.baseline, v.variant} <= out[key].keys():
                reading = profile_change(out[key][v.baseline], out[key][v.variant], kind=pair.kind,
                                         launch_us=launch_us, waits_for=pair.waits_for)
                print(f"{f.label}: {f.measured} — {reading}")
    return out


def same_gradients(model: torch.nn.Module, reference: Callable, workload: Workload, *, what: str) -> str:
    """Check the gradients ``model`` holds after a first step taken elsewhere (e.g. a compiled step's first call,
    timed as its compile) against ``reference``'s first step (a fresh step from the same weights), with the
    tolerances of :func:`same_first_step`; say by how much they differ.

    Raises:
        AssertionError: when they differ beyond the tolerance, or the model holds no gradients.
    """
    held = [p.grad for p in model.parameters() if p.grad is not None]
    if not held:
        raise AssertionError(f"{what}: the model holds no gradients: take its first step before the check")
    grads = torch.cat([g.detach().float().flatten() for g in held])
    expected = first_step(reference)[1]
    grad_tol = max(FIRST_STEP_TOLERANCE[workload.amp][1], workload.autocast_noise())
    if expected is None or not bool(grads.isfinite().all()):
        return f"{what}: gradients not finite (fp16 scale), not compared"
    err = relative_error(grads, expected)
    if err > grad_tol:
        raise AssertionError(f"{what}: gradients differ by {err:.1e} (tolerance {grad_tol:.0e})")
    return f"{what} computes eager's first-step gradients: relative error {err:.0e} (tolerance {grad_tol:.0e})"


def profile_tables(prof, *, phases: Sequence[str], steps: int, on_gpu: bool) -> float:
    """Print what a hand-opened profile (:func:`utils.profile.session`) of ``steps`` annotated steps says: per
    ``record_function`` range, its host time and the kernels launched inside it (:func:`range_totals`, so that
    ``backward`` gets the kernels autograd launches from its own threads); then the longest idle gaps, each with the
    range in which the host launched the kernel the GPU waited for (:func:`idle_gaps`). Returns the share of the
    profiled window the device sat idle (the profiler's own bookkeeping slows the host: a host-paced step looks
    idler here than unprofiled). On a CPU the top-level operators stand in for kernels."""
    from utils.plot import table
    from utils.profile import cpu_operators, gpu_kernels

    kernels = gpu_kernels(prof) if on_gpu else cpu_operators(prof)
    ranges = [r for r in annotation_ranges(prof) if r[0] in phases]
    work, what = ("GPU", "kernels") if on_gpu else ("operator", "operators")
    all_us = sum(k.duration_us for k in kernels) or 1.0
    totals = list(range_totals(kernels, ranges).values())
    outside = outside_ranges(kernels, ranges)
    rows = [{"range": t.name, "on the host, profiled": format_seconds(t.span_us / 1e6 / steps) if t.calls else "—",
             f"{work} time of its {what}": format_seconds(t.device_us / 1e6 / steps), what: f"{t.kernels / steps:.0f}",
             f"share of all {work} time": f"{t.device_us / all_us:.0%}"}
            for t in totals + ([outside] if outside else [])]
    table(rows, title=f"Per step: the {what} launched in each range, and their {work} time")
    gaps = idle_gaps(kernels, ranges=ranges, top=5)
    table([{"gap begins": f"{g.start_us / 1e3:.2f} ms", "idle for": format_seconds(g.duration_us / 1e6),
            "next launched in": g.inside or "—", "next": g.next_kernel[:60]} for g in gaps] or [{"gap": "none"}],
          title=f"The longest idle gaps of {steps} steps")
    window_us = max(k.end_us for k in kernels) - min(k.start_us for k in kernels)
    idle = sum(g.duration_us for g in idle_gaps(kernels, top=len(kernels))) / window_us if window_us > 0 else 0.0
    span = f"Between the first and the last {what[:-1]} of the profile ({format_seconds(window_us / 1e6)})"
    print(f"{span}, the GPU sat idle {idle:.0%} of the time, under the profiler (its bookkeeping slows the host, "
          "so a host-paced step looks idler here than timed)" if on_gpu else
          f"{span}, {idle:.0%} of the time was spent between operators: Python, dispatch and the profiler's "
          "bookkeeping (on a CPU the host runs the operators too, so nothing waits idle)")
    return idle
