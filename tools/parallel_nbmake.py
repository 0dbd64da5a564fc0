"""Spread nbmake over every GPU of this machine: what ``PARALLEL=1 bash .ci/gpu-run`` runs.

A sequential run of the whole course takes about as long as its notebooks together; on a machine with several GPUs
most of them sit idle. Here each GPU gets one job at a time from a shared queue, with ``CUDA_VISIBLE_DEVICES``
naming that GPU alone (the notebooks and the unit tests use ``cuda:0``, which is then that GPU; where
``CUDA_VISIBLE_DEVICES`` already limits the run to some GPUs, the jobs get those). Two kinds of job
need every GPU and run afterwards, one at a time, with all of them visible: the notebooks whose metadata says
``"course": {"gpus": "all"}`` (notebook 10), and the unit tests marked ``multi_gpu``.

The jobs share the host's CPU cores, memory and PCIe. Each one-GPU job gets an equal share of the cores for its
thread pools, ``OMP_NUM_THREADS`` and Inductor's compile workers (``TORCHINDUCTOR_COMPILE_THREADS``), unless the
run sets them itself: without it, four notebooks compiling at once would each start as many workers as the host
has cores (up to 32). What the jobs check (that every cell runs and every result is right) holds, but their
timings are not reference timings. So a parallel run's ``machine.json`` is marked ``shared_host``
(``--write-machine --shared-host``), which ``tools.reference_run --stamp-executed`` refuses; time on a quiet machine
for that.

    python -m tools.parallel_nbmake --gpus 4 --cell-timeout 1800 --unit-tests notebooks/*.ipynb

Each job's output goes to ``logs/<job>.log``; a line per finished job and a closing summary go to stdout; the exit
status is 1 when any job failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: The notebook metadata that sends a notebook to the all-GPU phase.
ALL_GPUS = {"gpus": "all"}
#: The pytest marker of the unit tests that need several GPUs (registered in pyproject.toml).
MULTI_GPU_MARK = "multi_gpu"


@dataclass
class Job:
    """One pytest run: ``name`` for the log and the summary, ``args`` after ``python -m pytest``."""

    name: str
    args: list[str]
    all_gpus: bool = False


@dataclass
class Outcome:
    job: Job
    gpus: str  # the CUDA_VISIBLE_DEVICES it ran with
    returncode: int
    seconds: float
    log: Path
    tail: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.returncode == 0


def uses_all_gpus(notebook: Path) -> bool:
    """Whether a notebook's metadata asks for every GPU (``"course": {"gpus": "all"}``)."""
    try:
        metadata = json.loads(notebook.read_text()).get("metadata", {})
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{notebook}: not a readable notebook ({error})") from error
    return metadata.get("course", {}).get("gpus") == ALL_GPUS["gpus"]


def plan(notebooks: Sequence[Path], *, cell_timeout: int, unit_tests: bool) -> tuple[list[Job], list[Job]]:
    """The jobs of the one-GPU phase and of the all-GPU phase, in the order they start.

    The unit tests (one of the longest jobs) go first, so that they do not start last; with
    pytest-xdist installed they run in four processes on their GPU.
    """
    nbmake = ["--nbmake", f"--nbmake-timeout={cell_timeout}", "--overwrite"]
    one, every = [], []
    if unit_tests:
        xdist = ["-n", "4"] if importlib.util.find_spec("xdist") else []
        one.append(Job("unit tests", ["-m", f"not {MULTI_GPU_MARK}", *xdist, "tests"]))
        every.append(Job(f"unit tests marked {MULTI_GPU_MARK}", ["-m", MULTI_GPU_MARK, "tests"], all_gpus=True))
    for nb in notebooks:
        job = Job(nb.name, [*nbmake, str(nb)], all_gpus=uses_all_gpus(nb))
        (every if job.all_gpus else one).append(job)
    return one, every


def device_ids(gpus: int, visible: str | None) -> list[str]:
    """The ``CUDA_VISIBLE_DEVICES`` value of each of ``gpus`` GPUs: 0, 1, … or, where ``visible`` (the run's own
    ``CUDA_VISIBLE_DEVICES``) lists GPUs, the first ``gpus`` of those, so that a run limited to GPUs 2 and 3 stays
    on them.

    Raises:
        ValueError: when ``visible`` lists fewer GPUs than ``gpus``.
    """
    if visible is None:
        return [str(i) for i in range(gpus)]
    listed = [entry.strip() for entry in visible.split(",") if entry.strip()]
    if len(listed) < gpus:
        raise ValueError(f"{gpus} GPU(s) asked for, but CUDA_VISIBLE_DEVICES={visible!r} lists {len(listed)}")
    return listed[:gpus]


#: The thread-pool sizes a one-GPU job gets its share of the host's cores for (unless the run sets them).
THREAD_SETTINGS = ("OMP_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS")


def thread_share(jobs_at_once: int, cores: int | None) -> dict[str, str]:
    """The settings that give each of ``jobs_at_once`` jobs an equal share of ``cores`` CPU cores (at least 1)."""
    share = str(max(1, (cores or 1) // max(1, jobs_at_once)))
    return {name: share for name in THREAD_SETTINGS}


def _run(job: Job, gpus: str, logs: Path, python: str, cwd: Path, threads: dict[str, str] | None = None) -> Outcome:
    log = logs / (job.name.replace(" ", "_") + ".log")
    start = time.monotonic()
    env = {**(threads or {}), **os.environ, "CUDA_VISIBLE_DEVICES": gpus}  # the run's own settings win
    with log.open("w") as out:
        rc = subprocess.run([python, "-m", "pytest", *job.args], cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                            env=env).returncode
    # pytest exits 5 when a marker selects no test (no multi-GPU test on this checkout): nothing failed
    if rc == 5 and job.args[:1] == ["-m"]:
        rc = 0
    return Outcome(job, gpus, rc, time.monotonic() - start, log, log.read_text().splitlines()[-30:])


def run(one: Sequence[Job], every: Sequence[Job], *, gpus: int, logs: Path, python: str = sys.executable,
        cwd: Path = Path("."), report: Callable[[str], None] = print) -> list[Outcome]:
    """Run ``one`` from a queue, one job per GPU at a time, then ``every`` one at a time on all GPUs.

    Raises:
        ValueError: for fewer than one GPU, or more than ``CUDA_VISIBLE_DEVICES`` lists (:func:`device_ids`).
    """
    if gpus < 1:
        raise ValueError(f"parallel nbmake needs at least one CUDA GPU, got {gpus}")
    ids = device_ids(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
    share = thread_share(min(gpus, len(one)), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                           else os.cpu_count())
    logs.mkdir(parents=True, exist_ok=True)
    todo: queue.Queue[Job] = queue.Queue()
    for job in one:
        todo.put(job)
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def finished(outcome: Outcome) -> None:
        with lock:
            outcomes.append(outcome)
            verdict = "passed" if outcome.passed else f"FAILED (exit {outcome.returncode}, log {outcome.log})"
            report(f"[GPU {outcome.gpus}] {outcome.job.name}: {verdict} in {outcome.seconds:.0f} s")
            if not outcome.passed:
                report("\n".join("    " + line for line in outcome.tail))

    def worker(gpu: str) -> None:
        while True:
            try:
                job = todo.get_nowait()
            except queue.Empty:
                return
            finished(_run(job, gpu, logs, python, cwd, share))

    threads = [threading.Thread(target=worker, args=(g,), name=f"gpu{g}") for g in ids[:len(one)]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for job in every:
        finished(_run(job, ",".join(ids), logs, python, cwd))
    return outcomes


def summary(outcomes: Sequence[Outcome], wall_s: float) -> str:
    failed = [o.job.name for o in outcomes if not o.passed]
    busy = sum(o.seconds for o in outcomes)
    head = (f"parallel nbmake: {len(outcomes) - len(failed)} of {len(outcomes)} jobs passed in {wall_s:.0f} s "
            f"(their times add up to {busy:.0f} s)")
    return head + (f"; failed: {', '.join(failed)}" if failed else "")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--gpus", type=int, default=None, help="default: torch.cuda.device_count()")
    parser.add_argument("--cell-timeout", type=int, default=1800, help="seconds one cell may take")
    parser.add_argument("--unit-tests", action="store_true", help="also run tests/, split as the docstring says")
    parser.add_argument("--logs", type=Path, default=Path("logs"))
    args = parser.parse_args(argv)
    gpus = args.gpus
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    if gpus < 1:
        parser.error("no CUDA GPU visible: parallel nbmake spreads notebooks over GPUs")
    one, every = plan(args.notebooks, cell_timeout=args.cell_timeout, unit_tests=args.unit_tests)
    print(f"parallel nbmake on {gpus} GPU(s): {len(one)} one-GPU job(s) from a queue, then {len(every)} on all "
          f"GPUs; logs in {args.logs}/. Timings in these notebooks shared the host with other jobs: not reference "
          "timings, not for --stamp-executed.", flush=True)
    start = time.monotonic()
    outcomes = run(one, every, gpus=gpus, logs=args.logs, python=sys.executable,
                   report=lambda line: print(line, flush=True))
    print(summary(outcomes, time.monotonic() - start))
    return 0 if all(o.passed for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
