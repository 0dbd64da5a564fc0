"""utils.bench: the timing harness and the peak measurements (CPU)."""

import random
import time

import pytest
import torch

from utils import bench, plot, results
from utils.env import GpuConditions, GpuSample


def test_bench_measures_a_known_duration():
    timing = bench.bench(lambda: time.sleep(0.002), label="sleep", device="cpu", min_run_time=0.05)
    assert 0.0018 < timing.median_s < 0.01
    assert timing.label == "sleep" and timing.device == "cpu"
    assert len(timing.block_times_s) >= 7 and timing.iqr_s >= 0


def test_bench_runs_warmup_before_timing():
    calls = []
    bench.bench(lambda: calls.append(1), warmup=5, device="cpu", min_run_time=0.01, min_blocks=2)
    assert len(calls) > 5


def test_bench_orders_fast_and_slow_work():
    small, large = torch.randn(64, 64), torch.randn(512, 512)  # 512× the work
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: on a busy 2-core machine, OpenMP's waits would blur the two apart
    try:
        fast = bench.bench(lambda: small @ small, device="cpu", min_run_time=0.05)
        slow = bench.bench(lambda: large @ large, device="cpu", min_run_time=0.05)
    finally:
        torch.set_num_threads(threads)
    assert slow.median_s > 5 * fast.median_s


def test_slow_calls_still_give_min_blocks():
    timing = bench.bench(lambda: time.sleep(0.03), device="cpu", warmup=0, min_run_time=0.01, min_blocks=3)
    assert len(timing.block_times_s) >= 3 and timing.calls_per_block == 1


def test_slow_calls_cost_only_the_warmup_one_probe_and_the_blocks():
    """A call longer than a block: warm-up, one probe call, then min_blocks blocks of one call, nothing hidden
    (torch.utils.benchmark.Timer.timeit adds two untimed calls to every block: for a call of a second, 3× the time)."""
    calls = []

    def slow():
        calls.append(1)
        time.sleep(0.03)

    timing = bench.bench(slow, device="cpu", warmup=1, min_run_time=0.01, min_blocks=3)
    assert len(calls) == 1 + 1 + 3 and len(timing.block_times_s) == 3
    assert all(0.025 < t < 0.2 for t in timing.block_times_s)


@pytest.mark.parametrize("not_callable", [42, "x @ x", None, torch.ones(2)])
def test_non_callable_is_a_clear_error(not_callable):
    with pytest.raises(TypeError, match="needs a callable"):
        bench.bench(not_callable)
    with pytest.raises(TypeError, match="needs a callable"):
        bench.first_call(not_callable)


def test_first_call_times_one_call_and_returns_its_result():
    calls = []

    def work():
        calls.append(1)
        time.sleep(0.02)
        return "built"

    seconds, result = bench.first_call(work, device="cpu")
    assert result == "built" and calls == [1]  # exactly one call: no warm-up, no repeats
    assert 0.019 < seconds < 0.5


def test_bad_settings_are_clear_errors():
    with pytest.raises(ValueError, match="min_run_time"):
        bench.bench(lambda: None, min_run_time=0)


def test_errors_inside_the_function_propagate():
    def broken():
        raise ZeroDivisionError("boom")

    with pytest.raises(ZeroDivisionError):
        bench.bench(broken, device="cpu")


def test_rates_and_percentages():
    timing = bench.Timing("t", median_s=0.5, iqr_s=0.01, block_times_s=(0.5,), calls_per_block=1, device="cpu")
    assert bench.gbps(2e9, timing) == pytest.approx(4.0)
    assert bench.tflops(1e12, timing) == pytest.approx(2.0)
    assert bench.per_second(100, timing) == pytest.approx(200)
    assert bench.percent_of(50, 200) == pytest.approx(25)
    with pytest.raises(ValueError):
        bench.percent_of(1, 0)


def timing(label, blocks):
    """A Timing from per-call block times, as bench() would build it."""
    return bench._timing_from(label, list(blocks), 1, torch.device("cpu"))


def test_quartiles_of_a_timing():
    t = timing("a", [1.0, 2.0, 3.0, 4.0, 5.0])
    assert t.quartiles_s == (2.0, 4.0) and t.median_s == 3.0
    single = timing("b", [7.0])
    assert single.quartiles_s == (7.0, 7.0)


def test_matmul_rate_kinds_on_cpu():
    sustained = bench.matmul_rate(torch.float32, "cpu", n=128)
    burst = bench.matmul_rate(torch.float32, "cpu", n=128, kind="burst")
    assert "sustained" in sustained.name and "burst" in burst.name
    for rate in (sustained, burst):  # no GPU readings on a CPU, and the rate says why
        assert rate.conditions is not None and not rate.conditions.samples
        assert "CPU" in str(rate.conditions)
    with pytest.raises(ValueError, match="kind"):
        bench.matmul_rate(torch.float32, "cpu", n=64, kind="peak")


# ── The one comparison protocol: alternating rounds, driven by a fake clock ─────────────────────────────────


class FakeClock:
    """A clock that only moves when fake work runs: each call of a work function advances it by the work's cost
    times a drift factor of the current time (a GPU whose clock sags under a power cap, a host that gets busier)."""

    def __init__(self, drift=lambda t: 1.0, noise=None):
        self.now = 0.0
        self.drift = drift
        self.noise = noise
        self.calls = []

    def __call__(self):
        return self.now

    def work(self, name, cost_s):
        def fn():
            self.calls.append(name)
            factor = self.noise() if self.noise else 1.0
            self.now += cost_s * self.drift(self.now) * factor

        return fn


def slowing_host(t):
    """The cost of the same work doubles over the first three seconds: the case that fired the old guards."""
    return 1.0 + min(t, 3.0) / 3.0


def test_a_real_speedup_under_drift_is_resolved_with_the_true_ratio():
    clock = FakeClock(drift=slowing_host)
    result = bench.compare({"baseline": clock.work("a", 0.010), "candidate": clock.work("b", 0.010 / 1.6)},
                           clock=clock, device="cpu", min_run_time=2.0)
    v = result.verdict("candidate")
    assert v.outcome == "faster" and v.speedup == pytest.approx(1.6, rel=0.03)
    assert v.short == "1.60× faster" or v.short.endswith("faster")
    assert "faster" in str(result) and "1.6" in str(result)


def test_the_old_protocol_misreads_the_same_drift():
    """What the alternating rounds replace: a baseline timed first and its variant afterwards, under the same drift,
    gives a ratio far from the true 1.6× (the guards used to print ⚠ about it)."""
    clock = FakeClock(drift=slowing_host)
    before = bench.bench(clock.work("a", 0.010), clock=clock, device="cpu", min_run_time=1.0)
    after = bench.bench(clock.work("b", 0.010 / 1.6), clock=clock, device="cpu", min_run_time=1.0)
    assert before.median_s / after.median_s < 1.3  # a third of the speed-up lost to the drift


def test_no_difference_under_drift_is_a_resolved_null():
    clock = FakeClock(drift=slowing_host)
    result = bench.compare({"a": clock.work("a", 0.004), "b": clock.work("b", 0.004)}, clock=clock, device="cpu")
    v = result.verdict()
    # each variant's own band is wide (the drift), the paired ratios are not
    assert result.timings["a"].spread > 0.1
    assert v.outcome == "same" and v.short == "no difference > 3%"
    assert v.text.startswith("no difference larger than 3%")


def test_noise_wider_than_the_resolution_is_inconclusive_never_a_miss():
    rng = random.Random(0)
    clock = FakeClock(noise=lambda: rng.uniform(0.7, 1.3))
    result = bench.compare({"a": clock.work("a", 0.010), "b": clock.work("b", 0.010 / 1.05)}, clock=clock,
                           device="cpu", rounds=8, min_run_time=0.08)  # one call per block: nothing averages out
    v = result.verdict("b")
    assert v.outcome == "inconclusive"
    assert v.text.startswith("could not resolve a 3% effect here") and "band" in v.text
    assert "did not hold" not in str(result) and "slower" not in v.short


def test_a_slower_variant_is_resolved_as_slower():
    clock = FakeClock()
    v = bench.compare({"fast": clock.work("a", 0.001), "slow": clock.work("b", 0.0033)}, clock=clock,
                      device="cpu").verdict()
    assert v.outcome == "slower" and v.short == "3.30× slower" and v.speedup == pytest.approx(1 / 3.3)
    assert v.text == "3.30× slower (band 3.30–3.30×)"  # the band in the headline's orientation


def test_rounds_alternate_and_reverse_order():
    clock = FakeClock()
    bench.compare({"A": clock.work("A", 1.0), "B": clock.work("B", 1.0), "C": clock.work("C", 1.0)}, clock=clock,
                  device="cpu", rounds=4, warmup=1, min_run_time=0.1)  # one call per block
    timed = clock.calls[-12:]
    assert "".join(timed) == "ABCCBAABCCBA"


def test_variants_are_warmed_up_and_given_blocks_of_their_own_length():
    clock = FakeClock()
    result = bench.compare({"short": clock.work("s", 1e-4), "long": clock.work("l", 1e-2)}, clock=clock,
                           device="cpu", rounds=4, min_run_time=0.8)  # 0.1 s per block
    assert result.timings["short"].calls_per_block == 1000 and result.timings["long"].calls_per_block == 10
    assert result.rounds == 4 and len(result.ratios("long")) == 4


def test_verdict_rules_on_crafted_ratios():
    def v(ratios, resolution=0.03):
        return bench.verdict_from_ratios("x", "base", ratios, resolution=resolution)

    assert v([1.60, 1.62, 1.61, 1.63, 1.62, 1.61]).outcome == "faster"
    assert v([1.02, 1.03, 1.025, 1.02, 0.99, 1.01]).outcome == "same"  # every ratio within ±3%
    assert v([1.02, 1.05, 1.06, 1.04, 1.05, 1.04]).outcome == "faster"  # band excludes 1, median 1.045 > 1.03
    assert v([1.01, 1.02, 1.05, 1.06, 1.04, 1.02]).outcome == "inconclusive"  # median 1.03: not over 3%
    assert v([0.8, 1.3, 1.0, 1.1, 1.05, 0.9]).outcome == "inconclusive"
    slow = v([0.50, 0.52, 0.51])  # 3 rounds, every one far beyond the resolution
    assert slow.outcome == "slower" and slow.text.endswith(", every one of 3 rounds beyond 3%)"), slow.text
    # notebook 10's two nodes: 3 launches each, one round at 0.99×: its whole range (a 75% interval) is no verdict
    nodes = v([0.947, 0.894, 0.988])
    assert nodes.few_rounds and nodes.confidence == pytest.approx(0.75) and nodes.outcome == "inconclusive"
    assert nodes.text == ("could not resolve a 3% effect here (0.95×, band 0.89–0.99×, 3 rounds: a 75% interval, "
                          "too few rounds for 95%)"), nodes.text
    assert not v([0.947, 0.894, 0.988, 0.95, 0.93, 0.96]).few_rounds
    assert v([0.8, 1.3, 1.0, 1.1], resolution=0.4).outcome == "same"
    wide = v([0.8, 1.3, 1.0, 1.1], resolution=0.10)
    assert wide.text.startswith("could not resolve a 10% effect here") and "band 0.80–1.30×" in wide.text
    with pytest.raises(ValueError, match="at least 2"):
        v([1.0])
    with pytest.raises(ValueError, match="resolution"):
        v([1.0, 1.0], resolution=3)


def test_median_interval_is_the_sign_test_interval():
    ten = [float(i) for i in range(1, 11)]
    low, high, coverage = bench.median_interval(ten)
    assert (low, high) == (2.0, 9.0) and coverage == pytest.approx(1 - 2 * 11 / 1024)
    low, high, coverage = bench.median_interval([3.0, 1.0, 2.0, 4.0])
    assert (low, high) == (1.0, 4.0) and coverage == pytest.approx(0.875)  # too few values for 95%: the range


def test_pure_noise_is_rarely_called_a_difference():
    """Over many comparisons of identical work under ±30% noise, at most a few percent come out "faster" or "slower"
    (the quartiles of the ratios did so about a third of the time)."""
    rng = random.Random(1)
    false = 0
    for _ in range(200):
        ratios = [rng.uniform(0.7, 1.3) / rng.uniform(0.7, 1.3) for _ in range(12)]
        false += bench.verdict_from_ratios("b", "a", ratios).outcome in ("faster", "slower")
    assert false <= 200 * 0.06


def test_explain_prints_the_reason_of_the_outcome_it_got():
    clock = FakeClock()
    v = bench.compare({"seed": clock.work("a", 1e-3), "pinned": clock.work("b", 3.3e-3)}, clock=clock,
                      device="cpu").verdict()
    text = v.explain(faster="the copy is hidden behind the step", slower="pinning runs in the main thread")
    assert "slower" in text and text.endswith("pinning runs in the main thread")
    assert "hidden" not in text
    assert v.explain(faster="only if faster") == str(v)  # no reason for this outcome: the verdict alone
    with pytest.raises(ValueError, match="keyed by outcome"):
        v.explain(expected="faster")


def test_rates_limits_table_and_plot():
    clock = FakeClock()
    result = bench.compare({"pageable": clock.work("a", 2e-3), "pinned": clock.work("b", 1e-3)}, clock=clock,
                           device="cpu", bytes_moved=1e8, limit=200.0, limit_name="PCIe link", title="H2D")
    assert result.rate("pinned") == pytest.approx(100.0) and result.rate("pageable") == pytest.approx(50.0)
    rows = result.rows()
    assert rows[1]["GB/s"] == "100" and rows[1]["% of PCIe link"] == "50%" and rows[0]["verdict"] == "baseline"
    assert result.fastest == "pinned"
    fig = result.plot()
    assert fig.axes[0].get_title() == "H2D"
    items = bench.compare({"a": clock.work("a", 0.5), "b": clock.work("b", 0.25)}, clock=clock, device="cpu",
                          items=(4000, "images"))
    assert items.rows()[0]["images/s"] == "8,000"
    with pytest.raises(ValueError, match="no rate"):
        bench.compare({"a": clock.work("a", 1e-3), "b": clock.work("b", 1e-3)}, clock=clock, device="cpu").rate("a")


def test_record_inside_the_measuring_call():
    clock = FakeClock()
    bench.compare({"serial": clock.work("a", 2e-3), "overlapped": clock.work("b", 1e-3)}, clock=clock,
                  device="cpu", bytes_moved=1e6, limit=2.0, limit_name="link",
                  record={"overlap_speedup": "overlapped", "serial_s": "serial",
                          "overlapped_gbps": ("overlapped", "rate")})
    speed = results.RECORDED["overlap_speedup"]
    assert speed.unit == "x" and speed.value == pytest.approx(2.0) and speed.band == pytest.approx((2.0, 2.0))
    assert results.RECORDED["serial_s"].unit == "s" and results.RECORDED["serial_s"].value == pytest.approx(2e-3)
    assert results.RECORDED["serial_s"].limit == pytest.approx(0.5e-3)  # 1 MB at the 2 GB/s limit
    assert results.RECORDED["serial_s"].percent_of_limit == pytest.approx(25)
    rate = results.RECORDED["overlapped_gbps"]
    assert rate.unit == "GB/s" and rate.value == pytest.approx(1.0) and rate.percent_of_limit == pytest.approx(50)
    assert speed.coverage is None, "6 rounds or more: a 95% band, nothing to say"


def test_a_speedup_from_few_rounds_records_its_bands_coverage():
    """10's two nodes against one: 3 launches a side, a band of their whole range that holds the median 75% of the
    time — recorded with it, so the README can say so."""
    few = bench.Comparison.from_rounds({"one": [56.3e-3, 55.4e-3, 60.8e-3], "two": [58.0e-3, 59.6e-3, 57.5e-3]})
    few.record({"two_vs_one": "two"})
    recorded = results.RECORDED["two_vs_one"]
    assert recorded.coverage == pytest.approx(0.75) and recorded.payload()["coverage"] == pytest.approx(0.75)
    assert "a 75% interval" in str(recorded)


def test_bad_comparisons_are_clear_errors():
    with pytest.raises(ValueError, match="at least two"):
        bench.compare({"only": lambda: None})
    with pytest.raises(TypeError, match="variant 'b'"):
        bench.compare({"a": lambda: None, "b": 3})
    with pytest.raises(ValueError, match="baseline 'c'"):
        bench.compare({"a": lambda: None, "b": lambda: None}, baseline="c", device="cpu")
    with pytest.raises(ValueError, match="rounds >= 2"):
        bench.compare({"a": lambda: None, "b": lambda: None}, rounds=1, device="cpu")
    with pytest.raises(ValueError, match="at most one"):
        bench.compare({"a": lambda: None, "b": lambda: None}, bytes_moved=1, flops=1, device="cpu")


def test_a_verdict_against_another_variant_of_the_same_rounds():
    clock = FakeClock()
    result = bench.compare({"seed": clock.work("a", 4e-3), "pinned": clock.work("b", 4e-3),
                            "resident": clock.work("c", 1e-3)}, clock=clock, device="cpu")
    assert result.verdict("resident").outcome == "faster"
    v = result.verdict("resident", against="pinned")
    assert v.baseline == "pinned" and v.speedup == pytest.approx(4.0) and str(v).startswith("resident vs pinned")
    assert result.verdict("pinned").outcome == "same"


def test_comparison_from_rounds_measured_elsewhere():
    """Rounds timed outside one process (alternating torchrun launches) get the same verdicts."""
    result = bench.Comparison.from_rounds({"1 GPU": [2.0, 2.2, 2.4, 2.6], "2 GPUs": [1.05, 1.15, 1.25, 1.35]})
    v = result.verdict()
    assert v.outcome == "faster" and v.speedup == pytest.approx(1.91, rel=0.01)
    with pytest.raises(ValueError, match="same number of rounds"):
        bench.Comparison.from_rounds({"a": [1.0, 1.0], "b": [1.0]})
    with pytest.raises(ValueError, match="positive"):
        bench.Comparison.from_rounds({"a": [1.0, 1.0], "b": [1.0, 0.0]})


def test_real_work_on_cpu_is_compared_in_rounds():
    small, large = torch.randn(32, 32), torch.randn(512, 512)  # 4,096× the work
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: on a busy 2-core machine, OpenMP's waits would blur the two apart
    try:
        result = bench.compare({"large": lambda: large @ large, "small": lambda: small @ small}, device="cpu",
                               min_run_time=0.3)
    finally:
        torch.set_num_threads(threads)
    assert result.verdict("small").outcome in ("faster", "inconclusive")
    assert result.timings["large"].median_s > 5 * result.timings["small"].median_s


# ── Profiling never precedes a timing ───────────────────────────────────────────────────────────────────────


def test_timing_after_a_profile_is_refused():
    from utils import profile

    x = torch.randn(32, 32)
    bench.bench(lambda: x @ x, device="cpu", min_run_time=0.01)  # before: fine
    profile.profile_steps(lambda: x @ x, steps=1, device="cpu")
    with pytest.raises(profile.ProfiledProcessError, match="profile_steps"):
        bench.bench(lambda: x @ x, device="cpu", min_run_time=0.01)
    with pytest.raises(profile.ProfiledProcessError, match="restart the kernel"):
        bench.compare({"a": lambda: x @ x, "b": lambda: x + x}, device="cpu")
    with pytest.raises(profile.ProfiledProcessError):
        bench.copy_bandwidth("cpu", nbytes=1 << 20)


def test_a_profiler_session_opened_by_hand_counts_too():
    from torch.profiler import ProfilerActivity

    from utils import profile

    x = torch.randn(16, 16)
    with profile.session(activities=[ProfilerActivity.CPU]) as prof:
        with pytest.raises(profile.ProfiledProcessError):
            bench.bench(lambda: x @ x, device="cpu", min_run_time=0.01)
        x @ x
    assert prof.key_averages()
    with pytest.raises(profile.ProfiledProcessError, match="session"):
        bench.bench(lambda: x @ x, device="cpu", min_run_time=0.01)


# ── A sweep ─────────────────────────────────────────────────────────────────────────────────────────────────


def test_sweep_checks_every_variant_then_gives_rates_against_a_limit():
    def copy(size):
        src, dst = torch.randn(size), torch.empty(size)
        return lambda: dst.copy_(src)

    def clone(size):
        src = torch.arange(size, dtype=torch.float32)
        return lambda: src.clone()

    reference = lambda size: torch.arange(size, dtype=torch.float32)  # noqa: E731
    def add_zero(size):
        t = torch.arange(size, dtype=torch.float32)
        return lambda: t + 0

    good = bench.sweep({"clone": clone, "add zero": add_zero},
                       [1 << 10, 1 << 14], reference=reference, bytes_moved=lambda s: 8 * s, limit=1e4,
                       limit_name="copy bandwidth", rounds=2, min_run_time=0.02, progress=False,
                       record={"clone_gbps": "clone"})
    assert len(good.rates("clone")) == 2 and all(r > 0 for r in good.rates("clone"))
    assert "checked against the reference at every size" in str(good)
    assert results.RECORDED["clone_gbps"].limit == 1e4
    assert good.plot().axes[0].get_xscale() == "log"
    with pytest.raises(ValueError, match="'copy' differs from the reference at size 1024"):
        bench.sweep({"clone": clone, "copy": copy}, [1 << 10], reference=reference, rounds=2, min_run_time=0.01,
                    progress=False)
    unchecked = bench.sweep({"clone": clone, "copy": copy}, [1 << 10], rounds=2, min_run_time=0.01, progress=False)
    assert "not checked: no reference was given" in str(unchecked)
    with pytest.raises(ValueError, match="increasing order"):
        bench.sweep({"clone": clone, "copy": copy}, [4, 2])
    # the variant the reference is made from is said to be the reference, not "checked" against itself
    own = bench.sweep({"clone": clone, "add zero": add_zero}, [1 << 10], reference=reference,
                      reference_variant="clone", rounds=2, min_run_time=0.01, progress=False)
    assert own.checked == {"clone": "the reference, not checked: the others are checked against it",
                           "add zero": "checked against the reference at every size"}
    with pytest.raises(ValueError, match="reference_variant 'bf16' is not one of"):
        bench.sweep({"clone": clone, "copy": copy}, [1 << 10], reference=reference, reference_variant="bf16")


def test_burst_size_shrinks_until_one_product_fits_the_budget():
    made = []

    def operands(n):
        made.append(n)
        return torch.randn(8, 8), torch.randn(8, 8)

    clock_s = iter([0.0, 0.3, 0.3, 0.6, 0.6, 0.6 + 0.004])  # 300 ms, 300 ms, then 4 ms per product
    real = bench.time.perf_counter
    try:
        bench.time.perf_counter = lambda: next(clock_s)
        n, _, _ = bench._burst_n(operands, 8192, torch.device("cpu"), 0.005)
    finally:
        bench.time.perf_counter = real
    assert made == [8192, 4096, 2048] and n == 2048

# ── Burst against sustained: two rates measured under different conditions on purpose ───────────────────────


def _rate(value, *, mhz=None, n=8192, spread=0.01, reasons=0, power=None, samples=12):
    median = 1.0 / value
    blocks = (median * (1 - spread), median, median * (1 + spread))
    timing = bench.Timing("matmul", median, 2 * spread * median, blocks, 1, "cuda:0")
    samples = [GpuSample(0.004 * i, mhz, power, reasons) for i in range(samples)] if mhz else []
    conditions = GpuConditions("cuda:0", "NVML" if mhz else None, None if mhz else "a CPU has no GPU clock",
                                   1980.0 if mhz else None, 700.0 if mhz else None, samples)
    return bench.Rate("matmul", value, "TFLOP/s", timing, conditions, {"n": n})


def test_burst_vs_sustained_when_the_clock_explains_the_drop():
    text = bench.burst_vs_sustained(_rate(787.5, mhz=1980), _rate(670.8, mhz=1695, reasons=0x4, power=699))
    assert "ustained 670.8 TFLOP/s is 85% of the burst's 787.5: the rate falls under sustained work." in text
    assert "held back by power cap; board power 699 W of a 700 W limit" in text
    assert "The clock accounts for the drop" in text


def test_burst_vs_sustained_when_the_rate_falls_less_than_the_clock():
    text = bench.burst_vs_sustained(_rate(787.5, mhz=1980), _rate(670.8, mhz=1485))
    assert "fell less than the clock" in text and "per GHz" in text


def test_burst_vs_sustained_holds_and_unresolved():
    text = bench.burst_vs_sustained(_rate(100.0, mhz=1410), _rate(99.0, mhz=1410))
    assert "holds its rate" in text and "falls" not in text
    text = bench.burst_vs_sustained(_rate(100.0, spread=0.2), _rate(90.0, spread=0.2))
    assert "bands overlap" in text and "not resolved" in text and "No clock readings (a CPU has no GPU clock)" in text


def test_burst_vs_sustained_names_a_smaller_burst():
    """A T4's fp32 burst multiplies 2048×2048 matrices (≤ 5 ms a product): no per-clock reading then."""
    text = bench.burst_vs_sustained(_rate(4.0, mhz=1590, n=2048), _rate(4.4, mhz=1590))
    assert "rises under sustained work" in text and "2048×2048" in text and "8192×8192" in text
    text = bench.burst_vs_sustained(_rate(8.0, mhz=1590, n=2048), _rate(6.0, mhz=1200))
    assert "per GHz" not in text and "accounts for" not in text and "differ by size" in text


def test_plot_clock_samples(capsys):
    assert plot.clock_samples({"burst": _rate(1.0).conditions}, title="t") is None
    assert "No clock plot" in capsys.readouterr().out
    fig = plot.clock_samples({"burst": _rate(1.0, mhz=1980).conditions,
                                  "sustained": _rate(1.0, mhz=1485).conditions}, title="SM clock")
    assert fig.axes[0].get_title() == "SM clock" and len(fig.axes[0].lines) == 3  # two series and the maximum


def test_burst_vs_sustained_label():
    text = bench.burst_vs_sustained(_rate(100.0), _rate(99.5), label="bf16 matmul")
    assert text.startswith("bf16 matmul: sustained 99.5 TFLOP/s is 100% of the burst's 100")


def test_burst_vs_sustained_needs_enough_clock_readings():
    text = bench.burst_vs_sustained(_rate(787.5, mhz=1980, samples=3), _rate(670.8, mhz=1695, reasons=0x4))
    assert "3 clock readings, too few to tell" in text and "The clock accounts for the drop" not in text


def test_a_table_orders_variants_as_their_speed_ups_do():
    """One number per variant: the per-call column is the baseline's median over the paired speed-up, so two close
    variants whose own medians order one way and whose speed-ups order the other are shown as the speed-ups say."""
    from utils.bench import Comparison, format_seconds

    rounds = {"seed": [0.300, 0.310, 0.290, 0.305, 0.300, 0.320],
              "a": [0.141, 0.150, 0.130, 0.141, 0.141, 0.150],
              "b": [0.143, 0.140, 0.132, 0.150, 0.139, 0.143]}
    c = Comparison.from_rounds(rounds)
    own = {n: sorted(t)[2:4] for n, t in rounds.items()}
    assert sum(own["a"]) / 2 < sum(own["b"]) / 2  # by their own medians a is faster ...
    assert c.speedup("b") > c.speedup("a")  # ... by the paired ratios b is
    for name in ("a", "b"):
        assert c.time_s(name) == pytest.approx(c.time_s("seed") / c.speedup(name))
    assert c.fastest == "b" and c.time_s("b") < c.time_s("a")
    rows = {r["variant"]: r for r in c.rows()}
    assert rows["b"]["per call"] == format_seconds(c.time_s("b"))
    for name in ("a", "b"):  # the band surrounds the number it belongs to: the speed-up's band, as times
        lo, hi = c.time_band_s(name)
        assert lo <= c.time_s(name) <= hi
        assert (lo, hi) == pytest.approx((c.time_s("seed") / c.verdict(name).band[1],
                                          c.time_s("seed") / c.verdict(name).band[0]))
    assert c.time_band_s("seed") == c.timings["seed"].quartiles_s


def test_a_median_near_one_prints_with_the_digits_of_its_band():
    """'1.00×, band 0.995–0.998×' put the rounded median outside its own band (04b's review)."""
    from utils.bench import Verdict
    same = Verdict("symbolic", "specialised", 0.9964, (0.995, 0.998), 0.03, 12)
    assert same.text == "no difference larger than 3% (0.996×, band 0.995–0.998×)"
    unresolved = Verdict("a", "b", 1.004, (0.97, 1.05), 0.03, 12)
    assert "(1.004×, band 0.97–1.05×, 12 rounds)" in unresolved.text


def test_a_ratio_in_a_verdict_keeps_its_side_of_every_edge():
    """10's 1 → 4 step: band top 1.0303 printed '1.03' read as inside ±3% where it is not."""
    assert bench.near_edge_text(1.0303) == "1.0303×" and bench.near_edge_text(1.0297) == "1.0297×"
    assert bench.near_edge_text(1.005) == "1.005×"  # near 1: three decimals, never "1.00"
    assert bench.near_edge_text(1.62) == "1.62×" and bench.near_edge_text(0.5) == "0.50×"
    assert bench.near_edge_text(1.096, resolution=0.1) == "1.096×"  # the edge follows the resolution
    assert bench.near_edge_text(0.0012) == "0.0012×" and bench.near_edge_text(11401) == "11,401×"
    edge = bench.verdict_from_ratios("x", "base", [1.0315, 1.033, 1.0318, 1.032, 1.0316, 1.034, 1.0317, 1.035])
    assert edge.outcome == "faster" and edge.short == "1.032× faster", edge.short  # never "1.03× faster"
    # the slower edge, 1/1.03 = 0.97087: 0.9712 lies inside it and must not read "0.97"; 0.9706 lies beyond it
    assert bench.near_edge_text(0.9712) == "0.971×" and bench.near_edge_text(0.9706) == "0.97×"
