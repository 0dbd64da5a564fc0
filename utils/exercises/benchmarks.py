"""Checks for the exercises of notebook 09 · The benchmark table."""

from __future__ import annotations

import torch

from utils.exercises import Miss, exercise


@exercise("1 · Workers for a training rate")
def workers_needed(answer, *, train_images_per_s: float | None = None, per_worker: float | None = None) -> str:
    """``answer(train_images_per_s, images_per_s_per_worker)``: the fewest workers that keep up."""
    cases = [((1000.0, 300.0), 4),  # 3 workers decode 900/s: short by 100, so a 4th is needed
             ((900.0, 300.0), 3),  # exactly enough
             ((5000.0, 180.0), 28),  # 27 give 4,860/s
             ((50.0, 400.0), 1)]  # one worker is more than enough, but there is no fraction of one
    for (train, worker), expected in cases:
        got = answer(train, worker)
        if got is None:
            raise NotImplementedError("workers_needed returns None: return a whole number of workers")
        if isinstance(got, float) and not got.is_integer():
            raise Miss(f"for {train:,.0f} images/s at {worker:,.0f} per worker it returns {got:.3g}: workers come "
                       "whole — round up")
        if got == expected:
            continue
        if got == expected - 1:
            raise Miss(f"for {train:,.0f} images/s at {worker:,.0f} per worker it returns {got}: {got} workers "
                       f"decode only {got * worker:,.0f} images/s — round up, not down or to nearest")
        if got == expected + 1:
            raise Miss(f"for {train:,.0f} images/s at {worker:,.0f} per worker it returns {got}: {expected} already "
                       f"decode {expected * worker:,.0f} images/s — one too many when the division comes out even")
        raise Miss(f"for {train:,.0f} images/s at {worker:,.0f} images/s per worker it returns {got}; "
                   f"expected {expected}")
    here = ""
    if train_images_per_s and per_worker:
        here = (f" Here: {answer(train_images_per_s, per_worker)} workers for the best ResNet-50 step's "
                f"{train_images_per_s:,.0f} images/s.")
    return "a whole number of workers, rounded up, and none more." + here


def _counted(rows: int, in_features: int, out_features: int) -> int:
    """What FlopCounterMode counts for one forward and backward pass of a bias-free Linear (input needs grad)."""
    layer = torch.nn.Linear(in_features, out_features, bias=False)
    x = torch.randn(rows, in_features, requires_grad=True)
    # imported here: torch.utils.flop_counter imports Triton, and `import utils` must not (notebook 06 sets
    # TRITON_INTERPRET=1 on a CPU before Triton is first imported)
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        layer(x).sum().backward()
    return counter.get_total_flops()


@exercise("2 · The FLOPs of a training step")
def linear_training_flops(answer) -> str:
    """``answer(rows, in_features, out_features)``: forward + backward FLOPs, as FlopCounterMode counts them."""
    shapes = [(64, 128, 32), (5, 17, 3), (1, 1024, 4096)]
    for rows, fan_in, fan_out in shapes:
        got = answer(rows, fan_in, fan_out)
        if got is None:
            raise NotImplementedError("linear_training_flops returns None: return a number of FLOPs")
        expected = _counted(rows, fan_in, fan_out)
        if abs(got - expected) <= 1e-9 * expected:
            continue
        ratio = got / expected
        where = f"for {rows} rows of {fan_in} → {fan_out}: yours {got:,.0f}, PyTorch counts {expected:,.0f}"
        if abs(ratio - 1 / 3) < 1e-9:
            raise Miss(f"that is the forward pass only ({where}): backward runs two more matmuls of the same size, "
                       "one for the weights' gradient and one for the input's")
        if abs(ratio - 2 / 3) < 1e-9:
            raise Miss(f"one gradient is missing ({where}): backward computes the weights' gradient and the input's, "
                       "each a matmul as large as the forward")
        if abs(ratio - 1 / 2) < 1e-9:
            raise Miss(f"a multiply-add is 2 FLOPs ({where})")
        raise Miss(where)
    return "forward 2·rows·in·out, backward twice that: 6 FLOPs per weight per row — what FlopCounterMode counts."


@exercise("1 · The memory limit of decoding")
def decode_limit(answer, *, parameters: int | None = None, bytes_per_parameter: int | None = None,
                 gb_per_s: float | None = None, measured: float | None = None) -> str:
    """``answer(parameters, bytes_per_parameter, gb_per_s)``: tokens/s at most when every step reads every weight
    once (notebook 09b)."""
    cases = [((124_439_808, 2, 3000.0), 12_054.02), ((1_000_000_000, 4, 1000.0), 250.0), ((7e9, 1, 700.0), 100.0)]
    for (n, size, gbps), expected in cases:
        got = answer(n, size, gbps)
        if got is None:
            raise NotImplementedError("decode_limit returns None: return tokens per second")
        where = (f"for {n:,.0f} parameters of {size} bytes at {gbps:,.0f} GB/s: yours {got:,.4g}, expected "
                 f"{expected:,.4g}")
        if abs(got - expected) <= 1e-3 * expected:
            continue
        ratio = got / expected
        if abs(ratio - size) < 1e-3 * size and size != 1:
            raise Miss(f"the bytes per parameter are missing ({where}): a step reads parameters × bytes")
        if abs(ratio - 1 / 8) < 1e-3:
            raise Miss(f"bytes, not bits ({where}): GB/s counts bytes")
        if abs(ratio - 2**30 / 1e9) < 1e-3:
            raise Miss(f"GB/s is 10⁹ bytes per second, not 2³⁰ ({where})")
        if got > 0 and abs(got * expected - 1) < 1e-3:
            raise Miss(f"that is seconds per token ({where}): tokens per second is its inverse")
        raise Miss(where)
    here = ""
    if parameters and bytes_per_parameter and gb_per_s:
        limit = answer(parameters, bytes_per_parameter, gb_per_s)
        here = f" Here: at most {limit:,.0f} tokens/s from the weights alone"
        here += f"; the best decoder measured {measured:,.0f} ({measured / limit:.0%} of it)." if measured else "."
    return "bandwidth ÷ bytes per step: every token reads every weight once." + here
