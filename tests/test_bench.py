"""utils.bench: the timing harness and the peak measurements (CPU)."""

import time

import pytest
import torch

from utils import bench


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


def test_speedup_table_against_baseline():
    t1 = bench.Timing("eager", 0.004, 0.0, (0.004,), 1, "cpu")
    t2 = bench.Timing("fused", 0.001, 0.0, (0.001,), 1, "cpu")
    rows = bench.speedup_table([t1, t2])
    assert [r["speed-up"] for r in rows] == ["1.00×", "4.00×"]


@pytest.mark.parametrize(("seconds", "text"), [(1.5, "1.5 s"), (0.0123, "12.3 ms"), (3.4e-6, "3.4 µs"),
                                               (8e-9, "8 ns")])
def test_format_seconds(seconds, text):
    assert bench.format_seconds(seconds) == text


def test_copy_bandwidth_and_matmul_rate_on_cpu():
    copy = bench.copy_bandwidth("cpu", nbytes=16 << 20)
    assert copy.unit == "GB/s" and copy.value > 0.1
    mm = bench.matmul_rate(torch.float32, "cpu", n=256)
    assert mm.unit == "TFLOP/s" and mm.value > 0
    # the TF32 switch is restored afterwards
    before = torch.get_float32_matmul_precision()
    bench.matmul_rate(torch.float32, "cpu", n=64, tf32=True)
    assert torch.get_float32_matmul_precision() == before


def test_host_to_device_needs_cuda():
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        bench.host_to_device_bandwidth(1 << 20, pinned=False, device="cpu")


# ── compare: verdicts with their noise ──────────────────────────────────────────────────────────────────────


def timing(label, blocks):
    """A Timing from per-call block times, as bench() would build it."""
    return bench._timing_from(label, list(blocks), 1, torch.device("cpu"))


def test_compare_calls_a_clear_gain_faster():
    base = timing("eager", [1.00, 1.01, 0.99, 1.02, 1.00, 0.98, 1.01])
    fast = timing("fused", [0.50, 0.51, 0.49, 0.50, 0.52, 0.50, 0.49])
    result = bench.compare(base, fast)
    assert result.outcome == "faster" and result.speedup == pytest.approx(2.0, rel=0.02)
    assert result.short == "2.00× faster" and "2.00× faster" in str(result)
    assert bench.compare(fast, base).outcome == "slower"
    assert "slower" in bench.compare(fast, base).verdict


def test_compare_calls_overlapping_timings_the_same():
    base = timing("a", [1.00, 1.10, 0.90, 1.05, 0.95, 1.02, 0.98])
    other = timing("b", [0.97, 1.08, 0.88, 1.03, 0.93, 1.00, 0.96])  # 2% apart, spreads of ±5%
    result = bench.compare(base, other)
    assert result.outcome == "same" and result.short == "same (noise)"
    assert "no difference beyond the noise" in result.verdict and "overlap" in result.verdict


def test_compare_needs_min_effect_even_without_overlap():
    base = timing("a", [1.000, 1.001, 0.999, 1.000, 1.000])
    other = timing("b", [0.980, 0.981, 0.979, 0.980, 0.980])  # tight and disjoint, but only 2% apart
    assert bench.compare(base, other).outcome == "same"
    assert "drift" in bench.compare(base, other).verdict
    assert bench.compare(base, other, min_effect=0.01).outcome == "faster"


def test_explain_adds_the_measured_reason_only_when_the_expectation_fails():
    base = timing("seed", [1.0, 1.01, 0.99, 1.0, 1.0])
    same = timing("pinned", [0.99, 1.0, 1.01, 0.98, 1.0])
    text = bench.compare(base, same).explain("faster", why="the copy takes 4 µs of a 1.4 ms step")
    assert text.startswith("pinned vs seed: no difference beyond the noise") and "4 µs" in text
    fast = timing("fast", [0.5, 0.5, 0.5, 0.5, 0.5])
    assert bench.compare(base, fast).explain("faster", why="unused").endswith("as expected")


def test_compare_rejects_bad_input():
    t = timing("a", [1.0, 1.0])
    with pytest.raises(TypeError, match="two Timing"):
        bench.compare(1.0, t)
    with pytest.raises(ValueError, match="min_effect"):
        bench.compare(t, t, min_effect=1.5)


def test_speedup_table_has_a_verdict_column():
    base = timing("eager", [1.0, 1.01, 0.99, 1.0, 1.0])
    fast = timing("fused", [0.25, 0.25, 0.26, 0.24, 0.25])
    rows = bench.speedup_table([base, fast])
    assert [r["verdict"] for r in rows] == ["baseline", "4.00× faster"]


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


def test_retimed_says_the_same_within_the_noise():
    before = timing("bf16", [1.00, 1.05, 0.95, 1.02, 0.98])
    again = timing("bf16", [1.01, 1.04, 0.96, 1.03, 0.99])
    changed, text = bench.retimed(before, again, then="in section 5", now="here")
    assert not changed and "⚠" not in text
    assert text.startswith("bf16: 1.01 s (IQR") and "here, 1 s (IQR" in text and "in section 5" in text
    assert text.endswith("the same within the noise")


def test_retimed_warns_when_the_same_work_got_slower_or_faster():
    before = timing("fp16 + GradScaler", [0.0156, 0.0157, 0.0155, 0.0156, 0.0158])
    slower = timing("fp16 + GradScaler", [0.0203, 0.0204, 0.0202, 0.0203, 0.0205])  # 1.30× as long, tight spreads
    changed, text = bench.retimed(before, slower, then="in section 5", now="here")
    assert changed and "⚠ 1.30× slower here" in text and "not with what was timed in section 5" in text
    changed, text = bench.retimed(slower, before)
    assert changed and "⚠ 1.30× faster now" in text


def test_retimed_ignores_a_small_shift_and_rejects_bad_input():
    before = timing("a", [1.000, 1.001, 0.999, 1.000, 1.000])
    shifted = timing("a", [1.020, 1.021, 1.019, 1.020, 1.020])  # disjoint but 2% apart: under MIN_EFFECT
    assert bench.retimed(before, shifted)[0] is False
    with pytest.raises(TypeError, match="two Timing"):
        bench.retimed(before, 1.0)
