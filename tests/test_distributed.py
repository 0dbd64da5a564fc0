"""utils.distributed and the scripts of notebook 10: the launcher (environment, streaming, deadline, errors), the
pure helpers, and the real scripts run as 2 gloo processes on the CPU (GPU variants need 2 CUDA GPUs)."""

from __future__ import annotations

import math
import os
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from utils import distributed as D
from utils.bench import Timing


def needs_two_gpus(test):
    """Skipped below two GPUs; marked multi_gpu, which .ci/gpu-run's parallel mode runs with every GPU visible."""
    return pytest.mark.multi_gpu(pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")(test))


CPU = ["--device", "cpu", "--timeout-s", "30"]


# ── The launcher's environment ───────────────────────────────────────────────────────────────────────────────


def test_child_env_keeps_the_multicast_switches_of_the_parent(monkeypatch):
    values = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    assert set(values) == set(D.PASSED_THROUGH)
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    env = D.child_env(2, nccl_debug="INFO")
    for name, value in values.items():
        assert env[name] == value, f"{name} must reach the processes unchanged"


def test_child_env_passes_everything_else_and_adds_only_what_it_needs(monkeypatch):
    monkeypatch.setenv("COURSE_TEST_VARIABLE", "kept")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("NCCL_DEBUG", raising=False)
    env = D.child_env(2)
    assert env["COURSE_TEST_VARIABLE"] == "kept" and env["PYTHONUNBUFFERED"] == "1"
    assert int(env["OMP_NUM_THREADS"]) >= 1 and "NCCL_DEBUG" not in env
    added = set(env) - set(os.environ)
    assert added <= {"OMP_NUM_THREADS", "PYTHONUNBUFFERED", *D.MULTICAST_OFF}
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    assert D.child_env(2)["OMP_NUM_THREADS"] == "7", "a thread count set by the reader is kept"


def test_child_env_switches_multicast_off_where_the_parent_says_nothing():
    env = D.child_env(4, parent={"PATH": "/bin"})
    assert {name: env[name] for name in D.MULTICAST_OFF} == {"NCCL_NVLS_ENABLE": "0",
                                                             "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                                                             "NVSHMEM_DISABLE_NVLS": "1"}
    assert D.child_env(4, parent={"NCCL_NVLS_ENABLE": "0"})["NCCL_NVLS_ENABLE"] == "0"


@pytest.mark.parametrize("name", D.PASSED_THROUGH)
def test_child_env_refuses_to_set_a_passed_through_variable(name):
    with pytest.raises(ValueError, match="passed through"):
        D.child_env(2, extra={name: "1"})


def test_fail_fast_nccl_env_takes_no_dump_and_waits_a_second():
    env = D.FAIL_FAST_NCCL_ENV
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0" and env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "0"
    assert 0 < 4 * int(env["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"]) <= 1000, "the watchdog sleeps 4× this (ms)"
    assert D.child_env(2, extra=env, parent={})["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"] == "250"
    assert not set(env) & set(D.PASSED_THROUGH)


def test_launch_hands_the_child_environment_to_the_processes(monkeypatch):
    """launch() starts torchrun with child_env(): the multicast switches of the parent reach every process."""
    for name in D.PASSED_THROUGH:
        monkeypatch.setenv(name, "0" if name == "NCCL_NVLS_ENABLE" else "1")
    seen = {}

    class Started(Exception):
        pass

    def fake_popen(cmd, **kwargs):
        seen.update(kwargs["env"])
        raise Started

    monkeypatch.setattr(D.subprocess, "Popen", fake_popen)
    with pytest.raises(Started):
        D.launch("allreduce_bench.py", 2)
    assert {name: seen[name] for name in D.PASSED_THROUGH} == {name: os.environ[name] for name in D.PASSED_THROUGH}


def test_function_source_reads_a_scripts_function():
    source = D.function_source("ddp_train.py", "wrap")
    assert source.startswith("def wrap(") and "DDP(" in source
    with pytest.raises(KeyError, match="no function"):
        D.function_source("ddp_train.py", "no_such_function")


def test_torchrun_command_uses_this_python():
    cmd = D.torchrun_command("scripts/x.py", 2, ["--a", 1])
    assert cmd[:3] == [os.sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc-per-node=2" in cmd and "--standalone" in cmd and cmd[-3:] == ["scripts/x.py", "--a", "1"]


def test_torchrun_command_for_several_nodes_meets_at_a_c10d_rendezvous():
    cmd = D.torchrun_command("x.py", 2, ["--a", 1], nnodes=2, endpoint="localhost:29511", run_id="job", is_host=False)
    assert "--standalone" not in cmd and "--nnodes=2" in cmd and "--rdzv-backend=c10d" in cmd
    assert "--rdzv-endpoint=localhost:29511" in cmd and "--rdzv-id=job" in cmd and "--rdzv-conf=is_host=0" in cmd
    with pytest.raises(ValueError, match="endpoint"):
        D.torchrun_command("x.py", 2, nnodes=2)
    shown = D.machine_commands("fsdp_train.py", 4, ["--phases", "resume"])
    assert "torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=MACHINE_A:29500" in shown
    assert "NCCL_SOCKET_IFNAME" in shown and "scripts/fsdp_train.py --phases resume" in shown
    assert os.sys.executable not in shown and "is_host" not in shown


def test_split_devices_gives_each_node_its_half():
    assert D.split_devices(4) == ["0,1", "2,3"]
    assert D.split_devices(3) == ["0,1", "2"]
    assert D.split_devices(8) == ["0,1,2,3", "4,5,6,7"]
    assert D.split_devices(4, visible="4,5,6,7") == ["4,5", "6,7"], "the GPUs this process was given"
    assert D.split_devices(2, visible="GPU-a, GPU-b") == ["GPU-a", "GPU-b"]
    with pytest.raises(ValueError):
        D.split_devices(1)


def test_gpu_counts_are_powers_of_two_and_every_gpu():
    assert [D.gpu_counts(n) for n in (1, 2, 3, 4, 6, 8)] == [[1], [1, 2], [1, 2, 3], [1, 2, 4], [1, 2, 4, 6],
                                                            [1, 2, 4, 8]]
    with pytest.raises(ValueError):
        D.gpu_counts(0)


def test_plan_says_what_runs_where():
    four = D.plan(gpus=4, nccl=True, gpu_name="H100")
    assert (four.device, four.nproc, four.scale_device, four.ladder) == ("cuda", 4, "cuda", [1, 2, 4])
    assert four.label == "4 × H100, NCCL" and four.unit == "GPU"
    assert "use all 4; the scaling also runs on 1, 2; the timeout demonstration runs 2 processes" in str(four)
    eight = D.plan(gpus=8, nccl=True, gpu_name="H100")
    assert eight.ladder == [1, 2, 4, 8] and eight.nproc == 8
    assert D.plan(gpus=3, nccl=True, gpu_name="x").ladder == [1, 2, 3]
    one = D.plan(gpus=1, nccl=True, gpu_name="T4")
    assert (one.device, one.nproc, one.scale_device, one.scale_nproc) == ("cpu", 2, "cuda", 1)
    assert "scaling needs a second" in str(one) and one.scale_label == "T4, NCCL" and one.unit == "GPU"
    for none in (D.plan(gpus=0, nccl=True), D.plan(gpus=2, nccl=False, gpu_name="x")):
        assert (none.device, none.nproc, none.scale_device, none.ladder) == ("cpu", 2, "cpu", [1, 2])
        assert none.unit == "process" and "not comparable" in none.label
    assert "no NCCL" in str(D.plan(gpus=2, nccl=False, gpu_name="x"))
    assert D.plan(torch.device("cpu")).gpus == 0, "a CPU device: no GPU runs, whatever the machine has"


def test_launch_rejects_bad_arguments():
    with pytest.raises(FileNotFoundError, match="no script"):
        D.launch("no_such_script.py", 2)
    with pytest.raises(ValueError, match="nproc"):
        D.launch("allreduce_bench.py", 0)


def test_setup_outside_torchrun_says_how_to_start(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        D.setup("cpu")


def test_failure_cause_prefers_the_timeout():
    lines = ["[rank0]: Traceback (most recent call last):",
             "[rank0]: RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms for recv",
             "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: "]
    assert D.failure_cause(lines).startswith("Timed out waiting 2000ms")
    assert D.failure_cause(["[rank1]: ValueError: bad shape"]) == "ValueError: bad shape"
    assert D.failure_cause(["all good"]) is None


# ── Pure helpers ─────────────────────────────────────────────────────────────────────────────────────────────


def test_bus_factor_matches_nccl_tests():
    assert [D.allreduce_bus_factor(n) for n in (2, 4, 8)] == [1.0, 1.5, 1.75]
    with pytest.raises(ValueError):
        D.allreduce_bus_factor(1)


def test_timing_round_trips_through_json():
    t = Timing("x", 0.002, 0.0001, (0.0019, 0.002, 0.0021), 10, "cpu")
    import json

    assert D.timing_from_dict(json.loads(json.dumps(D.timing_to_dict(t)))) == t


def _k(name, start, duration):
    return SimpleNamespace(name=name, start_us=start, duration_us=duration)


def test_communication_overlap_counts_time_under_computation():
    kernels = [_k("gemm_backward", 0, 100), _k("ncclDevKernel_AllReduce_Sum_f32", 50, 100),
               _k("elementwise", 130, 20)]
    stats = D.communication_overlap(kernels, steps=1)
    assert math.isclose(stats["comm_s"], 100e-6) and math.isclose(stats["overlapped_s"], 70e-6)
    assert math.isclose(stats["exposed_s"], 30e-6) and math.isclose(stats["overlap_fraction"], 0.7)
    assert math.isnan(D.communication_overlap([_k("gemm", 0, 1)])["overlap_fraction"])


def _parts(step, compute, exposed):
    return D.step_parts({"compute_s": compute, "exposed_s": exposed}, step, on_gpu=True)


def test_step_parts_split_the_step_and_name_what_grew():
    one, two = _parts(13.2e-3, 13.0e-3, 0.0), _parts(15.7e-3, 13.2e-3, 0.5e-3)
    assert math.isclose(two.idle_s, 2.0e-3) and math.isclose(one.idle_s, 0.2e-3)
    over = _parts(1e-3, 0.85e-3, 0.18e-3)  # the profiled steps a little busier than the timed one: separate runs
    assert over.idle_s == 0.0 and math.isclose(over.compute_s + over.exposed_s, 1e-3), "the parts fill the step"
    assert math.isclose(over.compute_s / over.exposed_s, 0.85 / 0.18), "in the profile's proportions"
    assert D.main_change(one, two).startswith("GPU idle")
    sentence = D.step_difference(one, two)
    assert sentence.startswith("the step is 2.50 ms longer") and "mostly GPU idle" in sentence
    assert sentence.index("GPU idle") < sentence.index("communication") < sentence.index("computation +")
    comm_bound = _parts(15.7e-3, 13.2e-3, 2.3e-3)
    assert D.main_change(one, comm_bound).startswith("communication")
    assert D.main_change(two, one).startswith("GPU idle"), "a shorter step: what shrank most"
    assert "shorter" in D.step_difference(two, one)
    # an earlier H200 run: 13.2 ms → 14.9 ms, with a profile 10% busier than the timed step: not split any more
    assert not _parts(14.9e-3, 13.62e-3, 2.72e-3).representative
    base, grown = _parts(13.2e-3, 12.5e-3, 0.0), _parts(14.9e-3, 13.62e-3, 1.6e-3)  # 2% over: split in proportion
    changes = [getattr(grown, k) - getattr(base, k) for k in ("compute_s", "exposed_s", "idle_s")]
    assert math.isclose(sum(changes), 14.9e-3 - 13.2e-3), "the parts' changes add up to the step's"
    assert "time between PyTorch's operators" in str(D.step_parts({"compute_s": 1.0, "exposed_s": 0.0}, 2.0,
                                                                    on_gpu=False))


def test_step_parts_not_shown_where_the_profile_does_not_fit_the_timed_step():
    busier = _parts(17.1e-3, 10.0e-3, 9.3e-3)  # busy 19.3 ms in a step of 17.1 ms: ranks out of step under the profiler
    assert not busier.representative and "not representative" in str(busier) and "split not shown" in str(busier)
    within = _parts(10e-3, 9.9e-3, 0.4e-3)  # 3% over: the profiler's own overhead, split in proportion
    assert within.representative and within.idle_s == 0.0
    # notebook 10's H200 run, DDP at 32 per GPU: ~9 ms exposed where 267.66 MiB at ~270 GB/s need ~1.04 ms
    waiting = D.step_parts({"compute_s": 6.0e-3, "exposed_s": 9.26e-3}, 17.1e-3, on_gpu=True, transfer_s=1.04e-3)
    assert not waiting.representative and "2×" in waiting.why
    fine = D.step_parts({"compute_s": 45.4e-3, "exposed_s": 0.244e-3}, 46.7e-3, on_gpu=True, transfer_s=1.04e-3)
    assert fine.representative and math.isclose(fine.idle_s, 46.7e-3 - 45.644e-3)
    assert D.step_parts({"compute_s": 1e-3, "exposed_s": 5e-3}, 10e-3, on_gpu=True, transfer_s=0.0).representative, \
        "no bytes on a link (one rank): not checked against them"
    base = _parts(19.4e-3, 12e-3, 0.1e-3)
    sentence = D.step_difference(base, waiting)
    assert sentence.startswith("the step is 2.30 ms shorter (19.4 ms → 17.1 ms); the 17.1 ms step's profile: the "
                               "profiled steps are not"), "names which of the two profiles did not fit"
    assert "the 17.1 ms step's profile" in D.step_difference(waiting, base), "the base's profile, named as well"
    assert "computation" not in sentence, "no split from a profile that does not fit"
    assert D.main_change(base, waiting) is None and D.main_change(waiting, base) is None
    assert D.main_change(base, fine) is not None


H200_ALLREDUCE_US = [35.8, 36.0, 38.5, 37.7, 38.7, 38.4, 39.3, 74.7, 248.9, 896.3, 3249.2]  # 1 KiB … 1 GiB, ×4


def _rows(times_us, first=1024):
    sizes = [first * 4**i for i in range(len(times_us))]
    return [{"bytes": b, "timing": {"median_s": t * 1e-6}, "alg_gbps": b / (t * 1e-6) / 1e9}
            for b, t in zip(sizes, times_us, strict=True)]


def test_allreduce_time_reads_the_row_of_the_bucket_size():
    rows = _rows(H200_ALLREDUCE_US)
    seconds, row = D.allreduce_time_s(rows, 280_657_216, 4)  # 4 buckets of ~67 MiB: the 64 MiB row
    assert row["bytes"] == 64 * 2**20 and math.isclose(seconds, 280_657_216 / row["alg_gbps"] / 1e9)
    assert D.allreduce_time_s(rows, 280_657_216, 268)[1]["bytes"] == 2**20, "1 MiB buckets: the 1 MiB row"
    assert D.allreduce_time_s(rows, 0, 4) == (0.0, None)
    with pytest.raises(ValueError):
        D.allreduce_time_s([], 1024)


def test_per_call_floor_tells_host_work_from_a_latency():
    host = D.per_call_floor(_rows(H200_ALLREDUCE_US))  # 4 MiB in 39.3 µs, not 35.8 µs + 12.7 µs at 330 GB/s
    assert host.startswith("35.8 µs for 1.00 KiB, at most twice that up to 4.00 MiB, which takes 39.3 µs: 9.19 µs less")
    assert "12.7 µs" in host and "host's time to issue each call" in host
    # a latency of 10 µs before each transfer at 10 GB/s: time = 10 µs + bytes / bandwidth, serial
    latency = D.per_call_floor(_rows([10 + 1024 * 4**i / 1e4 for i in range(6)]))
    assert "up to 64.00 KiB" in latency and "consistent with a fixed cost before each transfer" in latency
    assert "no flat region" in D.per_call_floor(_rows([10.0, 25.0, 80.0]))
    slower = D.per_call_floor(_rows([10.0, 12.0, 19.0, 30.0, 60.0]))  # 16 KiB: 19 µs > 10 µs + 3.75 µs
    assert "5.25 µs more than those 10.0 µs plus the 3.75 µs" in slower and "consistent with a fixed cost" not in slower
    assert "more than a fixed cost plus its transfer" in slower and "cannot isolate a fixed cost per call" in slower
    # within half its transfer above floor + transfer: still what a fixed cost before the transfer predicts
    near = D.per_call_floor(_rows([10.0, 12.0, 14.5, 30.0, 60.0]))  # 16 KiB: 14.5 µs ≈ 10 µs + 3.75 µs
    assert "consistent with a fixed cost before each transfer" in near
    assert "gloo" in D.per_call_floor(_rows(H200_ALLREDUCE_US), on_gpu=False)
    noisy = D.per_call_floor(_rows([415.0, 760.0, 329.0, 900.0, 2000.0]))  # gloo on 2 busy cores
    assert "less than the floor itself" in noisy and "cannot tell" in noisy and "But " not in noisy
    # the second 2 × H200 run: 1 MiB and 4 MiB faster than 1 KiB, so 16 MiB's 75 µs reads nothing about a latency
    dip = D.per_call_floor(_rows([44.1, 56.1, 51.7, 54.1, 61.3, 32.1, 33.9, 75.0, 250.3, 901.7, 3306.2]))
    assert "up to 16.00 MiB" in dip and "But 1.00 MiB took 32.1 µs, less than the floor itself" in dip
    assert "cannot tell" in dip and "consistent with a fixed cost" not in dip
    with pytest.raises(ValueError):
        D.per_call_floor(_rows([10.0]))


def _variant(step_ms_by_round, ranks=2, batch=4, seq=32, profile=None, allreduce_bytes=0):
    """A variant as scripts/ddp_train.py reports it, with one block per round."""
    times = [t / 1e3 for t in step_ms_by_round]
    timing = D.timing_to_dict(Timing("v", sorted(times)[len(times) // 2], 0.0, tuple(times), 1, "cuda:0"))
    return {"ranks": ranks, "batch": batch, "tokens_per_rank": batch * seq, "timing": timing, "profile": profile,
            "allreduce_bytes": allreduce_bytes}


def _launch(plain1, plain2, ddp1, ddp2, at=""):
    return {f"plain{at}:1": _variant(plain1, 1), f"plain{at}": _variant(plain2), f"ddp{at}:1": _variant(ddp1, 1),
            f"ddp{at}": _variant(ddp2)}


def test_compared_pairs_the_rounds_of_one_launch():
    runs = _launch([10, 11, 10.5, 10.2], [10.1, 11, 10.6, 10.2], [11, 12, 11.5, 11.2], [12, 13, 12.5, 12.2])
    c = D.compared(runs, {"DDP, 1": "ddp:1", "DDP, 2": "ddp"})
    assert c.variants == ["DDP, 1", "DDP, 2"] and c.baseline == "DDP, 1" and c.rounds == 4
    assert c.ratios("DDP, 2") == pytest.approx([11 / 12, 12 / 13, 11.5 / 12.5, 11.2 / 12.2])
    assert c.verdict().outcome == "slower", "every round: the drift cancels in the paired ratios"
    assert D.compared(runs, ["plain:1", "plain"]).variants == ["plain:1", "plain"], "a list shows the keys"
    with pytest.raises(KeyError, match="no_such"):
        D.compared(runs, ["ddp", "no_such"])


def _ladder(plain1, by_key):
    """Variants of scripts/ddp_train.py on 1, 2, …: 'plain:1' and every key of by_key ('ddp:4' → its rounds)."""
    return {"plain:1": _variant(plain1, 1), **{k: _variant(v, int(k.split(":")[1])) for k, v in by_key.items()}}


def test_scaling_is_a_ratio_of_throughputs_from_the_same_rounds():
    # a drifting clock: every variant's step moves with it, round by round
    drift = [0.0, 1.0, -0.2, 1.8, 0.2, 0.1]
    runs = _ladder([45.2 + d for d in drift], {"ddp:1": [46.0 + d for d in drift], "ddp:2": [46.7 + d for d in drift],
                                               "ddp:4": [48.0 + d for d in drift], "fsdp:2": [52.0 + d for d in drift],
                                               "fsdp:4": [55.0 + d for d in drift]})
    s = D.scaling(runs, [1, 2, 4])
    assert s.variants == ["plain, 1 GPU", "DDP, 1 GPU", "DDP, 2 GPUs", "DDP, 4 GPUs", "FSDP2, 2 GPUs", "FSDP2, 4 GPUs"]
    v = s.verdict("DDP, 4 GPUs")
    assert v.outcome == "faster" and v.speedup == pytest.approx(4 * 45.2 / 48.0, rel=0.01)
    assert s.time_s("DDP, 4 GPUs") == pytest.approx(s.time_s("plain, 1 GPU") / v.speedup), "one number per variant"
    assert s.rate("plain, 1 GPU") == pytest.approx(4 * 32 / 45.3e-3, rel=0.01), "tokens/s"
    assert D.efficiency(s, "DDP", 4).startswith(f"{v.speedup:.2f}× one GPU's tokens/s") and "efficiency 94%" in \
        D.efficiency(s, "DDP", 4)
    assert D.scaling(runs, [1, 2], kinds={"ddp": "DDP"}).variants == ["plain, 1 GPU", "DDP, 1 GPU", "DDP, 2 GPUs"]
    assert D.scaling(runs, [1, 2], unit="process").variants[2] == "DDP, 2 processes"
    with pytest.raises(ValueError, match="ran on"):
        D.scaling({**runs, "ddp:2": _variant([1.0] * 6, ranks=1)}, [1, 2])
    with pytest.raises(KeyError):
        D.scaling({"plain:1": runs["plain:1"]}, [1, 2])
    fig = D.scaling_figure(s, [1, 2, 4], title="t")
    assert [line.get_label() for line in fig.axes[0].get_lines()] == ["ideal (n×)", "DDP", "FSDP2"]


def test_shortfall_splits_the_efficiency_into_ddps_own_work_and_the_step_growth():
    # the H100 review: at 32 per GPU DDP's own host work on one GPU cost more than the second GPU brought
    runs = _ladder([20.0, 20.4, 19.8, 20.2, 20.1, 19.9], {"ddp:1": [26.0, 26.5, 25.8, 26.3, 26.1, 25.9],
                                                          "ddp:2": [26.2, 26.6, 26.0, 26.4, 26.2, 26.1]})
    text = D.shortfall(runs, 2)
    assert text.startswith("DDP's own work (DDP against the plain model on one GPU): the step 1.30× as long")
    assert "from one GPU to 2: no change beyond ±3%" in text, "the second GPU costs nothing: the loss is DDP's own"
    # the step grows from 1 to 2 GPUs: named with what moved in the profiles
    grows = _ladder([20.0] * 6, {"ddp:1": [20.2, 20.1, 20.3, 20.2, 20.2, 20.1],
                                 "ddp:2": [24.2, 24.1, 24.3, 24.2, 24.2, 24.1]})
    parts = {"ddp:1": D.StepParts(20.2e-3, 19e-3, 0.0, 1.2e-3, on_gpu=True),
             "ddp:2": D.StepParts(24.2e-3, 19.2e-3, 3.8e-3, 1.2e-3, on_gpu=True)}
    text = D.shortfall(grows, 2, parts=parts)
    assert "own work (DDP against the plain model on one GPU): no change beyond ±3%" in text
    assert "from one GPU to 2: the step 1.20× as long (" in text and "mostly communication not hidden" in text
    # not resolved, with profiles taken: said that they are not compared
    flat = D.shortfall(runs, 2, parts=parts)
    assert flat.endswith("no change beyond ±3% (nothing resolved for the profiles of DDP on 1 and n to explain: they "
                         "are not compared)"), flat
    assert not D.shortfall(runs, 2).endswith(")"), "no profiles: nothing said about them"
    # neither resolved nor a null: the step's ratio with its band, as every other inconclusive verdict
    noisy = _ladder([20.0] * 6, {"ddp:1": [20.0, 20.1, 19.9, 20.0, 20.1, 19.9],
                                 "ddp:2": [19.6, 21.6, 20.0, 21.2, 19.8, 21.0]})
    text = D.shortfall(noisy, 2)
    assert re.search(r"from one GPU to 2: the step 1\.0\d× as long, not resolved \(band 0\.9\d–1\.\d\d×\)$", text), text


def test_fsdp_against_ddp_gives_the_verdict_the_state_and_the_peaks():
    runs = _ladder([10.0] * 6, {"ddp:2": [10.0, 10.1, 9.9, 10.0, 10.2, 10.0], "fsdp:2": [12.0, 12.1, 11.9, 12.0,
                                                                                        12.2, 12.0]})
    verdict, memory, text = D.fsdp_against_ddp(runs, 2)
    assert verdict.outcome == "slower" and memory == {"state_ratio": None, "peak_ratio": None}
    assert text.startswith("FSDP2, 2 GPUs vs") and "measured on GPUs only" in text.splitlines()[1]
    runs["ddp:2"]["state_bytes"], runs["fsdp:2"]["state_bytes"] = {"total": 2 * 2**30}, {"total": 2**30}
    verdict, memory, text = D.fsdp_against_ddp(runs, 2)  # a CPU: the state, counted from the tensors, no peak
    assert memory == {"state_ratio": 0.5, "peak_ratio": None}
    assert "model state (parameters, gradients, AdamW) 1.00 GiB against 2.00 GiB (0.50×; 1/2 = 0.50)" in text
    runs["ddp:2"]["peak_bytes"], runs["fsdp:2"]["peak_bytes"] = 4 * 2**30, 3 * 2**30
    verdict, memory, text = D.fsdp_against_ddp(runs, 2)
    assert memory == {"state_ratio": 0.5, "peak_ratio": 0.75} and len(text.splitlines()) == 2
    assert "peak 3.00 GiB against 4.00 GiB (0.75×): the rest of the peak" in text
    assert "2.00 GiB with DDP and 2.00 GiB with FSDP2 (1.00×): about the same" in text, "what sharding left alone"


def _accumulation(sync_ms, no_sync_ms, *, grad_bytes=280e6, buckets=12):
    """The accumulation variants of scripts/ddp_train.py and its --check, all-reducing 4 micro-batches or 1."""
    runs = {"accum_sync": _variant(sync_ms, allreduce_bytes=4 * grad_bytes),
            "accum_no_sync": _variant(no_sync_ms, allreduce_bytes=grad_bytes)}
    check = {"grad_bytes": grad_bytes, "accumulation": {"no_sync": {"allreduce_calls": buckets}}}
    return runs, check


def test_no_sync_effect_gives_the_reason_of_the_outcome_it_has():
    rows = [{"bytes": 2**24, "alg_gbps": 200.0}, {"bytes": 2**26, "alg_gbps": 250.0}]  # 24 MB buckets: 200 GB/s
    # 3 × 280 MB skipped at 200 GB/s: 4.2 ms, 6% of a 70 ms step — not seen in the step: hidden by backward
    runs, check = _accumulation([70.0, 70.5, 69.8, 70.2, 70.1, 69.9], [70.1, 70.4, 69.9, 70.2, 70.0, 70.0])
    comparison, text = D.no_sync_effect(runs, check, rows, title="t")
    assert comparison.variants == ["all-reduce every micro-batch", "no_sync but the last"]
    assert comparison.verdict().outcome == "same"
    assert "it skips 36 all-reduces" in text and "4.20 ms at the bandwidth measured for 16.00 MiB messages" in text
    assert "6% of the 70.0 ms step" in text and "hid them" in text
    # the same outcome with a skipped time within the resolution: too little to show, nothing hidden
    small_runs, small_check = _accumulation([70.0, 70.5, 69.8, 70.2, 70.1, 69.9], [70.1, 70.4, 69.9, 70.2, 70.0, 70.0],
                                            grad_bytes=28e6)
    small = D.no_sync_effect(small_runs, small_check, rows)[1]
    assert "too little to resolve" in small and "hid" not in small
    # faster: the skipped time is the reason
    fast_runs, fast_check = _accumulation([70.0, 70.5, 69.8, 70.2, 70.1, 69.9], [66.0, 66.4, 65.9, 66.2, 66.0, 66.0])
    fast = D.no_sync_effect(fast_runs, fast_check, rows)[1]
    assert "faster" in fast and "it skips 36 all-reduces" in fast and "hid" not in fast
    assert "more than that" not in fast, "a 6% gain, band 5.4–6.4%: what 6% of skipped all-reduces explains"
    beyond = D.no_sync_effect(*_accumulation([70.0, 70.5, 69.8, 70.2, 70.1, 69.9], [56.0, 56.4, 55.9, 56.2, 56.0,
                                                                                    56.0]), rows)[1]
    assert "the step gained 20%, more than that" in beyond, "the skipped calls cost more than their transfer"
    # the 4 × H200 run: a median gain twice the skipped transfer's, the band's low end below it — the rest is unnamed
    wide = D.no_sync_effect(*_accumulation([70.0, 70.5, 69.8, 70.2, 70.1, 69.9], [60.0, 66.9, 60.2, 66.8, 60.1,
                                                                                  60.0]), rows)[1]
    assert "the step saved 9.78 ms, more than their transfer's at most 4.20 ms: the rest would be DDP's work" \
        in wide and "more than that" not in wide, wide
    assert "more than their transfer's" not in fast, "a saving the transfer explains needs no remainder"
    # inconclusive: what was at stake, no cause
    noisy_runs, noisy_check = _accumulation([70.0, 80.0, 60.0, 75.0, 65.0, 70.0], [75.0, 65.0, 70.0, 60.0, 80.0, 70.0])
    noisy = D.no_sync_effect(noisy_runs, noisy_check, rows)[1]
    assert "inconclusive" in noisy or "could not resolve" in noisy
    assert "at stake: it skips 36 all-reduces" in noisy and "saved" not in noisy, "the median saved nothing"
    # the 4 × H200 run of read r10: inconclusive, its median saving 3× the transfer — the rest is named, not implied
    # to be impossible by an "at stake" smaller than the saving
    unresolved = D.no_sync_effect(*_accumulation([70.0, 70.5, 69.8, 70.2, 70.1, 69.9, 70.0, 70.3, 69.9, 70.1],
                                                 [59.0, 71.0, 59.5, 70.8, 59.2, 70.6, 59.1, 70.9, 59.3, 70.7]),
                                  rows)[1]
    assert "could not resolve" in unresolved, unresolved
    assert "at stake: it skips 36 all-reduces" in unresolved
    assert "the median saved" in unresolved and "more than their transfer's at most 4.20 ms" in unresolved


def test_checkpoint_rows_and_placement():
    saved = {"ranks": 2, "losses": [6.3, 6.2, 6.1, 6.0]}
    resumed = {"two nodes": [{"resume": {"ranks": 4, "losses": [6.1, 6.0000004]}}],
               "one node": [{"resume": {"ranks": 4, "losses": [6.1000002, 6.0]}}] * 2}
    rows, worst = D.checkpoint_rows(saved, resumed)
    assert worst == pytest.approx(4e-7, rel=1e-3) and len(rows) == 4
    assert rows[0]["step 3"] == "6.100000" and rows[1]["run"] == "resumed on 4, two nodes"
    assert rows[3]["run"] == "resumed on 4, one node (launch 2)"
    placement = [{"rank": r, "node": r // 2, "local_rank": r % 2, "gpu": str(r)} for r in (3, 0, 1, 2)]
    assert D.placement_text(placement) == "node 0: ranks 0, 1 on GPUs 0, 1 · node 1: ranks 2, 3 on GPUs 2, 3"
    assert D.placement_text([{"rank": 0, "node": 0, "local_rank": 0, "gpu": "cpu"}]) == "node 0: rank 0 on the CPU"


def test_step_verdict_gives_the_reason_of_the_outcome_it_has():
    from utils.bench import verdict_from_ratios

    base, longer = _parts(13.2e-3, 13.0e-3, 0.0), _parts(15.7e-3, 13.2e-3, 0.5e-3)
    slower = verdict_from_ratios("B", "A", [0.84, 0.85, 0.83, 0.84, 0.86, 0.84])
    text = D.step_verdict(slower, base, longer, acts_on=("the exposed communication", 0.1e-3))
    assert text.startswith("B vs A: 1.19× slower") and "— the step is 2.50 ms longer" in text
    assert "mostly GPU idle" in text
    faster = verdict_from_ratios("A", "B", [1.18, 1.19, 1.2, 1.19, 1.18, 1.19])
    assert "the step is 2.50 ms shorter" in D.step_verdict(faster, longer, base)
    assert D.step_verdict(faster, base, longer) == str(faster), "splits that moved the other way: no reason"
    same = verdict_from_ratios("B", "A", [1.0, 1.01, 0.99, 1.0, 1.005, 0.995])
    bound = D.step_verdict(same, base, longer, acts_on=("DDP's own work", 0.2e-3))
    assert bound.endswith("— it acts on DDP's own work: 200 µs per step, 2% of the step")
    big = D.step_verdict(same, base, longer, acts_on=("DDP's own work", 2e-3))
    assert big.endswith("within the noise: no part is named as its cause"), "a bound that cannot explain it"
    unsure = verdict_from_ratios("B", "A", [0.8, 1.2, 0.9, 1.1, 0.85, 1.15])
    assert D.step_verdict(unsure, base, longer, acts_on=("DDP's own work", 2e-3)).endswith("15% of the step")
    assert "mostly" not in D.step_verdict(unsure, base, longer)
    assert D.step_verdict(same) == str(same)


def test_parts_of_splits_every_profiled_variant_and_counts_its_calls():
    profile = {"compute_s": 8e-3, "exposed_s": 1e-3, "comm_calls_per_step": 4.0}
    runs = {"ddp": _variant([10.0, 10.0], profile=profile, allreduce_bytes=4 << 20),
            "bucket_1mb": _variant([11.0, 11.0], profile={**profile, "comm_calls_per_step": 16.0},
                                   allreduce_bytes=4 << 20),
            "plain": _variant([9.0, 9.0]), "parameters": 1234}
    parts = D.parts_of(runs, _rows(H200_ALLREDUCE_US), on_gpu=True)
    assert set(parts) == {"ddp", "bucket_1mb"} and math.isclose(parts["ddp"].idle_s, 1e-3)
    assert not parts["ddp"].representative, "1 ms exposed where 4 MiB need ~13 µs: waiting, not transfer"
    assert D.parts_of(runs, on_gpu=True)["ddp"].representative, "without rows: not checked against the link"
    split = D.parts_of(runs, on_gpu=True)
    assert D.step_difference(split["ddp"], split["bucket_1mb"]).endswith(
        "; 16 communication calls per step instead of 4")
    on_cpu = D.parts_of(runs, on_gpu=False)
    assert "communication calls" not in D.step_difference(on_cpu["ddp"], on_cpu["bucket_1mb"]), "gloo: unseen"


def test_bus_rate_records_the_largest_message_with_its_band():
    row = {"bytes": 1 << 30, "bus_gbps": 330.0, "alg_gbps": 330.0,
           "timing": D.timing_to_dict(Timing("1 GiB", 3.25e-3, 0.1e-3, (3.2e-3, 3.25e-3, 3.3e-3), 1, "cuda:0"))}
    rate = D.bus_rate(row)
    assert rate.value == 330.0 and rate.unit == "GB/s" and "1.00 GiB" in rate.name
    from utils import results

    rate.record("allreduce_busbw_gbps_test", limit=450.0, limit_name="link spec")
    result = results.RECORDED.pop("allreduce_busbw_gbps_test")
    assert result.band[0] < 330.0 < result.band[1] and round(result.percent_of_limit) == 73


def test_too_big_model_is_sized_from_the_gpus_memory():
    import importlib.util

    spec = importlib.util.spec_from_file_location("fsdp_train", D.SCRIPTS_DIR / "fsdp_train.py")
    fsdp_train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fsdp_train)  # the script's main() runs only as __main__
    gib = 2**30
    names = {total: (fsdp_train.too_big_choice(total * gib) or ("none",))[0] for total in (139.8, 79.2, 15.6, 7.6, 3.7)}
    assert names == {139.8: "xl", 79.2: "xl", 15.6: "large", 7.6: "large", 3.7: "none"}
    name, params, budget = fsdp_train.too_big_choice(139.8 * gib)
    assert params == 607_716_176 and budget == fsdp_train.BUDGET_BYTES_PER_PARAM * params
    assert budget / (139.8 * gib) <= fsdp_train.TOO_BIG_SHARE, "a memory fraction the allocator accepts"


def test_batch_for_memory_picks_the_largest_that_fits():
    gib = 2**30
    pick = lambda total: D.batch_for_memory(total * gib, fixed_bytes=1.6 * gib, per_item_bytes=0.16 * gib)  # noqa: E731
    assert [pick(t) for t in (141, 80, 40, 24, 20, 8)] == [128, 128, 64, 64, 32, 32]
    with pytest.raises(ValueError):
        D.batch_for_memory(0, fixed_bytes=1, per_item_bytes=1)


NCCL_LINES = [
    "vm:3762:3762 [0] NCCL INFO NCCL version 2.28.9+cuda13.0",
    "vm:3763:3763 [1] NCCL INFO NCCL version 2.28.9+cuda13.0",
    "vm:3763:3763 [1] NCCL INFO NCCL_NVLS_ENABLE set by environment to 0.",
    "vm:3762:3762 [0] NCCL INFO NCCL_NVLS_ENABLE set by environment to 0.",
    "vm:3762:3762 [0] NCCL INFO comm 0x5581 rank 0 nRanks 2 nNodes 1 localRanks 2 localRank 0 MNNVL 0",
    "vm:3763:3763 [1] NCCL INFO Channel 00/0 : 1[1] -> 0[0] via P2P/CUMEM",
    "vm:3763:3763 [1] NCCL INFO Channel 01/0 : 1[1] -> 0[0] via P2P/CUMEM",
    "vm:3762:3762 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM",
    "vm:3762:3762 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/CUMEM",
    "vm:3762:3762 [0] NCCL INFO 32 coll channels, 32 collnet channels, 0 nvls channels, 32 p2p channels",
    "vm:3763:3763 [1] NCCL INFO 32 coll channels, 32 collnet channels, 0 nvls channels, 32 p2p channels",
    "✅ all_reduce(SUM) over 2 ranks (nccl) equals the sum computed locally",
    "vm:3763:3763 [1] NCCL WARN something went wrong",
]


def test_nccl_digest_keeps_each_telling_line_once_and_both_directions():
    digest = D.NcclDigest()
    shown = [line for line in NCCL_LINES if digest(line)]
    assert shown == [NCCL_LINES[i] for i in (0, 2, 5, 7, 9, 11, 12)]
    assert digest.kept == [NCCL_LINES[i] for i in (0, 2, 5, 7, 9)]


def test_interleaved_bench_builds_every_variant_every_round_in_rotating_order(monkeypatch):
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ctx = D.Context(0, 1, 0, torch.device("cpu"), "gloo")
        order = []

        def builder(label, seconds):
            def build():
                order.append(label)
                return lambda: time.sleep(seconds)
            return build

        measured = []

        def measure(label, step, timing):
            measured.append((label, len(order), timing.label))
            return {"label": label}

        timings, extras = D.interleaved_bench(
            {"a": builder("a", 1e-3), "b": builder("b", 3e-3), "c": builder("c", 1e-3)}, ctx, rounds=4, warmup=1,
            block_s={"a": 0.01, "b": 0.01, "c": 0.03}, measure=measure)
        rounds = ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
        assert order == rounds + ["a", "b", "c"], "rotated every round, then built once more to be measured"
        assert measured == [("a", 13, "a"), ("b", 14, "b"), ("c", 15, "c")], "after every round, with its timing"
        assert extras["b"] == {"label": "b"}
        assert all(len(t.block_times_s) == 4 and t.calls_per_block >= 1 for t in timings.values())
        assert timings["b"].median_s > timings["a"].median_s
        assert timings["c"].calls_per_block > 2 * timings["a"].calls_per_block, "its own, longer block"
        with pytest.raises(ValueError):
            D.interleaved_bench({}, ctx)
        with pytest.raises(ValueError, match="every label"):
            D.interleaved_bench({"a": builder("a", 1e-3)}, ctx, block_s={"b": 0.01})
        from utils import profile

        monkeypatch.setattr(profile, "_SESSIONS", ["a test's profile"])
        with pytest.raises(profile.ProfiledProcessError):
            D.interleaved_bench({"a": builder("a", 1e-3)}, ctx)
        with pytest.raises(profile.ProfiledProcessError):
            D.collective_bench(lambda: None, ctx, label="x")
    finally:
        if created:
            dist.destroy_process_group()


TOPOLOGY = """\
\t\x1b[4mGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m
GPU0\t X \tNV18\tSYS\t0-47\t0\t\tN/A
GPU1\tNV18\t X \tSYS\t0-47\t0\t\tN/A
NIC0\tSYS\tSYS\t X \t\t\t\t

Legend:
  NV#  = Connection traversing a bonded set of # NVLinks
"""


def test_link_between_and_its_spec():
    assert D.link_between(TOPOLOGY, 0, 1) == "NV18" and D.link_between(TOPOLOGY, 1, 0) == "NV18"
    assert D.link_between(TOPOLOGY, 0, 3) is None and D.link_between("garbage", 0, 1) is None
    assert D.link_spec_gbps("NV18", (9, 0))[0] == 450.0  # H100/H200 SXM: 900 GB/s bidirectional
    assert D.link_spec_gbps("NV12", (8, 0))[0] == 300.0  # A100 SXM: 600 GB/s bidirectional
    assert D.link_spec_gbps("NV4", (8, 6)) == (56.25, "4 NVLinks × 14.0625 GB/s per direction")  # RTX 3090 bridge
    spec, what = D.link_spec_gbps("NV4", (8, 9))  # no rate known for this GPU: none rather than a wrong one
    assert spec is None and "unknown" in what and "sm_89" in what
    assert D.link_spec_gbps("PIX", (8, 9), 31.5)[0] == 31.5
    assert D.link_spec_gbps("SYS", (8, 9))[0] is None and D.link_spec_gbps(None, (9, 0))[0] is None


TOPOLOGY_4 = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity
GPU0\t X \tNV18\tNV18\tNV18\t0-63
GPU1\tNV18\t X \tNV18\tNV18\t0-63
GPU2\tNV18\tNV18\t X \tNV18\t0-63
GPU3\tNV18\tNV18\tNV18\t X \t0-63
"""


def test_ring_link_spec_is_the_slowest_link_among_the_gpus():
    assert D.ring_link_spec(TOPOLOGY, 2, (9, 0)) == (450.0, "GPU0 ↔ GPU1: NV18 — 18 NVLinks × 25 GB/s per direction")
    spec, what = D.ring_link_spec(TOPOLOGY_4, 4, (9, 0))
    assert spec == 450.0
    assert what.startswith("GPUs 0–3, every pair NV18 (through a switch: 18 × 3 peers is more than the 18 links a "
                           "GPU has"), what
    # HGX A100 4-GPU: NV4 straight to each of 3 peers is 12 links, all an A100 has: direct, and rings use them all
    direct = TOPOLOGY_4.replace("NV18", "NV4")
    assert D.ring_link_spec(direct, 4, (8, 0)) == (300.0, "GPUs 0–3, every pair NV4 (direct links: 4 to each of 3 "
                                                          "peers) — 12 NVLinks × 25 GB/s per direction, per GPU")
    assert "unknown here" in D.ring_link_spec(direct, 4, (8, 9))[1] or D.ring_link_spec(direct, 4, (8, 9))[0] is None
    mixed = TOPOLOGY_4.replace("GPU2\tNV18\tNV18", "GPU2\tNV18\tPIX").replace("GPU1\tNV18\t X \tNV18",
                                                                              "GPU1\tNV18\t X \tPIX")
    assert D.ring_link_spec(mixed, 4, (9, 0), 63.0) == (63.0, "slowest pair GPU1 ↔ GPU2: PIX — PCIe, through at most "
                                                              "one PCIe bridge; bounded by each GPU's PCIe link, "
                                                              "63.0 GB/s per direction")
    spec, what = D.ring_link_spec(mixed, 4, (9, 0))
    assert spec is None and what.startswith("GPU1 ↔ GPU2: PIX"), "a link of unknown rate: no spec, and which"
    assert D.ring_link_spec(None, 4, (9, 0))[0] is None and D.ring_link_spec(TOPOLOGY, 1, (9, 0))[0] is None
    # nvidia-smi shows the whole machine: a process given GPUs 2 and 3 reads their rows, not GPU0 ↔ GPU1's
    assert D.ring_link_spec(mixed, 2, (9, 0), 63.0, visible="2,3") == (450.0, "GPU2 ↔ GPU3: NV18 — 18 NVLinks × "
                                                                             "25 GB/s per direction")
    assert D.ring_link_spec(mixed, 2, (9, 0), 63.0, visible="1,2")[1].startswith("GPU1 ↔ GPU2: PIX")
    assert D.ring_link_spec(TOPOLOGY, 2, (9, 0), visible="GPU-uuid-a,GPU-uuid-b")[1].startswith("GPU0 ↔ GPU1")


def test_allreduce_rows_and_figure_show_both_bandwidths():
    def sweep(n, bus):
        factor = D.allreduce_bus_factor(n)
        return {"ranks": n, "rows": [{"bytes": b, "alg_gbps": g / factor, "bus_gbps": g, "timing": D.timing_to_dict(
            Timing("x", b / (g / factor) / 1e9, 0.0, (b / (g / factor) / 1e9,) * 2, 1, "cuda:0"))}
            for b, g in ((1 << 20, bus / 4), (1 << 30, bus))]}

    sweeps = [sweep(2, 360.0), sweep(4, 330.0)]
    rows = D.allreduce_rows(sweeps, 450.0)
    assert [r["GPUs"] for r in rows] == [2, 4] and rows[1]["bus / algorithm"] == "1.5"
    assert rows[1]["bus GB/s"] == "330" and rows[1]["algorithm GB/s"] == "220" and rows[1]["% of link spec"] == "73%"
    assert D.allreduce_rows(sweeps)[0]["% of link spec"] == "—"
    fig = D.allreduce_figure(sweeps, spec_gbps=450.0, title="t")
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    assert lines["bus, 4 ranks"].get_linestyle() == "-" and lines["algorithm, 4 ranks"].get_linestyle() == "--"
    assert lines["bus, 4 ranks"].get_color() == lines["algorithm, 4 ranks"].get_color() != lines["bus, 2 ranks"] \
        .get_color()
    assert "link spec (450 GB/s)" in lines


def test_gpu_topology_is_plain_text(monkeypatch):
    monkeypatch.setattr(D.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(D.subprocess, "run", lambda *a, **k: SimpleNamespace(stdout=TOPOLOGY, returncode=0))
    topology = D.gpu_topology()
    assert "\x1b" not in topology and topology.splitlines()[0].split()[:2] == ["GPU0", "GPU1"]
    assert D.link_between(topology, 0, 1) == "NV18"
    monkeypatch.setattr(D.shutil, "which", lambda name: None)
    assert D.gpu_topology() is None


def test_peak_beyond_state_says_what_the_amounts_say():
    gib = 2**30

    def run(state, peak):
        return {"state_bytes": {"total": state * gib}, "peak_bytes": peak * gib}

    # notebook 10's H200 run: DDP 3.03 GiB of state in a 5.53 GiB peak, FSDP2 1.51 GiB in 2.72 GiB
    sentence = D.peak_beyond_state(run(3.03, 5.53), run(1.51, 2.72))
    assert "2.50 GiB with DDP and 1.21 GiB with FSDP2 (0.48×)" in sentence and "smaller too" in sentence
    assert "about the same" in D.peak_beyond_state(run(3.0, 5.5), run(1.5, 4.0))
    assert "larger" in D.peak_beyond_state(run(3.0, 5.5), run(1.5, 5.0))
    with pytest.raises(ValueError, match="measured"):
        D.peak_beyond_state({"state_bytes": {"total": 1}, "peak_bytes": None}, run(1.5, 2.7))


def test_native_bf16():
    assert not D.native_bf16(torch.device("cpu"))
    if torch.cuda.is_available():
        cc = torch.cuda.get_device_capability(0)
        assert D.native_bf16(torch.device("cuda", 0)) == (cc >= (8, 0))


def test_model_state_bytes_counts_parameters_gradients_and_adam():
    model = torch.nn.Linear(10, 10)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 10)).sum().backward()
    optimizer.step()
    state = D.model_state_bytes(model, optimizer)
    assert state["parameters"] == state["gradients"] == 110 * 4 and state["optimizer"] == 2 * 110 * 4
    assert state["total"] == 4 * 110 * 4


# ── The real scripts, 2 gloo processes on the CPU ───────────────────────────────────────────────────────────

# A guard against a hang, not a speed check: the DDP script takes 7 s alone on 2 cores, but over 60 s under
# `pytest -n 8` on a 16-core GPU machine (H100), where its timed variants share the cores with 8 test workers.
SCRIPT_TIMEOUT_S = 240


def test_allreduce_script_checks_and_times(capsys):
    run = D.launch("allreduce_bench.py", 2, timeout_s=SCRIPT_TIMEOUT_S,
                   args=[*CPU, "--min-bytes", 1024, "--max-bytes", 65536, "--min-run-s", 0.02])
    assert any("✅ all_reduce(SUM) over 2 ranks" in line for line in run.lines)
    assert "✅ all_reduce(SUM)" in capsys.readouterr().out, "the output is streamed"
    assert [s["ranks"] for s in run.result["sweeps"]] == [2], "2, 4, … up to the world size"
    rows = run.result["rows"]
    assert rows == run.result["sweeps"][-1]["rows"] and [r["bytes"] for r in rows] == [1024, 4096, 16384, 65536]
    assert all(r["bus_gbps"] == r["alg_gbps"] > 0 for r in rows)  # 2 ranks: bus = algorithm bandwidth


def test_ddp_script_equals_one_process_and_no_sync_accumulates():
    run = D.launch("ddp_train.py", 2, timeout_s=SCRIPT_TIMEOUT_S, echo=False,
                   args=[*CPU, "--check", "--variants", "ddp,accum_no_sync,plain@2,ddp@2:1,fsdp:2", "--min-run-s", 0.05,
                         "--rounds", 2, "--profile", "ddp,ddp@2:1"])
    check = run.result["check"]
    assert check["grad_err"] < 1e-4 and check["weight_err"] < 1e-4
    sync, skip = check["accumulation"]["sync_every_micro_batch"], check["accumulation"]["no_sync"]
    assert skip["allreduce_calls"] < sync["allreduce_calls"] and skip["grad_err"] < 1e-4
    # counted after a first step: the whole gradient once with no_sync, once per micro-batch without
    assert skip["allreduce_bytes"] == check["grad_bytes"] and sync["allreduce_bytes"] == 2 * check["grad_bytes"]
    variants = run.result["variants"]
    assert set(variants) == {"ddp", "accum_no_sync", "plain@2", "ddp@2:1", "fsdp:2"}
    assert variants["plain@2"]["batch"] == 2 and variants["ddp"]["batch"] == 4
    assert [variants[v]["ranks"] for v in ("ddp", "ddp@2:1", "fsdp:2")] == [2, 1, 2], "':1': the first rank alone"
    assert variants["ddp@2:1"]["tokens_per_rank"] == 2 * run.result["seq"]
    assert len(variants["ddp"]["timing"]["block_times_s"]) == 2, "one block per round"
    assert variants["ddp"]["profile"]["compute_s"] > 0 and variants["accum_no_sync"]["profile"] is None
    assert variants["ddp@2:1"]["profile"]["compute_s"] > 0, "rank 0 profiled DDP in its group of one"
    grad = run.result["grad_bytes"]
    assert [variants[v]["allreduce_bytes"] for v in ("ddp", "accum_no_sync", "plain@2", "ddp@2:1", "fsdp:2")] == [
        grad, grad, 0, 0, 0]
    assert D.compared(variants, ["ddp@2:1", "ddp"]).rounds == 2
    assert run.result["amp"] == "fp32", "a CPU trains every variant in fp32"
    state = {v: variants[v]["state_bytes"]["total"] for v in ("ddp", "fsdp:2", "plain@2")}
    assert state["ddp"] == state["plain@2"] > 0 and state["fsdp:2"] <= 0.55 * state["ddp"], "FSDP2 holds its shards"


def test_fsdp_on_fewer_ranks_than_the_launch():
    """fsdp:2 of a 3-process launch: FSDP2 over a device mesh of the first two ranks while the third idles."""
    run = D.launch("ddp_train.py", 3, timeout_s=SCRIPT_TIMEOUT_S, echo=False,
                   args=[*CPU, "--variants", "plain:1,fsdp:2,ddp:3", "--min-run-s", 0.05, "--rounds", 2,
                         "--profile", ""])
    assert [run.result["variants"][v]["ranks"] for v in ("plain:1", "fsdp:2", "ddp:3")] == [1, 2, 3]
    assert D.scaling(run.result["variants"], [1, 2, 3], unit="process").variants == [
        "plain, 1 process", "DDP, 3 processes", "FSDP2, 2 processes"]


@pytest.mark.parametrize("variants", ["ddp,no_such_thing", "ddp:2", "ddp:x"])
def test_ddp_script_rejects_unknown_variants(variants):
    with pytest.raises(D.LaunchError):
        D.launch("ddp_train.py", 1, timeout_s=SCRIPT_TIMEOUT_S, echo=False, args=[*CPU, "--variants", variants])


def test_fsdp_script_measures_memory_against_ddp(tmp_path):
    """With --bf16: the GPUs' code path (DDP under bf16 autocast, FSDP2 with a bf16 MixedPrecisionPolicy)."""
    run = D.launch("fsdp_train.py", 2, timeout_s=SCRIPT_TIMEOUT_S, echo=False,
                   args=[*CPU, "--phases", "memory,too_big", "--min-run-s", 0.05, "--bf16"])
    mem = run.result["memory"]
    assert mem["fsdp"]["state_bytes"]["total"] <= 0.55 * mem["ddp"]["state_bytes"]["total"]
    assert D.compared(mem, {"DDP": "ddp", "FSDP2": "fsdp"}).rounds == mem["rounds"] == 4, "alternating rounds"
    assert mem["parameters"] > 0 and all(mem[k]["profile"]["compute_s"] > 0 for k in ("ddp", "fsdp"))
    assert run.result["too_big"] is None  # GPU only


def test_a_checkpoint_saved_on_one_rank_resumes_on_two_nodes(tmp_path):
    """Resharding: saved by 1 process, loaded by 2 launched as two torchrun agents at a c10d rendezvous; the losses
    of steps 3-4 are the saving run's."""
    common = [*CPU, "--checkpoint-dir", tmp_path / "ckpt", "--global-batch", 4]
    saved = D.launch("fsdp_train.py", 1, timeout_s=SCRIPT_TIMEOUT_S, echo=False,
                     args=[*common, "--phases", "save"]).result["save"]
    assert saved["ranks"] == 1 and len(saved["losses"]) == 4
    assert any(name == ".metadata" for name, _ in saved["files"]) and len(saved["files"]) == 2, "one shard file"
    run = D.launch_nodes("fsdp_train.py", [1, 1], timeout_s=SCRIPT_TIMEOUT_S,
                         args=[*common, "--phases", "resume", "--time-batch", 2, "--min-run-s", 0.05])
    assert any(line.startswith("[node ") and "losses of steps 3–4" in line for line in run.lines)
    resumed = run.result["resume"]
    assert resumed["ranks"] == 2
    torch.testing.assert_close(resumed["losses"], saved["losses"][2:], rtol=1e-5, atol=1e-6)
    assert sorted(p["node"] for p in run.result["placement"]) == [0, 1], "one rank on each node"
    assert run.result["timed"]["timing"]["median_s"] > 0 and run.result["timed"]["amp"] == "fp32"


def test_launch_nodes_rejects_bad_arguments():
    with pytest.raises(ValueError, match="2 or more nodes"):
        D.launch_nodes("fsdp_train.py", [2])
    with pytest.raises(ValueError, match="2 or more nodes"):
        D.launch_nodes("fsdp_train.py", [1, 1], devices=["0"])


def test_timeout_demo_refuses_a_failure_before_the_all_reduce(monkeypatch):
    """A run that fails while its processes start (e.g. joining the group on a busy machine) did not fail on the
    mismatched collective's timeout, even when its message says 'timed out'."""
    def fails_at_start(*args, echo, **kwargs):
        echo("[rank 1] something else")
        raise D.LaunchError("mismatched_collective.py with 2 processes failed (exit code 1): timed out connecting",
                            returncode=1, lines=[])
    monkeypatch.setattr(D, "launch", fails_at_start)
    with pytest.raises(AssertionError, match="before rank 0 called the all-reduce"):
        D.timeout_demo("cpu", 2, collective_timeout_s=2)


def test_launch_nodes_starts_again_when_the_rendezvous_port_was_taken(monkeypatch):
    endpoints = []

    def supervise(path, nproc, agents, *, timeout_s, echo):
        commands = agents("result.json")
        endpoints.append(next(a for a in commands[0][0] if a.startswith("--rdzv-endpoint=")))
        assert [c[0][-2:] for c in commands] == [["--result", "result.json"]] * 2
        if len(endpoints) == 1:
            raise D.LaunchError("failed", returncode=1, lines=[
                "[node 0] torch.distributed.DistNetworkError: The server socket has failed to listen on any local "
                "network address. port: 29400, useIpv6: false, code: -98, name: EADDRINUSE, message: address already "
                "in use"])
        return "launched"

    monkeypatch.setattr(D, "_supervise", supervise)
    assert D.launch_nodes("fsdp_train.py", [1, 1]) == "launched" and len(endpoints) == 2
    assert D.port_taken(["... address already in use"]) and not D.port_taken(["Timed out waiting 2000ms"])

    def fails(path, nproc, agents, *, timeout_s, echo):
        raise D.LaunchError("failed", returncode=1, lines=["RuntimeError: something else"])
    monkeypatch.setattr(D, "_supervise", fails)
    with pytest.raises(D.LaunchError):  # any other failure: no second launch
        D.launch_nodes("fsdp_train.py", [1, 1])


def test_timeout_demo_names_the_timeout():
    text = D.timeout_demo("cpu", 2, collective_timeout_s=2, deadline_s=60)
    assert text.startswith("the launch failed ") and "after rank 0 called the all-reduce" in text
    assert "imed out" in text or "imeout" in text


def test_a_mismatched_collective_fails_with_the_timeout_instead_of_hanging():
    start = time.perf_counter()
    with pytest.raises(D.LaunchError, match="[Tt]imed out|[Tt]imeout") as err:
        D.launch("mismatched_collective.py", 2, timeout_s=60, echo=False,
                 args=["--device", "cpu", "--timeout-s", 2])
    assert not isinstance(err.value, D.LaunchTimeout), "the collective's timeout, not the launcher's deadline"
    assert time.perf_counter() - start < 45


def _processes_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to find left-over processes")
def test_the_deadline_kills_every_process_of_the_run():
    marker = "987.654"  # a collective timeout no other run uses: finds this run's processes in /proc
    start = time.perf_counter()
    with pytest.raises(D.LaunchTimeout, match="did not finish within 8 s"):
        D.launch("mismatched_collective.py", 2, timeout_s=8, echo=False,
                 args=["--device", "cpu", "--timeout-s", marker])
    assert time.perf_counter() - start < 25
    time.sleep(0.5)
    assert _processes_with(marker) == [], "processes of the killed run are still alive"


# ── On two GPUs (the reference machine's GPU test run) ──────────────────────────────────────────────────────


@needs_two_gpus
def test_topology_of_this_machine_names_the_link():
    topology = D.gpu_topology()
    assert topology is not None, "nvidia-smi topo -m gave nothing"
    link = D.link_between(topology, 0, 1)
    assert link is not None, f"no GPU0-GPU1 entry found in:\n{topology}"
    spec, what = D.link_spec_gbps(link, torch.cuda.get_device_capability(0))
    assert what


@needs_two_gpus
def test_allreduce_script_on_every_gpu():
    gpus = torch.cuda.device_count()
    run = D.launch("allreduce_bench.py", gpus, timeout_s=180, echo=False,
                   args=["--device", "cuda", "--timeout-s", 60, "--max-bytes", 1 << 26, "--min-run-s", 0.05])
    assert run.result["backend"] == "nccl" and run.result["rows"][-1]["bus_gbps"] > 1.0
    assert [s["ranks"] for s in run.result["sweeps"]] == [n for n in D.gpu_counts(gpus) if n > 1]


@needs_two_gpus
def test_ddp_script_on_two_gpus():
    run = D.launch("ddp_train.py", 2, timeout_s=300, echo=False,
                   args=["--device", "cuda", "--timeout-s", 60, "--check", "--variants",
                         "ddp,bucket_1mb,ddp:1,plain:1,fsdp:2",
                         "--min-run-s", 0.2, "--rounds", 2, "--profile-trace", "/tmp/course_ddp_trace.json"])
    assert run.result["check"]["grad_err"] < 1e-4 and run.result["backend"] == "nccl"
    alone = run.result["variants"]["ddp:1"]  # DDP in an NCCL group of rank 0 alone, GPU 1 idle meanwhile
    assert alone["ranks"] == 1 and alone["profile"]["compute_s"] > 0 and alone["peak_bytes"] > 0
    profiles = {v: e["profile"] for v, e in run.result["variants"].items()}
    assert profiles["ddp"]["comm_s"] > 0, "the profile shows NCCL kernels"
    assert profiles["bucket_1mb"]["comm_calls_per_step"] > profiles["ddp"]["comm_calls_per_step"] >= 1


@needs_two_gpus
def test_fsdp_script_on_two_gpus(tmp_path):
    run = D.launch("fsdp_train.py", 2, timeout_s=400, echo=False,
                   args=["--device", "cuda", "--timeout-s", 60, "--phases", "memory,too_big"])
    mem, too_big = run.result["memory"], run.result["too_big"]
    assert mem["fsdp"]["peak_bytes"] < mem["ddp"]["peak_bytes"]
    assert "with DDP and" in D.peak_beyond_state(mem["ddp"], mem["fsdp"]), "the sentence from real peaks"
    assert too_big["one_gpu"].startswith("out of memory") and too_big["fsdp_peak_bytes"] <= too_big["budget_bytes"]


@needs_two_gpus
def test_checkpoint_saved_on_one_gpu_resumes_on_two_nodes_of_one_gpu(tmp_path):
    common = ["--device", "cuda", "--timeout-s", 60, "--checkpoint-dir", tmp_path / "ckpt", "--global-batch", 4]
    saved = D.launch("fsdp_train.py", 1, timeout_s=300, echo=False, args=[*common, "--phases", "save"]).result
    run = D.launch_nodes("fsdp_train.py", [1, 1], devices=D.split_devices(2, 2, os.environ.get("CUDA_VISIBLE_DEVICES")),
                         timeout_s=300, echo=False, args=[*common, "--phases", "resume", "--time-batch", 4])
    torch.testing.assert_close(run.result["resume"]["losses"], saved["save"]["losses"][2:], rtol=1e-4, atol=1e-5)
    assert sorted(p["gpu"] for p in run.result["placement"]) == sorted(D.split_devices(2, 2, os.environ.get(
        "CUDA_VISIBLE_DEVICES"))), "each node on its own GPU"


@needs_two_gpus
def test_mismatched_collective_times_out_under_nccl_within_seconds():
    """Rank 0's ``work.wait(timeout)`` raises at the timeout, and with FAIL_FAST_NCCL_ENV (as notebook 10 runs it)
    the watchdog's default minute of waiting for the ranks' flight-recorder dumps does not hold up the exit."""
    start = time.perf_counter()
    with pytest.raises(D.LaunchError, match="[Tt]imed out|[Tt]imeout") as err:
        D.launch("mismatched_collective.py", 2, timeout_s=120, echo=False, args=["--device", "cuda", "--timeout-s", 5],
                 extra_env=D.FAIL_FAST_NCCL_ENV)
    assert not isinstance(err.value, D.LaunchTimeout)
    assert time.perf_counter() - start < 45, "the watchdog should end the run within seconds of the timeout"


def test_the_two_gpu_tests_carry_the_multi_gpu_marker():
    marked = [f for name, f in globals().items() if name.startswith("test_")
              and any(m.name == "multi_gpu" for m in getattr(f, "pytestmark", []))]
    assert len(marked) >= 5
    assert all(any(m.name == "skipif" for m in f.pytestmark) for f in marked)
    assert "multi_gpu:" in (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()


def test_main_change_names_a_part_only_when_it_dominates():
    # notebook 10's 2 × H200 run, DDP at 128 per GPU, one GPU → two: computation +456 µs, exposed communication
    # +437 µs, idle −207 µs — neither of the two that grew dominates
    one = D.StepParts(46.73e-3, 45.0e-3, 0.0, 1.73e-3, on_gpu=True)
    two = D.StepParts(47.415e-3, 45.456e-3, 0.437e-3, 1.522e-3, on_gpu=True)
    assert D.main_change(one, two) is None
    sentence = D.step_difference(one, two)
    assert "mostly" not in sentence and "no part dominates" in sentence
    assert sentence.endswith("split between computation and communication not hidden by computation (waiting for "
                             "the other rank included)")
    # just over twice the next part's change a part is named; just under, not
    base = D.StepParts(10e-3, 8e-3, 0.0, 2e-3, on_gpu=True)
    assert D.main_change(base, D.StepParts(13.1e-3, 10.1e-3, 1e-3, 2e-3, on_gpu=True)) == "computation"
    assert D.main_change(base, D.StepParts(12.9e-3, 9.9e-3, 1e-3, 2e-3, on_gpu=True)) is None
    # a part that moved against the step does not stop the one that moved with it from dominating (DDP at 32 per
    # GPU in that run: idle −1.14 ms, communication +611 µs, computation +226 µs, the step 307 µs shorter)
    shorter = D.StepParts(20.95e-3, 15.0e-3, 0.5e-3, 5.45e-3, on_gpu=True)
    after = D.StepParts(20.643e-3, 15.226e-3, 1.111e-3, 4.306e-3, on_gpu=True)
    assert D.main_change(shorter, after).startswith("GPU idle")
    assert D.step_difference(shorter, after).endswith("— mostly GPU idle (waiting for the host to issue work)")
    # the whole change within the noise: no part named, even a dominant one
    assert D.main_change(shorter, after, within_noise=True) is None
    quiet = D.step_difference(shorter, after, within_noise=True)
    assert "mostly" not in quiet and quiet.endswith("within the noise: no part is named as its cause")
    assert quiet.startswith("the step is 307 µs shorter") and "GPU idle (waiting for the host to issue work) −1.14 ms" \
        in quiet
