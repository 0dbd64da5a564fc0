"""Generate README's notebook table, its results and course targets, and a chart per GPU, from ``results/*.json``.

    python -m tools.readme_tables          # rewrite README's generated parts and results/<gpu>.png
    python -m tools.readme_tables --check  # exit 1 if README.md is out of date or a GPU's chart is missing

The generated parts live between ``<!-- notebooks:start -->`` / ``<!-- notebooks:end -->`` (the notebook table,
with each headline on the reference GPU) and ``<!-- results:start -->`` / ``<!-- results:end -->`` (each headline
on every GPU, the course targets met or not, the charts); the CI badge between ``<!-- badges:start -->`` /
``<!-- badges:end -->`` (from the repository address in pyproject.toml). Figures come only from results files
written by the reference run or ``.ci/gpu-run`` (``utils.results.read_results_file``). A figure from a run whose
sources differ from the notebook's current ones (``tools.course.sources_sha256``), or from a run without a record,
is marked †. The charts (matplotlib's Agg backend) show each headline figure as a percentage of the limit measured
beside it (``utils.results.Result.percent_of_limit``).
"""

from __future__ import annotations

import argparse
import operator
import re
import string
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import nbformat

from tools import course
from utils.results import Result, from_payload, reference_results

README = course.ROOT / "README.md"
RESULTS_DIR = course.ROOT / "results"
REFERENCE_GPU = "h200"  # the slug of the GPU whose figures the notebook table shows, and the first results column

# What each notebook teaches in a phrase, and its headline: a format string over its recorded figures, where
# ``{name:.1f}`` is a figure's value and ``{name.of_limit}`` reads " (95% of copy bandwidth)" where the figure
# carries the limit measured beside it (nothing where it does not). A figure a GPU's results lack shows as "—".
NOTEBOOKS: dict[str, tuple[str, str]] = {
    "00_install_check": (
        "versions, GPU properties, capabilities, measured matmul and copy peaks vs datasheets",
        "bf16 matmul {matmul_tflops_bf16_burst:.0f} burst / {matmul_tflops_bf16:.0f} sustained TFLOP/s"
        "{matmul_tflops_bf16.of_limit} · copy {copy_gbps:,.0f} GB/s{copy_gbps.of_limit}",
    ),
    "01_device_management": (
        "devices, asynchronous execution and errors, honest timing, pinned memory, streams, map_location",
        "H2D pinned {h2d_pinned_gbps:.1f} GB/s{h2d_pinned_gbps.of_limit} vs pageable {h2d_pageable_gbps:.1f} GB/s · "
        "copy/compute overlap {stream_overlap_speedup:.2f}×",
    ),
    "02_training_loop": (
        "the seed MNIST loop made fast: data pipeline, host syncs, GPU-resident data, CUDA graphs, checkpoints",
        "epoch {epoch_s_seed_loop:.3f} s → {epoch_s_systems:.4f} s (same batch) → {epoch_s_optimized:.4f} s"
        "{epoch_s_optimized.of_limit} at {test_accuracy_optimized:.1f}% test accuracy",
    ),
    "03_mixed_precision": (
        "autocast and GradScaler, fp16 vs bf16, when tensor cores pay, a chunked loss, on a Transformer LM",
        "step {step_ms_fp32:.0f} ms fp32 → {step_ms_bf16:.0f} ms bf16",
    ),
    "04_torch_compile": (
        "fusion, three ways to compile a training step, its compile from empty caches and break-even, checks against "
        "eager",
        "train step {compile_speedup_train_best:.2f}× (best variant), model compile {compile_time_s_default:.0f} s "
        "from empty caches",
    ),
    "04b_compile_in_depth": (
        "graph breaks, recompiles, empty and warm caches, CUDA graphs, max-autotune, compiled inference",
        "inference {compile_speedup_infer_best:.2f}× (best mode)",
    ),
    "05_memory": (
        "what fills GPU memory, how to see it (snapshots), and the techniques that fit a larger batch",
        "peak {peak_mem_gib_baseline:.1f} → {peak_mem_gib_combined:.1f} GiB · in 16 GiB: batch "
        "{max_batch_16gib_baseline:.0f} → {max_batch_16gib_combined:.0f}",
    ),
    "06_custom_kernels": (
        "one fused op as a Triton kernel you edit and in CUDA C++, registered with torch.library, vs the memory limit",
        "Triton {fused_gbps_triton:,.0f} GB/s{fused_gbps_triton.of_limit}, {speedup_triton_vs_eager:.1f}× eager · "
        "CUDA C++ {fused_gbps_cuda:,.0f} GB/s{fused_gbps_cuda.of_limit}, {speedup_cuda_vs_eager:.1f}× eager",
    ),
    "07_performance_playbook": (
        "the guides' tips timed on three models, each with its outcome: TF32 (fp32_precision), channels_last, "
        "cudnn.benchmark, pinned memory, set_to_none, .to(device)",
        "TF32 matmul {tf32_matmul_speedup:.1f}× · fp32 step {tf32_step_speedup:.2f}× · channels_last "
        "{channels_last_speedup_resnet50:.2f}×",
    ),
    "07b_launch_bound": (
        "launch-bound steps: the host's cost per launch, torch.compile on three models, CUDA graphs, fused "
        "optimizers, attention backends, determinism, the profiler and its diagnosis",
        "CUDA graphs {cuda_graphs_speedup:.1f}× · compile: Transformer {compile_speedup_transformer:.2f}×, "
        "ResNet-50 {compile_speedup_resnet50:.2f}×",
    ),
    "08_inference": (
        "GPT-2 decoding from the guide's loop to a Triton step in a CUDA graph, against the bandwidth's yardstick; "
        "HF generate in the same rounds; the profiler",
        "GPT-2 batch 1: {gpt2_tok_s_guide_loop:,.0f} → {gpt2_tok_s_best:,.0f} tokens/s "
        "({gpt2_best_pct_copy_bandwidth:.0f}% of copy bandwidth)",
    ),
    "08b_serving": (
        "serving GPT-2: batch size, sampling on the device, torch.export saved and loaded, AOTInductor in a child",
        "batch {gpt2_largest_batch:.0f}: {gpt2_tok_s_largest_batch:,.0f} tokens/s",
    ),
    "08c_quantization": (
        "int8 weight-only in plain PyTorch and one Triton kernel, checked against torchao; batch-1 decoding from GPT-2 "
        "124M to XL against the copy bandwidth; accuracy against fp32; fp8 with torch._scaled_mm",
        "GPT-2 XL batch 1: bf16 {gpt2_xl_tok_s_bf16:,.0f} → int8 {gpt2_xl_tok_s_int8:,.0f} tokens/s "
        "({int8_speedup_gpt2_xl:.2f}×) · in 08's Triton step: {gpt2_xl_tok_s_bf16_triton:,.0f} → "
        "{gpt2_xl_tok_s_int8_triton:,.0f} tokens/s ({int8_speedup_gpt2_xl_triton:.2f}×) · fp8 matmul "
        "{fp8_matmul_speedup:.2f}× bf16",
    ),
    "09_benchmarks": (
        "the guide's benchmark table, its ResNet-50 row: the guide's setting, the best the course teaches, the matmul "
        "limit; the JPEG input pipeline",
        "ResNet-50 training {resnet50_train_img_s_guide_setting:,.0f} → {resnet50_train_img_s_best:,.0f} img/s "
        "({resnet50_pct_matmul_peak:.0f}% of matmul rate) · JPEG loader {jpeg_loader_img_s_max:,.0f} img/s",
    ),
    "09b_inference_benchmarks": (
        "the guide's benchmark table, its inference rows: GPT-2 and BERT-Large at the guide's setting and the best, "
        "torch.compile per model, against the limits",
        "BERT-Large {bert_large_sent_s_best:,.0f} sent/s · GPT-2 {gpt2_tok_s_best:,.0f} tok/s · compile "
        "{compile_speedup_min:.2f}–{compile_speedup_max:.2f}×",
    ),
    "10_multi_gpu": (
        "torchrun, the all-reduce on 2…N GPUs vs the link, DDP and FSDP2 scaling on 1…N GPUs, two nodes on one host, "
        "a DCP checkpoint resharded",
        "all-reduce {allreduce_busbw_gbps:,.0f} GB/s bus{allreduce_busbw_gbps.of_limit} · DDP 2 GPUs "
        "{ddp_scaling_2gpu:.2f}×, 4 GPUs {ddp_scaling_4gpu:.2f}× · FSDP2 peak memory {fsdp_peak_mem_ratio_vs_ddp:.2f}× "
        "DDP · two nodes vs one {two_nodes_vs_one_node:.2f}×",
    ),
}


@dataclass(frozen=True)
class Target:
    """A course target: a figure of a notebook compared with a threshold (from the issues that set them).

    ``figure``: a figure's name (its value, in its unit), ``"a / b"`` (the ratio of two figures, ×), with a
    trailing ``" %"`` as a percentage: ``"name %"`` the figure's percentage of the limit it was recorded with,
    ``"a / b %"`` the ratio in percent. ``threshold``: a number in those units, or another figure's name.
    ``gpu``: the one GPU (results slug) the target is set for; None for every GPU.
    """

    notebook: str
    figure: str
    comparison: str  # one of COMPARISONS; "within": |value − 1| ≤ threshold (a ratio within a share of 1)
    threshold: float | str
    text: str
    gpu: str | None = None


COMPARISONS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt,
               "within": lambda value, share: abs(value - 1) <= share}

#: The course's targets, measured in the notebooks and never asserted in a test (issues 34–38, "Targets").
TARGETS: tuple[Target, ...] = (
    Target("02_training_loop", "speedup_systems", ">=", 8, "systems-only speed-up at the seed's batch ≥ 8×"),
    Target("02_training_loop", "speedup_overall", ">=", 15, "overall speed-up ≥ 15×"),
    Target("03_mixed_precision", "step_ms_fp32 / step_ms_bf16", ">=", 2.5, "bf16 step ≥ 2.5× the fp32 step"),
    Target("04_torch_compile", "compile_speedup_train_best", ">=", 1.5,
           "best compiled training step ≥ 1.5× an eager step timed in the same rounds"),
    Target("05_memory", "max_batch_16gib_combined / max_batch_16gib_baseline", ">=", 4,
           "the combined techniques fit ≥ 4× the baseline batch in 16 GiB"),
    Target("05_memory", "selective_checkpointing_step_overhead_pct", "<", "checkpointing_step_overhead_pct",
           "selective checkpointing costs less step time than full (each against none, same rounds)"),
    Target("06_custom_kernels", "fused_gbps_triton / copy_gbps %", ">=", 90,
           "Triton kernel ≥ 90% of the copy bandwidth measured in the same run"),
    Target("06_custom_kernels", "fused_gbps_cuda / copy_gbps %", ">=", 90,
           "CUDA C++ kernel ≥ 90% of the copy bandwidth measured in the same run"),
    Target("06_custom_kernels", "speedup_triton_vs_eager", ">=", 2,
           "Triton kernel ≥ 2× eager, timed in the same rounds"),
    Target("06_custom_kernels", "speedup_cuda_vs_eager", ">=", 2,
           "CUDA C++ kernel ≥ 2× eager, timed in the same rounds"),
    Target("08_inference", "gpt2_tok_s_best", ">=", 4000, "GPT-2 124M at batch 1 ≥ 4,000 tokens/s"),
    Target("08_inference", "gpt2_speedup_vs_hf_generate", ">", 1,
           "GPT-2 decoding ahead of Hugging Face `generate` (timed in the same rounds, in one process)"),
    Target("08c_quantization", "int8_speedup_gpt2_xl", ">=", 1.6,
           "GPT-2 XL at batch 1: int8 weight-only ≥ 1.6× the bf16 tokens/s of the same decoder (eager kernels in a "
           "CUDA graph)"),
    Target("08c_quantization", "int8_speedup_gpt2_xl_triton", ">=", 1.6,
           "GPT-2 XL at batch 1: int8 weight-only ≥ 1.6× the bf16 tokens/s of the same decoder (08's Triton step)"),
    Target("08c_quantization", "int8_logits_error_vs_bf16_gpt2_xl", "<=", 4,
           "GPT-2 XL: int8's logits error against fp32 within 4× of bf16's own"),
    Target("08c_quantization", "fp8_matmul_speedup", ">=", 1.3, "fp8 matmul ≥ 1.3× bf16 on a matmul-bound workload "
           "(Hopper)"),
    Target("09_benchmarks", "resnet50_train_img_s_best", ">=", 5000, "ResNet-50 training ≥ 5,000 images/s",
           gpu="h200"),
    Target("09b_inference_benchmarks", "bert_large_sent_s_best", ">=", 5500,
           "BERT-Large inference ≥ 5,500 sentences/s", gpu="h200"),
    Target("09b_inference_benchmarks", "gpt2_tok_s_best", ">=", 4000,
           "GPT-2 124M at batch 1 ≥ 4,000 tokens/s in the guide's table"),
    Target("10_multi_gpu", "ddp_scaling_4gpu", ">=", 3.6, "DDP on 4 GPUs ≥ 3.6× one GPU (90% efficiency)"),
    Target("10_multi_gpu", "allreduce_busbw_gbps %", ">=", 70,
           "all-reduce bus bandwidth on every GPU (4 on the reference run) ≥ 70% of the link's specification"),
    Target("10_multi_gpu", "two_nodes_vs_one_node", "within", 0.05,
           "two nodes × half the GPUs within 5% of one node × all of them, on the same host"),
)

STALE = "†"
STALE_NOTE = f"{STALE} from an earlier version of the notebook; rerun to refresh."
SHARED = "‡"
SHARED_NOTE = (f"{SHARED} measured while other notebooks ran beside it on the same host, each on its own GPU "
               "(`PARALLEL=1 bash .ci/gpu-run`, or one set of CPU cores per GPU).")
NOT_RUN = "—"


class _Shown:
    """A figure inside a headline's format string: ``{name:.1f}`` formats its value ("—" if missing) and
    ``{name.of_limit}`` reads " (95% of copy bandwidth)" where it carries a limit."""

    def __init__(self, result: Result | None):
        self.result = result

    def __format__(self, spec: str) -> str:
        return NOT_RUN if self.result is None else format(self.result.value, spec)

    @property
    def unresolved(self) -> str:
        """" (band 0.99–1.16×, which holds 1×)" for a speed-up whose band reaches across 1 (inconclusive, or no
        difference), so a headline never shows it as a plain gain; "" otherwise."""
        band = self.result.band if self.result is not None else None
        if not band or not band[0] <= 1 <= band[1]:
            return ""
        return f" (band {band[0]:.2f}–{band[1]:.2f}×{coverage_text(self.result)}, which holds 1×)"

    @property
    def of_limit(self) -> str:
        percent = self.result.percent_of_limit if self.result is not None else None
        return "" if percent is None else f" ({percent:.0f}% of {self.result.limit_name})"


class _Figures(dict):
    def __missing__(self, name: str) -> _Shown:
        return _Shown(None)


def headline_figures(stem: str) -> list[str]:
    """The names of the figures a notebook's headline shows, in order."""
    names = [field.split(".")[0] for _, field, _, _ in string.Formatter().parse(NOTEBOOKS[stem][1]) if field]
    return list(dict.fromkeys(names))


def results_of(figures: dict[str, dict[str, object]] | None) -> dict[str, Result]:
    """A notebook's figures (``{name: payload}``, as a results file holds them) as Results."""
    return {name: from_payload(name, payload) for name, payload in (figures or {}).items()}


def headline(stem: str, figures: dict[str, dict[str, object]] | None, *, gpus: int = 1) -> str:
    """A notebook's headline from one GPU's figures: "—" where a figure is missing, "—" alone where all are;
    "on N GPUs: " first for a run that used several."""
    if stem not in NOTEBOOKS:
        raise KeyError(f"tools/readme_tables.py: add {stem!r} to NOTEBOOKS (what it teaches, its headline)")
    found = results_of(figures)
    if not set(headline_figures(stem)) & set(found):
        return NOT_RUN
    text = re.sub(r"\{(\w+)(:[^}]*)?\}×", r"{\1\2}×{\1.unresolved}",  # every speed-up: its band where it holds 1
                  _present_parts(NOTEBOOKS[stem][1], set(found)))
    text = text.format_map(
        _Figures({name: _Shown(r) for name, r in found.items()}))
    return (f"on {gpus} GPUs: " if gpus > 1 else "") + text


def _fields(fmt: str) -> set[str]:
    return {field.split(".")[0] for _, field, _, _ in string.Formatter().parse(fmt) if field}


def _present_parts(fmt: str, found: set[str]) -> str:
    """A headline's format without the parts this run did not measure: a " · " segment none of whose figures was
    recorded, and a ", " part after a segment's first whose figures were not all recorded (a run on 2 GPUs has no
    4-GPU figure). A segment's first part stays, with "—" where a figure is missing, so no label loses its prefix."""
    segments = []
    for segment in fmt.split(" · "):
        if _fields(segment) and not _fields(segment) & found:
            continue
        first, *rest = segment.split(", ")
        segments.append(", ".join([first, *(part for part in rest if _fields(part) <= found)]))
    return " · ".join(segments)


def notebook_title(path: Path) -> str:
    """The topic from the title cell's first line, '# NN · Topic'."""
    first = course.cell_source(nbformat.read(path, as_version=4).cells[0]).splitlines()[0]
    match = re.match(r"^#\s*\d\d[a-z]?\s*·\s*(.+)$", first)
    return match.group(1).strip() if match else first.lstrip("# ").strip()


def current_sources() -> dict[str, str]:
    """Each notebook's current ``sources_sha256``, by stem."""
    return {path.stem: course.sources_sha256(nbformat.read(path, as_version=4)) for path in course.notebooks()}


def marks(entry: dict | None, sources: str | None) -> str:
    """† for figures whose run is not of the notebook's current sources (or has no record); ‡ for a shared host."""
    run = (entry or {}).get("run")
    mark = "" if run and sources is not None and run.get("sources_sha256") == sources else STALE
    return mark + (SHARED if run and run.get("shared_host") else "")


def result_cell(stem: str, entry: dict | None, sources: str | None) -> str:
    """One GPU's headline of a notebook, marked."""
    if not entry or not entry.get("figures"):
        return NOT_RUN
    gpus = int((entry.get("run") or {}).get("gpus") or 1)
    text = headline(stem, entry["figures"], gpus=gpus)
    return text if text == NOT_RUN else f"{text} {marks(entry, sources)}".rstrip()


def ordered_gpus(results: dict) -> list[str]:
    """The GPUs of the results, the reference GPU first, then the others by name."""
    return sorted(results, key=lambda gpu: (gpu != REFERENCE_GPU, gpu))


def footnotes(cells: list[str]) -> str:
    notes = [note for mark, note in ((STALE, STALE_NOTE), (SHARED, SHARED_NOTE)) if any(mark in c for c in cells)]
    return "\n\n" + "<br>\n".join(notes) if notes else ""


def notebooks_table(results: dict, sources: dict[str, str]) -> str:
    reference = results.get(REFERENCE_GPU, {})
    rows = [f"| # | Topic | What you learn | Open | Headline on the reference GPU ({REFERENCE_GPU.upper()}) |",
            "|---|---|---|---|---|"]
    cells = []
    for path in course.notebooks():
        stem = path.stem
        rel = path.relative_to(course.ROOT).as_posix()
        cell = result_cell(stem, reference.get(stem), sources.get(stem))
        cells.append(cell)
        rows.append(f"| {course.number(stem)} | [{notebook_title(path)}]({rel}) | {NOTEBOOKS.get(stem, ('?',))[0]} | "
                    f"[![Open In Colab]({course.COLAB_BADGE_IMAGE})]({course.colab_url(path)}) | "
                    f"{cell if cell != NOT_RUN else 'not yet run on the reference GPU'} |")
    return "\n".join(rows) + footnotes(cells)


def with_unit(value: float, unit: str, digits: int | None = None) -> str:
    """A figure with its unit for a table cell: '31×', '95%', '6,615 images/s' (``digits`` decimals if given)."""
    from utils.plot import format_value

    number = format_value(value) if digits is None else f"{value:,.{digits}f}"
    if unit in ("x", "×"):
        return f"{number}×"
    return f"{number}%" if unit == "%" else f"{number} {unit}"


def decimals_for(value: float, threshold: float, met: bool, compare) -> int | None:
    """None (the usual rounding) where it shows the outcome; else the fewest decimals (up to 4) at which the shown
    value still reads as met or not met ('1.47×', never 'not met (1.5×)' against 1.5)."""
    from utils.plot import format_value

    if compare(float(format_value(value).replace(",", "")), threshold) == met:
        return None
    for digits in range(1, 5):
        if compare(round(value, digits), threshold) == met:
            return digits
    return 4


def coverage_text(result: Result | None) -> str:
    """", a 75% interval" for a figure whose band covers less than 95% (a verdict from under 6 rounds); "" else."""
    return "" if result is None or result.coverage is None else f", a {result.coverage:.0%} interval"


def target_value(spec: str, found: dict[str, Result]) -> tuple[float, str, tuple[float, float] | None] | None:
    """The value a target's ``figure`` spec names in one notebook's figures, with its unit and its band (None for a
    ratio of two figures, or a figure recorded without one); None if not recorded."""
    percent = spec.endswith(" %")
    names = [name.strip() for name in spec.removesuffix(" %").split("/")]
    if not all(name in found for name in names):
        return None
    if len(names) == 2:
        value = found[names[0]].value / found[names[1]].value
        return (100 * value, "%", None) if percent else (value, "x", None)
    result = found[names[0]]
    if not percent:
        return result.value, result.unit, result.band
    if result.percent_of_limit is None:
        return None
    band = None if result.band is None else tuple(sorted(
        replace(result, value=end).percent_of_limit for end in result.band))
    return result.percent_of_limit, "%", band


def target_outcome(compare, value: float, threshold: float, band: tuple[float, float] | None) -> str:
    """"met" or "not met" where the figure's band (if it has one) lies wholly on one side of the threshold;
    "unresolved" where the band reaches across it, whichever side the value fell on."""
    met = compare(value, threshold)
    if band is None:
        return "met" if met else "not met"
    ends = {compare(end, threshold) for end in band} | {met}
    if ends == {True}:
        return "met"
    if ends == {False} and not (compare is COMPARISONS["within"] and band[0] < 1 < band[1]):
        return "not met"
    return "unresolved"


def target_cell(target: Target, gpu: str, entry: dict | None, sources: str | None) -> str:
    """'met (31×)', 'not met (6.2×)', 'unresolved (1.09×, band 0.99–1.18×)' (a band across the threshold), 'not
    measured', or '—' for a target set for another GPU."""
    if target.gpu is not None and target.gpu != gpu:
        return NOT_RUN
    found = results_of((entry or {}).get("figures"))
    measured = target_value(target.figure, found)
    threshold = (target_value(target.threshold, found) if isinstance(target.threshold, str)
                 else (target.threshold, "", None))
    if measured is None or threshold is None:
        return "not measured"
    from utils.plot import format_value

    compare = COMPARISONS[target.comparison]
    band = measured[2] if not isinstance(target.threshold, str) else None  # a figure against a figure: values
    outcome = target_outcome(compare, measured[0], threshold[0], band)
    if isinstance(target.threshold, str):
        shown = f"{with_unit(*measured[:2])} vs {with_unit(*threshold[:2])}"
    elif outcome == "unresolved":
        digits = 2 if measured[1] in ("x", "×") else None  # a ratio near 1: 1.09×, never 1.1×
        shown = (f"{with_unit(*measured[:2], digits)}, band "
                 f"{format_value(band[0]) if digits is None else f'{band[0]:.{digits}f}'}–"
                 f"{with_unit(band[1], measured[1], digits)}"
                 f"{coverage_text(found.get(target.figure.removesuffix(' %').strip()))}")
    else:
        shown = with_unit(*measured[:2], decimals_for(measured[0], threshold[0], outcome == "met", compare))
    return f"{outcome} ({shown}) {marks(entry, sources)}".rstrip()


def targets_table(results: dict, sources: dict[str, str]) -> str:
    gpus = ordered_gpus(results)
    rows = ["| Target | " + " | ".join(gpu.upper() for gpu in gpus) + " |", "|---|" + "---|" * len(gpus)]
    cells = []
    for target in TARGETS:
        row = [target_cell(target, gpu, results[gpu].get(target.notebook), sources.get(target.notebook))
               for gpu in gpus]
        cells += row
        where = f" (on the {target.gpu.upper()})" if target.gpu else ""
        rows.append(f"| {course.number(target.notebook)} · {target.text}{where} | " + " | ".join(row) + " |")
    return "\n".join(rows) + footnotes(cells)


def results_section(results: dict, sources: dict[str, str]) -> str:
    """Each headline on every GPU, the course targets, the charts and links to the raw files."""
    if not results:
        return "No reference run has been recorded yet."
    gpus = ordered_gpus(results)
    rows = ["| # | Notebook | " + " | ".join(gpu.upper() for gpu in gpus) + " |", "|---|---|" + "---|" * len(gpus)]
    cells = []
    for path in course.notebooks():
        stem = path.stem
        row = [result_cell(stem, results[gpu].get(stem), sources.get(stem)) for gpu in gpus]
        cells += row
        rel = path.relative_to(course.ROOT).as_posix()
        rows.append(f"| {course.number(stem)} | [{notebook_title(path)}]({rel}) | " + " | ".join(row) + " |")
    charts = "\n".join(f"![{gpu.upper()}: headline figures as a % of their limit]"
                       f"(results/{gpu}.png)" for gpu in gpus)
    files = " · ".join(f"[`results/{gpu}.json`](results/{gpu}.json)" for gpu in gpus)
    return ("\n".join(rows) + footnotes(cells)
            + "\n\n**Course targets**, per GPU (measured in the notebooks, never asserted in a test; \"unresolved\" "
              "where the figure's band reaches across the target):\n\n"
            + targets_table(results, sources)
            + "\n\nEach GPU's headline figures as a percentage of the limit recorded with them:\n\n" + charts
            + f"\n\nEvery recorded figure, with its band, its limit and the run it came from: {files}.")


def chart_bars(stem_entries: dict[str, dict], sources: dict[str, str]) -> list[tuple[str, float]]:
    """(label, % of its limit) of every headline figure of one GPU that carries a limit, notebook by notebook."""
    bars = []
    for path in course.notebooks():
        entry = stem_entries.get(path.stem)
        if not entry or path.stem not in NOTEBOOKS:
            continue
        found = results_of(entry.get("figures"))
        for name in headline_figures(path.stem):
            result = found.get(name)
            if result is not None and result.percent_of_limit is not None:
                label = f"{course.number(path.stem)} {name} (of {result.limit_name})"
                bars.append((f"{label} {marks(entry, sources.get(path.stem))}".rstrip(), result.percent_of_limit))
    return bars


def write_chart(gpu: str, stem_entries: dict[str, dict], sources: dict[str, str], path: Path) -> Path:
    """``path`` (a PNG): horizontal bars of one GPU's headline figures as a % of their limits."""
    import matplotlib

    if matplotlib.get_backend().lower() != "agg":
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from utils.plot import bar

    bars = chart_bars(stem_entries, sources)
    title = f"{gpu.upper()}: headline figures as a % of their limit"
    if any(STALE in label for label, _ in bars):
        title += f"\n({STALE_NOTE})"
    if bars:
        labels, values = zip(*bars, strict=True)
        fig = bar(list(labels), list(values), ylabel="% of the limit recorded with the figure (named in brackets)",
                  title=title, horizontal=True, reference=100.0, reference_label="the limit (100%)")
    else:
        fig, ax = plt.subplots(figsize=(8.0, 1.6))
        ax.axis("off")
        ax.text(0.5, 0.5, "No headline figure of this GPU carries a measured limit yet: rerun the notebooks.",
                ha="center", va="center", fontsize=10)
        ax.set_title(title)
        plt.close(fig)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight", metadata={"Software": None})
    return path


def write_charts(results_dir: Path = RESULTS_DIR) -> list[Path]:
    """``results_dir/<gpu>.png`` for every GPU's results file."""
    results, sources = reference_results(results_dir), current_sources()
    return [write_chart(gpu, entries, sources, results_dir / f"{gpu}.png") for gpu, entries in results.items()]


def badges() -> str:
    """The CPU workflow's status badge, linking to its runs."""
    runs = f"{course.repo_url()}/actions/workflows/cpu.yml"
    return f"[![CPU CI]({runs}/badge.svg)]({runs})"


def render(readme_text: str, results_dir: Path = RESULTS_DIR) -> str:
    """README text with the generated badge, notebook table and results replaced."""
    results, sources = reference_results(results_dir), current_sources()
    for key, body in (("badges", badges()), ("notebooks", notebooks_table(results, sources)),
                      ("results", results_section(results, sources))):
        pattern = re.compile(rf"(<!-- {key}:start -->\n).*?(<!-- {key}:end -->)", re.S)
        if not pattern.search(readme_text):
            raise ValueError(f"README.md lacks the <!-- {key}:start --> / <!-- {key}:end --> markers")
        readme_text = pattern.sub(lambda m, body=body: m.group(1) + body + "\n" + m.group(2), readme_text)
    return readme_text


def missing_charts(results_dir: Path = RESULTS_DIR) -> list[Path]:
    """The charts ``results_dir/<gpu>.png`` that a GPU's results file lacks."""
    return [p.with_suffix(".png") for p in sorted(results_dir.glob("*.json")) if not p.with_suffix(".png").exists()]


def write_readme(results_dir: Path = RESULTS_DIR) -> bool:
    """Rewrite README.md's generated parts and every GPU's chart; True if README changed."""
    old = README.read_text()
    new = render(old, results_dir)
    if new != old:
        README.write_text(new)
    write_charts(results_dir)
    return new != old


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Regenerate README.md's tables and the charts in results/.")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if README.md is out of date or a GPU's chart is missing")
    args = parser.parse_args(argv)
    if args.check:
        current = README.read_text()
        stale = render(current) != current
        missing = missing_charts()
        if stale or missing:
            what = ["README.md tables are out of date"] if stale else []
            what += [f"{p.relative_to(course.ROOT)} is missing" for p in missing]
            print(f"{'; '.join(what)}: run python -m tools.readme_tables", file=sys.stderr)
            return 1
        return 0
    print("README.md updated" if write_readme() else "README.md already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
