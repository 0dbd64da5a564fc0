"""utils.extension: build keys from file contents, the stale-lock guard (and its graceful absence without fcntl),
the deadline that kills a whole process group, the build of a real extension from csrc/, and the readers of what
was built (ptxas registers, ncu's CSV). Runs on CPU; the CUDA build needs nvcc, the ncu test a GPU and ncu.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from utils import extension
from utils.env import find_nvcc

CUDA = torch.cuda.is_available()


@pytest.fixture
def sources(tmp_path):
    """A tiny extension's files in a scratch folder."""
    (tmp_path / "a.cpp").write_text("int a() { return 1; }\n")
    (tmp_path / "a.h").write_text("#pragma once\n")
    (tmp_path / "k.cu").write_text("__global__ void k() {}\n")
    return tmp_path


def test_spec_validates_its_inputs(sources):
    with pytest.raises(ValueError, match="identifier"):
        extension.ExtensionSpec("bad-name", (sources / "a.cpp",))
    with pytest.raises(FileNotFoundError, match="missing source files"):
        extension.ExtensionSpec("ext", (sources / "nope.cpp",))
    with pytest.raises(ValueError, match="no sources"):
        extension.ExtensionSpec("ext", ())
    with pytest.raises(ValueError, match="give the arch"):
        extension.ExtensionSpec("ext", (sources / "k.cu",))
    assert extension.ExtensionSpec("ext", (sources / "k.cu",), arch="9.0").uses_cuda


def test_build_directory_follows_contents_flags_and_arch(sources, tmp_path):
    spec = extension.ExtensionSpec("ext", (sources / "a.cpp", sources / "k.cu"), (sources / "a.h",), arch="9.0")
    first = extension.build_directory(spec, tmp_path)
    assert first == extension.build_directory(spec, tmp_path) and first.name.startswith("ext-")
    assert extension.build_directory(extension.ExtensionSpec(
        "ext", spec.sources, spec.headers, arch="8.0"), tmp_path) != first
    assert extension.build_directory(extension.ExtensionSpec(
        "ext", spec.sources, spec.headers, extra_cflags=("-O2",), arch="9.0"), tmp_path) != first
    (sources / "a.h").write_text("#pragma once\n// edited\n")  # a header's contents count, not only its name
    assert extension.build_directory(spec, tmp_path) != first


def test_build_guard_removes_a_stale_lock_and_excludes_other_builds(tmp_path):
    assert not (tmp_path / "lock").exists()
    with extension.build_guard(tmp_path) as removed:
        assert not removed  # nothing to remove
    (tmp_path / "lock").touch()  # what a build killed half-way leaves behind
    with extension.build_guard(tmp_path) as removed:
        assert removed and not (tmp_path / "lock").exists()
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="another build"), extension.build_guard(tmp_path, timeout_s=0.3):
            pass  # a second build of the same directory must wait for the first
        assert time.monotonic() - start < 5
    with extension.build_guard(tmp_path, timeout_s=0.3):  # the first one finished: free again
        pass


@pytest.mark.skipif(extension.fcntl is None, reason="needs fcntl (POSIX)")
def test_build_guard_is_released_when_its_holder_dies(tmp_path):
    holder = (f"import fcntl, time; f = open({str(tmp_path / 'build.flock')!r}, 'w'); "
              "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(TimeoutError), extension.build_guard(tmp_path, timeout_s=0.3):
            pass
    finally:
        proc.kill()  # SIGKILL: no cleanup code runs, the kernel drops the OS lock
        proc.wait()
    with extension.build_guard(tmp_path, timeout_s=2):
        pass


def test_without_fcntl_the_module_imports_and_the_guard_says_it_is_off(tmp_path, monkeypatch, capsys):
    """Windows has no fcntl: importing must work, and the guard must degrade with a message, not fail."""
    monkeypatch.setitem(sys.modules, "fcntl", None)  # `import fcntl` now raises ImportError
    spec = importlib.util.spec_from_file_location("extension_without_fcntl", extension.__file__)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    assert module.fcntl is None
    (tmp_path / "lock").touch()
    with module.build_guard(tmp_path, timeout_s=0.1) as removed:
        assert removed is False
    assert (tmp_path / "lock").exists(), "without an OS lock a lock file may belong to a running build: keep it"
    out = capsys.readouterr().out
    assert "build guard off" in out and "no fcntl" in out and str(tmp_path / "lock") in out


def test_deadline_kills_the_whole_process_group(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    child = (f"import subprocess, time; p = subprocess.Popen(['sleep', '60']); "
             f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="killed with its children"):
        extension.run_with_deadline([sys.executable, "-c", child], timeout_s=1.5, log_path=tmp_path / "log")
    assert time.monotonic() - start < 10
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # the grandchild (think: nvcc) must be gone too, not only the Python child
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"grandchild {grandchild} survived the deadline")
    assert extension.run_with_deadline([sys.executable, "-c", "print('hi')"], timeout_s=30,
                                       log_path=tmp_path / "l2") == 0
    assert (tmp_path / "l2").read_text().strip() == "hi"


# ── A real build: the course's CPU extension (shared with tests/test_bias_gelu.py and notebook 06) ─────────


@pytest.fixture(scope="module")
def cpu_spec():
    from utils import bias_gelu as bg

    bg.build_extension("cpu")
    return bg.extension_spec("cpu")


def test_build_loads_once_and_marks_the_directory_done(cpu_spec):
    library = extension.build(cpu_spec)
    assert library == extension.library_path(cpu_spec) and library.exists()
    assert (library.parent / "build.ok").exists() and hasattr(torch.ops.course_ext, "bias_gelu_cpu")
    assert extension.build(cpu_spec) == library  # already loaded: nothing to do


def test_loading_a_second_build_of_one_extension_is_refused_clearly(cpu_spec, tmp_path):
    with pytest.raises(RuntimeError, match="restart the Python kernel"):
        extension.build(cpu_spec, root=tmp_path)


def test_stale_lock_does_not_hang_the_next_build(cpu_spec, capsys):
    """An interrupted build's lock in the real build directory: the next build removes it and finishes."""
    directory = extension.build_directory(cpu_spec)
    (directory / "lock").touch()
    log = (directory / "build.log").read_text()
    extension._build_in_child(cpu_spec, directory, timeout_s=120)  # up to date: ninja has nothing to do
    assert "removed a stale lock" in capsys.readouterr().out
    # a build that compiled nothing (here; or one that waited while another process built) keeps the log of the
    # build that compiled (its ptxas lines, its times): on the GPU, pytest -n 4 had lost them that way
    assert (directory / "build.log").read_text() == log
    assert not list(directory.glob("build.*.log"))


def test_a_running_build_is_waited_for_only_until_the_deadline(cpu_spec, tmp_path):
    start = time.monotonic()
    # another build of this directory is running (this process holds the guard): the child waits, then is killed
    with extension.build_guard(tmp_path), pytest.raises(TimeoutError, match="did not finish within 6 s") as caught:
        extension._build_in_child(cpu_spec, tmp_path, timeout_s=6)
    assert time.monotonic() - start < 30
    if "waiting for another build" in (tmp_path / "build.log").read_text():  # the child got that far (not on a
        assert "waiting for another build" in str(caught.value)  # loaded machine, where importing takes longer)


def test_a_failing_build_shows_the_compiler_error(tmp_path):
    bad = tmp_path / "bad.cpp"
    bad.write_text("this is not C++\n")
    spec = extension.ExtensionSpec("course_bad_ext", (bad,), include_dirs=(tmp_path,))
    with pytest.raises(RuntimeError, match=r"building course_bad_ext failed .*\n(.|\n)*error"):
        extension.build(spec, root=tmp_path, timeout_s=120)


# ── Reading what was built ─────────────────────────────────────────────────────────────────────────────────────


def test_ptxas_usage_parses_registers_and_spills(tmp_path):
    (tmp_path / "build.log").write_text(textwrap.dedent("""\
        ptxas info    : 0 bytes gmem
        ptxas info    : Compiling entry function '_Z3fooPf' for 'sm_90'
        ptxas info    : Function properties for _Z3fooPf
            24 bytes stack frame, 10 bytes spill stores, 20 bytes spill loads
        ptxas info    : Used 56 registers, used 0 barriers, 24 bytes cumulative stack size
        ptxas info    : Compiling entry function '_Z3barv' for 'sm_90'
        ptxas info    : Function properties for _Z3barv
            0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
        ptxas info    : Used 8 registers, used 0 barriers
        """))
    found = extension.ptxas_usage(tmp_path)
    assert [(u.registers, u.spill_stores, u.spill_loads, u.stack_bytes, u.arch) for u in found] == [
        (56, 10, 20, 24, "sm_90"), (8, 0, 0, 0, "sm_90")]
    assert found[0].kernel in ("foo(float*)", "_Z3fooPf")  # demangled where c++filt is installed
    assert extension.ptxas_usage(tmp_path / "missing") == []


def test_run_ncu_without_ncu_says_so(monkeypatch):
    monkeypatch.setattr(extension, "find_ncu", lambda: None)
    with pytest.raises(RuntimeError, match="Nsight Compute"):
        extension.run_ncu(["true"], metrics=["gpu__time_duration.sum"])


def test_run_ncu_parses_its_csv(monkeypatch, tmp_path):
    """ncu's --csv --page raw output: a header, a units row, one row per launch; other lines ignored."""
    fake = tmp_path / "ncu"
    fake.write_text("#!/bin/sh\n" + textwrap.dedent("""\
        echo '==PROF== Connected to process'
        echo '"ID","Kernel Name","gpu__time_duration.sum","smsp__inst_executed.sum"'
        echo '"","","nsecond","inst"'
        echo '"0","copy_kernel","1,234","5000"'
        echo '"1","gelu","99","n/a"'
        echo 'LABELS ["a"]'
        """))
    fake.chmod(0o755)
    monkeypatch.setattr(extension, "find_ncu", lambda: str(fake))
    rows = extension.run_ncu(["true"], metrics=["gpu__time_duration.sum", "smsp__inst_executed.sum"],
                             log_path=tmp_path / "ncu.log")
    assert rows == [{"kernel": "copy_kernel", "id": 0, "gpu__time_duration.sum": 1234.0,
                     "smsp__inst_executed.sum": 5000.0},
                    {"kernel": "gelu", "id": 1, "gpu__time_duration.sum": 99.0, "smsp__inst_executed.sum": "n/a"}]


def test_run_ncu_explains_missing_counter_permission(monkeypatch, tmp_path):
    fake = tmp_path / "ncu"
    fake.write_text("#!/bin/sh\necho '==ERROR== ERR_NVGPUCTRPERM - The user does not have permission'\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(extension, "find_ncu", lambda: str(fake))
    with pytest.raises(RuntimeError, match="performance counters"):
        extension.run_ncu(["true"], metrics=["x"], log_path=tmp_path / "ncu.log")


@pytest.mark.skipif(find_nvcc() is None or torch.version.cuda is None, reason="needs nvcc and a CUDA build of torch")
def test_cuda_build_reports_registers_per_kernel():
    """nvcc compiles the CUDA sources without a GPU too; ptxas -v's registers land in the build log."""
    from utils import bias_gelu as bg

    arch = extension.cuda_arch() if CUDA else "9.0"
    bg.build_extension("cuda", arch=arch)
    usage = bg.cuda_kernel_usage(torch.bfloat16, arch=arch)
    assert list(usage) == list(bg.CUDA_VARIANTS), usage
    assert all(8 <= u.registers <= 255 and u.spill_stores == 0 for u in usage.values())


def test_quiet_cuda_home_notice_silences_only_the_import(monkeypatch):
    import logging
    import sys

    import torch

    from utils import extension as ext

    logger, seen = logging.getLogger("torch.utils.cpp_extension"), []
    monkeypatch.delitem(sys.modules, "torch.utils.cpp_extension", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(ext.importlib, "import_module", lambda name: seen.append((name, logger.level)))
    level = logger.level
    ext.quiet_cuda_home_notice()
    assert seen == [("torch.utils.cpp_extension", logging.ERROR)] and logger.level == level
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU: nothing to quiet
    ext.quiet_cuda_home_notice()
    assert len(seen) == 1
