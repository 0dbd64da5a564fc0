"""Checks for the exercises of notebook 00 · Install check."""

from __future__ import annotations

from utils.exercises import Miss, close, exercise

# Ridge points stated by independent sources, not computed from the formula the exercise asks for:
# the device notes of the H200 and H100 give "about 206" and "about 295" FLOP per byte in dense bf16.
_RIDGE_CASES = [((989.4, 4800.0), 206.1, "H200 SXM, dense bf16"), ((989.4, 3350.0), 295.3, "H100 SXM, dense bf16"),
                ((65.0, 320.0), 203.1, "T4, fp16")]


@exercise("1 · Ridge point")
def ridge_point(answer, *, measured_tflops: float | None = None, measured_gbps: float | None = None) -> str:
    """``answer(peak_tflops, bandwidth_gbps)`` must return the arithmetic intensity (FLOP per byte) at which
    compute time equals memory time."""
    for (tflops, gbps), expected, what in _RIDGE_CASES:
        got = answer(tflops, gbps)
        if got is None:
            raise NotImplementedError("ridge_point returns None: return FLOP per byte")
        got = float(got)
        if close(got, expected, rel=2e-3):
            continue
        if close(got * 1000, expected, rel=2e-3) or close(got / 1000, expected, rel=2e-3):
            raise Miss(f"off by a factor of 1,000 for the {what}: TFLOP/s is 10¹² FLOP/s but GB/s only 10⁹ B/s")
        if close(1 / got, expected, rel=2e-3) if got else False:
            raise Miss(f"that is bytes per FLOP for the {what}; the ridge point is FLOP per byte")
        raise Miss(f"for the {what} ({tflops} TFLOP/s, {gbps:,.0f} GB/s) the ridge point is about {expected:.0f} "
                   f"FLOP/byte; yours gives {got:.4g}")
    here = ""
    if measured_tflops and measured_gbps:
        here = (f" On this device: {answer(measured_tflops, measured_gbps):,.0f} FLOP/byte — a kernel doing less "
                "arithmetic per byte it moves is bound by memory here.")
    return "matches the published ridge points of the H200, H100 and T4." + here


@exercise("2 · Lower bound")
def min_time_s(answer, *, measured_gbps: float | None = None) -> str:
    """``answer(n_elements, itemsize, bandwidth_gbps)``: the least time an elementwise op that reads one tensor
    and writes one of the same size can take."""
    # 10⁹ fp32 elements: 4 GB read and 4 GB written, 8 GB at 4,000 GB/s = 2 ms
    got = answer(10**9, 4, 4000.0)
    if got is None:
        raise NotImplementedError("min_time_s returns None: return seconds")
    got = float(got)
    if close(got, 2e-3, rel=1e-3):
        pass
    elif close(got, 1e-3, rel=1e-3):
        raise Miss("this counts only the read: the result is written back to memory too, as many bytes again")
    elif close(got, 2e-3 * 1e9, rel=1e-3) or close(got, 2e-3 / 1e9, rel=1e-3) or close(got, 2.0, rel=1e-3):
        raise Miss("the units are off: bytes / (GB/s × 10⁹) gives seconds")
    else:
        raise Miss(f"10⁹ fp32 elements at 4,000 GB/s take 2 ms at the least; yours says {got:.4g} s")
    if not close(float(answer(1000, 2, 1.0)), 4e-6, rel=1e-3):
        raise Miss("it must use the element size: 1,000 bf16 elements are 2,000 bytes each way")
    here = ""
    if measured_gbps:
        here = (f" On this device a 1 GiB fp32 tensor needs at least {answer(2**28, 4, measured_gbps) * 1e3:.3g} ms "
                "for any elementwise op.")
    return "reads plus writes over the bandwidth." + here


@exercise("3 · Clock-bound")
def rate_at_clock(answer, *, burst_tflops: float | None = None, burst_mhz: float | None = None,
                  sustained_mhz: float | None = None, sustained_tflops: float | None = None,
                  burst_n: int | None = None, sustained_n: int | None = None) -> str:
    """``answer(tflops, clock_mhz, new_clock_mhz)``: a matmul rate measured at one SM clock, at another clock. The
    tensor cores' work per clock cycle is fixed, so the rate scales with the clock.

    With the burst and sustained rates measured in the notebook (and their clocks), it says how much of the drop
    the clock explains; only when both multiplied matrices of the same size (``burst_n`` == ``sustained_n``):
    otherwise the size differs too, and it says so instead."""
    got = answer(777.0, 1980.0, 1485.0)
    if got is None:
        raise NotImplementedError("rate_at_clock returns None: return TFLOP/s")
    got = float(got)
    if close(got, 582.75, rel=1e-3):
        pass
    elif close(got, 777.0 * 1980.0 / 1485.0, rel=1e-3):
        raise Miss("the ratio is upside down: a lower clock gives a lower rate")
    elif close(got, 777.0 - (1980.0 - 1485.0), rel=1e-3):
        raise Miss("the rate scales in proportion to the clock, it does not drop by the MHz lost")
    else:
        raise Miss(f"777 TFLOP/s at 1,980 MHz becomes 583 TFLOP/s at 1,485 MHz (three quarters); yours: {got:.4g}")
    if not close(float(answer(100.0, 1000.0, 1000.0)), 100.0, rel=1e-9):
        raise Miss("at the same clock it must give the same rate")
    here = ""
    if burst_n != sustained_n:
        return (f"the rate scales with the clock. Here the burst multiplied {burst_n}×{burst_n} matrices and the "
                f"sustained run {sustained_n}×{sustained_n}: their rates differ by size as well as by clock, so the "
                "clock alone cannot be put against the drop.")
    if burst_tflops and burst_mhz and sustained_mhz and sustained_tflops and burst_tflops > sustained_tflops:
        at_clock = answer(burst_tflops, burst_mhz, sustained_mhz)
        here = (f" Here the burst's {burst_tflops:,.0f} TFLOP/s at {burst_mhz:,.0f} MHz becomes {at_clock:,.0f} at "
                f"the sustained clock, {sustained_mhz:,.0f} MHz, and the sustained run measured "
                f"{sustained_tflops:,.0f}: ")
        if abs(at_clock - sustained_tflops) <= 0.05 * burst_tflops:  # within 5 points: utils.bench's rule
            here += "the clock accounts for the drop from burst to sustained, within 5 points of the burst."
        elif at_clock >= sustained_tflops:
            explained = (burst_tflops - at_clock) / (burst_tflops - sustained_tflops)
            here += f"the clock explains {explained:.0%} of the drop from burst to sustained."
        else:
            here += ("the clock predicts a larger drop than was measured: the sustained run did more work per clock "
                     "than the burst, and the clock alone does not explain the difference.")
    return "the rate scales with the clock." + here
