"""The training steps the course measures: the language-model step with every mixed-precision option in one place,
a whole step captured in a CUDA graph, and notebook 02's training runs (:func:`fit`: a stage trained from fixed
weights, with its loss and accuracy curves).

:func:`train_step` is the production step of notebook 03 (autocast, GradScaler, unscale before clipping) and the
step notebook 04 compiles; keeping it here means both measure the same code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

#: A loss of a model on a batch: ``loss_fn(model, inputs, targets) -> scalar tensor``.
LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of logits [B, T, V] against targets [B, T] (computed in fp32 by autocast)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``features @ weight.T + bias`` against ``targets``, one chunk of tokens at a time, with
    the gradients computed in forward (the gradient of cross-entropy with respect to the logits is
    softmax − one-hot, known as soon as a chunk's logits are): backward only scales them by the incoming gradient.

    ``grad_scale`` (None, a number or a 0-d tensor): the loss scale that backward's incoming gradient will carry (a
    GradScaler's). The logits' gradient is then made at that scale before its 16-bit cast, as the plain loss's
    backward would carry it, and the fp32 results are divided by it again."""

    @staticmethod
    def forward(ctx, features, weight, bias, targets, chunk_tokens, compute_dtype, need_grad, grad_scale=None):
        n = len(targets)
        # the 16-bit logit gradients: (softmax − one-hot) × factor; the fp32 results are divided by `unit`
        factor, unit = (None, n) if grad_scale is None else (grad_scale / n, grad_scale)
        w = weight.to(compute_dtype)
        b = bias.to(compute_dtype) if bias is not None else None
        total = torch.zeros((), device=features.device, dtype=torch.float32)
        grad_features = torch.empty_like(features) if need_grad else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_grad else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if need_grad and bias is not None else None
        for start in range(0, n, chunk_tokens):
            x, t = features[start:start + chunk_tokens].to(compute_dtype), targets[start:start + chunk_tokens]
            # One chunk's log-probabilities in fp32: [chunk, vocab]. At most 8 bytes per logit are alive at once
            # (the fp32 logits and their log-softmax); each name is dropped as soon as it is used up, so no tensor
            # of this chunk outlives it into the next one.
            logits = F.linear(x, w, b).float()  # the 16-bit result is freed by .float()
            log_probs = torch.log_softmax(logits, dim=-1)
            del logits
            total -= log_probs.gather(1, t[:, None]).sum()
            if need_grad:
                probs = log_probs.exp_()  # softmax, in place
                del log_probs
                probs[torch.arange(len(t), device=t.device), t] -= 1.0  # − one-hot: d(loss sum)/d(logits)
                if grad_bias is not None:
                    grad_bias += probs.sum(dim=0).div_(n)  # from the fp32 values: no second fp32 copy
                if factor is not None:
                    probs.mul_(factor)  # at the loss scale, as the plain loss's backward would carry them
                g = probs.to(compute_dtype)  # without a scale: the summed loss's gradient, n × the mean's
                del probs
                grad_features[start:start + chunk_tokens] = (g @ w).float().div_(unit).to(features.dtype)
                grad_weight += (g.t() @ x).float().div_(unit)
                del g
            else:
                del log_probs
        ctx.save_for_backward(grad_features, grad_weight, grad_bias)
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return total / n

    @staticmethod
    def backward(ctx, grad_loss):
        grad_features, grad_weight, grad_bias = ctx.saved_tensors
        weight_dtype, bias_dtype = ctx.dtypes
        return (grad_features * grad_loss.to(grad_features.dtype), (grad_weight * grad_loss).to(weight_dtype),
                (grad_bias * grad_loss).to(bias_dtype) if grad_bias is not None else None,
                None, None, None, None, None)


def chunked_lm_loss(features: torch.Tensor, head: nn.Linear, targets: torch.Tensor, *,
                    chunk_tokens: int = 2048, grad_scale: float | torch.Tensor | None = None) -> torch.Tensor:
    """:func:`lm_loss` of ``head(features)``, computed ``chunk_tokens`` tokens at a time, never holding the logits.

    The plain loss materialises the logits [tokens, vocabulary] and, for backward, keeps the log-probabilities:
    in fp32 without autocast; under CUDA autocast ``cross_entropy``'s log-softmax keeps them in 16 bits and
    ``nll_loss`` (on autocast's fp32 list) an fp32 copy of them besides. At 8,192 tokens × 50,000 words the fp32
    ones alone are 1.6 GB, however low the precision of the rest of the model. Here the head and the loss run one
    chunk of tokens at a time, and each chunk's gradients are computed right away in the forward pass (the gradient of
    cross-entropy with respect to the logits is softmax − one-hot): what is kept for backward is the gradient of
    the features and of the head's weights, and backward only scales them. The full logits never exist and
    nothing is recomputed; the matmuls are the plain loss's. Under autocast the matmuls run in autocast's dtype
    and the softmax in fp32, as autocast would; the value equals ``lm_loss(head(features), targets)`` up to
    rounding. Gradients are computed only when autograd needs them. One chunk's logits cost 8 bytes each while it
    runs (fp32 logits and their log-softmax), whatever the precision.

    **fp16 and the GradScaler.** The logits' gradients are cast to the compute dtype in the *forward* pass, before
    ``scaler.scale(loss).backward()`` multiplies anything: a GradScaler alone never lifts them out of fp16's
    underflow range. Pass the scale that backward will carry as ``grad_scale`` (a float or a 0-d device tensor;
    :func:`chunked_loss_fn` with ``scaler=`` does it without a host synchronisation): the 16-bit gradients are then
    made at that scale, exactly as the plain loss's backward would carry them, so the scaler protects them (and
    detects their overflow) as it does the plain loss's. Without it they are the summed loss's gradients, as if
    under a fixed loss scale of the token count. bf16 has fp32's range and needs neither.

    Raises:
        ValueError: for a non-positive ``chunk_tokens`` or features and targets of different token counts.
    """
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    flat, flat_targets = features.flatten(0, -2), targets.flatten()
    if len(flat) != len(flat_targets):
        raise ValueError(f"features hold {len(flat)} tokens but targets {len(flat_targets)}")
    device_type = flat.device.type
    compute_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else flat.dtype
    need_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (flat, head.weight,
                                                                                              head.bias))
    with torch.autocast(device_type, enabled=False):  # the dtypes are chosen above, as autocast would
        return _ChunkedLinearCrossEntropy.apply(flat, head.weight, head.bias, flat_targets, chunk_tokens,
                                                compute_dtype, need_grad, grad_scale)


def chunked_loss_fn(chunk_tokens: int = 2048, *, scaler: torch.amp.GradScaler | None = None) -> LossFn:
    """A ``loss_fn`` for :func:`train_step` computing :func:`chunked_lm_loss` on a model with ``features()`` and
    ``head`` (``utils.models.TransformerModel``).

    ``scaler``: the GradScaler of the fp16 step this loss trains with. Its current scale is read on the device
    (``scaler.scale(ones)``, no host synchronisation) and passed as ``grad_scale``, so the gradients the loss makes
    in its forward pass are scaled as the plain loss's would be (see :func:`chunked_lm_loss`)."""
    def loss_fn(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        grad_scale = None
        if scaler is not None and scaler.is_enabled():
            grad_scale = scaler.scale(torch.ones((), device=inputs.device))
        return chunked_lm_loss(model.features(inputs), model.head, targets, chunk_tokens=chunk_tokens,
                               grad_scale=grad_scale)

    return loss_fn


def default_loss_fn(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The plain loss: :func:`lm_loss` of the model's logits."""
    return lm_loss(model(inputs), targets)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    amp_dtype: torch.dtype | None = None,
    scaler: torch.amp.GradScaler | None = None,
    max_grad_norm: float | None = 1.0,
    loss_fn: LossFn = default_loss_fn,
) -> torch.Tensor:
    """One optimisation step of a language model; returns the loss as a detached device tensor (no sync).

    Args:
        amp_dtype: ``torch.float16`` or ``torch.bfloat16`` to run the forward pass under
            ``torch.autocast(device_type, dtype)``; None for full precision.
        scaler: a ``torch.amp.GradScaler`` (needed with fp16, whose small gradients underflow otherwise).
        max_grad_norm: clip the gradient norm to this (None: no clipping). With a scaler the gradients are
            unscaled first, so the threshold applies to the true gradients.
        loss_fn: ``loss_fn(model, inputs, targets)``; default the plain :func:`lm_loss` of the logits,
            ``chunked_loss_fn()`` for the one that never holds the full logits.
    """
    if amp_dtype not in (None, torch.float16, torch.bfloat16):
        raise ValueError(f"amp_dtype must be None, torch.float16 or torch.bfloat16, got {amp_dtype}")
    device_type = inputs.device.type
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device_type, dtype=amp_dtype, enabled=amp_dtype is not None):
        loss = loss_fn(model, inputs, targets)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)  # true gradients, so that clipping sees their real norm
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        scaler.step(optimizer)  # skipped if the unscaled gradients hold inf/NaN
        scaler.update()  # lower the scale after a skip, raise it after a run of good steps
    else:
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
    return loss.detach()


class GraphedStep:
    """A whole training step — forward, loss, backward and optimizer step — captured in a CUDA graph and replayed.

    Eager PyTorch launches every kernel of a step from Python, one by one; when the kernels are small the GPU
    waits for those launches (the step is *launch-bound*). A CUDA graph records the step's kernels once and
    replays all of them with a single launch. ``GraphedStep(model, optimizer, loss_fn)(x, y)`` runs one step on
    the batch and returns the loss as a device tensor (a static buffer that the next call overwrites: add it to
    a running total, or clone it, before calling again).

    Capture rules that it handles for you:

    * one graph per input shape (the last batch of an epoch is often smaller), each with its own memory pool;
    * warm-up steps on a side stream before capture (cuBLAS and autograd set-up must not be recorded) — their
      effect on the weights and the optimizer state is undone afterwards, so the first real call continues
      exactly where eager training would;
    * gradients are allocated inside the graph (``zero_grad(set_to_none=True)`` before capture), so each replay
      writes them afresh.

    The optimizer must be graph-safe: ``capturable=True`` (Adam, AdamW, ... keep their step count on the GPU and
    never read it on the host), with or without ``fused=True``; ``fused=True`` alone is not enough (``step()``
    refuses to be captured: "param_groups' capturable is False"). Dropout works (PyTorch's CUDA RNG is
    graph-aware). Inputs are copied into the graph's static buffers on every call: pass tensors already on the GPU.

    Raises:
        RuntimeError: on a model that is not on a CUDA device.
        ValueError: for an optimizer that is not graph-safe (without ``capturable=True``).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn, *, warmup: int = 3,
                 amp_dtype: torch.dtype | None = None) -> None:
        unsafe = [i for i, g in enumerate(optimizer.param_groups) if not g.get("capturable")]
        if unsafe:
            raise ValueError(f"the optimizer is not graph-safe (param groups {unsafe}): create it with "
                             "capturable=True (fused=True alone is not captured)")
        self.device = next(model.parameters()).device
        if self.device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA device; the model is on {self.device}")
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.warmup, self.amp_dtype = warmup, amp_dtype
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
            loss = self.loss_fn(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def _capture(self, x: torch.Tensor, y: torch.Tensor):
        params = {p: p.detach().clone() for p in [*self.model.parameters(), *self.model.buffers()]}
        state = {id(t): t.clone() for s in self.optimizer.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor)}
        static_x, static_y = x.clone(), y.clone()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self.optimizer.zero_grad(set_to_none=True)
                self._step(static_x, static_y)
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.optimizer.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_loss = self._step(static_x, static_y)
        with torch.no_grad():  # undo the warm-up steps: weights and buffers back, optimizer state as it was
            for p, saved in params.items():
                p.copy_(saved)
            for s in self.optimizer.state.values():
                for t in s.values():
                    if not isinstance(t, torch.Tensor):
                        continue
                    if id(t) in state:
                        t.copy_(state[id(t)])
                    else:  # created by the warm-up: a fresh optimizer starts from zeros (Adam's step, moments)
                        t.zero_()
        return graph, static_x, static_y, static_loss

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        key = (tuple(x.shape), x.dtype, tuple(y.shape), y.dtype)
        if key not in self.graphs:
            self.graphs[key] = self._capture(x, y)
        graph, static_x, static_y, static_loss = self.graphs[key]
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        return static_loss


# ── Training runs of notebook 02: a stage trained from fixed weights, its curves and its accuracy ───────────


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Test accuracy in percent on tensors already on the model's device, in one forward pass (eval mode)."""
    was_training = model.training
    model.eval()
    try:
        return 100.0 * (model(x).argmax(dim=1) == y).sum().item() / len(y)
    finally:
        model.train(was_training)


def standard_error(accuracy_pct: float, n_test: int) -> float:
    """One standard error, in percentage points, of an accuracy measured on ``n_test`` images (binomial)."""
    p = accuracy_pct / 100
    return 100 * (p * (1 - p) / n_test) ** 0.5


@dataclass
class TrainingRun:
    """What :func:`fit` trained: the model and optimizer, the mean training loss and the test accuracy after every
    epoch, and ``epoch()``: one more epoch of the same loop on the same model (what a timing calls)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    losses: list[float]
    accuracies: list[float]
    epoch: Callable[[], float]

    @property
    def accuracy(self) -> float:
        """Test accuracy after the last trained epoch, in percent."""
        return self.accuracies[-1]

    def weights(self) -> dict[str, torch.Tensor]:
        """A copy of the trained weights (taken before any later epoch changes them)."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def fit(
    epoch_fn: Callable[..., float],
    batches: Callable[[], Iterable] | Iterable,
    *,
    init_state: dict[str, torch.Tensor],
    epochs: int,
    test: tuple[torch.Tensor, torch.Tensor],
    device: torch.device | str,
    lr: float,
    model_fn: Callable[[], nn.Module] | None = None,
    desc: str | None = None,
    **adam_options,
) -> TrainingRun:
    """Train a fresh model from ``init_state`` for ``epochs`` epochs of ``epoch_fn(model, batches, optimizer)``
    (which returns the epoch's mean loss) with Adam(lr, **adam_options), and record the loss and the test
    accuracy (``test`` = (images, labels) on ``device``) after every epoch, with a progress bar.

    ``batches`` is a function that returns one epoch's batches per call, or something iterated once per epoch (a
    ``DataLoader``). Every version in notebook 02 starts from the same weights and, given batches shuffled by a
    generator of their own with the same seed, sees the same order: so their weights and accuracies compare.

    Raises:
        ValueError: for fewer than one epoch.
    """
    from tqdm.auto import tqdm

    from utils.models import MLP

    if epochs < 1:
        raise ValueError(f"fit() needs at least one epoch, got {epochs}")
    model = (model_fn or MLP)().to(device)
    model.load_state_dict(init_state)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, **adam_options)

    epoch_batches = batches if callable(batches) else lambda: batches

    def one_epoch() -> float:
        return epoch_fn(model, epoch_batches(), optimizer)

    losses, accuracies = [], []
    for _ in tqdm(range(epochs), desc=desc or getattr(epoch_fn, "__name__", "training"), leave=False):
        losses.append(one_epoch())
        accuracies.append(accuracy(model, *test))
    return TrainingRun(model, optimizer, losses, accuracies, one_epoch)


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> str:
    """'bit-identical' or 'equal within fp32 rounding' for two state dicts of one model trained the same way.

    Raises:
        AssertionError: when they differ beyond rounding (``torch.testing.assert_close``), naming the tensor.
    """
    if a.keys() != b.keys():
        raise AssertionError(f"different parameters: {sorted(a)} and {sorted(b)}")
    for name in a:
        torch.testing.assert_close(a[name], b[name], msg=lambda m, name=name: f"{name}: {m}")
    return "bit-identical" if all(torch.equal(a[n], b[n]) for n in a) else "equal within fp32 rounding"
