"""utils.results: recording headline figures."""

import math

import pytest
import torch

from utils import results


def test_record_keeps_and_prints_the_figure(capsys):
    results.record("copy_gbps", 1234.5, "GB/s")
    assert results.RECORDED["copy_gbps"] == results.Result("copy_gbps", 1234.5, "GB/s")
    assert "copy_gbps = 1234 GB/s" in capsys.readouterr().out.replace("1.234e+03", "1234")


def test_record_accepts_tensor_scalars():
    results.record("speedup", torch.tensor(2.5), "x")
    assert results.RECORDED["speedup"].value == 2.5


@pytest.mark.parametrize(("name", "value", "unit"), [
    ("Copy GBps", 1.0, "GB/s"), ("", 1.0, "GB/s"), ("ok_name", math.nan, "GB/s"), ("ok_name", math.inf, "x"),
    ("ok_name", "fast", "x"), ("ok_name", True, "x"), ("ok_name", 1.0, ""), ("ok_name", 1.0, "  "),
])
def test_record_rejects_bad_figures(name, value, unit):
    with pytest.raises(ValueError):
        results.record(name, value, unit)


def test_reference_results_reads_every_gpus_file(tmp_path):
    (tmp_path / "h200.json").write_text('{"00_install_check": {"copy_gbps": {"value": 4261.0, "unit": "GB/s"}}}')
    (tmp_path / "a100.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("not a results file")
    found = results.reference_results(tmp_path)
    assert list(found) == ["a100", "h200"] and found["h200"]["00_install_check"]["copy_gbps"]["value"] == 4261.0
    assert results.reference_results(tmp_path / "missing") == {}
