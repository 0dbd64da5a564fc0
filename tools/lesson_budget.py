"""How a notebook reads against the lesson budget of the course's design (a notebook is a lesson; utils is the lab).

    python -m tools.lesson_budget [notebooks/NN_*.ipynb ...]    # every notebook when none is named

Per notebook: characters of markdown and code; words per sentence (mean, and the share over 40); lines per code
cell (median, max); functions and classes defined in the notebook (count, lines); how much source comes before the
first output after the setup cell; and ⚠ lines in the outputs. The same measurements as the shared
``lesson-budget`` tool, kept here so that a test can hold the notebooks rewritten as lessons (:data:`LESSONS`) to
the budget on a clean checkout.
"""

from __future__ import annotations

import ast
import json
import re
import statistics
import sys
from pathlib import Path

from tools import course

#: The goal drawn from the tutorials readers hold up as models: (limit, "max" or "min").
BUDGET: dict[str, float] = {"chars": 35_000, "prose": 12_000, "words/sentence": 20, "long sentences": 0.07,
                            "median lines": 10, "max lines": 25, "inline defs": 8, "def lines": 80,
                            "first output at": 6_000, "⚠ lines": 0}
#: Notebooks rewritten as lessons: a test holds them to every row of the budget.
LESSONS = {"00_install_check", "01_device_management", "02_training_loop", "03_mixed_precision", "04_torch_compile",
           "04b_compile_in_depth", "05_memory", "07_performance_playbook", "07b_launch_bound", "06_custom_kernels",
           "08_inference", "08b_serving", "08c_quantization", "09_benchmarks", "09b_inference_benchmarks",
           "10_multi_gpu"}
#: A kernel may run to 40 lines (DESIGN.md): cells whose first line carries this marker get that allowance.
KERNEL_MARK = "@triton.jit"
KERNEL_MAX_LINES = 40


def sentences(text: str) -> list[int]:
    """Words per sentence of markdown prose: code, link targets, headings and bullet marks left out."""
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    text = re.sub(r"`[^`]*`", "x", text)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"^\s*([#>*-]|\d+\.)\s*", "", text, flags=re.M)
    parts = re.split(r"(?<=[.!?])\s+|\n\s*\n", text)
    return [len(p.split()) for p in parts if len(p.split()) >= 3]


def definitions(src: str) -> list[int]:
    """Lines of each top-level function or class a code cell defines."""
    src = "\n".join("#" + line if line.lstrip().startswith(("%", "!")) else line for line in src.splitlines())
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return []
    return [n.end_lineno - n.lineno + 1 for n in tree.body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]


def _outputs(cell) -> list[str]:
    texts = []
    for o in cell.get("outputs", []):
        if o.get("output_type") == "stream":
            texts.append("".join(o.get("text", "")))
        elif "data" in o:
            texts.append("".join(o["data"].get("text/plain", "")))
    return texts


def measure(path: Path) -> dict[str, float | None]:
    """The budget's rows for one notebook."""
    cells = json.loads(Path(path).read_text(encoding="utf-8"))["cells"]
    md = ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    words = [w for text in md for w in sentences(text)]
    lines = [len([x for x in s.splitlines() if x.strip()]) for s in code] or [0]
    plain = [n for s, n in zip(code, lines, strict=True) if KERNEL_MARK not in s] or [0]
    defs = [n for s in code for n in definitions(s)]
    first, before, seen_setup = None, 0, False
    for c in cells:
        if c["cell_type"] == "code":
            if seen_setup and c.get("outputs") and first is None:
                first = before
            seen_setup = True
        before += len("".join(c["source"]))
    warn = sum(line.lstrip().startswith("⚠") for c in cells for text in _outputs(c) for line in text.splitlines())
    return {"chars": sum(map(len, md)) + sum(map(len, code)), "prose": sum(map(len, md)),
            "words/sentence": statistics.mean(words) if words else 0.0,
            "long sentences": sum(w > 40 for w in words) / len(words) if words else 0.0,
            "median lines": statistics.median(lines), "max lines": max(plain),
            "kernel lines": max(lines), "inline defs": len(defs), "def lines": sum(defs),
            "first output at": first, "⚠ lines": warn}


def over_budget(row: dict[str, float | None]) -> list[str]:
    """The rows of :func:`measure` that exceed the budget, each as 'name: value > limit'."""
    over = [f"{k}: {row[k]:.3g} > {limit:,}" for k, limit in BUDGET.items()
            if row.get(k) is not None and row[k] > limit]
    if row["kernel lines"] > KERNEL_MAX_LINES:
        over.append(f"kernel lines: {row['kernel lines']} > {KERNEL_MAX_LINES}")
    return over


def main(argv: list[str] | None = None) -> int:
    paths = [Path(p) for p in (argv or [])] or course.notebooks()
    rows = {p.name.split('_', 1)[0]: measure(p) for p in paths}
    keys = list(BUDGET)
    print(f"{'':16}" + "".join(f"{k:>8}" for k in rows) + f"{'budget':>10}")
    for k in keys:
        cells = []
        for r in rows.values():
            v = r[k]
            mark = "*" if v is not None and v > BUDGET[k] else " "
            text = "—" if v is None else f"{v:.0%}" if k == "long sentences" else f"{v:,.1f}" if k in (
                "words/sentence", "median lines") else f"{v:,.0f}"
            cells.append(f"{text}{mark}".rjust(8))
        limit = f"{BUDGET[k]:.0%}" if k == "long sentences" else f"{BUDGET[k]:,}"
        print(f"{k:16}" + "".join(cells) + f"{limit:>10}")
    print("* over the budget. Characters count markdown and code sources, not outputs.")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
