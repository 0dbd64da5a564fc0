"""utils.memory_snapshot: recording a CUDA memory history, the timeline of a snapshot and its plot, saving it,
and reading it (who holds the peak, the allocator's segments, expandable segments).

The readers are pure functions, tested everywhere on hand-made snapshots shaped like
``torch.cuda.memory._snapshot()``'s; the recording is tested on CPU against stand-ins for the torch.cuda calls, and
for real by the tests marked ``cuda`` when a GPU is present.
"""

import inspect
import pickle

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.tiny_transformer import small_lm
from utils import memory_snapshot, models, train  # noqa: E402

MiB = 2**20
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_record_memory_history_on_cpu_is_a_clear_runtime_error():
    message = "needs a CUDA device; on CPU use track_peak"
    with pytest.raises(RuntimeError, match=message), memory_snapshot.record_memory_history("cpu"):
        pass


# --- CUDA logic, against stand-ins for torch.cuda -------------------------------------------------


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda answering like a GPU that records its memory history; logs the calls."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda *args, **kwargs: calls.append(("record", args, kwargs)))
    monkeypatch.setattr(torch.cuda.memory, "_snapshot",
                        lambda: calls.append(("snapshot",)) or {"segments": []})
    return calls


def test_record_memory_history_snapshots_then_stops_even_on_error(fake_cuda):
    with pytest.raises(MemoryError), memory_snapshot.record_memory_history("cuda", max_entries=123) as history:
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
    events, live = memory_snapshot.memory_timeline({"device_traces": [TRACE]})
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
    events, live = memory_snapshot.memory_timeline(snapshot)
    assert events == [1, 3, 4, 6, 8, 10]
    assert live == [0, 1000, 4000, 3000, 3500, 500]  # not -8000, -7000, ...

    from torch.cuda import _memory_viz  # torch's own reader accepts the same dict

    assert "cudaMalloc" in _memory_viz.trace(snapshot)


def test_memory_timeline_picks_the_device_with_events():
    assert memory_snapshot.memory_timeline({"device_traces": [[], TRACE]})[1][-1] == 500
    with pytest.raises(ValueError, match="device_index"):
        memory_snapshot.memory_timeline({"device_traces": [TRACE, TRACE]})
    assert memory_snapshot.memory_timeline({"device_traces": [TRACE, TRACE]}, device_index=1)[0] == [1, 2, 4, 6, 8]
    with pytest.raises(ValueError, match="device_traces"):
        memory_snapshot.memory_timeline({"segments": []})


def test_plot_memory_timeline_is_a_labelled_step_plot(tmp_path):
    gib_trace = [{"action": "alloc", "addr": i, "size": 2**30, "stream": 0} for i in range(3)]
    fig = memory_snapshot.plot_memory_timeline({"device_traces": [gib_trace]}, title="Three tensors")
    ax = fig.axes[0]
    assert ax.get_title() == "Three tensors"
    assert "GiB" in ax.get_ylabel() and "event" in ax.get_xlabel()
    assert list(ax.get_lines()[0].get_ydata()) == [1.0, 2.0, 3.0]
    assert any("peak 3.00 GiB" in t.get_text() for t in ax.texts)
    fig.savefig(tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").stat().st_size > 1000

    small = memory_snapshot.plot_memory_timeline({"device_traces": [TRACE]})
    assert "MiB" in small.axes[0].get_ylabel() and small.axes[0].get_title() == "Memory allocated over time"
    empty = memory_snapshot.plot_memory_timeline({"device_traces": [[]]})
    assert "no allocations" in empty.axes[0].texts[0].get_text()


def test_save_snapshot_writes_a_pickle(tmp_path):
    snapshot = {"segments": [], "device_traces": [TRACE]}
    path = memory_snapshot.save_snapshot(snapshot, tmp_path / "sub" / "snap.pickle")
    with path.open("rb") as f:
        assert pickle.load(f) == snapshot


# --- reading snapshots ----------------------------------------------------------------------------


FORWARD = [{"filename": "/x/torch/nn/modules/linear.py", "line": 125, "name": "forward"},
           {"filename": "/repo/utils/models.py", "line": 60, "name": "features"}]
BACKWARD = [{"filename": "/x/torch/autograd/graph.py", "line": 800, "name": "_engine_run_backward"},
            {"filename": "/x/torch/_tensor.py", "line": 600, "name": "backward"}]
OPTIM = [{"filename": "/x/torch/optim/adamw.py", "line": 400, "name": "_multi_tensor_adamw"}]


def _snapshot_with_frames():
    trace = [
        {"action": "free_completed", "addr": 10_000, "size": 100, "stream": 0},  # allocated before recording
        {"action": "alloc", "addr": 1, "size": 1000, "stream": 0, "frames": FORWARD},
        {"action": "alloc", "addr": 2, "size": 3000, "stream": 0, "frames": FORWARD},
        {"action": "alloc", "addr": 3, "size": 500, "stream": 0, "frames": BACKWARD},  # the peak: 4,500 + before
        {"action": "free_completed", "addr": 2, "size": 3000, "stream": 0},
        {"action": "alloc", "addr": 4, "size": 200, "stream": 0, "frames": OPTIM},
    ]
    segment = {"device": 0, "address": 0, "total_size": 2 * MiB, "allocated_size": 0, "stream": 0,
               "segment_type": "large", "blocks": [
                   {"address": 0, "size": 1000 + 500 + 200 + 5000, "requested_size": 1000 + 500 + 200 + 5000,
                    "state": "active_allocated"},
                   {"address": 8000, "size": 2 * MiB - 8000, "requested_size": 0, "state": "inactive"}]}
    return {"segments": [segment], "device_traces": [trace]}


def test_frame_label_names_the_phase_and_the_innermost_frame():
    assert memory_snapshot._frame_label(FORWARD) == "forward · linear.py:forward"
    assert memory_snapshot._frame_label(BACKWARD).startswith("backward · graph.py")
    assert memory_snapshot._frame_label(OPTIM).startswith("optimizer step · adamw.py")
    assert memory_snapshot._frame_label([]).startswith("no Python stack")


def test_peak_breakdown_attributes_the_peak():
    breakdown = memory_snapshot.peak_breakdown(_snapshot_with_frames())
    assert breakdown.before_recording_bytes == 5000  # 5,100 live before recording, 100 of them freed
    assert breakdown.peak_bytes == 5000 + 4500 and breakdown.event_index == 3
    assert breakdown.by_source == [("forward · linear.py:forward", 4000, 2),
                                   ("backward · graph.py:_engine_run_backward", 500, 1)]
    rows = breakdown.rows(top=1)
    assert [r["allocated by"] for r in rows] == ["forward · linear.py:forward", "1 other places",
                                                 "before recording (weights, optimizer state, ...)"]
    assert memory_snapshot.peak_breakdown({"device_traces": [[]]}).peak_bytes == 0


def test_peak_breakdown_rows_leave_out_negligible_sources():
    sources = [("forward · a", 60_000, 3), ("backward · b", 19_990, 2), ("backward · c", 10, 1)]
    breakdown = memory_snapshot.PeakBreakdown(100_000, 7, 20_000, sources)
    assert breakdown.negligible(0.001) == [("backward · c", 10, 1)]  # 10 B of 100,000 is under 0.1%
    rows = breakdown.rows(top=8, min_share=0.001)
    assert [r["allocated by"] for r in rows] == ["forward · a", "backward · b",
                                                 "before recording (weights, optimizer state, ...)"]
    rows = breakdown.rows(top=1, min_share=0.001)  # the negligible one is not in "other places" either
    assert rows[1] == {"allocated by": "1 other places", "tensors": 2, "bytes at the peak": "19.52 KiB",
                       "share": "20%"}
    assert len(breakdown.rows(top=8)) == 4 and breakdown.negligible(0.0) == []


def test_segment_summary_and_expandable_segments_flag():
    summary = memory_snapshot.segment_summary(_snapshot_with_frames())
    assert summary == {"segments": 1, "reserved": 2 * MiB, "allocated": 6700, "cached": 2 * MiB - 6700,
                       "largest_free_block": 2 * MiB - 8000}
    enabled = memory_snapshot.expandable_segments_enabled
    assert enabled({"allocator_settings": {"expandable_segments": True}}) is True
    assert enabled({"allocator_settings": {"expandable_segments": False},
                    "segments": [{"is_expandable": True}]}) is False
    assert enabled({"segments": [{"is_expandable": False}, {"is_expandable": True}]})
    assert enabled({"segments": [{"total_size": 1}]}) is None


# --- on a real GPU --------------------------------------------------------------------------------




@cuda
def test_cuda_record_memory_history_on_a_gpu(tmp_path):
    before = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")  # live before recording, freed during it
    allocated_before = torch.cuda.memory_allocated()
    with memory_snapshot.record_memory_history("cuda") as history:
        a = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
        b = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")
        del a, before
    assert set(history.snapshot) >= {"segments", "device_traces"}
    events, live = memory_snapshot.memory_timeline(history.snapshot, device_index=history.device_index)
    assert [level - live[0] for level in live] == [0, 16 * MiB, 8 * MiB, 4 * MiB]
    # The level counts what was live before recording; sizes in the trace are the requested ones, while
    # memory_allocated() counts whole blocks, so allow a little rounding.
    assert abs(live[0] - (allocated_before + 8 * MiB)) < MiB
    assert abs(live[-1] - torch.cuda.memory_allocated()) < MiB
    fig = memory_snapshot.plot_memory_timeline(history.snapshot)
    fig.savefig(tmp_path / "timeline.png")
    memory_snapshot.save_snapshot(history.snapshot, tmp_path / "snap.pickle")
    enabled = getattr(torch._C, "_cuda_isHistoryEnabled", lambda: False)()
    assert not enabled, "recording was left on"
    del b


@cuda
def test_cuda_peak_breakdown_of_a_recorded_step():
    model, x, y = small_lm()
    model = model.cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    train.train_step(model, optimizer, x.cuda(), y.cuda())
    with memory_snapshot.record_memory_history("cuda") as history:
        train.train_step(model, optimizer, x.cuda(), y.cuda())
    breakdown = memory_snapshot.peak_breakdown(history.snapshot)
    live = sum(b for _, b, _ in breakdown.by_source)
    assert breakdown.peak_bytes == breakdown.before_recording_bytes + live
    assert breakdown.before_recording_bytes >= 3 * 4 * models.count_parameters(model)  # weights + AdamW
    assert any(label.startswith(("forward", "backward")) for label, _, _ in breakdown.by_source)
    summary = memory_snapshot.segment_summary(history.snapshot)
    assert summary["reserved"] == torch.cuda.memory_reserved()


@cuda
def test_cuda_snapshot_carries_the_allocator_settings():
    snapshot = torch.cuda.memory._snapshot()
    assert isinstance(snapshot.get("allocator_settings"), dict), sorted(snapshot)
    assert memory_snapshot.expandable_segments_enabled(snapshot) in (True, False)


def test_peak_breakdown_summary_gives_each_phase_its_share():
    breakdown = memory_snapshot.PeakBreakdown(1000, 42, 200, [("forward · functional.py:relu", 500, 3),
                                                             ("no Python stack (a C++ thread)", 250, 1),
                                                             ("backward · autograd.py:x", 49, 1),
                                                             ("forward · tiny.py:y", 1, 1)])
    text = breakdown.summary(1002, min_share=0.01)
    assert "event 42" in text and "50% allocated in the forward pass, 30% in backward, 20% before the step" in text
    assert "1 place(s) under 1.0% of the peak, 1 B in all" in text and "2 B less" in text
    assert "more tensors were live" in breakdown.summary(900)
    assert memory_snapshot.PeakBreakdown(0, -1, 0, []).summary() == "The snapshot recorded no allocation."
