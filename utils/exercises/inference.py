"""Checks for the exercises of notebooks 08 · Fast decoding (the decoding limit) and 08b · Serving GPT-2 (top-k
sampling on the device)."""

from __future__ import annotations

import torch

from utils.exercises import Miss, close, exercise, no_host_sync


@exercise("1 · The decoding limit")
def max_tokens_per_s(answer, *, model=None, bandwidth_gbps: float | None = None) -> str:
    """``answer(params, bytes_per_param, bandwidth_gbps)``: tokens/s when every step reads every parameter once."""
    # 124 M bf16 parameters at 4,800 GB/s: 248 MB a step, 19,355 steps a second
    got = answer(124_000_000, 2, 4800.0)
    if got is None:
        raise NotImplementedError("max_tokens_per_s returns None: return tokens per second")
    got = float(got)
    if close(got, 4800e9 / 248e6, rel=1e-3):
        pass
    elif close(got, 4800e9 / 124e6, rel=1e-3):
        raise Miss("this ignores the bytes per parameter: a bf16 parameter is 2 bytes")
    elif close(got, 4800 / 248e6, rel=1e-3) or close(got, 4800e12 / 248e6, rel=1e-3):
        raise Miss("the units are off: GB/s is 10⁹ bytes per second")
    elif close(got, 248e6 / 4800e9, rel=1e-3):
        raise Miss("that is seconds per token; the question asks for tokens per second")
    else:
        raise Miss(f"124 M bf16 parameters at 4,800 GB/s allow about 19,400 tokens/s; yours says {got:,.4g}")
    here = ""
    if model is not None and bandwidth_gbps:
        params = sum(p.numel() for p in model.parameters())
        size = next(model.parameters()).element_size()
        here = (f" Here: {answer(params, size, bandwidth_gbps):,.0f} tokens/s for this model in "
                f"{next(model.parameters()).dtype} — the yardstick notebook 08 put every variant against.")
    return "bandwidth over the bytes a step must read." + here


@exercise("1 · Top-k sampling on the device")
def sample_top_k(answer, *, device: torch.device | str = "cpu") -> str:
    """``answer(logits, k, generator)`` returns int64 [batch, 1] on the logits' device, drawn from the top-k softmax."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.full((4, 50), -5.0, device=device)
    logits[:, 7], logits[:, 3], logits[:, 42] = 3.0, 2.5, 2.9  # the top 3 of every row
    draws = []
    with no_host_sync(device, "keep everything a tensor on the device"):
        for _ in range(200):
            draws.append(answer(logits, 3, gen))
    first = draws[0]
    if first is None:
        raise NotImplementedError("sample_top_k returns None")
    if not isinstance(first, torch.Tensor):
        raise Miss(f"it returns a {type(first).__name__}: return a tensor on the logits' device")
    if first.shape != (4, 1) or first.dtype != torch.int64:
        raise Miss(f"it returns {first.dtype} {list(first.shape)}; expected int64 [batch, 1] = [4, 1]")
    if first.device != logits.device:
        raise Miss(f"the tokens are on {first.device}, the logits on {logits.device}")
    seen = torch.cat(draws).flatten()
    allowed = torch.tensor([3, 7, 42], device=device)
    if not torch.isin(seen, allowed).all():
        raise Miss(f"it drew tokens outside the 3 largest logits, e.g. {seen[~torch.isin(seen, allowed)][:3].tolist()}")
    counts = torch.bincount(seen, minlength=50)[allowed].float() / len(seen)
    expected = torch.softmax(torch.tensor([2.5, 3.0, 2.9]), dim=0).to(device)  # tokens 3, 7, 42
    if len(set(seen.tolist())) == 1:
        raise Miss("it always picks the same token: that is argmax, not sampling")
    if (counts - expected).abs().max() > 0.06:
        raise Miss(f"the frequencies {[round(c, 2) for c in counts.tolist()]} are not the top-k softmax "
                   f"{[round(e, 2) for e in expected.tolist()]}: renormalise over the k kept logits")
    return f"only the top k, with the softmax's frequencies, on {device}" + (
        " (checked in sync-debug mode)." if device.type == "cuda" else ".")
