"""utils.results: recording headline figures, and the results files that keep them."""

import json
import math

import pytest
import torch

from utils import results


def test_record_keeps_and_prints_the_figure(capsys):
    results.record("copy_gbps", 1234.5, "GB/s")
    assert results.RECORDED["copy_gbps"] == results.Result("copy_gbps", 1234.5, "GB/s")
    assert "copy_gbps = 1,234 GB/s" in capsys.readouterr().out


def test_a_figure_prints_four_digits_with_thousands_separated():
    assert [results.figure(x) for x in (0.5, 12.345, 987.65, 4231.2, 1.2e6)] == ["0.5", "12.35", "987.6", "4,231",
                                                                                "1,200,000"]


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


def test_a_coverage_belongs_to_a_band_and_lies_between_0_and_1():
    with pytest.raises(ValueError, match="coverage is a band's"):
        results.record("nodes", 0.97, "x", coverage=0.75)
    with pytest.raises(ValueError, match="coverage is a band's"):
        results.record("nodes", 0.97, "x", band=(0.9, 1.1), coverage=75)
    results.record("nodes", 0.97, "x", band=(0.929, 1.058), coverage=0.75)
    assert results.RECORDED["nodes"].coverage == 0.75


RUN = {"date": "2026-11-28", "gpu": "NVIDIA H200", "gpus": 1, "cpus": 16, "torch": "2.11.0+cu130", "cuda": "13.0",
       "wall_s": 126.4, "sources_sha256": "ab" * 32}


def test_reference_results_reads_every_gpus_file(tmp_path):
    entry = {"run": RUN, "figures": {"copy_gbps": {"value": 4261.0, "unit": "GB/s"}}}
    (tmp_path / "h200.json").write_text(json.dumps({"00_install_check": entry}))
    (tmp_path / "a100.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("not a results file")
    found = results.reference_results(tmp_path)
    assert list(found) == ["a100", "h200"] and found["h200"]["00_install_check"] == entry
    assert results.reference_results(tmp_path / "missing") == {}


def test_a_results_file_from_before_run_records_reads_without_one(tmp_path):
    """A reader's older t4.json holds {stem: {name: payload}}: its figures read, with "run": None."""
    (tmp_path / "t4.json").write_text('{"00_install_check": {"copy_gbps": {"value": 300.0, "unit": "GB/s"}}}')
    assert results.read_results_file(tmp_path / "t4.json") == {
        "00_install_check": {"run": None, "figures": {"copy_gbps": {"value": 300.0, "unit": "GB/s"}}}}
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="maps notebook stems"):
        results.read_results_file(tmp_path / "bad.json")


def test_write_results_entry_replaces_one_notebook_and_keeps_the_others(tmp_path):
    path = tmp_path / "h100.json"
    (tmp_path / "h100.json").write_text('{"01_b": {"y": {"value": 2.0, "unit": "s"}}}')  # the older format too
    results.write_results_entry(path, "00_a", RUN, {"x": {"value": 1.0, "unit": "s"}})
    results.write_results_entry(path, "00_a", None, {"z": {"value": 3.0, "unit": "µs"}})
    data = json.loads(path.read_text(encoding="utf-8"))
    assert list(data) == ["00_a", "01_b"]  # notebooks in name order
    assert data == {"00_a": {"run": None, "figures": {"z": {"value": 3.0, "unit": "µs"}}},
                    "01_b": {"run": None, "figures": {"y": {"value": 2.0, "unit": "s"}}}}
    assert set(RUN) == set(results.RUN_FIELDS)


def test_a_recorded_payload_reads_back_as_the_same_result():
    """What record() displays (Result.payload(), the results file's format) reads back whole: band and limit too."""
    rate = results.Result("copy_gbps", 3000.0, "GB/s", band=(2900.0, 3100.0), limit=3350.0, limit_name="the datasheet")
    epoch = results.Result("epoch_s", 0.002, "s", limit=0.001, limit_name="the arithmetic floor")
    plain = results.Result("speedup", 2.0, "x")
    few = results.Result("nodes", 0.97, "x", band=(0.929, 1.058), coverage=0.75)
    for result in (rate, epoch, plain, few):
        assert results.from_payload(result.name, json.loads(json.dumps(result.payload()))) == result
    assert results.from_payload("epoch_s", epoch.payload()).percent_of_limit == pytest.approx(50)


def test_a_recorded_line_gives_the_limit_with_its_unit():
    from utils.results import Result

    rate = Result("copy_gbps", 3000.0, "GB/s", None, 3350.0, "datasheet bandwidth")
    assert str(rate).endswith("90% of datasheet bandwidth (3,350 GB/s)")
    time = Result("epoch_s", 0.3, "s", None, 6.4e-05, "fp32 matmul rate")
    assert str(time).endswith("0.021% of fp32 matmul rate: 6.4e-05 s at it")
