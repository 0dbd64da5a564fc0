"""Headline figures of a notebook, collected by the reference run into ``results/<gpu>.json``.

A notebook calls ``utils.results.record("copy_gbps", rate.value, "GB/s")`` once per headline figure. Inside
Jupyter the figure is displayed as a one-line output that also carries a machine-readable copy (MIME type
:data:`MIME_TYPE`); ``tools/reference_run.py`` reads those outputs from the executed notebook, so the numbers in
``results/`` are exactly the ones the committed notebook shows. Outside Jupyter the figure is printed.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

MIME_TYPE = "application/vnd.pytorch-cuda-course.result+json"
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class Result:
    """One recorded headline figure."""

    name: str
    value: float
    unit: str

    def __str__(self) -> str:
        return f"recorded {self.name} = {self.value:.4g} {self.unit}"


#: Every figure recorded in this process, in order (the exercises and tests read it).
RECORDED: dict[str, Result] = {}


def record(name: str, value: float, unit: str) -> None:
    """Record a headline figure under ``name`` (snake_case, e.g. ``matmul_tflops_bf16``) with its unit.

    Raises:
        ValueError: for a name that is not snake_case, a value that is not a finite number (a NaN or inf
            headline is a bug upstream), or an empty unit.
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"result name must be snake_case like 'copy_gbps', got {name!r}")
    if isinstance(value, bool) or not hasattr(value, "__float__"):
        raise ValueError(f"result {name!r} must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"result {name!r} must be finite, got {value}")
    if not isinstance(unit, str) or not unit.strip():
        raise ValueError(f"result {name!r} needs a unit (e.g. 'GB/s', 'ms', 'x'), got {unit!r}")
    result = Result(name, value, unit.strip())
    RECORDED[name] = result
    _show(result)


def reference_results(results_dir: str | Path) -> dict[str, dict[str, dict[str, dict[str, object]]]]:
    """Every reference run's figures, as ``tools/reference_run.py`` wrote them into ``results_dir/<gpu>.json``:
    ``{gpu: {notebook stem: {name: {"value": ..., "unit": ...}}}}``, GPUs in name order (empty without files)."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(Path(results_dir).glob("*.json"))}


def _show(result: Result) -> None:
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        get_ipython = None  # noqa: N806
    if get_ipython is not None and get_ipython() is not None:
        payload = {"name": result.name, "value": result.value, "unit": result.unit}
        display({"text/plain": f"📌 {result}", MIME_TYPE: payload}, raw=True)
    else:
        print(f"📌 {result}")
