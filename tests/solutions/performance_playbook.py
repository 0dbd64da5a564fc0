"""Solutions to notebook 07's exercises."""

import math

TIP_FOR_KIND = {"matmul": "tf32", "attention": "sdpa", "other": "compile"}


def which_tip(profile):
    if profile.idle_fraction >= 0.5:
        return "cuda_graphs"
    kinds = profile.time_by_kind()
    return TIP_FOR_KIND[max(kinds, key=kinds.get)]


def predicted_rel_error(mantissa_bits, k):
    return 2.0 ** -(mantissa_bits + 1)


def steps_to_pay_off(tuning_s, step_s, tuned_step_s):
    saved = step_s - tuned_step_s
    return math.ceil(tuning_s / saved) if saved > 0 else math.inf


# ── Plausible wrong answers ────────────────────────────────────────────────────────────────────────────────────


def _tip_by_idle_seconds(profile):
    if profile.idle_s >= 0.5:  # seconds, not a share of the step
        return "cuda_graphs"
    kinds = profile.time_by_kind()
    return TIP_FOR_KIND[max(kinds, key=kinds.get)]


def _tip_by_kernel_count(profile):
    if profile.idle_fraction >= 0.5:
        return "cuda_graphs"
    counts = {"matmul": 0, "attention": 0, "other": 0}
    for row in profile.top_kernels(len(profile.kernels)):
        counts[row["kind"]] += float(row["calls per step"])
    return TIP_FOR_KIND[max(counts, key=counts.get)]


def _tip_by_longest_kernel(profile):
    if profile.idle_fraction >= 0.5:
        return "cuda_graphs"
    return TIP_FOR_KIND[profile.top_kernels(1)[0]["kind"]]


def _tip_when_any_idle(profile):
    if profile.idle_fraction >= 0.2:
        return "cuda_graphs"
    kinds = profile.time_by_kind()
    return TIP_FOR_KIND[max(kinds, key=kinds.get)]


CASES = {
    "which_tip": ([which_tip], [
        ("compares idle_s (seconds) with 0.5", [_tip_by_idle_seconds], "launch-bound"),
        ("counts kernels instead of their time", [_tip_by_kernel_count], "not by kernel count"),
        ("looks only at the longest kernel", [_tip_by_longest_kernel], "longest kernel"),
        ("calls any idle step launch-bound", [_tip_when_any_idle], "under half the step"),
        ("returns a name outside the four", [lambda p: "channels_last"], "one of"),
    ]),
    "tf32_error": ([predicted_rel_error], [
        ("grows with sqrt(k)", [lambda b, k: math.sqrt(k) * 2.0**-b], "grows with k"),
        ("counts decimal digits", [lambda b, k: 10.0**-b], "binary digits"),
        ("ignores the mantissa bits", [lambda b, k: 2.0**-24], "each bit fewer"),
        ("is off by a factor of 64", [lambda b, k: 2.0 ** -(b + 7)], "measured relative error"),
    ]),
    "steps_to_pay_off": ([steps_to_pay_off], [
        ("does not round", [lambda t, s, ts: t / (s - ts) if s > ts else math.inf], "whole number"),
        ("rounds down", [lambda t, s, ts: int(t / (s - ts)) if s > ts else math.inf], "round up"),
        ("returns a negative count when tuning makes it slower",
         [lambda t, s, ts: math.inf if s == ts else math.ceil(t / (s - ts))], "never pays off"),
        ("divides by zero when nothing is saved", [lambda t, s, ts: math.ceil(t / (s - ts))], "ZeroDivisionError"),
    ]),
}
