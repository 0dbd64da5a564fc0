"""utils.memory: byte formatting, CPU and CUDA memory numbers, peak tracking, snapshot timelines.

The CPU tests run everywhere. The CUDA logic is tested on CPU against stand-ins for the torch.cuda calls (so a
wrong call order or argument fails here too), and for real by the tests marked ``cuda`` when a GPU is present.
"""

import inspect
import math
import pickle
from contextlib import nullcontext

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

from utils import memory, models, train  # noqa: E402

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


# --- predicting a training step's memory ------------------------------------------------------------


SMALL = models.TransformerConfig(vocab_size=512, d_model=64, nhead=4, num_layers=2, dim_feedforward=128, dropout=0.0)


def _small_lm(seed=0):
    torch.manual_seed(seed)
    model = models.TransformerModel(SMALL)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, SMALL.vocab_size, (4, 16), generator=gen)
    y = torch.randint(0, SMALL.vocab_size, (4, 16), generator=gen)
    return model, x, y


@pytest.mark.parametrize("amp", [False, True])
def test_transformer_activations_match_what_autograd_keeps_on_cpu(amp):
    model, x, y = _small_lm()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        loss = train.lm_loss(model(x), y)
    kept = sum(s.nbytes for s in memory.saved_tensors_by_op(loss, exclude=list(model.parameters())))
    estimate = memory.transformer_activations(SMALL, 4, 16, amp=amp, device_type="cpu")
    assert abs(estimate.saved_bytes - kept) <= 16  # the loss's 0-d weight and such
    assert estimate.transient_bytes == 4 * 16 * 512 * (4 if amp else 8)


def test_transformer_activations_shrink_with_each_technique():
    full = memory.transformer_activations(models.TransformerConfig(dropout=0.0), 32, 256)
    ckpt = memory.transformer_activations(models.TransformerConfig(dropout=0.0), 32, 256, checkpointing="full")
    sel = memory.transformer_activations(models.TransformerConfig(dropout=0.0), 32, 256, checkpointing="selective")
    chunked = memory.transformer_activations(models.TransformerConfig(dropout=0.0), 32, 256, chunked_loss=True)
    assert ckpt.saved_bytes < sel.saved_bytes < full.saved_bytes
    assert chunked.saved_bytes < full.saved_bytes and chunked.transient_bytes < full.transient_bytes
    n = 32 * 256
    assert ckpt.saved["layers (checkpointed)"] == 6 * n * 512 * 4  # each layer's fp32 input
    dropout = memory.transformer_activations(models.TransformerConfig(dropout=0.1), 32, 256)
    assert dropout.saved["layers"] - full.saved["layers"] == 6 * n * (4 * 2048 + 2 * 512 + 2048)
    with pytest.raises(ValueError, match="checkpointing"):
        memory.transformer_activations(SMALL, 1, 1, checkpointing="some")
    with pytest.raises(ValueError, match="positive"):
        memory.transformer_activations(SMALL, 0, 16)


@pytest.mark.parametrize(("name", "make"), [
    ("sgd", lambda p: torch.optim.SGD(p, lr=0.1)),
    ("sgd_momentum", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
    ("adam", lambda p: torch.optim.Adam(p)),
    ("adamw", lambda p: torch.optim.AdamW(p)),
    ("adafactor", lambda p: torch.optim.Adafactor(p)),
])
def test_optimizer_state_bytes_equals_what_the_optimizer_allocates(name, make):
    model, x, y = _small_lm()
    optimizer = make(model.parameters())
    train.lm_loss(model(x), y).backward()
    optimizer.step()
    allocated = sum(t.nbytes for state in optimizer.state.values() for t in state.values()
                    if isinstance(t, torch.Tensor) and t.dim() > 0)  # 0-d step counters left out
    assert memory.optimizer_state_bytes(model, name) == allocated


def test_optimizer_state_bytes_bad_input():
    with pytest.raises(ValueError, match="unknown optimizer"):
        memory.optimizer_state_bytes(10, "lion")
    with pytest.raises(ValueError, match="shapes"):
        memory.optimizer_state_bytes(10, "adafactor")
    with pytest.raises(ValueError, match="negative"):
        memory.optimizer_state_bytes(-1)
    with pytest.raises(TypeError, match="params"):
        memory.optimizer_state_bytes(1.5)
    assert memory.optimizer_state_bytes([(3, 4), (4,)], "adafactor") == (3 + 4 + 4) * 4


def test_predict_training_memory_parts_and_peak():
    estimate = memory.ActivationEstimate(saved={"a": 1000}, transient={"loss": 300, "layer": 500})
    p = memory.predict_training_memory(100, optimizer="adamw", activations=estimate)
    assert (p.weights, p.gradients, p.optimizer_state, p.activations, p.transient) == (400, 400, 800, 1000, 500)
    assert p.static == 1600 and p.sum_of_parts == 3100
    assert p.peak == 400 + 800 + 1000 + 500  # the gradients are not there yet at the start of backward
    kept = memory.predict_training_memory(100, activations=estimate, set_to_none=False)
    assert kept.peak == p.peak + 400
    tiny = memory.predict_training_memory(100, optimizer="sgd")
    assert tiny.peak == tiny.static == 800  # the end of backward: weights and gradients
    assert "predicted peak" in str(p) and "optimizer state" in p.parts
    model, _, _ = _small_lm()
    assert memory.predict_training_memory(model).weights == 4 * models.count_parameters(model)
    with pytest.raises(ValueError):
        memory.predict_training_memory(10, activations=-1)


# --- out of memory and the largest batch ------------------------------------------------------------


def test_is_out_of_memory_knows_both_allocators():
    assert memory.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    try:
        torch.empty(2**62, dtype=torch.uint8)
    except RuntimeError as err:
        assert memory.is_out_of_memory(err)
    assert not memory.is_out_of_memory(RuntimeError("shape mismatch"))
    assert not memory.is_out_of_memory(ValueError("can't allocate memory"))
    # a CUDA call that found no memory outside the allocator (e.g. loading a kernel lazily), and cuBLAS
    assert memory.is_out_of_memory(RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be ..."))
    assert memory.is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
    assert not memory.is_out_of_memory(RuntimeError("CUDA error: an illegal memory access was encountered"))


def test_try_step_catches_out_of_memory_and_lets_other_errors_through():
    ok = memory.try_step(lambda: torch.ones(4), "cpu")
    assert ok.ok and ok.error is None
    model, x, y = _small_lm()

    def half_done():  # gradients exist, then the next allocation fails
        train.lm_loss(model(x), y).backward()
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    failed = memory.try_step(half_done, "cpu", release=[model])
    assert not failed.ok and failed.error.startswith("CUDA out of memory")
    assert all(p.grad is None for p in model.parameters()), "release= must drop the half-done gradients"
    with pytest.raises(ValueError, match="not memory"):
        memory.try_step(lambda: (_ for _ in ()).throw(ValueError("not memory")), "cpu")
    with pytest.raises(RuntimeError, match="size"):
        memory.try_step(lambda: torch.ones(2) @ torch.ones(3), "cpu")


@pytest.mark.parametrize("answer", [1, 2, 3, 7, 8, 9, 100, 777, 1000, 4095])
def test_largest_batch_finds_the_threshold_in_few_tries(answer):
    search = memory.largest_batch(lambda b: b <= answer, limit=4096)
    assert search.largest == answer
    assert len(search.tried) <= 2 * math.log2(answer + 1) + 3
    assert not search.limit_reached or answer == 4096


def test_largest_batch_edges_and_resolution():
    assert memory.largest_batch(lambda b: False).largest == 0
    top = memory.largest_batch(lambda b: True, limit=1000)
    assert top.largest == 1000 and top.limit_reached and "the limit" in str(top)
    coarse = memory.largest_batch(lambda b: b <= 777, start=4, resolution=0.05)
    assert 777 / 1.05 <= coarse.largest <= 777 and len(coarse.tried) < 15
    assert memory.largest_batch(lambda b: b <= 5, start=64).largest == 5  # start too big: bisect below it
    for bad in ({"start": 0}, {"start": 10, "limit": 5}, {"resolution": -1}):
        with pytest.raises(ValueError):
            memory.largest_batch(lambda b: True, **bad)


def test_fits_in_memory_turns_out_of_memory_into_false():
    def run(batch):
        if batch > 6:
            raise torch.OutOfMemoryError("CUDA out of memory")
    fits = memory.fits_in_memory(run, "cpu")
    assert fits(6) and not fits(7)
    assert memory.largest_batch(fits).largest == 6


# --- activation checkpointing -----------------------------------------------------------------------

ATEN = torch.ops.aten


def _grads(model, x, y):
    model.zero_grad(set_to_none=True)
    loss = train.lm_loss(model(x), y)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_op_counter_sees_the_matmuls_linear_decomposes_into():
    model, x, _ = _small_lm()
    with memory.OpCounter() as ops:
        model(x)
    names = {memory.op_name(op) for op in ops.matmuls()}
    assert names <= {"aten.addmm.default", "aten.mm.default"} and "aten.addmm.default" in names
    assert memory.is_matmul(ATEN.mm.default) and memory.is_matmul(ATEN.addmm) and not memory.is_matmul(ATEN.relu)
    assert sum(ops.compute_ops().values()) < sum(ops.counts.values())  # views are left out


@pytest.mark.parametrize("save", [None, [ATEN.mm.default, ATEN.addmm.default]])
def test_checkpointing_gives_the_same_gradients_and_counts_recomputation(save):
    model, x, y = _small_lm()
    loss, grads = _grads(model, x, y)
    ac = memory.ActivationCheckpointing(model.encoder.layers, save=save)
    with ac:
        ckpt_loss, ckpt_grads = _grads(model, x, y)
    assert "forward" not in model.encoder.layers[0].__dict__, "the original forward must be back"
    torch.testing.assert_close(ckpt_loss, loss)
    for g, h in zip(ckpt_grads, grads, strict=True):
        torch.testing.assert_close(g, h)
    assert ac.recomputed_compute_ops() > 0
    if save is None:
        assert ac.recomputed_matmuls() == 8 and not ac.selective  # 4 per layer: in-proj, out-proj, 2 linear
    else:
        assert ac.recomputed_matmuls() == 0 and ac.unmatched() == []
        assert sum(ac.saved.values()) == 8


@pytest.mark.parametrize("wrong", [[ATEN.addmm, ATEN.mm], [ATEN.linear.default]])
def test_a_policy_naming_ops_that_never_dispatch_recomputes_everything(wrong):
    model, x, y = _small_lm()
    full = memory.ActivationCheckpointing(model.encoder.layers)
    with full:
        _grads(model, x, y)
    ac = memory.ActivationCheckpointing(model.encoder.layers, save=wrong)
    with ac:
        _grads(model, x, y)
    assert ac.recomputed_matmuls() == full.recomputed_matmuls() > 0
    assert ac.unmatched() == [memory.op_name(op) for op in wrong]
    ac.reset()
    assert not ac.saved and not ac.recomputed


def test_checkpointing_without_counting_records_nothing_and_computes_the_same():
    model, x, y = _small_lm()
    loss, grads = _grads(model, x, y)
    for save in (None, [ATEN.mm.default, ATEN.addmm.default]):
        ac = memory.ActivationCheckpointing(model.encoder.layers, save=save, counting=False)
        with ac:
            ckpt_loss, ckpt_grads = _grads(model, x, y)
        torch.testing.assert_close(ckpt_loss, loss)
        for g, h in zip(ckpt_grads, grads, strict=True):
            torch.testing.assert_close(g, h)
        assert not ac.recomputed
        ac.counting = True  # switched back on: counted again
        with ac:
            _grads(model, x, y)
        assert ac.recomputed_matmuls() == (8 if save is None else 0) and ac.recomputed_compute_ops() > 0


def test_checkpointing_bad_use():
    with pytest.raises(ValueError, match="at least one"):
        memory.ActivationCheckpointing([])
    model, x, _ = _small_lm()
    ac = memory.ActivationCheckpointing(model.encoder.layers)
    with ac, pytest.raises(RuntimeError, match="already replaced"), memory.ActivationCheckpointing(
            model.encoder.layers):
        pass
    with ac, torch.no_grad():
        model(x)  # no grad: plain forward, nothing recomputed later
    assert not ac.recomputed


# --- memory over one step -----------------------------------------------------------------------------


def test_trace_step_memory_reads_every_phase_in_order(tmp_path):
    model, x, y = _small_lm()
    optimizer = torch.optim.AdamW(model.parameters())
    modules = {"embedding": model.embedding, **{f"layer {i}": m for i, m in enumerate(model.encoder.layers)},
               "head": model.head}
    with memory.trace_step_memory("cpu", modules, optimizer) as trace:
        train.train_step(model, optimizer, x, y)
    assert trace.labels == ["start", "embedding", "layer 0", "layer 1", "head", "head", "layer 1", "layer 0",
                            "embedding", "optimizer step"]
    assert trace.phases[1:5] == ["forward"] * 4 and trace.phases[-1] == "optimizer"
    assert len(trace.allocated_bytes) == len(trace.labels) and "RSS" in trace.what
    model.zero_grad()
    train.lm_loss(model(x), y).backward()  # the hooks are gone
    assert len(trace.labels) == 10
    fig = memory.plot_memory_trace(trace, title="one step")
    assert fig.axes[0].get_title() == "one step" and "MiB" in fig.axes[0].get_ylabel()
    fig.savefig(tmp_path / "trace.png")


# --- reading snapshots --------------------------------------------------------------------------------

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
    assert memory._frame_label(FORWARD) == "forward · linear.py:forward"
    assert memory._frame_label(BACKWARD).startswith("backward · graph.py")
    assert memory._frame_label(OPTIM).startswith("optimizer step · adamw.py")
    assert memory._frame_label([]).startswith("no Python stack")


def test_peak_breakdown_attributes_the_peak():
    breakdown = memory.peak_breakdown(_snapshot_with_frames())
    assert breakdown.before_recording_bytes == 5000  # 5,100 live before recording, 100 of them freed
    assert breakdown.peak_bytes == 5000 + 4500 and breakdown.event_index == 3
    assert breakdown.by_source == [("forward · linear.py:forward", 4000, 2),
                                   ("backward · graph.py:_engine_run_backward", 500, 1)]
    rows = breakdown.rows(top=1)
    assert [r["allocated by"] for r in rows] == ["forward · linear.py:forward", "1 other places",
                                                 "before recording (weights, optimizer state, ...)"]
    assert memory.peak_breakdown({"device_traces": [[]]}).peak_bytes == 0


def test_segment_summary_and_expandable_segments_flag():
    summary = memory.segment_summary(_snapshot_with_frames())
    assert summary == {"segments": 1, "reserved": 2 * MiB, "allocated": 6700, "cached": 2 * MiB - 6700,
                       "largest_free_block": 2 * MiB - 8000}
    assert memory.expandable_segments_enabled({"allocator_settings": {"expandable_segments": True}}) is True
    assert memory.expandable_segments_enabled({"allocator_settings": {"expandable_segments": False},
                                               "segments": [{"is_expandable": True}]}) is False
    assert memory.expandable_segments_enabled({"segments": [{"is_expandable": False}, {"is_expandable": True}]})
    assert memory.expandable_segments_enabled({"segments": [{"total_size": 1}]}) is None


def test_fragmentation_demo_and_probe_need_cuda():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU message")
    with pytest.raises(RuntimeError, match="CUDA"):
        memory.fragmentation_demo("cpu")
    assert set(memory.ALLOC_CONF_VARS) == {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"}


# --- the same on a real GPU ---------------------------------------------------------------------------


@cuda
def test_cuda_try_step_releases_a_real_out_of_memory():
    model, x, y = _small_lm()
    model = model.cuda()
    before = torch.cuda.memory_allocated()
    total = torch.cuda.get_device_properties(0).total_memory

    def too_big():
        keep = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")  # held by the frame when it fails
        torch.empty(2 * total, dtype=torch.uint8, device="cuda")
        del keep

    outcome = memory.try_step(too_big, "cuda", release=[model])
    assert not outcome.ok and "out of memory" in outcome.error.lower()
    assert outcome.held_bytes >= before + 64 * MiB, "the traceback still holds the frame's tensor"
    assert outcome.after_bytes == before
    assert memory.try_step(lambda: model(x.cuda()).sum().backward(), "cuda").ok  # carries on


@cuda
def test_cuda_largest_batch_under_a_memory_fraction():
    total = torch.cuda.get_device_properties(0).total_memory
    budget = 2 * 2**30
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(budget / total)
    try:
        fits = memory.fits_in_memory(lambda b: torch.empty(b * MiB, dtype=torch.uint8, device="cuda"), "cuda")
        search = memory.largest_batch(fits, start=64, limit=1 << 14)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert budget / MiB * 0.8 < search.largest <= budget / MiB, search


@cuda
def test_cuda_fragmentation_demo_and_the_allocator_probe():
    rows = memory.fragmentation_demo("cuda")
    assert [r["stage"] for r in rows] == ["start", "10 tensors of 48 MiB", "all of them freed",
                                          "one tensor of 288 MiB", "empty_cache()"]
    assert rows[0]["allocated"] == rows[0]["reserved"] == 0
    assert rows[1]["allocated"] == 480 * MiB and rows[2]["allocated"] == 0 and rows[3]["allocated"] == 288 * MiB
    assert rows[2]["reserved"] >= 480 * MiB, "freed blocks stay cached"
    if not memory.expandable_segments_enabled(torch.cuda.memory._snapshot()):
        assert rows[3]["reserved"] >= 768 * MiB, "ten separate 48 MiB segments cannot hold one 288 MiB tensor"
    assert rows[4]["reserved"] < rows[3]["reserved"]
    default = memory.allocator_probe(None)
    assert default.expandable_segments is False
    assert default.reserved_after("one tensor") >= 768 * MiB
    old = memory.allocator_probe("PYTORCH_CUDA_ALLOC_CONF")
    assert old.expandable_segments is True  # the old name works in every release
    assert old.reserved_after("one tensor") < default.reserved_after("one tensor")
    new = memory.allocator_probe("PYTORCH_ALLOC_CONF")
    assert new.expandable_segments in (True, False) and new.torch_version == torch.__version__


@cuda
def test_cuda_peak_breakdown_of_a_recorded_step():
    model, x, y = _small_lm()
    model = model.cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    train.train_step(model, optimizer, x.cuda(), y.cuda())
    with memory.record_memory_history("cuda") as history:
        train.train_step(model, optimizer, x.cuda(), y.cuda())
    breakdown = memory.peak_breakdown(history.snapshot)
    live = sum(b for _, b, _ in breakdown.by_source)
    assert breakdown.peak_bytes == breakdown.before_recording_bytes + live
    assert breakdown.before_recording_bytes >= 3 * 4 * models.count_parameters(model)  # weights + AdamW
    assert any(label.startswith(("forward", "backward")) for label, _, _ in breakdown.by_source)
    summary = memory.segment_summary(history.snapshot)
    assert summary["reserved"] == torch.cuda.memory_reserved()


@cuda
def test_cuda_trace_step_memory_rises_in_forward_and_falls_in_backward():
    model, x, y = _small_lm()
    model = model.cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    train.train_step(model, optimizer, x.cuda(), y.cuda())
    modules = {"embedding": model.embedding, **{f"layer {i}": m for i, m in enumerate(model.encoder.layers)}}
    with memory.trace_step_memory("cuda", modules, optimizer) as trace:
        train.train_step(model, optimizer, x.cuda(), y.cuda())
    level = dict(zip(zip(trace.labels, trace.phases, strict=True), trace.allocated_bytes, strict=True))
    # the start still holds the last step's gradients (train_step frees them first): compare within the forward
    assert level[("layer 1", "forward")] > level[("layer 0", "forward")] > level[("embedding", "forward")]
    assert "memory_allocated" in trace.what


def test_plot_stacked_memory_stacks_parts_and_marks_peaks(tmp_path):
    bars = {"predicted": {"weights": 2**30, "activations": 2 * 2**30},
            "measured": {"weights": 2**30, "activations": 2**30, "cache": 2**29}}
    fig = memory.plot_stacked_memory(bars, peaks={"measured": 2 * 2**30}, title="anatomy")
    ax = fig.axes[0]
    assert ax.get_title() == "anatomy" and "GiB" in ax.get_ylabel()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["weights", "activations", "cache"]
    assert len(ax.patches) == 6  # every part in every bar (0 where missing)
    assert any("peak 2.00 GiB" in t.get_text() for t in ax.texts)
    fig.savefig(tmp_path / "stack.png")


# --- GPU-only helpers, checked where the notebook relies on them ----------------------------------------


def _cublas_workspaces_ready():
    """This process's first matmuls, forward and backward (autograd's own thread gets a cuBLAS workspace too)."""
    w = torch.ones(64, 64, device="cuda", requires_grad=True)
    torch.nn.functional.linear(w, w, w[0]).sum().backward()


@cuda
def test_cuda_allocator_counts_the_predicted_weights_gradients_and_adamw_state():
    # Notebook 05's check on the full model, small: sizes that are multiples of the allocator's 512-byte blocks.
    config = models.TransformerConfig(vocab_size=4096, d_model=256, nhead=4, num_layers=2, dim_feedforward=1024,
                                      dropout=0.0)
    _cublas_workspaces_ready()
    torch.manual_seed(0)
    start = torch.cuda.memory_allocated()
    model = models.TransformerModel(config).cuda()
    weights = torch.cuda.memory_allocated() - start
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, config.vocab_size, (4, 64), device="cuda")
    train.lm_loss(model(x), x).backward()
    before = torch.cuda.memory_allocated()
    optimizer.step()  # AdamW creates its state here (its step counters stay on the CPU)
    state = torch.cuda.memory_allocated() - before
    before = torch.cuda.memory_allocated()
    optimizer.zero_grad(set_to_none=True)
    gradients = before - torch.cuda.memory_allocated()
    predicted = memory.predict_training_memory(model, optimizer="adamw")
    assert weights == pytest.approx(predicted.weights, rel=0.01)
    assert gradients == pytest.approx(predicted.gradients, rel=0.01)
    assert state == pytest.approx(predicted.optimizer_state, rel=0.01)


@cuda
@pytest.mark.parametrize("amp", [False, True])
def test_cuda_transformer_activations_match_what_autograd_keeps(amp):
    # The docstring's claim on a GPU: to the byte with FlashAttention-style kernels; the memory-efficient kernel
    # (fp32) keeps one more N×D copy per layer. Allowed on top: attention kernels pad the log-sum-exp to 32
    # positions and keep two RNG-state scalars.
    model, x, y = _small_lm()
    model, x, y = model.cuda(), x.cuda(), y.cuda()
    dtype = torch.bfloat16 if torch.cuda.get_device_capability() >= (8, 0) else torch.float16
    with torch.autocast("cuda", dtype=dtype, enabled=amp):
        loss = train.lm_loss(model(x), y)
    kept = sum(s.nbytes for s in memory.saved_tensors_by_op(loss, exclude=list(model.parameters())))
    estimate = memory.transformer_activations(SMALL, 4, 16, amp=amp, device_type="cuda").saved_bytes
    n, value_bytes = 4 * 16, 2 if amp else 4
    slack = SMALL.num_layers * (n * SMALL.d_model * value_bytes + 4 * SMALL.nhead * 32 * 4 + 64)
    assert estimate - 64 <= kept <= estimate + slack, (kept, estimate)


@cuda
def test_cuda_checkpointing_counts_what_the_backward_thread_recomputes():
    # On a GPU, backward (and so the recomputation) runs on autograd's device thread, not the caller's.
    model, x, y = _small_lm()
    model, x, y = model.cuda(), x.cuda(), y.cuda()
    loss, grads = _grads(model, x, y)
    with memory.OpCounter() as ops:
        model(x)
    overloads = sorted(ops.matmuls(), key=str)
    packets = [getattr(ATEN, op.overloadpacket.__name__.split(".")[-1]) for op in overloads]
    counts = {}
    for name, save in (("full", None), ("overloads", overloads), ("packets", packets)):
        ac = memory.ActivationCheckpointing(model.encoder.layers, save=save)
        with ac:
            ckpt_loss, ckpt_grads = _grads(model, x, y)
        torch.testing.assert_close(ckpt_loss, loss, rtol=1e-5, atol=1e-6)
        for g, h in zip(ckpt_grads, grads, strict=True):
            torch.testing.assert_close(g, h, rtol=1e-4, atol=1e-6)
        counts[name] = (ac.recomputed_matmuls(), ac.recomputed_compute_ops(), ac.unmatched())
    assert counts["full"][0] == 8 and counts["full"][1] > 0  # 4 matmuls per layer
    assert counts["overloads"][0] == 0 and counts["overloads"][2] == []
    assert counts["packets"][0] == counts["full"][0] and len(counts["packets"][2]) == len(packets)


@cuda
def test_cuda_checkpointing_lowers_the_peak_of_a_step():
    model, _, _ = _small_lm()
    model = model.cuda()
    x = torch.randint(0, SMALL.vocab_size, (32, 128), device="cuda")
    peaks = {}
    for name, ac in (("plain", nullcontext()), ("checkpointed", memory.ActivationCheckpointing(model.encoder.layers))):
        model.zero_grad(set_to_none=True)
        with memory.track_peak("cuda") as mem, ac:
            train.lm_loss(model(x), x).backward()
        peaks[name] = mem.peak_increase_bytes
    # the layers keep ~5 KB per token without checkpointing, 0.5 KB with it: 4,096 tokens
    assert peaks["checkpointed"] < peaks["plain"] - 8 * MiB, peaks


@cuda
def test_cuda_release_memory_drops_gradients_and_the_cache():
    layer = torch.nn.Linear(1024, 1024).cuda()
    layer(torch.randn(64, 1024, device="cuda")).sum().backward()
    block = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    del block
    reserved = torch.cuda.memory_reserved()
    memory.release_memory("cuda", layer)
    assert layer.weight.grad is None and layer.bias.grad is None
    assert torch.cuda.memory_reserved() <= reserved - 64 * MiB


@cuda
def test_cuda_largest_batch_of_real_training_steps_in_a_budget():
    model, _, _ = _small_lm()
    model = model.cuda()
    optimizer = torch.optim.AdamW(model.parameters())

    def run(b):
        x = torch.randint(0, SMALL.vocab_size, (b, 64), device="cuda")
        train.train_step(model, optimizer, x, x)

    fits = memory.fits_in_memory(run, "cuda", release=[optimizer])
    assert fits(8)  # AdamW's state exists before the budget is set
    memory.release_memory("cuda")
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 256 * MiB) / total)
    try:
        search = memory.largest_batch(fits, start=8, limit=1 << 14, resolution=0.05)
        assert fits(search.largest), "after the failed attempts, the largest batch still runs"
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert 8 < search.largest < search.limit and any(not ok for _, ok in search.tried), search
    assert all(p.grad is None for p in model.parameters())


@cuda
def test_cuda_snapshot_carries_the_allocator_settings():
    snapshot = torch.cuda.memory._snapshot()
    assert isinstance(snapshot.get("allocator_settings"), dict), sorted(snapshot)
    assert memory.expandable_segments_enabled(snapshot) in (True, False)
