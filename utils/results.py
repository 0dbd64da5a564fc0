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


def figure(x: float) -> str:
    """A measured figure as the course prints it: four significant digits, thousands separated from 1,000 up."""
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"


@dataclass(frozen=True)
class Result:
    """One recorded headline figure, with the band it was measured with and the limit measured beside it."""

    name: str
    value: float
    unit: str
    band: tuple[float, float] | None = None
    limit: float | None = None
    limit_name: str | None = None
    coverage: float | None = None  # the band's coverage where it is below 95% (too few rounds); None: 95%

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
        if self.coverage is not None:
            out["coverage"] = self.coverage
        if self.limit is not None:
            out["limit"] = {"name": self.limit_name, "value": self.limit}
        return out

    def __str__(self) -> str:
        text = f"recorded {self.name} = {figure(self.value)} {self.unit}"
        if self.band is not None:
            coverage = f", a {self.coverage:.0%} interval" if self.coverage is not None else ""
            text += f" (band {figure(self.band[0])}–{figure(self.band[1])}{coverage})"
        if self.limit is not None:
            pct = self.percent_of_limit
            text += f", {pct:.0f}%" if pct >= 10 else f", {pct:.2g}%"
            if self.unit in TIME_UNITS:  # the limit of a time is the least time the work takes at that rate
                text += f" of {self.limit_name}: {figure(self.limit)} {self.unit} at it"
            else:
                text += f" of {self.limit_name} ({figure(self.limit)} {self.unit})"
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
           limit: float | None = None, limit_name: str | None = None, coverage: float | None = None) -> None:
    """Record a headline figure under ``name`` (snake_case, e.g. ``matmul_tflops_bf16``) with its unit.

    ``band``: the (low, high) quartiles it was measured with, or a verdict's interval; ``coverage``: that
    interval's coverage where it is below 95% (a verdict from fewer than 6 rounds), so the README can say so.
    ``limit`` and ``limit_name``: the limit measured in the same run that the figure is put against (in the
    figure's unit), e.g. ``limit=copy.value, limit_name="copy bandwidth"``; the README shows the figure as a
    percentage of it. Usually called by the measuring call itself (``utils.bench.compare(..., record=...)``,
    ``Rate.record``). The :class:`Result` is kept in :data:`RECORDED` (nothing is returned, so a cell that ends
    with this call shows the figure once).

    Raises:
        ValueError: for a name that is not snake_case, a value, band or limit that is not a finite number (a NaN
            or inf headline is a bug upstream), an empty unit, a limit without its name, or a coverage without a
            band or outside (0, 1).
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"result name must be snake_case like 'copy_gbps', got {name!r}")
    value = _finite(name, "the value", value)
    if not isinstance(unit, str) or not unit.strip():
        raise ValueError(f"result {name!r} needs a unit (e.g. 'GB/s', 'ms', 'x'), got {unit!r}")
    if band is not None:
        band = (_finite(name, "the band", band[0]), _finite(name, "the band", band[1]))
    if coverage is not None:
        coverage = _finite(name, "the coverage", coverage)
        if band is None or not 0 < coverage < 1:
            raise ValueError(f"result {name!r}: a coverage is a band's, between 0 and 1 (0.75 for 3 rounds), got "
                             f"{coverage} {'with' if band is not None else 'without'} a band")
    if limit is not None:
        limit = _finite(name, "the limit", limit)
        if limit <= 0 or not limit_name:
            raise ValueError(f"result {name!r}: a limit is positive and named (limit_name='copy bandwidth'), "
                             f"got {limit} named {limit_name!r}")
    result = Result(name, value, unit.strip(), band, limit, limit_name if limit is not None else None, coverage)
    RECORDED[name] = result
    _show(result)


#: What a run record says about the run that measured a notebook's figures (``results/<gpu>.json``, and the same
#: fields in a notebook's ``metadata.reference_run`` stamp): its date, the GPU's name, how many GPUs the notebook
#: used, how many CPUs the process could use, the torch and CUDA versions, the wall time in seconds, and the
#: SHA-256 of the notebook's sources (``tools.course.sources_sha256``). ``cpus`` and ``wall_s`` may be None (not
#: known for runs from before they were recorded); a record may also say ``"shared_host": true`` (the notebooks ran
#: side by side on one host, ``PARALLEL=1 bash .ci/gpu-run``).
RUN_FIELDS = ("date", "gpu", "gpus", "cpus", "torch", "cuda", "wall_s", "sources_sha256")


def from_payload(name: str, payload: dict[str, object]) -> Result:
    """A figure as a results file or a recorded output holds it (``Result.payload()``), as a :class:`Result`."""
    band = payload.get("band")
    limit = payload.get("limit") or {}
    coverage = payload.get("coverage")
    return Result(name, float(payload["value"]), str(payload["unit"]),
                  (float(band[0]), float(band[1])) if band else None,
                  float(limit["value"]) if limit else None, limit.get("name") if limit else None,
                  float(coverage) if coverage is not None else None)


def read_results_file(path: str | Path) -> dict[str, dict[str, object]]:
    """One GPU's results file: ``{notebook stem: {"run": run record or None, "figures": {name: payload}}}``.

    The run record has the fields :data:`RUN_FIELDS`; a payload is ``{"value", "unit"}`` with an optional
    ``"band": [low, high]``, ``"coverage"`` (the band's, where under 95%) and ``"limit": {"name", "value"}``. A
    file in the format from before run records (``{stem: {name: payload}}``, e.g. a reader's older ``t4.json``)
    reads as entries with ``"run": None``.

    Raises:
        ValueError: for a file that is not a JSON object of notebook entries.
    """
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict) or not all(isinstance(entry, dict) for entry in data.values()):
        raise ValueError(f"{path}: a results file maps notebook stems to entries (JSON objects)")
    entries: dict[str, dict[str, object]] = {}
    for stem, entry in data.items():
        if "figures" in entry and set(entry) <= {"run", "figures"}:
            entries[stem] = {"run": entry.get("run"), "figures": entry["figures"]}
        else:  # the format before run records: the figures alone
            entries[stem] = {"run": None, "figures": entry}
    return entries


def write_results_entry(path: str | Path, stem: str, run: dict[str, object] | None,
                        figures: dict[str, dict[str, object]]) -> Path:
    """Set one notebook's entry (its run record and figures) in the results file at ``path``; the other notebooks'
    entries stay. Notebooks in name order, figures in the order they were recorded. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    entries = read_results_file(path) if path.exists() else {}
    entries[stem] = {"run": run, "figures": figures}
    path.write_text(json.dumps(dict(sorted(entries.items())), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def reference_results(results_dir: str | Path) -> dict[str, dict[str, dict[str, object]]]:
    """Every reference run's results, as ``tools/reference_run.py`` wrote them into ``results_dir/<gpu>.json``:
    ``{gpu: {notebook stem: {"run": ..., "figures": {name: payload}}}}`` (:func:`read_results_file`), GPUs in
    name order (empty without files)."""
    return {p.stem: read_results_file(p) for p in sorted(Path(results_dir).glob("*.json"))}


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
