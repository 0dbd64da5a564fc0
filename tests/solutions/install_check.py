"""Solutions to notebook 00's exercises."""


def ridge_point(peak_tflops, bandwidth_gbps):
    return peak_tflops * 1e12 / (bandwidth_gbps * 1e9)


def min_time_s(n_elements, itemsize, bandwidth_gbps):
    return 2 * n_elements * itemsize / (bandwidth_gbps * 1e9)


def rate_at_clock(tflops, clock_mhz, new_clock_mhz):
    return tflops * new_clock_mhz / clock_mhz


# What tests/test_exercises.py feeds each check: (the solution's arguments, [(what a plausible wrong answer does,
# its arguments, a phrase the feedback must contain)]).
CASES = {
    "ridge_point": ([ridge_point], [
        ("divides TFLOP/s by GB/s", [lambda t, g: t / g], "factor of 1,000"),
        ("inverts the ratio", [lambda t, g: g * 1e9 / (t * 1e12)], "bytes per FLOP"),
    ]),
    "min_time_s": ([min_time_s], [
        ("counts only the read", [lambda n, i, b: n * i / (b * 1e9)], "only the read"),
        ("forgets the 10⁹", [lambda n, i, b: 2 * n * i / b], "units"),
        ("ignores the element size", [lambda n, i, b: 8 * n / (b * 1e9)], "element size"),
    ]),
    "rate_at_clock": ([rate_at_clock], [
        ("inverts the clock ratio", [lambda d, m, c: d * m / c], "upside down"),
        ("subtracts the MHz", [lambda d, m, c: d - (m - c)], "proportion"),
    ]),
}
