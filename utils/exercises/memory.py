"""Checks for the exercises of notebook 05 · GPU memory."""

from __future__ import annotations

import math

import torch
from torch import nn

from utils.exercises import Miss, exercise
from utils.memory import format_bytes

_OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
}


def _held_after_a_step(model: nn.Module, optimizer_name: str) -> dict[str, int]:
    """Train ``model`` one step with the real optimizer and count the bytes of every tensor it then holds:
    weights, gradients, and the optimizer's state (its 0-d step counters left out)."""
    optimizer = _OPTIMIZERS[optimizer_name](model.parameters())
    x = torch.randn(8, model[0].in_features, generator=torch.Generator().manual_seed(0))
    model(x).square().mean().backward()
    optimizer.step()
    return {"weights": sum(p.nbytes for p in model.parameters()),
            "gradients": sum(p.grad.nbytes for p in model.parameters()),
            "state": sum(t.nbytes for s in optimizer.state.values() for t in s.values()
                         if torch.is_tensor(t) and t.dim() > 0)}


def _models() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(37, 64), nn.ReLU(), nn.Linear(64, 10)),
            nn.Sequential(nn.Linear(300, 1000), nn.Tanh(), nn.Linear(1000, 3))]


@exercise("1 · Static memory")
def static_memory(answer, *, n_params: int | None = None) -> str:
    """``answer(n_params, optimizer)``: bytes of fp32 weights, gradients and optimizer state. Checked against what
    small models trained with the real optimizers hold."""
    for model in _models():
        n = sum(p.numel() for p in model.parameters())
        right: set[str] = set()
        for name in _OPTIMIZERS:  # "sgd" first: its answer tells whether weights and gradients are counted
            held = _held_after_a_step(model, name)
            expected = sum(held.values())
            got = answer(n, name)
            if got is None:
                raise NotImplementedError("static_training_bytes returns None: return a number of bytes")
            got = float(got)
            if math.isclose(got, expected):
                right.add(name)
                continue
            where = f"{n:,} parameters with {name}"
            if "sgd" in right:  # weights and gradients are right: the optimizer's state is not
                if name.startswith("adam") and math.isclose(got, expected - held["weights"]):
                    raise Miss(f"{where}: Adam and AdamW keep two moments per weight (exp_avg and exp_avg_sq), "
                               "not one")
                if math.isclose(got, expected - held["state"]):
                    raise Miss(f"{where}: you leave out the optimizer's state — {name} keeps "
                               f"{held['state'] // held['weights']} value(s) per weight between steps")
            elif math.isclose(got, expected - held["gradients"]):
                raise Miss(f"{where}: you leave out the gradients — backward writes one per weight, and they stay "
                           "allocated until zero_grad(set_to_none=True)")
            if any(math.isclose(got * f, expected) for f in (4, 1 / 4, 8, 1 / 8)):
                raise Miss(f"{where}: off by a constant factor — count bytes: an fp32 value takes 4 bytes")
            raise Miss(f"{where}: the model holds {expected:,} bytes after a step ({held['weights']:,} in weights, "
                       f"{held['gradients']:,} in gradients, {held['state']:,} in the optimizer's state); yours "
                       f"says {got:,.0f}")
    here = ""
    if n_params:
        here = (f" For this notebook's model ({n_params / 1e6:.1f} M parameters) with AdamW: "
                f"{format_bytes(answer(n_params, 'adamw'))} before a single activation.")
    return "weights, gradients and state match what SGD, SGD with momentum, Adam and AdamW allocate." + here


# Thresholds (the largest batch that fits) and limits; 0: nothing fits; the limit itself may fit.
_SEARCHES = [(1, 1024), (5, 1024), (64, 1024), (100, 1024), (777, 1024), (1000, 1024), (0, 1024), (1024, 1024),
             (4095, 100_000)]


@exercise("2 · The largest batch")
def largest_batch(answer) -> str:
    """``answer(run, limit)``: the largest batch ``run`` accepts, where ``run(b)`` raises torch.OutOfMemoryError
    for a batch that does not fit, found with a number of calls that grows like log(limit)."""
    most_calls = 0
    for threshold, limit in _SEARCHES:
        calls: list[int] = []

        def run(b: int, threshold: int = threshold, limit: int = limit, calls: list[int] = calls) -> None:
            if not isinstance(b, int) or isinstance(b, bool) or not 1 <= b <= limit:
                raise Miss(f"run({b!r}) was called: try whole batches between 1 and the limit ({limit:,})")
            calls.append(b)
            if b > threshold:
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {b * 20} MiB (batch {b})")

        try:
            got = answer(run, limit)
        except torch.OutOfMemoryError:
            raise Miss("torch.OutOfMemoryError escaped your function: catch it — a batch that does not fit raises "
                       "it, and that answer is 'no', not a crash") from None
        if got is None:
            raise NotImplementedError("largest_fitting_batch returns None: return a batch size")
        budget = 2 * math.ceil(math.log2(limit)) + 3
        if got != threshold:
            if got == threshold + 1:
                raise Miss(f"for a largest fitting batch of {threshold} you return {got}: the first batch that "
                           "failed, one too many")
            if threshold and got and got < threshold and got & (got - 1) == 0:
                raise Miss(f"you return {got}, but batches up to {threshold} fit: you stop at a power of two — "
                           "bisect between the last batch that fitted and the first that failed")
            raise Miss(f"batches up to {threshold:,} fit (limit {limit:,}); you return {got}")
        if len(calls) > budget:
            raise Miss(f"{len(calls)} calls of run for a limit of {limit:,}: that many training steps take long; "
                       f"bisection needs about {budget}")
        most_calls = max(most_calls, len(calls))
    return (f"right in every case, with at most {most_calls} calls of run — each one is a training step on a real "
            "GPU.")
