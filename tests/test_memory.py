"""utils.memory: byte formatting, CPU and CUDA memory numbers, peak tracking, what autograd keeps for backward,
memory over one training step, releasing memory.

The CPU tests run everywhere. The CUDA logic is tested on CPU against stand-ins for the torch.cuda calls (so a
wrong call order or argument fails here too), and for real by the tests marked ``cuda`` when a GPU is present.
"""

import json
import subprocess
import sys
from functools import partial
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.tiny_transformer import SMALL, small_lm
from utils import memory, memory_calculator, models, train  # noqa: E402

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


_TRACK_A_200_MB_TENSOR = """
import json, torch
from utils import memory
with memory.track_peak("cpu") as mem:
    x = torch.randn(50 * 1000**2)  # 200 MB of float32, every page written
    del x
print(json.dumps({**vars(mem), "text": str(mem)}))
"""


@pytest.mark.skipif(not LINUX_PROC, reason="reads /proc (Linux)")
def test_track_peak_cpu_sees_a_200_mb_tensor():
    # In a fresh process: after a long test session the C library can serve the tensor from freed memory the
    # process still holds, and RSS does not move (CI once measured a rise of 0 at an RSS of 2.4 GB).
    out = subprocess.run([sys.executable, "-c", _TRACK_A_200_MB_TENSOR], capture_output=True, text=True, timeout=120,
                         cwd=Path(memory.__file__).resolve().parent.parent, check=True).stdout
    mem = json.loads(out.splitlines()[-1])
    assert mem["device"] == "cpu"
    assert mem["peak_increase_bytes"] >= 190 * MB
    assert mem["peak_bytes"] == mem["start_bytes"] + mem["peak_increase_bytes"]
    assert mem["end_bytes"] > 0 and "RSS" in mem["what"]
    assert memory.format_bytes(mem["peak_bytes"]) in mem["text"]


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


# --- CUDA logic, against stand-ins for torch.cuda -------------------------------------------------


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


_RELEASE_A_CACHED_BLOCK = """
import json, torch
from utils import memory
layer = torch.nn.Linear(1024, 1024).cuda()
layer(torch.randn(64, 1024, device="cuda")).sum().backward()
allocated = torch.cuda.memory_allocated()
block = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
del block
reserved = torch.cuda.memory_reserved()
memory.release_memory("cuda", layer)
print(json.dumps({"grads": [p.grad is not None for p in layer.parameters()], "allocated": allocated,
                  "allocated_after": torch.cuda.memory_allocated(), "reserved": reserved,
                  "reserved_after": torch.cuda.memory_reserved()}))
"""


@cuda
def test_cuda_release_memory_drops_gradients_and_the_cache():
    # In a fresh process: in a long test session (pytest -n 4 on an H100) the 64 MiB block came from a segment
    # earlier tests had left cached and still partly in use, which empty_cache cannot give back.
    out = subprocess.run([sys.executable, "-c", _RELEASE_A_CACHED_BLOCK], capture_output=True, text=True,
                         timeout=120, cwd=Path(memory.__file__).resolve().parent.parent, check=True).stdout
    seen = json.loads(out.splitlines()[-1])
    assert seen["grads"] == [False, False]
    assert seen["allocated_after"] <= seen["allocated"] - (1024 * 1024 + 1024) * 4  # the gradients' bytes
    assert seen["reserved_after"] <= seen["reserved"] - 64 * MiB


# --- what autograd keeps for backward -------------------------------------------------------------


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


# --- memory over one step -------------------------------------------------------------------------




def test_trace_step_memory_reads_every_phase_in_order(tmp_path):
    model, x, y = small_lm()
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
    # MiB or GiB by the peak: on a CPU that is the test process's whole RSS, which depends on what ran before
    assert fig.axes[0].get_title() == "one step" and fig.axes[0].get_ylabel() in ("memory (MiB)", "memory (GiB)")
    fig.savefig(tmp_path / "trace.png")


@cuda
def test_cuda_trace_step_memory_rises_in_forward_and_falls_in_backward():
    model, x, y = small_lm()
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


# --- a step's parts, variants checked against a baseline, forward passes, optimizers (notebook 05) ---------------

def _new_model():
    torch.manual_seed(0)
    return models.TransformerModel(SMALL)


def _batch():
    gen = torch.Generator().manual_seed(0)
    return (torch.randint(0, SMALL.vocab_size, (4, 16), generator=gen),
            torch.randint(0, SMALL.vocab_size, (4, 16), generator=gen))


def test_measure_step_parts_reads_every_phase_on_cpu():
    x, y = _batch()
    parts = memory.measure_step_parts(_new_model, partial(torch.optim.AdamW, lr=1e-3), x, y, "cpu")
    assert list(parts.parts) == ["weights", "activations", "optimizer state", "gradients", "transient at the peak"]
    assert parts.cache_bytes is None and parts.outside_bytes is None and parts.peak_bytes >= 0
    predicted = memory_calculator.predict_training_memory(_new_model(), activations=1000)
    rows = parts.rows(predicted)
    assert [r["part"] for r in rows][-1] == "peak of a step" and all(r["measured / predicted"] == "—" for r in rows)
    assert "resident set size" in parts.check(predicted)  # a CPU says what RSS is instead of comparing


def test_step_parts_check_holds_the_exact_parts_to_the_prediction():
    predicted = memory_calculator.MemoryPrediction(weights=1000, gradients=1000, optimizer_state=2000,
                                                   activations=5000, transient=100)
    exact = {"weights": 1010, "gradients": 1000, "optimizer state": 2000, "activations": 6000,
             "transient at the peak": 0}
    parts = memory.StepParts("cuda:0", exact, 9000, 9000, 0, 0, "allocator")
    assert "within 1.0% (weights)" in parts.check(predicted)
    assert parts.rows(predicted)[0]["measured / predicted"] == "1.01"
    off = memory.StepParts("cuda:0", exact | {"optimizer state": 3000}, 9000, 9000, 0, 0, "allocator")
    with pytest.raises(AssertionError, match="optimizer state"):
        off.check(predicted)


def test_trace_summary_reads_the_end_of_forward_the_highest_and_the_last():
    trace = memory.MemoryTrace("cuda:0", "allocator", ["start", "layer 0", "head", "head", "optimizer step"],
                               ["start", "forward", "forward", "backward", "optimizer"],
                               [100, 300, 600, 500, 150])
    text = trace.summary(peak_increase_bytes=900)
    assert "500 B at the end of the forward pass" in text and "(head, forward)" in text
    assert "50 B at the last (optimizer step)" in text and "900 B above the start" in text


def _plain(model, optimizer, inputs, targets, **options):
    return train.train_step(model, optimizer, inputs, targets, **options)


def _no_update(model, optimizer, inputs, targets):
    optimizer.zero_grad(set_to_none=True)
    loss = train.lm_loss(model(inputs), targets)
    loss.backward()
    return loss.detach()  # forgets optimizer.step()


def _doubled_loss(model, optimizer, inputs, targets):
    return train.train_step(model, optimizer, inputs, targets, loss_fn=lambda m, i, t: 2 * train.lm_loss(m(i), t),
                            max_grad_norm=None)


def _accumulated(model, optimizer, inputs, targets):
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for xs, ys in zip(inputs.chunk(2), targets.chunk(2), strict=True):
        loss = train.lm_loss(model(xs), ys) / 2
        loss.backward()
        total += loss.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return torch.tensor(total)


def test_check_steps_accepts_equivalent_variants_and_says_what_it_checked():
    x, y = _batch()
    adamw = partial(torch.optim.AdamW, lr=1e-3)
    variants = {"baseline": (adamw, _plain),
                "chunked loss": (adamw, partial(_plain, loss_fn=train.chunked_loss_fn(16))),
                "accumulated": (adamw, _accumulated),
                "bf16": (adamw, partial(_plain, amp_dtype=torch.bfloat16)),
                "Adafactor": (torch.optim.Adafactor, _plain)}
    checks = memory.check_steps(variants, _new_model, x, y, "cpu", low_precision=["bf16"], own_update=["Adafactor"])
    kinds = {label: c.kind for label, c in checks.checks.items()}
    assert kinds == {"baseline": "reference", "chunked loss": "exact", "accumulated": "exact", "bf16": "low precision",
                     "Adafactor": "own update"}
    assert len(checks.checks["Adafactor"].grad_errors) == 1 and checks.checks["Adafactor"].update_error is None
    assert len(checks.checks["chunked loss"].grad_errors) == 2 and checks.checks["chunked loss"].update_error < 3e-3
    assert checks.baseline == "baseline" and checks.peak("accumulated") >= 0
    assert [r["variant"] for r in checks.rows()] == list(variants)
    summary = checks.summary()
    assert summary.startswith("✅ 4 variants") and "2 × the loss and gradients of both steps and the weights' change" \
        in summary and "1 × the first step's" in summary


@pytest.mark.parametrize(("variant", "message"), [(_no_update, "did not fall|loss is|gradients are"),
                                                   (_doubled_loss, "step 1's loss")])
def test_check_steps_rejects_a_variant_that_computes_something_else(variant, message):
    x, y = _batch()
    adamw = partial(torch.optim.AdamW, lr=1e-3)
    with pytest.raises(AssertionError, match=message):
        memory.check_steps({"baseline": (adamw, _plain), "broken": (adamw, variant)}, _new_model, x, y, "cpu")


def test_check_steps_catches_an_optimizer_that_updates_differently():
    x, y = _batch()
    adamw = partial(torch.optim.AdamW, lr=1e-3)
    sgd = partial(torch.optim.SGD, lr=1e-3)  # the same first gradients, another update
    with pytest.raises(AssertionError, match="step 2|update"):
        memory.check_steps({"baseline": (adamw, _plain), "sgd": (sgd, _plain)}, _new_model, x, y, "cpu")


def test_forward_memory_measures_each_mode_and_checks_the_outputs():
    x, _ = _batch()
    model = _new_model().eval()
    modes = {"gradients enabled": torch.enable_grad, "no_grad": torch.no_grad}
    passes = memory.forward_memory(model, x, modes, "cpu")
    assert set(passes.peaks) == set(passes.held) == set(passes.calls) == set(modes)
    assert passes.calls["no_grad"]().requires_grad is False
    assert [r["mode"] for r in passes.rows()] == list(modes)
    with pytest.raises(AssertionError, match="differs"):
        memory.forward_memory(model, x, {"fp32": torch.no_grad,
                                         "bf16": partial(torch.autocast, "cpu", dtype=torch.bfloat16)}, "cpu")


def test_optimizer_memory_counts_each_optimizers_state():
    x, y = _batch()
    rows = memory.optimizer_memory(_new_model, {"AdamW": partial(torch.optim.AdamW, lr=1e-3),
                                                "SGD": partial(torch.optim.SGD, lr=1e-3)}, x, y, "cpu")
    n = sum(p.numel() for p in _new_model().parameters())
    assert rows[0]["state"] == memory.format_bytes(8 * n) and rows[1]["state"] == "0 B"
    assert rows[0]["step()'s temporaries"].endswith("(RSS)")
