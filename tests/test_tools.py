"""tools/: the stamp hash and Run-time line, the reference-run tool (on CPU, --allow-cpu), README's generated
results, targets and charts."""

from __future__ import annotations

import hashlib
import json

import nbformat
import pytest

from tools import course, readme_tables, reference_run
from utils import env, results


def _notebook(*code_cells: str, markdown: str = "# 99 · Test") -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(markdown)] + [nbformat.v4.new_code_cell(c) for c in code_cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def test_sources_sha256_follows_the_documented_formula():
    nb = _notebook("x = 1\ny = 2", "print(x)")
    expected = hashlib.sha256(json.dumps(
        [["markdown", "# 99 · Test"], ["code", "x = 1\ny = 2"], ["code", "print(x)"]]).encode()).hexdigest()
    assert course.sources_sha256(nb) == expected
    # a list-of-lines source hashes like the joined string; outputs do not count
    nb.cells[1].source = ["x = 1\n", "y = 2"]
    nb.cells[2].outputs = [nbformat.v4.new_output("stream", text="1\n")]
    assert course.sources_sha256(nb) == expected
    nb.cells[2].source = "print(y)"
    assert course.sources_sha256(nb) != expected


def test_sources_sha256_leaves_out_the_run_time_line_alone():
    """The stamp writes the title's Run-time line, so its text does not count; the rest of the title does."""
    title = "# 99 · Test\n\n**Runs on:** CPU · any GPU.\n**Run time:** {}\n\nMore."
    hashes = {course.sources_sha256(_notebook("x = 1", markdown=title.format(text)))
              for text in ("about a minute\non a GPU.", course.RUN_TIME_UNMEASURED.removeprefix("**Run time:** "))}
    assert len(hashes) == 1
    assert course.sources_sha256(_notebook("x = 1", markdown=title.format("a minute").replace("More", "Less"))) \
        not in hashes
    assert course.sources_sha256(_notebook("x = 1", markdown=title.format("a minute").replace("CPU", "GPU"))) \
        not in hashes
    # the label itself counts (a title without the line is another title), and only in the title cell
    assert course.sources_sha256(_notebook("x = 1", markdown="# 99 · Test\n\n**Runs on:** CPU · any GPU.\n\nMore.")) \
        not in hashes


def test_run_time_line_from_the_stamp():
    stamp = {"date": "2026-11-28", "gpu": "NVIDIA H200", "gpus": 1, "cpus": 16, "wall_s": 126.0}
    budget = "on a CPU-only machine it is sized to finish within 2 minutes."
    assert course.run_time_line(stamp) == (
        f"**Run time:** 2.1 min on one NVIDIA H200 with 16 CPU cores (reference run, 2026-11-28); {budget}")
    assert course.run_time_line({**stamp, "wall_s": 95.4, "gpus": 2, "cpus": None}) == (
        f"**Run time:** 95 s on 2 × NVIDIA H200 (reference run, 2026-11-28); {budget}")
    assert course.run_time_line({**stamp, "shared_host": True}) == (
        f"**Run time:** 2.1 min on one NVIDIA H200 with 16 CPU cores (reference run beside other notebooks, each on "
        f"its own GPU, 2026-11-28); {budget}")
    unmeasured = f"**Run time:** not yet measured on a GPU by a reference run; {budget}"
    assert course.run_time_line(None) == unmeasured == course.RUN_TIME_UNMEASURED
    assert course.run_time_line({**stamp, "wall_s": None}) == unmeasured  # a stamp from before wall times


def test_sync_rewrites_the_run_time_paragraph_from_the_stamp():
    title = ("# 99 · Test\n\n**Runs on:** CPU · any GPU.\n**Run time:** about a minute on a GPU,\n"
             "more on a T4; under a minute on CPU.\n\n- a list after it")
    nb = _notebook("x = 1", markdown=title)
    before = course.sources_sha256(nb)
    assert course.sync_run_time_line(nb) and not course.sync_run_time_line(nb)
    assert course.cell_source(nb.cells[0]) == (
        f"# 99 · Test\n\n**Runs on:** CPU · any GPU.\n{course.RUN_TIME_UNMEASURED}\n\n- a list after it")
    stamp = {"date": "2026-11-28", "gpu": "NVIDIA H100 80GB HBM3", "gpus": 1, "cpus": 2, "wall_s": 30.0}
    nb.metadata["reference_run"] = stamp
    assert not course.sync_run_time_line(nb), "a stamp without outputs is not a run the notebook shows"
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", text="1\n")]
    assert course.sync_run_time_line(nb)
    assert course.run_time_line(stamp) in course.cell_source(nb.cells[0])
    assert course.sources_sha256(nb) == before
    untitled = _notebook("x = 1", markdown="# 99 · Test")
    assert course.sync_run_time_line(untitled)
    assert course.cell_source(untitled.cells[0]) == f"# 99 · Test\n{course.RUN_TIME_UNMEASURED}"


def test_colab_url_points_at_the_notebook():
    path = course.NOTEBOOK_DIR / "00_install_check.ipynb"
    assert course.colab_url(path) == (
        f"https://colab.research.google.com/github/{course.repo_slug()}/blob/main/notebooks/00_install_check.ipynb")


RECORDING_CELL = (
    "import sys\n"
    f"sys.path.insert(0, {str(course.ROOT)!r})\n"
    "import utils\n"
    "utils.results.record('answer_gbps', 42.5, 'GB/s')\n"
    "utils.results.record('speedup', 2.0, 'x')"
)


STAMP_FIELDS = {"sources_sha256", "gpu", "gpus", "cpus", "torch", "cuda", "date", "wall_s"}
FIGURES = {"answer_gbps": {"value": 42.5, "unit": "GB/s"}, "speedup": {"value": 2.0, "unit": "x"}}


def test_reference_run_executes_stamps_and_collects(tmp_path, capsys):
    path = tmp_path / "99_test.ipynb"
    nbformat.write(_notebook(RECORDING_CELL, markdown="# 99 · Test\n**Run time:** old text"), path)
    results_dir = tmp_path / "results"
    assert reference_run.main([str(path), "--allow-cpu", "--results-dir", str(results_dir)]) == 0

    nb = nbformat.read(path, as_version=4)
    stamp = nb.metadata["reference_run"]
    assert set(stamp) == STAMP_FIELDS == set(results.RUN_FIELDS)
    assert stamp["sources_sha256"] == course.sources_sha256(nb)
    machine, slug = reference_run.machine_stamp(allow_cpu=True)  # "cpu" here; the GPU on a GPU machine
    assert stamp["gpu"] == machine["gpu"] and stamp["gpus"] == min(machine["gpus"], 1)
    assert stamp["cpus"] == env.usable_cpus() >= 1
    assert 0 < stamp["wall_s"] < 120
    assert course.has_outputs(nb) and not any("execution" in cell.metadata for cell in nb.cells)
    assert course.cell_source(nb.cells[0]) == f"# 99 · Test\n{course.run_time_line(stamp)}"
    assert json.loads((results_dir / f"{slug}.json").read_text()) == {"99_test": {"run": stamp, "figures": FIGURES}}
    assert "ok 99_test.ipynb" in capsys.readouterr().out


def test_recorded_results_keep_band_and_limit():
    """A figure recorded with its band and limit is filed with them (the payload utils.results displays)."""
    nb = _notebook("")
    figure = results.Result("copy_gbps", 3000.0, "GB/s", band=(2900.0, 3100.0), limit=3350.0, limit_name="sheet")
    nb.cells[1].outputs = [nbformat.v4.new_output("display_data", data={
        "text/plain": f"📌 {figure}", results.MIME_TYPE: {"name": "copy_gbps", **figure.payload()}})]
    assert reference_run.recorded_results(nb) == {"copy_gbps": {"value": 3000.0, "unit": "GB/s",
                                                                "band": [2900.0, 3100.0],
                                                                "limit": {"name": "sheet", "value": 3350.0}}}


def test_wall_seconds_span_the_cells_timings():
    nb = _notebook("a", "b", "c")
    nb.cells[1].metadata["execution"] = {"iopub.execute_input": "2026-11-28T10:00:00.500Z",
                                         "shell.execute_reply": "2026-11-28T10:01:00Z"}
    nb.cells[3].metadata["execution"] = {"iopub.execute_input": "2026-11-28T10:01:00.100Z",
                                         "shell.execute_reply": "2026-11-28T10:02:05.000Z"}
    assert reference_run.wall_seconds(nb) == 124.5  # cell 2 has no timings: not counted, not a failure
    assert reference_run.slowest_cells(nb) == [(3, 64.9), (1, 59.5)]
    reference_run.drop_cell_timings(nb)
    assert reference_run.wall_seconds(nb) is None
    assert reference_run.slowest_cells(nb) == []


def test_run_record_counts_the_gpus_a_notebook_used():
    machine = {"gpu": "NVIDIA H200", "gpus": 4, "cpus": 64, "torch": "2.11", "cuda": "13.0", "date": "2026-11-28"}
    one, every = _notebook("x = 1"), _notebook("x = 1")
    every.metadata["course"] = {"gpus": "all"}
    assert reference_run.run_record(one, machine)["gpus"] == 1
    assert reference_run.run_record(every, machine)["gpus"] == 4
    assert reference_run.run_record(one, {**machine, "gpus": 0})["gpus"] == 0
    assert "shared_host" not in reference_run.run_record(one, machine)
    assert reference_run.run_record(one, {**machine, "shared_host": True})["shared_host"] is True
    assert tuple(reference_run.run_record(one, machine)) == results.RUN_FIELDS


def test_reference_run_leaves_a_failing_notebook_untouched(tmp_path):
    path = tmp_path / "98_fail.ipynb"
    nbformat.write(_notebook("raise ValueError('wrong result')"), path)
    before = path.read_text()
    failed = tmp_path / "failed"
    assert reference_run.main([str(path), "--allow-cpu", "--results-dir", str(tmp_path / "r"),
                               "--failed-dir", str(failed)]) == 1
    assert path.read_text() == before
    assert "wrong result" in (failed / "98_fail.ipynb").read_text()
    assert not (tmp_path / "r").exists()


def _executed_by_nbmake(path, executed_dir):
    """What .ci/gpu-run leaves: the notebook run by nbmake (--overwrite) into another directory."""
    import subprocess
    import sys

    executed_dir.mkdir()
    copy = executed_dir / path.name
    copy.write_text(path.read_text())
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbmake", "--overwrite",
                    str(copy)], check=True, capture_output=True, timeout=300)
    return copy


def test_stamp_executed_adopts_what_nbmake_ran(tmp_path, capsys):
    path = tmp_path / "99_test.ipynb"
    nbformat.write(_notebook(RECORDING_CELL), path)
    copy = _executed_by_nbmake(path, tmp_path / "executed")
    executed = nbformat.read(copy, as_version=4)
    assert "execution" in executed.cells[1].metadata  # nbmake's cell timing
    results_dir = tmp_path / "results"
    assert reference_run.main([str(path), "--allow-cpu", "--results-dir", str(results_dir),
                               "--stamp-executed", str(copy.parent)]) == 0

    nb = nbformat.read(path, as_version=4)
    stamp = nb.metadata["reference_run"]
    assert stamp["sources_sha256"] == course.sources_sha256(nb)
    assert stamp["wall_s"] == reference_run.wall_seconds(executed) > 0  # read before nbmake's timings go
    assert course.has_outputs(nb) and "execution" not in nb.cells[1].metadata
    slug = reference_run.machine_stamp(allow_cpu=True)[1]
    entry = json.loads((results_dir / f"{slug}.json").read_text())["99_test"]
    assert entry == {"run": stamp, "figures": FIGURES}
    assert "stamped from" in capsys.readouterr().out


H200 = {"gpu": "NVIDIA H200", "gpus": 1, "cpus": 16, "torch": "2.11.0+cu130", "cuda": "13.0", "date": "2026-11-23"}


def test_stamp_executed_records_the_machine_that_executed(tmp_path):
    """.ci/gpu-run writes who ran the notebooks (--write-machine); stamped elsewhere, they name that machine."""
    path = tmp_path / "99_test.ipynb"
    nbformat.write(_notebook(RECORDING_CELL), path)
    copy = _executed_by_nbmake(path, tmp_path / "executed")
    machine = tmp_path / "machine.json"
    assert reference_run.main(["--allow-cpu", "--write-machine", str(machine)]) == 0
    assert set(json.loads(machine.read_text())) == set(reference_run.MACHINE_FIELDS)
    machine.write_text(json.dumps(H200))
    results_dir = tmp_path / "results"
    assert reference_run.main([str(path), "--results-dir", str(results_dir), "--stamp-executed", str(copy.parent),
                               "--machine", str(machine)]) == 0
    stamp = nbformat.read(path, as_version=4).metadata["reference_run"]
    assert {k: stamp[k] for k in H200} == H200
    assert course.run_time_line(stamp) in course.cell_source(nbformat.read(path, as_version=4).cells[0])
    assert json.loads((results_dir / "h200.json").read_text())["99_test"]["run"] == stamp
    machine.write_text(json.dumps({"gpu": "NVIDIA H200"}))
    with pytest.raises(SystemExit, match="lacks"):
        reference_run.main([str(path), "--stamp-executed", str(copy.parent), "--machine", str(machine)])
    with pytest.raises(SystemExit, match="goes with --stamp-executed"):
        reference_run.main([str(path), "--machine", str(machine)])


def test_a_shared_host_is_collected_but_never_stamped(tmp_path):
    """PARALLEL=1 bash .ci/gpu-run writes machine.json with --shared-host: its copies' figures are collected, with a
    run record that says so, and --stamp-executed refuses them (the notebooks ran side by side)."""
    path = tmp_path / "99_test.ipynb"
    nbformat.write(_notebook("x = 1"), path)
    copy = tmp_path / "executed" / path.name  # what nbmake left, without its cell timings
    copy.parent.mkdir()
    executed = _notebook("x = 1")
    executed.cells[1].execution_count = 1
    nbformat.write(executed, copy)
    machine = tmp_path / "machine.json"
    assert reference_run.main(["--allow-cpu", "--write-machine", str(machine), "--shared-host"]) == 0
    assert json.loads(machine.read_text())["shared_host"] is True
    machine.write_text(json.dumps({**H200, "shared_host": True}))
    before = path.read_text()
    with pytest.raises(SystemExit, match="shared the host"):
        reference_run.main([str(path), "--stamp-executed", str(copy.parent), "--machine", str(machine)])
    assert path.read_text() == before
    assert reference_run.main(["--collect-only", "--machine", str(machine), "--results-dir", str(tmp_path / "r"),
                               str(copy)]) == 0
    run = json.loads((tmp_path / "r" / "h200.json").read_text())["99_test"]["run"]
    assert run["shared_host"] is True and run["gpu"] == "NVIDIA H200" and run["wall_s"] is None  # no timings
    with pytest.raises(SystemExit, match="goes with --write-machine"):
        reference_run.main(["--allow-cpu", "--shared-host"])


def test_collect_only_files_another_gpus_figures_with_their_run_record(tmp_path, capsys):
    """.ci/gpu-run's --collect-only: the figures of what nbmake executed, with a run record (the machine from
    machine.json, the wall time from the copy's cell timings, the hash of its sources); nothing is stamped."""
    path = tmp_path / "99_test.ipynb"
    nbformat.write(_notebook(RECORDING_CELL), path)
    copy = _executed_by_nbmake(path, tmp_path / "executed")
    h100 = {**H200, "gpu": "NVIDIA H100 80GB HBM3", "cpus": 2, "gpus": 4}
    (tmp_path / "machine.json").write_text(json.dumps(h100))
    results_dir = tmp_path / "results"
    (results_dir).mkdir()
    (results_dir / "h100.json").write_text('{"00_old": {"x": {"value": 1.0, "unit": "s"}}}')  # older format
    executed = copy.read_text()
    assert reference_run.main(["--collect-only", "--machine", str(tmp_path / "machine.json"), "--results-dir",
                               str(results_dir), str(copy)]) == 0
    assert copy.read_text() == executed and "reference_run" not in nbformat.read(copy, as_version=4).metadata
    filed = json.loads((results_dir / "h100.json").read_text())
    run = filed["99_test"]["run"]
    assert run == {**{k: h100[k] for k in ("date", "gpu", "cpus", "torch", "cuda")}, "gpus": 1,
                   "wall_s": reference_run.wall_seconds(nbformat.read(copy, as_version=4)),
                   "sources_sha256": course.sources_sha256(nbformat.read(path, as_version=4))}
    assert run["wall_s"] > 0 and filed["99_test"]["figures"] == FIGURES
    assert filed["00_old"] == {"run": None, "figures": {"x": {"value": 1.0, "unit": "s"}}}
    assert "collected 99_test.ipynb: 2 figures" in capsys.readouterr().out


@pytest.mark.parametrize("damage, message", [
    (lambda nb: nb.cells[1].__setitem__("source", "print('edited since')"), "other sources"),
    (lambda nb: nb.cells[1].__setitem__("execution_count", None), "never executed"),
    (lambda nb: nb.cells[1].outputs.append(nbformat.v4.new_output("error", ename="E", evalue="", traceback=[])),
     "raised an error"),
])
def test_stamp_executed_refuses_a_copy_that_is_not_a_whole_clean_run(tmp_path, damage, message):
    path = tmp_path / "99_test.ipynb"
    nbformat.write(_notebook("x = 1"), path)
    executed = _notebook("x = 1")
    executed.cells[1].execution_count = 1
    damage(executed)
    (tmp_path / "executed").mkdir()
    nbformat.write(executed, tmp_path / "executed" / path.name)
    before = path.read_text()
    with pytest.raises(SystemExit, match=message):
        reference_run.main([str(path), "--allow-cpu", "--results-dir", str(tmp_path / "r"),
                            "--stamp-executed", str(tmp_path / "executed")])
    assert path.read_text() == before
    with pytest.raises(SystemExit, match="does not exist"):
        reference_run.main([str(path), "--allow-cpu", "--stamp-executed", str(tmp_path / "nowhere")])


def test_reference_run_refuses_cpu_without_the_flag(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA GPU"):
        reference_run.machine_stamp(allow_cpu=False)


SOURCES = {"00_install_check": "now-00", "02_training_loop": "now-02"}  # stand-ins for the notebooks' hashes


def _run(sources_sha256: str | None, **more) -> dict | None:
    if sources_sha256 is None:
        return None
    return {"date": "2026-11-28", "gpu": "NVIDIA H200", "gpus": 1, "cpus": 16, "torch": "2.11.0+cu130",
            "cuda": "13.0", "wall_s": 60.0, "sources_sha256": sources_sha256, **more}


def _results_dir(tmp_path, monkeypatch):
    """Two GPUs' results: the H200's of the current sources (with limits), the H100's of an earlier version."""
    monkeypatch.setattr(readme_tables, "current_sources", lambda: dict(SOURCES))
    h200 = {"00_install_check": {"run": _run("now-00"), "figures": {
        "matmul_tflops_bf16_burst": {"value": 777.8, "unit": "TFLOP/s"},
        "matmul_tflops_bf16": {"value": 665.0, "unit": "TFLOP/s", "band": [660.0, 670.0],
                               "limit": {"name": "the bf16 datasheet peak", "value": 989.0}},
        "copy_gbps": {"value": 4262.0, "unit": "GB/s"}}},
        "02_training_loop": {"run": _run("now-02"), "figures": {
            "epoch_s_seed_loop": {"value": 0.21, "unit": "s"}, "epoch_s_systems": {"value": 0.0067, "unit": "s"},
            "epoch_s_optimized": {"value": 0.0014, "unit": "s",
                                  "limit": {"name": "the arithmetic floor", "value": 0.0007}},
            "test_accuracy_optimized": {"value": 95.0, "unit": "%"},
            "speedup_systems": {"value": 31.3, "unit": "x"}, "speedup_overall": {"value": 14.96, "unit": "x"}}}}
    h100 = {"00_install_check": {"run": _run("then-00"), "figures": {
        "copy_gbps": {"value": 3011.0, "unit": "GB/s"}, "matmul_tflops_fp32": {"value": 51.6, "unit": "TFLOP/s"}}},
        "02_training_loop": {"run": None, "figures": {"speedup_systems": {"value": 7.96, "unit": "x"}}}}
    (tmp_path / "h200.json").write_text(json.dumps(h200))
    (tmp_path / "h100.json").write_text(json.dumps(h100))
    return tmp_path


README_MARKERS = ("intro\n<!-- badges:start -->\nold\n<!-- badges:end -->\n<!-- notebooks:start -->\nold\n"
                  "<!-- notebooks:end -->\n<!-- results:start -->\nold\n<!-- results:end -->\n")


def test_readme_results_one_row_per_headline_one_column_per_gpu(tmp_path, monkeypatch):
    text = readme_tables.render(README_MARKERS, _results_dir(tmp_path, monkeypatch))
    assert "actions/workflows/cpu.yml/badge.svg" in text
    assert "old" not in text and text.startswith("intro\n")
    assert "| # | Notebook | H200 | H100 |" in text  # the reference GPU first
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| 0")}
    h200 = "bf16 matmul 778 burst / 665 sustained TFLOP/s (67% of the bf16 datasheet peak) · copy 4,262 GB/s"
    assert f" | {h200} | copy 3,011 GB/s † |" in rows["| 00"]  # a part this run did not measure is left out
    assert f"| {h200} |" in text.split("<!-- notebooks:end -->")[0]  # the notebook table: the H200's headline
    # a time against its floor: floor / time; a GPU without the headline's figures: "—"
    assert ("epoch 0.210 s → 0.0067 s (same batch) → 0.0014 s (50% of the arithmetic floor) at 95.0% test accuracy"
            " | — |") in rows["| 02"]
    assert "| 01 | [Device management](notebooks/01_device_management.ipynb) | — | — |" in text
    assert readme_tables.STALE_NOTE in text
    assert "[`results/h200.json`](results/h200.json) · [`results/h100.json`](results/h100.json)" in text
    assert "![H200: headline figures as a % of their limit](results/h200.png)" in text
    assert "| Notebook | Figure |" not in text  # the raw figures stay in the JSON files


def test_readme_targets_met_not_met_not_measured(tmp_path, monkeypatch):
    text = readme_tables.render(README_MARKERS, _results_dir(tmp_path, monkeypatch))
    targets = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| 02 · ")}
    assert targets["| 02 · systems-only speed-up at the seed's batch ≥ 8×"].endswith(
        "| met (31.3×) | not met (7.96×) † |")  # the H100's run has no record: †
    assert targets["| 02 · overall speed-up ≥ 15×"].endswith("| not met (14.96×) | not measured |")  # never "15.0×"
    assert "| 10 · DDP on 4 GPUs ≥ 3.6× one GPU (90% efficiency) | not measured | not measured |" in text
    assert "(on the H200) | not measured | — |" in text  # a target set for the H200 alone


def test_targets_read_ratios_percentages_and_other_figures():
    figures = {"a": {"value": 3.0, "unit": "ms"}, "b": {"value": 1.0, "unit": "ms"},
               "fast_gbps": {"value": 2850.0, "unit": "GB/s", "limit": {"name": "copy", "value": 3000.0}},
               "copy_gbps": {"value": 3000.0, "unit": "GB/s"}}
    entry = {"run": _run("now"), "figures": figures}

    def cell(figure, comparison, threshold):
        return readme_tables.target_cell(readme_tables.Target("x", figure, comparison, threshold, "t"), "h200",
                                         entry, "now")

    assert cell("a / b", ">=", 2.5) == "met (3.0×)"
    assert cell("fast_gbps %", ">=", 90) == "met (95.0%)"  # the figure's % of its limit
    assert cell("fast_gbps / copy_gbps %", ">=", 96) == "not met (95.0%)"
    assert cell("b", "<", "a") == "met (1.0 ms vs 3.0 ms)"
    assert cell("copy_gbps %", ">=", 90) == cell("missing", ">=", 1) == "not measured"  # no limit; no figure
    assert set(readme_tables.COMPARISONS) >= {t.comparison for t in readme_tables.TARGETS}
    assert {t.notebook for t in readme_tables.TARGETS} <= set(readme_tables.NOTEBOOKS)


def test_targets_follow_the_band_not_the_value_alone():
    def cell(comparison, threshold, value, band, unit="x"):
        figures = {"f": {"value": value, "unit": unit, "band": list(band)}}
        return readme_tables.target_cell(readme_tables.Target("x", "f", comparison, threshold, "t"), "h200",
                                         {"run": _run("now"), "figures": figures}, "now")

    assert cell(">=", 3.6, 3.82, (3.79, 3.85)) == "met (3.8×)"
    assert cell(">=", 3.6, 3.5, (3.4, 3.55)) == "not met (3.5×)"
    assert cell(">=", 3.6, 3.62, (3.5, 3.7)) == "unresolved (3.62×, band 3.50–3.70×)"  # the value alone met it
    assert cell(">=", 3.6, 3.58, (3.5, 3.7)) == "unresolved (3.58×, band 3.50–3.70×)"  # the value alone missed it
    # "within 5%" of 1: both sides count; a band across the whole range cannot say "not met"
    assert cell("within", 0.05, 0.99, (0.97, 1.005)) == "met (0.99×)"
    assert cell("within", 0.05, 1.088, (0.994, 1.183)) == "unresolved (1.09×, band 0.99–1.18×)"
    assert cell("within", 0.05, 1.12, (1.08, 1.15)) == "not met (1.1×)"
    assert cell("within", 0.05, 0.9, (0.85, 0.93)) == "not met (0.9×)"
    assert cell("within", 0.05, 1.0, (0.8, 1.2)) == "unresolved (1.00×, band 0.80–1.20×)"
    # a band from 3 rounds covers 75%: the cell says so (10's two nodes against one)
    few = {"f": {"value": 0.97, "unit": "x", "band": [0.929, 1.058], "coverage": 0.75}}
    assert readme_tables.target_cell(readme_tables.Target("x", "f", "within", 0.05, "t"), "h200",
                                     {"run": _run("now"), "figures": few}, "now") == \
        "unresolved (0.97×, band 0.93–1.06×, a 75% interval)"
    # a figure's % of its limit carries its band across; a time's band turns over (a floor / the time)
    rate = {"f": {"value": 72.0, "unit": "GB/s", "band": [68.0, 75.0], "limit": {"name": "link", "value": 100.0}}}
    shown = readme_tables.target_cell(readme_tables.Target("x", "f %", ">=", 70, "t"), "h200",
                                      {"run": _run("now"), "figures": rate}, "now")
    assert shown == "unresolved (72.0%, band 68.0–75.0%)"
    time = {"f": {"value": 2.0, "unit": "ms", "band": [1.9, 2.2], "limit": {"name": "floor", "value": 1.0}}}
    assert readme_tables.target_value("f %", readme_tables.results_of(time))[2] == pytest.approx((100 / 2.2, 100 / 1.9))


def test_each_gpu_gets_its_chart(tmp_path, monkeypatch):
    results_dir = _results_dir(tmp_path, monkeypatch)
    assert [p.name for p in readme_tables.missing_charts(results_dir)] == ["h100.png", "h200.png"]
    written = readme_tables.write_charts(results_dir)
    assert sorted(p.name for p in written) == ["h100.png", "h200.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in written)
    assert readme_tables.missing_charts(results_dir) == []
    bars = readme_tables.chart_bars(readme_tables.reference_results(results_dir)["h200"], SOURCES)
    assert bars == [("00 matmul_tflops_bf16 (of the bf16 datasheet peak)", pytest.approx(100 * 665 / 989)),
                    ("02 epoch_s_optimized (of the arithmetic floor)", pytest.approx(50.0))]


def test_headline_names_how_many_gpus_a_run_used():
    figures = {"allreduce_busbw_gbps": 324.8, "ddp_scaling_2gpu": 1.914, "fsdp_peak_mem_ratio_vs_ddp": 0.5706}
    payloads = {k: {"value": v, "unit": ""} for k, v in figures.items()}
    line = readme_tables.headline("10_multi_gpu", payloads, gpus=2)
    assert line == "on 2 GPUs: all-reduce 325 GB/s bus · DDP 2 GPUs 1.91× · FSDP2 peak memory 0.57× DDP"
    assert readme_tables.headline("10_multi_gpu", {}) == "—"
    assert readme_tables.headline("10_multi_gpu", {"x": {"value": 1.0, "unit": ""}}) == "—"
    one = readme_tables.headline("03_mixed_precision", {"step_ms_fp32": {"value": 59.0, "unit": "ms"},
                                                         "step_ms_bf16": {"value": 14.0, "unit": "ms"}})
    assert one == "step 59 ms fp32 → 14 ms bf16", "a notebook on one GPU: no count"
    # a speed-up whose band holds 1 (07b's inconclusive ResNet-50 compile) says so; a resolved one does not
    compile_ = readme_tables.headline("07b_launch_bound", {
        "cuda_graphs_speedup": {"value": 18.9, "unit": "x", "band": [18.3, 19.8]},
        "compile_speedup_transformer": {"value": 1.297, "unit": "x", "band": [1.247, 1.353]},
        "compile_speedup_resnet50": {"value": 1.082, "unit": "x", "band": [0.985, 1.156]}})
    assert compile_ == ("CUDA graphs 18.9× · compile: Transformer 1.30×, ResNet-50 1.08× (band 0.98–1.16×, which "
                        "holds 1×)"), compile_
    nodes = readme_tables.headline("10_multi_gpu", {"two_nodes_vs_one_node": {
        "value": 0.97, "unit": "x", "band": [0.929, 1.058], "coverage": 0.75}})
    assert "0.97× (band 0.93–1.06×, a 75% interval, which holds 1×)" in nodes, nodes
    entry = {"run": _run("now", gpus=2), "figures": payloads}
    assert readme_tables.result_cell("10_multi_gpu", entry, "now").startswith("on 2 GPUs: all-reduce")
    assert readme_tables.result_cell("10_multi_gpu", {**entry, "run": _run("now", shared_host=True)},
                                     "now").endswith("DDP ‡")


def test_readme_tables_need_their_markers():
    with pytest.raises(ValueError, match="markers"):
        readme_tables.render("no markers here")


def test_headline_for_a_notebook_not_yet_run():
    assert readme_tables.headline("00_install_check", None) == "—"
    assert readme_tables.result_cell("10_multi_gpu", None, "now") == "—"
    with pytest.raises(KeyError, match="add '77_unknown'"):
        readme_tables.headline("77_unknown", {})


def test_readme_check_fails_for_a_missing_chart(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(readme_tables, "missing_charts", lambda: [course.ROOT / "results" / "t4.png"])
    assert readme_tables.main(["--check"]) == 1
    assert "results/t4.png is missing" in capsys.readouterr().err


def tqdm_widget_notebook(bars: dict[str, dict]) -> nbformat.NotebookNode:
    """A notebook whose one cell shows the given tqdm bars as Jupyter saves them: the first drawing as text/plain,
    the final state in metadata.widgets (HBox of HTML, FloatProgress, HTML with a Layout)."""
    state, outputs = {}, []
    for name, bar in bars.items():
        state[f"{name}-layout"] = {"model_name": "LayoutModel", "state": bar.get("layout", {})}
        state[f"{name}-left"] = {"model_name": "HTMLModel", "state": {"value": bar["left"]}}
        state[f"{name}-bar"] = {"model_name": "FloatProgressModel", "state": {"value": bar["value"], "max": bar["max"]}}
        state[f"{name}-right"] = {"model_name": "HTMLModel", "state": {"value": bar["right"]}}
        state[name] = {"model_name": "HBoxModel", "state": {
            "children": [f"IPY_MODEL_{name}-{part}" for part in ("left", "bar", "right")],
            "layout": f"IPY_MODEL_{name}-layout"}}
        outputs.append(nbformat.v4.new_output("display_data", data={
            "application/vnd.jupyter.widget-view+json": {"model_id": name, "version_major": 2, "version_minor": 0},
            "text/plain": f"{bar['left']}   0%|          | 0/{bar['max']:.0f} [00:00<?, ?it/s]"}))
    outputs.append(nbformat.v4.new_output("stream", name="stdout", text="done\n"))
    cell = nbformat.v4.new_code_cell("for _ in tqdm(range(7)): pass", outputs=outputs)
    nb = nbformat.v4.new_notebook(cells=[cell])
    nb.metadata["widgets"] = {reference_run.WIDGET_STATE: {"state": state, "version_major": 2, "version_minor": 0}}
    return nb


def test_settle_progress_bars_shows_how_each_bar_ended():
    nb = tqdm_widget_notebook({
        "kept": {"left": "sizes: 100%", "value": 7.0, "max": 7.0,
                 "right": "\u20077/7\u2007[00:09&lt;00:00,\u20072.13s/it]"},
        "half": {"left": "", "value": 2.0, "max": 4.0, "right": " 2/4 [00:01<00:01]"},
        "gone": {"left": "inner: 100%", "value": 3.0, "max": 3.0, "right": " 3/3", "layout": {"visibility": "hidden"}},
    })
    assert reference_run.settle_progress_bars(nb) == 3
    texts = [o["data"]["text/plain"] if "data" in o else o["text"] for o in nb.cells[0].outputs]
    assert texts == ["sizes: 100%|██████████| 7/7 [00:09<00:00, 2.13s/it]", " 50%|█████     | 2/4 [00:01<00:01]",
                     "done\n"]


def test_settle_progress_bars_leaves_other_widgets_alone():
    nb = tqdm_widget_notebook({})
    slider = nbformat.v4.new_output("display_data", data={
        "application/vnd.jupyter.widget-view+json": {"model_id": "s", "version_major": 2, "version_minor": 0},
        "text/plain": "[controls: n = 3]"})
    nb.cells[0].outputs.insert(0, slider)
    nb.metadata["widgets"][reference_run.WIDGET_STATE]["state"]["s"] = {"model_name": "IntSliderModel",
                                                                         "state": {"value": 3}}
    assert reference_run.settle_progress_bars(nb) == 0
    assert nb.cells[0].outputs[0]["data"]["text/plain"] == "[controls: n = 3]"


def test_notebook_numbers_allow_a_split_topic():
    """A topic too long for one lesson becomes NN_… and NNb_…, read in that order and shown as "NNb"."""
    from tools import course

    names = ["05_memory.ipynb", "04b_compile_in_depth.ipynb", "04_torch_compile.ipynb"]
    assert all(course.NOTEBOOK_NAME.match(n) for n in names)
    assert not course.NOTEBOOK_NAME.match("4_x.ipynb") and not course.NOTEBOOK_NAME.match("04bb_x.ipynb")
    assert sorted(names) == ["04_torch_compile.ipynb", "04b_compile_in_depth.ipynb", "05_memory.ipynb"]
    assert [course.number(n.removesuffix(".ipynb")) for n in sorted(names)] == ["04", "04b", "05"]
