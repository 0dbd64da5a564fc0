"""Headline figures of a notebook, collected by the reference run into ``results/<gpu>.json``.

A figure is recorded by the call that measured it (``utils.bench.compare(..., record=...)``,
``rate.record("copy_gbps")``) or by ``utils.results.record("copy_gbps", value, "GB/s")``, with the band it was
measured with and the limit measured beside it. Inside
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


#: Units of figures where less is better (a time): their "% of the limit" is limit / value, not value / limit.
TIME_UNITS = ("s", "ms", "µs", "ns")


@dataclass(frozen=True)
class Result:
    """One recorded headline figure, with the band it was measured with and the limit measured beside it."""

    name: str
    value: float
    unit: str
    band: tuple[float, float] | None = None
    limit: float | None = None
    limit_name: str | None = None

    @property
    def percent_of_limit(self) -> float | None:
        """How close the figure came to its limit, in percent: value / limit for a rate, limit / value for a time
        (a floor), None without a limit."""
        if self.limit is None:
            return None
        return 100.0 * (self.limit / self.value if self.unit in TIME_UNITS else self.value / self.limit)

    def payload(self) -> dict[str, object]:
        """The figure as the results file holds it (the keys without a value left out)."""
        out: dict[str, object] = {"value": self.value, "unit": self.unit}
        if self.band is not None:
            out["band"] = list(self.band)
        if self.limit is not None:
            out["limit"] = {"name": self.limit_name, "value": self.limit}
        return out

    def __str__(self) -> str:
        text = f"recorded {self.name} = {self.value:.4g} {self.unit}"
        if self.band is not None:
            text += f" (band {self.band[0]:.4g}–{self.band[1]:.4g})"
        if self.limit is not None:
            text += f", {self.percent_of_limit:.0f}% of {self.limit_name} ({self.limit:.4g})"
        return text


#: Every figure recorded in this process, in order (the exercises and tests read it).
RECORDED: dict[str, Result] = {}


def _finite(name: str, what: str, value: object) -> float:
    if isinstance(value, bool) or not hasattr(value, "__float__"):
        raise ValueError(f"result {name!r}: {what} must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"result {name!r}: {what} must be finite, got {value}")
    return value


def record(name: str, value: float, unit: str, *, band: tuple[float, float] | None = None,
           limit: float | None = None, limit_name: str | None = None) -> Result:
    """Record a headline figure under ``name`` (snake_case, e.g. ``matmul_tflops_bf16``) with its unit.

    ``band``: the (low, high) quartiles it was measured with. ``limit`` and ``limit_name``: the limit measured in
    the same run that the figure is put against (in the figure's unit), e.g. ``limit=copy.value,
    limit_name="copy bandwidth"``; the README shows the figure as a percentage of it. Usually called by the
    measuring call itself (``utils.bench.compare(..., record=...)``, ``Rate.record``). Returns the :class:`Result`.

    Raises:
        ValueError: for a name that is not snake_case, a value, band or limit that is not a finite number (a NaN
            or inf headline is a bug upstream), an empty unit, or a limit without its name.
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"result name must be snake_case like 'copy_gbps', got {name!r}")
    value = _finite(name, "the value", value)
    if not isinstance(unit, str) or not unit.strip():
        raise ValueError(f"result {name!r} needs a unit (e.g. 'GB/s', 'ms', 'x'), got {unit!r}")
    if band is not None:
        band = (_finite(name, "the band", band[0]), _finite(name, "the band", band[1]))
    if limit is not None:
        limit = _finite(name, "the limit", limit)
        if limit <= 0 or not limit_name:
            raise ValueError(f"result {name!r}: a limit is positive and named (limit_name='copy bandwidth'), "
                             f"got {limit} named {limit_name!r}")
    result = Result(name, value, unit.strip(), band, limit, limit_name if limit is not None else None)
    RECORDED[name] = result
    _show(result)
    return result


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
        payload = {"name": result.name, **result.payload()}
        display({"text/plain": f"📌 {result}", MIME_TYPE: payload}, raw=True)
    else:
        print(f"📌 {result}")
