"""utils.checkpointing: the operator counter, and activation checkpointing, full and selective: the same loss and
gradients as without it, what backward recomputes counted, a policy that matches nothing detected, and (on a GPU)
a lower peak.
"""

from contextlib import nullcontext

import pytest
import torch

from tests.tiny_transformer import SMALL, small_lm
from utils import checkpointing, memory, train

MiB = 2**20
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")




ATEN = torch.ops.aten


def _grads(model, x, y):
    model.zero_grad(set_to_none=True)
    loss = train.lm_loss(model(x), y)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_op_counter_sees_the_matmuls_linear_decomposes_into():
    model, x, _ = small_lm()
    with checkpointing.OpCounter() as ops:
        model(x)
    names = {checkpointing.op_name(op) for op in ops.matmuls()}
    assert names <= {"aten.addmm.default", "aten.mm.default"} and "aten.addmm.default" in names
    assert checkpointing.is_matmul(ATEN.mm.default) and checkpointing.is_matmul(ATEN.addmm)
    assert not checkpointing.is_matmul(ATEN.relu)
    assert checkpointing.is_attention(ATEN._scaled_dot_product_efficient_attention.default)
    assert checkpointing.is_attention(ATEN._scaled_dot_product_flash_attention_for_cpu)
    assert not checkpointing.is_attention(ATEN.mm.default) and not checkpointing.is_matmul(
        ATEN._scaled_dot_product_flash_attention.default)
    assert all(hasattr(ATEN, name) for name in checkpointing.ATTENTION_OPS)  # the names exist in this PyTorch
    assert sum(ops.compute_ops().values()) < sum(ops.counts.values())  # views are left out


@pytest.mark.parametrize("save", [None, [ATEN.mm.default, ATEN.addmm.default]])
def test_checkpointing_gives_the_same_gradients_and_counts_recomputation(save):
    model, x, y = small_lm()
    loss, grads = _grads(model, x, y)
    ac = checkpointing.ActivationCheckpointing(model.encoder.layers, save=save)
    with ac:
        ckpt_loss, ckpt_grads = _grads(model, x, y)
    assert "forward" not in model.encoder.layers[0].__dict__, "the original forward must be back"
    torch.testing.assert_close(ckpt_loss, loss)
    for g, h in zip(ckpt_grads, grads, strict=True):
        torch.testing.assert_close(g, h)
    assert ac.recomputed_compute_ops() > 0
    if save is None:
        assert ac.recomputed_matmuls() == 8 and not ac.selective  # 4 per layer: in-proj, out-proj, 2 linear
    else:
        assert ac.recomputed_matmuls() == 0 and ac.unmatched() == []
        assert sum(ac.saved.values()) == 8


@pytest.mark.parametrize("wrong", [[ATEN.addmm, ATEN.mm], [ATEN.linear.default]])
def test_a_policy_naming_ops_that_never_dispatch_recomputes_everything(wrong):
    model, x, y = small_lm()
    full = checkpointing.ActivationCheckpointing(model.encoder.layers)
    with full:
        _grads(model, x, y)
    ac = checkpointing.ActivationCheckpointing(model.encoder.layers, save=wrong)
    with ac:
        _grads(model, x, y)
    assert ac.recomputed_matmuls() == full.recomputed_matmuls() > 0
    assert ac.unmatched() == [checkpointing.op_name(op) for op in wrong]
    ac.reset()
    assert not ac.saved and not ac.recomputed


def test_checkpointing_without_counting_records_nothing_and_computes_the_same():
    model, x, y = small_lm()
    loss, grads = _grads(model, x, y)
    for save in (None, [ATEN.mm.default, ATEN.addmm.default]):
        ac = checkpointing.ActivationCheckpointing(model.encoder.layers, save=save, counting=False)
        with ac:
            ckpt_loss, ckpt_grads = _grads(model, x, y)
        torch.testing.assert_close(ckpt_loss, loss)
        for g, h in zip(ckpt_grads, grads, strict=True):
            torch.testing.assert_close(g, h)
        assert not ac.recomputed
        ac.counting = True  # switched back on: counted again
        with ac:
            _grads(model, x, y)
        assert ac.recomputed_matmuls() == (8 if save is None else 0) and ac.recomputed_compute_ops() > 0


def test_checkpointing_bad_use():
    with pytest.raises(ValueError, match="at least one"):
        checkpointing.ActivationCheckpointing([])
    model, x, _ = small_lm()
    ac = checkpointing.ActivationCheckpointing(model.encoder.layers)
    with ac, pytest.raises(RuntimeError, match="already replaced"), checkpointing.ActivationCheckpointing(
            model.encoder.layers):
        pass
    with ac, torch.no_grad():
        model(x)  # no grad: plain forward, nothing recomputed later
    assert not ac.recomputed


# --- on a real GPU --------------------------------------------------------------------------------


@cuda
def test_cuda_checkpointing_counts_what_the_backward_thread_recomputes():
    # On a GPU, backward (and so the recomputation) runs on autograd's device thread, not the caller's.
    model, x, y = small_lm()
    model, x, y = model.cuda(), x.cuda(), y.cuda()
    loss, grads = _grads(model, x, y)
    with checkpointing.OpCounter() as ops:
        model(x)
    overloads = sorted(ops.matmuls(), key=str)
    packets = [getattr(ATEN, op.overloadpacket.__name__.split(".")[-1]) for op in overloads]
    counts = {}
    for name, save in (("full", None), ("overloads", overloads), ("packets", packets)):
        ac = checkpointing.ActivationCheckpointing(model.encoder.layers, save=save)
        with ac:
            ckpt_loss, ckpt_grads = _grads(model, x, y)
        torch.testing.assert_close(ckpt_loss, loss, rtol=1e-5, atol=1e-6)
        for g, h in zip(ckpt_grads, grads, strict=True):
            torch.testing.assert_close(g, h, rtol=1e-4, atol=1e-6)
        counts[name] = (ac.recomputed_matmuls(), ac.recomputed_compute_ops(), ac.unmatched())
    assert counts["full"][0] == 8 and counts["full"][1] > 0  # 4 matmuls per layer
    assert counts["overloads"][0] == 0 and counts["overloads"][2] == []
    assert counts["packets"][0] == counts["full"][0] and len(counts["packets"][2]) == len(packets)


@cuda
def test_cuda_checkpointing_lowers_the_peak_of_a_step():
    model, _, _ = small_lm()
    model = model.cuda()
    x = torch.randint(0, SMALL.vocab_size, (32, 128), device="cuda")
    peaks = {}
    variants = (("plain", nullcontext()), ("checkpointed", checkpointing.ActivationCheckpointing(model.encoder.layers)))
    for name, ac in variants:
        model.zero_grad(set_to_none=True)
        with memory.track_peak("cuda") as mem, ac:
            train.lm_loss(model(x), x).backward()
        peaks[name] = mem.peak_increase_bytes
    # the layers keep ~5 KB per token without checkpointing, 0.5 KB with it: 4,096 tokens
    assert peaks["checkpointed"] < peaks["plain"] - 8 * MiB, peaks


def test_count_recomputation_and_check_policies_catch_the_slip():
    model, x, y = small_lm()
    overloads = [ATEN.mm.default, ATEN.addmm.default]
    policies = {"full": None, "overloads": overloads, "packets": [ATEN.mm, ATEN.addmm]}
    rows = checkpointing.count_recomputation(model.encoder.layers,
                                             lambda: train.lm_loss(model(x), y).backward(), policies)
    assert [r["policy"] for r in rows.values()] == list(policies)
    assert rows["full"]["matmuls recomputed"] == rows["packets"]["matmuls recomputed"] == 8
    assert rows["overloads"]["matmuls recomputed"] == 0 and rows["packets"]["named but never matched"] != "—"
    assert rows["full"]["attention recomputed"] == rows["overloads"]["attention recomputed"] > 0  # SDPA: not kept
    text = checkpointing.check_policies(rows, full="full", selective="overloads", slip="packets")
    assert "no matmul recomputed, against 8" in text and "matches nothing" in text
    with pytest.raises(AssertionError, match="recomputed 8 matmuls it should keep"):
        checkpointing.check_policies(rows, full="full", selective="packets")
    with pytest.raises(AssertionError, match="not the 8"):
        checkpointing.check_policies(rows, full="full", selective="overloads", slip="overloads")
    with pytest.raises(AssertionError, match="nothing was checkpointed"):
        checkpointing.check_policies(rows, full="overloads", selective="overloads")


def test_record_overhead_records_the_step_time_cost_with_its_band():
    from utils import bench, results

    steps = bench.Comparison.from_rounds({"base": [1.0] * 8, "full": [1.2] * 7 + [1.25], "sel": [1.1] * 8})
    checkpointing.record_overhead(steps, {"full_pct": "full", "sel_vs_full_pct": "sel"})
    assert results.RECORDED["full_pct"].unit == "%"
    assert results.RECORDED["full_pct"].value == pytest.approx(20.0)
    low, high = results.RECORDED["full_pct"].band
    assert low <= 20.0 <= high
    checkpointing.record_overhead(steps, {"sel_vs_full_pct": "sel"}, against="full")
    assert results.RECORDED["sel_vs_full_pct"].value == pytest.approx(100 * (1.1 / 1.2 - 1))


def test_costlier_in_16_bits_flags_a_recompute_that_costs_more_than_fp32s():
    from utils import bench

    rounds = {"fp32": [60e-3] * 8, "fp32 + ckpt": [69e-3] * 7 + [70e-3], "bf16": [18e-3] * 7 + [18.5e-3],
              "bf16 + ckpt": [34e-3] * 6 + [33e-3, 35e-3]}
    steps = bench.Comparison.from_rounds(rounds)
    text = checkpointing.costlier_in_16_bits(steps, fp32=("fp32", "fp32 + ckpt"), low=("bf16", "bf16 + ckpt"))
    assert text is not None and "16.0 ms per step" in text and "9.00 ms in fp32" in text
    cheap = dict(rounds, **{"bf16 + ckpt": [21e-3] * 8})  # 3 ms added in 16 bits against 9 ms: as expected
    steps = bench.Comparison.from_rounds(cheap)
    assert checkpointing.costlier_in_16_bits(steps, fp32=("fp32", "fp32 + ckpt"), low=("bf16", "bf16 + ckpt")) is None
