"""utils.memory: byte formatting, CPU and CUDA memory numbers, peak tracking, snapshot timelines.

The CPU tests run everywhere. The CUDA logic is tested on CPU against stand-ins for the torch.cuda calls (so a
wrong call order or argument fails here too), and for real by the tests marked ``cuda`` when a GPU is present.
"""

import inspect
import pickle

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

from utils import memory  # noqa: E402

MB = 1_000_000
MiB = 2**20
LINUX_PROC = memory._proc_rss() is not None


def _clear_refs_writable() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


CAN_RESET_RSS_PEAK = _clear_refs_writable()
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (512, "512 B"),
        (1023, "1023 B"),
        (1023.6, "1.00 KiB"),  # not "1024 B"
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (2**20 - 1, "1.00 MiB"),  # not "1024.00 KiB"
        (3.25 * 2**30, "3.25 GiB"),
        (5 * 2**40, "5.00 TiB"),
        (-512, "-512 B"),
        (-1536, "-1.50 KiB"),
    ],
)
def test_format_bytes(n, text):
    assert memory.format_bytes(n) == text


def test_parse_proc_status_reads_vm_lines_in_bytes():
    text = "Name:\tpython\nVmPeak:\t  2000 kB\nVmHWM:\t    1500 kB\nVmRSS:\t    1200 kB\nThreads:\t4\n"
    assert memory._parse_proc_status(text) == {"VmPeak": 2000 * 1024, "VmHWM": 1500 * 1024,
                                                "VmRSS": 1200 * 1024}


# --- CPU ------------------------------------------------------------------------------------------


@pytest.mark.skipif(not LINUX_PROC, reason="reads /proc (Linux)")
@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_memory_stats_cpu_reports_rss(device):
    stats = memory.memory_stats(device)
    assert stats.device == "cpu"
    assert stats.allocated_bytes > 20 * MB  # a Python process with torch loaded holds far more than this
    assert stats.reserved_bytes == stats.allocated_bytes
    assert stats.peak_allocated_bytes >= stats.allocated_bytes
    assert stats.what == (
        "process resident set size (RSS) from /proc: allocated = current RSS, reserved = current RSS, "
        "peak = high-water mark; includes everything the process holds, not only tensors"
    )
    assert str(stats).startswith(f"cpu: allocated {memory.format_bytes(stats.allocated_bytes)}")


def test_memory_stats_cpu_without_proc_uses_getrusage(monkeypatch, tmp_path):
    pytest.importorskip("resource")
    monkeypatch.setattr(memory, "_PROC_STATUS", tmp_path / "missing")
    stats = memory.memory_stats("cpu")
    assert "getrusage" in stats.what
    assert stats.allocated_bytes == stats.peak_allocated_bytes > 20 * MB  # KiB converted to bytes


@pytest.mark.skipif(not LINUX_PROC, reason="reads /proc (Linux)")
def test_track_peak_cpu_sees_a_200_mb_tensor():
    with memory.track_peak("cpu") as mem:
        x = torch.randn(50 * MB)  # 200 MB of float32, every page written
        del x
    assert mem.device == "cpu"
    assert mem.peak_increase_bytes >= 190 * MB
    assert mem.peak_bytes == mem.start_bytes + mem.peak_increase_bytes
    assert mem.end_bytes > 0 and "RSS" in mem.what
    assert memory.format_bytes(mem.peak_bytes) in str(mem)


@pytest.mark.skipif(not CAN_RESET_RSS_PEAK, reason="needs a writable /proc/self/clear_refs (Linux >= 4.0)")
def test_track_peak_cpu_resets_the_high_water_mark():
    x = torch.randn(50 * MB)  # raise the process's high-water mark before the block...
    del x
    with memory.track_peak("cpu") as mem:
        pass  # ...then measure a block that allocates nothing
    assert "inside the block" in mem.what
    assert mem.peak_increase_bytes < 50 * MB


@pytest.mark.skipif(not LINUX_PROC, reason="reads /proc (Linux)")
def test_track_peak_cpu_says_when_the_peak_is_the_lifetime_one(monkeypatch):
    monkeypatch.setattr(memory, "_reset_rss_peak", lambda: False)
    with memory.track_peak("cpu") as mem:
        pass
    assert "whole process lifetime" in mem.what and "could not be reset" in mem.what


def test_track_peak_fills_its_fields_when_the_block_raises():
    with pytest.raises(KeyError), memory.track_peak("cpu") as mem:
        raise KeyError("boom")
    assert mem.end_bytes > 0 and mem.peak_bytes >= mem.start_bytes


@pytest.mark.parametrize("device", ["tpu", "mps", "not a device"])
def test_unknown_device_is_a_value_error(device):
    with pytest.raises(ValueError, match="cpu"):
        memory.memory_stats(device)
    with pytest.raises(ValueError), memory.track_peak(device):
        pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown when CUDA is missing")
def test_cuda_without_a_gpu_is_a_clear_runtime_error():
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        memory.memory_stats("cuda")


def test_record_memory_history_on_cpu_is_a_clear_runtime_error():
    message = "needs a CUDA device; on CPU use track_peak"
    with pytest.raises(RuntimeError, match=message), memory.record_memory_history("cpu"):
        pass


# --- CUDA logic, against stand-ins for torch.cuda ---------------------------------------------------


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda answering like a GPU whose allocated memory goes 100 -> 400 (peak 900); logs the calls."""
    calls = []
    allocated = iter([100, 400])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("synchronize", device)))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device=None: calls.append(("reset", device)))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: next(allocated))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 2048)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 900)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda *args, **kwargs: calls.append(("record", args, kwargs)))
    monkeypatch.setattr(torch.cuda.memory, "_snapshot",
                        lambda: calls.append(("snapshot",)) or {"segments": []})
    return calls


def test_memory_stats_cuda_reads_the_caching_allocator(fake_cuda):
    stats = memory.memory_stats("cuda")
    assert (stats.device, stats.allocated_bytes, stats.reserved_bytes, stats.peak_allocated_bytes) == (
        "cuda:0", 100, 2048, 900)
    assert stats.what == ("PyTorch caching allocator on cuda:0: allocated = live tensors, reserved = held by "
                          "the cache, peak since last reset")


def test_track_peak_cuda_resets_then_reads_the_peak_after_synchronizing(fake_cuda):
    with memory.track_peak("cuda:0") as mem:
        assert fake_cuda == [("synchronize", torch.device("cuda:0")), ("reset", torch.device("cuda:0"))]
    assert fake_cuda[-1] == ("synchronize", torch.device("cuda:0"))
    assert (mem.start_bytes, mem.end_bytes, mem.peak_bytes, mem.peak_increase_bytes) == (100, 400, 900, 800)
    assert mem.what.startswith("PyTorch caching allocator on cuda:0")


def test_record_memory_history_snapshots_then_stops_even_on_error(fake_cuda):
    with pytest.raises(MemoryError), memory.record_memory_history("cuda", max_entries=123) as history:
        raise MemoryError("out of memory")
    assert fake_cuda == [
        ("record", (), {"enabled": "all", "stacks": "python", "max_entries": 123}),
        ("snapshot",),
        ("record", (), {"enabled": None}),
    ]
    assert history.snapshot == {"segments": []} and history.device == "cuda:0"


def test_record_memory_history_arguments_fit_the_installed_torch():
    # torch.cuda.memory._record_memory_history is semi-private: check that what we pass is still accepted.
    signature = inspect.signature(torch.cuda.memory._record_memory_history)
    signature.bind(enabled="all", stacks="python", max_entries=123)
    signature.bind(enabled=None)
    assert {"stacks", "max_entries"} <= set(signature.parameters)


# --- snapshot timelines ---------------------------------------------------------------------------

# The shape of torch.cuda.memory._snapshot(): see its docstring and torch/cuda/_memory_viz.py (trace()).
TRACE = [
    {"action": "segment_alloc", "addr": 0, "size": 2 * MiB, "stream": 0},
    {"action": "alloc", "addr": 0, "size": 1000, "stream": 0},  # 1
    {"action": "alloc", "addr": 1024, "size": 3000, "stream": 0},  # 2
    {"action": "free_requested", "addr": 0, "size": 1000, "stream": 0},  # not free yet
    {"action": "free_completed", "addr": 0, "size": 1000, "stream": 0},  # 4
    {"action": "snapshot", "addr": 0, "size": 0, "stream": 0},
    {"action": "alloc", "addr": 4096, "size": 500, "stream": 0},  # 6
    {"action": "free_requested", "addr": 1024, "size": 3000, "stream": 0},
    {"action": "free_completed", "addr": 1024, "size": 3000, "stream": 0},  # 8
]


def test_memory_timeline_counts_allocs_and_completed_frees():
    events, live = memory.memory_timeline({"device_traces": [TRACE]})
    assert events == [1, 2, 4, 6, 8]
    assert live == [1000, 4000, 3000, 3500, 500]


def test_memory_timeline_starts_from_what_was_live_before_recording():
    # An 8000-byte tensor allocated before recording is freed during it; at the end only 500 bytes are live.
    trace = [{"action": "free_requested", "addr": 8192, "size": 8000, "stream": 0},
             {"action": "free_completed", "addr": 8192, "size": 8000, "stream": 0}, *TRACE]
    segment = {"device": 0, "address": 0, "total_size": 2 * MiB, "allocated_size": 512, "stream": 0,
               "segment_type": "large", "blocks": [
                   {"address": 0, "size": 4096, "requested_size": 1000, "state": "inactive"},
                   {"address": 4096, "size": 512, "requested_size": 500, "state": "active_allocated"},
                   {"address": 4608, "size": 2 * MiB - 4608, "requested_size": 0, "state": "inactive"}]}
    snapshot = {"segments": [segment], "device_traces": [trace]}
    events, live = memory.memory_timeline(snapshot)
    assert events == [1, 3, 4, 6, 8, 10]
    assert live == [0, 1000, 4000, 3000, 3500, 500]  # not -8000, -7000, ...

    from torch.cuda import _memory_viz  # torch's own reader accepts the same dict

    assert "cudaMalloc" in _memory_viz.trace(snapshot)


def test_memory_timeline_picks_the_device_with_events():
    assert memory.memory_timeline({"device_traces": [[], TRACE]})[1][-1] == 500
    with pytest.raises(ValueError, match="device_index"):
        memory.memory_timeline({"device_traces": [TRACE, TRACE]})
    assert memory.memory_timeline({"device_traces": [TRACE, TRACE]}, device_index=1)[0] == [1, 2, 4, 6, 8]
    with pytest.raises(ValueError, match="device_traces"):
        memory.memory_timeline({"segments": []})


def test_plot_memory_timeline_is_a_labelled_step_plot(tmp_path):
    gib_trace = [{"action": "alloc", "addr": i, "size": 2**30, "stream": 0} for i in range(3)]
    fig = memory.plot_memory_timeline({"device_traces": [gib_trace]}, title="Three tensors")
    ax = fig.axes[0]
    assert ax.get_title() == "Three tensors"
    assert "GiB" in ax.get_ylabel() and "event" in ax.get_xlabel()
    assert list(ax.get_lines()[0].get_ydata()) == [1.0, 2.0, 3.0]
    assert any("peak 3.00 GiB" in t.get_text() for t in ax.texts)
    fig.savefig(tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").stat().st_size > 1000

    small = memory.plot_memory_timeline({"device_traces": [TRACE]})
    assert "MiB" in small.axes[0].get_ylabel() and small.axes[0].get_title() == "Memory allocated over time"
    empty = memory.plot_memory_timeline({"device_traces": [[]]})
    assert "no allocations" in empty.axes[0].texts[0].get_text()


def test_save_snapshot_writes_a_pickle(tmp_path):
    snapshot = {"segments": [], "device_traces": [TRACE]}
    path = memory.save_snapshot(snapshot, tmp_path / "sub" / "snap.pickle")
    with path.open("rb") as f:
        assert pickle.load(f) == snapshot


# --- on a real GPU --------------------------------------------------------------------------------


@cuda
def test_cuda_memory_stats_and_track_peak_on_a_gpu():
    stats = memory.memory_stats("cuda")
    assert stats.reserved_bytes >= stats.allocated_bytes >= 0 and stats.device.startswith("cuda:")
    with memory.track_peak("cuda") as mem:
        x = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
        del x
    assert mem.peak_increase_bytes >= 256 * MiB
    assert mem.end_bytes == mem.start_bytes


@cuda
def test_cuda_record_memory_history_on_a_gpu(tmp_path):
    before = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")  # live before recording, freed during it
    allocated_before = torch.cuda.memory_allocated()
    with memory.record_memory_history("cuda") as history:
        a = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
        b = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")
        del a, before
    assert set(history.snapshot) >= {"segments", "device_traces"}
    events, live = memory.memory_timeline(history.snapshot, device_index=history.device_index)
    assert [level - live[0] for level in live] == [0, 16 * MiB, 8 * MiB, 4 * MiB]
    # The level counts what was live before recording; sizes in the trace are the requested ones, while
    # memory_allocated() counts whole blocks, so allow a little rounding.
    assert abs(live[0] - (allocated_before + 8 * MiB)) < MiB
    assert abs(live[-1] - torch.cuda.memory_allocated()) < MiB
    fig = memory.plot_memory_timeline(history.snapshot)
    fig.savefig(tmp_path / "timeline.png")
    memory.save_snapshot(history.snapshot, tmp_path / "snap.pickle")
    enabled = getattr(torch._C, "_cuda_isHistoryEnabled", lambda: False)()
    assert not enabled, "recording was left on"
    del b


def test_saved_tensors_by_op_attributes_each_storage_once():
    from utils import memory as mem

    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 5)
    x = torch.randn(4, 8, requires_grad=True)
    loss = torch.nn.functional.cross_entropy(layer(x), torch.tensor([0, 1, 2, 3]))
    saved = mem.saved_tensors_by_op(loss, exclude=list(layer.parameters()))
    ops = {(s.op, s.name) for s in saved}
    assert ("LogSoftmaxBackward0", "result") in ops  # log-probs, kept once although nll_loss keeps them too
    assert not any(s.op == "NllLossBackward0" and s.name == "self" for s in saved)
    assert sum(s.nbytes for s in saved) == sum(mem.saved_bytes_by(saved).values())
    by_dtype = mem.saved_bytes_by(saved, key="dtype")
    assert set(by_dtype) <= {"float32", "int64"}
    with pytest.raises(ValueError, match="key"):
        mem.saved_bytes_by(saved, key="shape")
    loss.backward()
    with pytest.raises(ValueError, match="no autograd graph"):
        mem.saved_tensors_by_op(torch.ones(2))
