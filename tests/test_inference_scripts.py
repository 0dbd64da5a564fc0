"""Notebook 08's child processes: the checkpoint they read (utils.gpt2.save_checkpoint / load_checkpoint), the
export / AOTInductor script and the Hugging Face generate script, run through utils.isolate.run_script on a tiny
GPT-2 — on the CPU, and on a GPU where there is one (there transformers compiles the static cache and AOTInductor
builds CUDA code: the steps that are isolated because they can crash)."""

import signal

import pytest
import torch

from utils import bench, distributed, gpt2, isolate

transformers = pytest.importorskip("transformers", reason="the reference implementation (requirements.txt has it)")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                   reason="needs a CUDA GPU"))]


@pytest.fixture
def checkpoint(tmp_path):
    """A tiny GPT-2 (Hugging Face's, random weights) and a prompt saved for a child process; ours for reference."""
    ours, hf, _, _ = gpt2.reference_pair(gpt2.GPT2Config.tiny(), online=False, seed=3)
    prompt = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    return gpt2.save_checkpoint(hf, prompt, tmp_path / "checkpoint"), ours, hf, prompt


def test_checkpoint_round_trip_gives_both_models_the_same_weights(checkpoint):
    directory, ours, hf, prompt = checkpoint
    loaded, loaded_prompt = gpt2.load_checkpoint(directory)
    assert torch.equal(loaded_prompt, prompt) and not loaded.training
    theirs = transformers.GPT2LMHeadModel.from_pretrained(directory).eval()
    with torch.no_grad():
        assert torch.equal(loaded(prompt), ours(prompt))
        torch.testing.assert_close(theirs(prompt).logits, hf(prompt).logits, rtol=0, atol=0)


def test_load_checkpoint_names_a_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        gpt2.load_checkpoint(tmp_path)


STAGES = ["load the checkpoint", "export", "check the exported program", "AOTInductor compile", "load", "run",
          "check against eager"]


def aoti_crash_stage(run: isolate.ChildRun) -> str | None:
    """The stage, 'load' or 'run', in which AOTInductor's package crashed the script with a segmentation fault (as on
    torch 2.11); None for any other outcome — success, an exception, a timeout, a crash elsewhere."""
    crashed = not run.timed_out and run.returncode == -signal.SIGSEGV
    return run.stage if crashed and run.stage in ("load", "run") else None


@pytest.mark.parametrize("device", DEVICES)
def test_export_script_checks_the_package_against_eager(checkpoint, device):
    run = isolate.run_script("gpt2_export.py", ["--checkpoint", checkpoint[0], "--device", device], timeout_s=600)
    result = run.result or {}
    stage = aoti_crash_stage(run)
    if stage is not None:  # a known prototype crash: everything before it must still have worked and been reported
        assert result["exported_relative_error"] < 1e-4, "the exported program must match eager before AOTInductor"
        assert list(result["seconds"]) == STAGES[:STAGES.index(stage)]
        assert f"killed by SIGSEGV (Segmentation fault) in stage '{stage}'" in run.failure, run.failure
        pytest.xfail(f"AOTInductor crashed {'loading' if stage == 'load' else 'running'} the package on torch "
                     f"{torch.__version__}: stage '{stage}'")
    assert run.ok, f"{run.failure}\n{run.tail(30)}"
    assert result["exported_relative_error"] < 1e-4 and result["relative_error"] < 1e-4
    assert result["package_bytes"] > 0 and list(result["seconds"]) == STAGES


def test_only_a_segfault_in_aotinductors_load_or_run_counts_as_its_known_crash():
    def child(returncode, stage, timed_out=False):
        return isolate.ChildRun("gpt2_export.py", returncode, timed_out, 60, 1.0, {"stage": stage, "seconds": {}})

    assert aoti_crash_stage(child(-signal.SIGSEGV, "load")) == "load"
    assert aoti_crash_stage(child(-signal.SIGSEGV, "run")) == "run"
    for other in (child(-signal.SIGSEGV, "AOTInductor compile"), child(-signal.SIGSEGV, "export"),
                  child(-signal.SIGABRT, "load"), child(1, "load"), child(None, "load", timed_out=True),
                  child(0, isolate.DONE)):
        assert aoti_crash_stage(other) is None, other


@pytest.mark.parametrize("device", DEVICES)
def test_hf_generate_script_checks_both_caches_and_ours_and_times_them_in_alternating_rounds(checkpoint, device):
    """Ours with its prefill in a CUDA graph on a GPU (graph_prefill), as notebook 08 builds it."""
    run = isolate.run_script("hf_generate.py", ["--checkpoint", checkpoint[0], "--device", device, "--new-tokens", 8,
                                                "--dtype", "float32", "--min-run-s", 0.05, "--rounds", 4,
                                                "--fallback-rounds", 2, "--ours", "graph", "--ours-label", "ours"],
                             timeout_s=600)
    assert run.ok, f"{run.failure}\n{run.tail(30)}"
    variants = run.result["variants"]
    assert list(variants) == ["ours", "HF generate, dynamic cache", "HF generate, static cache"]
    # timed together before the static cache's compile (a deadline there leaves that comparison), then with it
    assert [s for s in run.result["seconds"] if s.startswith("compare")] == ["compare 2", "compare 3"]
    assert run.result["comparisons"] == [  # the fallback in its few rounds, then all three in the full rounds
        {"variants": ["ours", "HF generate, dynamic cache"], "rounds": 2}, {"variants": list(variants), "rounds": 4}]
    rounds = {}
    for label, row in variants.items():
        assert "error" not in row, f"{label}: {row.get('error')}"
        assert row["greedy"], f"{label}: not the greedy tokens"
        assert row["graphs_compiled"] >= 0 and row["graphs_loaded"] >= 0, f"{label}: Inductor's graph counts"
        timing = distributed.timing_from_dict(row["timing"])
        assert timing.label == label and timing.median_s > 0 and timing.device.startswith(device)
        rounds[label] = timing.block_times_s
    assert {len(times) for times in rounds.values()} == {4}, "one time per alternating round and variant"
    assert bench.Comparison.from_rounds(rounds).verdict("ours").rounds == 4


def test_hf_generate_script_without_two_passing_variants_times_nothing(checkpoint, monkeypatch):
    """A variant that fails its first call is reported and left out; with fewer than two left, nothing is timed."""
    run = isolate.run_script("hf_generate.py", ["--checkpoint", checkpoint[0], "--device", "cpu", "--new-tokens", 4,
                                                "--dtype", "float32", "--ours", "triton"], timeout_s=600)
    assert run.ok, f"{run.failure}\n{run.tail(30)}"
    ours = run.result["variants"]["ours, triton"]
    assert "error" in ours and "timing" not in ours, ours  # Triton does not run on a CPU outside its interpreter
    assert all("timing" in row for label, row in run.result["variants"].items() if label != "ours, triton")
