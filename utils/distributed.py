"""Training on several GPUs from a notebook: ``torchrun`` launched with a deadline, and what its scripts share.

PyTorch runs data-parallel training as one process per GPU, started by ``torchrun`` (``python -m
torch.distributed.run``), which gives every process its ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``. A notebook
cannot be that process, so notebook 10 keeps its training scripts in ``scripts/`` and launches them:

    plan = utils.distributed.plan(device)   # every GPU with NCCL; one GPU or none: gloo processes on the CPU
    run = utils.distributed.launch("ddp_train.py", plan.nproc, args=["--device", plan.device], timeout_s=300)
    run.result            # the JSON the script's rank 0 wrote with write_result()

:func:`launch` streams the processes' output into the notebook line by line, kills the whole process group when
the deadline passes (and says so), and raises :class:`LaunchError` with the line that says what went wrong when a
process fails. :func:`launch_nodes` starts one ``torchrun`` agent per node, as on several machines, meeting at a
c10d rendezvous on localhost, each agent with its own GPUs (:func:`split_devices`); :func:`machine_commands` is
what a reader types on real machines. The child processes get the notebook's environment, with NVLink multicast
switched off where it says nothing about it (:data:`MULTICAST_OFF`), plus only ``OMP_NUM_THREADS`` (if unset),
``PYTHONUNBUFFERED`` and, when asked, ``NCCL_DEBUG``. :func:`timeout_demo` shows a collective's timeout ending a run
that one rank never joins.

Inside a script: :func:`setup` reads the ranks, pins the process to its GPU (``torch.cuda.set_device``), and
joins the process group — NCCL on GPUs, gloo on a CPU — with a short ``timeout``, so that a collective that one
rank never reaches fails with an error instead of hanging; :func:`teardown` leaves it. :func:`collective_bench`
times one thing that contains collectives (every rank must make the same number of calls, which
``utils.bench.bench`` does not guarantee), :func:`interleaved_bench` times several variants of a step in alternating
rounds (a variant may run on the first k ranks while the others idle), and :func:`write_result` hands rank 0's
numbers back to the notebook.

Back in the notebook, what a launch timed in the same rounds becomes one ``utils.bench.Comparison``
(:func:`compared`, built with ``Comparison.from_rounds``): one number and one verdict per variant, as everywhere in
the course. :func:`scaling` puts DDP's and FSDP2's throughput on 1, 2, …, N GPUs (:func:`gpu_counts`) against one
GPU's; :func:`efficiency` reads it, :func:`shortfall` splits the efficiency into DDP's own work and the step's growth
from one GPU to n, each with its verdict, and :func:`step_verdict` gives a verdict the reason measured in the
profiles (:func:`step_parts`, :func:`step_difference`). :func:`fsdp_against_ddp` compares the two wrappers' steps,
model state and peaks; :func:`no_sync_effect` gradient accumulation with and without ``no_sync()``;
:func:`checkpoint_rows` the losses of a checkpoint resumed on another number of GPUs.

Also here: bus bandwidth of an all-reduce and what the benchmark's rows say (:func:`bus_rate`,
:func:`allreduce_rows`, :func:`allreduce_figure`, :func:`allreduce_time_s`, :func:`per_call_floor`), the
communication/computation overlap in a profile, the bytes of model state a rank holds, the links between GPUs as
``nvidia-smi topo -m`` reports them with their specified rates (:func:`ring_link_spec`), and :class:`NcclDigest`,
which keeps the few telling lines of ``NCCL_DEBUG=INFO`` output.
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

from utils.bench import Comparison, Rate, Timing, Verdict, Work, near_edge_text
from utils.bench import format_seconds as fmt
from utils.profile import assert_not_profiled

ROOT = Path(__file__).resolve().parents[1]
#: Where the course's distributed training scripts live.
SCRIPTS_DIR = ROOT / "scripts"

#: NVLink multicast (NVLS) and symmetric-memory multicast, switched off in every launched process: on shared
#: multi-GPU machines their use can take GPUs out of service, and the course never needs them. launch() sets each to
#: this value where the notebook's environment has none, and passes a value the notebook has set unchanged.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
#: The variables of :data:`MULTICAST_OFF`: ``extra_env`` may never set them (they are the machine's to set).
PASSED_THROUGH = tuple(MULTICAST_OFF)

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
    """The environment of the launched processes: the parent's (default ``os.environ``), plus
    :data:`MULTICAST_OFF` where the parent does not set those variables, ``OMP_NUM_THREADS`` (CPU threads per
    process, only if the parent has none: this machine's cores shared among the ``nproc`` processes),
    ``PYTHONUNBUFFERED=1`` (lines arrive as they are printed) and ``NCCL_DEBUG`` when asked (``"INFO"`` prints how
    NCCL connects the GPUs; ``"WARN"`` only problems).

    Raises:
        ValueError: if ``extra`` would set one of :data:`PASSED_THROUGH` (they are the machine's to set).
    """
    env = dict(os.environ if parent is None else parent)
    for name in extra or {}:
        if name in PASSED_THROUGH:
            raise ValueError(f"{name} is passed through from the parent environment unchanged; launch() never sets "
                             "it")
    for name, value in MULTICAST_OFF.items():
        env.setdefault(name, value)
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


def torchrun_command(script: str | Path, nproc: int, args: Sequence[str] = (), *, nnodes: int = 1,
                     endpoint: str | None = None, run_id: str = "course", is_host: bool | None = None,
                     program: Sequence[str] | None = None) -> list[str]:
    """The ``torchrun`` command line, run with this kernel's Python (``python -m torch.distributed.run``: the
    ``torchrun`` on PATH may belong to another environment) unless ``program`` says otherwise (e.g. ``["torchrun"]``
    for a command to show).

    One node: ``--standalone --nproc-per-node=N`` (a single-machine rendezvous on a free port: two runs never
    collide). Several (``nnodes`` > 1): ``--nnodes --nproc-per-node --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT
    --rdzv-id``, the same on every machine; the agent whose machine is ``HOST`` keeps the rendezvous
    (``is_host`` says so explicitly: ``--rdzv-conf=is_host=1`` or ``0``). The c10d rendezvous numbers the nodes
    itself (``GROUP_RANK``); ``--node-rank`` matters only to the static rendezvous (``--master-addr``)."""
    head = [*(program or [sys.executable, "-m", "torch.distributed.run"])]
    if nnodes == 1:
        head += ["--standalone", f"--nproc-per-node={nproc}"]
    else:
        if endpoint is None:
            raise ValueError("torchrun_command(): several nodes need the rendezvous endpoint HOST:PORT")
        head += [f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
                 f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}"]
        if is_host is not None:
            head.append(f"--rdzv-conf=is_host={int(is_host)}")
    return [*head, str(script), *map(str, args)]


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now (for a rendezvous)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def split_devices(gpus: int, nodes: int = 2, visible: str | None = None) -> list[str]:
    """``CUDA_VISIBLE_DEVICES`` of each of ``nodes`` agents that share ``gpus`` GPUs of this host, in order (the
    first nodes get one more when they do not divide evenly): "0,1" and "2,3" for 4 GPUs. Where ``visible`` (this
    process's own ``CUDA_VISIBLE_DEVICES``) lists GPUs, the agents share those.

    Raises:
        ValueError: for fewer GPUs than nodes.
    """
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible else [str(i) for i in range(gpus)]
    ids = ids[:gpus]
    if len(ids) < nodes or nodes < 1:
        raise ValueError(f"split_devices(): {nodes} nodes need at least as many GPUs, got {ids}")
    sizes = [len(ids) // nodes + (i < len(ids) % nodes) for i in range(nodes)]
    starts = list(itertools.accumulate([0, *sizes]))
    return [",".join(ids[a:b]) for a, b in itertools.pairwise(starts)]


def machine_commands(script: str, nproc_per_node: int, args: Sequence[str] = (), *, nnodes: int = 2,
                     endpoint: str = "MACHINE_A:29500", run_id: str = "my-job") -> str:
    """What a reader types to run ``script`` on ``nnodes`` machines of ``nproc_per_node`` GPUs each: the same
    ``torchrun`` line on every machine, with the rendezvous on machine A, and the variables that change between
    machines (NCCL's network interface)."""
    line = " ".join(torchrun_command(f"scripts/{script}", nproc_per_node, args, nnodes=nnodes, endpoint=endpoint,
                                     run_id=run_id, program=["torchrun"]))
    return (f"# on every one of the {nnodes} machines (MACHINE_A: the address of the first, reachable from the "
            f"others):\nexport NCCL_SOCKET_IFNAME=eth0   # the network interface between the machines "
            f"(see `ip addr`)\n{line}")


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
    env = child_env(nproc, nccl_debug=nccl_debug, extra=extra_env)
    return _supervise(path, nproc, lambda result: [(torchrun_command(path, nproc, [*args, "--result", result]),
                                                    env, "")], timeout_s=timeout_s, echo=echo)


def launch_nodes(script: str | Path, nproc_per_node: Sequence[int], args: Sequence[str] = (), *,
                 devices: Sequence[str] | None = None, timeout_s: float = 300.0,
                 echo: bool | Callable[[str], bool] = True, nccl_debug: str | None = None,
                 extra_env: dict[str, str] | None = None) -> LaunchResult:
    """Run ``script`` as a cluster runs it on several machines, here on one host: one ``torchrun`` agent per node
    (``--nnodes=len(nproc_per_node)``, agent ``i`` with ``nproc_per_node[i]`` processes), meeting at a c10d
    rendezvous on ``localhost:<free port>`` that the first agent keeps. ``devices[i]``, if given, is agent ``i``'s
    ``CUDA_VISIBLE_DEVICES`` (:func:`split_devices`): each node its own GPUs, as on separate machines. Lines are
    prefixed with ``[node i]``; what :func:`launch` says of output, results, deadline and errors holds here, and when
    one agent fails the others are stopped 10 s later (they would wait for its processes until their timeout). The
    port is free when chosen but not reserved: if the first agent finds it taken (:func:`port_taken`), the agents
    are started once more on another (:data:`RENDEZVOUS_ATTEMPTS`).

    Raises:
        LaunchTimeout, LaunchError: as :func:`launch`. ValueError: for fewer than two nodes, a node without
            processes, or ``devices`` of another length.
    """
    nodes = len(nproc_per_node)
    if nodes < 2 or min(nproc_per_node) < 1 or timeout_s <= 0 or (devices is not None and len(devices) != nodes):
        raise ValueError(f"launch_nodes(): need 2 or more nodes of at least one process (and one device list per "
                         f"node), got {list(nproc_per_node)} and {devices}")
    path = script_path(script)
    world = sum(nproc_per_node)

    def agents(result: str, endpoint: str, run_id: str) -> list[tuple[list[str], dict[str, str], str]]:
        out = []
        for node, nproc in enumerate(nproc_per_node):
            env = child_env(world, nccl_debug=nccl_debug, extra=extra_env)
            if devices is not None:
                env["CUDA_VISIBLE_DEVICES"] = devices[node]
            cmd = torchrun_command(path, nproc, [*args, "--result", result], nnodes=nodes, endpoint=endpoint,
                                   run_id=run_id, is_host=node == 0)
            out.append((cmd, env, f"[node {node}] "))
        return out

    for attempt in range(1, RENDEZVOUS_ATTEMPTS + 1):
        # free_port() releases the port it found: another process may take it before the first agent listens
        endpoint, run_id = f"localhost:{free_port()}", f"course-{os.getpid()}-{time.monotonic_ns()}"
        try:
            return _supervise(path, world, lambda result, e=endpoint, r=run_id: agents(result, e, r),
                              timeout_s=timeout_s, echo=echo)
        except LaunchTimeout:
            raise
        except LaunchError as err:
            if attempt == RENDEZVOUS_ATTEMPTS or not port_taken(err.lines):
                raise
            print(f"the rendezvous port {endpoint} was taken before the first agent listened on it: launching "
                  "again on another", flush=True)
    raise AssertionError("unreachable")


#: How often :func:`launch_nodes` starts its agents when the rendezvous port it chose was taken meanwhile.
RENDEZVOUS_ATTEMPTS = 2
_PORT_TAKEN = re.compile(r"EADDRINUSE|[Aa]ddress already in use")


def port_taken(lines: Sequence[str]) -> bool:
    """Whether a failed launch's output says a port it wanted to listen on was taken (``EADDRINUSE``)."""
    return any(_PORT_TAKEN.search(line) for line in lines)


#: After one agent of a several-node launch failed, how long the others may take to notice before they are killed.
AGENT_GRACE_S = 10.0


def _supervise(path: Path, nproc: int, agents: Callable[[str], list[tuple[list[str], dict[str, str], str]]], *,
               timeout_s: float, echo: bool | Callable[[str], bool]) -> LaunchResult:
    """Start the agents ``agents(result_path)`` gives (command, environment, prefix of its lines), each in a process
    group of its own; stream their lines; enforce the deadline; return rank 0's result."""
    out_dir = Path(tempfile.mkdtemp(prefix="course-dist-"))
    result_path = out_dir / "result.json"
    show = echo if callable(echo) else (lambda line: bool(echo))
    lines: list[str] = []
    arrived: queue.Queue[tuple[int, str | None]] = queue.Queue()
    procs: list[subprocess.Popen] = []
    start = time.perf_counter()

    def read(i: int, proc: subprocess.Popen, prefix: str) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            arrived.put((i, prefix + line.rstrip("\n")))
        arrived.put((i, None))

    try:
        for i, (cmd, env, prefix) in enumerate(agents(str(result_path))):
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                    errors="replace", env=env, cwd=ROOT,
                                    start_new_session=True)  # its own process group: killed as one
            procs.append(proc)
            threading.Thread(target=read, args=(i, proc, prefix), daemon=True).start()
        deadline, open_streams, failed_at = start + timeout_s, len(procs), None
        while open_streams:
            now = time.perf_counter()
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = now  # one agent failed: the others get a grace period, then are stopped
            if failed_at is not None and now > failed_at + AGENT_GRACE_S:
                for proc in procs:
                    if proc.poll() is None:
                        _kill_group(proc)
            try:
                i, line = arrived.get(timeout=max(0.0, min(0.5, deadline - now)))
            except queue.Empty:
                if time.perf_counter() >= deadline:
                    for proc in procs:
                        _kill_group(proc)
                    tail = "\n".join(lines[-15:])
                    raise LaunchTimeout(f"{path.name} with {nproc} processes did not finish within {timeout_s:.0f} s: "
                                        f"every process of it was killed. Last lines:\n{tail}",
                                        returncode=procs[0].poll(), lines=lines) from None
                continue
            if line is None:
                open_streams -= 1
                continue
            lines.append(line)
            if show(line):
                print(line, flush=True)
        returncodes = []
        for proc in procs:
            try:
                returncodes.append(proc.wait(timeout=max(1.0, deadline - time.perf_counter())))
            except subprocess.TimeoutExpired:  # its output closed, but a process lives on past the deadline
                for p in procs:
                    _kill_group(p)
                raise LaunchTimeout(f"{path.name} with {nproc} processes did not exit within {timeout_s:.0f} s: "
                                    "every process of it was killed", returncode=proc.poll(), lines=lines) from None
    except BaseException:  # the deadline, an interrupted kernel, anything: never leave processes behind
        for proc in procs:
            if proc.poll() is None:
                _kill_group(proc)
        shutil.rmtree(out_dir, ignore_errors=True)
        raise
    wall_s = time.perf_counter() - start
    result = json.loads(result_path.read_text()) if result_path.is_file() else None
    shutil.rmtree(out_dir, ignore_errors=True)
    returncode = next((code for code in returncodes if code != 0), 0)
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


# ── What this machine can run ──────────────────────────────────────────────────────────────────────────────


def gpu_counts(largest: int) -> list[int]:
    """1, 2, 4, … up to ``largest``, and ``largest`` itself when it is not a power of two: the numbers of GPUs a
    scaling study runs on (1, 2, 3 for three GPUs; 1, 2, 4, 8 for eight).

    Raises:
        ValueError: for ``largest`` < 1.
    """
    if largest < 1:
        raise ValueError(f"gpu_counts(): need at least one GPU, got {largest}")
    counts = [1 << k for k in range(largest.bit_length()) if 1 << k <= largest]
    return counts if counts[-1] == largest else [*counts, largest]


@dataclass(frozen=True)
class Plan:
    """Where notebook 10's runs go on this machine (:func:`plan`): the multi-process runs (all-reduce, timeout,
    two nodes, checkpoint) on ``device`` with ``nproc`` processes, the scaling on ``scale_device`` with
    ``scale_nproc``; ``reason`` says why, in a sentence or two."""

    gpus: int
    device: str
    nproc: int
    scale_device: str
    scale_nproc: int
    reason: str
    gpu_name: str = ""

    @property
    def ladder(self) -> list[int]:
        """The numbers of GPUs (processes) the scaling runs on: :func:`gpu_counts` of ``scale_nproc``."""
        return gpu_counts(self.scale_nproc)

    @property
    def unit(self) -> str:
        """What one share of the scaling is called: "GPU", or "process" on a CPU."""
        return "GPU" if self.scale_device == "cuda" else "process"

    @property
    def label(self) -> str:
        """A table's label for the multi-process runs: "4 × NVIDIA H100 80GB HBM3, NCCL" or "gloo on CPU: not
        comparable"."""
        return f"{self.nproc} × {self.gpu_name}, NCCL" if self.device == "cuda" else "gloo on CPU: not comparable"

    @property
    def scale_label(self) -> str:
        """The label of the scaling's tables (on one GPU, that GPU)."""
        if self.scale_device == "cpu":
            return "gloo on CPU: not comparable"
        return f"{self.gpu_name}, NCCL" if self.scale_nproc == 1 else f"{self.scale_nproc} × {self.gpu_name}, NCCL"

    def __str__(self) -> str:
        return self.reason


def plan(device: torch.device | None = None, *, gpus: int | None = None, nccl: bool | None = None,
         gpu_name: str | None = None, cpu_processes: int = 2) -> Plan:
    """What this machine can run, and why: every GPU with NCCL where there are two or more; on one GPU, the scaling
    on that GPU alone (DDP's own cost, with nothing to talk to) and every multi-process run as ``cpu_processes``
    gloo processes on the CPU; without GPUs (``device`` not CUDA) or without NCCL, everything on the CPU. ``gpus``,
    ``nccl`` and ``gpu_name`` default to what this process sees."""
    on_gpu = device is None or torch.device(device).type == "cuda"
    gpus = (torch.cuda.device_count() if on_gpu and torch.cuda.is_available() else 0) if gpus is None else gpus
    nccl = (torch.distributed.is_available() and torch.distributed.is_nccl_available()) if nccl is None else nccl
    name = gpu_name if gpu_name is not None else (torch.cuda.get_device_name(0) if gpus else "")
    cpu = f"{cpu_processes} gloo processes on the CPU"
    if gpus >= 2 and nccl:
        fewer = ", ".join(map(str, gpu_counts(gpus)[:-1]))
        return Plan(gpus, "cuda", gpus, "cuda", gpus, f"{gpus} GPUs ({name}) and NCCL: the all-reduce, the scaling "
                    f"and the resumed checkpoint use all {gpus}; the scaling also runs on {fewer}; the timeout "
                    "demonstration runs 2 processes, and the checkpoint is saved on fewer GPUs than it resumes on.",
                    name)
    if gpus == 1 and nccl:
        return Plan(1, "cpu", cpu_processes, "cuda", 1, "One GPU: scaling needs a second one, so it is not measured "
                    "here. DDP's own cost is (DDP against the plain model on this GPU). The all-reduce, the timeout, "
                    f"the two nodes and the checkpoint run as {cpu}: real launches and checks, not GPU speeds.", name)
    why = (f"{gpus} GPU{'s' if gpus > 1 else ''}, but this PyTorch has no NCCL" if gpus else "No GPU")
    return Plan(gpus, "cpu", cpu_processes, "cpu", cpu_processes, f"{why}: every run uses {cpu}. The launches, "
                "checks and checkpoint are real; bandwidths and speeds are not those of GPUs.", name)


def timeout_demo(device_type: str, nproc: int, *, collective_timeout_s: float, deadline_s: float = 90.0) -> str:
    """Launch ``scripts/mismatched_collective.py`` — rank 0 all-reduces, the others never do — and say how the
    collective's ``timeout`` ended it: how long after rank 0 called the all-reduce the launch failed, and the line
    that names the timeout. Under NCCL it runs with :data:`FAIL_FAST_NCCL_ENV` (no flight-recorder dump, the
    watchdog's wait for the dumps cut to a second); rank 0's announcement is the only line shown.

    The script joins its process group with the usual timeout (starting the processes can take longer than the
    short one on a busy machine) and runs the all-reduce in a group made with ``collective_timeout_s``.

    Raises:
        AssertionError: when the collective completed, or the launcher's deadline (not the timeout) ended it, or
            the run failed before rank 0 called the all-reduce, or the failure does not name the timeout.
    """
    called: list[float] = []

    def show(line: str) -> bool:
        if line.startswith("rank 0 calls all_reduce"):
            called.append(time.perf_counter())
            return True
        return False

    start = time.perf_counter()
    try:
        launch("mismatched_collective.py", nproc, timeout_s=deadline_s, echo=show,
               extra_env=FAIL_FAST_NCCL_ENV if device_type == "cuda" else None,
               args=["--device", device_type, "--timeout-s", collective_timeout_s])
    except LaunchTimeout as err:
        raise AssertionError(f"the collective's timeout did not end the run, the launcher's deadline did: {err}") \
            from err
    except LaunchError as err:
        first = str(err).splitlines()[0]
        assert called, f"the run failed before rank 0 called the all-reduce, so not on its timeout: {first}"
        assert re.search(r"[Tt]imed out|[Tt]imeout", first), f"the failure should name the timeout: {first}"
        end = time.perf_counter()
        return (f"the launch failed {end - called[0]:.1f} s after rank 0 called the all-reduce, {end - start:.1f} s "
                f"after it began (timeout {collective_timeout_s:g} s; the rest is starting {nproc} processes and "
                f"joining the group): {first[:240]}")
    raise AssertionError("the mismatched collective completed: it should have timed out")


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
    the GPUs finish the previous one. If it takes clearly more than the floor plus its transfer (by over half the
    transfer and a tenth of the floor), the bytes moved below the best bandwidth at that size and no fixed cost can
    be read. Otherwise the times are consistent with a fixed cost before each transfer, which a wall-clock timing
    cannot place on the host or the device. A message of the flat region faster than the
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
             f"{fmt(transfer)} its bytes need at the best algorithm bandwidth measured ({best['alg_gbps']:,.3g} GB/s)")

    def below_floor(row: dict[str, Any]) -> bool:  # resolved: 3% under the floor, the two bands (quartiles) apart
        t, iqr = row["timing"]["median_s"], row["timing"].get("iqr_s", 0.0)
        return t < floor / 1.03 and t + iqr / 2 < floor - rows[0]["timing"].get("iqr_s", 0.0) / 2

    fastest = min(flat[1:], key=lambda r: r["timing"]["median_s"])  # a message of the flat region below the floor
    if below_floor(fastest):
        which = ("It" if fastest is end else
                 f"But {format_bytes(fastest['bytes'])} took {fmt(fastest['timing']['median_s'])},")
        return said + (f". {which} less than the floor itself: no fixed cost per call fits both times (the cost per "
                       "call varies from one size to the next). So these times cannot tell a latency before the "
                       "transfer from work per call")
    if hidden < -max(transfer / 2, 0.1 * floor):  # slower than a fixed cost plus the transfer at the best rate
        return said + (". That is more than a fixed cost plus its transfer: at this size the bytes move well below "
                       "the best bandwidth, so these times cannot isolate a fixed cost per call")
    if hidden < transfer / 2:
        return said + (". That is consistent with a fixed cost before each transfer, which a wall-clock timing cannot "
                       "place on the host or the device")
    if on_gpu:
        return said + (". So most of the transfer overlapped the fixed cost. It is not a latency of the link before "
                       "the transfer but the host's time to issue each call (PyTorch's and NCCL's work), while the "
                       "GPUs finish the previous one")
    return said + (". So most of the transfer overlapped the fixed cost: it is work per call beside the transfer "
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


def scaling(variants: Mapping[str, Mapping[str, Any]], ladder: Sequence[int], *, unit: str = "GPU",
            kinds: Mapping[str, str] | None = None, **options: Any) -> Comparison:
    """Data-parallel throughput on 1, 2, …, N GPUs against the plain model on one GPU, at the same batch per GPU,
    from variants of ``scripts/ddp_train.py`` timed in the same rounds: ``plain:1`` (the baseline), and for every
    kind (``kinds``: key → name shown, default ``{"ddp": "DDP", "fsdp": "FSDP2"}``) and every ``n`` of ``ladder``
    the variant ``kind:n`` that the launch timed (FSDP2 on one GPU is usually left out).

    Each variant's time is put per batch of one GPU — its step divided by the ``n`` GPUs that share the work — with
    tokens/s as its rate, so that every speed-up is a ratio of throughputs: DDP on n GPUs against one GPU is the
    scaling, and speed-up / n the scaling efficiency (:func:`efficiency`). Names read "DDP, 4 GPUs" (``unit``:
    what to call a GPU, e.g. "process" on a CPU).

    Raises:
        KeyError: without ``plain:1`` or any scaled variant. ValueError: for a variant timed on another number of
            ranks than its name says.
    """
    kinds = dict(kinds or {"ddp": "DDP", "fsdp": "FSDP2"})
    keys = {f"plain, 1 {unit}": "plain:1"}
    for kind, shown in kinds.items():
        keys |= {scaled_name(shown, n, unit): f"{kind}:{n}" for n in ladder if f"{kind}:{n}" in variants}
    if "plain:1" not in variants or len(keys) < 2:
        raise KeyError(f"scaling(): need plain:1 and at least one scaled variant; the launch timed {list(variants)}")
    for key in keys.values():
        n = int(key.rsplit(":", 1)[1])
        if variants[key]["ranks"] != n:
            raise ValueError(f"scaling(): {key} ran on {variants[key]['ranks']} ranks")
    per_batch = {name: [t / variants[key]["ranks"] for t in variants[key]["timing"]["block_times_s"]]
                 for name, key in keys.items()}
    one = variants["plain:1"]
    return Comparison.from_rounds(per_batch, work=Work(one["tokens_per_rank"], "tokens"),
                                  device=one["timing"]["device"], **options)


def plural(unit: str) -> str:
    """'GPU' → 'GPUs', 'process' → 'processes'."""
    return unit + ("es" if unit.endswith("s") else "s")


def scaled_name(kind: str, n: int, unit: str = "GPU") -> str:
    """How :func:`scaling` names a variant: 'DDP, 1 GPU', 'DDP, 4 GPUs', 'FSDP2, 2 processes'."""
    return f"{kind}, {n} {unit if n == 1 else plural(unit)}"


def efficiency(scaling_: Comparison, kind: str, n: int, unit: str = "GPU") -> str:
    """'3.71× one GPU's tokens/s (band 3.62–3.80×), efficiency 93% (91–95%)': the speed-up of ``kind`` on ``n``
    GPUs (:func:`scaled_name`) over the baseline of :func:`scaling`, and that speed-up / ``n``, each with its band."""
    v = scaling_.verdict(scaled_name(kind, n, unit))
    lo, hi = v.band
    return (f"{v.speedup:.2f}× one {unit}'s tokens/s (band {lo:.2f}–{hi:.2f}×), efficiency {v.speedup / n:.0%} "
            f"({lo / n:.0%}–{hi / n:.0%})")


def shortfall(variants: Mapping[str, Mapping[str, Any]], n: int, *, parts: Mapping[str, StepParts] | None = None,
              unit: str = "GPU", resolution: float = 0.03) -> str:
    """Why DDP on ``n`` GPUs falls short of n× one GPU (or does not), from the same rounds as :func:`scaling`.

    The efficiency factors exactly into two ratios of step times, each a comparison of its own with a verdict:
    DDP's own work, ``ddp:1`` against ``plain:1`` (its hooks, the copies into its buckets, an all-reduce over one
    rank: what DDP costs with nothing to talk to), and going from one GPU to ``n``, ``ddp:n`` against ``ddp:1``
    (the all-reduce that backward does not hide, waiting for the slowest rank, the host shared by more processes).
    Each is reported with its verdict; where the second is resolved and the profiles of ``ddp:1`` and ``ddp:n`` are
    in ``parts`` (:func:`parts_of`), what moved in the step (:func:`step_verdict`)."""
    own = compared(variants, {f"plain, 1 {unit}": "plain:1", f"DDP, 1 {unit}": "ddp:1"}, resolution=resolution)
    grow = compared(variants, {f"DDP, 1 {unit}": "ddp:1", scaled_name("DDP", n, unit): f"ddp:{n}"},
                    resolution=resolution)
    own_v, grow_v = own.verdict(), grow.verdict()

    def step(v: Verdict) -> str:
        times = f"{1 / v.speedup:.2f}×"
        return {"slower": f"the step {times} as long", "faster": f"the step {times} as long",
                "same": f"no change beyond ±{v.resolution:.0%}"}.get(
            v.outcome, f"the step {times} as long, not resolved (band "
                       f"{near_edge_text(1 / v.band[1], v.resolution).rstrip('×')}–"
                       f"{near_edge_text(1 / v.band[0], v.resolution)})")

    parts = parts or {}
    moved = step_verdict(grow_v, parts.get("ddp:1"), parts.get(f"ddp:{n}")).split(" — ", 1)
    why = f" ({moved[1]})" if len(moved) > 1 and grow_v.outcome in ("faster", "slower") else (
        " (nothing resolved for the profiles of DDP on 1 and n to explain: they are not compared)"
        if parts.get("ddp:1") and parts.get(f"ddp:{n}") else "")
    return (f"DDP's own work (DDP against the plain model on one {unit}): {step(own_v)}; from one {unit} to {n}: "
            f"{step(grow_v)}{why}")


def scaling_figure(scaling_: Comparison, ladder: Sequence[int], *, unit: str = "GPU",
                   kinds: Sequence[str] = ("DDP", "FSDP2"), title: str):
    """Speed-up over one GPU against the number of GPUs for every kind :func:`scaling` timed, each point with its
    band, beside the ideal n×."""
    from utils.plot import curves

    series = {"ideal (n×)": (list(ladder), [float(n) for n in ladder])}
    bands = {}
    for kind in kinds:
        ns = [n for n in ladder if scaled_name(kind, n, unit) in scaling_.timings]
        if ns:
            verdicts = [scaling_.verdict(scaled_name(kind, n, unit)) for n in ns]
            series[kind] = (ns, [v.speedup for v in verdicts])
            bands[kind] = (ns, [v.band for v in verdicts])
    fig = curves(series, xlabel=plural(unit), ylabel=f"throughput / one {unit}'s (plain model)", title=title)
    axes = fig.axes[0]
    for line in axes.get_lines():
        if line.get_label() in bands:
            ns, band = bands[line.get_label()]
            axes.fill_between(ns, [lo for lo, _ in band], [hi for _, hi in band], color=line.get_color(), alpha=0.2)
        elif line.get_label().startswith("ideal"):
            line.set_linestyle(":")
            line.set_color("0.45")
    axes.set_xticks(list(ladder))
    axes.legend(fontsize=9)
    return fig


def fsdp_against_ddp(variants: Mapping[str, Mapping[str, Any]], n: int, *, unit: str = "GPU"
                     ) -> tuple[Verdict, dict[str, float | None], str]:
    """FSDP2's step against DDP's on ``n`` GPUs (``fsdp:n`` and ``ddp:n`` of ``scripts/ddp_train.py``, the same
    rounds) and their memory per GPU: the verdict; ``{"state_ratio": ..., "peak_ratio": ...}``, FSDP2's model state
    (parameters, gradients, AdamW's moments: ``state_bytes``) and its peak over DDP's (None where not reported; a
    CPU has no peak to read); and two lines: the verdict, then the memory with what the rest of the peak says
    (:func:`peak_beyond_state`). Sharding over n ranks should leave a state ratio near 1/n."""
    from utils.memory import format_bytes

    verdict = compared(variants, {scaled_name("DDP", n, unit): f"ddp:{n}",
                                  scaled_name("FSDP2", n, unit): f"fsdp:{n}"}).verdict()
    ddp, fsdp = variants[f"ddp:{n}"], variants[f"fsdp:{n}"]
    ratios: dict[str, float | None] = {"state_ratio": None, "peak_ratio": None}
    said = []
    if ddp.get("state_bytes") and fsdp.get("state_bytes"):
        states = [m["state_bytes"]["total"] for m in (fsdp, ddp)]
        ratios["state_ratio"] = states[0] / states[1]
        said.append(f"model state (parameters, gradients, AdamW) {format_bytes(states[0])} against "
                    f"{format_bytes(states[1])} ({ratios['state_ratio']:.2f}×; 1/{n} = {1 / n:.2f})")
    if ddp.get("peak_bytes") and fsdp.get("peak_bytes"):
        ratios["peak_ratio"] = fsdp["peak_bytes"] / ddp["peak_bytes"]
        said.append(f"peak {format_bytes(fsdp['peak_bytes'])} against {format_bytes(ddp['peak_bytes'])} "
                    f"({ratios['peak_ratio']:.2f}×)")
        if ratios["state_ratio"] is not None:
            said[-1] += ": " + peak_beyond_state(ddp, fsdp)
    else:
        said.append(f"peak memory per {unit} is measured on GPUs only")
    return verdict, ratios, f"{verdict}\nFSDP2 against DDP, per {unit}: " + "; ".join(said)


def no_sync_effect(variants: Mapping[str, Mapping[str, Any]], check: Mapping[str, Any],
                   rows: Sequence[dict[str, Any]], *, resolution: float = 0.03, **options: Any
                   ) -> tuple[Comparison, str]:
    """Gradient accumulation with ``no_sync()`` against an all-reduce after every micro-batch: ``accum_no_sync``
    and ``accum_sync`` of ``scripts/ddp_train.py``, timed in the same rounds, as a :class:`utils.bench.Comparison`
    (``options`` go to it: ``title``, ...), and its verdict with the reason for the outcome it has
    (``Verdict.explain``): the all-reduces that no_sync skips per optimizer step and the time they take at the
    bandwidth the all-reduce benchmark measured (its ``rows``) for messages of DDP's bucket size, against the step.
    ``check`` is the script's ``--check`` result: its gradient bytes and its count of all-reduces (DDP's buckets)
    in one synchronised backward. A skipped time within the resolution cannot show; a larger one that does not
    show was hidden behind backward's computation; a gain beyond it (even at the low end of the band) says the
    skipped calls cost more than their transfer."""
    from utils.memory import format_bytes

    names = {"all-reduce every micro-batch": "accum_sync", "no_sync but the last": "accum_no_sync"}
    comparison = compared(variants, names, resolution=resolution, **options)
    verdict = comparison.verdict()
    skipped = variants["accum_sync"]["allreduce_bytes"] - variants["accum_no_sync"]["allreduce_bytes"]
    buckets = check["accumulation"]["no_sync"]["allreduce_calls"]  # one synchronised backward: DDP's buckets
    calls = round(buckets * skipped / check["grad_bytes"])
    skipped_s, row = allreduce_time_s(rows, skipped, max(calls, 1))
    step_s = comparison.time_s("all-reduce every micro-batch")
    share = skipped_s / step_s
    what = (f"it skips {calls} all-reduces of {format_bytes(skipped)} in all per optimizer step, "
            f"{fmt(skipped_s)} at the bandwidth measured for {format_bytes(row['bytes'])} messages" if row else
            "it skips no all-reduce")
    what += f": {share:.0%} of the {fmt(step_s)} step"
    hidden = (f"{what}, more than the ±{resolution:.0%} resolved: backward's computation hid them (DDP all-reduces "
              "each bucket while backward goes on)")
    gained_at_least = 1 - 1 / verdict.band[0]  # the share of the step saved, at the low end of the band
    saved_s = step_s - comparison.time_s("no_sync but the last")
    # the transfer is an upper bound of what the skipped all-reduces expose: DDP overlaps them with backward
    remainder = (f"; the {'step' if verdict.outcome == 'faster' else 'median'} saved {fmt(saved_s)}, more than their "
                 f"transfer's at most {fmt(skipped_s)}: the rest would be DDP's work per synchronised backward (its "
                 "hooks and bucket copies), not measured apart here" if saved_s > 1.25 * skipped_s else "")
    faster = what + (f"; the step gained {1 - 1 / verdict.speedup:.0%}, more than that: here the skipped all-reduces "
                     "cost more than their bytes at the measured rate" if gained_at_least > share else remainder)
    return comparison, verdict.explain(faster=faster, same=what + ": too little to resolve" if share <= resolution
                                       else hidden, inconclusive=f"at stake: {what}{remainder}")


def checkpoint_rows(saved: Mapping[str, Any], resumed: Mapping[str, Sequence[Mapping[str, Any]]]
                    ) -> tuple[list[dict[str, str]], float]:
    """Table rows of ``scripts/fsdp_train.py``'s checkpoint: the losses of steps 3–4 in the run that saved it
    (``saved``, never interrupted) and in every run that resumed from it (``resumed``: a label → the results of its
    launches), with each one's largest difference from the saving run; and the largest difference of all."""
    reference = saved["losses"][2:]
    rows = [{"run": f"saved on {saved['ranks']}, never interrupted", "step 3": f"{reference[0]:.6f}",
             "step 4": f"{reference[1]:.6f}", "largest difference": "—"}]
    worst = 0.0
    for label, results in resumed.items():
        for i, result in enumerate(results, 1):
            losses = result["resume"]["losses"]
            diff = max(abs(a - b) for a, b in zip(losses, reference, strict=True))
            worst = max(worst, diff)
            rows.append({"run": f"resumed on {result['resume']['ranks']}, {label}"
                                + (f" (launch {i})" if len(results) > 1 else ""),
                         "step 3": f"{losses[0]:.6f}", "step 4": f"{losses[1]:.6f}",
                         "largest difference": f"{diff:.1e}"})
    return rows, worst


def placement_text(placement: Sequence[Mapping[str, Any]]) -> str:
    """'node 0: ranks 0, 1 on GPUs 0, 1 · node 1: ranks 2, 3 on GPUs 2, 3', from the placement a script reports."""
    nodes: dict[int, list[Mapping[str, Any]]] = {}
    for entry in sorted(placement, key=lambda e: e["rank"]):
        nodes.setdefault(entry["node"], []).append(entry)
    parts = []
    for node, entries in sorted(nodes.items()):
        ranks = ", ".join(str(e["rank"]) for e in entries)
        where = ("the CPU" if all(e["gpu"] == "cpu" for e in entries)
                 else "GPU" + ("s " if len(entries) > 1 else " ") + ", ".join(e["gpu"] for e in entries))
        parts.append(f"node {node}: rank{'s' if len(entries) > 1 else ''} {ranks} on {where}")
    return " · ".join(parts)


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
#: NVLinks one GPU has, by compute capability (P100 4, V100 6, A100 12, GA102 bridge 4, H100/H200 and B200 18): an
#: ``NV#`` to every peer whose sum exceeds it must go through a switch (:func:`ring_link_spec`).
NVLINK_LINKS_PER_GPU = {(6, 0): 4, (7, 0): 6, (7, 5): 2, (8, 0): 12, (8, 6): 4, (9, 0): 18, (10, 0): 18, (10, 3): 18}


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


def ring_link_spec(topology: str | None, gpus: int, compute_capability: tuple[int, int] | None,
                   pcie_gbps: float | None = None, visible: str | None = None) -> tuple[float | None, str]:
    """The specified bandwidth per direction that bounds an all-reduce over the first ``gpus`` GPUs this process
    sees: the slowest link between any two of them (:func:`link_between`, :func:`link_spec_gbps`), and a phrase
    saying which. A ring crosses every GPU's links, so no bus bandwidth can beat its slowest one. ``nvidia-smi topo
    -m`` shows the whole machine whatever ``CUDA_VISIBLE_DEVICES`` says, so where ``visible`` (that variable) lists
    GPU indices, those rows of the matrix are read (GPUs 2 and 3 for "2,3"); else GPUs 0 … ``gpus``−1."""
    if topology is None or gpus < 2:
        return None, "no link between GPUs here"
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible else []
    devices = [int(v) for v in ids] if ids and all(v.isdigit() for v in ids) else list(range(gpus))
    devices = devices[:gpus]
    if len(devices) < 2:
        return None, "no link between GPUs here"
    links = []
    for a, b in itertools.combinations(devices, 2):
        entry = link_between(topology, a, b)
        gbps, what = link_spec_gbps(entry, compute_capability, pcie_gbps)
        if gbps is None:
            return None, f"GPU{a} ↔ GPU{b}: {entry or '?'} — {what}"
        links.append((gbps, a, b, entry, what))
    gbps, a, b, entry, what = min(links)
    if len({link[3] for link in links}) == 1:
        if len(devices) == 2:
            return gbps, f"GPU{a} ↔ GPU{b}: {entry} — {what}"
        named = (f"GPUs {devices[0]}–{devices[-1]}" if devices == list(range(devices[0], devices[-1] + 1)) else
                 "GPUs " + ", ".join(map(str, devices)))
        match = re.fullmatch(r"NV(\d+)", entry)
        owned = NVLINK_LINKS_PER_GPU.get(tuple(compute_capability)) if compute_capability else None
        if match is None:
            return gbps, f"{named}, every pair {entry} — {what}, per GPU"
        peers, per_pair = len(devices) - 1, int(match.group(1))
        if owned is not None and per_pair * peers <= owned:  # direct links to every peer: rings use all of them
            return (gbps * peers, f"{named}, every pair {entry} (direct links: {per_pair} to each of {peers} peers) "
                                  f"— {per_pair * peers} NVLinks × {gbps / per_pair:g} GB/s per direction, per GPU")
        if owned is not None:  # more links to its peers than the GPU has: they go through a switch
            return gbps, (f"{named}, every pair {entry} (through a switch: {per_pair} × {peers} peers is more than "
                          f"the {owned} links a GPU has, so all peers share them) — {what}, per GPU")
        return gbps, f"{named}, every pair {entry} (direct or through a switch: unknown here) — {what}, per GPU"
    return gbps, f"slowest pair GPU{a} ↔ GPU{b}: {entry} — {what}"


def allreduce_rows(sweeps: Sequence[Mapping[str, Any]], spec_gbps: float | None = None) -> list[dict[str, str]]:
    """One table row per number of ranks of ``scripts/allreduce_bench.py``'s ``sweeps``, at its largest message:
    time per call, algorithm and bus bandwidth, their ratio 2(n−1)/n, and the bus bandwidth's share of the link's
    specification ``spec_gbps`` (when known)."""
    from utils.memory import format_bytes

    rows = []
    for sweep in sweeps:
        row, n = sweep["rows"][-1], sweep["ranks"]
        rows.append({"GPUs": n, "message": format_bytes(row["bytes"]), "time per call": fmt(row["timing"]["median_s"]),
                     "algorithm GB/s": f"{row['alg_gbps']:,.3g}", "bus GB/s": f"{row['bus_gbps']:,.3g}",
                     "bus / algorithm": f"{allreduce_bus_factor(n):.3g}",
                     "% of link spec": f"{100 * row['bus_gbps'] / spec_gbps:.0f}%" if spec_gbps else "—"})
    return rows


def allreduce_figure(sweeps: Sequence[Mapping[str, Any]], *, spec_gbps: float | None = None, title: str):
    """Bus bandwidth (solid) and algorithm bandwidth (dashed) of every sweep against the message size, the link's
    specification as a line: the figure of notebook 10's all-reduce section."""
    from utils.memory import format_bytes
    from utils.plot import curves

    series = {}
    for sweep in sweeps:
        sizes = [r["bytes"] for r in sweep["rows"]]
        series[f"bus, {sweep['ranks']} ranks"] = (sizes, [r["bus_gbps"] for r in sweep["rows"]])
        series[f"algorithm, {sweep['ranks']} ranks"] = (sizes, [r["alg_gbps"] for r in sweep["rows"]])
    fig = curves(series, hlines={f"link spec ({spec_gbps:,.0f} GB/s)": spec_gbps} if spec_gbps else None,
                 xlabel="message size", ylabel="GB/s", logx=True, title=title, legend_outside=True,
                 xticks=lambda b: format_bytes(b).replace(".00", ""))
    axes = fig.axes[0]
    colours = {}
    for line in axes.get_lines():  # one colour per number of ranks: bus solid, algorithm dashed
        kind, _, ranks = line.get_label().partition(", ")
        if kind in ("bus", "algorithm"):
            line.set_color(colours.setdefault(ranks, f"C{len(colours)}"))
            line.set_linestyle("-" if kind == "bus" else "--")
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return fig
