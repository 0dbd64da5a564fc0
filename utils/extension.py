"""Build and load the course's C++ and CUDA extensions from ``csrc/``, safely, and look inside what was built.

Every extension of the course goes through :func:`build`, which wraps ``torch.utils.cpp_extension.load`` with
four decisions:

- **A build directory per build key**: ``build/<name>-<hash>`` under the repository (git-ignored); the hash covers
  the *contents* of the sources and of the headers they include, the flags, the GPU arch and the torch / CUDA /
  Python versions. Any change builds afresh next to the old build instead of over it.
- **The detected GPU's arch only** (``TORCH_CUDA_ARCH_LIST`` from ``torch.cuda.get_device_capability()``): one
  device compile instead of one per arch the torch build knows.
- **A child process with a deadline**, in its own process group: at the deadline, or on Ctrl-C, the whole group
  (Python, ninja, the compilers) is killed. A thread with a timeout would return while the compiler kept running.
- **A guard against stale locks**: ``torch.utils.cpp_extension`` serialises builds of one directory with a file
  named ``lock``. Where it uses ``FileBaton`` (PyTorch before its switch to an OS lock, pytorch/pytorch#189245)
  the file's mere existence blocks, so a build killed half-way (a timeout, Ctrl-C, the out-of-memory killer)
  leaves a lock that makes every later build wait forever. Each build first takes this module's own OS lock on
  the directory (:func:`build_guard`, ``fcntl.flock``, which the kernel releases when its holder dies, however it
  dies); holding it means no other build of the directory runs, so a ``lock`` file found then is stale and goes.
  Without ``fcntl`` (Windows) the guard cannot know that: it says so, and leaves the lock alone.

Before building, :func:`why_not_buildable` says what this machine lacks for a spec, in words: a C++ compiler
(``$CXX`` or ``c++``, what ``torch.utils.cpp_extension`` calls), ``ninja`` (its build tool: ``pip install ninja``,
listed in requirements.txt; found on PATH or beside this Python), and for CUDA sources a CUDA build of PyTorch and
``nvcc`` (the CUDA toolkit, which a pip-only install lacks). A notebook prints that reason and skips every cell that
would call the extension, instead of failing later.

To look inside a CUDA build: :func:`ptxas_usage` reads the registers and spills of every kernel from the build
log (the specs of this course pass ``-Xptxas=-v``), and :func:`run_ncu` runs Nsight Compute on a command and
returns the metrics of the kernels it launched.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import importlib
import io
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

try:  # POSIX; absent on Windows, where build_guard degrades (see its docstring)
    import fcntl
except ImportError:  # pragma: no cover - exercised by simulating the missing module in tests/test_extension.py
    fcntl = None

REPO_ROOT = Path(__file__).resolve().parents[1]
CSRC = REPO_ROOT / "csrc"
"""Where the C++ and CUDA sources live, as real files."""
BUILD_ROOT = REPO_ROOT / "build"
"""Where extensions are built: the repository's git-ignored build/ folder."""

DEFAULT_TIMEOUT_S = 300.0
"""The longest a build may take by default (a C++ file with light headers takes 5-20 s on 2 cores)."""


@dataclass(frozen=True)
class ExtensionSpec:
    """What to build: a shared library from C++ (``.cpp``) and CUDA (``.cu``) sources.

    The library registers its operators itself (``TORCH_LIBRARY_FRAGMENT``); it is loaded with
    ``torch.ops.load_library``, no pybind11 module. ``headers`` are the files the sources include: they are not
    compiled on their own, but their contents are part of the build key, so editing one rebuilds.
    """

    name: str
    sources: tuple[Path, ...]
    headers: tuple[Path, ...] = ()
    extra_cflags: tuple[str, ...] = ("-O3",)
    extra_cuda_cflags: tuple[str, ...] = ("-O3",)
    arch: str | None = None  # TORCH_CUDA_ARCH_LIST for .cu sources, e.g. "9.0"; None: no CUDA source
    include_dirs: tuple[Path, ...] = field(default=(CSRC,))

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.name):
            raise ValueError(f"extension name must be an identifier, got {self.name!r}")
        if not self.sources:
            raise ValueError(f"extension {self.name}: no sources")
        missing = [str(p) for p in (*self.sources, *self.headers) if not Path(p).is_file()]
        if missing:
            raise FileNotFoundError(f"extension {self.name}: missing source files {missing}")
        if self.uses_cuda and not self.arch:
            raise ValueError(f"extension {self.name} has CUDA sources: give the arch to build for (e.g. '9.0')")

    @property
    def uses_cuda(self) -> bool:
        return any(Path(p).suffix == ".cu" for p in self.sources)

    def key(self) -> dict:
        """Everything the build depends on: file contents (not only names), flags, arch, versions."""
        digest = {str(Path(p).relative_to(REPO_ROOT) if Path(p).is_relative_to(REPO_ROOT) else p):
                  hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in (*self.sources, *self.headers)}
        return {"name": self.name, "files": digest, "cflags": list(self.extra_cflags),
                "cuda_cflags": list(self.extra_cuda_cflags), "arch": self.arch, "torch": torch.__version__,
                "cuda": torch.version.cuda, "python": list(sys.version_info[:2])}


def cuda_arch(device: torch.device | str | int | None = None) -> str:
    """``TORCH_CUDA_ARCH_LIST`` for the detected GPU only, e.g. "9.0" on an H100 or H200 (sm_90)."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}.{minor}"


def find_cxx() -> str | None:
    """The C++ compiler ``torch.utils.cpp_extension`` runs (``$CXX``, else ``c++``), or None when it is missing."""
    return shutil.which(os.environ.get("CXX", "c++"))


def find_ninja() -> str | None:
    """``ninja``, which ``torch.utils.cpp_extension.load`` needs: on PATH, else beside this Python (``pip install
    ninja`` puts it in the environment's bin/, which is not on PATH unless the environment is activated), else None."""
    exe = shutil.which("ninja")
    if exe:
        return exe
    beside = Path(sys.executable).parent / ("ninja.exe" if sys.platform == "win32" else "ninja")
    return str(beside) if beside.is_file() else None


def why_not_buildable(spec: ExtensionSpec | None = None, *, cuda: bool | None = None) -> str | None:
    """Why ``spec`` (or, with ``cuda=``, any C++ or CUDA extension) cannot be built on this machine, in words; None
    when the tools are there. Checks, in order: a C++ compiler, ninja, and for CUDA sources a CUDA build of
    PyTorch and nvcc. (A CUDA GPU is not needed to build, only to run: the caller checks that.)"""
    cuda = spec.uses_cuda if cuda is None else cuda
    if find_cxx() is None:
        return f"no C++ compiler ({os.environ.get('CXX', 'c++')} is not on PATH): install g++ or clang"
    if find_ninja() is None:
        return "no ninja, the build tool of torch.utils.cpp_extension: pip install ninja (requirements.txt lists it)"
    if cuda:
        from utils.env import find_nvcc

        if torch.version.cuda is None:
            return "this PyTorch is built without CUDA"
        if find_nvcc() is None:
            return ("no nvcc: PyTorch's pip wheels bring the CUDA runtime, not the compiler; install the CUDA "
                    "toolkit (or set CUDA_HOME) to build CUDA C++")
    return None


def quiet_cuda_home_notice() -> None:
    """Import ``torch.utils.cpp_extension`` (Inductor's C++ backend imports it on a first compile) with its warning
    "No CUDA runtime is found, using CUDA_HOME=..." silenced: on a CPU-only machine where a CUDA toolkit is
    installed, that line says only that this torch found no GPU, which the lesson already says. Its other warnings
    stay on. Does nothing where a GPU is present or the module is already imported."""
    if "torch.utils.cpp_extension" in sys.modules or torch.cuda.is_available():
        return
    logger = logging.getLogger("torch.utils.cpp_extension")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        importlib.import_module("torch.utils.cpp_extension")  # the warning is logged once, at import
    finally:
        logger.setLevel(level)


quiet_cuda_home_notice()


def build_directory(spec: ExtensionSpec, root: Path = BUILD_ROOT) -> Path:
    """``root/<name>-<hash>``: the hash covers :meth:`ExtensionSpec.key`."""
    key = json.dumps(spec.key(), sort_keys=True)
    return Path(root) / f"{spec.name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def library_path(spec: ExtensionSpec, root: Path = BUILD_ROOT) -> Path:
    """Where the built shared library of ``spec`` is (or will be)."""
    suffix = ".pyd" if sys.platform == "win32" else ".so"
    return build_directory(spec, root) / f"{spec.name}{suffix}"


@contextlib.contextmanager
def build_guard(directory: Path, *, timeout_s: float | None = None) -> Iterator[bool]:
    """Hold this module's OS lock on ``directory`` for one build; yield True if a stale ``lock`` was removed.

    The lock is ``flock`` on ``directory/build.flock``: the kernel releases it when the holding process dies, so
    it can never go stale. While it is held no other build of the directory runs, so torch's ``lock`` file, if
    present, was left by an interrupted build: it is removed before the build would wait on it forever.

    Without ``fcntl`` (Windows) there is no such lock: the guard prints that stale locks are not detected, where
    the lock file is, and yields False without touching it.

    Raises:
        TimeoutError: another build held the directory for more than ``timeout_s`` seconds (None: wait).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        print(f"build guard off: this platform has no fcntl (Windows), so a stale lock cannot be told from a "
              f"running build; if a build waits forever, stop it and delete {directory / 'lock'}", flush=True)
        yield False
        return
    with open(directory / "build.flock", "w") as guard:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        waiting = False
        while True:
            try:
                fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waiting:
                    print(f"waiting for another build of {directory}", flush=True)
                    waiting = True
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"another build of {directory} is running (it holds "
                                       f"{directory / 'build.flock'}) and did not finish in {timeout_s} s") from None
                time.sleep(0.05)
        stale = directory / "lock"
        removed = stale.exists()
        stale.unlink(missing_ok=True)
        yield removed  # the OS lock is released when the file closes, here or when the process dies


def run_with_deadline(cmd: Sequence[str], *, timeout_s: float, log_path: Path, env: dict | None = None) -> int:
    """Run ``cmd`` in its own process group with output to ``log_path``; kill the whole group at the deadline.

    Returns the exit status. Raises TimeoutError after killing every process of the group (the child and
    whatever it started: ninja, the compilers), which a thread with a deadline could not do. An interrupt
    (Ctrl-C, Jupyter's stop button) kills the group too, then propagates.
    """
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=hasattr(os, "killpg"))
        try:
            return proc.wait(timeout=timeout_s)
        except BaseException as err:  # the deadline, or Ctrl-C / a kernel interrupt: stop the whole group
            if hasattr(os, "killpg"):
                os.killpg(proc.pid, signal.SIGKILL)  # the group: Python, ninja, c++ / nvcc
            else:  # pragma: no cover - Windows
                proc.kill()
            proc.wait()
            if isinstance(err, subprocess.TimeoutExpired):
                raise TimeoutError(f"{Path(cmd[0]).name} did not finish within {timeout_s:.0f} s and was killed "
                                   f"with its children; its output is in {log_path}") from None
            raise


_CHILD = r"""
import json, sys
from pathlib import Path
from torch.utils.cpp_extension import load
from utils.extension import build_guard
args = json.loads(Path(sys.argv[1]).read_text())
with build_guard(Path(args["build_directory"])) as removed:
    if removed:
        print("removed a stale lock left by an interrupted build")
    load(**args)
"""

_LOADED: dict[str, Path] = {}
"""Libraries loaded into this process, by extension name."""


def build(spec: ExtensionSpec, *, timeout_s: float = DEFAULT_TIMEOUT_S, root: Path = BUILD_ROOT) -> Path:
    """Build ``spec`` (if needed) and load it into this process; return the path of its shared library.

    A finished build is reused, also by another process (``build.ok`` marks it); a new build runs in a child
    process that is killed at ``timeout_s``, after which the next call resumes where it stopped.

    Raises:
        TimeoutError: the build did not finish in time.
        RuntimeError: the build failed (the message ends with the compiler's last lines); the tools are missing
            (:func:`why_not_buildable`: no C++ compiler, no ninja, or for CUDA sources no nvcc or no CUDA build of
            torch); or another build of the same extension was already loaded in this process (after editing a
            source: restart the Python kernel).
    """
    library = library_path(spec, root)
    if _LOADED.get(spec.name) == library:
        return library
    if spec.name in _LOADED:
        raise RuntimeError(f"another build of {spec.name} ({_LOADED[spec.name].parent.name}) is already loaded in "
                           "this process and its operators cannot be registered twice: restart the Python kernel")
    directory = library.parent
    done = directory / "build.ok"  # written only after a child process built and loaded the library
    if not (done.exists() and library.exists()):
        missing = why_not_buildable(spec)
        if missing:
            raise RuntimeError(f"cannot build {spec.name} here: {missing}")
        _build_in_child(spec, directory, timeout_s)
        done.write_text(library.name)
    try:
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError) as err:
        raise RuntimeError(f"loading {library} failed: {err}") from err
    _LOADED[spec.name] = library
    return library


def _build_in_child(spec: ExtensionSpec, directory: Path, timeout_s: float) -> None:
    from utils.env import find_nvcc

    env = dict(os.environ)
    if spec.uses_cuda:
        nvcc = find_nvcc()
        if nvcc is None or torch.version.cuda is None:
            raise RuntimeError(f"{spec.name} has CUDA sources: it needs nvcc (the CUDA toolkit) and a CUDA build of "
                               f"torch; found nvcc={nvcc}, torch CUDA {torch.version.cuda}")
        env["TORCH_CUDA_ARCH_LIST"] = spec.arch  # this GPU's arch only: one device compile, not one per arch
        env.setdefault("CUDA_HOME", str(Path(nvcc).resolve().parents[1]))  # the toolkit that nvcc belongs to
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)  # for utils
    ninja = find_ninja()
    if ninja:  # torch runs plain `ninja`: a pip-installed one beside this Python must be on the child's PATH
        env["PATH"] = os.pathsep.join(p for p in (str(Path(ninja).parent), env.get("PATH")) if p)
    directory.mkdir(parents=True, exist_ok=True)
    args = {"name": spec.name, "sources": [str(p) for p in spec.sources], "extra_cflags": list(spec.extra_cflags),
            "extra_cuda_cflags": list(spec.extra_cuda_cflags) if spec.uses_cuda else None,
            "extra_include_paths": [str(p) for p in spec.include_dirs], "build_directory": str(directory),
            "is_python_module": False, "verbose": True}
    args_path = directory / "spec.json"
    args_path.write_text(json.dumps(args, indent=1))
    log = directory / "build.log"
    # This attempt's own log: where another process built the library while this one waited for the lock, ninja
    # finds nothing to do, and that log must not replace the one holding the compiler's (ptxas -v) lines.
    attempt = directory / f"build.{os.getpid()}.log"
    try:
        status = run_with_deadline([sys.executable, "-c", _CHILD, str(args_path)], timeout_s=timeout_s,
                                   log_path=attempt, env=env)
    except TimeoutError as err:
        waited = "waiting for another build" in attempt.read_text(errors="replace")
        os.replace(attempt, log)
        message = str(err).replace(str(attempt), str(log))
        if waited:
            message += f"; it was waiting for another build of the same directory, which holds " \
                       f"{directory / 'build.flock'}"
        raise TimeoutError(message) from None
    output = attempt.read_text(errors="replace").splitlines()
    if status == 0 and "ninja: no work to do." in output and log.exists():
        attempt.unlink()
    else:
        os.replace(attempt, log)
    if "removed a stale lock left by an interrupted build" in output:
        print(f"removed a stale lock left by an interrupted build in {directory}")
    if status != 0:
        tail = "\n".join(output[-25:])
        raise RuntimeError(f"building {spec.name} failed (exit {status}); full log {log}:\n{tail}")


# ── Looking inside a CUDA build ─────────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class KernelUsage:
    """What ptxas reported for one compiled kernel: registers per thread, spills and stack (bytes)."""

    kernel: str  # demangled where c++filt is available
    arch: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int


def demangle(names: Sequence[str]) -> list[str]:
    """C++ names as written (``c++filt``); the mangled names themselves where c++filt is not installed."""
    exe = shutil.which("c++filt") or shutil.which("cu++filt")
    if exe is None or not names:
        return list(names)
    try:
        out = subprocess.run([exe], input="\n".join(names), capture_output=True, text=True, timeout=30, check=True)
    except (subprocess.SubprocessError, OSError):
        return list(names)
    lines = out.stdout.splitlines()
    return lines if len(lines) == len(names) else list(names)


def ptxas_usage(log_or_directory: Path) -> list[KernelUsage]:
    """Registers and spills of every kernel, from the ``ptxas -v`` lines of a build log (``-Xptxas=-v``).

    Pass the build directory (its ``build.log``: the log of the last build that compiled something) or a log
    file. Returns [] when the log has no ptxas lines (built without ``-Xptxas=-v``).
    """
    path = Path(log_or_directory)
    log = path / "build.log" if path.is_dir() else path
    if not log.exists():
        return []
    found: list[dict] = []
    current: dict | None = None
    for line in log.read_text(errors="replace").splitlines():
        if m := re.search(r"Compiling entry function '(\S+)' for '(\w+)'", line):
            current = {"kernel": m.group(1), "arch": m.group(2), "stack_bytes": 0, "spill_stores": 0,
                       "spill_loads": 0}
            found.append(current)
        elif current is not None and (m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                                                     r"(\d+) bytes spill loads", line)):
            current.update(stack_bytes=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif current is not None and (m := re.search(r"Used (\d+) registers", line)):
            current["registers"] = int(m.group(1))
            current = None
    found = [f for f in found if "registers" in f]
    names = demangle([f["kernel"] for f in found])
    return [KernelUsage(**{**f, "kernel": name}) for f, name in zip(found, names, strict=True)]


def find_ncu() -> str | None:
    """Nsight Compute's command-line profiler (``ncu``): on PATH, else next to nvcc, else None."""
    from utils.env import find_nvcc

    exe = shutil.which("ncu")
    if exe:
        return exe
    nvcc = find_nvcc()
    if nvcc:
        candidate = Path(nvcc).resolve().parent / "ncu"
        if candidate.is_file():
            return str(candidate)
    return None


def run_ncu(command: Sequence[str], *, metrics: Sequence[str], kernel_regex: str | None = None,
            launch_count: int | None = None, profile_from_start: bool = True, timeout_s: float = 300.0,
            env: dict | None = None, log_path: Path | None = None) -> list[dict[str, object]]:
    """Profile the CUDA kernels that ``command`` launches with Nsight Compute; one dict per kernel launch:
    ``{"kernel": name, "id": launch number, <metric>: value, ...}`` (numbers as floats, in ncu's base units).

    Runs ``ncu --clock-control none`` (the GPU keeps the clocks it would have without the profiler, so counts
    per byte match the timed runs) with a deadline, like a build. Each launch is replayed once per group of
    metrics, so a few metrics on a few launches take seconds. ``profile_from_start=False`` profiles only the
    launches between ``torch.cuda.profiler.start()`` and ``stop()`` in the command (its warm-up stays out).

    Raises:
        RuntimeError: no ncu, or it failed (e.g. ``ERR_NVGPUCTRPERM``: this user may not read the GPU's
            performance counters; the message says so).
        TimeoutError: past ``timeout_s``.
    """
    exe = find_ncu()
    if exe is None:
        raise RuntimeError("Nsight Compute (ncu) is not installed: it ships with the CUDA toolkit")
    cmd = [exe, "--clock-control", "none", "--csv", "--page", "raw", "--metrics", ",".join(metrics)]
    if kernel_regex:
        cmd += ["--kernel-name", f"regex:{kernel_regex}"]
    if launch_count:
        cmd += ["--launch-count", str(launch_count)]
    if not profile_from_start:
        cmd += ["--profile-from-start", "off"]
    log = Path(log_path) if log_path is not None else BUILD_ROOT / "ncu" / f"ncu-{os.getpid()}.log"
    status = run_with_deadline([*cmd, *command], timeout_s=timeout_s, log_path=log, env=env)
    text = log.read_text(errors="replace")
    if "ERR_NVGPUCTRPERM" in text:
        raise RuntimeError("ncu may not read this GPU's performance counters (ERR_NVGPUCTRPERM): run as an "
                           "administrator or allow it (NVreg_RestrictProfilingToAdminUsers=0)")
    csv_lines = [line for line in text.splitlines() if line.startswith('"')]
    if status != 0 or len(csv_lines) < 2:
        tail = "\n".join(text.splitlines()[-15:])
        raise RuntimeError(f"ncu failed (exit {status}) or profiled no kernel; its output ({log}) ends:\n{tail}")
    rows = list(csv.DictReader(io.StringIO("\n".join(csv_lines))))
    units = rows[0] if rows and not str(rows[0].get("ID", "")).strip().isdigit() else None
    results = []
    for row in rows[1:] if units else rows:
        entry: dict[str, object] = {"kernel": row.get("Kernel Name", ""), "id": int(row.get("ID", len(results)))}
        for metric in metrics:
            value = str(row.get(metric, "")).replace(",", "")
            try:
                entry[metric] = float(value)
            except ValueError:
                entry[metric] = value
        results.append(entry)
    return results
