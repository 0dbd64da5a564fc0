"""Where a step's time goes, read off ``torch.profiler``: the kernels a step runs, how long the GPU is busy and
how long it waits, the top kernels, time by kind (matmul, attention, other), and a trace for Perfetto.

    prof = utils.profile.profile_steps(lambda: train_step(...), step_s=timing.median_s, trace_path="step.json")
    print(prof.bottleneck())     # "launch-bound: the GPU is idle 62% of the step (47 kernels, 9.8 µs each) ..."
    utils.plot.table(prof.top_kernels(8))
    print(utils.profile.compare_profiles(eager_prof, compiled_prof))  # which kind of time shrank, which grew

On a GPU the kernels are what the GPU really ran — compute kernels, copies and memsets, as CUPTI records them.
Ranges that code marks with ``record_function`` (e.g. ``Optimizer.step#AdamW.step``) are drawn on the GPU timeline
too, around the kernels inside them; they are annotations, not work, and are left out so nothing is counted twice.
*Busy* time is the union of the kernels' intervals (kernels on two streams that overlap count once); *idle* is the
rest of the step, when the GPU waited for the CPU to give it work.

On a CPU there is no separate device: the "kernels" are the top-level operators the step called (what the CPU
ran on behalf of PyTorch), busy time is the time inside them, and idle time is the Python, data loading and
dispatch between them.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from utils.env import get_device, synchronize

# ── Profiling never precedes a timing in the same process ──────────────────────────────────────────────────

#: Where each profiler session of this process was opened (utils.bench refuses to time after the first one).
_SESSIONS: list[str] = []



#: Words of a kernel's template arguments that say nothing about what it does.
_GENERIC_WORDS = {"native", "detail", "cutlass", "lambda", "operator", "const", "TensorIteratorBase", "Array",
                  "BFloat16", "Half", "float", "char", "unsigned", "long", "bool", "double", "Params", "void", "std",
                  "size_t"}


def readable_kernel_name(name: str, width: int = 70) -> str:
    """A kernel's name short enough for a table, keeping what says what it does.

    A templated ATen kernel (``void at::native::elementwise_kernel<128, 4, ...direct_copy_kernel_cuda...>(...)``)
    becomes its own name and the functor it runs (``elementwise_kernel (direct_copy_kernel_cuda)``); other names
    (cuBLAS, cuDNN, Triton) are kept, cut at ``width`` characters with an ellipsis."""
    text = name.removeprefix("void ").replace("(anonymous namespace)::", "").strip()
    cut = min((i for i in (text.find("<"), text.find("(")) if i > 0), default=-1)
    if cut > 0:
        base = text[:cut].split("::")[-1]
        words = [w for w in re.findall(r"[A-Za-z_]\w{3,}", text[cut:])
                 if w != base and w not in _GENERIC_WORDS and not w.startswith("gpu_kernel_impl")]
        telling = [w for w in words if re.search(r"kernel_cuda|Functor|_op$|Op$|cutlass_|xmma|gemm|conv", w)]
        inner = telling or words
        text = f"{base} ({inner[0]})" if inner else base
    return text if len(text) <= width else text[:width - 1] + "…"


class ProfiledProcessError(RuntimeError):
    """A timing was asked for after a profiler session ran in this process."""


def mark_profiled(where: str) -> None:
    """Note that a profiler session ran in this process (``where``: what opened it)."""
    _SESSIONS.append(where)


def profiled() -> str | None:
    """What opened the first profiler session of this process, or None when none has run (or one is running)."""
    if _SESSIONS:
        return _SESSIONS[0]
    if getattr(torch.autograd.profiler, "_is_profiler_enabled", False):
        return "a torch.profiler session that is still open"
    return None


def assert_not_profiled(what: str) -> None:
    """Raise :class:`ProfiledProcessError` when a profiler session has run in this process.

    A finished ``torch.profiler`` session can leave NVIDIA's CUPTI attached (Kineto tears it down only with
    ``TEARDOWN_CUPTI=1``, which PyTorch turns off where it crashed with CUDA graphs), and host-bound code then runs
    slower for the rest of the process (pytorch/pytorch#144455): a timing taken after a profile does not compare
    with one taken before it. So the course times first and profiles afterwards, and this guard makes the order a
    rule rather than a habit. :func:`utils.bench.bench` and :func:`utils.bench.compare` call it.
    """
    first = profiled()
    if first is not None:
        raise ProfiledProcessError(
            f"{what}: a profiler session already ran in this process ({first}). A finished profile can leave "
            "CUPTI attached and slow host-bound code, so timings after it do not compare with timings before it. "
            "Take every timing before the first profile: restart the kernel and run the cells in order.")


@contextlib.contextmanager
def session(**options):
    """``torch.profiler.profile(**options)`` as a context manager that also marks this process as profiled, so that
    no timing follows it (:func:`assert_not_profiled`). Use it wherever a notebook opens a profiler itself::

        with utils.profile.session(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=8))
    """
    mark_profiled("utils.profile.session")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events")  # torch 2.11: not our concern
        with profile(**options) as prof:
            yield prof

#: Kernel and operator names of matrix multiplies: cuBLAS/cuBLASLt (gemm, nvjet, xmma, cutlass), Triton matmul
#: templates, and the ATen operators on a CPU.
MATMUL = re.compile(r"gemm|gemv|nvjet|xmma|cutlass|cublas|triton_tem|^aten::(mm|addmm|bmm|baddbmm|_addmm_activation|"
                    r"matmul|linear)$"
                    # a CPU profile's backward: autograd's node for a matmul is the top-level operator
                    r"|^autograd::engine::evaluate_function: (Addmm|Mm|Bmm|Baddbmm|Linear|Matmul)Backward\d*$",
                    re.IGNORECASE)
#: Attention kernels and operators (FlashAttention, memory-efficient, cuDNN, SDPA).
ATTENTION = re.compile(r"flash|fmha|attention|sdpa|scaled_dot_product", re.IGNORECASE)
#: Inductor's generated pointwise, persistent-reduction and reduction kernels: named after the operators fused into
#: them (``triton_poi_fused__scaled_dot_product_flash_attention_…``), which makes none of them an attention kernel.
INDUCTOR_FUSED = re.compile(r"^triton_(poi|per|red)_")
#: Profiler events that are wrappers, not work (compiled-graph calls, Dynamo frames, profiler steps).
_WRAPPERS = ("TorchDynamo", "Torch-Compiled", "Pregraph", "AOTDispatcher", "## ", "ProfilerStep", "CompiledFunction")


@dataclass(frozen=True)
class Kernel:
    """One piece of device work (a GPU kernel, copy or memset) or, on a CPU, one top-level operator call.

    On a GPU, ``op`` is the innermost operator that launched it (``aten::cudnn_convolution``,
    ``aten::convolution_backward``, ...) and ``launched_us`` when the host launched it, on the profile's clock; both
    come from the profiler's correlation ids (:func:`gpu_kernels`) and stay empty where the profile has no link.
    """

    name: str
    start_us: float
    duration_us: float
    op: str = ""
    launched_us: float | None = None

    @property
    def end_us(self) -> float:
        return self.start_us + self.duration_us


def kind_of(name: str) -> str:
    """'matmul', 'attention' or 'other' for a kernel or operator name. Attention first: the fused attention kernels'
    full names carry their matmul library's (``pytorch_flash::flash_fwd_kernel<…cutlass::bfloat16_t…>``). An Inductor
    pointwise or reduction kernel is 'other' whatever operators its name lists (:data:`INDUCTOR_FUSED`)."""
    if ATTENTION.search(name) and not INDUCTOR_FUSED.match(name):
        return "attention"
    if MATMUL.search(name):
        return "matmul"
    return "other"


@dataclass
class StepProfile:
    """What ``steps`` calls of a step ran, per step. Build it with :func:`profile_steps`."""

    device: str
    steps: int
    wall_s: float  # one step: the time given by the caller (utils.bench) or, else, measured under the profiler
    kernels: list[Kernel]
    on_gpu: bool
    trace_path: Path | None = None
    profiled_wall_s: float = 0.0  # one step as measured under the profiler (which adds overhead of its own)
    unit: str = "step"  # what one call of the profiled function is: "step", "epoch", ...
    operator_calls: Counter = field(default_factory=Counter)  # every operator call by name, nested ones included
    _busy_s: float | None = field(default=None, repr=False)

    @property
    def kernels_per_step(self) -> float:
        return len(self.kernels) / self.steps

    def calls_per_step(self, operator: str) -> float:
        """Calls per step of an operator by name (``"aten::_to_copy"``: casts and copies to another dtype or device),
        counting calls nested inside other operators too — on a CPU as on a GPU, where :attr:`kernels` shows only
        what the device ran."""
        return self.operator_calls[operator] / self.steps

    @property
    def busy_s(self) -> float:
        """Seconds per step in which the device works: the union of the kernels' intervals (operators on CPU)."""
        if self._busy_s is None:
            total_us, end_us = 0.0, -float("inf")
            for k in sorted(self.kernels, key=lambda k: k.start_us):
                start = max(k.start_us, end_us)
                if k.end_us > start:
                    total_us += k.end_us - start
                end_us = max(end_us, k.end_us)
            self._busy_s = total_us / 1e6 / self.steps
        return self._busy_s

    @property
    def overlap(self) -> float:
        """The kernels' summed durations over the busy time: 1 where one kernel runs at a time, more where kernels
        overlap — on several streams, or with programmatic dependent launch, where a kernel starts (and waits)
        before the one before it has ended, so its duration includes that wait."""
        summed_s = sum(k.duration_us for k in self.kernels) / 1e6 / self.steps
        return summed_s / self.busy_s if self.busy_s > 0 else 1.0

    @property
    def idle_s(self) -> float:
        """Seconds per step in which no kernel ran (on CPU: no operator ran): the device waited for the host."""
        return max(0.0, self.wall_s - self.busy_s)

    @property
    def idle_fraction(self) -> float:
        return self.idle_s / self.wall_s if self.wall_s > 0 else 0.0

    def time_by_kind(self) -> dict[str, float]:
        """Seconds per step of matmul, attention and other kernels (summed durations, see :func:`kind_of`)."""
        out = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
        for k in self.kernels:
            out[kind_of(k.name)] += k.duration_us / 1e6 / self.steps
        return out

    def top_kernels(self, n: int = 8) -> list[dict[str, object]]:
        """Table rows of the ``n`` kernels (by name, every launch summed) that take the most time per step."""
        total = Counter()
        calls = Counter()
        for k in self.kernels:
            total[k.name] += k.duration_us
            calls[k.name] += 1
        busy_us = sum(total.values()) or 1.0
        what = "kernel" if self.on_gpu else "operator"
        return [{what: readable_kernel_name(name),
                 f"calls per {self.unit}": f"{calls[name] / self.steps:.3g}",
                 f"time per {self.unit}": _format_us(us / self.steps), "share of busy": f"{us / busy_us:.0%}",
                 "kind": kind_of(name)}
                for name, us in total.most_common(n)]

    def summary_row(self, label: str) -> dict[str, object]:
        """One table row: step time, busy, idle, kernels per step and the time by kind (summed durations: where
        kernels overlap, :attr:`overlap` > 1, they add up to more than the busy time)."""
        kinds = self.time_by_kind()
        return {self.unit: label, "wall": _format_us(self.wall_s * 1e6), "busy": _format_us(self.busy_s * 1e6),
                "idle": f"{self.idle_fraction:.0%}", "kernels": f"{self.kernels_per_step:.0f}"
                if self.on_gpu else "—", "matmul": _format_us(kinds["matmul"] * 1e6),
                "attention": _format_us(kinds["attention"] * 1e6), "other": _format_us(kinds["other"] * 1e6)}

    def bottleneck(self, *, in_cuda_graphs: bool = False) -> str:
        """One sentence on what bounds this step, from the numbers: waiting for the host, or which kind of work.

        ``in_cuda_graphs``: the step's kernels already run from CUDA graphs (``mode="reduce-overhead"``, a captured
        step), so a GPU that idles waits for host work outside or around the graphs, not for launches."""
        per_kernel_us = self.busy_s * 1e6 / max(self.kernels_per_step, 1)
        if self.on_gpu:
            where = (f"the GPU is idle {self.idle_fraction:.0%} of the {self.unit} "
                     f"({_format_us(self.idle_s * 1e6)} of {_format_us(self.wall_s * 1e6)}; "
                     f"{self.kernels_per_step:.0f} kernels, {_format_us(per_kernel_us)} each on average)")
            if self.idle_fraction >= 0.5 and in_cuda_graphs:
                return (f"host-bound: {where} — its kernels already run from CUDA graphs, so the GPU waits for host "
                        "work outside or around them (eager code between the graphs, their bookkeeping); moving that "
                        "work into the graphs or off the step helps, faster kernels do not")
            if self.idle_fraction >= 0.5:
                return (f"launch-bound: {where} — the CPU cannot issue work as fast as the GPU does it; fewer, larger "
                        "kernels help (a larger batch, fusion, CUDA graphs), faster kernels do not")
            if self.idle_fraction >= 0.2 and in_cuda_graphs:
                return (f"partly host-bound: {where} — its kernels run from CUDA graphs, so the GPU waits for host "
                        "work around them, not for launches")
            if self.idle_fraction >= 0.2:
                return f"partly launch-bound: {where}"
        kinds = self.time_by_kind()
        largest = max(kinds, key=kinds.get)
        share = kinds[largest] / max(sum(kinds.values()), 1e-12)
        top = self.top_kernels(1)
        top_name = next(iter(top[0].values())) if top else "none"
        if self.on_gpu:
            kind = "non-matmul, non-attention" if largest == "other" else largest
            overlap = (f"; the kernels overlap: their durations add up to {self.overlap:.2g}× the busy time (a kernel "
                       "that starts before the one before it ends counts its wait too), so the time by kind is "
                       "shares of the summed durations" if self.overlap > 1.1 else "")
            return (f"GPU-bound: busy {1 - self.idle_fraction:.0%} of the {self.unit}; {kind} kernels take "
                    f"{share:.0%} of that; the kernel with the most time in total is {top_name}{overlap}")
        return (f"on the CPU, operators take {1 - self.idle_fraction:.0%} of the {self.unit} (the rest is Python, "
                f"dispatch, and compiled code the profiler does not record as an operator); {largest} takes "
                f"{share:.0%} of the operator time")

    def __str__(self) -> str:
        return (f"{self.steps} {self.unit}s on {self.device}: {_format_us(self.wall_s * 1e6)} per {self.unit}, "
                f"busy {_format_us(self.busy_s * 1e6)}, {self.kernels_per_step:.0f} "
                f"{'kernels' if self.on_gpu else 'operators'} per {self.unit}")


def _format_us(us: float) -> str:
    if us >= 1e6:
        return f"{us / 1e6:.3g} s"
    if us >= 1e3:
        return f"{us / 1e3:.3g} ms"
    return f"{us:.3g} µs"


def _largest_of_kind(p: StepProfile, kind: str) -> str | None:
    """The name of ``p``'s kernel of ``kind`` that takes the most time (every launch summed), or None."""
    total = Counter()
    for k in p.kernels:
        if kind_of(k.name) == kind:
            total[k.name] += k.duration_us
    return total.most_common(1)[0][0] if total else None


def compare_profiles(before: StepProfile, after: StepProfile, names: tuple[str, str] = ("eager", "compiled"), *,
                     fusion: bool = True, idle_noise_s: float = 0.0) -> str:
    """What changed from ``before`` to ``after``, two profiles of the same work (e.g. eager and compiled), as one
    sentence for a verdict's reason.

    Per call of the profiled function it gives the kernels and the wall time, then the kind of time that shrank
    most and the kind that grew most — matmul, attention or other kernels, or idle time (the differences of
    :meth:`StepProfile.time_by_kind` and :attr:`StepProfile.idle_s`; without kernels overlapping on two streams
    they add up to the change in wall time) — each with its largest kernel in both versions ("the largest in
    both" when it is the same kernel). Idle time is the wall time (a timing's median, ``step_s``) less the kernels'
    time, so it carries the timing's noise: ``idle_noise_s`` (e.g. the half-widths of the two timings' bands,
    summed) is how far a change of idle time may be that noise; a change within it is never "shrank most" or "grew
    most", and is said as within the timings' bands. Last (``fusion``, for a compile: leave it out for a change of
    type or batch size, which is no fusion), the share of ``before``'s wall time in matmul kernels: that work stays
    after compiling, so fusion can save mostly in the rest (attention, where either profile has attention kernels,
    may be lowered to other kernels); where ``after`` took no less wall time, it says that the rest saved nothing
    overall here.

    On a CPU the kernels are top-level operators and idle time is the time outside them: Python, dispatch, and the
    C++ code that a compiled graph generates (it runs no operator the profiler sees).
    """
    if before.unit != after.unit or before.on_gpu != after.on_gpu:
        raise ValueError(f"compare_profiles needs two profiles of the same kind of call on the same kind of device: "
                         f"got a {before.unit} on {before.device} and a {after.unit} on {after.device}")
    b_name, a_name = names
    unit, what = after.unit, "kernels" if after.on_gpu else "operators"
    idle = "GPU idle time" if after.on_gpu else "time outside operators (Python, dispatch, compiled C++ code)"
    tb, ta = before.time_by_kind(), after.time_by_kind()
    tb["idle"], ta["idle"] = before.idle_s, after.idle_s

    def change(kind: str, verb: str) -> str:
        label = idle if kind == "idle" else f"{kind} {what}"
        text = f"{label} {verb} most ({_format_us(tb[kind] * 1e6)} → {_format_us(ta[kind] * 1e6)}"
        if kind != "idle":
            b_top, a_top = _largest_of_kind(before, kind), _largest_of_kind(after, kind)
            short = {n: "none" if n is None else n if len(n) <= 60 else n[:59] + "…" for n in (b_top, a_top)}
            text += (f"; the largest in both: {short[a_top]}" if b_top == a_top else
                     f"; the largest {b_name}: {short[b_top]}, {a_name}: {short[a_top]}")
            if a_top is None and b_top is not None:  # not gone: done by kernels of another kind (a fused matmul...)
                text += f" — no {a_name} kernel is classed as {kind}: that work runs in kernels of another kind there"
        return text + ")"

    if idle_noise_s < 0:
        raise ValueError(f"compare_profiles(): idle_noise_s must be >= 0, got {idle_noise_s}")
    deltas = {kind: ta[kind] - tb[kind] for kind in tb}
    idle_within = abs(deltas["idle"]) <= idle_noise_s and deltas["idle"] != 0
    ranked = {kind: d for kind, d in deltas.items() if not (kind == "idle" and idle_within)}
    shrank, grew = min(ranked, key=ranked.get), max(ranked, key=ranked.get)
    parts = [f"per {unit}, {b_name} → {a_name}: {before.kernels_per_step:.0f} → {after.kernels_per_step:.0f} {what}, "
             f"{_format_us(before.wall_s * 1e6)} → {_format_us(after.wall_s * 1e6)}",
             change(shrank, "shrank") if ranked[shrank] < 0 else "no kind of time shrank",
             change(grew, "grew") if ranked[grew] > 0 else "no kind of time grew"]
    if idle_within:
        parts.append(f"{idle} {_format_us(tb['idle'] * 1e6)} → {_format_us(ta['idle'] * 1e6)}: a change within the "
                     f"timings' bands (±{_format_us(idle_noise_s * 1e6)}), not read")
    if fusion:
        share = tb["matmul"] / before.wall_s if before.wall_s > 0 else 0.0
        lowered = (f" (attention may be lowered to other {what})"
                   if before.time_by_kind()["attention"] or after.time_by_kind()["attention"] else "")
        text = f"matmul {what} take {share:.0%} of {b_name}'s {unit}: that work stays after compiling{lowered}, so " \
               f"fusion can save mostly in the rest"
        if after.wall_s >= before.wall_s:
            text += f"; here the {a_name} {unit} saved nothing overall"
        parts.append(text)
    return "; ".join(parts)


def gpu_kernels(prof: profile) -> list[Kernel]:
    """Every kernel, copy and memset the GPU ran in a finished profile, in start order, annotations left out; each
    with the operator that launched it and when (:class:`Kernel`), read from the profiler's correlation ids."""
    launches = _launches(prof)
    found = []
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False):
            op, launched_us = launches.get(e.id, ("", None))
            found.append(Kernel(e.name, e.time_range.start, e.time_range.end - e.time_range.start, op, launched_us))
    return sorted(found, key=lambda k: k.start_us)


#: Names of CUDA runtime and driver calls (cudaLaunchKernel, cuLaunchKernelEx, ...): launches, not operators.
_RUNTIME_CALL = re.compile(r"^cu(da)?[A-Z]")


def _launches(prof: profile) -> dict[int, tuple[str, float]]:
    """GPU activity's correlation id → (the operator that launched it, µs when the host launched it).

    The profiler links each kernel, copy and memset, and the runtime call that launched it (``cudaLaunchKernel``),
    to the innermost operator open on the launching thread (``linked_correlation_id``); the launch time is the
    runtime call's start, else the operator's. Times are on the clock of ``prof.events()``. Empty when the profile
    carries no such links."""
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if results is None:
        return {}
    try:
        return link_launches(results.events(), results.trace_start_ns())
    except AttributeError:  # a torch whose raw events lack one of these methods: kernels stay unlinked
        return {}


def link_launches(events, trace_start_ns: int) -> dict[int, tuple[str, float]]:
    """:func:`_launches` on raw profiler events (``torch.autograd._KinetoEvent``-like objects with ``name()``,
    ``device_type()``, ``correlation_id()``, ``linked_correlation_id()``, ``start_ns()`` and
    ``is_user_annotation()``)."""
    ops: dict[int, tuple[str, float]] = {}
    calls: dict[int, float] = {}  # runtime call's correlation id → its start (µs)
    device: dict[int, int] = {}  # GPU activity's correlation id → the operator's correlation id
    for e in events:
        start_us = (e.start_ns() - trace_start_ns) / 1e3
        linked = e.linked_correlation_id()
        if e.device_type() == DeviceType.CPU:
            if linked > 0:
                calls[e.correlation_id()] = start_us
            elif not e.is_user_annotation() and not _RUNTIME_CALL.match(e.name()):
                ops[e.correlation_id()] = (e.name(), start_us)
        elif linked > 0:
            device[e.correlation_id()] = linked
    links = {}
    for correlation, op_id in device.items():
        name, op_start = ops.get(op_id, ("", None))
        launched = calls.get(correlation, op_start)
        if launched is not None:
            links[correlation] = (name, launched)
    return links


def op_table(prof: profile, *, row_limit: int = 10, max_name_column_width: int = 45,
             kernels_only: bool = False) -> str:
    """``prof.key_averages().table(...)`` without the rows of ``record_function`` ranges, sorted by the device time
    each row took itself on a GPU profile (by self CPU time otherwise).

    A range is drawn on the GPU's timeline around the kernels launched inside it, and the table credits it with
    their time as its "Self CUDA" — time already in those kernels' own rows, so with the ranges the shares add up to
    more than 100%. Ranges whose kernels run on another thread (backward, on autograd's) look empty there instead.

    An operator and its kernels double up the same way: an operator's "Self CUDA" is the time of the kernels it
    launched, and those kernels have rows of their own, so over all rows "Self CUDA %" adds up to about 200%.
    ``kernels_only=True`` keeps the device's own rows (kernels, copies, memsets): each device microsecond in one
    row, the shares adding up to 100% (the CPU columns of those rows are empty). A CPU profile has no such rows.

    Raises:
        ValueError: for ``kernels_only=True`` on a profile without device rows (a CPU profile).
    """
    on_gpu = any(e.device_type == DeviceType.CUDA for e in prof.events())
    if kernels_only and not on_gpu:
        raise ValueError("kernels_only=True needs a GPU profile: a CPU profile has operators only")
    averages = prof.key_averages()
    averages[:] = [a for a in averages if not getattr(a, "is_user_annotation", False)
                   and (not kernels_only or a.device_type != DeviceType.CPU)]
    if kernels_only:  # the device's rows only: their CPU columns would be empty, so a table of device time alone
        rows = sorted(averages, key=lambda a: a.self_device_time_total, reverse=True)
        total_us = sum(a.self_device_time_total for a in rows) or 1.0
        width = max_name_column_width
        header = f"{'Name':<{width}}  {'Self CUDA':>10}  {'Self CUDA %':>11}  {'# of Calls':>10}  {'CUDA avg':>9}"
        lines = ["-" * len(header), header, "-" * len(header)]
        for a in rows[:row_limit]:
            name = a.key if len(a.key) <= width else a.key[:width - 3] + "..."
            lines.append(f"{name:<{width}}  {_format_us(a.self_device_time_total):>10}  "
                         f"{a.self_device_time_total / total_us:>11.2%}  {a.count:>10}  "
                         f"{_format_us(a.self_device_time_total / max(a.count, 1)):>9}")
        lines += ["-" * len(header), f"Self CUDA time total: {_format_us(total_us)}"]
        return "\n".join(lines)
    return averages.table(sort_by="self_device_time_total" if on_gpu else "self_cpu_time_total", row_limit=row_limit,
                          max_name_column_width=max_name_column_width)


def cpu_operators(prof: profile) -> list[Kernel]:
    """The top-level operators of a CPU profile: calls not inside another operator (annotations do not count as
    enclosing operators, so the kernels of a compiled graph's call are listed)."""

    def is_wrapper(e) -> bool:
        return getattr(e, "is_user_annotation", False) or e.name.startswith(_WRAPPERS)

    found = []
    for e in prof.events():
        if e.device_type != DeviceType.CPU or is_wrapper(e):
            continue
        parent = e.cpu_parent
        while parent is not None and is_wrapper(parent):
            parent = parent.cpu_parent
        if parent is None:
            found.append(Kernel(e.name, e.time_range.start, e.time_range.end - e.time_range.start))
    return sorted(found, key=lambda k: k.start_us)


def host_syncs(fn: Callable[[], object], *, device: torch.device | str | None = None) -> int:
    """How many times one call of ``fn()`` makes the host wait for the GPU (``.item()``, a blocking copy to the
    host, ``nonzero``, a stream synchronisation, ...), counted with ``torch.cuda.set_sync_debug_mode("warn")``.

    Every such wait drains the GPU's queue, so the GPU idles until the host has launched new work; a step that
    synchronises can leave the GPU idle however fast its kernels are. The debug mode is a prototype and does not
    see every synchronisation (not those of ``torch.distributed``, for one): a count of 0 means none that PyTorch
    reports. Warnings from autograd's threads are replayed in the calling thread, so ``backward()`` is covered.
    The previous debug mode is restored.

    Raises:
        TypeError: if ``fn`` is not callable.
        ValueError: for a device that is not a CUDA GPU (on a CPU nothing runs asynchronously to wait for).
    """
    if not callable(fn):
        raise TypeError(f"host_syncs() needs a callable taking no arguments, got {type(fn).__name__}")
    device = get_device(device)
    if device.type != "cuda":
        raise ValueError(f"host_syncs() counts waits for a CUDA GPU; {device} runs each operation before it returns")
    synchronize(device)
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:  # also the mode's own "prototype feature" notice
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    synchronize(device)
    return sum("called a synchronizing" in str(w.message) for w in caught)


def profile_steps(
    fn: Callable[[], object],
    *,
    steps: int = 5,
    warmup: int = 1,
    device: torch.device | str | None = None,
    step_s: float | None = None,
    trace_path: str | Path | None = None,
    unit: str = "step",
) -> StepProfile:
    """Run ``fn()`` ``warmup`` times, then ``steps`` times under ``torch.profiler``, and return a :class:`StepProfile`.

    Args:
        fn: one step, callable without arguments.
        steps: profiled calls (averaged per step).
        warmup: unprofiled calls first (compilation, autotuning, cuDNN/cuBLAS set-up stay out of the profile).
        step_s: the step time measured without the profiler (e.g. ``utils.bench`` median): idle time is computed
            against it, since the profiler slows the host a little. Default: the wall time under the profiler.
            On a CPU the profiler slows the operators it records as much as the host between them, so there the
            operators' times are scaled by ``step_s`` over the profiled step: busy and idle then add up to the step.
        trace_path: where to save a Chrome/Perfetto trace (JSON) of the profiled steps; open it at
            https://ui.perfetto.dev. None: no trace.
        unit: what one call is, for the tables and sentences ("step", "epoch", "forward pass", ...).

    Time before you profile: when a ``torch.profiler`` session ends, Kineto leaves NVIDIA's CUPTI attached unless
    the environment variable ``TEARDOWN_CUPTI=1`` is set, and host-bound code can run slower for the rest of the
    process (pytorch/pytorch#144455). This helper does not set it: PyTorch turns the teardown off where it crashed
    with CUDA graphs (before CUDA 12.6), and back-to-back sessions have raced with it (pytorch/kineto#1169, #1554).
    So after this call :func:`utils.bench.bench` and :func:`utils.bench.compare` refuse to time in this process
    (:func:`assert_not_profiled`): take the timings first, then profile to explain them.

    Raises:
        TypeError: if ``fn`` is not callable.
        ValueError: for fewer than 1 step or a negative warmup.
    """
    if not callable(fn):
        raise TypeError(f"profile_steps() needs a callable taking no arguments, got {type(fn).__name__}")
    if steps < 1 or warmup < 0:
        raise ValueError(f"profile_steps(): need steps >= 1 and warmup >= 0, got {steps} and {warmup}")
    device = get_device(device)
    on_gpu = device.type == "cuda"
    for _ in range(warmup):
        fn()
    synchronize(device)
    mark_profiled(f"utils.profile.profile_steps of {getattr(fn, '__name__', 'a step')}")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    saved_fd, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)  # the profiler's C++ side logs 'profiler start/stop' lines to stderr: keep them out
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*Profiler clears events")  # torch 2.11: not our concern
            with profile(activities=activities) as prof:
                start = time.perf_counter()
                for _ in range(steps):
                    fn()
                synchronize(device)
                profiled_wall_s = (time.perf_counter() - start) / steps
            kernels = gpu_kernels(prof) if on_gpu else cpu_operators(prof)
            if not on_gpu and step_s is not None and profiled_wall_s > 0:  # into the unprofiled step's time
                scale = step_s / profiled_wall_s
                kernels = [replace(k, start_us=k.start_us * scale, duration_us=k.duration_us * scale)
                           for k in kernels]
            operator_calls = Counter(e.name for e in prof.events() if e.device_type == DeviceType.CPU
                                     and not getattr(e, "is_user_annotation", False))
    finally:
        os.dup2(saved_fd, 2)
        os.close(saved_fd)
        os.close(devnull)
    saved = None
    if trace_path is not None:
        saved = Path(trace_path)
        saved.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(saved))
    result = StepProfile(device=str(device), steps=steps, wall_s=step_s if step_s is not None else profiled_wall_s,
                         kernels=kernels, on_gpu=on_gpu, trace_path=saved, profiled_wall_s=profiled_wall_s,
                         unit=unit, operator_calls=operator_calls)
    # the device cannot be busier than the step is long: more would mean work counted twice
    if on_gpu and result.busy_s > 1.05 * max(result.wall_s, profiled_wall_s):
        raise AssertionError(f"GPU busy {result.busy_s * 1e3:.3f} ms per {unit} exceeds the {unit} "
                             f"({result.wall_s * 1e3:.3f} ms): kernels were counted twice")
    return result
