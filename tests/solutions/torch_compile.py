"""Solutions to notebook 04's exercises."""

import math


def max_compile_speedup(step_ms, library_ms):
    if library_ms > step_ms:
        raise ValueError(f"library_ms ({library_ms}) cannot exceed step_ms ({step_ms})")
    return math.inf if library_ms == 0 else step_ms / library_ms


def break_even_steps(compile_s, eager_ms, compiled_ms):
    saved_ms = eager_ms - compiled_ms
    return math.inf if saved_ms <= 0 else math.ceil(compile_s * 1e3 / saved_ms)


def _bound_without_edge_cases(step_ms, library_ms):
    return step_ms / library_ms


CASES = {
    "amdahl_bound": ([max_compile_speedup], [
        ("divides by the time outside the library", [lambda s, lib: s / (s - lib) if s > lib else math.inf],
         "the matmuls stay"),
        ("returns the library share", [lambda s, lib: lib / s], "share of the step"),
        ("divides by zero without library time", [_bound_without_edge_cases], "divides by zero"),
        ("accepts library_ms > step_ms", [lambda s, lib: math.inf if lib == 0 else s / lib], "ValueError"),
    ]),
    "break_even": ([break_even_steps], [
        ("does not round up", [lambda c, e, k: c * 1e3 / (e - k) if e > k else math.inf], "round up"),
        ("mixes seconds and milliseconds", [lambda c, e, k: math.ceil(c / (e - k)) if e > k else math.inf],
         "seconds"),
        ("divides by the compiled step", [lambda c, e, k: math.ceil(c * 1e3 / k) if e > k else math.inf],
         "what each step saves"),
        ("returns a negative count when slower", [lambda c, e, k: math.ceil(c * 1e3 / (e - k))], "never pays off"),
    ]),
}
