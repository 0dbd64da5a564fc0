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
    small, large = torch.randn(64, 64), torch.randn(512, 512)
    fast = bench.bench(lambda: small @ small, device="cpu", min_run_time=0.05)
    slow = bench.bench(lambda: large @ large, device="cpu", min_run_time=0.05)
    assert slow.median_s > 5 * fast.median_s


def test_slow_calls_still_give_min_blocks():
    timing = bench.bench(lambda: time.sleep(0.03), device="cpu", warmup=0, min_run_time=0.01, min_blocks=3)
    assert len(timing.block_times_s) >= 3 and timing.calls_per_block == 1


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
