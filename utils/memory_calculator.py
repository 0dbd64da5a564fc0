"""A training step's memory predicted from sizes, before anything is allocated: the optimizer's state
(:func:`optimizer_state_bytes`, :data:`OPTIMIZER_STATE`), the activations of the course's Transformer
(:func:`transformer_activations`), and weights, gradients and the peak they add up to (:func:`predict_training_memory`
→ :class:`MemoryPrediction`), drawn as stacked bars beside what was measured (:func:`plot_stacked_memory`).

It is arithmetic on sizes and runs anywhere; the notebook puts every prediction against what the allocator
measured (``utils.memory.track_peak``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from utils.memory import format_bytes

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: What each optimizer :func:`optimizer_state_bytes` knows keeps, per parameter.
OPTIMIZER_STATE = {
    "sgd": "nothing (plain SGD)",
    "sgd_momentum": "one momentum buffer per value",
    "adam": "two moment estimates per value (exp_avg, exp_avg_sq)",
    "adamw": "two moment estimates per value (exp_avg, exp_avg_sq)",
    "adafactor": "a factored second moment: one value per row and per column of a matrix, one per value of a "
                 "vector; no momentum",
}
_STATE_VALUES_PER_VALUE = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2}

#: Parameters as :func:`optimizer_state_bytes` and :func:`predict_training_memory` take them: a model, tensors or
#: shapes, or just their number (not enough for Adafactor, whose state depends on the shapes).
Params = int | torch.nn.Module | Iterable[torch.Tensor | Sequence[int]]


def _param_shapes(params: Params) -> list[tuple[int, ...]] | None:
    """The shapes of trainable parameters, or None when only their number was given."""
    if isinstance(params, (bool, float)):
        raise TypeError(f"params must be a model, tensors, shapes or a number of values, got {params!r}")
    if isinstance(params, int):
        if params < 0:
            raise ValueError(f"a number of parameters cannot be negative, got {params}")
        return None
    if isinstance(params, torch.nn.Module):
        params = [p for p in params.parameters() if p.requires_grad]
    return [tuple(p.shape) if isinstance(p, torch.Tensor) else tuple(int(d) for d in p) for p in params]


def _param_count(params: Params) -> int:
    shapes = _param_shapes(params)
    return params if shapes is None else sum(math.prod(s) for s in shapes)  # type: ignore[return-value]


def optimizer_state_bytes(params: Params, optimizer: str = "adamw", *, bytes_per_value: int = 4) -> int:
    """Bytes of optimizer state for ``params`` (see :data:`OPTIMIZER_STATE`), at ``bytes_per_value`` per value.

    The state has the parameters' dtype (4 bytes for fp32). Step counters (one scalar per parameter tensor) are
    left out. ``adafactor`` needs the shapes (a model, tensors or shapes): for a matrix of r rows and c columns it
    keeps r + c values (``torch.optim.Adafactor``'s ``row_var`` and ``col_var``), for a vector one per value.

    Raises:
        ValueError: for an optimizer not in :data:`OPTIMIZER_STATE`, or ``adafactor`` given only a count.
    """
    if optimizer not in OPTIMIZER_STATE:
        raise ValueError(f"unknown optimizer {optimizer!r}: choose one of {sorted(OPTIMIZER_STATE)}")
    if optimizer != "adafactor":
        return _STATE_VALUES_PER_VALUE[optimizer] * _param_count(params) * bytes_per_value
    shapes = _param_shapes(params)
    if shapes is None:
        raise ValueError("adafactor's state depends on the parameters' shapes: pass the model, its parameters or "
                         "their shapes, not a count")
    values = 0
    for shape in shapes:
        if len(shape) >= 2:  # row_var: shape with the last dim 1; col_var: shape with the second-to-last dim 1
            values += math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]
        else:
            values += math.prod(shape)
    return values * bytes_per_value


@dataclass(frozen=True)
class ActivationEstimate:
    """What a forward pass keeps for backward (``saved``) and the short-lived buffers at the peak
    (``transient``), in bytes, each by what holds it. Build it with :func:`transformer_activations`."""

    saved: dict[str, int]
    transient: dict[str, int]

    @property
    def saved_bytes(self) -> int:
        return sum(self.saved.values())

    @property
    def transient_bytes(self) -> int:
        """The largest of the transient buffers: they live at different moments, so only one counts at the peak."""
        return max(self.transient.values(), default=0)


def transformer_activations(
    config: Any,
    batch: int,
    seq: int,
    *,
    amp: bool = False,
    checkpointing: str = "none",
    chunked_loss: bool = False,
    chunk_tokens: int = 2048,
    device_type: str = "cuda",
) -> ActivationEstimate:
    """Estimate the activation memory of one training step of ``utils.models.TransformerModel``.

    ``config`` is a ``TransformerConfig`` (anything with ``vocab_size``, ``d_model``, ``nhead``, ``num_layers``,
    ``dim_feedforward`` and ``dropout``). N = batch × seq tokens, D = d_model, F = dim_feedforward; matmul inputs
    and outputs take s = 4 bytes per value, 2 under 16-bit autocast (``amp=True``); the residual stream and the
    layer norms' inputs stay fp32 either way. Each post-norm ``TransformerEncoderLayer`` keeps, per token:

    * the in-projection's input, the attention's q, k, v and output (which is the out-projection's input), and
      the first linear layer's input: 6·D·s; the ReLU's output (the second linear layer's input): F·s;
    * the two layer norms' fp32 inputs, 8·D, and their mean and inverse deviation, 16; the attention's
      log-sum-exp, 4 per head.

    With dropout (``config.dropout > 0``) add its masks (one byte per value on a GPU: 2·D + F) and the second
    linear layer's separate input (F·s). This matches, to the byte, what autograd keeps with FlashAttention-style
    attention (FlashAttention, cuDNN, CPU flash); the memory-efficient kernel in fp32 keeps one more N·D copy per
    layer, and the math fallback (old GPUs, CPU with dropout) keeps the [seq × seq] attention matrix as well.

    ``checkpointing="full"`` (each layer under ``torch.utils.checkpoint``) keeps only each layer's fp32 input;
    backward recomputes one layer at a time (a transient of one layer's activations). ``"selective"`` keeps the
    layer inputs and the outputs of its four matmuls, 5·D·s + F·s per token, and recomputes the rest. Under
    autocast without checkpointing, the 16-bit copies of the matmul weights are kept too.

    The loss: the plain one keeps the fp32 log-probabilities, N·V·4 bytes (under CUDA autocast its log-softmax keeps
    16-bit log-probabilities and nll_loss an fp32 copy of them: N·V·(4 + s)), and its backward briefly adds the fp32
    gradients of log-probabilities and logits, N·V·8 (N·V·4 under autocast); the chunked one
    (``utils.train.chunked_lm_loss``) keeps the gradients it computed in the forward pass, of the features (N·D·4)
    and of the head (V·D·4), and holds one chunk's logits at a time, 8 bytes each whatever the precision (fp32
    logits and their log-softmax; under autocast also the head's 16-bit weight).

    Raises:
        ValueError: for a checkpointing mode other than "none", "full" or "selective", or non-positive sizes.
    """
    if checkpointing not in ("none", "full", "selective"):
        raise ValueError(f"checkpointing must be 'none', 'full' or 'selective', got {checkpointing!r}")
    if batch <= 0 or seq <= 0 or chunk_tokens <= 0:
        raise ValueError(f"batch, seq and chunk_tokens must be positive, got {batch}, {seq}, {chunk_tokens}")
    n, d, f, h = batch * seq, config.d_model, config.dim_feedforward, config.nhead
    v, layers, s = config.vocab_size, config.num_layers, 2 if amp else 4
    per_layer = n * (s * (6 * d + f) + 8 * d + 16 + 4 * h)
    if config.dropout > 0:
        per_layer += n * (s * f + 2 * d + f)
    layer_input = n * d * 4
    matmul_outputs = n * s * (5 * d + f)
    matmul_weights = layers * (4 * d * d + 2 * d * f)

    saved: dict[str, int] = {"embedding (token ids)": n * 8}
    transient: dict[str, int] = {}
    if checkpointing == "none":
        saved["layers"] = layers * per_layer
        if amp:
            saved["16-bit weight copies (autocast)"] = matmul_weights * 2
    else:
        kept = layer_input + (matmul_outputs if checkpointing == "selective" else 0)
        saved["layers (checkpointed)"] = layers * kept
        transient["one layer recomputed in backward"] = per_layer
    if chunked_loss:
        saved["chunked loss: gradients of features and head"] = n * d * 4 + (v * d + v) * 4
        chunk = min(chunk_tokens, n)
        transient["chunked loss: one chunk's logits"] = chunk * v * 8 + (v * d * s if amp else 0)
    else:
        saved["head input"] = n * d * s
        saved["loss: log-probabilities"] = n * v * 4 + (n * v * s if amp and device_type == "cuda" else 0) + n * 8
        if amp:
            saved["16-bit weight copies (autocast)"] = saved.get("16-bit weight copies (autocast)", 0) + v * d * 2
        transient["loss backward: gradients of log-probabilities and logits"] = n * v * (4 if amp else 8)
    return ActivationEstimate(saved, transient)


@dataclass(frozen=True)
class MemoryPrediction:
    """A training step's memory predicted from sizes, in bytes. Build it with :func:`predict_training_memory`.

    The parts do not all live at once: with ``zero_grad(set_to_none=True)`` the gradients appear during backward
    while the activations are freed, so :attr:`peak` (what the step needs at its worst moment) is below
    :attr:`sum_of_parts`.
    """

    weights: int
    gradients: int
    optimizer_state: int
    activations: int
    transient: int
    gradients_live_in_forward: bool = False  # zero_grad(set_to_none=False) keeps them allocated

    @property
    def parts(self) -> dict[str, int]:
        return {"weights": self.weights, "gradients": self.gradients, "optimizer state": self.optimizer_state,
                "activations": self.activations, "transient at the peak": self.transient}

    @property
    def static(self) -> int:
        """Weights, gradients and optimizer state: what stays between steps."""
        return self.weights + self.gradients + self.optimizer_state

    @property
    def sum_of_parts(self) -> int:
        return sum(self.parts.values())

    @property
    def peak(self) -> int:
        """The larger of: the end of the forward pass and the start of backward (weights, optimizer state,
        activations, the transient buffers, and the gradients only if they are kept through forward); the end of
        backward (weights, optimizer state and all gradients)."""
        forward = self.weights + self.optimizer_state + self.activations + self.transient
        if self.gradients_live_in_forward:
            forward += self.gradients
        return max(forward, self.static)

    def __str__(self) -> str:
        lines = [f"{name:22} {format_bytes(nbytes):>12}" for name, nbytes in self.parts.items()]
        lines.append(f"{'predicted peak':22} {format_bytes(self.peak):>12} (sum of the parts "
                     f"{format_bytes(self.sum_of_parts)})")
        return "\n".join(lines)


def predict_training_memory(
    params: Params,
    *,
    optimizer: str = "adamw",
    bytes_per_value: int = 4,
    activations: ActivationEstimate | int = 0,
    transient: int = 0,
    set_to_none: bool = True,
) -> MemoryPrediction:
    """Predict a training step's memory from the parameters, the optimizer and an activation estimate.

    Weights and gradients take ``bytes_per_value`` per parameter value (4: fp32; autocast keeps both fp32), the
    optimizer's state as :func:`optimizer_state_bytes` says; ``activations`` is a byte count or an
    :class:`ActivationEstimate` (whose transient buffers are added to ``transient``). ``set_to_none=False``
    (``zero_grad`` writing zeros) keeps the gradients allocated through the forward pass.

    The calculator behind the notebook's stacked bars: ``predict_training_memory(model, optimizer="adamw",
    activations=transformer_activations(config, 32, 256)).peak``.
    """
    if isinstance(activations, ActivationEstimate):
        transient += activations.transient_bytes
        activations = activations.saved_bytes
    if activations < 0 or transient < 0 or bytes_per_value <= 0:
        raise ValueError("activations and transient must be >= 0 and bytes_per_value > 0")
    values = _param_count(params)
    return MemoryPrediction(weights=values * bytes_per_value, gradients=values * bytes_per_value,
                            optimizer_state=optimizer_state_bytes(params, optimizer, bytes_per_value=bytes_per_value),
                            activations=int(activations), transient=int(transient),
                            gradients_live_in_forward=not set_to_none)


def plot_stacked_memory(bars: dict[str, dict[str, int]], *, title: str,
                        peaks: dict[str, int] | None = None, order: Sequence[str] | None = None) -> Figure:
    """One stacked bar per entry of ``bars`` (bar label → {part: bytes}); a part has the same colour in every
    bar, and a part missing from a bar counts as 0. ``peaks`` (bar label → bytes) draws each bar's peak as a
    black line across it: the parts of a training step do not all live at once, so the peak can lie below the
    top of the stack. ``order`` lists parts from the bottom of every stack up (parts it does not name follow, in
    order of first appearance); without it, the parts stack in order of first appearance across the bars, so a
    part missing from the first bar lands above all of that bar's parts. Returns a closed Figure."""
    import matplotlib.pyplot as plt

    seen = list(dict.fromkeys(part for stack in bars.values() for part in stack))
    parts = [part for part in dict.fromkeys(order or ()) if part in seen]
    parts += [part for part in seen if part not in parts]
    totals = [sum(max(0, v) for v in stack.values()) for stack in bars.values()]
    top = max([*totals, *(peaks or {}).values(), 1])
    unit, scale = ("GiB", 2**30) if top >= 2**30 else ("MiB", 2**20)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = list(bars)
    bottoms = [0.0] * len(labels)
    for i, part in enumerate(parts):
        heights = [max(0, bars[label].get(part, 0)) / scale for label in labels]
        ax.bar(labels, heights, bottom=bottoms, color=plt.get_cmap("tab10")(i % 10), label=part, width=0.55)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    for i, label in enumerate(labels):
        if peaks and label in peaks:
            ax.hlines(peaks[label] / scale, i - 0.36, i + 0.36, color="black", linewidth=2.2)
            # above the line, centred on its bar (beside it, the text ran into the next bar); a white box keeps it
            # legible over the parts stacked above the peak
            ax.annotate(f"peak {format_bytes(peaks[label])}", (i, peaks[label] / scale), xytext=(0, 2),
                        textcoords="offset points", ha="center", va="bottom", fontsize=8,
                        bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1.0})
    ax.set_ylabel(f"memory ({unit})")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.set_xlim(-0.6, len(labels) - 0.1)
    ax.set_ylim(0, 1.1 * top / scale)  # headroom: a peak label above the highest line stays inside the axes
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    plt.close(fig)
    return fig


def _shapes(config: Any) -> list[tuple[int, ...]]:
    """The parameter shapes of ``utils.models.TransformerModel(config)``, built on the meta device (no memory)."""
    from utils.models import TransformerModel

    with torch.device("meta"):
        return [tuple(p.shape) for p in TransformerModel(config).parameters()]


def predict_step_peak(config: Any, batch: int, seq: int, *, optimizer: str = "adamw", **activation_options) -> int:
    """The predicted peak of one training step of ``TransformerModel(config)`` at ``batch`` × ``seq`` tokens:
    :func:`predict_training_memory` of its parameters with :func:`transformer_activations` (``amp``,
    ``checkpointing``, ``chunked_loss``, ``chunk_tokens``, ``device_type``)."""
    estimate = transformer_activations(config, batch, seq, **activation_options)
    return predict_training_memory(_shapes(config), optimizer=optimizer, activations=estimate).peak


def largest_predicted_batch(config: Any, budget_bytes: int, seq: int, *, limit: int = 1 << 20, **options) -> int:
    """The largest batch whose :func:`predict_step_peak` fits in ``budget_bytes`` (0 if not even one sequence),
    by ``utils.out_of_memory.largest_batch`` on the prediction. It leaves out the CUDA context, the libraries'
    workspaces and the allocator's rounding and cache: expect a real search to find fewer."""
    from utils.out_of_memory import largest_batch

    return largest_batch(lambda b: predict_step_peak(config, b, seq, **options) <= budget_bytes, limit=limit).largest


def explorer(models: dict[str, Any], device: torch.device | str, *, batch: int, seq: int, chunk_tokens: int = 2048,
             amp_dtype: torch.dtype | None = None, show: bool = True) -> Any:
    """The calculator with controls (``utils.explore``): a model shape from ``models`` (label → TransformerConfig),
    the batch, the sequence length, the precision, the checkpointing, the loss and the optimizer → the predicted
    peak, part by part, against this device's memory. It runs once with its defaults (the output a static copy
    shows). On a GPU, *Measure on this GPU* runs two real steps with those settings (the first creates the
    optimizer's state) and puts the second step's peak (``max_memory_allocated`` above the start) beside the
    prediction, or reports the out-of-memory error, handled (``utils.out_of_memory.try_step``)."""
    from utils import explore
    from utils.checkpointing import MATMUL_OPS, ActivationCheckpointing
    from utils.env import capabilities, get_device
    from utils.memory import memory_stats, release_memory
    from utils.models import TransformerModel
    from utils.out_of_memory import try_step
    from utils.plot import table
    from utils.train import chunked_loss_fn, train_step

    dev = get_device(device)
    room = capabilities(dev).total_memory_bytes if dev.type == "cuda" else None
    precisions = {"fp32": None, **({str(amp_dtype).removeprefix("torch.") + " autocast": amp_dtype}
                                   if amp_dtype is not None else {})}
    optimizers = {"adamw": lambda p: torch.optim.AdamW(p, lr=1e-4),
                  "sgd_momentum": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
                  "sgd": lambda p: torch.optim.SGD(p, lr=1e-2), "adafactor": lambda p: torch.optim.Adafactor(p)}
    controls = {"model": explore.Choice(list(models)),
                "batch_size": explore.Slider(1, 512, value=batch, label="batch (sequences)"),
                "length": explore.Choice(sorted({seq, 128, 256, 512, 1024, 2048}), value=seq,
                                         label="tokens per sequence"),
                "precision": explore.Choice(list(precisions)),
                "checkpointing": explore.Choice(["none", "selective", "full"]),
                "chunked_loss": explore.Toggle(False, label="chunked loss"),
                "optimizer": explore.Choice(list(optimizers))}

    def predicted(model, batch_size, length, precision, checkpointing, chunked_loss, optimizer) -> MemoryPrediction:
        estimate = transformer_activations(models[model], batch_size, length, amp=precisions[precision] is not None,
                                           checkpointing=checkpointing, chunked_loss=chunked_loss,
                                           chunk_tokens=chunk_tokens, device_type=dev.type)
        return predict_training_memory(_shapes(models[model]), optimizer=optimizer, activations=estimate)

    def calculator(**settings) -> MemoryPrediction:
        prediction = predicted(**settings)
        table([{"part": part, "predicted": format_bytes(nbytes)} for part, nbytes in prediction.parts.items()],
              title=", ".join(f"{k} {v}" for k, v in settings.items()))
        print(f"predicted peak {format_bytes(prediction.peak)}" + (
            f": {prediction.peak / room:.0%} of this GPU's {format_bytes(room)}, "
            + ("fits, before the CUDA context and workspaces" if prediction.peak < room else "does not fit")
            if room else " (a CPU has no fixed memory to compare with)"))
        return prediction

    def measure(**settings) -> int | None:
        if dev.type != "cuda":
            print("Measuring needs a GPU: on a CPU the process's resident memory cannot single out one step.")
            return None
        prediction = predicted(**settings)
        release_memory(dev)
        start = memory_stats(dev).allocated_bytes
        net = TransformerModel(models[settings["model"]]).to(dev)
        opt = optimizers[settings["optimizer"]](net.parameters())
        options = {"amp_dtype": precisions[settings["precision"]]}
        if settings["chunked_loss"]:
            options["loss_fn"] = chunked_loss_fn(chunk_tokens)
        keep = None if settings["checkpointing"] != "selective" else [
            getattr(torch.ops.aten, name).default for name in MATMUL_OPS if hasattr(torch.ops.aten, name)]
        data = torch.randint(0, net.config.vocab_size, (settings["batch_size"], settings["length"] + 1), device=dev)
        peak: dict[str, int] = {}

        def two_steps() -> None:
            ac = ActivationCheckpointing(net.encoder.layers, save=keep, counting=False)
            with ac if settings["checkpointing"] != "none" else _nothing():
                train_step(net, opt, data[:, :-1], data[:, 1:], **options)  # creates the optimizer's state
                torch.cuda.reset_peak_memory_stats(dev)
                train_step(net, opt, data[:, :-1], data[:, 1:], **options)
                peak["bytes"] = torch.cuda.max_memory_allocated(dev) - start

        outcome = try_step(two_steps, dev, release=[opt])
        net = opt = data = None  # let go of the model, its state and the batch before emptying the cache
        release_memory(dev)
        if not outcome.ok:
            print(f"out of memory (handled, memory released): {outcome.error[:150]}")
            return None
        print(f"measured peak {format_bytes(peak['bytes'])}, predicted {format_bytes(prediction.peak)} "
              f"({peak['bytes'] / prediction.peak - 1:+.0%} against the prediction)")
        return peak["bytes"]

    return explore.explore(calculator, controls, actions={"Measure on this GPU": measure}, show=show)


def _nothing():
    from contextlib import nullcontext

    return nullcontext()
