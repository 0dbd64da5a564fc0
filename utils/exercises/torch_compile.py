"""Checks for the exercises of notebook 04 · What torch.compile does to a training step.

Both are arithmetic on numbers the notebook measures, checked on cases with known answers; the notebook's own
numbers are then put through the reader's answer and shown beside what the notebook measured. (The exercises of
04b, graph breaks and recompiles, are in :mod:`utils.exercises.compile_in_depth`.)
"""

from __future__ import annotations

import math

from utils.exercises import Miss, close, exercise


@exercise("1 · Amdahl's bound")
def amdahl_bound(answer, *, step_ms: float | None = None, library_ms: float | None = None,
                 reached: float | None = None) -> str:
    """``answer(step_ms, library_ms)``: the largest speed-up any compiler could give a step of which
    ``library_ms`` run in kernels it leaves alone (matmuls, attention), if everything else became free."""
    cases = [((10.0, 7.5), 4 / 3, "a 10 ms step with 7.5 ms of matmuls"),
             ((4.0, 1.0), 4.0, "a 4 ms step with 1 ms of matmuls"),
             ((2.0, 2.0), 1.0, "a step that is all matmuls")]
    for (step, library), expected, what in cases:
        got = answer(step, library)
        if got is None:
            raise NotImplementedError("max_compile_speedup returns None: return the bound")
        got = float(got)
        if close(got, expected, rel=1e-9):
            continue
        if step > library and close(got, step / (step - library), rel=1e-9):
            raise Miss(f"for {what} that is the gain from removing the matmuls; the matmuls stay, and what the "
                       "compiler could at best remove is the rest")
        if close(got, library / step, rel=1e-9) or close(got, 1 - library / step, rel=1e-9):
            raise Miss(f"for {what} it returns a share of the step ({got:.3g}), not a speed-up (≥ 1)")
        raise Miss(f"for {what} the bound is {expected:.4g}×; yours gives {got:.4g}")
    try:
        unlimited = answer(3.0, 0.0)
    except ZeroDivisionError:
        raise Miss("with no library time at all it divides by zero: nothing bounds the gain, return math.inf") \
            from None
    if not (isinstance(unlimited, (int, float)) and math.isinf(unlimited) and unlimited > 0):
        raise Miss(f"with no library time at all nothing bounds the gain (math.inf); yours gives {unlimited}")
    try:
        impossible = answer(1.0, 2.0)
    except ValueError:
        impossible = None
    if impossible is not None:
        raise Miss("library_ms larger than step_ms is impossible: raise ValueError instead of returning "
                   f"{impossible}")
    here = ""
    if step_ms and library_ms:
        bound = answer(step_ms, library_ms)
        here = f" For this notebook's eager step: at most {bound:.2f}×" + (
            f"; the best compiled step reached {reached:.2f}×." if reached else ".")
    return "the step time over the time the compiler cannot touch." + here


@exercise("2 · Break-even")
def break_even(answer, *, compile_s: float | None = None, eager_ms: float | None = None,
               compiled_ms: float | None = None, measured: int | None = None) -> str:
    """``answer(compile_s, eager_ms, compiled_ms)``: the number of steps after which a compile of ``compile_s``
    seconds has paid for itself, when it shortens each step from ``eager_ms`` to ``compiled_ms``; ``math.inf``
    when it never does."""
    cases = [((10.0, 20.0, 17.0), 3334, "a 10 s compile that saves 3 ms per 20 ms step"),
             ((30.0, 25.0, 10.0), 2000, "a 30 s compile that saves 15 ms per 25 ms step"),
             ((0.5, 4.0, 1.5), 200, "a 0.5 s compile that saves 2.5 ms per 4 ms step")]
    for (c, e, k), expected, what in cases:
        got = answer(c, e, k)
        if got is None:
            raise NotImplementedError("break_even_steps returns None: return the number of steps")
        if close(float(got), expected, rel=1e-9):
            continue
        exact = c * 1e3 / (e - k)
        if close(float(got), exact, rel=1e-9) or close(float(got), math.floor(exact), rel=1e-9):
            raise Miss(f"for {what} it gives {got:g}: a step is whole, and the compile is paid back only after "
                       "the step that completes it — round up (math.ceil)")
        if close(float(got), math.ceil(c / (e - k)), rel=1e-9) or close(float(got), c / (e - k), rel=1e-9):
            raise Miss(f"for {what} it gives {got:g}: compile_s is in seconds and the step times in milliseconds")
        if close(float(got), math.ceil(c * 1e3 / k), rel=1e-9) or close(float(got), math.ceil(c * 1e3 / e), rel=1e-9):
            raise Miss(f"for {what} it gives {got:g}: the compile is paid back by what each step saves "
                       "(eager − compiled), not by the step time")
        raise Miss(f"for {what} the answer is {expected:,} steps; yours gives {got}")
    for args, what in (((10.0, 20.0, 20.0), "no faster"), ((10.0, 20.0, 25.0), "slower")):
        try:
            got = answer(*args)
        except ZeroDivisionError:
            raise Miss("a compiled step no faster than eager divides by zero: it never pays off, return math.inf") \
                from None
        if not (isinstance(got, (int, float)) and math.isinf(got) and got > 0):
            raise Miss(f"a compiled step {what} than eager never pays off (math.inf); yours gives {got}")
    here = ""
    if compile_s is not None and eager_ms and compiled_ms:
        mine = answer(compile_s, eager_ms, compiled_ms)
        here = (f" For this notebook's best variant: {mine:,.0f} steps" if math.isfinite(mine) else
                " For this notebook's best variant: never") + (
            f"; the table said {measured:,}." if measured else ".")
    return "the compile divided by what each step saves, rounded up." + here
