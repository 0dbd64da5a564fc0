"""Reference run: execute notebooks in place on this machine's GPU, stamp them, collect their headline figures.

    python -m tools.reference_run                      # every notebook
    python -m tools.reference_run notebooks/00_*.ipynb # some of them

For each notebook, in reading order: execute it with nbclient (working directory notebooks/, like nbmake and
JupyterLab), and only if every cell succeeded write it back in place with the stamp

    metadata.reference_run = {"sources_sha256", "gpu", "gpus", "cpus", "torch", "cuda", "date", "wall_s"}

where ``sources_sha256`` hashes every cell's type and source (``tools.course.sources_sha256``), so a test can
tell when the outputs no longer belong to the sources; ``gpus`` is how many GPUs the notebook used (all the
machine has for a notebook whose metadata says ``"course": {"gpus": "all"}``, else one); ``cpus`` how many CPUs
the process could use; ``wall_s`` the seconds from the first cell's start to the last cell's end (from the
per-cell timings nbclient and nbmake record, which are then removed). The title cell's Run-time line is rewritten
from the stamp (``tools.course.run_time_line``; the hash leaves that line out). Every figure the notebook passed
to ``utils.results.record`` is read from its outputs and written to ``results/<gpu>.json`` with the stamp as the
run record, ``{notebook stem: {"run": stamp, "figures": {name: {"value", "unit", "band"?, "coverage"?, "limit"?}}}}``
(``utils.results.read_results_file``); then README's tables and charts are regenerated.

A failed notebook is left untouched (its partial run goes to --failed-dir if given) and the exit status is 1.

    python -m tools.reference_run --collect-only --machine build/gpu-run/machine.json --results-dir DIR NB...

reads the figures of notebooks that were already executed (by nbmake --overwrite in .ci/gpu-run) into
``DIR/<gpu>.json`` with their run record, without executing or stamping anything: this is how another GPU's
figures are filed (e.g. ``results/h100.json``). The record's machine fields come from ``--machine`` (else this
machine), its wall time from the executed copy's per-cell timings.

    python -m tools.reference_run --stamp-executed build/gpu-run/notebooks notebooks/04_*.ipynb

adopts the copies that ``.ci/gpu-run`` executed (nbmake, the same nbclient, the same working directory) as the
reference run instead of executing each notebook a second time: each copy must have exactly the sources of the
notebook it replaces, every code cell executed and no error output; then it is stamped and written in place like a
run of its own. One GPU run both proves that nbmake passes and gives the committed outputs. The stamp's machine
fields are those ``.ci/gpu-run`` wrote to ``build/gpu-run/machine.json`` (``--write-machine``) on the machine that
executed them, so the copies can be stamped elsewhere (``--machine FILE``); without it, this machine's. A machine
file written with ``--shared-host`` (``PARALLEL=1 bash .ci/gpu-run``: notebooks side by side on one host) is
refused for stamping; its figures can be collected, and their run record says ``"shared_host": true``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import html as html_lib
import json
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

from tools import course, readme_tables
from tools.parallel_nbmake import ALL_GPUS
from utils.env import usable_cpus
from utils.results import MIME_TYPE, write_results_entry

RESULTS_DIR = course.ROOT / "results"



def machine_stamp(allow_cpu: bool) -> tuple[dict[str, object], str]:
    """The stamp's machine fields and the results file's slug, read off this machine's torch and OS.

    ``gpus`` here is how many GPUs the machine shows; the stamp keeps how many a notebook used (:func:`run_record`).
    """
    import torch

    from utils.env import gpu_slug

    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
        slug = gpu_slug(gpu)
    elif allow_cpu:
        gpu, slug = "cpu", "cpu"
    else:
        raise SystemExit("reference_run: no CUDA GPU visible. Reference runs are GPU runs; "
                         "pass --allow-cpu to stamp a run on a machine without a GPU anyway.")
    stamp = {"gpu": gpu, "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
             "cpus": usable_cpus(), "torch": torch.__version__, "cuda": torch.version.cuda or "none",
             "date": dt.datetime.now(dt.UTC).date().isoformat()}
    return stamp, slug


def recorded_results(nb) -> dict[str, dict[str, object]]:
    """Every figure ``utils.results.record`` displayed in an executed notebook, in order (last one wins), as the
    results file holds it: ``{name: {"value", "unit", "band"?, "coverage"?, "limit"?}}``."""
    found: dict[str, dict[str, object]] = {}
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            payload = output.get("data", {}).get(MIME_TYPE)
            if payload is not None:
                found[payload["name"]] = {key: value for key, value in payload.items() if key != "name"}
    return found


def wall_seconds(nb) -> float | None:
    """The run's wall time: from the first code cell's start (``iopub.execute_input``) to the last one's reply
    (``shell.execute_reply``), read from the per-cell timings nbclient and nbmake keep in ``cell.metadata.execution``;
    None where the notebook holds no timings."""
    starts, ends = [], []
    for cell in nb.cells:
        timing = cell.get("metadata", {}).get("execution", {})
        if "iopub.execute_input" in timing and "shell.execute_reply" in timing:
            starts.append(dt.datetime.fromisoformat(timing["iopub.execute_input"]))
            ends.append(dt.datetime.fromisoformat(timing["shell.execute_reply"]))
    return round((max(ends) - min(starts)).total_seconds(), 1) if starts else None


def slowest_cells(nb, count: int = 5) -> list[tuple[int, float]]:
    """The ``count`` code cells that took longest, as (cell index, seconds), slowest first, read from the same
    per-cell timings as :func:`wall_seconds` (the run log names where a notebook's time goes)."""
    spans = []
    for index, cell in enumerate(nb.cells):
        timing = cell.get("metadata", {}).get("execution", {})
        if "iopub.execute_input" in timing and "shell.execute_reply" in timing:
            seconds = (dt.datetime.fromisoformat(timing["shell.execute_reply"])
                       - dt.datetime.fromisoformat(timing["iopub.execute_input"])).total_seconds()
            spans.append((index, round(seconds, 1)))
    return sorted(spans, key=lambda span: -span[1])[:count]


def drop_cell_timings(nb) -> None:
    """Remove the per-cell timings (not part of a committed notebook; :func:`wall_seconds` reads them first)."""
    for cell in nb.cells:
        cell.get("metadata", {}).pop("execution", None)


def run_record(nb, machine: dict[str, object]) -> dict[str, object]:
    """The stamp of an executed notebook, which is also its run record in ``results/<gpu>.json``
    (``utils.results.RUN_FIELDS``): the machine's fields, the GPUs the notebook used, its wall time and the hash of
    its sources. ``"shared_host": true`` is kept where the machine file says so."""
    uses_all = nb.metadata.get("course", {}).get("gpus") == ALL_GPUS["gpus"]
    machine_gpus = int(machine["gpus"])
    record = {"date": machine["date"], "gpu": machine["gpu"],
              "gpus": machine_gpus if uses_all else min(machine_gpus, 1), "cpus": machine.get("cpus"),
              "torch": machine["torch"], "cuda": machine["cuda"], "wall_s": wall_seconds(nb),
              "sources_sha256": course.sources_sha256(nb)}
    if machine.get("shared_host"):
        record["shared_host"] = True
    return record


def execute(path: Path, *, cell_timeout: int, failed_dir: Path | None):
    """Run one notebook top to bottom; return the executed notebook, or None if a cell failed."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=cell_timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()
    except (CellExecutionError, CellTimeoutError, DeadKernelError) as err:
        print(f"FAILED {path.name}: {str(err).strip()[-3000:]}", file=sys.stderr)
        if failed_dir is not None:
            failed_dir.mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, failed_dir / path.name)
        return None
    return nb


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def settle_progress_bars(nb) -> int:
    """Make each tqdm bar's saved output show how the bar ended, as the reader saw it live; return how many changed.

    In Jupyter a ``tqdm.auto`` bar is a widget whose output keeps, as its ``text/plain`` fallback (what GitHub, nbviewer
    and any reader without the widget state show), the bar as it was *drawn first*: "0%| | 0/7". The widget state that
    the executing kernel saved in ``metadata.widgets`` holds the final one. A bar closed with ``leave=False`` is hidden
    live: its output is dropped. A visible bar's fallback is rewritten from the state: description and
    percentage, bar, counter and rate. Outputs of other widgets are left as they are.
    """
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})

    def model(ref: object) -> dict:
        key = ref[len("IPY_MODEL_"):] if isinstance(ref, str) and ref.startswith("IPY_MODEL_") else ref
        return state.get(key, {}).get("state", {}) if isinstance(key, str) else {}

    def text(html: object) -> str:
        return html_lib.unescape(str(html or "")).replace("\u2007", " ").replace("&nbsp;", " ")

    changed = 0
    for cell in nb.cells:
        kept = []
        for output in cell.get("outputs", []):
            view = output.get("data", {}).get(WIDGET_VIEW)
            box = model(view.get("model_id")) if view else {}
            children = [model(ref) for ref in box.get("children", [])]
            if len(children) != 3 or "max" not in children[1]:  # not tqdm's HBox(HTML, FloatProgress, HTML)
                kept.append(output)
                continue
            changed += 1
            layout = model(box.get("layout"))
            if layout.get("visibility") == "hidden" or layout.get("display") == "none":
                continue  # leave=False: closed and hidden when it ended
            value, total = float(children[1].get("value") or 0), float(children[1]["max"] or 0)
            fraction = min(max(value / total, 0.0), 1.0) if total > 0 else 0.0
            filled = round(10 * fraction)
            left = text(children[0].get("value")).strip() or f"{100 * fraction:3.0f}%"  # "desc: 100%"
            right = text(children[2].get("value")).rstrip()  # " 7/7 [00:09<00:00, 2.13s/it]"
            output["data"]["text/plain"] = f"{left}|{'█' * filled}{' ' * (10 - filled)}|{right}"
            kept.append(output)
        if "outputs" in cell:
            cell["outputs"] = kept
    return changed


MACHINE_FIELDS = ("gpu", "gpus", "cpus", "torch", "cuda", "date")


def read_machine(path: Path, *, stamping: bool) -> tuple[dict[str, object], str]:
    """The machine fields and results slug from a file written by ``--write-machine``; one written with
    ``--shared-host`` is refused when ``stamping`` (its notebooks ran side by side: not reference timings)."""
    from utils.env import gpu_slug

    machine = json.loads(path.read_text())
    missing = set(MACHINE_FIELDS) - set(machine)
    if missing:
        raise SystemExit(f"reference_run: {path} lacks {sorted(missing)}: write it with --write-machine")
    if stamping and machine.get("shared_host"):
        raise SystemExit(f"reference_run: {path} is from a run whose notebooks shared the host (PARALLEL=1): its "
                         "timings are not reference timings; stamp the copies of a plain `bash .ci/gpu-run`")
    return machine, "cpu" if machine["gpu"] == "cpu" else gpu_slug(machine["gpu"])


def executed_copy(path: Path, executed_dir: Path):
    """The copy of ``path`` executed in ``executed_dir``, checked to be a whole, clean run of the same sources."""
    copy = executed_dir / path.name
    if not copy.exists():
        raise SystemExit(f"reference_run: {copy} does not exist: run .ci/gpu-run on {path.name} first")
    nb = nbformat.read(copy, as_version=4)
    if course.sources_sha256(nb) != course.sources_sha256(nbformat.read(path, as_version=4)):
        raise SystemExit(f"reference_run: {copy} was executed from other sources than {path}: run it again")
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if cell.get("execution_count") is None:
            raise SystemExit(f"reference_run: cell {index} of {copy} was never executed: the run stopped early")
        if any(output.get("output_type") == "error" for output in cell.get("outputs", [])):
            raise SystemExit(f"reference_run: cell {index} of {copy} raised an error: the run failed")
    return nb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Execute notebooks on this GPU, stamp them, collect results.")
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every notebook, in order")
    parser.add_argument("--cell-timeout", type=int, default=900, help="seconds one cell may take (default 900)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--failed-dir", type=Path, help="write partially executed failed notebooks here")
    parser.add_argument("--allow-cpu", action="store_true", help="stamp a run on a machine without a GPU")
    parser.add_argument("--collect-only", action="store_true",
                        help="only collect the figures and run records of already executed notebooks (no run, no "
                             "stamp)")
    parser.add_argument("--stamp-executed", type=Path, metavar="DIR",
                        help="stamp the copies already executed in DIR on this machine (e.g. build/gpu-run/notebooks) "
                             "instead of executing the notebooks again")
    parser.add_argument("--machine", type=Path, metavar="FILE",
                        help="with --stamp-executed or --collect-only: the machine that executed the notebooks, as "
                             "--write-machine wrote it")
    parser.add_argument("--write-machine", type=Path, metavar="FILE",
                        help="only write this machine's stamp fields to FILE (JSON) and exit")
    parser.add_argument("--shared-host", action="store_true",
                        help="with --write-machine: the notebooks will run side by side on this host (PARALLEL=1); "
                             "the file is then refused by --stamp-executed")
    args = parser.parse_args(argv)

    if args.shared_host and args.write_machine is None:
        raise SystemExit("reference_run: --shared-host goes with --write-machine")
    if args.machine is not None:
        if args.stamp_executed is None and not args.collect_only:
            raise SystemExit("reference_run: --machine goes with --stamp-executed or --collect-only")
        machine, slug = read_machine(args.machine, stamping=not args.collect_only)
    else:
        machine, slug = machine_stamp(args.allow_cpu)
    if args.write_machine is not None:
        args.write_machine.write_text(json.dumps({**machine, **({"shared_host": True} if args.shared_host else {})},
                                                 indent=2) + "\n")
        return 0
    paths = [p.resolve() for p in args.notebooks] or course.notebooks()
    if args.collect_only:
        for path in paths:
            nb = nbformat.read(path, as_version=4)
            run, figures = run_record(nb, machine), recorded_results(nb)
            out = write_results_entry(args.results_dir / f"{slug}.json", path.stem, run, figures)
            print(f"collected {path.name}: {len(figures)} figures, wall time {run['wall_s']} s → {out}")
        return 0
    failures = 0
    for path in paths:
        start = time.perf_counter()
        if args.stamp_executed is not None:
            nb = executed_copy(path, args.stamp_executed)
        else:
            nb = execute(path, cell_timeout=args.cell_timeout, failed_dir=args.failed_dir)
        seconds = time.perf_counter() - start
        if nb is None:
            failures += 1
            continue
        settle_progress_bars(nb)
        stamp = run_record(nb, machine)
        slowest = ", ".join(f"cell {index} {seconds:.0f} s" for index, seconds in slowest_cells(nb))
        if slowest:
            print(f"{path.name}: slowest cells {slowest}")
        drop_cell_timings(nb)
        nb.metadata["reference_run"] = stamp
        course.sync_run_time_line(nb)
        stamp["sources_sha256"] = course.sources_sha256(nb)  # changed only where the title had no Run-time line
        nb.metadata["reference_run"] = stamp  # (nbformat keeps a copy of what it is given)
        nbformat.write(nb, path)
        figures = recorded_results(nb)
        out = write_results_entry(args.results_dir / f"{slug}.json", path.stem, stamp, figures)
        how = f"stamped from {args.stamp_executed}" if args.stamp_executed is not None else f"{seconds:.0f} s"
        print(f"ok {path.name}: {how} on {stamp['gpu']} (wall time {stamp['wall_s']} s), {len(figures)} figures "
              f"→ {out.name}")
    if args.results_dir.resolve() == RESULTS_DIR.resolve():
        readme_tables.write_readme()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
