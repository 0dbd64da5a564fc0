"""utils.amp: notebook 03's checks say what they measured, fail (or say so) when they checked nothing, and print the
reason that matches each outcome."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from utils import amp, bench, data, models, results, train
from utils.memory import SavedTensor


def caps(**kw):
    return SimpleNamespace(**({"name": "Tesla T4", "tf32": False, "bf16": False} | kw))


def test_why_skipped_gives_a_reason_per_device():
    cpu = caps(name="a CPU", bf16=True)  # CPU autocast runs bf16
    assert amp.why_skipped("fp32", "cpu", cpu) is None and amp.why_skipped("bf16", "cpu", cpu) is None
    assert "tensor cores" in amp.why_skipped("tf32", "cpu", cpu)
    assert "fp16" in amp.why_skipped("fp16 + GradScaler + chunked loss", "cpu", cpu)
    assert "T4" in amp.why_skipped("bf16 + chunked loss", "cuda", caps())  # before Ampere
    assert amp.why_skipped("fp16 + GradScaler", "cuda", caps()) is None
    ampere = caps(name="A100", tf32=True, bf16=True)
    assert all(amp.why_skipped(n, "cuda", ampere) is None for n in ("fp32", "tf32", "bf16", "fp16 + GradScaler"))


def test_module_output_dtypes_under_cpu_autocast():
    model = models.TransformerModel(models.TransformerConfig(vocab_size=50, d_model=16, nhead=2, num_layers=1,
                                                             dim_feedforward=32, dropout=0.0))
    x, _ = data.synthetic_tokens(2, 8, 50)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rows = {r["module"]: r["output dtype"] for r in amp.module_output_dtypes(model, lambda: model(x))}
    assert rows["Embedding"] == "float32" and rows["Linear"] == "bfloat16" and rows["TransformerModel"] == "bfloat16"
    assert not model._forward_hooks and not model.head._forward_hooks  # the hooks are removed


def _passes():
    torch.manual_seed(0)
    logits, grads = torch.randn(1000) * 1e-3, torch.randn(500)
    lost = grads.clone()
    lost[:200] = 0
    return (logits, grads), {"fp16, no scaler": (torch.zeros(1000), lost),
                             "fp16 + GradScaler": (logits, grads * 1.001)}


def test_gradient_losses_and_the_verdict(capsys):
    reference, passes = _passes()
    losses = amp.gradient_losses(reference, passes)
    by = {g.name: g for g in losses}
    assert by["fp16, no scaler"].zero_logit_share == 1.0 and by["fp16, no scaler"].lost_share == pytest.approx(0.4)
    assert by["fp16 + GradScaler"].relative_error == pytest.approx(0.001, rel=1e-3)
    text = amp.underflow_verdict(losses)
    assert "100.000% of the logit gradients" in text and "match fp32 to 0.1%" in text
    assert "One backward pass" in capsys.readouterr().out


def test_underflow_verdict_fails_when_it_shows_nothing_or_the_scaler_does_not_recover():
    reference, passes = _passes()
    nothing_lost = dict(passes, **{"fp16, no scaler": reference})
    with pytest.raises(AssertionError, match="not small enough"):
        amp.underflow_verdict(amp.gradient_losses(reference, nothing_lost))
    not_recovered = dict(passes, **{"fp16 + GradScaler": passes["fp16, no scaler"]})
    with pytest.raises(AssertionError, match="did not recover"):
        amp.underflow_verdict(amp.gradient_losses(reference, not_recovered))


def test_histograms_and_plots():
    edges, share = amp.log10_histogram(torch.tensor([1e-3, 1e-3, 1e-9, 0.0]))
    assert len(edges) == len(share) + 1 and sum(share) == pytest.approx(100.0)
    assert amp.plot_against_fp16({"g": torch.tensor([1e-3, 1e-9])}, title="t").axes
    assert amp.plot_loss_scale([4.0, 2.0, 2.0], [0], growth_interval=15).axes


def test_train_alike_passes_close_curves_and_fails_a_stray_one():
    fp32 = [3.0 - 0.01 * i for i in range(50)]
    close = amp.train_alike({"fp32": fp32, "bf16": [v + 0.01 for v in fp32]})
    assert close.window == 5 and " trains like fp32: every" in close.check()
    assert close.rows()[1]["largest gap to fp32 (smoothed)"] == "0.010"
    stray = amp.train_alike({"fp32": fp32, "fp16": [v + 0.5 for v in fp32]})
    with pytest.raises(AssertionError, match="fp16 did not train like fp32"):
        stray.check()
    tied = amp.train_alike({"fp32": fp32, "fp16": [v + 0.0141 for v in fp32], "bf16": [v + 0.0139 for v in fp32],
                            "tf32": fp32})
    assert "(the farthest, fp16 and bf16, each 0.014)" in tied.check()  # equal as printed: no single farthest
    assert "(the farthest, bf16, 0.010)" in close.check()
    assert "nothing was compared" in amp.train_alike({"fp32": fp32}).check()  # a check that checked nothing says so
    with pytest.raises(ValueError, match="same number of steps"):
        amp.train_alike({"fp32": fp32, "bf16": fp32[:10]})
    with pytest.raises(ValueError, match="no 'fp32' curve"):
        amp.train_alike({"bf16": fp32})
    assert close.plot(floor=1.0, title="t").axes


def test_saved_activation_bytes_counts_custom_functions_and_not_parameters():
    torch.manual_seed(0)
    head = nn.Linear(8, 100)
    features = torch.randn(32, 8, requires_grad=True)
    targets = torch.randint(0, 100, (32,))
    plain = amp.saved_activation_bytes(head, lambda: train.lm_loss(head(features)[None], targets[None]))
    chunked = amp.saved_activation_bytes(head, lambda: train.chunked_lm_loss(features, head, targets, chunk_tokens=8))
    assert plain >= 32 * 100 * 4  # the fp32 log-probabilities
    assert chunked == 32 * 8 * 4 + 100 * 8 * 4 + 100 * 4  # the gradients it keeps: features, weight, bias


def _saved(op, dtype, nbytes):
    return SavedTensor(op, "result", dtype, (1,), nbytes)


def test_loss_anatomy_rows_and_its_sentences():
    fp32 = [_saved("LogSoftmaxBackward0", torch.float32, 400), _saved("AddmmBackward0", torch.float32, 600)]
    low = [_saved("LogSoftmaxBackward0", torch.bfloat16, 200), _saved("NllLossBackward0", torch.float32, 400),
           _saved("AddmmBackward0", torch.bfloat16, 300)]
    rows, text = amp.loss_anatomy({"fp32": fp32, "bf16": low})
    assert rows[-1] == {"kept for backward by": "everything", "fp32 run": "1000 B", "bf16 run": "900 B"}
    assert "The loss keeps 400 B in the fp32 run and 600 B in the bf16 run: 67%" in text
    assert "(50%)" in text and text.endswith("bf16 keeps 10% less than fp32.")
    _, more = amp.loss_anatomy({"fp32": fp32, "bf16": [*low, _saved("MulBackward0", torch.float32, 500)]})
    assert more.endswith("bf16 keeps 40% more than fp32.")


def test_same_gradients_accepts_the_chunked_loss_and_rejects_a_wrong_one():
    torch.manual_seed(0)
    model = models.TransformerModel(models.TransformerConfig(vocab_size=300, d_model=32, nhead=2, num_layers=1,
                                                             dim_feedforward=64, dropout=0.0))
    x, y = data.synthetic_tokens(2, 16, 300)
    plain = lambda: train.lm_loss(model(x), y)  # noqa: E731
    text = amp.same_gradients(model, {"plain": plain, "chunked": lambda: train.chunked_lm_loss(
        model.features(x), model.head, y, chunk_tokens=8)}, amp_dtype=torch.bfloat16)
    assert text.startswith("loss: plain") and "from plain's (relative; within 0.02: checked)" in text
    with pytest.raises(AssertionError, match="twice differs from plain"):
        amp.same_gradients(model, {"plain": plain, "twice": lambda: 2 * plain()}, amp_dtype=torch.bfloat16)


def _steps():
    rounds = {"fp32": [0.060, 0.061, 0.059, 0.060, 0.062, 0.060], "bf16": [0.020, 0.021, 0.020, 0.019, 0.020, 0.021]}
    return bench.Comparison.from_rounds(rounds, device="cuda", work=bench.Work(1e12, "FLOP"), title="step")


def test_step_rows_and_records():
    steps = _steps()
    memory = {"fp32": {"peak_bytes": 7 * 2**30, "saved_bytes": 3 * 2**30}, "bf16": {"peak_bytes": None,
                                                                                  "saved_bytes": 2**30}}
    rows = amp.step_rows(steps, tokens=8192, peaks={"fp32": 50.0, "bf16": 700.0}, memory=memory)
    assert rows[0]["% of sustained peak"] == "33%" and rows[0]["peak memory"] == "7.00 GiB"
    bf16_s = 0.060 / steps.speedup("bf16")  # the baseline's median over the paired speed-up: one number per variant
    assert steps.time_s("bf16") == pytest.approx(bf16_s)
    assert rows[1]["peak memory"] == "—" and rows[1]["tokens/s"] == f"{8192 / bf16_s:,.0f}"
    results.RECORDED.clear()
    amp.record_steps(steps, {"fp32": "fp32", "bf16": "bf16", "tf32": "tf32"}, memory)
    assert set(results.RECORDED) == {"step_ms_fp32", "step_ms_bf16", "peak_mem_gib_fp32"}  # tf32 was not timed
    fp32 = results.RECORDED["step_ms_fp32"]
    assert fp32.unit == "ms" and fp32.value == pytest.approx(60.0) and fp32.band[0] <= 60.0 <= fp32.band[1]
    assert results.RECORDED["peak_mem_gib_fp32"].value == pytest.approx(7.0)
    assert results.RECORDED["peak_mem_gib_fp32"].unit == "GiB"


@pytest.mark.parametrize("rounds,outcome", [
    ([1.0, 1.01, 0.99, 1.0, 1.0, 1.01], "same"), ([1.2, 1.21, 1.19, 1.2, 1.22, 1.2], "slower"),
    ([0.8, 1.3, 0.9, 1.25, 0.85, 1.2], "inconclusive"), ([0.8, 0.81, 0.79, 0.8, 0.8, 0.81], "faster")])
def test_scaler_cost_prints_what_it_measured_whatever_the_outcome(rounds, outcome):
    comparison = bench.Comparison.from_rounds({"fp16, no scaler": [1.0] * 6, "fp16 + GradScaler": rounds})
    verdict = comparison.verdict("fp16 + GradScaler")
    assert verdict.outcome == outcome
    text = amp.scaler_cost(verdict, SimpleNamespace(busy_s=3e-3, idle_s=10e-3),
                           SimpleNamespace(busy_s=3.2e-3, idle_s=11e-3), syncs=(0, 1))
    assert ("GPU work 3.00 ms → 3.20 ms per step, GPU idle 10.0 ms → 11.0 ms; host synchronisations per step 0 → 1"
            in text)


def test_step_pace_names_the_side_that_set_the_step():
    def profile(busy_s, wall_s, on_gpu=True, kernels=500):
        return SimpleNamespace(busy_s=busy_s, wall_s=wall_s, on_gpu=on_gpu, idle_fraction=1 - busy_s / wall_s,
                               kernels_per_step=kernels)

    tiny = profile(3e-3, 15e-3)  # launch-bound: 80% idle, the host needs 15 ms per step
    gpu_bound = amp.step_pace("fp32", profile(57e-3, 59e-3), tiny, tiny_label="1 × 64 tokens")
    assert "GPU work 57" in gpu_bound and "about 15" in gpu_bound and "GPU idle 80%" in gpu_bound
    assert "the GPU sets" in gpu_bound
    assert "the two are close" in amp.step_pace("bf16", profile(13.7e-3, 15.5e-3), tiny, tiny_label="1 × 64")
    assert "the host sets" in amp.step_pace("bf16", profile(8e-3, 16e-3), tiny, tiny_label="1 × 64")
    busy_tiny = amp.step_pace("bf16", profile(13.7e-3, 15.5e-3), profile(10e-3, 12e-3), tiny_label="1 × 64")
    assert "no split" in busy_tiny and "sets" not in busy_tiny
    assert "on a CPU" in amp.step_pace("bf16", profile(0.0, 1.0, on_gpu=False), tiny, tiny_label="1 × 8")
    # a full step with more kernels than the tiny one: the tiny step's time is only a lower bound on the host's
    tiny_fewer = profile(2e-3, 10e-3, kernels=400)
    more = amp.step_pace("bf16", profile(16e-3, 17e-3, kernels=800), tiny_fewer, tiny_label="1 × 64")
    assert "at least 10" in more and "400 kernels to this step's 800" in more and "the two are close" in more
    assert "the GPU sets" in amp.step_pace("bf16", profile(31e-3, 32e-3, kernels=800), tiny_fewer, tiny_label="1×64")


def test_scaler_in_a_loop_checks_both_rules_on_cpu():
    rows = amp.scaler_in_a_loop("cpu")
    assert "bit-identical" in rows[0]["result"] and "with the scaler's state" in rows[0]["check"]
    assert "apart" in rows[2]["result"]


def test_close_to_is_a_sweep_check():
    check = amp.close_to(1e-2)
    check(torch.ones(4) * 1.001, torch.ones(4))
    with pytest.raises(AssertionError, match="relative error"):
        check(torch.ones(4) * 1.1, torch.ones(4))
    with pytest.raises(AssertionError):
        check(torch.full((4,), float("nan")), torch.ones(4))


def test_cpu_bf16_reasons_follow_the_cpus_matrix_units(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    assert "no bf16 matrix units" in amp.cpu_bf16_reasons()["slower"] and "faster" not in amp.cpu_bf16_reasons()
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert amp.cpu_bf16_reasons() == {"faster": "this CPU has AMX for bf16 matmuls"}
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")
    assert amp.cpu_bf16_reasons() == {}, "a build without the probes gives no reason rather than a guess"
