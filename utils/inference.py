"""What notebooks 08 and 08b measure around serving GPT-2, phrased once and tested: the deadline of a child process on
this host, whether AOTInductor is tried here, the reading of the Hugging Face child's report, a profiled decode step
against the bytes it must read, and the batch-size sweep.

- :func:`child_deadline_s` — a child's deadline scaled to this host's cores: compilers run a job per core, so a
  compile that takes a minute with 16 cores takes several with Colab's 2.
- :func:`aotinductor_gate` — None where AOTInductor is tried, else why not (a PyTorch release on which loading its
  package is known to crash, or too few cores to compile a whole model within the deadline). AOTInductor always
  runs in a child process (``scripts/gpt2_export.py``), so a crash there cannot end the notebook;
  :func:`aotinductor_report` reads how it ended.
- :func:`read_hf_child` — ``scripts/hf_generate.py``'s report as one :class:`utils.bench.Comparison` of whole
  generations (ours and Hugging Face ``generate``, timed in the same alternating rounds in the child), with each
  variant's first call against a call in those rounds (its one-off costs) and the Inductor graphs it compiled.
- :func:`busy_against_bytes` — a profiled step's busy time against the bytes it must read at the copy bandwidth.
- :class:`BatchSweep` — decode steps by batch size: rates, the first batch whose step is resolved to grow by more
  than a quarter (its verdict against batch 1 "slower"), and there the extra KV bytes at the copy bandwidth against
  how much the step grew.

A note on the bandwidth: ``tokens/s ≤ bandwidth / bytes per step`` uses the *copy* bandwidth measured in the same
run (a read and a write per byte). A stream that only reads can beat it by a little, so it is a yardstick to put
rates against, not a ceiling a kernel cannot pass.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from utils import bench, gpt2
from utils.env import usable_cpus
from utils.memory import format_bytes
from utils.plot import curves, format_value

#: PyTorch releases on which loading an AOTInductor package is known to crash, by device type: release prefix →
#: what was seen. Tried anyway when ``COURSE_TRY_AOTI=1`` is set (a newer build may have fixed it).
AOTI_KNOWN_CRASHES: dict[str, dict[str, str]] = {
    "cuda": {"2.11.": "loading GPT-2's package ended in a segmentation fault on an H100 and an H200 "
                      "(torch 2.11.0+cu130, in aoti_load_package)"},
}
#: Seconds AOTInductor took to compile GPT-2 small's package with 16 cores (an H200 host, torch 2.11).
AOTI_COMPILE_S_16_CORES = 72.0
#: Cores below which a GPU's whole-model AOTInductor compile is not tried: it would take most of a notebook's budget.
AOTI_MIN_CPUS = 8


def child_deadline_s(seconds: float, *, cpus: int | None = None, reference_cpus: int = 16,
                     most: float = 2.5) -> float:
    """A deadline for a child whose work takes up to ``seconds`` with ``reference_cpus`` cores: scaled by
    ``reference_cpus / cpus`` where this host has fewer (compile workers run one per core), by at most ``most``×
    (the serial part of a compile does not scale, and the notebook's own budget bounds the wait).

    Raises:
        ValueError: for seconds or a factor that is not positive.
    """
    if seconds <= 0 or most < 1 or reference_cpus < 1:
        raise ValueError(f"need seconds > 0, most >= 1, reference_cpus >= 1; got {seconds}, {most}, {reference_cpus}")
    cpus = usable_cpus() if cpus is None else cpus
    return seconds * min(most, max(1.0, reference_cpus / max(cpus, 1)))


def aotinductor_gate(device: torch.device | str, *, torch_version: str | None = None, cpus: int | None = None,
                     environ: Mapping[str, str] | None = None) -> str | None:
    """None when AOTInductor should be tried on ``device`` here; otherwise one sentence saying why it is not.

    Not tried: on a PyTorch release listed in :data:`AOTI_KNOWN_CRASHES` for the device type (unless
    ``COURSE_TRY_AOTI=1``), or on a GPU host with fewer than :data:`AOTI_MIN_CPUS` cores, where compiling GPT-2
    small's package (:data:`AOTI_COMPILE_S_16_CORES` s with 16) would outlast the notebook's budget. On a CPU the
    notebook exports a tiny GPT-2, which compiles in seconds.
    """
    kind = torch.device(device).type
    version = torch.__version__ if torch_version is None else torch_version
    environ = os.environ if environ is None else environ
    if environ.get("COURSE_TRY_AOTI", "").strip() in ("1", "true", "yes"):
        return None
    for prefix, seen in AOTI_KNOWN_CRASHES.get(kind, {}).items():
        if version.startswith(prefix):
            return (f"on PyTorch {version} {seen}; the exported program above is the path that works here "
                    "(set COURSE_TRY_AOTI=1 to try the package anyway, in its child process)")
    cpus = usable_cpus() if cpus is None else cpus
    if kind == "cuda" and cpus < AOTI_MIN_CPUS:
        return (f"compiling GPT-2's package took {AOTI_COMPILE_S_16_CORES:.0f} s with 16 cores; this host has {cpus}, "
                "so it would take most of this notebook's budget (run scripts/gpt2_export.py yourself to try it)")
    return None


def aotinductor_report(child) -> list[str]:
    """What ``scripts/gpt2_export.py`` run by :func:`utils.isolate.run_script` found, as lines to print: the seconds
    of each stage, the exported program's error against eager (checked before AOTInductor starts), the package's
    size and error, or how and where the child ended and what that means.

    Raises:
        AssertionError: when the exported program or the package computes something else than eager (relative
            error of the logits ≥ 1e-4 in fp32): a wrong artifact must fail the run, not be reported.
    """
    report = child.result or {}
    seconds = report.get("seconds", {})
    lines = ["seconds per stage: " + (", ".join(f"{s} {t:.1f}" for s, t in seconds.items()) or "none finished")]
    exported_err = report.get("exported_relative_error")
    if exported_err is not None:
        assert exported_err < 1e-4, f"the exported program differs from eager by {exported_err:.1e}"
        lines.append(f"the exported program (in the child) matches eager: relative error {exported_err:.1e}")
    if child.ok:
        err = report["relative_error"]
        assert err < 1e-4, f"the AOTInductor package differs from eager by {err:.1e}"
        size = report["package_bytes"] / 2**20
        lines.append(f"the AOTInductor package ({size:,.1f} MiB) loaded and ran: relative error {err:.1e} "
                     "against eager")
        return lines
    lines.append(f"AOTInductor did not complete: {child.failure}")
    crashed = child.returncode is not None and child.returncode < 0
    if crashed and child.stage in ("load", "run"):
        lines.append(f"  a crash in AOTInductor's native code on PyTorch {report.get('torch', torch.__version__)} "
                     "(a signal, no Python exception): the exported program is not at fault; keep it "
                     "(torch.export.save), or try the package on another release")
    lines.append(f"its last lines:\n{child.tail()}")
    return lines


@dataclass
class HFChild:
    """``scripts/hf_generate.py``'s report: per variant its first call (or why it is missing), and the comparison of
    the variants timed together in the child's last finished alternating-round comparison."""

    lines: list[str] = field(default_factory=list)
    comparison: bench.Comparison | None = None
    best_hf: str | None = None  # the fastest Hugging Face variant in the comparison

    def report(self) -> str:
        return "\n".join(self.lines)

    def verdict_line(self, ours: str) -> str:
        """``ours`` against the fastest Hugging Face variant, whole generation against whole generation; or why
        there is no such verdict (the child did not time the two in the same rounds: :meth:`report` says why)."""
        if self.comparison is None or ours not in self.comparison.variants:
            return f"{ours} vs Hugging Face generate: not timed together in this run (the child's report says why)"
        return f"{self.comparison.verdict(ours)}, whole generation against whole generation"


def read_hf_child(child, new_tokens: int, *, record: str | None = None) -> HFChild:
    """Read a :class:`utils.isolate.ChildRun` of ``scripts/hf_generate.py``: a line per variant (its first call, what
    it cost beyond a call of the child's rounds — the comparison's per-call figure, the one its table prints — the
    Inductor graphs compiled in it and those loaded from the cache on disk, or that none was compiled, so a one-off
    cost there is not Inductor's; or why the variant is not available), then how the child ended if it did not
    finish. The variants that carry per-round times (the same
    rounds: the child's last comparison) become one :class:`utils.bench.Comparison` against the fastest Hugging Face
    variant; ``record`` names the figure that records that variant's rate.

    Raises:
        AssertionError: when a variant the child checked made other tokens than the greedy ones.
    """
    out, rounds, own_rounds = HFChild(), {}, {}
    lines: list[str | tuple[str, float, str]] = []  # a finished line, or (label, first call, graphs) to finish
    for label, row in (child.result or {}).get("variants", {}).items():
        if "error" in row:  # a transformers without the option, a failed compile
            lines.append(f"{label}: not available here ({row['error']})")
            continue
        if "greedy" not in row:
            lines.append(f"{label}: its first call did not finish")
            continue
        assert row["greedy"], f"{label}: not the greedy tokens"
        n, loaded = row.get("graphs_compiled", 0), row.get("graphs_loaded", 0)
        graphs = f"Inductor graphs in it: {n} compiled, {loaded} from its cache" if n or loaded else (
            "no Inductor graph compiled in it")
        lines.append((label, row["first_call_s"], graphs))
        if "timing" in row:
            rounds[label] = own_rounds[label] = list(row["timing"]["block_times_s"])
    if len({len(r) for r in rounds.values()}) > 1:  # not one comparison: keep the variants of the longest
        longest = max(len(r) for r in rounds.values())
        rounds = {k: r for k, r in rounds.items() if len(r) == longest}
    hf_labels = [label for label in rounds if label.startswith("HF")]
    if hf_labels and len(rounds) >= 2:
        out.best_hf = min(hf_labels, key=lambda label: statistics.median(rounds[label]))
        out.comparison = bench.Comparison.from_rounds(
            rounds, baseline=out.best_hf, work=bench.Work(new_tokens, "tokens"),
            title=f"{new_tokens} tokens, whole generation, batch 1, timed together in the child process (its own "
                  "rounds: ours has a figure of its own here)")
        if record:
            out.comparison.record({record: (out.best_hf, "rate")})
    for entry in lines:  # a call of the rounds: the comparison's one number per variant (its table's), where it has one
        if isinstance(entry, str):
            out.lines.append(entry)
            continue
        label, first, graphs = entry
        line = f"{label}: first call {bench.format_seconds(first)}"
        if out.comparison is not None and label in out.comparison.variants:
            line += ", " + _one_off(first, out.comparison.time_s(label))
        elif label in own_rounds:  # timed in an earlier comparison only: its own median
            line += ", " + _one_off(first, statistics.median(own_rounds[label]))
        out.lines.append(f"{line}; {graphs}")
    if not child.ok:
        out.lines.append(f"{child.failure}\nits last lines:\n{child.tail()}")
    if out.comparison is None:
        out.lines.append("Hugging Face generate was not timed against ours in this run: the lines above say why")
    return out


def _one_off(first_s: float, call_s: float) -> str:
    """A first call against a steady call of the same variant: what the first one cost beyond a call, that it cost
    about a call (within half a call's time either way), or that it took less than one (a host busier during the
    rounds than during the first call)."""
    if first_s > 1.5 * call_s:
        return (f"{bench.format_seconds(first_s - call_s)} more than a call in the child's rounds "
                f"({bench.format_seconds(call_s)}): one-off costs")
    if first_s < 0.5 * call_s:
        return f"less than a call in the child's rounds ({bench.format_seconds(call_s)})"
    return f"about a call's time in the child's rounds ({bench.format_seconds(call_s)})"


def busy_against_bytes(profile, step_bytes: int, copy_gbps: float, *, on_gpu: bool) -> str:
    """One line: a profiled step's busy time per token against the time the copy bandwidth needs for the bytes the
    step must read — as a multiple, as GB/s while busy, and as a % of the copy bandwidth."""
    least_s = step_bytes / (copy_gbps * 1e9)
    busy = max(profile.busy_s, 1e-12)
    what = "kernels" if on_gpu else "operators"
    return (f"its {what} take {bench.format_seconds(busy)} per token, {busy / least_s:.1f}× the "
            f"{bench.format_seconds(least_s)} in which the copy bandwidth moves the step's {step_bytes / 2**20:,.1f} "
            f"MiB: {format_value(step_bytes / busy / 1e9)} GB/s while busy, {100 * least_s / busy:.0f}% of copy")


@dataclass
class BatchSweep:
    """Decode steps by batch size, from one comparison whose variants are named ``"batch {b}"``: each batch's
    :class:`utils.gpt2.DecodeRate`, the step's growth over batch 1's, each batch's verdict against batch 1 (the same
    rounds), and the knee: the first batch whose step grows by more than :attr:`GROWTH` *and* whose verdict
    resolves it ("slower"). A growth the rounds did not resolve names no knee and no cause."""

    rates: dict[int, gpt2.DecodeRate]
    growth: dict[int, float]
    kv_bytes_at_knee: int | None
    weight_bytes: int
    verdicts: dict[int, bench.Verdict] = field(default_factory=dict)  # each batch's step against batch 1's
    kv_bytes_per_sequence: int = 0  # one sequence's keys and values at the average context
    copy_gbps: float | None = None  # the copy bandwidth measured in the same run
    kv_buffer_bytes_per_sequence: int = 0  # its whole cache buffer, which a static cache reads (masked) every step
    GROWTH = 1.25

    def _resolved(self, batch: int) -> bool:
        verdict = self.verdicts.get(batch)
        return verdict is None or verdict.outcome == "slower"

    @property
    def knee(self) -> int | None:
        return next((b for b, g in self.growth.items() if g > self.GROWTH and self._resolved(b)), None)

    @property
    def unresolved(self) -> list[int]:
        """Batches before the knee (or any, without one) whose step read more than :attr:`GROWTH` × batch 1's
        although their verdict did not resolve a slow-down: noise the rounds could not separate from a knee."""
        knee = self.knee
        return [b for b, g in self.growth.items()
                if g > self.GROWTH and not self._resolved(b) and (knee is None or b < knee)]

    def rows(self) -> list[dict[str, object]]:
        return [r.row() for r in self.rates.values()]

    def reading(self) -> list[str]:
        """Batch 1's bytes against its step, and at the knee the arithmetic of what grew: the KV bytes the knee's
        sequences read beyond batch 1's, timed at the copy bandwidth, against how much the step grew. Measured
        numbers only: how much of the step (or of its growth) the bytes take at that bandwidth, no canned cause."""
        one = self.rates[1]
        if one.pct_copy is None:
            lines = ["batch 1: no copy bandwidth was measured to put its bytes against"]
        else:
            rest = "; something other than the bytes sets the rest" if one.pct_copy < 100 else ""
            lines = [f"batch 1 reads at {one.pct_copy:.0f}% of the copy bandwidth: its bytes, read at that bandwidth, "
                     f"would take {min(one.pct_copy, 100):.0f}% of its step{rest}"]
        for b in self.unresolved:  # the verdict's band is of speed-ups (batch 1 / batch b): as growths, inverted
            lo, hi = self.verdicts[b].band
            lines.append(f"batch {b}'s step read {self.growth[b]:.2f}× batch 1's, band {1 / hi:.2f}–{1 / lo:.2f}× over "
                         f"{self.verdicts[b].rounds} rounds: the rounds did not resolve it, so no knee or cause is "
                         "read from it")
        knee = self.knee
        if knee is None:
            last = max(self.rates)
            if not self.unresolved:
                lines.append(f"the step stayed within a quarter of batch 1's up to batch {last}: extra sequences "
                             f"were still nearly free at {last}")
            return lines
        at = self.rates[knee]
        grew_s = (at.ms_per_token - one.ms_per_token) / 1e3
        w = self.weight_bytes
        # the KV bytes a step reads: at least the average context's; a static cache reads its whole buffer, masked
        low, high = self.kv_bytes_per_sequence, max(self.kv_buffer_bytes_per_sequence, self.kv_bytes_per_sequence)

        def span(a: float, b: float, fmt) -> str:
            return fmt(a) if fmt(a) == fmt(b) else f"{fmt(a)}–{fmt(b)}"

        there = (f"the step first grows by more than a quarter at batch {knee}: {one.ms_per_token:.3g} → "
                 f"{at.ms_per_token:.3g} ms, {bench.format_seconds(grew_s)} more; its KV caches read "
                 f"{span(knee * low, knee * high, format_bytes)} per step (the average context to the whole buffer, "
                 f"which a static cache reads masked; {span(knee * low / w, knee * high / w, lambda v: f'{v:.2g}')}× "
                 f"the weights' {format_bytes(w)}), {span((knee - 1) * low, (knee - 1) * high, format_bytes)} more "
                 "than batch 1's")
        if self.copy_gbps and grew_s > 0:
            lo_s, hi_s = ((knee - 1) * b / (self.copy_gbps * 1e9) for b in (low, high))
            there += (f": at the copy bandwidth those bytes take {span(lo_s, hi_s, bench.format_seconds)}, "
                      f"{span(lo_s / grew_s, hi_s / grew_s, lambda v: f'{v:.0%}')} of the growth"
                      + (", so they alone can account for it" if lo_s >= grew_s else
                         "; the rest is not these bytes (not measured apart here)"))
        lines.append(there)
        return lines

    def plot(self, title: str):
        """Tokens/s and ms per step by batch size, beside the line of free extra sequences; the knee marked."""
        b = list(self.rates)
        knee = self.knee
        return curves(
            {"tokens/s (all sequences)": (b, [self.rates[x].tokens_per_s for x in b]),
             "if extra sequences were free": (b, [x * self.rates[1].tokens_per_s for x in b])},
            right={"ms per step": (b, [self.rates[x].ms_per_token for x in b])}, right_label="ms per step",
            vlines={f"step > {self.GROWTH}× batch 1's ({knee})": knee} if knee else None,
            xlabel="batch size (log scale)", ylabel="tokens/s", logx=True, logy=True, title=title)


def batch_sweep(by_batch: bench.Comparison, model: gpt2.GPT2, batches: Sequence[int], *, prompt: int,
                new_tokens: int, copy_gbps: float | None) -> BatchSweep:
    """A :class:`BatchSweep` from a comparison of decode steps alone (``new_tokens − 1`` steps per call, variants
    ``"batch {b}"``, batch 1 among them), bytes counted at the average context (and, at the knee, up to the whole
    cache buffer of ``prompt + new_tokens`` positions, which a static cache reads masked), each batch judged against
    batch 1 in the comparison's own rounds.

    Raises:
        ValueError: without batch 1 among ``batches``.
    """
    if 1 not in batches:
        raise ValueError(f"the sweep needs batch 1 as its reference, got {list(batches)}")
    rates = {b: gpt2.decode_rate(f"batch {b}", by_batch.time_s(f"batch {b}"), model, batch=b, prompt=prompt,
                                 new_tokens=new_tokens, copy_gbps=copy_gbps) for b in batches}
    growth = {b: rates[b].ms_per_token / rates[1].ms_per_token for b in batches}
    verdicts = {b: by_batch.verdict(f"batch {b}", against="batch 1") for b in batches if b != 1}
    context = prompt + new_tokens // 2
    weights = gpt2.bytes_per_decode_step(model, 0, context)
    per_sequence = gpt2.bytes_per_decode_step(model, 1, context) - weights
    buffer = gpt2.bytes_per_decode_step(model, 1, prompt + new_tokens) - gpt2.bytes_per_decode_step(
        model, 0, prompt + new_tokens)
    sweep = BatchSweep(rates, growth, None, weights, verdicts, per_sequence, copy_gbps, buffer)
    if sweep.knee is not None:
        sweep.kv_bytes_at_knee = gpt2.bytes_per_decode_step(model, sweep.knee, context) - weights
    return sweep

