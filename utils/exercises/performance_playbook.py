"""Checks for the exercises of notebooks 07 · The performance playbook (TF32's error, tuning's pay-off) and 07b ·
Launch-bound steps (which tip).

The first check builds step profiles whose answers are clear by construction (a step idle most of the time, one
spent in matmuls spread over few kernels among many small ones, ...); the second measures what rounding a matmul's
inputs to fewer mantissa bits really does (on the CPU, in float64, with a fixed seed); the third uses tuning costs
and step times whose answers are exact.
"""

from __future__ import annotations

import math

import torch

from utils.exercises import Miss, exercise
from utils.number_formats import round_mantissa
from utils.playbook import relative_error
from utils.profile import Kernel, StepProfile

_TIP_KEYS = ("cuda_graphs", "tf32", "sdpa", "compile")


def _profile(wall_ms: float, kernels: list[tuple[str, int, float]]) -> StepProfile:
    """A one-step GPU profile of ``wall_ms``: (name, count, µs each) kernels laid end to end from t = 0."""
    laid, t = [], 0.0
    for name, count, each_us in kernels:
        for _ in range(count):
            laid.append(Kernel(name, t, each_us))
            t += each_us
    return StepProfile(device="cuda:0", steps=1, wall_s=wall_ms / 1e3, kernels=laid, on_gpu=True)


_GEMM, _ELEMENTWISE = "sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32", "vectorized_elementwise_kernel"
# (what the step is, its profile, the tip it needs, what a wrong answer gets wrong about it)
_STEPS = [
    ("a step whose GPU is idle 83% of the time", _profile(2.0, [(_ELEMENTWISE, 30, 10.0), (_GEMM, 2, 20.0)]),
     "cuda_graphs", "it is launch-bound (GPU idle 83% of the step, idle_fraction ≥ 0.5): fewer launches, not faster "
                    "kernels — CUDA graphs"),
    ("a busy step: 3 matmul kernels take 7.5 ms, 60 small elementwise kernels 1.2 ms",
     _profile(10.0, [(_GEMM, 3, 2500.0), (_ELEMENTWISE, 60, 20.0)]),
     "tf32", "the matmuls take most of the GPU's time, although there are few of them: weigh kinds by time, not by "
             "kernel count"),
    ("a busy step dominated by attention", _profile(10.0, [("flash_fwd_kernel", 1, 4000.0),
                                                           ("flash_bwd_dq_dk_dv_loop_seqk_parallel", 1, 3000.0),
                                                           (_GEMM, 1, 1500.0), (_ELEMENTWISE, 10, 50.0)]),
     "sdpa", "attention kernels take most of the GPU's time: a fused SDPA backend"),
    ("a busy step of 200 elementwise kernels", _profile(5.0, [(_ELEMENTWISE, 200, 20.0), (_GEMM, 1, 500.0)]),
     "compile", "elementwise kernels take most of the GPU's time: fusion (torch.compile)"),
    ("a busy step whose single longest kernel is a reduction",
     _profile(11.0, [*[(f"sm90_xmma_gemm_bf16_tile{i}", 1, 1000.0) for i in range(8)], ("reduce_kernel", 1, 1500.0)]),
     "tf32", "eight matmul kernels of 1 ms each outweigh one 1.5 ms reduction: sum the time of each kind, do not "
             "look only at the longest kernel"),
    ("a step idle 40% of the time, matmuls the rest", _profile(10.0, [(_GEMM, 3, 2000.0)]),
     "tf32", "idle 40% is under half the step, so by the rule it is not launch-bound: the matmuls decide"),
]


@exercise("1 · Which tip?")
def which_tip(answer, *, profiles: dict | None = None) -> str:
    """``answer(profile)`` names the tip for a GPU step's StepProfile: "cuda_graphs" when the GPU is idle at least
    half the step, else the tip for the kind of kernel with the most GPU time (matmul "tf32", attention "sdpa",
    other "compile")."""
    for what, profile, expected, why in _STEPS:
        got = answer(profile)
        if got is None:
            raise NotImplementedError("which_tip returns None: return one of " + ", ".join(map(repr, _TIP_KEYS)))
        if got not in _TIP_KEYS:
            raise Miss(f"it returned {got!r}; return one of {', '.join(map(repr, _TIP_KEYS))}")
        if got != expected:
            raise Miss(f"for {what} it says {got!r}, but {why} ({expected!r})")
    here = ""
    gpu_profiles = {name: p for name, p in (profiles or {}).items() if getattr(p, "on_gpu", False)}
    if gpu_profiles:
        here = " On this run's steps it says: " + "; ".join(f"{name} → {answer(p)}"
                                                              for name, p in gpu_profiles.items()) + "."
    return "launch-bound first, then the kind of kernel that takes the most GPU time." + here


def _measured_error(bits: int, k: int, *, m: int = 64, n: int = 64, seed: int = 7) -> float:
    """Relative error of an (m×k)·(k×n) product of standard-normal matrices whose inputs are rounded to ``bits``
    mantissa bits, against the exact product of the unrounded inputs (float64 throughout)."""
    gen = torch.Generator().manual_seed(seed + bits * 1000 + k)
    a, b = (torch.randn(m, k, generator=gen, dtype=torch.float64), torch.randn(k, n, generator=gen,
                                                                              dtype=torch.float64))
    exact = a @ b
    rounded = round_mantissa(a, bits).double() @ round_mantissa(b, bits).double()
    return relative_error(rounded, exact)


_ERROR_CASES = [(10, 256, "TF32, k = 256"), (10, 4096, "TF32, k = 4,096"), (7, 1024, "bf16, k = 1,024"),
                (3, 512, "fp8 e4m3's 3 bits, k = 512")]


@exercise("1 · TF32's error, predicted")
def tf32_error(answer, *, measured_tf32: float | None = None, measured_fp32: float | None = None) -> str:
    """``answer(mantissa_bits, k)`` predicts, within a factor of 4, the relative error of a matmul of random
    matrices (inner dimension k) whose inputs are rounded to ``mantissa_bits`` bits and summed exactly."""
    predictions = {}
    for bits, k, _ in _ERROR_CASES:
        got = answer(bits, k)
        if got is None:
            raise NotImplementedError("predicted_rel_error returns None: return a relative error (a float)")
        predictions[(bits, k)] = float(got)
    if any(not math.isfinite(p) or p <= 0 for p in predictions.values()):
        raise Miss("a relative error is a positive number (e.g. 1e-3)")
    if predictions[(10, 4096)] > 2 * predictions[(10, 256)]:
        raise Miss("your prediction grows with k, but the rounding errors of k random products partly cancel, "
                   "as the sum itself grows: the relative error stays about the same for any k")
    if predictions[(7, 1024)] < 2 * predictions[(10, 256)]:
        raise Miss("7 mantissa bits (bf16) must give a much larger error than 10 (TF32): each bit fewer doubles "
                   "the rounding step")
    for bits, k, what in _ERROR_CASES:
        truth, got = _measured_error(bits, k), predictions[(bits, k)]
        if not truth / 4 <= got <= truth * 4:
            hint = (" — that is 10^-bits; bits are binary digits: 2^-bits" if math.isclose(got, 10.0**-bits)
                    else "")
            raise Miss(f"for {what} the measured relative error is {truth:.1e}; you predicted {got:.1e}{hint}")
    here = ""
    if measured_tf32:
        here = (f" On this GPU a TF32 matmul measured {measured_tf32:.1e} against float64 (your prediction "
                f"{answer(10, 4096):.1e})" + (f"; plain fp32 {measured_fp32:.1e}" if measured_fp32 else "") + ".")
    return "about the unit roundoff 2^-(bits+1), whatever the size of the product." + here


_PAYOFF_CASES = [((2.0, 0.5, 0.25), 8), ((0.75, 0.5, 0.25), 3), ((0.8, 0.5, 0.25), 4), ((1.0, 0.25, 0.25), math.inf),
                 ((1.0, 0.25, 0.5), math.inf)]


@exercise("2 · When does tuning pay off?")
def steps_to_pay_off(answer, *, tuning_s: float | None = None, step_s: float | None = None,
                     tuned_step_s: float | None = None) -> str:
    """``answer(tuning_s, step_s, tuned_step_s)``: the fewest whole steps after which a one-off tuning cost has been
    won back by faster steps; ``math.inf`` when the tuned step is not faster."""
    for (tuning, plain, tuned), expected in _PAYOFF_CASES:
        got = answer(tuning, plain, tuned)
        if got is None:
            raise NotImplementedError("steps_to_pay_off returns None: return a number of steps")
        if expected == math.inf:
            if got != math.inf:
                raise Miss(f"with a tuned step of {tuned} s against {plain} s the tuning never pays off: return "
                           f"math.inf (yours: {got})")
            continue
        if got == expected:
            continue
        if isinstance(got, float) and math.isclose(got, tuning / (plain - tuned)):
            raise Miss(f"{got:g} steps is not a whole number: round up to the step after which it has paid off")
        if got == expected - 1:
            raise Miss(f"after {got} steps of {tuning} s of tuning and {plain - tuned} s saved per step it has not "
                       "paid off yet: round up, not down")
        raise Miss(f"{tuning} s of tuning, {plain} s per step untuned, {tuned} s tuned: it pays off after "
                   f"{expected} steps; yours says {got}")
    here = ""
    if tuning_s is not None and step_s and tuned_step_s:
        n = answer(tuning_s, step_s, tuned_step_s)
        here = (f" Here cudnn.benchmark's tuning ({tuning_s:.2f} s) pays off after {n:,} steps at one input size."
                if n != math.inf else " Here the tuned step was not faster: cudnn.benchmark never pays off at this "
                                      "size.")
    return "the tuning cost over the time saved per step, rounded up; never when nothing is saved." + here
