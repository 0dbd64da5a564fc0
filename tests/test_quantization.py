"""utils.quantization: sizes, bytes, the accuracy check that fails a broken quantization, the decode sweep on CPU,
perplexity, torchao's gate, the fp8 recipes on CPU, and notebook 08c's int8 layers and kernel shape."""

from __future__ import annotations

import builtins
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import utils.quantization as uq
from utils import gpt2


class Int8Linear(nn.Module):
    """The notebook's layer (per-channel int8 weights, dequantize then matmul), as the tests need it."""

    def __init__(self, linear, max_abs_to=127.0):
        super().__init__()
        w = linear.weight.detach()
        scale = w.float().abs().amax(dim=1).clamp(min=1e-12) / max_abs_to
        self.register_buffer("weight", torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(w.dtype))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x):
        y = F.linear(x, self.weight.to(x.dtype)) * self.scale
        return y if self.bias is None else y + self.bias


def quantize_linears(model, layer_class=Int8Linear):
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, nn.Linear):
                setattr(module, name, layer_class(child))
    return model


def test_parameter_count_matches_the_model():
    for config in [gpt2.GPT2Config.tiny(), *uq.CPU_CONFIGS.values()]:
        assert uq.parameter_count(config) == gpt2.count_parameters(gpt2.GPT2(config))
    assert 1.5e9 < uq.parameter_count(uq.GPT2_CONFIGS["GPT-2 XL 1.5B"]) < 1.6e9
    assert 124e6 < uq.parameter_count(uq.GPT2_CONFIGS["GPT-2 124M"]) < 125e6


def test_sizes_are_chosen_from_the_device():
    assert uq.gpt2_sizes("cpu") == uq.CPU_CONFIGS
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(uq, "get_device", lambda d=None: torch.device("cuda"))
        every = uq.gpt2_sizes("cuda", free_bytes=80 << 30)
        assert list(every) == list(uq.GPT2_CONFIGS)
        small = uq.gpt2_sizes("cuda", free_bytes=8 << 30)  # an 8 GB card: XL's build needs about 19 GB
        assert "GPT-2 XL 1.5B" not in small and "GPT-2 124M" in small
        assert list(uq.gpt2_sizes("cuda", free_bytes=1 << 20)) == ["GPT-2 124M"]  # at least the smallest


def test_weight_bytes_counts_int8_as_one_byte_and_tied_weights_once():
    layer = nn.Linear(64, 32).to(torch.bfloat16)
    assert uq.weight_bytes(layer) == (64 * 32 + 32) * 2
    assert uq.weight_bytes(Int8Linear(layer)) == 64 * 32 + 32 * 2 + 32 * 2  # int8 weight, bf16 scale and bias
    model = gpt2.GPT2(gpt2.GPT2Config.tiny())
    assert uq.weight_bytes(model) == gpt2.count_parameters(model) * 4  # the head shares wte: counted once


def test_check_logits_reports_errors_and_fails_a_broken_quantization():
    torch.manual_seed(0)
    reference = torch.randn(2, 8, 100)
    bf16 = reference.bfloat16()
    rounded = reference + 0.01 * torch.randn_like(reference)
    errors = uq.check_logits({"bf16": bf16, "int8": rounded}, reference)
    assert errors["bf16"].ratio == 1.0
    assert errors["int8"].ratio > 1 and 0.005 < errors["int8"].relative_error < 0.02
    assert errors["int8"].top1_agreement > 0.8
    assert "× bf16's own error" in uq.error_verdict(errors["int8"]) or "about bf16" in uq.error_verdict(errors["int8"])
    with pytest.raises(uq.QuantizationBrokeModel, match="broke the model"):
        uq.check_logits({"bf16": bf16, "int8": reference * 3}, reference, what="a wrong scale")
    with pytest.raises(uq.QuantizationBrokeModel, match="not finite"):
        uq.check_logits({"bf16": bf16, "int8": torch.full_like(reference, math.nan)}, reference)
    rows = uq.error_rows({"m": errors})
    assert [r["variant"] for r in rows] == ["bf16", "int8"]


def test_matvec_blocks_fill_the_gpu_within_a_tile():
    for n, k in [(4800, 1600), (1600, 6400), (2304, 768), (7, 5)]:
        block_n, block_k, warps = uq.matvec_blocks(n, k, "cpu")
        assert block_k >= min(k, uq.MAX_TILE) and block_k & (block_k - 1) == 0
        assert 2 <= block_n <= 16 and block_n & (block_n - 1) == 0
        assert block_n * block_k <= max(uq.MAX_TILE, 2 * block_k) and warps in (4, 8)


def test_decode_sweep_on_cpu_checks_times_and_reports():
    configs = {"tiny": gpt2.GPT2Config.tiny()}
    sweep = uq.decode_sweep(configs, {"bf16": lambda m: m, "int8": quantize_linears}, device="cpu", copy_bw=10.0,
                            new_tokens=6, rounds=2, min_run_time=0.05, progress=False)
    (size,) = sweep.sizes
    assert size.steps == 5 and size.weights["int8"] < size.weights["bf16"]
    assert size.step_bytes["int8"] < size.step_bytes["bf16"]
    assert size.tokens_per_s("bf16") > 0 and size.pct_copy("bf16") > 0
    assert size.errors["int8"].ratio >= 1
    rows = sweep.rows()
    assert rows[0]["model"] == "tiny" and "int8 vs bf16" in rows[0]
    assert len(sweep.verdicts()) == 1 and sweep.verdicts()[0].startswith("tiny: int8 vs bf16")
    assert sweep.memory_rows()[0]["int8 weights"] and sweep.accuracy_rows()
    labels = [tick.get_text() for tick in sweep.plot().axes[0].get_xticklabels()]
    assert labels == [uq._count(size.params)] and uq._count(1_557_611_200) == "1.56 B"
    assert sweep.record({"x": ("GPT-2 XL 1.5B", "int8", "speedup")}) == []  # a size this run did not reach


def test_sweep_reasons_set_the_time_saved_against_what_the_bytes_explain():
    """The reason beside a size's verdict compares the time int8 saved per token with the time its fewer bytes take
    at the copy bandwidth: 1.25× or more → elsewhere; within 1.25× → the bytes; less → how fast each read."""
    class Times:  # stands in for the size's comparison: seconds per call of 1 step
        def __init__(self, base, int8):
            self.t = {"bf16": base, "int8": int8}

        def time_s(self, v):
            return self.t[v]

    def reasons(base_s, int8_s):
        size = uq.SizeResult("m", gpt2.GPT2Config.tiny(), 1, Times(base_s, int8_s), 1,
                             {"bf16": 2_000_000, "int8": 1_000_000}, {}, {}, {})  # 1 MB fewer: 1 µs at 1,000 GB/s
        return uq.DecodeSweep([size], 1000.0, "bf16", variants=["bf16", "int8"])._reasons(size, "int8")

    assert "5.0× what the bytes explain: 80% of the gain comes from elsewhere" in reasons(10e-6, 5e-6)["faster"]
    # saved 1.6 µs, 1.6× the bytes' 1 µs: the bytes still explain most of it, and the reason says how much
    assert "1.6× what the bytes explain: 38% of the gain comes from elsewhere" in reasons(10e-6, 8.4e-6)["faster"]
    assert "about what the bytes explain" in reasons(10e-6, 9e-6)["faster"]
    # saved 0.5 µs: half what the bytes explain, and how fast each variant read
    assert reasons(10e-6, 9.5e-6)["faster"].endswith("50% of what the bytes explain: int8 reads at 11% of the copy "
                                                    "bandwidth, bf16 at 20%")
    same = reasons(10e-6, 10e-6)["same"]  # a null result where the bytes predicted 1.11×: said, with the reading rates
    assert "10% of bf16's 10.0 µs per token: 1.11× faster had they been read at that bandwidth, which did not show: " \
        "int8 reads at 10% of the copy bandwidth, bf16 at 20%" in same, same
    assert "under the resolution" in reasons(100e-6, 100e-6)["same"]  # 1 µs of 100: 1.01×
    no_copy = uq.DecodeSweep([], None, "bf16", variants=["bf16", "int8"])
    size = uq.SizeResult("m", gpt2.GPT2Config.tiny(), 1, Times(1.0, 0.5), 1, {"bf16": 2, "int8": 1}, {}, {}, {})
    assert no_copy._reasons(size, "int8")["faster"] == "int8 reads 2.00× fewer bytes per token"


def test_decode_sweep_fails_before_timing_when_a_quantization_breaks_the_model():
    def broken(model):
        quantize_linears(model)
        for m in model.modules():
            if isinstance(m, Int8Linear):
                m.scale.mul_(10)  # a wrong scale
        return model

    with pytest.raises(uq.QuantizationBrokeModel, match="tiny"):
        uq.decode_sweep({"tiny": gpt2.GPT2Config.tiny()}, {"bf16": lambda m: m, "int8": broken}, device="cpu",
                        new_tokens=4, rounds=2, min_run_time=0.01, progress=False)


def test_perplexity_is_low_for_a_model_that_predicts_and_near_the_vocabulary_for_noise():
    class Predicts(nn.Module):
        def forward(self, ids):  # always the next id: (i + 1) mod 10
            return F.one_hot((ids + 1) % 10, 10).float() * 20

    ids = torch.arange(20).remainder(10)[None]
    assert uq.perplexity(Predicts(), ids) < 1.01

    class Uniform(nn.Module):
        def forward(self, ids):
            return torch.zeros(*ids.shape, 10)

    assert uq.perplexity(Uniform(), ids) == pytest.approx(10)
    with pytest.raises(ValueError, match="T >= 2"):
        uq.perplexity(Uniform(), ids[:, :1])


def test_torchao_status_says_why_when_it_is_missing(monkeypatch):
    real_import = builtins.__import__

    def no_torchao(name, *args, **kwargs):
        if name == "torchao" or name.startswith("torchao."):
            raise ModuleNotFoundError("No module named 'torchao'", name="torchao")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchao)
    status = uq.torchao_status()
    assert not status.available and "not installed" in status.why_not


def test_torchao_agrees_with_the_bare_layer():
    status = uq.torchao_status()
    if not status.available:
        pytest.skip(status.why_not)
    torch.manual_seed(0)
    layer = nn.Linear(128, 96).to(torch.bfloat16)
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    reference = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    theirs = copy.deepcopy(layer)
    status.quantize_(theirs, status.Int8WeightOnlyConfig())
    text = uq.agreement(Int8Linear(layer), theirs, x, reference)
    assert "identical" in text and "our formula" in text
    with pytest.raises(AssertionError, match="steps"):  # a quantization with another scale rule is not the same
        uq.agreement(Int8Linear(layer, max_abs_to=60.0), theirs, x, reference)


def test_fp8_recipes_run_on_cpu_and_the_verdict_follows_the_numbers():
    recipes = uq.fp8_support("cpu")
    assert set(recipes) == {"per-tensor", "row-wise"}
    assert "tie" in uq.fp8_scales_verdict({"fp8, per-tensor scales": 0.037, "fp8, row-wise scales": 0.036})
    assert uq.fp8_scales_verdict({"fp8, per-tensor scales": 0.05, "fp8, row-wise scales": 0.037}).startswith(
        "Row-wise scales kept the ordinary rows 1.4× more precise")
    assert "Only one" in uq.fp8_scales_verdict({"fp8, per-tensor scales": 0.05})
    rows = uq.fp8_error_rows({"bf16": 0.003, "fp8, per-tensor scales": 0.036})
    assert rows[1]["× bf16's"] == "12.0×"


def test_fp8_support_gates_gpus_before_ada(monkeypatch):
    monkeypatch.setattr(uq, "get_device", lambda d=None: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    reasons = uq.fp8_support("cuda")
    assert all("8.9" in why and "8.0" in why for why in reasons.values())


def test_fp8_sweep_checks_every_recipe_against_bf16(monkeypatch):
    fp8 = torch.float8_e4m3fn

    def to_fp8(t, rowwise):
        amax = t.abs().amax(dim=1, keepdim=True) if rowwise else t.abs().amax()
        scale = amax.float().clamp(min=1e-12) / 448
        return (t / scale).clamp(-448, 448).to(fp8), scale

    def fp8_matmul(a8, sa, b8, sb):
        return torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb.t(), out_dtype=torch.bfloat16)

    result = uq.fp8_sweep(to_fp8, fp8_matmul, ["per-tensor", "row-wise"], sizes=[64, 128], device="cpu", rounds=2,
                          min_run_time=0.02)
    assert result.variants == ["bf16", "fp8, per-tensor scales", "fp8, row-wise scales"]
    lines = uq.fp8_verdicts(result, to_fp8, device="cpu")
    assert len(lines) == 4 and "converting one 128×128 bf16 activation" in lines[2]
    assert "counted in, fp8 would be" in lines[2] and "× bf16's speed" in lines[2]

    def wrong(a8, sa, b8, sb):  # forgets the scales
        return torch._scaled_mm(a8, b8.t(), scale_a=torch.tensor(1.0), scale_b=torch.tensor(1.0),
                                out_dtype=torch.bfloat16)

    with pytest.raises(ValueError, match="differs from the reference"):
        uq.fp8_sweep(to_fp8, wrong, ["per-tensor"], sizes=[64], device="cpu", rounds=2, min_run_time=0.02)


def test_sample_text_is_long_enough_for_a_perplexity():
    assert len(uq.SAMPLE_TEXT.split()) > 200


KERNEL_CHECK = r'''
import os, sys
os.environ["TRITON_INTERPRET"] = "1"  # before the first import of triton in this process
import nbformat, torch, triton, triton.language as tl
import utils.quantization as uq
nb = nbformat.read(sys.argv[1], as_version=4)
src = next(c.source for c in nb.cells if c.cell_type == "code" and c.source.startswith("@triton.jit"))
ns = {"triton": triton, "tl": tl}
exec(compile(src, "08c kernel cell", "exec"), ns)
for n, k, rows, has_bias, block_k in [(1823, 781, 1, True, None), (96, 4100, 3, False, 1024), (7, 5, 2, True, None)]:
    torch.manual_seed(0)
    w, scale = torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n) / 100
    bias, x, out = torch.randn(n), torch.randn(rows, k), torch.empty(rows, n)
    bn, bk, warps = uq.matvec_blocks(n, k, "cpu")
    ns["int8_matvec_kernel"][(triton.cdiv(n, bn), rows)](x, w, scale, bias if has_bias else scale, out, n, k,
        HAS_BIAS=has_bias, BLOCK_N=bn, BLOCK_K=block_k or bk, num_warps=warps)
    torch.testing.assert_close(out, (x @ w.float().T) * scale + (bias if has_bias else 0), rtol=1e-4, atol=1e-4)
print("kernel ok")
'''


def test_the_notebooks_int8_kernel_in_tritons_interpreter():
    """08c's @triton.jit cell, run by Triton's CPU interpreter on odd shapes (one tile, several along K)."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", KERNEL_CHECK, str(root / "notebooks" / "08c_quantization.ipynb")],
                          cwd=root, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0 and "kernel ok" in done.stdout, done.stderr[-2000:]


SWEEP_FUSED_CHECK = r'''
import os
os.environ["TRITON_INTERPRET"] = "1"  # before the first import of triton in this process
import torch
import utils.quantization as uq
from utils import gpt2, gpt2_fused
from tests.test_quantization import quantize_linears
calls = []
original = gpt2_fused.FusedDecodeStep.greedy
gpt2_fused.FusedDecodeStep.greedy = lambda self, *a: (calls.append(self), original(self, *a))[1]
sweep = uq.decode_sweep({"tiny": gpt2.GPT2Config.tiny()}, {"fp32": lambda m: m, "int8": quantize_linears},
                        device="cpu", dtype=torch.float32, fused_step=True, new_tokens=4, rounds=2,
                        min_run_time=0.01, progress=False)
int8_steps = [s for s in calls if s.model.h[0].mlp["c_fc"].weight.dtype == torch.int8]
assert int8_steps and len(int8_steps) < len(calls), len(calls)  # both variants decoded by the Triton step
assert sweep.sizes[0].tokens_per_s("int8") > 0
print("sweep ok")
'''


def test_decode_sweep_decodes_with_the_triton_step_in_the_interpreter():
    """fused_step=True: both variants decode in utils.gpt2_fused's step, the int8 one reading its int8 weights."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", SWEEP_FUSED_CHECK], cwd=root, capture_output=True, text=True,
                          timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0 and "sweep ok" in done.stdout, done.stderr[-2000:]


def test_copies_past_l2_stream_the_weights_from_memory():
    assert uq.copies_past_l2(20 << 20, "cpu") == 1  # no L2 to get past on a CPU: one layer
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(uq, "get_device", lambda d=None: torch.device("cuda"))
        copies = uq.copies_past_l2(20_480_000, "cuda", l2_bytes=50 << 20)  # GPT-2 XL's 1600→6400 in bf16, 50 MB L2
        assert copies * 20_480_000 >= 4 * (50 << 20) > (copies - 1) * 20_480_000
        assert uq.copies_past_l2(1 << 30, "cuda", l2_bytes=4 << 20) == 1  # a layer far larger than the L2


def test_streamed_layers_run_every_copy_of_every_layer_on_cpu():
    torch.manual_seed(0)
    layer = nn.Linear(32, 16).to(torch.bfloat16)
    calls = []

    class Counted(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            calls.append(id(self))
            return self.inner(x)

    x = torch.randn(1, 32, dtype=torch.bfloat16)
    timed, how = uq.streamed_layers({"bf16": Counted(layer), "int8": Counted(Int8Linear(layer))}, x, 3, device="cpu")
    assert set(timed) == {"bf16", "int8"} and "3 copies" in how and "launched from Python" in how
    timed["bf16"]()
    assert len(calls) == 3 and len(set(calls)) == 3  # three separate copies, each called once
    timed["int8"]()
    assert len(calls) == 6
    assert "one layer per call" in uq.streamed_layers({"a": layer}, x, 1, device="cpu")[1]


def test_error_rows_name_the_baseline():
    reference = torch.randn(4, 10)
    errors = uq.check_logits({"fp16": reference.half(), "int8": reference + 1e-3}, reference)
    assert "× fp16's error" in uq.error_rows({"m": errors}, "fp16")[0]


def test_decode_sweep_in_another_16_bit_type():
    sweep = uq.decode_sweep({"tiny": gpt2.GPT2Config.tiny()}, {"fp16": lambda m: m, "int8": quantize_linears},
                            device="cpu", dtype=torch.float16, new_tokens=4, rounds=2, min_run_time=0.02,
                            progress=False)
    (size,) = sweep.sizes
    assert sweep.baseline == "fp16" and size.weights["fp16"] == gpt2.count_parameters(gpt2.GPT2(size.config)) * 2
    assert "× fp16's error" in sweep.accuracy_rows()[0]
