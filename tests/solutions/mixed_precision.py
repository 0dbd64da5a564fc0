"""Solutions to notebook 03's exercises."""

import math

import torch

from utils import train
from utils.exercises.mixed_precision import _clip_before_unscale  # the check knows this wrong answer by name


def min_loss_scale(g):
    return 2.0 ** math.ceil(math.log2(torch.finfo(torch.float16).smallest_normal / g))


def predict_autocast(device_type, amp_dtype):
    stays_fp32_on_cuda = torch.float32 if device_type == "cuda" else amp_dtype  # CUDA's fp32 list is longer
    return {"matmul": amp_dtype, "linear": amp_dtype, "cross_entropy": torch.float32,
            "matmul + fp32 tensor": torch.float32, "softmax": stays_fp32_on_cuda, "layer_norm": stays_fp32_on_cuda,
            "relu": amp_dtype}


def my_amp_step(model, optimizer, scaler, inputs, targets, max_norm=1.0):
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(inputs.device.type, dtype=torch.float16):
        loss = train.lm_loss(model(inputs), targets)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    return loss.detach()


def _no_update(model, optimizer, scaler, inputs, targets, max_norm=1.0):
    """The solution with scaler.update() forgotten."""
    scaler.update = lambda *args, **kwargs: None
    return my_amp_step(model, optimizer, scaler, inputs, targets, max_norm)


CASES = {
    "min_loss_scale": ([min_loss_scale], [
        ("rounds the exponent down", [lambda g: 2.0 ** math.floor(math.log2(torch.finfo(torch.float16).smallest_normal
                                                                            / g))], "too small"),
        ("returns the exact ratio", [lambda g: torch.finfo(torch.float16).smallest_normal / g], "power of two"),
        ("one power too many", [lambda g: 2 * min_loss_scale(g)], "not the smallest"),
    ]),
    "predict_autocast": ([predict_autocast], [
        ("everything in 16 bits", [lambda d, amp: {k: amp for k in predict_autocast(d, amp)}], "cross_entropy"),
        ("CUDA's lists on any device", [lambda d, amp: predict_autocast("cuda", amp)], "softmax"),
        ("forgets an operation", [lambda d, amp: {"matmul": amp}], "no prediction"),
    ]),
    "amp_step": ([my_amp_step], [
        ("clips before unscaling", [_clip_before_unscale], "unscale_"),
        ("never updates the scale", [_no_update], "scaler.update()"),
    ]),
}
