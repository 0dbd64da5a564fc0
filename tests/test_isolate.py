"""utils.isolate: a child process that finishes, fails, crashes or overruns its deadline is reported, never raised,
with the stage it reached; faulthandler writes to the real stderr; the section clock times, logs and watches."""

import io
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from utils import isolate

ROOT = Path(__file__).resolve().parents[1]


def script(tmp_path: Path, body: str) -> Path:
    """A script that reports its progress with utils.isolate.Progress, then runs ``body``."""
    path = tmp_path / "child.py"
    path.write_text(textwrap.dedent(f"""\
        import os, signal, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from utils.isolate import Progress
        progress = Progress(sys.argv[sys.argv.index("--result") + 1])
        with progress.timed("load"):
            progress.data["loaded"] = True
        progress.stage("work")
    """) + textwrap.dedent(body))
    return path


def test_a_finished_script_returns_its_result(tmp_path):
    run = isolate.run_script(script(tmp_path, "print('hello'); progress.done()\n"), timeout_s=60)
    assert run.ok and run.failure is None and run.returncode == 0
    assert run.result["loaded"] is True and run.result["stage"] == isolate.DONE
    assert set(run.result["seconds"]) == {"load"}
    assert "hello" in run.lines and "▶ work" in run.lines


def test_a_segfault_is_reported_with_its_stage_and_python_stack(tmp_path):
    run = isolate.run_script(script(tmp_path, "os.kill(os.getpid(), signal.SIGSEGV)\n"), timeout_s=60)
    assert not run.ok and run.returncode == -11
    assert run.result["loaded"] is True, "the stages before the crash are still reported"
    assert run.failure.startswith("child.py was killed by SIGSEGV (Segmentation fault) in stage 'work'")
    assert "Fatal Python error: Segmentation fault" in run.failure  # faulthandler in the child (PYTHONFAULTHANDLER)
    assert any("child.py" in line for line in run.lines), "the Python stack names the line that crashed"


def test_the_tail_of_a_crash_shows_the_crashing_thread_only(tmp_path):
    """faulthandler dumps every thread and then names every loaded C module: the tail keeps the crashing stack."""
    body = """\
        import threading
        import numpy  # an extension module: faulthandler lists those after the stacks

        def idle_worker():
            time.sleep(60)

        def crash_here():
            os.kill(os.getpid(), signal.SIGSEGV)

        threading.Thread(target=idle_worker, daemon=True).start()
        time.sleep(0.2)
        crash_here()
    """
    run = isolate.run_script(script(tmp_path, body), timeout_s=60)
    assert run.returncode == -11 and any("idle_worker" in line for line in run.lines)  # all threads were dumped
    tail = run.tail(30)
    assert "Current thread" in tail and "crash_here" in tail and "Fatal Python error: Segmentation fault" in tail
    assert "idle_worker" not in tail and "Extension modules" not in tail and "\n    Thread 0x" not in tail


def test_short_paths_keep_what_a_reader_needs():
    root = str(Path(isolate.__file__).resolve().parent.parent)
    lines = ['  File "/opt/torch/.venv/lib/python3.12/site-packages/torch/_inductor/package/package.py", line 1045 in '
             "_load_aoti", f'  File "{root}/scripts/gpt2_export.py", line 45 in main', "plain text stays"]
    assert isolate.short_paths(lines) == ['  File "torch/_inductor/package/package.py", line 1045 in _load_aoti',
                                          '  File "scripts/gpt2_export.py", line 45 in main', "plain text stays"]


def test_crash_report_lines_keep_a_dump_without_a_current_thread():
    crash = ["▶ load", "Fatal Python error: Segmentation fault", "", "Thread 0x00007f01 (most recent call first):",
             '  File "pool.py", line 3 in worker', "", "Current thread 0x00007f02 (most recent call first):",
             '  File "run.py", line 9 in load', "", "Extension modules: numpy._core, torch._C (total: 2)", ""]
    assert isolate.crash_report_lines(crash) == [
        "▶ load", "Fatal Python error: Segmentation fault", "", "Current thread 0x00007f02 (most recent call first):",
        '  File "run.py", line 9 in load']
    watchdog = ["Timeout (0:05:00)!", "Thread 0x00007f01 (most recent call first):", '  File "a.py", line 1 in f',
                "", "Thread 0x00007f02 (most recent call first):", '  File "b.py", line 2 in g', "then more output"]
    assert isolate.crash_report_lines(watchdog) == watchdog  # no crash: every thread's stack stays


def test_an_abort_is_reported(tmp_path):
    run = isolate.run_script(script(tmp_path, "os.abort()\n"), timeout_s=60)
    assert run.returncode == -6 and "SIGABRT" in run.failure


def test_an_exception_is_reported_with_its_message(tmp_path):
    run = isolate.run_script(script(tmp_path, "raise RuntimeError('no AOTInductor here')\n"), timeout_s=60)
    assert run.returncode == 1 and not run.ok
    assert run.failure.startswith("child.py exited with code 1 in stage 'work' after")
    assert run.failure.endswith("— RuntimeError: no AOTInductor here")


def test_the_deadline_stops_the_whole_group(tmp_path):
    marker = tmp_path / "grandchild.pid"
    body = f"""\
        import subprocess
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open({str(marker)!r}, "w").write(str(p.pid))
        time.sleep(60)
    """
    start = time.perf_counter()
    run = isolate.run_script(script(tmp_path, body), timeout_s=20)  # room for importing torch on a busy machine
    assert time.perf_counter() - start < 50
    assert run.timed_out and run.returncode is None and not run.ok
    assert "did not finish within 20 s" in run.failure and "stage 'work'" in run.failure
    pid = int(marker.read_text())
    time.sleep(0.2)
    alive = Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
    assert not alive, "the grandchild must be killed with the group"


def test_exiting_without_finishing_is_a_failure(tmp_path):
    run = isolate.run_script(script(tmp_path, "sys.exit(0)\n"), timeout_s=60)
    assert not run.ok and "without reporting that it finished" in run.failure


def test_bad_arguments_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no script"):
        isolate.run_script("no_such_script.py", timeout_s=10)
    with pytest.raises(ValueError, match="timeout_s"):
        isolate.run_script(script(tmp_path, ""), timeout_s=0)
    with pytest.raises(ValueError, match="watchdog_s"):
        isolate.SectionClock("x", watchdog_s=0)


def test_describe_exit_and_failure_cause():
    assert isolate.describe_exit(-11).startswith("killed by SIGSEGV")
    assert isolate.describe_exit(2) == "exit code 2" and isolate.describe_exit(None) == "no exit code"
    lines = ["Fatal Python error: Aborted", "terminate called after throwing an instance of 'c10::Error'",
             "  what():  CUDA error: an illegal memory access was encountered"]
    # no Python exception line: the C++ exception's message says more than faulthandler's "Aborted"
    assert isolate.failure_cause(lines) == "what():  CUDA error: an illegal memory access was encountered"
    assert isolate.failure_cause(["x", "torch._dynamo.exc.BackendCompilerFailed: boom", "y"]).endswith("boom")
    assert isolate.failure_cause(["ValueError: first", "KeyError: last"]) == "KeyError: last"
    assert isolate.failure_cause(["nothing useful"]) is None


def test_real_stderr_prefers_the_kernels_copy_and_falls_back(monkeypatch):
    class KernelStream(io.StringIO):  # ipykernel's OutStream: fileno() is its copy of the original stderr
        def fileno(self):
            return 99

    monkeypatch.setattr(sys, "stderr", KernelStream())
    assert isolate.real_stderr_fd() == 99
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # fileno() raises io.UnsupportedOperation
    assert isolate.real_stderr_fd() == sys.__stderr__.fileno()


def test_crash_traces_print_the_python_stack_of_a_crash():
    code = ("import ctypes, utils.isolate\nutils.isolate.crash_traces()\n"
            "def crashing_function():\n    ctypes.string_at(0)\ncrashing_function()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == -11
    assert "Fatal Python error: Segmentation fault" in proc.stderr and "crashing_function" in proc.stderr


def test_section_clock_times_sections_and_writes_a_line_each():
    now = [100.0]
    read, write = os.pipe()
    clock = isolate.SectionClock("nb", fd=write, clock=lambda: now[0])
    clock.start("§1 load")
    now[0] += 2.0
    clock.start("§2 measure")
    now[0] += 6.0
    assert [r["section"] for r in clock.rows()] == ["§1 load", "§2 measure (running)"]
    clock.stop()
    now[0] += 50.0  # after stop the total stays put
    os.close(write)
    text = os.read(read, 10000).decode()
    os.close(read)
    assert clock.sections == [("§1 load", 2.0), ("§2 measure", 6.0)] and clock.total_s == 8.0
    assert clock.rows() == [{"section": "§1 load", "seconds": "2.0", "share": "25%"},
                            {"section": "§2 measure", "seconds": "6.0", "share": "75%"}]
    assert "[nb] +2.0 s: §2 measure starts (§1 load took 2.0 s)" in text
    assert "§2 measure took 6.0 s; 8.0 s since the clock started" in text


def test_section_clock_watchdog_dumps_the_stacks_of_a_slow_section(tmp_path):
    log = tmp_path / "stderr.txt"
    code = ("import time, utils.isolate\n"
            f"stream = open({str(log)!r}, 'w')\nfd = stream.fileno()\n"
            "clock = utils.isolate.SectionClock('nb', watchdog_s=0.3, fd=fd)\n"
            "def slow_section():\n    time.sleep(1.0)\n"
            "clock.start('§1 slow'); slow_section(); clock.start('§2 quick'); clock.stop(); time.sleep(0.5)\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)
    text = log.read_text()
    assert text.count("Timeout") == 1, "one dump, for the slow section only"
    assert "slow_section" in text


def test_progress_writes_atomically_and_by_hand_writes_nothing(tmp_path, capsys):
    progress = isolate.Progress(tmp_path / "r.json")
    with progress.timed("compile"):
        progress.data["x"] = 1
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["stage"] == "compile" and saved["x"] == 1 and saved["seconds"]["compile"] >= 0
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(RuntimeError), progress.timed("load"):
        raise RuntimeError("a failed stage stays the stage reached, without seconds")
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["stage"] == "load" and "load" not in saved["seconds"]
    isolate.Progress(None).done()  # a script run by hand: no file
    assert "▶ done" in capsys.readouterr().out
