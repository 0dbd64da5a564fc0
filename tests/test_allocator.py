"""utils.allocator: the fragmentation demo and the allocator probe, which runs it in a child process with one
setting. The child process is checked on CPU against a stand-in for subprocess.run; the allocator itself only by
the tests marked ``cuda`` when a GPU is present.
"""

import importlib
import json
import os
import re
import subprocess

import pytest
import torch

from utils import allocator, memory_snapshot

MiB = 2**20
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_fragmentation_demo_and_probe_need_cuda():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU message")
    with pytest.raises(RuntimeError, match="CUDA"):
        allocator.fragmentation_demo("cpu")
    assert set(allocator.ALLOC_CONF_VARS) == {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"}


def test_allocator_probe_runs_its_child_with_one_setting(monkeypatch):
    # The child's command is a string: check that it imports a module that has the child's entry point, and that
    # the child gets the one variable asked for and none of the others, imports this checkout's utils, and that
    # its JSON line and its warnings about the variable are read back.
    row = {"stage": "one tensor of 288 MiB", "allocated": 288 * MiB, "reserved": 288 * MiB}
    seen = {}

    def fake_run(args, **kwargs):
        seen.update(kwargs, args=args)
        out = json.dumps({"torch": "9.9", "expandable_segments": True, "rows": [row]})
        return subprocess.CompletedProcess(args, 0, stdout=f"noise\n{out}\n",
                                           stderr="UserWarning: PYTORCH_CUDA_ALLOC_CONF is deprecated\nother\n")

    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")
    monkeypatch.setattr(subprocess, "run", fake_run)
    probe = allocator.allocator_probe("PYTORCH_CUDA_ALLOC_CONF", timeout_s=5)
    assert probe == allocator.ProbeResult("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True", "9.9", True, [row],
                                          ["UserWarning: PYTORCH_CUDA_ALLOC_CONF is deprecated"])
    assert probe.reserved_after("one tensor") == 288 * MiB
    env = seen["env"]
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True" and "PYTORCH_ALLOC_CONF" not in env
    assert env["PYTHONPATH"].split(os.pathsep)[0] == seen["cwd"] and seen["timeout"] == 5
    code = seen["args"][-1]
    module = re.search(r"import ([\w.]+) as m\b", code)
    assert module and "m._allocator_probe_main()" in code, code
    assert callable(importlib.import_module(module.group(1))._allocator_probe_main)

    monkeypatch.setattr(subprocess, "run", lambda args, **kwargs: subprocess.CompletedProcess(
        args, 1, stdout="", stderr="Traceback ...\nRuntimeError: Found no NVIDIA driver on your system.\n"))
    with pytest.raises(RuntimeError, match="(?s)failed \\(exit 1\\): .*no NVIDIA driver"):
        allocator.allocator_probe(None)


def _rows(start_cached, freed_reserved, big_reserved, *, big=288 * MiB):
    """fragmentation_demo's five rows, above the start, with the absolute free memory in the cache."""
    return [{"stage": "start", "allocated": 0, "reserved": 0, "cached": start_cached},
            {"stage": "10 tensors of 48 MiB", "allocated": 480 * MiB, "reserved": 480 * MiB, "cached": start_cached},
            {"stage": "all of them freed", "allocated": 0, "reserved": freed_reserved,
             "cached": start_cached + freed_reserved},
            {"stage": "one tensor of 288 MiB", "allocated": big, "reserved": big_reserved,
             "cached": start_cached + big_reserved - big},
            {"stage": "empty_cache()", "allocated": big, "reserved": big, "cached": start_cached}]


def test_fragmentation_verdict_follows_the_numbers():
    # The default allocator in a clean process: a new 288 MiB segment beside 480 MiB of cached, free segments.
    said = allocator.fragmentation_verdict(_rows(0, 480 * MiB, 768 * MiB))
    assert "288.00 MiB of new segments although 480.00 MiB were cached and free: fragmentation" in said
    assert said.endswith("left 288.00 MiB reserved above the start.")
    # Expandable segments: the freed space is contiguous, no new segment.
    said = allocator.fragmentation_verdict(_rows(0, 480 * MiB, 480 * MiB), expandable=True)
    assert "without a new segment: with expandable segments" in said and "free: fragmentation" not in said
    # A process whose live tensors pin segments with free space in them: the cache serves everything, and the
    # verdict says so instead of claiming fragmentation (the H200 run of notebook 05 with its leaked tensors).
    said = allocator.fragmentation_verdict(_rows(1500 * MiB, 0, 0), expandable=False)
    assert "without a new segment" in said and "1.46 GiB free at its start" in said
    assert "no fragmentation to see" in said
    # Too little cached to serve it: a new segment, but not fragmentation.
    said = allocator.fragmentation_verdict(_rows(0, 100 * MiB, 388 * MiB))
    assert "less than the 288.00 MiB asked for" in said and "not fragmentation" in said
    with pytest.raises(ValueError, match="five rows"):
        allocator.fragmentation_verdict(_rows(0, 0, 0)[:4])


# --- on a real GPU --------------------------------------------------------------------------------


@cuda
def test_cuda_fragmentation_demo_and_the_allocator_probe():
    rows = allocator.fragmentation_demo("cuda")
    assert [r["stage"] for r in rows] == ["start", "10 tensors of 48 MiB", "all of them freed",
                                          "one tensor of 288 MiB", "empty_cache()"]
    assert rows[0]["allocated"] == rows[0]["reserved"] == 0
    assert rows[1]["allocated"] == 480 * MiB and rows[2]["allocated"] == 0 and rows[3]["allocated"] == 288 * MiB
    assert all(r["cached"] >= 0 for r in rows) and rows[2]["cached"] >= 480 * MiB
    said = allocator.fragmentation_verdict(rows, expandable=memory_snapshot.expandable_segments_enabled(
        torch.cuda.memory._snapshot()))
    # Earlier tests in this process can leave free blocks in segments that their live tensors keep reserved
    # (empty_cache() cannot return those): the demo's tensors may then come from there. From a clean cache:
    if rows[0]["cached"] < 48 * MiB:
        assert rows[2]["reserved"] >= 480 * MiB, "freed blocks stay cached"
        if not memory_snapshot.expandable_segments_enabled(torch.cuda.memory._snapshot()):
            assert rows[3]["reserved"] >= 768 * MiB, "ten separate 48 MiB segments cannot hold one 288 MiB tensor"
        assert rows[4]["reserved"] < rows[3]["reserved"]
        # The default allocator: fragmentation (a new segment beside enough cached, free memory); with expandable
        # segments (a reader's PYTORCH_CUDA_ALLOC_CONF) the cache serves it.
        assert "free: fragmentation" in said or "with expandable segments" in said, said
    else:
        assert any(p in said for p in ("fragmentation", "not fragmentation", "cached before the demo")), said
    default = allocator.allocator_probe(None)
    assert default.expandable_segments is False
    assert default.reserved_after("one tensor") >= 768 * MiB
    old = allocator.allocator_probe("PYTORCH_CUDA_ALLOC_CONF")
    assert old.expandable_segments is True  # the old name works in every release
    assert old.reserved_after("one tensor") < default.reserved_after("one tensor")
    new = allocator.allocator_probe("PYTORCH_ALLOC_CONF")
    assert new.expandable_segments in (True, False) and new.torch_version == torch.__version__


def test_cache_demo_on_cpu_reads_rss_and_says_what_happened():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU branch")
    rows, said = allocator.cache_demo("cpu", mib=64)
    assert [r["after"] for r in rows] == ["clean start", "a 64 MiB tensor, every page written", "del"]
    assert said.startswith("CPU, no caching allocator: RSS")
    with pytest.raises(RuntimeError, match="CUDA caching allocator"):
        allocator.empty_cache_refills(MiB, "cpu")


def _probe(variable, expandable, reserved_big, reserved_after, warnings=()):
    rows = [{"stage": "one tensor of 288 MiB", "allocated": 288 * MiB, "reserved": reserved_big},
            {"stage": "empty_cache()", "allocated": 288 * MiB, "reserved": reserved_after}]
    return allocator.ProbeResult(variable, "expandable_segments:True" if variable else None, "2.9.1", expandable, rows,
                                 list(warnings))


def test_probe_settings_runs_every_setting_and_the_summary_follows_the_numbers(monkeypatch):
    seen = []

    def fake_probe(variable, value="expandable_segments:True", *, timeout_s=180.0):
        seen.append(variable)
        return _probe(variable, variable == "PYTORCH_CUDA_ALLOC_CONF" or None if variable else False,
                      480 * MiB if variable else 768 * MiB, 300 * MiB if variable else 288 * MiB)

    monkeypatch.setattr(allocator, "allocator_probe", fake_probe)
    probes = allocator.probe_settings()
    assert sorted(seen, key=str) == sorted([None, *allocator.ALLOC_CONF_VARS], key=str)
    assert list(probes) == ["no variable (defaults)", *allocator.ALLOC_CONF_VARS]
    rows = allocator.probe_rows(probes)
    assert rows[0]["set"] == "no variable (defaults)" and rows[1]["expandable segments in use"] == "yes"
    assert rows[2]["expandable segments in use"] == "unknown"
    text = allocator.probe_summary(probes)
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: honoured" in text
    assert "PYTORCH_ALLOC_CONF=expandable_segments:True: could not be read back" in text
    assert "480.00 MiB reserved, against 768.00 MiB" in text and "15 of them" in text
    probes["PYTORCH_ALLOC_CONF"] = _probe("PYTORCH_ALLOC_CONF", False, 768 * MiB, 288 * MiB, ["a warning"])
    assert "IGNORED (no error)" in allocator.probe_summary(probes) and "with a warning: a warning" in \
        allocator.probe_summary(probes)
