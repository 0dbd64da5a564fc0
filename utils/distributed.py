"""Training on several GPUs from a notebook: ``torchrun`` launched with a deadline, and what its scripts share.

PyTorch runs data-parallel training as one process per GPU, started by ``torchrun`` (``python -m
torch.distributed.run``), which gives every process its ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``. A notebook
cannot be that process, so notebook 10 keeps its training scripts in ``scripts/`` and launches them:

    run = utils.distributed.launch("ddp_train.py", nproc=2, args=["--device", "cuda"], timeout_s=300)
    run.result            # the JSON the script's rank 0 wrote with write_result()

:func:`launch` streams the processes' output into the notebook line by line, kills the whole process group when
the deadline passes (and says so), and raises :class:`LaunchError` with the line that says what went wrong when a
process fails. The child processes get the notebook's environment unchanged — in particular the variables in
:data:`PASSED_THROUGH`, which keep NVLink multicast switched off on machines that require it — plus only
``OMP_NUM_THREADS`` (if unset), ``PYTHONUNBUFFERED`` and, when asked, ``NCCL_DEBUG``.

Inside a script: :func:`setup` reads the ranks, pins the process to its GPU (``torch.cuda.set_device``), and
joins the process group — NCCL on GPUs, gloo on a CPU — with a short ``timeout``, so that a collective that one
rank never reaches fails with an error instead of hanging; :func:`teardown` leaves it. :func:`collective_bench`
times one thing that contains collectives (every rank must make the same number of calls, which
``utils.bench.bench`` does not guarantee), :func:`interleaved_bench` times several variants of a step in alternating
rounds, and :func:`write_result` hands rank 0's numbers back to the notebook.

Back in the notebook, what a launch timed in the same rounds becomes one ``utils.bench.Comparison``
(:func:`compared`, built with ``Comparison.from_rounds``): one number and one verdict per variant, as everywhere in
the course. :func:`scaling` puts DDP's throughput on several GPUs against one GPU's, from variants of the same
rounds, and :func:`step_verdict` gives a verdict the reason measured in the profiles (:func:`step_parts`,
:func:`step_difference`).

Also here: bus bandwidth of an all-reduce and what the benchmark's rows say (:func:`bus_rate`,
:func:`allreduce_time_s`, :func:`per_call_floor`), the communication/computation overlap in a profile, the bytes
of model state a rank holds, the link between two GPUs as ``nvidia-smi topo -m`` reports it with its specified rate,
and :class:`NcclDigest`, which keeps the few telling lines of ``NCCL_DEBUG=INFO`` output.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import itertools
import json
import math
import os
import queue
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import timeit
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from utils.bench import Comparison, Rate, Timing, Verdict, Work, verdict_from_ratios
from utils.bench import format_seconds as fmt
from utils.profile import assert_not_profiled

ROOT = Path(__file__).resolve().parents[1]
#: Where the course's distributed training scripts live.
SCRIPTS_DIR = ROOT / "scripts"

#: Environment variables that launch() passes to every process exactly as the notebook has them, never set or
#: changed: on shared multi-GPU machines they switch NVLink multicast (NVLS) off, whose use can take GPUs out of
#: service. The course never uses symmetric memory or multicast objects either.
PASSED_THROUGH = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")

#: Extra environment for a run that is meant to fail on a collective's timeout (notebook 10's demonstration and its
#: test). When a collective fails, NCCL's watchdog signals every rank to dump its flight recorder and then sleeps
#: 4 × ``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC`` (15 s by default: a minute) before it ends the process, whether or not
#: a dump was asked for (``Watchdog::runLoop`` in PyTorch's ``torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp``).
#: Here no dump is taken, no collective is recorded for one, and that sleep is cut to 4 × 250 ms = 1 s, so the
#: process ends about a second after the timeout. A real training run keeps the defaults, and its dumps.
FAIL_FAST_NCCL_ENV = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "TORCH_NCCL_TRACE_BUFFER_SIZE": "0",
                      "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "250"}

#: Lines of a failed run that say why it failed, most telling first.
_CAUSES = (re.compile(r"Watchdog caught collective operation timeout.*"),
           re.compile(r"[Tt]imed out.*|[Tt]imeout.*"),
           re.compile(r"\b\w*(Error|Exception): .*"))


class LaunchError(RuntimeError):
    """A launched run failed: its exit code, the line that says why, and its last lines of output."""

    def __init__(self, message: str, *, returncode: int | None, lines: Sequence[str]) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.lines = list(lines)


class LaunchTimeout(LaunchError, TimeoutError):
    """A launched run did not finish before its deadline: every process of it was killed."""


@dataclass
class LaunchResult:
    """What one launch produced: the JSON of rank 0 (``result``), every line of output and the wall time."""

    script: str
    nproc: int
    returncode: int
    lines: list[str]
    result: dict[str, Any] | None
    wall_s: float


# ── Launching ──────────────────────────────────────────────────────────────────────────────────────────────


def child_env(nproc: int, *, nccl_debug: str | None = None, extra: dict[str, str] | None = None,
              parent: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the launched processes: the parent's (default ``os.environ``), unchanged, plus
    ``OMP_NUM_THREADS`` (CPU threads per process, only if the parent has none: this machine's cores shared among
    the ``nproc`` processes), ``PYTHONUNBUFFERED=1`` (lines arrive as they are printed) and ``NCCL_DEBUG`` when
    asked (``"INFO"`` prints how NCCL connects the GPUs; ``"WARN"`` only problems).

    Raises:
        ValueError: if ``extra`` would set one of :data:`PASSED_THROUGH` (they are the machine's to set).
    """
    env = dict(os.environ if parent is None else parent)
    for name in extra or {}:
        if name in PASSED_THROUGH:
            raise ValueError(f"{name} is passed through from the parent environment unchanged; launch() never sets "
                             "it")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(nproc, 1))))
    env["PYTHONUNBUFFERED"] = "1"
    if nccl_debug is not None:
        env["NCCL_DEBUG"] = nccl_debug
    env.update(extra or {})
    return env


def function_source(script: str | Path, name: str) -> str:
    """The source of the top-level function ``name`` of a script in ``scripts/`` (read, not imported: the
    scripts start process groups), for a notebook to show the lines it runs.

    Raises:
        FileNotFoundError: for a script that does not exist. KeyError: for a function it does not define.
    """
    import ast

    path = script_path(script)
    source = path.read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_source_segment(source, node) or ""
    raise KeyError(f"{path.name} defines no function {name!r}")


def torchrun_command(script: str | Path, nproc: int, args: Sequence[str] = ()) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node=N script args``, with this kernel's Python
    (the ``torchrun`` on PATH may belong to another environment). ``--standalone`` runs a single-machine
    rendezvous on a free port, so two runs never collide."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            str(script), *map(str, args)]


def script_path(script: str | Path) -> Path:
    """The file of ``script``: a path, or a name in the course's ``scripts/`` folder; a clear error if neither."""
    path = Path(script)
    if not path.is_absolute() and not path.exists():
        path = SCRIPTS_DIR / path
    if not path.is_file():
        raise FileNotFoundError(f"no script {script!r} (looked in {SCRIPTS_DIR})")
    return path


def _kill_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM to the run's whole process group (torchrun and every rank), then SIGKILL to whatever of it is left
    after ``grace_s`` (a rank may outlive torchrun)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    time.sleep(0.2)  # let the ranks act on the SIGTERM torchrun passed on
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)


def failure_cause(lines: Sequence[str]) -> str | None:
    """The line of a failed run's output that best says why: a collective's timeout first, then any timeout, then
    the last exception a rank printed (torchrun's own summary left aside)."""
    own = ("ChildFailedError", "torch.distributed.elastic")
    for pattern in _CAUSES:
        for line in reversed(lines):
            if any(o in line for o in own):
                continue
            match = pattern.search(line)
            if match:
                return match.group(0).strip()
    return None


#: Kinds of NCCL_DEBUG=INFO lines that say how the GPUs are connected (see :class:`NcclDigest`).
_NCCL_CHANNEL = re.compile(r"Channel (\d+)/\d+ : (\d+)\[\d+\] -> (\d+)\[\d+\] via (\S+)")
_NCCL_KEPT = re.compile(r"NCCL version|NVLS|\bcoll channels\b")


class NcclDigest:
    """A ``launch(echo=...)`` filter for a run with ``NCCL_DEBUG=INFO``: it passes the script's own lines and NCCL's
    warnings, and of NCCL's many INFO lines only those that say how the GPUs are connected, each once: the version,
    what it says about NVLS (NVLink multicast), how many channels it uses, and for every pair of ranks, in each
    direction, the transport of the first channel (e.g. ``0[0] -> 1[1] via P2P/CUMEM``). The lines it showed are
    in ``kept``."""

    def __init__(self) -> None:
        self.kept: list[str] = []
        self._seen: set[object] = set()

    def __call__(self, line: str) -> bool:
        if "NCCL INFO" not in line:
            return True  # the script's own lines, NCCL's warnings, errors
        message = line.split("NCCL INFO", 1)[1].strip()
        channel = _NCCL_CHANNEL.search(message)
        if channel:
            key: object = ("channel", channel.group(2), channel.group(3))  # the first channel of each direction
        elif _NCCL_KEPT.search(message):
            key = message  # the same message from every rank: once
        else:
            return False
        if key in self._seen:
            return False
        self._seen.add(key)
        self.kept.append(line)
        return True


def launch(script: str | Path, nproc: int, args: Sequence[str] = (), *, timeout_s: float = 300.0,
           echo: bool | Callable[[str], bool] = True, nccl_debug: str | None = None,
           extra_env: dict[str, str] | None = None) -> LaunchResult:
    """Run ``script`` (a path, or a name in ``scripts/``) under ``torchrun`` with ``nproc`` processes and return
    what rank 0 reported.

    The script gets ``--result PATH`` appended to ``args``; its rank 0 writes its numbers there with
    :func:`write_result`. Output (stdout and stderr together) is printed line by line as it arrives when
    ``echo`` is True, or for the lines ``echo(line)`` accepts.

    Raises:
        LaunchTimeout: the run was still going after ``timeout_s`` seconds; the whole process group was killed.
        LaunchError: a process failed (the message names the line that says why) or no result was written.
        ValueError: for ``nproc`` < 1 or a non-positive timeout.
    """
    if nproc < 1 or timeout_s <= 0:
        raise ValueError(f"launch(): need nproc >= 1 and timeout_s > 0, got {nproc} and {timeout_s}")
    path = script_path(script)
    out_dir = Path(tempfile.mkdtemp(prefix="course-dist-"))
    result_path = out_dir / "result.json"
    cmd = torchrun_command(path, nproc, [*args, "--result", str(result_path)])
    show = echo if callable(echo) else (lambda line: bool(echo))
    lines: list[str] = []
    start = time.perf_counter()
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                errors="replace", env=child_env(nproc, nccl_debug=nccl_debug, extra=extra_env),
                                cwd=ROOT, start_new_session=True)  # its own process group: killed as one
    except BaseException:
        shutil.rmtree(out_dir, ignore_errors=True)
        raise
    arrived: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            arrived.put(line.rstrip("\n"))
        arrived.put(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = start + timeout_s
        while True:
            try:
                line = arrived.get(timeout=max(0.0, min(0.5, deadline - time.perf_counter())))
            except queue.Empty:
                if time.perf_counter() >= deadline:
                    _kill_group(proc)
                    tail = "\n".join(lines[-15:])
                    raise LaunchTimeout(f"{path.name} with {nproc} processes did not finish within {timeout_s:.0f} s: "
                                        f"every process of it was killed. Last lines:\n{tail}",
                                        returncode=proc.poll(), lines=lines) from None
                continue
            if line is None:
                break
            lines.append(line)
            if show(line):
                print(line, flush=True)
        try:
            returncode = proc.wait(timeout=max(1.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:  # its output closed, but a process lives on past the deadline
            _kill_group(proc)
            raise LaunchTimeout(f"{path.name} with {nproc} processes did not exit within {timeout_s:.0f} s: every "
                                "process of it was killed", returncode=proc.poll(), lines=lines) from None
    except BaseException:  # the deadline, an interrupted kernel, anything: never leave processes behind
        if proc.poll() is None:
            _kill_group(proc)
        shutil.rmtree(out_dir, ignore_errors=True)
        raise
    wall_s = time.perf_counter() - start
    result = json.loads(result_path.read_text()) if result_path.is_file() else None
    shutil.rmtree(out_dir, ignore_errors=True)
    if returncode != 0:
        cause = failure_cause(lines)
        tail = "\n".join(lines[-15:])
        raise LaunchError(f"{path.name} with {nproc} processes failed (exit code {returncode})"
                          + (f": {cause}" if cause else "") + f"\nLast lines:\n{tail}",
                          returncode=returncode, lines=lines)
    if result is None:
        raise LaunchError(f"{path.name} finished but its rank 0 wrote no result (write_result)", returncode=returncode,
                          lines=lines)
    return LaunchResult(path.name, nproc, returncode, lines, result, wall_s)


# ── Inside a script ────────────────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class Context:
    """Who this process is in the run: its rank, the world size, its GPU (or the CPU) and the backend."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def script_arguments(description: str) -> argparse.ArgumentParser:
    """An argument parser with the options every course script takes: ``--device cpu|cuda``, ``--timeout-s``
    (of every collective) and ``--result`` (where rank 0 writes its JSON; launch() passes it)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--timeout-s", type=float, default=120.0,
                        help="a collective that has not completed after this long fails the run")
    parser.add_argument("--result", type=Path, default=None, help="rank 0 writes its results here (JSON)")
    return parser


def setup(device_type: str, *, timeout_s: float = 120.0) -> Context:
    """Join the process group started by torchrun: NCCL on CUDA (after ``torch.cuda.set_device(LOCAL_RANK)``),
    gloo on a CPU, with ``timeout`` = ``timeout_s`` for every collective.

    Raises:
        RuntimeError: when not started by torchrun (no RANK/WORLD_SIZE/LOCAL_RANK), or when this process's
            LOCAL_RANK has no GPU of its own.
        ValueError: for a device type other than 'cpu' or 'cuda'.
    """
    missing = [v for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if v not in os.environ]
    if missing:
        raise RuntimeError(f"{', '.join(missing)} not set: start this script with torchrun, e.g. "
                           "`python -m torch.distributed.run --nproc-per-node=2 scripts/<script>.py`")
    rank, world, local_rank = (int(os.environ[v]) for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    timeout = datetime.timedelta(seconds=timeout_s)
    if device_type == "cuda":
        if not torch.cuda.is_available() or local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK {local_rank} needs GPU {local_rank}, but this process sees "
                               f"{torch.cuda.device_count()} GPU(s): launch at most that many processes")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # before anything touches the GPU: every rank on its own GPU
        torch.distributed.init_process_group("nccl", timeout=timeout, device_id=device)
    elif device_type == "cpu":
        device = torch.device("cpu")
        torch.distributed.init_process_group("gloo", timeout=timeout)
    else:
        raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
    return Context(rank, world, local_rank, device, torch.distributed.get_backend())


def native_bf16(device: torch.device) -> bool:
    """True for a GPU with bf16 arithmetic in hardware (Ampere, compute capability 8.0, and later).
    ``torch.cuda.is_bf16_supported()`` also says yes where bf16 is only emulated (e.g. a T4), and slow."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def teardown() -> None:
    """Leave the process group (a clean shutdown: NCCL otherwise warns that resources may leak)."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def log(ctx: Context, message: str, *, all_ranks: bool = False) -> None:
    """Print ``message`` from rank 0 (or from every rank, prefixed with it), flushed at once."""
    if all_ranks:
        print(f"[rank {ctx.rank}] {message}", flush=True)
    elif ctx.is_main:
        print(message, flush=True)


def write_result(ctx: Context, path: str | Path | None, payload: dict[str, Any]) -> None:
    """The end of a script's work, called by every rank: rank 0 writes ``payload`` as JSON to ``path``
    (atomically: a reader never sees half a file), then all ranks wait for each other, so that none leaves the
    process group while another still talks to it (a rank whose peer has gone can abort at exit)."""
    if path is not None and ctx.is_main:
        path = Path(path)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(payload, indent=1))
        tmp.replace(path)
    torch.distributed.barrier()


def timing_to_dict(timing: Timing) -> dict[str, Any]:
    """A :class:`utils.bench.Timing` as JSON-able data (:func:`timing_from_dict` reverses it)."""
    return dataclasses.asdict(timing)


def timing_from_dict(data: dict[str, Any]) -> Timing:
    """The :class:`utils.bench.Timing` a script reported (one rate or cost; comparisons of variants timed in the same
    rounds come from their block times: :func:`compared`)."""
    return Timing(**{**data, "block_times_s": tuple(data["block_times_s"])})


def _agree(value: float, ctx: Context, op=None) -> float:
    """The max (or ``op``) of ``value`` over all ranks."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=ctx.device)
    torch.distributed.all_reduce(t, op=op or torch.distributed.ReduceOp.MAX)
    return float(t.item())


def collective_bench(fn: Callable[[], object], ctx: Context, *, label: str, warmup: int = 3,
                     min_run_time: float = 0.5, min_blocks: int = 5) -> Timing:
    """Per-call time of ``fn()`` on every rank, as ``utils.bench.bench`` measures it (blocks of calls, device
    synchronised at the block boundaries, median and IQR over the blocks), for work that contains collectives.

    Every rank must make the same number of calls or one of them waits forever in a collective the others never
    join: the calls per block are agreed among the ranks (the largest any rank wants), the ranks start every block
    together (a barrier, outside the timed region), and rank 0 decides when enough blocks are measured. For one
    thing (a rate, a cost); variants to compare are timed together by :func:`interleaved_bench`.

    Raises:
        utils.profile.ProfiledProcessError: when a profiler session already ran in this process.
    """
    if warmup < 0 or min_run_time <= 0 or min_blocks < 1:
        raise ValueError("collective_bench(): need warmup >= 0, min_run_time > 0, min_blocks >= 1")
    assert_not_profiled("utils.distributed.collective_bench")

    def sync() -> None:
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)

    for _ in range(warmup):
        fn()
    sync()
    torch.distributed.barrier()
    start = timeit.default_timer()
    fn()
    sync()
    one_call_s = max(_agree(timeit.default_timer() - start, ctx), 1e-7)
    block = max(1, math.ceil(min_run_time / min_blocks / one_call_s))
    times: list[float] = []
    while True:
        torch.distributed.barrier()
        start = timeit.default_timer()
        for _ in range(block):
            fn()
        sync()
        times.append((timeit.default_timer() - start) / block)
        more = len(times) < min_blocks or sum(times) * block < min_run_time
        if not _agree(float(more) if ctx.is_main else 0.0, ctx):
            break
    q1, q3 = (statistics.quantiles(times, n=4, method="inclusive")[::2] if len(times) >= 2
              else (times[0], times[0]))
    return Timing(label=label, median_s=statistics.median(times), iqr_s=q3 - q1, block_times_s=tuple(times),
                  calls_per_block=block, device=str(ctx.device))


def interleaved_bench(builders: dict[str, Callable[[], Callable[[], object]]], ctx: Context, *, rounds: int = 5,
                      warmup: int = 3, block_s: float | Mapping[str, float] = 0.25,
                      measure: Callable[[str, Callable[[], object], Timing], dict[str, Any]] | None = None,
                      ) -> tuple[dict[str, Timing], dict[str, dict[str, Any]]]:
    """Per-call time of several variants of a step (work that may contain collectives), in alternating rounds: the
    protocol of ``utils.bench.compare`` for work that every rank of a launch must run together.

    ``builders[label]()`` builds a variant afresh (its model, optimizer, ...) and returns its step function. In each
    of ``rounds`` rounds every variant is built, warmed up (``warmup`` calls) and timed for one block of calls; the
    order rotates from round to round and the variant is released before the next is built, so only one lives at a
    time. Whatever drifts while the rounds run — clocks, the host's other work, the allocator's state — then falls
    on every variant alike, and round ``i`` of one variant pairs with round ``i`` of another: the block times of
    the Timings returned are those rounds, ready for ``utils.bench.Comparison.from_rounds`` (:func:`compared`).
    The calls per block are fixed in the first round (about ``block_s`` seconds, the largest any rank wants;
    ``block_s`` may also map every label to its own, e.g. longer blocks for a variant of long steps). The ranks start
    every block together and wait for each other after it, so a rank that sits a variant out (its step does
    nothing: e.g. DDP on a group of fewer ranks) idles while the others are timed. On a GPU a garbage collection
    after each variant returns its memory to the allocator even if part of it hangs in a reference cycle.

    ``measure(label, step, timing)``, if given, runs after all the rounds, in a pass of its own: every variant is
    built once more, warmed up and handed over with its :class:`~utils.bench.Timing` (every rank calls it: it may
    profile the step). No timed block follows it, so a profiler session there cannot slow what is timed
    (``utils.profile.profile_steps``: a finished session can slow host-bound code for the rest of the process).
    What it returns is collected per label.

    Returns: ``({label: Timing}, {label: measure's dict})``.

    Raises:
        utils.profile.ProfiledProcessError: when a profiler session already ran in this process.
    """
    blocks = {label: block_s for label in builders} if not isinstance(block_s, Mapping) else dict(block_s)
    if not builders or rounds < 1 or warmup < 0 or set(blocks) != set(builders) or min(blocks.values()) <= 0:
        raise ValueError("interleaved_bench(): need at least one builder, rounds >= 1, warmup >= 0 and block_s > 0 "
                         "(for every label when given per label)")
    assert_not_profiled("utils.distributed.interleaved_bench")

    def sync() -> None:
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)

    labels = list(builders)
    calls: dict[str, int] = {}
    times: dict[str, list[float]] = {label: [] for label in labels}
    extras: dict[str, dict[str, Any]] = {}
    for round_ in range(rounds):
        shift = round_ % len(labels)
        for label in labels[shift:] + labels[:shift]:
            step = builders[label]()
            for _ in range(warmup):
                step()
            sync()
            if label not in calls:  # first round: how many calls make a block
                torch.distributed.barrier()
                start = timeit.default_timer()
                step()
                sync()
                one_call_s = max(_agree(timeit.default_timer() - start, ctx), 1e-7)
                calls[label] = max(1, math.ceil(blocks[label] / one_call_s))
            torch.distributed.barrier()
            start = timeit.default_timer()
            for _ in range(calls[label]):
                step()
            sync()
            times[label].append((timeit.default_timer() - start) / calls[label])
            torch.distributed.barrier()  # a rank that sat this variant out waits here, idle, while the others run
            del step
            if ctx.device.type == "cuda":  # its memory goes before the next variant is built, even if in a cycle
                gc.collect()
    out = {}
    for label in labels:
        t = times[label]
        q1, q3 = statistics.quantiles(t, n=4, method="inclusive")[::2] if len(t) >= 2 else (t[0], t[0])
        out[label] = Timing(label=label, median_s=statistics.median(t), iqr_s=q3 - q1, block_times_s=tuple(t),
                            calls_per_block=calls[label], device=str(ctx.device))
    for label in labels if measure is not None else ():  # after every timed block: profiles slow nothing timed
        step = builders[label]()
        for _ in range(warmup):
            step()
        sync()
        torch.distributed.barrier()
        extras[label] = measure(label, step, out[label])
        del step
        if ctx.device.type == "cuda":
            gc.collect()
    return out, extras


# ── What the numbers mean ──────────────────────────────────────────────────────────────────────────────────


def allreduce_bus_factor(world_size: int) -> float:
    """Bus bandwidth / algorithm bandwidth of an all-reduce over ``world_size`` ranks: 2(n−1)/n, the share of
    the data each rank must send and receive in a ring all-reduce (nccl-tests' convention), so that bus
    bandwidth can be put against a link's speed whatever the number of ranks."""
    if world_size < 2:
        raise ValueError(f"an all-reduce needs at least 2 ranks to move data, got {world_size}")
    return 2 * (world_size - 1) / world_size


def _intervals(kernels: Iterable[Any]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted((k.start_us, k.start_us + k.duration_us) for k in kernels):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _overlap_us(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


#: Names of communication kernels and operators: NCCL's kernels on a GPU (``ncclDevKernel_AllReduce_...``,
#: ``ncclKernel_...``), gloo's and c10d's operators on a CPU. Nothing broader: a GEMM epilogue may well be called
#: "...broadcast...".
COMMUNICATION = re.compile(r"^nccl|gloo:|c10d::")


def communication_overlap(kernels: Iterable[Any], steps: int = 1) -> dict[str, float]:
    """How much of the communication ran while computation ran, from a profile's kernels (objects with
    ``name``, ``start_us`` and ``duration_us``, e.g. ``utils.profile.StepProfile.kernels``).

    Returns per step: ``comm_s`` (union of the communication kernels' intervals), ``compute_s`` (union of the
    others), ``overlapped_s`` (both at once), ``exposed_s`` (communication alone: the time it adds to the step)
    and ``overlap_fraction`` (overlapped / comm; NaN without communication).
    """
    kernels = list(kernels)
    comm = _intervals(k for k in kernels if COMMUNICATION.search(k.name))
    compute = _intervals(k for k in kernels if not COMMUNICATION.search(k.name))
    comm_us = sum(e - s for s, e in comm)
    overlapped_us = _overlap_us(comm, compute)
    per = 1e-6 / max(steps, 1)
    return {"comm_s": comm_us * per, "compute_s": sum(e - s for s, e in compute) * per,
            "overlapped_s": overlapped_us * per, "exposed_s": (comm_us - overlapped_us) * per,
            "overlap_fraction": overlapped_us / comm_us if comm_us > 0 else math.nan}


@dataclass(frozen=True)
class StepParts:
    """What one step's time consists of, from a timed step and a profile of it: ``compute_s`` (some kernel other
    than communication runs), ``exposed_s`` (only communication runs: the all-reduce that computation does not
    hide, waiting for the slower rank included) and ``idle_s`` (nothing runs: the device waits for the host to
    give it work — Python, the framework's bookkeeping, kernel launches). On a CPU the "kernels" are PyTorch's
    operators and ``idle_s`` is the time between them.

    ``representative`` is False when the profiled steps did something other than the timed ones (see
    :func:`step_parts`); then ``why`` says what, and the split is not shown. ``comm_calls``: communication
    kernels (on a CPU, operators) per profiled step, where known."""

    step_s: float
    compute_s: float
    exposed_s: float
    idle_s: float
    on_gpu: bool
    representative: bool = True
    why: str = ""
    comm_calls: float | None = None

    def names(self) -> dict[str, str]:
        if self.on_gpu:
            return {"idle_s": "GPU idle (waiting for the host to issue work)",
                    "exposed_s": "communication not hidden by computation (waiting for the other rank included)",
                    "compute_s": "computation"}
        return {"idle_s": "time between PyTorch's operators (Python, DDP's hooks)",
                "exposed_s": "communication outside the operators", "compute_s": "time in operators"}

    def __str__(self) -> str:
        if not self.representative:
            return f"step {fmt(self.step_s)}: {self.why}"
        names = self.names()
        return f"step {fmt(self.step_s)}: " + ", ".join(
            f"{names[k]} {fmt(getattr(self, k))} ({getattr(self, k) / self.step_s:.0%})"
            for k in ("compute_s", "exposed_s", "idle_s"))


#: How much busier than the timed step its profiled steps may keep the device and still split it (kernels run a
#: little longer under the profiler); busier than that, the profiled steps did something the timed ones did not.
BUSY_TOLERANCE = 0.05
#: Exposed communication beyond this many times what its bytes need on the link (at the bandwidth measured for
#: messages of that size) is waiting for the other rank, not transfer.
EXPOSED_LIMIT = 2.0


def step_parts(profile: dict[str, float], step_s: float, *, on_gpu: bool,
               transfer_s: float | None = None) -> StepParts:
    """Split a step of ``step_s`` (timed without the profiler) into computation, exposed communication and idle
    time, from the per-step ``compute_s`` and ``exposed_s`` of :func:`communication_overlap` on its profile. Idle is
    the rest of the step.

    The profile and the timing are separate runs, and under the profiler the ranks can fall out of step: a
    communication kernel then spins until the lagging rank joins, and counts as exposed communication that the timed
    steps never had. So the split is marked not representative (and not shown) when the profiled steps kept the
    device busier than the timed step is long, by more than :data:`BUSY_TOLERANCE`, or when their exposed
    communication exceeds :data:`EXPOSED_LIMIT` × ``transfer_s``, the time the step's all-reduced bytes need at the
    measured bandwidth (:func:`allreduce_time_s`; None or 0: not checked). Within the tolerance, a profile busier
    than the step keeps its proportions and fills the step (idle 0), so that the three parts add up to ``step_s``.
    The profile's ``comm_calls_per_step``, if it has one, is kept as ``comm_calls``.
    """
    parts = _step_parts(profile, step_s, on_gpu=on_gpu, transfer_s=transfer_s)
    return dataclasses.replace(parts, comm_calls=profile.get("comm_calls_per_step"))


def _step_parts(profile: dict[str, float], step_s: float, *, on_gpu: bool, transfer_s: float | None) -> StepParts:
    compute, exposed = profile["compute_s"], profile["exposed_s"]
    busy = compute + exposed
    why = None
    if busy > (1 + BUSY_TOLERANCE) * step_s:
        why = f"the device was busy {fmt(busy)} per profiled step, more than the whole timed step"
    elif transfer_s and exposed > EXPOSED_LIMIT * transfer_s:
        why = (f"{fmt(exposed)} of exposed communication per profiled step, more than {EXPOSED_LIMIT:g}× the "
               f"{fmt(transfer_s)} its bytes need at the measured bandwidth")
    if why:
        why = ("the profiled steps are not representative of the timed step (ranks out of step under the profiler: "
               f"{why}): split not shown")
        return StepParts(step_s, compute, exposed, max(0.0, step_s - busy), on_gpu, representative=False, why=why)
    if busy > step_s:
        return StepParts(step_s, compute * step_s / busy, exposed * step_s / busy, 0.0, on_gpu)
    return StepParts(step_s, compute, exposed, step_s - busy, on_gpu)


def _changes(base: StepParts, other: StepParts) -> dict[str, float]:
    return {k: getattr(other, k) - getattr(base, k) for k in ("idle_s", "exposed_s", "compute_s")}


#: A part of the step is named as what moved it only when its change, in the direction the whole step moved, is at
#: least this many times the next part's in that direction; otherwise the change is split between them.
DOMINANT = 2.0


def _moved_most(base: StepParts, other: StepParts) -> list[str]:
    """The parts (keys of :func:`_changes`) by how far they moved in the direction the whole step moved, most
    first."""
    changes = _changes(base, other)
    sign = 1.0 if other.step_s >= base.step_s else -1.0
    return sorted(changes, key=lambda k: -sign * changes[k])


def main_change(base: StepParts, other: StepParts, *, within_noise: bool = False) -> str | None:
    """The name of the part of the step that moved most in the direction the whole step moved from ``base`` to
    ``other`` (what made it longer, or shorter), when it clearly dominates: its change in that direction is at least
    :data:`DOMINANT` × the next part's. None when no part dominates (the change is split), when either split is not
    representative, or when ``within_noise`` — the caller's comparison of the two steps' timings found no difference
    beyond the noise, so no part's share of that difference is a cause to name."""
    if within_noise or not (base.representative and other.representative):
        return None
    changes = _changes(base, other)
    sign = 1.0 if other.step_s >= base.step_s else -1.0
    first, second = _moved_most(base, other)[:2]
    if sign * changes[first] <= 0 or sign * changes[first] < DOMINANT * max(sign * changes[second], 0.0):
        return None
    return base.names()[first]


def step_difference(base: StepParts, other: StepParts, *, within_noise: bool = False) -> str:
    """Where the time went between two steps: 'the step is 2.5 ms longer (13.2 ms → 15.7 ms): GPU idle (waiting
    for the host to issue work) +2.0 ms, communication not hidden by computation (waiting for the other rank
    included) +0.5 ms, computation +0.0 ms — mostly GPU idle (...)': every part's change, largest first, then
    :func:`main_change` as the cause — or, where no part dominates, the two that moved most in the step's direction
    ('split between …'), and where ``within_noise`` (the two steps' timings differ by no more than the noise), no
    cause at all. When either split is not representative, the step's change, which of the two steps' profile did
    not fit (named by its time) and why the split is not shown."""
    delta = other.step_s - base.step_s
    head = (f"the step is {fmt(abs(delta))} {'longer' if delta >= 0 else 'shorter'} ({fmt(base.step_s)} → "
            f"{fmt(other.step_s)})")
    calls = ""  # on a GPU only: on a CPU, gloo's work for DDP runs in threads the profiler does not see
    if base.on_gpu and None not in (base.comm_calls, other.comm_calls) and round(base.comm_calls) != round(
            other.comm_calls):
        calls = f"; {other.comm_calls:.0f} communication calls per step instead of {base.comm_calls:.0f}"
    unrepresentative = next((p for p in (other, base) if not p.representative), None)
    if unrepresentative is not None:
        return f"{head}; the {fmt(unrepresentative.step_s)} step's profile: {unrepresentative.why}{calls}"
    names = base.names()
    changes = _changes(base, other)
    listed = ", ".join(f"{names[k]} {'+' if changes[k] >= 0 else '−'}{fmt(abs(changes[k]))}"
                       for k in sorted(changes, key=lambda k: -abs(changes[k])))
    if within_noise:
        return f"{head}: {listed} — the step's change is within the noise: no part is named as its cause{calls}"
    main = main_change(base, other)
    if main is not None:
        return f"{head}: {listed} — mostly {main}{calls}"
    first, second = _moved_most(base, other)[:2]
    return (f"{head}: {listed} — no part dominates (in the step's direction, the largest change is under "
            f"{DOMINANT:g}× the next): split between {names[first]} and {names[second]}{calls}")


def allreduce_time_s(rows: Sequence[dict[str, Any]], nbytes: float, messages: float = 1) -> tuple[float, dict | None]:
    """Seconds that all-reducing ``nbytes`` in ``messages`` messages of equal size takes at the algorithm bandwidth
    that ``scripts/allreduce_bench.py`` measured (its ``rows``) for the message size nearest to nbytes / messages
    (nearest on a log scale: the rows go up ×4), and that row. ``(0.0, None)`` for no bytes.

    Raises:
        ValueError: without rows to read the bandwidth from.
    """
    if nbytes <= 0:
        return 0.0, None
    if not rows:
        raise ValueError("allreduce_time_s(): need the all-reduce benchmark's rows")
    size = nbytes / max(messages, 1)
    row = min(rows, key=lambda r: abs(math.log(r["bytes"] / size)))
    return nbytes / (row["alg_gbps"] * 1e9), row


def per_call_floor(rows: Sequence[dict[str, Any]], *, on_gpu: bool = True) -> str:
    """What the nearly flat time of small all-reduces says, from the rows of ``scripts/allreduce_bench.py``
    (wall-clock time per call, calls back to back), as a phrase. The smallest message's time is the floor, and the
    flat region runs up to the largest message that takes at most twice that. A fixed latency before each transfer
    would add to it: that message would take about the floor plus its transfer time (at the best bandwidth
    measured; a little less, since that bandwidth and the floor include some of each other). If it takes less than
    the floor plus half its transfer time, most of the transfer overlapped the floor, which therefore is not a
    latency before the transfer: on GPUs it is the host's time to issue each call (PyTorch's and NCCL's work), while
    the GPUs finish the previous one. Otherwise the times are consistent with a fixed cost before each transfer,
    which a wall-clock timing cannot place on the host or the device. A message of the flat region faster than the
    floor itself (the last one or any before it) says only that the cost per call is not one fixed amount: no fixed
    cost fits both times, and the rows cannot tell a latency from work per call.

    Raises:
        ValueError: for fewer than two rows.
    """
    from utils.memory import format_bytes

    if len(rows) < 2:
        raise ValueError("per_call_floor(): need at least two message sizes")
    floor = rows[0]["timing"]["median_s"]
    flat = list(itertools.takewhile(lambda r: r["timing"]["median_s"] <= 2 * floor, rows))
    end = flat[-1]
    said = f"{fmt(floor)} for {format_bytes(rows[0]['bytes'])}"
    if end is rows[0]:
        return (said + f", and {format_bytes(rows[1]['bytes'])} already takes more than twice that: no flat region "
                "to read a fixed cost per call from")
    best = max(rows, key=lambda r: r["alg_gbps"])
    transfer = end["bytes"] / (best["alg_gbps"] * 1e9)
    took = end["timing"]["median_s"]
    hidden = floor + transfer - took  # how much of the transfer the floor hid
    said += (f", at most twice that up to {format_bytes(end['bytes'])}, which takes {fmt(took)}: "
             f"{fmt(abs(hidden))} {'less' if hidden >= 0 else 'more'} than those {fmt(floor)} plus the "
             f"{fmt(transfer)} its bytes need at the best bandwidth measured ({best['alg_gbps']:,.3g} GB/s)")
    fastest = min(flat[1:], key=lambda r: r["timing"]["median_s"])  # a message of the flat region below the floor
    if fastest["timing"]["median_s"] < floor:
        which = ("" if fastest is end else
                 f" but {format_bytes(fastest['bytes'])} took {fmt(fastest['timing']['median_s'])},")
        return said + (f" —{which} less than the floor itself: no fixed cost per call fits both times (the cost per "
                       "call varies from one size to the next), so these times cannot tell a latency before the "
                       "transfer from work per call")
    if hidden < transfer / 2:
        return said + (" — consistent with a fixed cost before each transfer, which a wall-clock timing cannot place "
                       "on the host or the device")
    if on_gpu:
        return said + (", so most of the transfer overlapped the fixed cost: it is not a latency of the link before "
                       "the transfer but the host's time to issue each call (PyTorch's and NCCL's work), during which "
                       "the GPUs finish the previous one")
    return said + (", so most of the transfer overlapped the fixed cost: it is work per call beside the transfer "
                   "(gloo's and PyTorch's), not a latency before it")


def bus_rate(row: Mapping[str, Any]) -> Rate:
    """The bus bandwidth of one row of ``scripts/allreduce_bench.py`` as a :class:`utils.bench.Rate`, its band from
    the quartiles of the row's timing: ready to record (``bus_rate(row).record("allreduce_busbw_gbps")``)."""
    from utils.memory import format_bytes

    return Rate(f"all-reduce bus bandwidth, {format_bytes(row['bytes'])} messages", row["bus_gbps"], "GB/s",
                timing_from_dict(row["timing"]))


# ── Comparisons of what a launch timed ─────────────────────────────────────────────────────────────────────


def compared(variants: Mapping[str, Mapping[str, Any]], names: Mapping[str, str] | Sequence[str],
             **options: Any) -> Comparison:
    """The :class:`utils.bench.Comparison` of variants that one launch timed in the same alternating rounds
    (:func:`interleaved_bench`, whose ``timing`` has one block per round), as ``utils.bench.compare`` would have
    timed them in one process: one number and one verdict per variant.

    ``variants``: what the script reported per variant (each with its ``timing``, :func:`timing_to_dict`).
    ``names``: the variants to compare, as a list of their keys or a mapping from the name to show to the key; the
    first is the baseline. ``options`` go to :meth:`utils.bench.Comparison.from_rounds` (``title``, ``resolution``,
    ``work``, ...).

    Raises:
        KeyError: for a variant the launch did not time. ValueError: as ``from_rounds`` (e.g. unequal rounds).
    """
    names = dict(names) if isinstance(names, Mapping) else {key: key for key in names}
    missing = [key for key in names.values() if key not in variants]
    if missing:
        raise KeyError(f"compared(): the launch timed no {missing}; it timed {list(variants)}")
    first = variants[next(iter(names.values()))]["timing"]
    return Comparison.from_rounds({shown: variants[key]["timing"]["block_times_s"] for shown, key in names.items()},
                                  device=first["device"], **options)


def scaling(variants: Mapping[str, Mapping[str, Any]], *, at: str = "", unit: str = "GPU",
            **options: Any) -> Comparison:
    """Data-parallel throughput against one GPU (``unit``: what to call it, e.g. "process" on a CPU) at the same batch
    per GPU, from four variants of
    ``scripts/ddp_train.py`` timed in the same rounds (``at``: their batch suffix, e.g. ``"@32"``): the plain model
    on one GPU (the baseline; the other ranks idle), the plain model on all GPUs at once without communication, DDP
    on one GPU (a process group of its own) and DDP on all of them.

    Each variant's time is put per batch of one GPU — its step divided by the GPUs that share the work — with
    tokens/s as its rate, so that every speed-up is a ratio of throughputs. DDP on n GPUs against one GPU is the
    scaling (speed-up / n is the scaling efficiency). The plain model on all GPUs at once shows what merely sharing
    the machine costs (n× would be nothing); DDP on one GPU what DDP's own work costs (its hooks, the copies into
    its buckets, an all-reduce over one rank).

    Raises:
        KeyError: for a variant the launch did not time. ValueError: where the variants ran on other numbers of
            ranks than these four need.
    """
    keys = [f"plain{at}:1", f"plain{at}", f"ddp{at}:1", f"ddp{at}"]
    missing = [key for key in keys if key not in variants]
    if missing:
        raise KeyError(f"scaling(): the launch timed no {missing}; it timed {list(variants)}")
    ranks = {key: variants[key]["ranks"] for key in keys}
    n = ranks[f"ddp{at}"]
    if n < 2 or list(ranks.values()) != [1, n, 1, n]:
        raise ValueError(f"scaling(): need plain and DDP on one rank and on n >= 2 ranks, got {ranks}")
    units = unit + ("es" if unit.endswith("s") else "s")
    shown = dict(zip([f"plain, 1 {unit}", f"plain, {n} {units} at once (no communication)", f"DDP, 1 {unit}",
                      f"DDP, {n} {units}"], keys, strict=True))
    per_batch = {name: [t / variants[key]["ranks"] for t in variants[key]["timing"]["block_times_s"]]
                 for name, key in shown.items()}
    one = variants[f"plain{at}:1"]
    return Comparison.from_rounds(per_batch, work=Work(one["tokens_per_rank"], "tokens"),
                                  device=one["timing"]["device"], **options)


def efficiency_difference(larger: Comparison, smaller: Comparison, *,
                          names: tuple[str, str] = ("at the larger batch", "at the smaller batch")) -> Verdict:
    """Whether DDP scaled better at one batch per GPU than at another, from two :func:`scaling` comparisons of one
    launch (the same rounds): round by round, the speed-up of its last variant over one GPU at the larger batch
    divided by that at the smaller — the ratio of the two scaling efficiencies — as a :class:`utils.bench.Verdict`
    named ``names``: "faster", the larger batch scaled better; "slower", the smaller one did; "same", neither by more
    than the resolution; else "inconclusive".

    Raises:
        ValueError: for comparisons of different numbers of rounds.
    """
    a, b = larger.ratios(larger.variants[-1]), smaller.ratios(smaller.variants[-1])
    if len(a) != len(b):
        raise ValueError(f"efficiency_difference(): the comparisons must share their rounds, got {len(a)} and {len(b)}")
    return verdict_from_ratios(*names, [x / y for x, y in zip(a, b, strict=True)], resolution=larger.resolution)


def parts_of(variants: Mapping[str, Any], rows: Sequence[dict[str, Any]] | None = None, *,
             on_gpu: bool) -> dict[str, StepParts]:
    """:func:`step_parts` of every variant a script profiled (its ``profile`` not None), against its timed step. With
    the all-reduce benchmark's ``rows``, a variant's exposed communication is also put against what its
    ``allreduce_bytes`` need at the bandwidth measured (:func:`allreduce_time_s`)."""
    out = {}
    for key, entry in variants.items():
        if not isinstance(entry, Mapping) or not entry.get("profile"):
            continue
        profile, transfer_s = entry["profile"], None
        if rows and entry.get("allreduce_bytes"):
            transfer_s = allreduce_time_s(rows, entry["allreduce_bytes"], profile["comm_calls_per_step"] or 1)[0]
        out[key] = step_parts(profile, entry["timing"]["median_s"], on_gpu=on_gpu, transfer_s=transfer_s)
    return out


def step_verdict(verdict: Verdict, base: StepParts | None = None, other: StepParts | None = None, *,
                 acts_on: tuple[str, float] | None = None) -> str:
    """``verdict`` — a variant's step against the baseline's (:func:`compared`) — with the reason measured for the
    outcome it has (``Verdict.explain``), so that the reason printed always matches the result:

    * faster or slower: what moved in the step, part by part (:func:`step_difference` of the profiles' splits
      ``base`` and ``other``; left out where the two timed steps moved the other way than the paired rounds say);
    * same: where ``acts_on`` — what the variant can change and its seconds per step, e.g. ``("the exposed
      communication", 0.4e-3)`` — is within the resolution of the baseline's step, that bound (an effect that small
      cannot show); otherwise the parts' changes, with no cause named;
    * inconclusive: the bound, as what was at stake, and no cause.

    Without splits (steps not profiled) only the bound is given; without either, the verdict alone.
    """
    bound, small = None, False
    if acts_on is not None and base is not None:
        what, seconds = acts_on[0], max(acts_on[1], 0.0)
        share = seconds / base.step_s
        bound = f"it acts on {what}: {fmt(seconds)} per step, {share:.0%} of the step"
        small = share <= verdict.resolution
    moved = quiet = None
    if base is not None and other is not None:
        quiet = step_difference(base, other, within_noise=True)
        if (other.step_s < base.step_s) == (verdict.speedup > 1):
            moved = step_difference(base, other)
    return verdict.explain(faster=moved, slower=moved, same=bound if small else quiet, inconclusive=bound)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor shard: the part this rank holds


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state that this rank holds (for FSDP's sharded DTensors,
    only the local shard): what sharding divides by the number of ranks. Activations are not included."""
    params = list(model.parameters())
    out = {"parameters": sum(_local(p).nbytes for p in params),
           "gradients": sum(_local(p.grad).nbytes for p in params if p.grad is not None), "optimizer": 0}
    if optimizer is not None:
        for state in optimizer.state.values():
            out["optimizer"] += sum(_local(v).nbytes for v in state.values()
                                    if isinstance(v, torch.Tensor) and v.dim() > 0)
    out["total"] = out["parameters"] + out["gradients"] + out["optimizer"]
    return out


def peak_beyond_state(ddp: dict[str, Any], fsdp: dict[str, Any], *, same_within: float = 0.1) -> str:
    """What the peak memory of DDP and of FSDP2 holds beyond the model state, from the ``peak_bytes`` and
    ``state_bytes["total"]`` of each (per rank, as ``scripts/fsdp_train.py`` reports them): both amounts, their
    ratio, and what it says — smaller too, about the same (within ``same_within``) or larger with FSDP2.

    Raises:
        ValueError: without a measured peak (on a CPU) or with a peak below the state it includes.
    """
    from utils.memory import format_bytes

    rest = {}
    for kind, m in (("DDP", ddp), ("FSDP2", fsdp)):
        if not m.get("peak_bytes") or m["peak_bytes"] < m["state_bytes"]["total"]:
            raise ValueError(f"peak_beyond_state(): {kind}'s peak ({m.get('peak_bytes')}) must be measured and include "
                             f"its state ({m['state_bytes']['total']} bytes)")
        rest[kind] = m["peak_bytes"] - m["state_bytes"]["total"]
    ratio = rest["FSDP2"] / rest["DDP"] if rest["DDP"] else math.inf
    if ratio < 1 - same_within:
        what = "smaller too, so sharding saved more than the state it divides"
    elif ratio <= 1 + same_within:
        what = "about the same: sharding divided the state, not the rest"
    else:
        what = "larger, which takes back part of what sharding the state saved"
    return (f"the rest of the peak (activations, temporaries, DDP's gradient buckets or FSDP2's gathered layers) is "
            f"{format_bytes(rest['DDP'])} with DDP and {format_bytes(rest['FSDP2'])} with FSDP2 ({ratio:.2f}×): "
            f"{what}")


def batch_for_memory(total_bytes: int, *, fixed_bytes: float, per_item_bytes: float,
                     choices: Sequence[int] = (128, 64, 32), share: float = 0.5) -> int:
    """The largest batch of ``choices`` whose estimated memory, ``fixed_bytes + per_item_bytes × batch``, fits in
    ``share`` of a device's ``total_bytes``; the smallest choice if none does."""
    if not choices or total_bytes <= 0 or not 0 < share <= 1:
        raise ValueError("batch_for_memory(): need choices, a positive total and 0 < share <= 1")
    for batch in sorted(choices, reverse=True):
        if fixed_bytes + per_item_bytes * batch <= share * total_bytes:
            return batch
    return min(choices)


# ── How the GPUs are connected ─────────────────────────────────────────────────────────────────────────────


#: A terminal control sequence (ESC [ parameters final-byte), such as the underline ``\x1b[4m`` … ``\x1b[0m``.
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")


def gpu_topology(timeout_s: float = 10.0) -> str | None:
    """``nvidia-smi topo -m``: the matrix of how every pair of GPUs is connected, as plain text (terminal escape
    sequences removed), or None without nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=timeout_s, check=True)
    except (subprocess.SubprocessError, OSError):
        return None
    return _ANSI_ESCAPE.sub("", out.stdout)  # nvidia-smi underlines the header with terminal escapes, even in a pipe


#: What the entries of ``nvidia-smi topo -m`` mean (its own legend, abbreviated).
TOPOLOGY_LEGEND = {
    "NV": "NVLink: NV<n> is a bonded set of n links",
    "PIX": "PCIe, through at most one PCIe bridge",
    "PXB": "PCIe, through several PCIe bridges (no host bridge)",
    "PHB": "PCIe, through a host bridge (the CPU)",
    "NODE": "PCIe and the interconnect between host bridges inside one NUMA node",
    "SYS": "PCIe and the interconnect between NUMA nodes (e.g. UPI/QPI between sockets)",
}


def link_between(topology: str, a: int = 0, b: int = 1) -> str | None:
    """The entry of ``nvidia-smi topo -m`` for GPUs ``a`` and ``b`` ('NV18', 'PIX', 'SYS', ...), or None."""
    rows = [_ANSI_ESCAPE.sub("", line).split() for line in topology.splitlines()]
    header = next((r for r in rows if r and r[0] == "GPU0"), None)  # the header row starts with the first column
    row = next((r for r in rows if r and r[0] == f"GPU{a}" and r is not header), None)
    if header is None or row is None or f"GPU{b}" not in header:
        return None
    column = header.index(f"GPU{b}") + 1
    return row[column] if column < len(row) else None


#: NVLink GB/s per link and direction, by the GPU's compute capability (major, minor): NVLink 1 on Pascal's GP100;
#: NVLink 2 on Volta and Turing, NVLink 3 on the A100, NVLink 4 on Hopper (25 GB/s per link and direction; e.g.
#: H100/H200 SXM: 18 links, 450 GB/s each way, "900 GB/s" bidirectional in NVIDIA's datasheets); NVLink 5 on
#: Blackwell's B200 and B300 (50 GB/s). GA102 (sm_86: RTX 3090, RTX A6000, A40) has NVLink 3 links of its own
#: kind: "four x4 links, with each link providing 14.0625 GB/sec bandwidth in each direction" (NVIDIA Ampere GA102
#: GPU Architecture whitepaper). Any other GPU: unknown, rather than a generation's rate that may not be its own.
NVLINK_GBPS_PER_LINK = {(6, 0): 20.0, (7, 0): 25.0, (7, 5): 25.0, (8, 0): 25.0, (8, 6): 14.0625, (9, 0): 25.0,
                        (10, 0): 50.0, (10, 3): 50.0}


def link_spec_gbps(entry: str | None, compute_capability: tuple[int, int] | None,
                   pcie_gbps: float | None = None) -> tuple[float | None, str]:
    """The specified bandwidth per direction of the link ``entry`` (from :func:`link_between`) and a phrase
    saying what it is. NVLink: links × per-link rate of the generation; PCIe: ``pcie_gbps`` (the GPU's host
    link, an upper bound for traffic between GPUs that crosses it)."""
    if entry is None:
        return None, "unknown link (nvidia-smi topo -m gave no entry)"
    match = re.fullmatch(r"NV(\d+)", entry)
    if match:
        links = int(match.group(1))
        per_link = NVLINK_GBPS_PER_LINK.get(tuple(compute_capability)) if compute_capability else None
        if per_link is None:
            cc = f"sm_{compute_capability[0]}{compute_capability[1]}" if compute_capability else "this GPU"
            return None, f"{links} NVLinks; their rate per link is unknown here for {cc}"
        return links * per_link, f"{links} NVLinks × {per_link:g} GB/s per direction"
    what = TOPOLOGY_LEGEND.get(entry, f"'{entry}'")
    if pcie_gbps:
        return pcie_gbps, f"{what}; bounded by each GPU's PCIe link, {pcie_gbps:.1f} GB/s per direction"
    return None, what
