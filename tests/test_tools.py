"""tools/: the stamp hash, the reference-run tool (on CPU, --allow-cpu) and README's generated tables."""

from __future__ import annotations

import hashlib
import json

import nbformat
import pytest

from tools import course, readme_tables, reference_run


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


def test_reference_run_executes_stamps_and_collects(tmp_path, capsys):
    path = tmp_path / "99_test.ipynb"
    nbformat.write(_notebook(RECORDING_CELL), path)
    results_dir = tmp_path / "results"
    assert reference_run.main([str(path), "--allow-cpu", "--results-dir", str(results_dir)]) == 0

    nb = nbformat.read(path, as_version=4)
    stamp = nb.metadata["reference_run"]
    assert stamp["sources_sha256"] == course.sources_sha256(nb)
    machine, slug = reference_run.machine_stamp(allow_cpu=True)  # "cpu" here; the GPU on a GPU machine
    assert stamp["gpu"] == machine["gpu"] and stamp["gpus"] == machine["gpus"]
    assert set(stamp) == {"sources_sha256", "gpu", "gpus", "torch", "cuda", "date"}
    assert course.has_outputs(nb)
    figures = json.loads((results_dir / f"{slug}.json").read_text())
    assert figures == {"99_test": {"answer_gbps": {"value": 42.5, "unit": "GB/s"},
                                   "speedup": {"value": 2.0, "unit": "x"}}}
    assert "ok 99_test.ipynb" in capsys.readouterr().out


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
    assert "execution" in nbformat.read(copy, as_version=4).cells[1].metadata  # nbmake's cell timing
    results_dir = tmp_path / "results"
    assert reference_run.main([str(path), "--allow-cpu", "--results-dir", str(results_dir),
                               "--stamp-executed", str(copy.parent)]) == 0

    nb = nbformat.read(path, as_version=4)
    assert nb.metadata["reference_run"]["sources_sha256"] == course.sources_sha256(nb)
    assert course.has_outputs(nb) and "execution" not in nb.cells[1].metadata
    slug = reference_run.machine_stamp(allow_cpu=True)[1]
    assert json.loads((results_dir / f"{slug}.json").read_text())["99_test"]["speedup"] == {"value": 2.0, "unit": "x"}
    assert "stamped from" in capsys.readouterr().out


def test_stamp_executed_records_the_machine_that_executed(tmp_path):
    """.ci/gpu-run writes who ran the notebooks (--write-machine); stamped elsewhere, they name that machine."""
    path = tmp_path / "99_test.ipynb"
    nbformat.write(_notebook(RECORDING_CELL), path)
    copy = _executed_by_nbmake(path, tmp_path / "executed")
    machine = tmp_path / "machine.json"
    assert reference_run.main(["--allow-cpu", "--write-machine", str(machine)]) == 0
    assert set(json.loads(machine.read_text())) == {"gpu", "gpus", "torch", "cuda", "date"}
    h200 = {"gpu": "NVIDIA H200", "gpus": "1", "torch": "2.11.0+cu130", "cuda": "13.0", "date": "2026-11-23"}
    machine.write_text(json.dumps(h200))
    results_dir = tmp_path / "results"
    assert reference_run.main([str(path), "--results-dir", str(results_dir), "--stamp-executed", str(copy.parent),
                               "--machine", str(machine)]) == 0
    stamp = nbformat.read(path, as_version=4).metadata["reference_run"]
    assert {k: stamp[k] for k in h200} == h200
    assert "99_test" in json.loads((results_dir / "h200.json").read_text())
    machine.write_text(json.dumps({"gpu": "NVIDIA H200"}))
    with pytest.raises(SystemExit, match="lacks"):
        reference_run.main([str(path), "--stamp-executed", str(copy.parent), "--machine", str(machine)])
    with pytest.raises(SystemExit, match="goes with --stamp-executed"):
        reference_run.main([str(path), "--machine", str(machine)])


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


def test_merge_results_keeps_other_notebooks(tmp_path):
    reference_run.merge_results("h100", "00_a", {"x": {"value": 1.0, "unit": "s"}}, tmp_path)
    reference_run.merge_results("h100", "01_b", {"y": {"value": 2.0, "unit": "s"}}, tmp_path)
    reference_run.merge_results("h100", "00_a", {"z": {"value": 3.0, "unit": "s"}}, tmp_path)
    assert json.loads((tmp_path / "h100.json").read_text()) == {
        "00_a": {"z": {"value": 3.0, "unit": "s"}}, "01_b": {"y": {"value": 2.0, "unit": "s"}}}


def test_readme_tables_render_headlines_and_one_column_per_gpu(tmp_path):
    (tmp_path / "h200.json").write_text(json.dumps({"00_install_check": {
        "matmul_tflops_bf16_burst": {"value": 777.8, "unit": "TFLOP/s"},
        "matmul_tflops_bf16_sustained": {"value": 665.0, "unit": "TFLOP/s"},
        "copy_gbps": {"value": 4262.0, "unit": "GB/s"}}}))
    (tmp_path / "h100.json").write_text(json.dumps({"00_install_check": {
        "copy_gbps": {"value": 3011.0, "unit": "GB/s"}, "matmul_tflops_fp32": {"value": 51.6, "unit": "TFLOP/s"}}}))
    readme = ("intro\n<!-- badges:start -->\nold\n<!-- badges:end -->\n<!-- notebooks:start -->\nold\n"
              "<!-- notebooks:end -->\n<!-- results:start -->\nold\n<!-- results:end -->\n")
    text = readme_tables.render(readme, tmp_path)
    assert "actions/workflows/cpu.yml/badge.svg" in text
    assert "bf16 matmul 778 burst / 665 sustained TFLOP/s · copy 4,262 GB/s" in text  # the H200's headline
    assert "| Notebook | Figure | H200 | H100 |" in text  # the reference GPU first
    assert "| 00_install_check | `copy_gbps` | 4,262 GB/s | 3,011 GB/s |" in text
    assert "| 00_install_check | `matmul_tflops_fp32` | — | 51.6 TFLOP/s |" in text  # recorded on one GPU only
    assert "old" not in text and text.startswith("intro\n")


def test_headline_names_how_many_reference_gpus_a_notebook_used():
    figures = {"allreduce_busbw_gbps": 324.8, "ddp_scaling_2gpu": 1.914, "fsdp_peak_mem_ratio_vs_ddp": 0.5706}
    line = readme_tables.headline("10_multi_gpu", {k: {"value": v, "unit": ""} for k, v in figures.items()})
    assert line == "on 2 × H200: all-reduce 325 GB/s bus · DDP 2 GPUs 1.91× · FSDP2 peak memory 0.57× DDP"
    assert readme_tables.headline("10_multi_gpu", {}) == "not yet run on the reference GPU"
    assert readme_tables.headline("10_multi_gpu", {"x": {"value": 1.0, "unit": ""}}).startswith("on 2 × H200: (figure")
    one = readme_tables.headline("03_mixed_precision", {"step_ms_fp32": {"value": 59.0, "unit": "ms"},
                                                         "step_ms_bf16": {"value": 14.0, "unit": "ms"}})
    assert one == "step 59 ms fp32 → 14 ms bf16", "a notebook on one GPU: no count"
    assert set(readme_tables.REFERENCE_GPUS_USED) <= set(readme_tables.NOTEBOOKS)


def test_readme_tables_need_their_markers():
    with pytest.raises(ValueError, match="markers"):
        readme_tables.render("no markers here")


def test_headline_for_a_notebook_not_yet_run():
    assert readme_tables.headline("00_install_check", None) == "not yet run on the reference GPU"
    assert readme_tables.headline("10_multi_gpu", None) == "not yet run on the reference GPU"
    with pytest.raises(KeyError, match="add '77_unknown'"):
        readme_tables.headline("77_unknown", {})


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
