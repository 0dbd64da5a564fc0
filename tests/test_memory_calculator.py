"""utils.memory_calculator: a training step's memory predicted from sizes, checked against what PyTorch really
allocates (the optimizers' state, what autograd keeps for backward: on CPU everywhere, on a GPU when one is
present), and the stacked-bar plot.
"""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.tiny_transformer import SMALL, small_lm
from utils import memory, memory_calculator, models, train  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")




@pytest.mark.parametrize("amp", [False, True])
def test_transformer_activations_match_what_autograd_keeps_on_cpu(amp):
    model, x, y = small_lm()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        loss = train.lm_loss(model(x), y)
    kept = sum(s.nbytes for s in memory.saved_tensors_by_op(loss, exclude=list(model.parameters())))
    estimate = memory_calculator.transformer_activations(SMALL, 4, 16, amp=amp, device_type="cpu")
    assert abs(estimate.saved_bytes - kept) <= 16  # the loss's 0-d weight and such
    assert estimate.transient_bytes == 4 * 16 * 512 * (4 if amp else 8)


def test_transformer_activations_shrink_with_each_technique():
    estimate, config = memory_calculator.transformer_activations, models.TransformerConfig(dropout=0.0)
    full = estimate(config, 32, 256)
    ckpt = estimate(config, 32, 256, checkpointing="full")
    sel = estimate(config, 32, 256, checkpointing="selective")
    chunked = estimate(config, 32, 256, chunked_loss=True)
    assert ckpt.saved_bytes < sel.saved_bytes < full.saved_bytes
    assert chunked.saved_bytes < full.saved_bytes and chunked.transient_bytes < full.transient_bytes
    n = 32 * 256
    assert ckpt.saved["layers (checkpointed)"] == 6 * n * 512 * 4  # each layer's fp32 input
    dropout = estimate(models.TransformerConfig(dropout=0.1), 32, 256)
    assert dropout.saved["layers"] - full.saved["layers"] == 6 * n * (4 * 2048 + 2 * 512 + 2048)
    with pytest.raises(ValueError, match="checkpointing"):
        estimate(SMALL, 1, 1, checkpointing="some")
    with pytest.raises(ValueError, match="positive"):
        estimate(SMALL, 0, 16)


@pytest.mark.parametrize(("name", "make"), [
    ("sgd", lambda p: torch.optim.SGD(p, lr=0.1)),
    ("sgd_momentum", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
    ("adam", lambda p: torch.optim.Adam(p)),
    ("adamw", lambda p: torch.optim.AdamW(p)),
    ("adafactor", lambda p: torch.optim.Adafactor(p)),
])
def test_optimizer_state_bytes_equals_what_the_optimizer_allocates(name, make):
    model, x, y = small_lm()
    optimizer = make(model.parameters())
    train.lm_loss(model(x), y).backward()
    optimizer.step()
    allocated = sum(t.nbytes for state in optimizer.state.values() for t in state.values()
                    if isinstance(t, torch.Tensor) and t.dim() > 0)  # 0-d step counters left out
    assert memory_calculator.optimizer_state_bytes(model, name) == allocated


def test_optimizer_state_bytes_bad_input():
    with pytest.raises(ValueError, match="unknown optimizer"):
        memory_calculator.optimizer_state_bytes(10, "lion")
    with pytest.raises(ValueError, match="shapes"):
        memory_calculator.optimizer_state_bytes(10, "adafactor")
    with pytest.raises(ValueError, match="negative"):
        memory_calculator.optimizer_state_bytes(-1)
    with pytest.raises(TypeError, match="params"):
        memory_calculator.optimizer_state_bytes(1.5)
    assert memory_calculator.optimizer_state_bytes([(3, 4), (4,)], "adafactor") == (3 + 4 + 4) * 4


def test_predict_training_memory_parts_and_peak():
    estimate = memory_calculator.ActivationEstimate(saved={"a": 1000}, transient={"loss": 300, "layer": 500})
    p = memory_calculator.predict_training_memory(100, optimizer="adamw", activations=estimate)
    assert (p.weights, p.gradients, p.optimizer_state, p.activations, p.transient) == (400, 400, 800, 1000, 500)
    assert p.static == 1600 and p.sum_of_parts == 3100
    assert p.peak == 400 + 800 + 1000 + 500  # the gradients are not there yet at the start of backward
    kept = memory_calculator.predict_training_memory(100, activations=estimate, set_to_none=False)
    assert kept.peak == p.peak + 400
    tiny = memory_calculator.predict_training_memory(100, optimizer="sgd")
    assert tiny.peak == tiny.static == 800  # the end of backward: weights and gradients
    assert "predicted peak" in str(p) and "optimizer state" in p.parts
    model, _, _ = small_lm()
    assert memory_calculator.predict_training_memory(model).weights == 4 * models.count_parameters(model)
    with pytest.raises(ValueError):
        memory_calculator.predict_training_memory(10, activations=-1)


def test_plot_stacked_memory_stacks_parts_and_marks_peaks(tmp_path):
    bars = {"predicted": {"weights": 2**30, "activations": 2 * 2**30},
            "measured": {"weights": 2**30, "activations": 2**30, "cache": 2**29}}
    fig = memory_calculator.plot_stacked_memory(bars, peaks={"measured": 2 * 2**30}, title="anatomy")
    ax = fig.axes[0]
    assert ax.get_title() == "anatomy" and "GiB" in ax.get_ylabel()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["weights", "activations", "cache"]
    assert len(ax.patches) == 6  # every part in every bar (0 where missing)
    assert any("peak 2.00 GiB" in t.get_text() for t in ax.texts)
    fig.savefig(tmp_path / "stack.png")


def test_plot_stacked_memory_peak_labels_stay_over_their_own_bar():
    """Notebook 05: a label beside the peak line ran into the next bar; it sits above the line, centred."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    bars = {"predicted": {"weights": 2**30, "activations": 6 * 2**30},
            "measured": {"weights": 2**30, "activations": 6 * 2**30, "cache": 2**30}}
    peaks = {"predicted": int(6.5 * 2**30), "measured": 8 * 2**30}  # the measured one at the top of its stack
    fig = memory_calculator.plot_stacked_memory(bars, peaks=peaks, title="anatomy")
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    ax, renderer = fig.axes[0], canvas.get_renderer()
    to_data = ax.transData.inverted()
    bar_edges = sorted({round(p.get_x(), 6) for p in ax.patches} | {round(p.get_x() + p.get_width(), 6)
                                                                   for p in ax.patches})
    labels = [t for t in ax.texts if t.get_text().startswith("peak ")]
    assert len(labels) == 2
    for i, (label, peak) in enumerate(zip(labels, peaks.values(), strict=True)):
        (x0, y0), (x1, y1) = to_data.transform(label.get_window_extent(renderer).get_points())
        left, right = bar_edges[2 * i], bar_edges[2 * i + 1]  # this bar's edges
        assert left <= x0 and x1 <= right, f"{label.get_text()} runs out of its bar ({x0:.2f}–{x1:.2f})"
        assert y0 >= peak / 2**30, "above the peak line, not across it"
        assert y1 <= ax.get_ylim()[1], "inside the axes, not over the title"


def test_plot_stacked_memory_order_puts_a_part_missing_from_the_first_bar_in_place():
    # Notebook 05: the predicted bar has no "workspace"; without order it would stack above "gradients".
    bars = {"predicted": {"weights": 2**30, "gradients": 2**30},
            "measured": {"weights": 2**30, "workspace": 2**28, "gradients": 2**30}}
    default = memory_calculator.plot_stacked_memory(bars, title="default").axes[0]
    assert [t.get_text() for t in default.get_legend().get_texts()] == ["weights", "gradients", "workspace"]
    ax = memory_calculator.plot_stacked_memory(bars, title="ordered",
                                               order=["weights", "workspace", "unused", "gradients"]).axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["weights", "workspace", "gradients"]
    # patches go part by part, bar by bar: the measured bar's gradients start on top of its workspace
    measured_gradients = ax.patches[5]
    assert measured_gradients.get_y() == 1.0 + 0.25 and measured_gradients.get_height() == 1.0
    # parts that order does not name still appear, after the named ones
    partial = memory_calculator.plot_stacked_memory(bars, title="partial", order=["gradients"]).axes[0]
    assert [t.get_text() for t in partial.get_legend().get_texts()] == ["gradients", "weights", "workspace"]


# --- on a real GPU --------------------------------------------------------------------------------


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
    predicted = memory_calculator.predict_training_memory(model, optimizer="adamw")
    assert weights == pytest.approx(predicted.weights, rel=0.01)
    assert gradients == pytest.approx(predicted.gradients, rel=0.01)
    assert state == pytest.approx(predicted.optimizer_state, rel=0.01)


@cuda
@pytest.mark.parametrize("amp", [False, True])
def test_cuda_transformer_activations_match_what_autograd_keeps(amp):
    # The docstring's claim on a GPU: to the byte with FlashAttention-style kernels; the memory-efficient kernel
    # (fp32) keeps one more N×D copy per layer. Allowed on top: attention kernels pad the log-sum-exp to 32
    # positions and keep two RNG-state scalars.
    model, x, y = small_lm()
    model, x, y = model.cuda(), x.cuda(), y.cuda()
    dtype = torch.bfloat16 if torch.cuda.get_device_capability() >= (8, 0) else torch.float16
    with torch.autocast("cuda", dtype=dtype, enabled=amp):
        loss = train.lm_loss(model(x), y)
    kept = sum(s.nbytes for s in memory.saved_tensors_by_op(loss, exclude=list(model.parameters())))
    estimate = memory_calculator.transformer_activations(SMALL, 4, 16, amp=amp, device_type="cuda").saved_bytes
    n, value_bytes = 4 * 16, 2 if amp else 4
    slack = SMALL.num_layers * (n * SMALL.d_model * value_bytes + 4 * SMALL.nhead * 32 * 4 + 64)
    assert estimate - 64 <= kept <= estimate + slack, (kept, estimate)


def test_largest_predicted_batch_is_the_last_that_fits():
    budget = 64 * 2**20
    for options in ({}, {"amp": True, "checkpointing": "full", "chunked_loss": True, "chunk_tokens": 64}):
        best = memory_calculator.largest_predicted_batch(SMALL, budget, 64, **options)
        assert best > 0
        assert memory_calculator.predict_step_peak(SMALL, best, 64, **options) <= budget
        assert memory_calculator.predict_step_peak(SMALL, best + 1, 64, **options) > budget
    assert memory_calculator.largest_predicted_batch(SMALL, 1, 64) == 0


def test_explorer_runs_with_its_defaults_and_measures_only_on_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU branch")
    explorer = memory_calculator.explorer({"small": SMALL}, "cpu", batch=4, seq=16, amp_dtype=torch.bfloat16,
                                          show=False)
    assert explorer.result.peak == memory_calculator.predict_step_peak(SMALL, 4, 16, device_type="cpu")
    assert "predicted peak" in capsys.readouterr().out
    default = explorer.result
    assert explorer.run("Measure on this GPU") is None and explorer.error is None
    assert "Measuring needs a GPU" in capsys.readouterr().out
    settings = explorer.values | {"precision": "bfloat16 autocast", "checkpointing": "selective", "chunked_loss": True}
    assert explorer.fn(**settings).peak < default.peak
