"""Steps that may crash or hang, run where they cannot take a notebook down; and, for the rest of a run, a record of
where its time went and of where a crash happened.

Prototype features (AOTInductor packages, a library that compiles behind your back, CUDA graph trees) can end a
process with a segmentation fault or an abort instead of an exception. In a notebook that kills the kernel: every
output of the run is lost and the reader — or ``nbmake`` — sees only "Kernel died". Three tools:

- :func:`run_script` runs a script of ``scripts/`` in a child process with a deadline (its own process group,
  killed whole at the deadline: :func:`utils.extension.run_with_deadline`) and returns a :class:`ChildRun`. It
  never raises for the child's failure: ``.result`` is the JSON the script wrote — also when it died half-way,
  since scripts write their progress after every stage (:class:`Progress`) — and ``.failure`` one line saying how
  it ended (the signal, the exception, the deadline) and in which stage. The child runs with ``faulthandler`` on,
  so a crash leaves its Python stack in ``.lines``.
- :func:`crash_traces` turns on :mod:`faulthandler` for this process, on its *real* standard error. Under Jupyter,
  file descriptor 2 (``sys.__stderr__``) is a pipe that a thread of the kernel itself forwards to the notebook; a
  crash kills that thread before it reads the pipe, so a plain ``faulthandler.enable()`` prints nothing anyone
  sees. ``sys.stderr.fileno()`` is the copy ipykernel kept of the original descriptor: the terminal that started
  Jupyter or, under ``nbmake``, the test's captured stderr, shown when the notebook fails.
- :class:`SectionClock` records each section's wall time, writes a line per section to that real stderr (a run
  that dies still says which section it was in) and arms a watchdog that dumps every thread's Python stack there
  when one section runs longer than expected (``faulthandler.dump_traceback_later``; the run goes on).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from utils.distributed import script_path
from utils.extension import run_with_deadline

DONE = "done"
"""The stage a script reports when it finished everything it had to do."""

#: Lines of a failed child's output that say why, most telling first (searched from the end of the output).
_CAUSES = (re.compile(r"\b[\w.]*(Error|Exception|Failed|Interrupt)\b: .*"),
           re.compile(r"terminate called .*|what\(\): .*"),
           re.compile(r"Fatal Python error: .*"))


# ── This process: crash traces and where the time went ───────────────────────────────────────────────────────


def real_stderr_fd() -> int:
    """The file descriptor of this process's real standard error: under ipykernel the copy it kept of the
    original (what ``sys.stderr.fileno()`` returns there), elsewhere ``sys.stderr``'s own, else 2."""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            return stream.fileno()
        except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both an OSError and a ValueError
            continue
    return 2


def crash_traces() -> int:
    """Print the Python stack of every thread to the real standard error if this process crashes (a segmentation
    fault, an abort, a bus error, ...), with :mod:`faulthandler`. Returns the file descriptor it writes to.

    A crash in native code ends a process without a Python traceback; with this on, the last lines it writes say
    which Python line it was in. In a notebook, call it once, early (see the module's docstring for why it does not
    use ``faulthandler.enable()``'s default file there)."""
    fd = real_stderr_fd()
    faulthandler.enable(file=fd, all_threads=True)
    return fd


class SectionClock:
    """Wall time per section of a run, a line per section on the real standard error, and a watchdog.

    ``clock.start("§3 The steps")`` ends the section before (if any) and starts this one; ``clock.stop()`` ends
    the last and freezes :attr:`total_s`; :meth:`rows` is the table of the sections. Each start writes a line
    such as ``[08_inference] +183.2 s: §3 The steps starts (§2 Memory took 12.0 s)`` to ``fd`` (default:
    :func:`real_stderr_fd`). With ``watchdog_s``, a section still running after that many seconds gets the Python
    stack of every thread dumped to ``fd`` once (``faulthandler.dump_traceback_later``, without exiting): where a
    slow run spent its time. There is one such timer per process; the clock re-arms it at every start and cancels
    it at stop. (Section names that start with a digit would be right-aligned as numbers by ``utils.plot.table``.)

    Raises:
        ValueError: for a watchdog of zero or fewer seconds.
    """

    def __init__(self, name: str, *, watchdog_s: float | None = None, fd: int | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if watchdog_s is not None and watchdog_s <= 0:
            raise ValueError(f"watchdog_s must be positive seconds or None, got {watchdog_s}")
        self.name, self.watchdog_s, self._clock = name, watchdog_s, clock
        self.fd = real_stderr_fd() if fd is None else fd
        self.begin = clock()
        self.sections: list[tuple[str, float]] = []  # finished sections: (name, seconds)
        self._current: tuple[str, float] | None = None
        self._stopped_at: float | None = None

    def _write(self, text: str) -> None:
        with contextlib.suppress(OSError):  # a closed stderr must not stop the run
            os.write(self.fd, f"[{self.name}] +{self._clock() - self.begin:.1f} s: {text}\n".encode())

    def _finish(self) -> str:
        if self._current is None:
            return ""
        name, started = self._current
        seconds = self._clock() - started
        self.sections.append((name, seconds))
        self._current = None
        return f"{name} took {seconds:.1f} s"

    def start(self, section: str) -> None:
        """End the running section (if any) and start ``section``."""
        previous = self._finish()
        self._current, self._stopped_at = (section, self._clock()), None
        self._write(f"{section} starts" + (f" ({previous})" if previous else ""))
        if self.watchdog_s is not None:
            faulthandler.dump_traceback_later(self.watchdog_s, repeat=False, file=self.fd, exit=False)

    def stop(self) -> None:
        """End the running section and cancel the watchdog."""
        if self.watchdog_s is not None:
            faulthandler.cancel_dump_traceback_later()
        previous = self._finish()
        self._stopped_at = self._clock()
        self._write(f"{previous}; {self.total_s:.1f} s since the clock started" if previous else "stopped")

    @property
    def total_s(self) -> float:
        """Seconds from the clock's creation to its stop (or to now, while it runs)."""
        return (self._clock() if self._stopped_at is None else self._stopped_at) - self.begin

    def rows(self) -> list[dict[str, object]]:
        """One table row per section (the running one so far), with its share of the time since the clock
        started."""
        sections = list(self.sections)
        if self._current is not None:
            sections.append((f"{self._current[0]} (running)", self._clock() - self._current[1]))
        total = max(self.total_s, 1e-9)
        return [{"section": name, "seconds": f"{seconds:.1f}", "share": f"{seconds / total:.0%}"}
                for name, seconds in sections]


# ── A child process ──────────────────────────────────────────────────────────────────────────────────────────


class Progress:
    """What a script has done so far, written as JSON to its ``--result`` file after every change (atomically: a
    reader never sees half a file), so that its parent reads the finished stages even when the script dies in the
    next one.

    ``progress.data`` is the dict written; ``progress.stage("load")`` records (and prints) the stage it enters;
    ``with progress.timed("compile"): ...`` does the same and adds the stage's seconds to ``data["seconds"]``;
    ``progress.save()`` writes ``data`` after you changed it; ``progress.done()`` marks the end (:data:`DONE`).
    ``path`` None: nothing is written (a script run by hand).
    """

    def __init__(self, path: str | Path | None) -> None:
        self.path = None if path is None else Path(path)
        self.data: dict[str, Any] = {"stage": "start", "seconds": {}}

    def save(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(self.path)

    def stage(self, name: str) -> None:
        self.data["stage"] = name
        self.save()
        print(f"▶ {name}", flush=True)

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        self.stage(name)
        start = time.perf_counter()
        yield
        self.data["seconds"][name] = time.perf_counter() - start
        self.save()

    def done(self) -> None:
        self.stage(DONE)


def describe_exit(returncode: int | None) -> str:
    """How a process ended, in words: ``killed by SIGSEGV (Segmentation fault)``, ``exit code 1``, ``exit code 0``.
    ``None`` (still running, or killed by us at a deadline): ``no exit code``."""
    if returncode is None:
        return "no exit code"
    if returncode < 0:
        try:
            sig = signal.Signals(-returncode)
        except ValueError:
            return f"killed by signal {-returncode}"
        return f"killed by {sig.name} ({signal.strsignal(sig) or 'no description'})"
    return f"exit code {returncode}"


#: faulthandler's header of one thread's stack: "Thread 0x00007f… (most recent call first):" for another thread,
#: "Current thread 0x00007f… (most recent call first):" for the one that crashed.
_THREAD_HEADER = re.compile(r"^(Current thread|Thread) 0x[0-9a-fA-F]+ \(most recent call first\):\s*$")


def crash_report_lines(lines: Sequence[str]) -> list[str]:
    """``lines`` of a child's output with faulthandler's crash report cut to the crashing thread: where the output
    has a "Current thread 0x… (most recent call first):" stack, the stacks of the other threads ("Thread 0x…"
    blocks: a compiler's worker pool, a progress bar) and the "Extension modules: …" line (a few hundred characters
    naming every loaded C module) are left out. A report without a current thread (a watchdog's dump of every
    thread) keeps all its stacks."""
    lines = list(lines)
    crashed = any(_THREAD_HEADER.match(line) and line.startswith("Current") for line in lines)
    kept: list[str] = []
    skipping = False
    for line in lines:
        header = _THREAD_HEADER.match(line)
        if header:
            skipping = crashed and header.group(1) == "Thread"
        elif skipping and not (line.startswith("  ") or not line.strip()):
            skipping = False  # the first line that is no frame (nor the blank line after a stack) ends the block
        if skipping or (crashed and line.startswith("Extension modules:")):
            continue
        kept.append(line)
    while kept and not kept[-1].strip():
        kept.pop()
    return kept


_LONG_PATH = re.compile(r"(?:/[^\s\"':]+)?/(?:site-packages|dist-packages)/")


def short_paths(lines: Sequence[str]) -> list[str]:
    """``lines`` with installed packages' paths cut to the package (``…/site-packages/torch/x.py`` → ``torch/x.py``)
    and this repository's own paths to their place in it (``/home/you/course/scripts/s.py`` → ``scripts/s.py``):
    what a reader needs of a stack, without the machine's layout."""
    root = str(Path(__file__).resolve().parent.parent) + os.sep
    return [_LONG_PATH.sub("", line).replace(root, "") for line in lines]


def failure_cause(lines: Sequence[str]) -> str | None:
    """The line of a failed child's output that best says why: its last exception, else a C++ abort's message,
    else faulthandler's ``Fatal Python error`` line."""
    for pattern in _CAUSES:
        for line in reversed(lines):
            match = pattern.search(line)
            if match:
                return match.group(0).strip()
    return None


@dataclass(frozen=True)
class ChildRun:
    """How a script run by :func:`run_script` ended, and what it reported."""

    script: str
    returncode: int | None  # None when it was killed at the deadline
    timed_out: bool
    timeout_s: float
    wall_s: float
    result: dict[str, Any] | None  # the JSON it wrote (its progress), or None if it wrote none
    lines: list[str] = field(default_factory=list)  # its output, stdout and stderr together

    @property
    def stage(self) -> str | None:
        """The last stage the script reported (``"done"`` when it finished)."""
        return (self.result or {}).get("stage")

    @property
    def ok(self) -> bool:
        """It exited with 0 before the deadline and reported :data:`DONE`."""
        return not self.timed_out and self.returncode == 0 and self.stage == DONE

    @property
    def failure(self) -> str | None:
        """None if :attr:`ok`; else one line: how it ended, in which stage, and the line of output that says why."""
        if self.ok:
            return None
        where = f" in stage '{self.stage}'" if self.stage not in (None, DONE) else ""
        if self.timed_out:  # the stage says where it was; its last lines are in tail()
            return f"{self.script} did not finish within {self.timeout_s:.0f} s and was stopped{where}"
        if self.returncode == 0:
            how = "exited without reporting that it finished"
        elif self.returncode is not None and self.returncode < 0:
            how = f"was {describe_exit(self.returncode)}"
        else:
            how = f"exited with code {self.returncode}"
        cause = failure_cause(self.lines)
        return f"{self.script} {how}{where} after {self.wall_s:.0f} s" + (f" — {cause}" if cause else "")

    def tail(self, n: int = 12) -> str:
        """Its last ``n`` lines of output, indented, with faulthandler's crash report cut to what says where: the
        crashing thread's stack (:func:`crash_report_lines`), file paths shortened (:func:`short_paths`), and a
        warning's echoed source line that lost its message (a lone ``warnings.warn(``) left out."""
        lines = [line for line in short_paths(crash_report_lines(self.lines)) if line.strip() != "warnings.warn("]
        return "\n".join(f"    {line}" for line in lines[-n:])


def run_script(script: str | Path, args: Sequence[object] = (), *, timeout_s: float,
               extra_env: dict[str, str] | None = None) -> ChildRun:
    """Run ``python script args --result PATH`` (``script``: a path, or a name in ``scripts/``) in a child process
    with this kernel's Python, its environment plus ``PYTHONUNBUFFERED=1``, ``PYTHONFAULTHANDLER=1`` and
    ``extra_env``, and wait at most ``timeout_s`` seconds.

    Returns a :class:`ChildRun` however the child ended — finished, failed, crashed or stopped at the deadline (its
    whole process group killed). Check ``.ok``; print ``.failure`` and ``.tail()`` when it is not.

    Raises:
        FileNotFoundError: for a script that does not exist. ValueError: for a timeout of zero or fewer seconds.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    path = script_path(script)
    work = Path(tempfile.mkdtemp(prefix=f"{path.stem}-"))
    result_path, log_path = work / "result.json", work / "output.log"
    cmd = [sys.executable, str(path), *map(str, args), "--result", str(result_path)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", **(extra_env or {})}
    start = time.perf_counter()
    try:
        try:
            returncode, timed_out = run_with_deadline(cmd, timeout_s=timeout_s, log_path=log_path, env=env), False
        except TimeoutError:  # the whole process group was killed
            returncode, timed_out = None, True
        wall_s = time.perf_counter() - start
        lines = log_path.read_text(errors="replace").splitlines() if log_path.is_file() else []
        try:
            result = json.loads(result_path.read_text()) if result_path.is_file() else None
        except json.JSONDecodeError:
            result = None
    finally:  # also on Ctrl-C, which run_with_deadline answers by killing the group
        shutil.rmtree(work, ignore_errors=True)
    return ChildRun(path.name, returncode, timed_out, timeout_s, wall_s, result, lines)
