"""Notebook 08's child processes: the checkpoint they read (utils.gpt2.save_checkpoint / load_checkpoint), the
export / AOTInductor script and the Hugging Face generate script, run through utils.isolate.run_script on a tiny
GPT-2 — on the CPU, and on a GPU where there is one (there transformers compiles the static cache and AOTInductor
builds CUDA code: the steps that are isolated because they can crash)."""

import pytest
import torch

from utils import distributed, gpt2, isolate

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


@pytest.mark.parametrize("device", DEVICES)
def test_export_script_checks_the_package_against_eager(checkpoint, device):
    run = isolate.run_script("gpt2_export.py", ["--checkpoint", checkpoint[0], "--device", device], timeout_s=600)
    assert run.ok, f"{run.failure}\n{run.tail(30)}"
    assert run.result["relative_error"] < 1e-4 and run.result["package_bytes"] > 0
    assert list(run.result["seconds"]) == ["load the checkpoint", "export", "AOTInductor compile", "load", "run",
                                           "check against eager"]


@pytest.mark.parametrize("device", DEVICES)
def test_hf_generate_script_checks_and_times_both_caches(checkpoint, device):
    run = isolate.run_script("hf_generate.py", ["--checkpoint", checkpoint[0], "--device", device, "--new-tokens", 8,
                                                "--dtype", "float32", "--min-run-s", 0.05], timeout_s=600)
    assert run.ok, f"{run.failure}\n{run.tail(30)}"
    variants = run.result["variants"]
    assert list(variants) == ["HF generate, dynamic cache", "HF generate, static cache"]
    for label, row in variants.items():
        assert "error" not in row, f"{label}: {row.get('error')}"
        assert row["greedy"], f"{label}: not the greedy tokens"
        timing = distributed.timing_from_dict(row["timing"])
        assert timing.label == label and timing.median_s > 0 and timing.device.startswith(device)
