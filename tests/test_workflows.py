"""The CI workflows: valid for GitHub (its workflow schema), clean under zizmor's audits, and doing what README says:
the CPU workflow runs .ci/run on every push and pull request with pip caching; the GPU workflow runs .ci/gpu-run on
a self-hosted GPU runner, manually and on a schedule, and uploads what it executed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tools import course

WORKFLOWS = sorted((course.ROOT / ".github" / "workflows").glob("*.yml"))
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    """The dev tool installed next to this Python (the README's set-up), else the one on PATH (a --target install)."""
    beside = BIN / name
    return str(beside) if beside.exists() else shutil.which(name) or str(beside)


def load(name: str) -> dict:
    text = (course.ROOT / ".github" / "workflows" / name).read_text()
    data = yaml.safe_load(text)
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads the key `on` as True
    return data


def steps(job: dict) -> list[dict]:
    return job["steps"]


def test_there_are_a_cpu_and_a_gpu_workflow():
    assert {p.name for p in WORKFLOWS} == {"cpu.yml", "gpu.yml"}


@pytest.mark.parametrize("path", WORKFLOWS, ids=[p.name for p in WORKFLOWS])
def test_workflow_matches_githubs_schema(path):
    result = subprocess.run([tool("check-jsonschema"), "--builtin-schema", "vendor.github-workflows", str(path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_workflows_pass_zizmor_audits():
    """zizmor: template injection, credentials left in checkouts, unpinned actions, excessive permissions, ..."""
    result = subprocess.run([tool("zizmor"), "--offline", "--no-progress", str(course.ROOT / ".github")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_cpu_workflow_runs_the_readme_test_command_on_every_push():
    cpu = load("cpu.yml")
    assert {"push", "pull_request"} <= set(cpu["on"])
    job = cpu["jobs"]["test"]
    assert job["runs-on"] == "ubuntu-latest"
    setup = next(s for s in steps(job) if s.get("uses", "").startswith("actions/setup-python@"))
    assert setup["with"]["cache"] == "pip" and setup["with"]["cache-dependency-path"] == "requirements.txt"
    assert any(s.get("run") == "bash .ci/run" for s in steps(job))
    assert job["timeout-minutes"] >= 90  # the CI budget: 90 minutes on 2 cores


def test_gpu_workflow_runs_gpu_run_on_a_self_hosted_gpu_runner():
    gpu = load("gpu.yml")
    assert {"workflow_dispatch", "schedule"} <= set(gpu["on"])
    job = gpu["jobs"]["nbmake"]
    assert {"self-hosted", "gpu"} <= set(job["runs-on"])
    assert any("bash .ci/gpu-run" in s.get("run", "") for s in steps(job))
    upload = next(s for s in steps(job) if s.get("uses", "").startswith("actions/upload-artifact@"))
    assert upload["if"] == "always()" and "build/gpu-run/notebooks/*.ipynb" in upload["with"]["path"]
    assert "build/gpu-run/results/*.json" in upload["with"]["path"]
    reference = gpu["jobs"]["reference-run"]
    assert reference["if"] == "inputs.reference_run" and reference["needs"] == "nbmake"


def test_actions_are_pinned_to_commits():
    for path in WORKFLOWS:
        for job in yaml.safe_load(path.read_text())["jobs"].values():
            for step in job["steps"]:
                if "uses" in step:
                    ref = step["uses"].rsplit("@", 1)[1]
                    assert len(ref) == 40 and all(c in "0123456789abcdef" for c in ref), f"{path.name}: {step['uses']}"


def test_gpu_run_refuses_a_machine_without_a_gpu(tmp_path):
    if shutil.which("git") is None or shutil.which("tar") is None:
        pytest.skip("needs git and tar")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal is for CPU-only machines")
    result = subprocess.run(["bash", str(course.ROOT / ".ci" / "gpu-run")], capture_output=True, text=True,
                            timeout=120, env=_gpu_run_env(PYTHON=sys.executable))
    assert result.returncode == 2 and "sees no CUDA GPU" in result.stderr and "bash .ci/run" in result.stderr


def test_gpu_run_needs_a_python(tmp_path):
    result = subprocess.run(["bash", str(course.ROOT / ".ci" / "gpu-run")], capture_output=True, text=True,
                            timeout=60, env=_gpu_run_env(PYTHON=str(tmp_path / "no-python")))
    assert result.returncode == 2 and "not found" in result.stderr


def _gpu_run_env(**settings):
    """The environment for a gpu-run under test: this process's, without gpu-run's own settings (the suite itself
    runs inside `PARALLEL=1 bash .ci/gpu-run` on a GPU machine), plus ``settings``."""
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHON", "PARALLEL", "UNIT_TESTS", "CELL_TIMEOUT"}}
    return {**env, **settings}


def _checkout_with_gpu_run(tmp_path, files):
    """A git checkout in tmp_path holding .ci/gpu-run and `files` (name -> text), committed: gpu-run replaces its
    build/gpu-run, so tests run it here, never in the course's checkout (whose executed notebooks it would delete)."""
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    shutil.copy(course.ROOT / ".ci" / "gpu-run", repo / ".ci" / "gpu-run")
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "one"]):
        subprocess.run(git + args, check=True, capture_output=True)
    return repo


@pytest.mark.parametrize("outer", [{}, {"PARALLEL": "1", "CELL_TIMEOUT": "60"}], ids=["plain", "inside-a-parallel-run"])
def test_gpu_run_collects_only_the_notebooks_it_executed(tmp_path, monkeypatch, outer):
    """The other copies in build/gpu-run carry the reference GPU's committed outputs: their figures must not be
    filed under this GPU's name (a run of 04 alone once wrote the H200's figures of 00-02 into results/h100.json).
    Run from a suite that `PARALLEL=1 bash .ci/gpu-run` started, the gpu-run under test must not inherit its mode
    (it once did, and took the parallel path)."""
    for name, value in outer.items():
        monkeypatch.setenv(name, value)
    if shutil.which("git") is None or shutil.which("tar") is None:
        pytest.skip("needs git and tar")
    repo = _checkout_with_gpu_run(tmp_path, {"notebooks/00_install_check.ipynb": "{}\n",
                                             "notebooks/04_torch_compile.ipynb": "{}\n"})
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "python"  # stands in for the GPU machine's Python: says CUDA is there, logs what it is asked
    fake.write_text(f'#!/bin/sh\necho "$*" >> {calls}\nexit 0\n')
    fake.chmod(0o755)
    result = subprocess.run(["bash", str(repo / ".ci" / "gpu-run"), "notebooks/04_torch_compile.ipynb"],
                            capture_output=True, text=True, timeout=120,
                            env=_gpu_run_env(PYTHON=str(fake), UNIT_TESTS="0"))
    assert result.returncode == 0, result.stderr
    collect = [line for line in calls.read_text().splitlines() if "--collect-only" in line]
    assert collect == ["-m tools.reference_run --collect-only --machine machine.json --results-dir results "
                       "notebooks/04_torch_compile.ipynb"]
    pytest_call = [line for line in calls.read_text().splitlines() if line.startswith("-m pytest")]
    assert pytest_call and pytest_call[0].endswith("--overwrite notebooks/04_torch_compile.ipynb")
    assert (repo / "build" / "gpu-run" / "notebooks" / "00_install_check.ipynb").exists()


def test_gpu_run_parallel_mode_hands_the_notebooks_to_the_queue(tmp_path):
    """PARALLEL=1 bash .ci/gpu-run: the notebooks (a directory expanded) and the unit tests go to
    tools.parallel_nbmake, and machine.json is written with --shared-host (its timings are not for --stamp-executed;
    the run records collected from it say so)."""
    if shutil.which("git") is None or shutil.which("tar") is None:
        pytest.skip("needs git and tar")
    repo = _checkout_with_gpu_run(tmp_path, {"notebooks/00_a.ipynb": "{}\n", "notebooks/10_b.ipynb": "{}\n"})
    log = tmp_path / "calls.txt"
    fake = tmp_path / "python"  # says CUDA is there, logs what it is asked
    fake.write_text(f'#!/bin/sh\necho "$*" >> {log}\nexit 0\n')
    fake.chmod(0o755)
    result = subprocess.run(["bash", str(repo / ".ci" / "gpu-run")], capture_output=True, text=True, timeout=120,
                            env=_gpu_run_env(PYTHON=str(fake), PARALLEL="1", CELL_TIMEOUT="99"))
    assert result.returncode == 0, result.stderr
    calls = log.read_text().splitlines()
    assert not any(c.startswith("-m pytest") for c in calls)
    assert [c for c in calls if "--write-machine" in c] == ["-m tools.reference_run --write-machine machine.json "
                                                              "--shared-host"]
    queued = [c for c in calls if c.startswith("-m tools.parallel_nbmake")]
    assert queued == ["-m tools.parallel_nbmake --cell-timeout 99 --logs logs --unit-tests "
                      "notebooks/00_a.ipynb notebooks/10_b.ipynb"]


def test_gpu_run_copies_what_git_tracks_or_would_track(tmp_path):
    """A checkout whose index is stale (a working tree copied to a GPU machine with an older .git) still brings its
    new files: untracked ones that git does not ignore are copied too; ignored ones and deleted tracked ones are not."""
    if shutil.which("git") is None or shutil.which("tar") is None:
        pytest.skip("needs git and tar")
    repo = _checkout_with_gpu_run(tmp_path, {".gitignore": "build/\nscratch.txt\n", "tracked.py": "x = 1\n",
                                             "deleted.py": "y = 2\n"})
    (repo / "deleted.py").unlink()
    (repo / "new_module.py").write_text("z = 3\n")  # never added: what a stale index does not list
    (repo / "scratch.txt").write_text("ignored\n")
    fake = tmp_path / "python"  # says CUDA is there and does nothing else
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    result = subprocess.run(["bash", str(repo / ".ci" / "gpu-run")], capture_output=True, text=True, timeout=120,
                            env=_gpu_run_env(PYTHON=str(fake), UNIT_TESTS="0"))
    assert result.returncode == 0, result.stderr
    copied = {p.name for p in (repo / "build" / "gpu-run").iterdir()}
    assert {"tracked.py", "new_module.py", ".gitignore"} <= copied
    assert not {"scratch.txt", "deleted.py", "build"} & copied


def test_readme_documents_both_runs_and_the_badge():
    readme = (course.ROOT / "README.md").read_text()
    assert f"{course.repo_url()}/actions/workflows/cpu.yml/badge.svg" in readme
    assert "bash .ci/gpu-run" in readme and "self-hosted" in readme and "tools.reference_run" in readme
