"""Checks for the exercises of notebook 03 · Mixed precision with torch.amp."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from utils.exercises import Miss, exercise

_FP16_NORMAL = torch.finfo(torch.float16).smallest_normal


def _is_fp16_normal(value: float) -> bool:
    """Does fp16 store ``value`` as a normal number (not flushed, not subnormal)? Asked of PyTorch's own fp16."""
    stored = torch.tensor(value, dtype=torch.float32).to(torch.float16).float().item()
    return stored >= _FP16_NORMAL


@exercise("1 · Loss scale")
def min_loss_scale(answer) -> str:
    """``answer(g)``: the smallest power-of-two loss scale that lifts a gradient of size g to fp16's normal range."""
    for g in (2e-9, 3e-8, 1.7e-6):
        scale = answer(g)
        if scale is None:
            raise NotImplementedError("min_loss_scale returns None: return the scale")
        scale = float(scale)
        if scale <= 0 or not math.isfinite(scale) or not math.log2(scale).is_integer():
            raise Miss(f"for g = {g:g} it returns {scale:g}, not a power of two: scaling by a power of two only "
                       "changes the exponent, so it is exact and undone exactly by unscale_")
        if not _is_fp16_normal(g * scale):
            raise Miss(f"g = {g:g} times {scale:g} is still below fp16's smallest normal number: too small a scale")
        if _is_fp16_normal(g * scale / 2):
            raise Miss(f"for g = {g:g}, half of {scale:g} already lifts it into fp16's normal range: not the smallest")
    return "the smallest power of two each time (checked by storing g·S in PyTorch's fp16)."


_OPS = {
    "matmul": lambda a, b, labels: a @ b,
    "linear": lambda a, b, labels: F.linear(a, b),
    "cross_entropy": lambda a, b, labels: F.cross_entropy(a @ b, labels),
    "matmul + fp32 tensor": lambda a, b, labels: a @ b + a,
    "softmax": lambda a, b, labels: F.softmax(a @ b, dim=-1),
    "layer_norm": lambda a, b, labels: F.layer_norm(a @ b, (a.shape[1],)),
    "relu": lambda a, b, labels: F.relu(a @ b),
}


@exercise("2 · Predict autocast")
def predict_autocast(answer, *, device: torch.device | str = "cpu", amp_dtype: torch.dtype | None = None) -> str:
    """``answer(device_type, amp_dtype)`` returns {operation: output dtype} for the operations of ``_OPS`` run on
    fp32 inputs under ``torch.autocast(device_type, dtype=amp_dtype)``; the check runs them and compares."""
    device = torch.device(device)
    amp_dtype = amp_dtype or torch.bfloat16
    predicted = answer(device.type, amp_dtype)
    if predicted is None:
        raise NotImplementedError("predict_autocast returns None: return a dict")
    missing = sorted(set(_OPS) - set(predicted))
    if missing:
        raise Miss(f"no prediction for {missing}; predict every one of {list(_OPS)}")
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(32, 32, device=device, generator=gen)
    b = torch.randn(32, 32, device=device, generator=gen)
    labels = torch.randint(0, 32, (32,), device=device, generator=gen)
    with torch.autocast(device.type, dtype=amp_dtype):
        actual = {name: op(a, b, labels).dtype for name, op in _OPS.items()}
    wrong = [f"{name}: you said {str(predicted[name]).removeprefix('torch.')}, autocast on {device.type} returns "
             f"{str(dtype).removeprefix('torch.')}" for name, dtype in actual.items() if predicted[name] != dtype]
    if wrong:
        hint = (" (CUDA's fp32 list is longer than the CPU's: softmax and layer_norm stay fp32 only on CUDA)"
                if device.type == "cpu" else "")
        raise Miss("; ".join(wrong) + hint)
    return f"all {len(_OPS)} output dtypes right for autocast on {device.type} with {amp_dtype}."


def _tiny_model_and_batch(device: torch.device):
    from utils import data, models

    config = models.TransformerConfig(vocab_size=64, d_model=32, nhead=2, num_layers=1, dim_feedforward=64,
                                      dropout=0.0)
    gen = torch.Generator(device=device).manual_seed(0)
    x, y = data.patterned_tokens(4, 16, 64, device=device, generator=gen)
    torch.manual_seed(0)
    return models.TransformerModel(config).to(device), x, y


def _clip_before_unscale(model, optimizer, scaler, inputs, targets, max_norm=1.0):
    from utils import train

    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(inputs.device.type, dtype=torch.float16):
        loss = train.lm_loss(model(inputs), targets)
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    return loss.detach()


@exercise("3 · The step, in order")
def amp_step(answer, *, device: torch.device | str = "cpu") -> str:
    """``answer(model, optimizer, scaler, inputs, targets, max_norm)`` must update exactly as the course's
    production step ``utils.train.train_step`` (fp16 autocast, scaler, clipping) does, with plain SGD, whose
    update is proportional to the gradient, so a clip applied to the scaled gradients shows."""
    from utils import train

    device = torch.device(device)

    def reference(model, optimizer, scaler, x, y, max_norm):
        return train.train_step(model, optimizer, x, y, amp_dtype=torch.float16, scaler=scaler,
                                max_grad_norm=max_norm)

    runs = {}
    for name, step in (("yours", answer), ("reference", reference), ("clipped before unscale_", _clip_before_unscale)):
        model, x, y = _tiny_model_and_batch(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        scaler = torch.amp.GradScaler(device.type)
        for _ in range(3):
            try:
                loss = step(model, optimizer, scaler, x, y, 0.1)
            except RuntimeError as err:
                if "after step()" in str(err):
                    raise Miss("the scaler complains that unscale_() came after step() of the previous step: call "
                               "scaler.update() once per step, after scaler.step") from None
                raise
            if loss is None and name == "yours":
                raise NotImplementedError("my_amp_step returns None: return the loss")
        runs[name] = ([p.detach().clone() for p in model.parameters()], scaler.get_scale())

    def same(a, b):
        return all(torch.allclose(p, q, rtol=1e-4, atol=1e-6) for p, q in zip(a[0], b[0], strict=True))

    if same(runs["yours"], runs["reference"]) and runs["yours"][1] == runs["reference"][1]:
        return "three steps give the same weights and loss scale as utils.train.train_step."
    if same(runs["yours"], runs["clipped before unscale_"]):
        raise Miss("you clip the scaled gradients: call scaler.unscale_(optimizer) before clip_grad_norm_, or "
                   "the threshold applies to gradients S times too large")
    if runs["yours"][1] != runs["reference"][1]:
        raise Miss(f"the loss scale ends at {runs['yours'][1]:g}, the production step's at {runs['reference'][1]:g}: "
                   "call scaler.update() once per step, after scaler.step")
    raise Miss("after three steps the weights differ from the production step's: check the order — zero_grad, "
               "forward and loss under autocast, scale(loss).backward(), unscale_, clip, step, update")
