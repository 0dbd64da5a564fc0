"""Solutions to notebook 00's exercises."""


def ridge_point(peak_tflops, bandwidth_gbps):
    return peak_tflops * 1e12 / (bandwidth_gbps * 1e9)


def min_time_s(n_elements, itemsize, bandwidth_gbps):
    return 2 * n_elements * itemsize / (bandwidth_gbps * 1e9)


def rate_at_clock(datasheet_tflops, max_clock_mhz, clock_mhz):
    return datasheet_tflops * clock_mhz / max_clock_mhz
