"""tools.parallel_nbmake (PARALLEL=1 bash .ci/gpu-run): one job per GPU at a time, then the all-GPU jobs.

A fake `python` stands in for the interpreter: it logs which GPUs each job saw and when it ran, sleeps, and fails
where a test asks it to, so the scheduling is checked on a machine without a GPU.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat
import pytest

from tools import course
from tools import parallel_nbmake as P

FAKE_PYTHON = """#!{python}
import json, os, sys, time
args = sys.argv[1:]
start = time.time()
time.sleep(float(os.environ.get("FAKE_SLEEP", "0.4")))
with open({log!r}, "a") as f:
    f.write(json.dumps({{"args": args, "gpus": os.environ["CUDA_VISIBLE_DEVICES"], "start": start,
                        "end": time.time(), "omp": os.environ.get("OMP_NUM_THREADS"),
                        "compile": os.environ.get("TORCHINDUCTOR_COMPILE_THREADS")}}) + "\\n")
print("fake pytest output for", args[-1])
sys.exit(5 if "-m" in args and "multi_gpu" in args and os.environ.get("FAKE_NO_MULTI") else
         1 if any("broken" in a for a in args) else 0)
"""


def _notebook(path: Path, all_gpus: bool = False) -> Path:
    nb = nbformat.v4.new_notebook()
    if all_gpus:
        nb.metadata["course"] = dict(P.ALL_GPUS)
    nbformat.write(nb, path)
    return path


@pytest.fixture(autouse=True)
def all_gpus_visible(monkeypatch):
    """These tests run inside a parallel run too, where their own job sees one GPU and a share of the cores:
    start from none named and no thread settings."""
    for name in ("CUDA_VISIBLE_DEVICES", *P.THREAD_SETTINGS):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def fake(tmp_path):
    log = tmp_path / "calls.jsonl"
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON.format(python=sys.executable, log=str(log)))
    python.chmod(0o755)

    def calls():
        return [json.loads(line) for line in log.read_text().splitlines()]

    return python, calls


def test_plan_sends_marked_notebooks_and_multi_gpu_tests_to_the_all_gpu_phase(tmp_path):
    a, b = _notebook(tmp_path / "00_a.ipynb"), _notebook(tmp_path / "10_b.ipynb", all_gpus=True)
    one, every = P.plan([a, b], cell_timeout=60, unit_tests=True)
    assert one[0].name == "unit tests" and one[0].args[:2] == ["-m", "not multi_gpu"] and one[0].args[-1] == "tests"
    assert [j.name for j in one[1:]] == ["00_a.ipynb"]
    assert one[1].args == ["--nbmake", "--nbmake-timeout=60", "--overwrite", str(a)]
    assert [j.name for j in every] == ["unit tests marked multi_gpu", "10_b.ipynb"] and all(j.all_gpus for j in every)
    assert P.plan([a], cell_timeout=60, unit_tests=False) == (P.plan([a], cell_timeout=60, unit_tests=True)[0][1:], [])


def test_plan_names_a_file_that_is_not_a_notebook(tmp_path):
    bad = tmp_path / "x.ipynb"
    bad.write_text("not json")
    with pytest.raises(ValueError, match=r"x\.ipynb: not a readable notebook"):
        P.plan([bad], cell_timeout=60, unit_tests=False)


def test_one_job_per_gpu_at_a_time_then_the_all_gpu_jobs_on_every_gpu(tmp_path, fake):
    python, calls = fake
    nbs = [_notebook(tmp_path / f"0{i}_nb.ipynb") for i in range(5)] + [_notebook(tmp_path / "10.ipynb", True)]
    one, every = P.plan(nbs, cell_timeout=60, unit_tests=True)
    lines = []
    outcomes = P.run(one, every, gpus=2, logs=tmp_path / "logs", python=str(python), cwd=tmp_path,
                     report=lines.append)
    assert all(o.passed for o in outcomes) and len(outcomes) == len(one) + len(every) == 8
    runs = calls()
    assert sorted(r["args"][-1] for r in runs) == sorted([*(str(n) for n in nbs), "tests", "tests"])
    singles = [r for r in runs if r["gpus"] != "0,1"]
    assert len(singles) == 6 and {r["gpus"] for r in singles} == {"0", "1"}  # both GPUs used, one at a time each
    for gpu in ("0", "1"):
        mine = sorted((r["start"], r["end"]) for r in singles if r["gpus"] == gpu)
        assert all(end <= next_start for (_, end), (next_start, _) in zip(mine, mine[1:], strict=False))
    first = sorted(singles, key=lambda r: r["start"])[:2]
    assert first[0]["end"] > first[1]["start"], "the two GPUs' first jobs should overlap in time"
    alls = [r for r in runs if r["gpus"] == "0,1"]
    assert len(alls) == 2 and min(r["start"] for r in alls) >= max(r["end"] for r in singles)
    assert all(line.startswith("[GPU ") and "passed in" in line for line in lines)
    assert (tmp_path / "logs" / "unit_tests.log").read_text().startswith("fake pytest output for tests")


def test_a_run_limited_to_some_gpus_stays_on_them(tmp_path, fake, monkeypatch):
    python, calls = fake
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    nbs = [_notebook(tmp_path / f"0{i}_nb.ipynb") for i in range(3)] + [_notebook(tmp_path / "10.ipynb", True)]
    one, every = P.plan(nbs, cell_timeout=60, unit_tests=False)
    lines = []
    P.run(one, every, gpus=2, logs=tmp_path / "logs", python=str(python), cwd=tmp_path, report=lines.append)
    seen = [r["gpus"] for r in calls()]
    assert set(seen[:-1]) == {"2", "3"} and seen[-1] == "2,3"
    assert {line.split("]")[0] for line in lines} == {"[GPU 2", "[GPU 3", "[GPU 2,3"}


def test_each_one_gpu_job_gets_its_share_of_the_cores_unless_the_run_sets_it(tmp_path, fake, monkeypatch):
    python, calls = fake
    monkeypatch.setattr(P.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    nbs = [_notebook(tmp_path / f"0{i}_nb.ipynb") for i in range(3)] + [_notebook(tmp_path / "10.ipynb", True)]
    one, every = P.plan(nbs, cell_timeout=60, unit_tests=False)
    P.run(one, every, gpus=2, logs=tmp_path / "logs", python=str(python), cwd=tmp_path, report=lambda _: None)
    runs = calls()
    assert [(r["omp"], r["compile"]) for r in runs[:-1]] == [("4", "4")] * 3  # 8 cores, 2 jobs at a time
    assert (runs[-1]["omp"], runs[-1]["compile"]) == (None, None)  # the all-GPU job runs alone: no share
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    (tmp_path / "calls.jsonl").unlink()
    P.run(one[:1], [], gpus=2, logs=tmp_path / "logs", python=str(python), cwd=tmp_path, report=lambda _: None)
    assert (calls()[0]["omp"], calls()[0]["compile"]) == ("3", "8")  # one job: all 8 cores; the run's OMP kept


def test_thread_share():
    assert P.thread_share(4, 64) == {"OMP_NUM_THREADS": "16", "TORCHINDUCTOR_COMPILE_THREADS": "16"}
    assert P.thread_share(4, 2)["OMP_NUM_THREADS"] == "1" and P.thread_share(0, None)["OMP_NUM_THREADS"] == "1"


def test_device_ids_follow_cuda_visible_devices():
    assert P.device_ids(3, None) == ["0", "1", "2"]
    assert P.device_ids(2, "4,5,6") == ["4", "5"]
    assert P.device_ids(1, "GPU-8f2c,") == ["GPU-8f2c"]  # UUIDs pass through as they are
    with pytest.raises(ValueError, match=r"2 GPU\(s\) asked for, but CUDA_VISIBLE_DEVICES='1' lists 1"):
        P.device_ids(2, "1")
    with pytest.raises(ValueError, match="lists 0"):
        P.device_ids(1, "")


def test_a_failed_job_is_reported_with_its_log_and_the_others_still_run(tmp_path, fake):
    python, calls = fake
    nbs = [_notebook(tmp_path / "01_ok.ipynb"), _notebook(tmp_path / "02_broken.ipynb"),
           _notebook(tmp_path / "03_ok.ipynb")]
    one, every = P.plan(nbs, cell_timeout=60, unit_tests=False)
    lines = []
    outcomes = P.run(one, every, gpus=2, logs=tmp_path / "logs", python=str(python), cwd=tmp_path,
                     report=lines.append)
    assert [o.job.name for o in outcomes if not o.passed] == ["02_broken.ipynb"] and len(calls()) == 3
    failed = next(i for i, line in enumerate(lines) if "FAILED" in line)
    assert "02_broken.ipynb: FAILED (exit 1" in lines[failed] and "fake pytest output" in lines[failed + 1]
    assert P.summary(outcomes, 1.0).startswith("parallel nbmake: 2 of 3 jobs passed")
    assert P.summary(outcomes, 1.0).endswith("failed: 02_broken.ipynb")


def test_no_multi_gpu_test_selected_is_not_a_failure(tmp_path, fake, monkeypatch):
    python, _ = fake
    monkeypatch.setenv("FAKE_NO_MULTI", "1")  # pytest's exit 5: the marker selected nothing
    one, every = P.plan([], cell_timeout=60, unit_tests=True)
    outcomes = P.run(one, every, gpus=1, logs=tmp_path / "logs", python=str(python), cwd=tmp_path,
                     report=lambda _: None)
    assert [o.passed for o in outcomes] == [True, True]


def test_main_exits_1_on_a_failure_and_refuses_no_gpu(tmp_path, fake, monkeypatch, capsys):
    python, _ = fake
    monkeypatch.setattr(P.sys, "executable", str(python))
    monkeypatch.chdir(tmp_path)
    broken = _notebook(tmp_path / "02_broken.ipynb")
    assert P.main(["--gpus", "1", "--logs", "logs", str(broken)]) == 1
    out = capsys.readouterr().out
    assert "not reference timings" in out and "0 of 1 jobs passed" in out
    with pytest.raises(SystemExit):
        P.main(["--gpus", "0", str(broken)])
    assert "no CUDA GPU visible" in capsys.readouterr().err


def test_only_the_notebooks_that_launch_several_processes_ask_for_every_gpu():
    for path in course.notebooks():
        nb = nbformat.read(path, as_version=4)
        # utils.distributed.launch starts torchrun, whose processes take a GPU each
        launches = any("distributed.launch(" in "".join(c.source) for c in nb.cells if c.cell_type == "code")
        assert P.uses_all_gpus(path) == launches, f"{path.name}: metadata.course.gpus"
