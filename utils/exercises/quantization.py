"""Checks for the exercises of notebook 08c · Quantized inference (int8 × int8 with ``torch._int_mm``)."""

from __future__ import annotations

import torch

from utils.exercises import Miss, exercise


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@exercise("1 · int8 × int8")
def w8a8_linear(answer) -> str:
    """``answer(x, q_weight, w_scale)``: x fp32 [M, K] quantized per row to int8, ``torch._int_mm`` with the int8
    weight [N, K], both scales applied; fp32 [M, N]."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=g)
    x[3] *= 50  # one row far larger than the rest: a per-tensor scale would cost the others their precision
    w = torch.randn(48, 64, generator=g) / 8
    w_scale = w.abs().amax(dim=1) / 127
    q_weight = torch.round(w / w_scale[:, None]).clamp(-127, 127).to(torch.int8)
    exact = x @ (q_weight.float() * w_scale[:, None]).T  # the int8 weights, unquantized activations
    calls = []
    original = torch._int_mm

    def spy(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    torch._int_mm = spy
    try:
        got = answer(x, q_weight, w_scale)
    finally:
        torch._int_mm = original
    if got is None:
        raise NotImplementedError("w8a8_linear returns None")
    if not isinstance(got, torch.Tensor):
        raise Miss(f"it returns a {type(got).__name__}: return a tensor")
    if got.shape != (32, 48):
        raise Miss(f"it returns shape {list(got.shape)}; expected [M, N] = [32, 48] (multiply by the weight's "
                   "transpose)")
    if not calls:
        raise Miss("torch._int_mm was never called: quantize x to int8 and multiply int8 by int8")
    if not got.dtype.is_floating_point:
        raise Miss(f"it returns {got.dtype}: apply both scales to the int32 product and return floats")
    err = _relative(got.float(), exact)
    if err < 1e-5:
        raise Miss("that is exact: x was not quantized to int8 before the product")
    if err > 0.015:
        x_scale = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
        if _relative(got.float() * x_scale, exact) < 0.015:
            raise Miss("the activations' scale is missing: multiply by each row's scale of x")
        if _relative(got.float() * w_scale, exact) < 0.015:
            raise Miss("the weight's scale is missing: multiply by w_scale per output column")
        raise Miss(f"{err:.1%} from the product with the int8 weights; per-row int8 activations give under 1% "
                   "(give each row of x its own scale, so the large row does not cost the others their precision)")
    return (f"within {err:.2%} of the product with unquantized activations. torch._int_mm ran int8 × int8 → int32, "
            "which CUDA runs on tensor cores for more than 16 rows: prompts and batches, not batch-1 decoding.")
