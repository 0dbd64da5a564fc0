"""The guide's benchmark table (notebooks 09 and 09b): its rows, a rate read against a figure published for another
GPU, the check that a variant computes its reference's result, the compile row, what a compiled graph did to
attention, why a decode step stays short of the memory limit, a cross-check against another notebook's run, and a
step timed in two comparisons (:func:`two_timings`).

    with utils.benchmarks.full_fp32():                      # the checks' reference: fp32 matmuls without TF32
        reference = model(x)
    utils.benchmarks.check_close("bf16 weights", model_bf16(x), reference, tol=6e-2)
    print(utils.benchmarks.against_guide(c, "guide setting", GUIDE["BERT-Large inference"].rate))
    print(utils.benchmarks.attention_in_graph(utils.compile.generated(compiled, x).modules))
    print(utils.benchmarks.cross_check(rate, notebook="08_inference", figure="gpt2_tok_s_kv_cache", gpu=name,
                                       results_dir=root / "results"))

**The guide's table** (:data:`GUIDE`) is one figure per row, measured on an RTX 4090 with settings it names in a
few words; the notebooks read those settings as literally as they can and time them beside the best the course
teaches, in the same alternating rounds. A published figure has no spread, so :func:`against_guide` says "the same"
only where it lies inside this run's band.

**Attention in a compiled graph.** ``torch.compile`` keeps ``scaled_dot_product_attention`` as one call to a fused
kernel when the shapes, dtype and mask allow one; otherwise (or where a model builds its attention mask while being
traced, so that a mask appears that eager never passed) the graph can call another backend, or compute attention
as matmuls and a softmax (SDPA's *math* path, no fused kernel). :func:`attention_in_graph` reads which one from the
code Inductor generated (no profiler needed), and :func:`attention_change` from the kernels two profiles ran.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from utils.bench import Comparison, Verdict, format_seconds
from utils.env import gpu_slug
from utils.playbook import relative_error
from utils.plot import format_value
from utils.profile import StepProfile, kind_of
from utils.results import reference_results


@dataclass(frozen=True)
class GuideRow:
    """One row of the guide's table: its figure on the RTX 4090 and the setting its notes name."""

    task: str
    rate: float
    unit: str
    notes: str


#: The guide's table, measured on an RTX 4090 (its last row, "torch.compile 1.3–2×", is :data:`GUIDE_COMPILE`).
GUIDE: dict[str, GuideRow] = {r.task: r for r in (
    GuideRow("ResNet-50 training", 1850, "images/s", "batch 64, AMP"),
    GuideRow("BERT-Large inference", 320, "sentences/s", "batch 32, torch.compile"),
    GuideRow("GPT-2 generation", 145, "tokens/s", "KV cache"),
)}
GUIDE_COMPILE = (1.3, 2.0)


def guide_table() -> list[dict[str, str]]:
    """The guide's table as rows for :func:`utils.plot.table`."""
    rows = [{"task": f"{r.task} ({r.unit})", "the guide's RTX 4090": f"{r.rate:,.0f}", "notes": r.notes}
            for r in GUIDE.values()]
    return rows + [{"task": "torch.compile speed-up", "the guide's RTX 4090": "1.3–2×", "notes": "varies by model"}]


# ── References and checks ──────────────────────────────────────────────────────────────────────────────────────


@contextlib.contextmanager
def full_fp32() -> Iterator[None]:
    """fp32 matmuls and convolutions without TF32 inside the block (the checks' references); the settings before it
    come back after. It uses the same switches as :func:`utils.bench.matmul_rate` (``set_float32_matmul_precision``
    and cuDNN's ``allow_tf32``): mixing them with the newer ``fp32_precision`` switches in one process makes
    PyTorch raise when it reads one kind after the other was set."""
    previous = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False  # PyTorch's default lets cuDNN's fp32 convolutions use TF32
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous[0])
        torch.backends.cudnn.allow_tf32 = previous[1]


def check_close(what: str, result: torch.Tensor, reference: torch.Tensor, tol: float) -> float:
    """A variant must compute its reference's result up to rounding: the relative error (returned) at most ``tol``.

    Raises:
        AssertionError: naming ``what``, the error and the tolerance, when it is larger or not finite.
    """
    err = relative_error(result.float(), reference.float())
    if not err <= tol:  # NaN fails too
        raise AssertionError(f"{what}: relative error {err:.1e} against its reference exceeds {tol:.0e}")
    return err


#: Tolerances of a training step's first loss and gradients against full fp32, by autocast type (None: fp32 with
#: TF32 matmuls, or fp32 on a CPU): (loss, gradients), relative.
STEP_TOLERANCE: dict[torch.dtype | None, tuple[float, float]] = {
    None: (1e-3, 1e-2), torch.bfloat16: (2e-2, 0.25), torch.float16: (1e-2, 0.1)}


def first_step(step: Callable[..., torch.Tensor], model: torch.nn.Module, x: torch.Tensor,
               y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The loss of ``step(x, y)``'s first call and ``model``'s gradients after it, flattened (None where they are
    not finite: a GradScaler's first scale can overflow fp16, and then its optimizer step is skipped)."""
    loss = step(x, y).detach().float()
    grads = torch.cat([p.grad.detach().float().flatten() for p in model.parameters() if p.grad is not None])
    return loss, grads if bool(grads.isfinite().all()) else None


def check_first_step(what: str, result: tuple[torch.Tensor, torch.Tensor | None],
                     reference: tuple[torch.Tensor, torch.Tensor | None], amp: torch.dtype | None) -> str:
    """A first step (:func:`first_step`) against its reference's, up to ``amp``'s rounding (:data:`STEP_TOLERANCE`);
    returns the line that says so. Gradients that overflowed are left out, and the line says that.

    Raises:
        AssertionError: when the loss or the gradients differ by more than the tolerance.
    """
    (loss, grads), (ref_loss, ref_grads) = result, reference
    loss_tol, grad_tol = STEP_TOLERANCE[amp]
    text = f"loss {check_close(what + ', loss', loss, ref_loss, loss_tol):.0e}"
    if grads is None or ref_grads is None:
        text += ", gradients not compared (not finite: a GradScaler's first scale overflowed)"
    else:
        text += f", gradients {check_close(what + ', gradients', grads, ref_grads, grad_tol):.0e}"
    return f"✅ {what}: first step against its reference: relative error {text}"


def repeated(fn: Callable[[], object], times: int) -> Callable[[], list]:
    """One call of a comparison: ``fn`` ``times`` times, so that every batch size does the same number of items."""
    if times < 1:
        raise ValueError(f"repeated() needs times >= 1, got {times}")
    return lambda: [fn() for _ in range(times)]


# ── Reading a row ──────────────────────────────────────────────────────────────────────────────────────────────


def against_guide(c: Comparison, variant: str, guide_rate: float, *, comparable: bool = True) -> str:
    """This run's rate of ``variant`` against the guide's one figure: where it lies inside the band of the
    variant's rate, "the same as the guide's 4090 figure, within this run's band" if that band is within the
    comparison's resolution (±3%) of the rate, else "no different from … at this run's resolution (band …)" — a
    wide band holds the figure without showing the two equal; outside the band, how many times it. ``comparable``
    False (a CPU, a small model): says the two are not comparable.

    Raises:
        ValueError: for a guide rate that is not positive.
    """
    if guide_rate <= 0:
        raise ValueError(f"against_guide() needs a positive guide rate, got {guide_rate}")
    if not comparable:
        return "not comparable (a CPU, with a small model)"
    slow_s, fast_s = c.time_band_s(variant)[::-1]
    slowest, fastest = c.work.rate(variant, slow_s), c.work.rate(variant, fast_s)
    low, high = min(slowest, fastest), max(slowest, fastest)
    if low <= guide_rate <= high:
        rate = c.rate(variant)
        if high <= rate * (1 + c.resolution) and low >= rate / (1 + c.resolution):
            return "the same as the guide's 4090 figure, within this run's band"
        return (f"no different from the guide's 4090 figure at this run's resolution (its band {format_value(low)}–"
                f"{format_value(high)} holds {format_value(guide_rate)})")
    return f"{c.rate(variant) / guide_rate:.2f}× the guide's 4090 figure"


def guide_range(speedup: float, band: tuple[float, float] | None = None) -> str:
    """Where a compile speed-up lies against the guide's 1.3–2×: 'below', 'within' or 'above' — by its whole
    ``band`` where one is given, so a band across an end of the range reads 'across 1.3' (or 'across 2'), never
    'within' from the median alone."""
    low, high = GUIDE_COMPILE
    lo, hi = band if band is not None else (speedup, speedup)
    if hi < low:
        return "below"
    if lo > high:
        return "above"
    if low <= lo and hi <= high:
        return "within"
    return f"across {low:g}" if lo < low else f"across {high:g}"


def hedged(v: Verdict, *, long: bool = False) -> str:
    """A verdict's short form (:attr:`Verdict.short`; ``long``: :attr:`Verdict.text`, with its band), and for a
    resolved difference whose band reaches into the resolution (e.g. "1.03× faster" with a band from 1.004×, or
    "1.17× faster" with one from 1.028×) a note that the band's near end lies within it: the rounds tell the
    effect apart from 1, but not from one as small as the resolution. (The median may be well outside it: the note
    is about the band's end, not the effect's size.)"""
    lo, hi = v.band
    near = lo < 1 + v.resolution if v.outcome == "faster" else hi > 1 / (1 + v.resolution)
    if v.outcome in ("faster", "slower") and near:
        edge = lo if v.outcome == "faster" else 1 / hi
        return (f"{v.text}; its band reaches {edge:.3f}×, within the {v.resolution:.0%} resolution: the effect may "
                "be that small" if long else
                f"{v.short} (band from {edge:.3f}×, within the {v.resolution:.0%} resolution)")
    return v.text if long else v.short


@dataclass(frozen=True)
class CompilePair:
    """An entry of the compile row: ``compiled`` against ``eager``, two variants of comparison ``c``, and the first
    call's extra seconds (compiling). ``guide``: the guide's own setting."""

    name: str
    c: Comparison
    eager: str
    compiled: str
    compile_s: float
    guide: bool = False

    @property
    def verdict(self) -> Verdict:
        return self.c.verdict(self.compiled, against=self.eager)

    def per_item_s(self) -> dict[str, float]:
        """Seconds per item: eager's as the comparison's table shows it (:meth:`~utils.bench.Comparison.time_s`),
        and the compiled one's as eager's over the pair's own speed-up (the median of their per-round ratios), so
        that the two columns' ratio is the pair's speed-up. (The table's compiled time divides the comparison's
        baseline instead, so it can differ from this by the noise of the rounds against the baseline.)"""
        if not self.c.work:
            return {}
        eager_call_s = self.c.time_s(self.eager)
        return {"eager": eager_call_s / self.c.work.of(self.eager),
                "compiled = eager ÷ speed-up": eager_call_s / self.verdict.speedup / self.c.work.of(self.compiled)}

    def row(self) -> dict[str, str]:
        v = self.verdict
        per_item = {k: format_seconds(s) for k, s in self.per_item_s().items()}
        return {"model": self.name + (" · the guide's setting" if self.guide else ""), **per_item,
                "speed-up": f"{v.speedup:.2f}×", "verdict": hedged(v),
                "the guide's 1.3–2×": guide_range(v.speedup, v.band),
                "compile time": f"{max(self.compile_s, 0.0):.0f} s"}


def compile_summary(pairs: Sequence[CompilePair]) -> str:
    """One line over the compile row: the range of speed-ups and which model gave each end.

    Raises:
        ValueError: for no pairs.
    """
    if not pairs:
        raise ValueError("compile_summary() needs at least one pair")
    low = min(pairs, key=lambda p: p.verdict.speedup)
    high = max(pairs, key=lambda p: p.verdict.speedup)
    if low is high:
        return f"torch.compile: {low.verdict.text} ({low.name})"
    return (f"torch.compile speed-ups from {low.verdict.speedup:.2f}× ({low.name}) to {high.verdict.speedup:.2f}× "
            f"({high.name})")


def best_against_next(c: Comparison, best: str | None = None) -> Verdict:
    """The verdict of the fastest variant (or ``best``) against the next fastest, from the same rounds: whether
    the best is a resolved winner or a tie.

    Raises:
        ValueError: for a comparison with fewer than two variants.
    """
    best = best or c.fastest
    others = [v for v in c.variants if v != best]
    if not others:
        raise ValueError("best_against_next() needs a comparison of at least two variants")
    return c.verdict(best, against=min(others, key=c.time_s))


def table_row(task: str, c: Comparison, guide: str, best: str, limit: str, *, comparable: bool,
              note: str = "") -> dict[str, str]:
    """A row of the guide's table on this machine: the guide's figure, its setting here against it, the best here
    and its verdict against the guide's setting (same rounds), how far the best is from the limit. Where the best
    is not resolved faster than the next fastest (:func:`best_against_next`), its setting names both."""
    row = GUIDE[task]
    setting = best
    if len(c.variants) > 2 and best == c.fastest:
        nearest = best_against_next(c, best)
        if nearest.outcome != "faster":
            setting = f"{best} (or {nearest.baseline}: {nearest.short} between them)"
    return {"task": f"{task} ({row.unit})", "guide's 4090": f"{row.rate:,.0f}",
            "guide setting here": format_value(c.rate(guide)),
            "vs the 4090": against_guide(c, guide, row.rate, comparable=comparable) + (f" ({note})" if note else ""),
            "best here": format_value(c.rate(best)),
            "best vs guide setting": "— (it is the best)" if best == guide else hedged(c.verdict(best, against=guide)),
            "limit": limit, "best setting": setting}


def transposed(rows: Sequence[Mapping[str, str]], key: str = "task") -> list[dict[str, str]]:
    """Rows of the guide's table turned on their side, for :func:`utils.plot.table`: one line per column, one
    column per row (headed by its ``key``), so that a row with long cells stays narrow."""
    if not rows:
        raise ValueError("transposed() needs at least one row")
    return [{"": name, **{str(r[key]): str(r[name]) for r in rows}} for name in rows[0] if name != key]


# ── Attention: in the compiled graph, and in the kernels that ran ────────────────────────────────────────────

_SDPA_OP = re.compile(r"aten\.(_scaled_dot_product_(flash_attention_for_cpu|flash|efficient|cudnn|fused)\w*"
                      r"|scaled_dot_product_attention)\b")
ATTENTION_BACKENDS = {"flash": "FlashAttention", "flash_attention_for_cpu": "FlashAttention for CPUs",
                      "efficient": "memory-efficient", "cudnn": "cuDNN", "fused": "fused"}


def first_call_code(fn: Callable[[], object]) -> tuple[object, list[str]]:
    """``fn()``'s result and the Python modules Inductor generated while it ran (its first call compiles). Unlike
    ``torch._inductor.utils.run_and_get_code`` (:func:`utils.compile.generated`), it does not reset Dynamo first, so
    models compiled before keep their compiled code and do not compile again."""
    from unittest import mock

    from torch._inductor.graph import GraphLowering

    modules: list[str] = []
    with mock.patch.object(GraphLowering, "save_output_code", modules.append):
        result = fn()
    return result, list(dict.fromkeys(modules))


def attention_ops(modules: Sequence[str]) -> list[str]:
    """The scaled-dot-product-attention operators that Inductor's generated code calls (``_scaled_dot_product_
    efficient_attention`` …), each once, in order of appearance; empty when the graph computes attention from
    matmuls and a softmax (or has none)."""
    return list(dict.fromkeys(m.group(1) for code in modules for m in _SDPA_OP.finditer(code)))


def attention_in_graph(modules: Sequence[str], *, what: str = "the compiled graph") -> str:
    """One sentence: which attention the generated code of a compiled model calls (:func:`attention_ops`)."""
    if not modules:
        return f"{what}: no generated code to read (another backend, or compiled before this call)"
    ops = attention_ops(modules)
    if not ops:
        return (f"{what} calls no fused attention operator: its attention is matmuls and a softmax kernel "
                "(SDPA's math path, as Inductor lowered it)")
    names = []
    for op in ops:
        match = _SDPA_OP.search(f"aten.{op}")
        names.append(f"{ATTENTION_BACKENDS.get(match.group(2), 'fused') if match.group(2) else 'SDPA'} "
                     f"(aten.{op})")
    return f"{what} calls fused attention: {', '.join(names)}"


def attention_kernels(profile: StepProfile) -> dict[str, float]:
    """Seconds per profiled call of every attention kernel (by name, its launches summed), largest first."""
    total: Counter = Counter()
    for k in profile.kernels:
        if kind_of(k.name) == "attention":
            total[k.name] += k.duration_us / 1e6 / profile.steps
    return dict(total.most_common())


def _short(name: str, width: int = 60) -> str:
    return name if len(name) <= width else name[:width - 1] + "…"


def attention_change(before: StepProfile, after: StepProfile, names: tuple[str, str] = ("eager", "compiled")) -> str:
    """One sentence on the attention kernels of two profiles of the same work: the largest in each, its time per
    call, and where one of them ran none (its attention then ran as matmul and softmax kernels)."""
    parts = []
    for label, p in zip(names, (before, after), strict=True):
        kernels = attention_kernels(p)
        if kernels:
            top, seconds = next(iter(kernels.items()))
            parts.append(f"{label}: {_short(top)}, {format_seconds(seconds)} per {p.unit}"
                         + (f" ({len(kernels)} attention kernels by name)" if len(kernels) > 1 else ""))
        else:
            parts.append(f"{label}: no attention kernel ran — its attention was matmul and softmax kernels")
    return "attention — " + "; ".join(parts)


# ── GPT-2 at batch 1: which floor a decode step met ─────────────────────────────────────────────────────────


def decode_floor(profile: StepProfile, step_s: float, step_bytes: float, copy_gbps: float) -> str:
    """Why a decode step (one replay, or one eager step) takes ``step_s``: its bytes at the copy bandwidth, or the
    per-kernel costs of its many small kernels, read from its profile. Near the bandwidth (≥ 70%) it says so;
    otherwise it names the kernel that takes the most time, or the share of the step its bytes explain and the
    rest as time per kernel (the step's time ÷ its kernels: under programmatic dependent launch kernels overlap,
    so this is a kernel's share of the step, not its duration)."""
    if step_s <= 0 or step_bytes <= 0 or copy_gbps <= 0:
        raise ValueError("decode_floor() needs a positive step time, byte count and bandwidth")
    what = "kernels" if profile.on_gpu else "operators"
    bytes_s = step_bytes / (copy_gbps * 1e9)
    pct = 100 * bytes_s / step_s
    n = max(profile.kernels_per_step, 1.0)
    head = (f"{format_seconds(step_s)} per token: {n:.0f} {what}, busy {1 - profile.idle_fraction:.0%}; its "
            f"{step_bytes / 1e6:,.0f} MB at the copy bandwidth would take {format_seconds(bytes_s)} ({pct:.0f}%)")
    if pct >= 70:
        return f"{head} — near the memory limit"
    time_by_name: Counter = Counter()
    calls: Counter = Counter()
    for k in profile.kernels:
        time_by_name[k.name] += k.duration_us / 1e6 / profile.steps
        calls[k.name] += 1 / profile.steps
    if not time_by_name:
        return f"{head}; the profile saw no {what}"
    top, top_s = time_by_name.most_common(1)[0]
    per_call = top_s / calls[top]
    if per_call > 0.3 * step_s:
        return (f"{head} — short of the memory limit, and one {what[:-1]} call takes {format_seconds(per_call)} "
                f"of the step: {_short(top, 70)}")
    rest_s = max(step_s - bytes_s, 0.0)
    return (f"{head} — short of the memory limit: the bytes explain only {pct:.0f}% of the step; the rest, "
            f"{format_seconds(rest_s)}, is {format_seconds(rest_s / n)} per {what[:-1]} over its {n:.0f} {what}"
            + (f" (they overlap {profile.overlap:.1f}×: a share of the step, not each one's own cost)"
               if profile.overlap > 1.05 else "")
            + f"; more bandwidth could shorten at most the bytes' {pct:.0f}%")


# ── Cross-checks and the chart ────────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class CrossCheck:
    """The outcome of :func:`cross_check`: its sentence (``str()`` of it), this run's value over the other run's
    (``ratio``, None where there was nothing to compare with) and whether the two agree within the tolerance."""

    text: str
    ratio: float | None = None
    agrees: bool = True
    notebook: str = ""

    def __str__(self) -> str:
        return self.text

    @property
    def note(self) -> str:
        """A few words for the row that quotes the checked figure: empty where the runs agree (or nothing was
        compared), else how far apart they are, pointing to the cross-check."""
        if self.agrees or self.ratio is None:
            return ""
        return f"{self.ratio:.2f}× notebook {self.notebook}'s run of the same step: see the cross-check"


def cross_check(value: float, *, notebook: str, figure: str, gpu: str, results_dir: str | Path,
                tolerance: float = 0.2, earlier: str = "") -> CrossCheck:
    """This run's ``value`` against ``figure`` of ``notebook``'s reference run on the same kind of GPU (from
    ``results_dir``, matched by :func:`utils.env.gpu_slug`): one sentence with both numbers, their ratio, and which
    run it was (its GPU, date and torch, from the run record where there is one). Apart by more than a factor
    ``1 + tolerance`` either way (1.2: 0.82× and 1.22× are both apart), it says so and lists what can part two runs
    of the same step — it cannot tell which one applies, so it names none as the cause; ``earlier`` names what this
    process ran before the timing (e.g. "a compile and a Triton build"), which joins the list. Without such a
    figure, it says there is nothing to compare with. Returns a :class:`CrossCheck` (its ``note`` goes beside the
    figure where the runs disagree)."""
    entry = reference_results(results_dir).get(gpu_slug(gpu), {}).get(notebook)
    payload = (entry or {}).get("figures", {}).get(figure)
    number = notebook.split("_")[0]
    if payload is None:
        return CrossCheck(f"nothing to cross-check against: notebook {number}'s reference runs in results/ have no "
                          f"{figure} for {gpu}", notebook=number)
    run = (entry or {}).get("run") or {}
    which = ", ".join(str(part) for part in (run.get("gpu") or gpu_slug(gpu).upper(), run.get("date"),
                                              run.get("torch") and f"torch {run['torch']}") if part)
    if run.get("shared_host"):
        which += ", beside other notebooks"
    ref = float(payload["value"])
    ratio = value / ref
    text = (f"{figure}: notebook {number}'s reference run ({which}) measured {format_value(ref)} "
            f"{payload.get('unit', '')}; this run {format_value(value)}, {ratio:.2f}× that")
    if abs(math.log(ratio)) > math.log(1 + tolerance):
        compiles = f"compiles earlier in the process (this one ran {earlier})" if earlier else \
            "compiles earlier in either process"
        return CrossCheck(text + f" — apart by more than a factor {1 + tolerance:g} either way: the two runs "
                          "differ in something that "
                          f"matters (another process on the host, a profile before the timing, {compiles}, another "
                          "host or GPU model, notebook sources changed since); trust neither until they agree",
                          ratio, False, number)
    return CrossCheck(text + f" — within a factor {1 + tolerance:g} either way", ratio, True, number)


def guide_chart(panels: Sequence[tuple[str, str, Mapping[str, float], Mapping[str, str]]], *, notebook: str,
                results_dir: str | Path, here: str, recorded: Mapping[str, float]):
    """Bars per panel: the guide's figures, every other kind of GPU whose reference run of ``notebook`` recorded the
    panel's figures in ``results_dir``, and this run (``recorded``: figure → value). The file of this run's own kind
    of GPU (``here``, by :func:`utils.env.gpu_slug`) is left out: this run is its new reference run, or stands beside
    it, and the file may hold a run at older sources. A panel is ``(title, unit, {guide bar: value}, {bar suffix:
    figure name})``. Returns the matplotlib figure."""
    import matplotlib.pyplot as plt

    previous = {gpu.upper(): entries.get(notebook, {}).get("figures", {})
                for gpu, entries in reference_results(results_dir).items() if gpu != gpu_slug(here)}
    cols = min(len(panels), 2)
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 3.6 * rows), squeeze=False)
    others = False  # whether any other GPU's reference run is drawn: the title says so only then
    for ax, (title, unit, guide, figures) in zip(axes.flat, panels, strict=False):
        bars = dict(guide)
        for gpu, found in previous.items():
            drawn_runs = {f"{gpu}, reference run ({k})": found[f]["value"] for k, f in figures.items() if f in found}
            bars |= drawn_runs
            others = others or bool(drawn_runs)
        bars |= {f"{here} ({k})": recorded[f] for k, f in figures.items() if f in recorded}
        colours = ["#999999" if b in guide else "#DD8452" if b.startswith(here) else "#4C72B0" for b in bars]
        drawn = ax.barh(list(bars), list(bars.values()), color=colours)
        ax.bar_label(drawn, labels=[format_value(v) for v in bars.values()], padding=3, fontsize=8)
        ax.invert_yaxis()
        ax.tick_params(axis="y", labelsize=8)
        ax.margins(x=0.2)
        ax.set(title=title, xlabel=unit)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle("The guide's table: its RTX 4090, " + ("the other GPUs' reference runs in results/, " if others
                                                        else "") + "and this run")
    fig.tight_layout()
    plt.close(fig)
    return fig


def profile_reading(verdict: Verdict, before: StepProfile, after: StepProfile, names: tuple[str, str], *,
                    compile_pair: bool = False) -> str:
    """What two profiles of the same work say about a verdict between them: the verdict, then which kind of kernel
    time shrank and grew (:func:`utils.profile.compare_profiles`), then the attention kernels of each
    (:func:`attention_change`) — three lines, every reason read from the profiles, whatever the outcome.

    The share of matmul kernels, and what fusion can save beside them, is said for a compile pair only
    (``compile_pair``, :func:`utils.profile.compare_profiles`' ``fusion``): a change of type or batch size is no
    fusion."""
    from utils.profile import compare_profiles

    change = compare_profiles(before, after, names=names, fusion=compile_pair)
    return "\n".join([f"{verdict.variant} against {verdict.baseline}: {hedged(verdict, long=True)}", "  " + change,
                      "  " + attention_change(before, after, names=names)])


def two_timings(variant: str, first: Comparison, second: Comparison, *, first_where: str, second_where: str,
                second_variant: str | None = None) -> str:
    """One sentence on a variant timed in two comparisons (e.g. a training step timed against other settings,
    then again beside an input pipeline): both rates with their bands, their ratio, and whether the second lies
    inside the first's band. It says which figure the rest of the notebook quotes (the first) and that each
    verdict uses its own comparison's rounds; it names no cause for a gap (the rounds differ in what ran beside
    the variant, and in their baseline: :meth:`~utils.bench.Comparison.time_s`).

    Raises:
        ValueError: where either comparison has no rate (no work given).
    """
    second_variant = second_variant or variant
    if first.work is None or second.work is None:
        raise ValueError("two_timings() needs two comparisons with a rate (items=, bytes_moved= or flops=)")

    def band(c: Comparison, v: str) -> tuple[float, float]:
        slow_s, fast_s = c.time_band_s(v)[::-1]
        return c.work.rate(v, slow_s), c.work.rate(v, fast_s)

    (r1, b1), (r2, b2) = ((c.rate(v), band(c, v)) for c, v in ((first, variant), (second, second_variant)))
    unit = first.work.rate_unit
    inside = b1[0] <= r2 <= b1[1]
    return (f"{variant}, timed in two comparisons: {format_value(r1)} {unit} (band {format_value(b1[0])}–"
            f"{format_value(b1[1])}) {first_where}; {format_value(r2)} (band {format_value(b2[0])}–"
            f"{format_value(b2[1])}) {second_where} — {max(r1, r2) / min(r1, r2):.2f}× apart, "
            + ("inside the first's band" if inside else "outside the first's band: the rounds differ by more than "
               "their noise")
            + ". Each verdict uses its own comparison's rounds; the rate quoted for the step elsewhere is the first")
