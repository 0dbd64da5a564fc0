"""Generate README's notebook table and results table from the notebooks and ``results/*.json``.

    python -m tools.readme_tables          # rewrite the two tables in README.md
    python -m tools.readme_tables --check  # exit 1 if README.md is out of date (a test runs this)

The tables live between ``<!-- notebooks:start -->`` / ``<!-- notebooks:end -->`` and ``<!-- results:start -->`` /
``<!-- results:end -->``; the CI badge between ``<!-- badges:start -->`` / ``<!-- badges:end -->`` (from the repository
address in pyproject.toml). Headline figures come only from results files written by the reference run.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat

from tools import course
from utils.results import reference_results

README = course.ROOT / "README.md"
RESULTS_DIR = course.ROOT / "results"
REFERENCE_GPU = "h200"  # the slug of the GPU whose figures the notebook table shows
#: Notebooks that run on several reference GPUs at once, and how many (notebook 10's NPROC): their headline says so.
REFERENCE_GPUS_USED: dict[str, int] = {"10_multi_gpu": 2}

# What each notebook teaches in a phrase, and its headline: a format string over its recorded figures.
NOTEBOOKS: dict[str, tuple[str, str]] = {
    "00_install_check": (
        "versions, GPU properties, capabilities, measured matmul and copy peaks vs datasheets",
        "bf16 matmul {matmul_tflops_bf16_burst:.0f} burst / {matmul_tflops_bf16_sustained:.0f} sustained TFLOP/s "
        "· copy {copy_gbps:,.0f} GB/s",
    ),
    "01_device_management": (
        "devices, asynchronous execution and errors, honest timing, pinned memory, streams, map_location",
        "H2D pinned {h2d_pinned_gbps:.1f} vs pageable {h2d_pageable_gbps:.1f} GB/s · "
        "copy/compute overlap {stream_overlap_speedup:.2f}×",
    ),
    "02_training_loop": (
        "the seed MNIST loop made fast: data pipeline, host syncs, GPU-resident data, CUDA graphs, checkpoints",
        "epoch {epoch_s_seed_loop:.3f} s → {epoch_s_seed_hparams_fastest:.4f} s (same batch) → "
        "{epoch_s_optimized:.4f} s at {test_accuracy_optimized:.1f}% test accuracy",
    ),
    "03_mixed_precision": (
        "torch.amp autocast, GradScaler, fp16 vs bf16 on a Transformer LM",
        "step {step_ms_fp32:.0f} ms fp32 → {step_ms_bf16:.0f} ms bf16",
    ),
    "04_torch_compile": (
        "what torch.compile fuses, what it costs, graph breaks, recompiles, when it does not help",
        "train step {compile_speedup_train_best:.2f}× (best mode), compile {compile_time_s_default:.0f} s",
    ),
    "05_memory": (
        "what fills GPU memory, how to see it (snapshots), and the techniques that fit 4× the batch",
        "peak {peak_mem_gb_baseline:.1f} → {peak_mem_gb_combined:.1f} GB · in 16 GB: batch "
        "{max_batch_16gb_baseline:.0f} → {max_batch_16gb_combined:.0f}",
    ),
    "06_custom_kernels": (
        "one fused op in Triton and CUDA C++, registered with torch.library, vs the memory limit",
        "{fused_gbps_triton:,.0f} GB/s Triton · {speedup_vs_eager:.1f}× eager",
    ),
    "08_inference": (
        "GPT-2 decoding from the guide's loop to a Triton step in a CUDA graph, against the memory limit; HF generate; "
        "export",
        "GPT-2 batch 1: {gpt2_tok_s_guide_loop:,.0f} → {gpt2_tok_s_best:,.0f} tokens/s "
        "({gpt2_best_pct_copy_bandwidth:.0f}% of copy bandwidth)",
    ),
    "09_benchmarks": (
        "the guide's benchmark table on your GPU: its settings, the best the course teaches, the limits, JPEG input",
        "ResNet-50 {resnet50_train_img_s_best:,.0f} img/s · BERT-Large {bert_large_sent_s_best:,.0f} sent/s · "
        "GPT-2 {gpt2_tok_s_best:,.0f} tok/s · compile {compile_speedup_min:.2f}–{compile_speedup_max:.2f}×",
    ),
    "07_performance_playbook": (
        "every tip of the performance guides checked on your GPU, and the profiler that says which to try",
        "TF32 matmul {tf32_matmul_speedup:.1f}× · channels_last {channels_last_speedup_resnet50:.2f}× · "
        "CUDA graphs {cuda_graphs_speedup:.1f}×",
    ),
    "10_multi_gpu": (
        "torchrun, NCCL all-reduce vs the link, DDP scaling and its options, no_sync, FSDP2 memory, DCP checkpoints",
        "all-reduce {allreduce_busbw_gbps:,.0f} GB/s bus · DDP 2 GPUs {ddp_scaling_2gpu:.2f}× · "
        "FSDP2 peak memory {fsdp_peak_mem_ratio_vs_ddp:.2f}× DDP",
    ),
}


def notebook_title(path: Path) -> str:
    """The topic from the title cell's first line, '# NN · Topic'."""
    first = course.cell_source(nbformat.read(path, as_version=4).cells[0]).splitlines()[0]
    match = re.match(r"^#\s*\d\d\s*·\s*(.+)$", first)
    return match.group(1).strip() if match else first.lstrip("# ").strip()


def load_results(results_dir: Path = RESULTS_DIR) -> dict[str, dict[str, dict[str, dict[str, object]]]]:
    """``{gpu slug: {notebook stem: {name: {"value", "unit"}}}}`` from every results file."""
    return reference_results(results_dir)


def headline(stem: str, figures: dict[str, dict[str, object]] | None) -> str:
    if stem not in NOTEBOOKS:
        raise KeyError(f"tools/readme_tables.py: add {stem!r} to NOTEBOOKS (what it teaches, its headline)")
    if not figures:
        return "not yet run on the reference GPU"
    values = {name: fig["value"] for name, fig in figures.items()}
    gpus = REFERENCE_GPUS_USED.get(stem, 1)
    on = f"on {gpus} × {REFERENCE_GPU.upper()}: " if gpus > 1 else ""
    try:
        return on + NOTEBOOKS[stem][1].format(**values)
    except KeyError as missing:
        return f"{on}(figure {missing} not recorded)"


def notebooks_table(results: dict) -> str:
    reference = results.get(REFERENCE_GPU, {})
    rows = [f"| # | Topic | What you learn | Open | Headline on the reference GPU ({REFERENCE_GPU.upper()}) |",
            "|---|---|---|---|---|"]
    for path in course.notebooks():
        stem = path.stem
        rel = path.relative_to(course.ROOT).as_posix()
        rows.append(f"| {stem[:2]} | [{notebook_title(path)}]({rel}) | {NOTEBOOKS.get(stem, ('?',))[0]} | "
                    f"[![Open In Colab]({course.COLAB_BADGE_IMAGE})]({course.colab_url(path)}) | "
                    f"{headline(stem, reference.get(stem))} |")
    return "\n".join(rows)


def results_table(results: dict) -> str:
    """Every recorded figure, one row per (notebook, figure), one column per GPU; '—' where a GPU lacks it."""
    if not results:
        return "No reference run has been recorded yet."
    gpus = sorted(results, key=lambda gpu: (gpu != REFERENCE_GPU, gpu))  # the reference GPU first
    keys: dict[tuple[str, str], None] = {}
    for stem in sorted({stem for by_notebook in results.values() for stem in by_notebook}):
        for gpu in gpus:
            for name in results[gpu].get(stem, {}):
                keys[(stem, name)] = None
    rows = ["| Notebook | Figure | " + " | ".join(gpu.upper() for gpu in gpus) + " |",
            "|---|---|" + "---:|" * len(gpus)]
    for stem, name in keys:
        cells = []
        for gpu in gpus:
            fig = results[gpu].get(stem, {}).get(name)
            cells.append(f"{fig['value']:,.4g} {fig['unit']}" if fig else "—")
        rows.append(f"| {stem} | `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def badges() -> str:
    """The CPU workflow's status badge, linking to its runs."""
    runs = f"{course.repo_url()}/actions/workflows/cpu.yml"
    return f"[![CPU CI]({runs}/badge.svg)]({runs})"


def render(readme_text: str, results_dir: Path = RESULTS_DIR) -> str:
    """README text with the generated badge and tables replaced."""
    results = load_results(results_dir)
    for key, body in (("badges", badges()), ("notebooks", notebooks_table(results)),
                      ("results", results_table(results))):
        pattern = re.compile(rf"(<!-- {key}:start -->\n).*?(<!-- {key}:end -->)", re.S)
        if not pattern.search(readme_text):
            raise ValueError(f"README.md lacks the <!-- {key}:start --> / <!-- {key}:end --> markers")
        readme_text = pattern.sub(lambda m, body=body: m.group(1) + body + "\n" + m.group(2), readme_text)
    return readme_text


def write_readme() -> bool:
    """Rewrite README.md's tables; True if it changed."""
    old = README.read_text()
    new = render(old)
    if new != old:
        README.write_text(new)
    return new != old


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Regenerate README.md's notebook and results tables.")
    parser.add_argument("--check", action="store_true", help="exit 1 if README.md is out of date")
    args = parser.parse_args(argv)
    if args.check:
        current = README.read_text()
        if render(current) != current:
            print("README.md tables are out of date: run python -m tools.readme_tables", file=sys.stderr)
            return 1
        return 0
    print("README.md updated" if write_readme() else "README.md already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
