"""utils.gpt2_fused: the Triton decode step computes the model's function — its logits, its cache writes, its greedy
tokens — in Triton's CPU interpreter here and compiled on a GPU; its block choices stay within their limits; bad
inputs fail clearly."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from utils import gpt2

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def run_interpreted(script: str) -> None:
    """``script`` in a fresh process with Triton's interpreter on (it must be set before triton is imported)."""
    prologue = 'import os\nos.environ["TRITON_INTERPRET"] = "1"\n'
    result = subprocess.run([sys.executable, "-c", prologue + textwrap.dedent(script)], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": REPO_ROOT})
    output = result.stdout[-2000:] + result.stderr[-3000:]
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), output


def test_fused_step_matches_the_model_in_the_interpreter():
    """Logits and cache writes against the model's own static-cache step: fp32 and fp16, batch 1 and 2, an empty
    cache (position 0), one attention split and several (some of them empty), a non-contiguous token column."""
    run_interpreted("""
        import torch
        from utils import gpt2, gpt2_fused
        assert gpt2_fused.TRITON_INTERPRETED
        torch.manual_seed(0)
        config = gpt2.GPT2Config.tiny()
        tokens = torch.randint(0, config.vocab_size, (2, 128))
        original = gpt2_fused.attention_blocks
        for dtype, rel in ((torch.float32, 1e-5), (torch.float16, 3e-3)):  # no bf16: numpy has none
            model = gpt2.GPT2(config).eval().to(dtype)
            for splits in (None, 4, 8):  # None: the module's choice (1 split up to 127 positions, then 2)
                gpt2_fused.attention_blocks = original if splits is None else (
                    lambda max_len, s=splits: {"SPLITS": s, "BLOCK_T": 16, "ITERS": -(-max_len // (16 * s)),
                                               "num_warps": 4})
                step = gpt2_fused.FusedDecodeStep(model)
                for batch, prompt, max_len in ((1, 0, 16), (2, 3, 16), (2, 40, 64), (1, 100, 128)):
                    ours = gpt2.StaticKVCache(config, batch, max_len, dtype=dtype)
                    theirs = gpt2.StaticKVCache(config, batch, max_len, dtype=dtype)
                    with torch.inference_mode():
                        if prompt:
                            model(tokens[:batch, :prompt], torch.arange(prompt), ours)
                            model(tokens[:batch, :prompt], torch.arange(prompt), theirs)
                        for p in (prompt, prompt + 1):
                            pos = torch.tensor([p])
                            expected = model(tokens[:batch, p:p + 1], pos, theirs).float()
                            got = step(tokens[:batch, p:p + 1], pos, ours)  # a column of [B, 128]: strided
                            err = ((got - expected).norm() / expected.norm()).item()
                            assert got.shape == expected.shape and err < rel, (dtype, splits, batch, p, err)
                            k_err = (ours.k.float() - theirs.k.float()).abs().max().item()
                            v_err = (ours.v.float() - theirs.v.float()).abs().max().item()
                            assert max(k_err, v_err) < rel * 10, (dtype, splits, batch, p, k_err, v_err)
        print("ok")
    """)


def test_fused_greedy_decoder_gives_the_eager_decoders_tokens_in_the_interpreter():
    """StaticDecoder(fused_step=True): the argmax inside the head's kernel, the pick kernel's bookkeeping (token,
    output, position) — the same tokens as the eager step in fp32, for two sequences that differ."""
    run_interpreted("""
        import torch
        from utils import gpt2
        torch.manual_seed(1)
        config = gpt2.GPT2Config.tiny()
        model = gpt2.GPT2(config).eval()
        prompt = torch.randint(0, config.vocab_size, (2, 5))
        eager = gpt2.StaticDecoder(model, batch=2, max_len=24).generate(prompt, 12)
        fused = gpt2.StaticDecoder(model, batch=2, max_len=24, fused_step=True).generate(prompt, 12)
        assert torch.equal(eager, fused), (eager, fused)
        assert not torch.equal(fused[0], fused[1])
        print("ok")
    """)


INT8_MODEL = """
    import torch
    from torch import nn
    from utils import gpt2, gpt2_fused


    class Int8Linear(nn.Module):  # int8 weight-only, one scale per output, as notebook 08c writes it
        def __init__(self, linear):
            super().__init__()
            w = linear.weight.detach().float()
            scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
            self.register_buffer("weight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
            self.register_buffer("scale", scale.to(linear.weight.dtype))
            self.register_buffer("bias", linear.bias.detach().clone())

        def forward(self, x):
            return nn.functional.linear(x, self.weight.to(x.dtype)) * self.scale + self.bias


    def quantized(model):
        for block in model.h:
            for parent, name in ((block.attn, "c_attn"), (block.attn, "c_proj"), (block.mlp, "c_fc"),
                                 (block.mlp, "c_proj")):
                if isinstance(parent, nn.ModuleDict):
                    parent[name] = Int8Linear(parent[name])
                else:
                    setattr(parent, name, Int8Linear(getattr(parent, name)))
        return model
"""


def test_fused_step_reads_int8_weights_with_their_scales_in_the_interpreter():
    """A model whose block layers hold int8 weights and a scale per output: the step's logits and greedy tokens
    match the model's own (which dequantizes), in fp32 and fp16; an int8 layer without its scales is refused."""
    run_interpreted(textwrap.dedent(INT8_MODEL) + textwrap.dedent("""
        torch.manual_seed(2)
        config = gpt2.GPT2Config.tiny()
        tokens = torch.randint(0, config.vocab_size, (2, 40))
        for dtype, rel in ((torch.float32, 1e-5), (torch.float16, 3e-3)):
            model = quantized(gpt2.GPT2(config).eval().to(dtype))
            assert model.h[0].mlp["c_fc"].weight.dtype == torch.int8
            step = gpt2_fused.FusedDecodeStep(model)
            ours, theirs = (gpt2.StaticKVCache(config, 2, 64, dtype=dtype) for _ in range(2))
            with torch.inference_mode():
                model(tokens[:, :20], torch.arange(20), ours)
                model(tokens[:, :20], torch.arange(20), theirs)
                pos = torch.tensor([20])
                expected = model(tokens[:, 20:21], pos, theirs).float()
                got = step(tokens[:, 20:21], pos, ours)
            err = ((got - expected).norm() / expected.norm()).item()
            assert err < rel, (dtype, err)
        model = quantized(gpt2.GPT2(config).eval())
        prompt = tokens[:, :5]
        eager = gpt2.StaticDecoder(model, batch=2, max_len=24).generate(prompt, 12)
        fused = gpt2.StaticDecoder(model, batch=2, max_len=24, fused_step=True).generate(prompt, 12)
        assert torch.equal(eager, fused), (eager, fused)
        del model.h[1].attn.c_proj.scale
        try:
            gpt2_fused.FusedDecodeStep(model)
        except ValueError as e:
            assert "h.1.attn.c_proj has int8 weights" in str(e), e
        else:
            raise AssertionError("an int8 layer without its scales was accepted")
        print("ok")
    """))


def test_bad_inputs_are_clear_errors_in_the_interpreter():
    run_interpreted("""
        import torch
        from utils import gpt2, gpt2_fused
        config = gpt2.GPT2Config.tiny()
        model = gpt2.GPT2(config).eval()
        step = gpt2_fused.FusedDecodeStep(model)
        cache = gpt2.StaticKVCache(config, 1, 16)
        pos = torch.tensor([3])
        cases = [((torch.zeros(1, 2, dtype=torch.int64), pos, cache), "one int64 token per sequence"),
                 ((torch.zeros(1, 1, dtype=torch.int32), pos, cache), "one int64 token per sequence"),
                 ((torch.zeros(1, 1, dtype=torch.int64), torch.tensor([3, 4]), cache), "one int64 position"),
                 ((torch.zeros(1, 1, dtype=torch.int64), pos, gpt2.DynamicKVCache()), "StaticKVCache"),
                 ((torch.zeros(2, 1, dtype=torch.int64), pos, cache), "must match the model"),
                 ((torch.zeros(1, 1, dtype=torch.int64), pos, gpt2.StaticKVCache(config, 1, 16, dtype=torch.float16)),
                  "must match the model")]
        for args, message in cases:
            try:
                step(*args)
            except ValueError as err:
                assert message in str(err), (message, err)
            else:
                raise AssertionError(f"no error for {message}")
        try:
            gpt2_fused.FusedDecodeStep(model, pdl=True)
        except ValueError as err:
            assert "programmatic dependent launch needs a Hopper" in str(err)
        else:
            raise AssertionError("PDL accepted in the interpreter")
        try:
            gpt2.StaticDecoder(model, batch=1, max_len=16, fused_step=True, compile_step=True)
        except ValueError as err:
            assert "choose one of compile_step and fused_step" in str(err)
        else:
            raise AssertionError("both steps accepted")
        other = gpt2.GPT2(config).eval()
        try:
            gpt2.StaticDecoder(model, batch=1, max_len=16, fused_step=gpt2_fused.FusedDecodeStep(other))
        except ValueError as err:
            assert "a utils.gpt2_fused.FusedDecodeStep of this model" in str(err)
        else:
            raise AssertionError("another model's step accepted")
        print("ok")
    """)


def test_a_cpu_model_without_the_interpreter_says_how():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs Triton's interpreter")
    gpt2_fused = pytest.importorskip("utils.gpt2_fused")
    if gpt2_fused.triton is None:
        pytest.skip("triton is not installed")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        gpt2_fused.FusedDecodeStep(gpt2.GPT2(gpt2.GPT2Config.tiny()))


def test_block_choices_stay_within_their_limits():
    gpt2_fused = pytest.importorskip("utils.gpt2_fused")
    if gpt2_fused.triton is None:
        pytest.skip("triton is not installed")
    for n, k in ((2304, 768), (768, 768), (3072, 768), (768, 3072), (50257, 768), (192, 64), (7, 3)):
        for wanted in (8, 264, 528):
            block_n, block_k, warps = gpt2_fused._blocks(n, k, wanted)
            assert block_k >= k and block_k & (block_k - 1) == 0  # the whole row in one power-of-two tile
            assert block_n >= 2 and block_n & (block_n - 1) == 0 and block_n * block_k <= gpt2_fused.MAX_TILE
            assert warps in (4, 8)
    assert gpt2_fused._blocks(768, 768, 264)[0] == 2  # 384 programs for 132 multiprocessors: at least two each
    for max_len, splits in ((16, 1), (64, 1), (128, 2), (384, 4), (1024, 8), (4096, 8)):
        blocks = gpt2_fused.attention_blocks(max_len)
        assert blocks["SPLITS"] == splits and blocks["BLOCK_T"] <= 128, (max_len, blocks)
        assert blocks["SPLITS"] * blocks["BLOCK_T"] * blocks["ITERS"] >= max_len  # every position has a split


@needs_cuda
@pytest.mark.parametrize("pdl", [False, None], ids=["no PDL", "PDL where the GPU has it"])
def test_fused_step_on_the_gpu_matches_the_model(pdl):
    from utils import gpt2_fused

    torch.manual_seed(0)
    config = gpt2.GPT2Config()
    model = gpt2.GPT2(config).eval().cuda()
    tokens = torch.randint(0, config.vocab_size, (3, 300), device="cuda")
    for dtype, rel in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        low = model.to(dtype)
        step = gpt2_fused.FusedDecodeStep(low, pdl=pdl)
        for batch, prompt, max_len in ((1, 128, 384), (3, 200, 256), (1, 5, 1024)):
            ours = gpt2.StaticKVCache(config, batch, max_len, dtype=dtype).cuda()
            theirs = gpt2.StaticKVCache(config, batch, max_len, dtype=dtype).cuda()
            with torch.inference_mode():
                positions = torch.arange(prompt, device="cuda")
                low(tokens[:batch, :prompt], positions, ours)
                low(tokens[:batch, :prompt], positions, theirs)
                pos = torch.tensor([prompt], device="cuda")
                expected = low(tokens[:batch, prompt:prompt + 1], pos, theirs).float()
                got = step(tokens[:batch, prompt:prompt + 1], pos, ours)
            err = ((got - expected).norm() / expected.norm()).item()
            assert err < rel, (dtype, batch, prompt, err)


@needs_cuda
def test_fused_step_on_the_gpu_reads_int8_weights():
    """GPT-2 small in bf16 with int8 block layers (08c's sweep): the compiled kernels' logits match the model's."""
    from utils import gpt2_fused

    scope: dict = {}
    exec(textwrap.dedent(INT8_MODEL), scope)  # noqa: S102 (the test's own source: Int8Linear and quantized())
    torch.manual_seed(0)
    config = gpt2.GPT2Config()
    model = scope["quantized"](gpt2.GPT2(config).eval().cuda().to(torch.bfloat16))
    tokens = torch.randint(0, config.vocab_size, (1, 129), device="cuda")
    step = gpt2_fused.FusedDecodeStep(model)
    ours, theirs = (gpt2.StaticKVCache(config, 1, 256, dtype=torch.bfloat16).cuda() for _ in range(2))
    with torch.inference_mode():
        positions = torch.arange(128, device="cuda")
        model(tokens[:, :128], positions, ours)
        model(tokens[:, :128], positions, theirs)
        pos = torch.tensor([128], device="cuda")
        expected = model(tokens[:, 128:], pos, theirs).float()
        got = step(tokens[:, 128:], pos, ours)
    assert ((got - expected).norm() / expected.norm()).item() < 3e-2


@needs_cuda
def test_fused_decoder_replays_pick_the_greedy_tokens():
    from utils import gpt2_fused

    torch.manual_seed(0)
    config = gpt2.GPT2Config()
    model = gpt2.GPT2(config).eval().cuda()
    low = gpt2.GPT2(config).eval().cuda().to(torch.bfloat16)
    low.load_state_dict(model.state_dict())
    prompt = torch.randint(0, config.vocab_size, (2, 64), device="cuda")
    decoder = gpt2.StaticDecoder(low, batch=2, max_len=160, fused_step=True)
    tokens = decoder.generate(prompt, 96)
    assert decoder.graph is not None and tokens.shape == (2, 160)
    for row in range(2):
        assert gpt2.is_greedy(model, tokens[row:row + 1], 64)
    again = decoder.generate(prompt, 96)  # replays from the same prompt: the same tokens
    assert torch.equal(tokens, again)
    without_pdl = gpt2.StaticDecoder(low, batch=2, max_len=160,
                                     fused_step=gpt2_fused.FusedDecodeStep(low, pdl=False)).generate(prompt, 96)
    assert torch.equal(without_pdl, tokens)  # the same kernels, launched without overlap
    fp32 = gpt2.StaticDecoder(model, batch=2, max_len=160, fused_step=True).generate(prompt, 96)
    for row in range(2):  # fp32 weights: every token the argmax, up to fp32 rounding
        assert gpt2.is_greedy(model, fp32[row:row + 1], 64, rel=1e-4)
