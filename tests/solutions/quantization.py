"""Solutions to the exercises of notebook 08c."""

import torch


def w8a8_linear(x, q_weight, w_scale):
    x_scale = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
    q_x = torch.round(x / x_scale).clamp(-127, 127).to(torch.int8)
    return torch._int_mm(q_x, q_weight.t()).float() * x_scale * w_scale


def _float_product(x, q_weight, w_scale):
    torch._int_mm(torch.zeros(17, 8, dtype=torch.int8), torch.zeros(8, 8, dtype=torch.int8))  # called, but unused
    return x @ (q_weight.float() * w_scale[:, None]).T


def _no_activation_scale(x, q_weight, w_scale):
    x_scale = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
    q_x = torch.round(x / x_scale).clamp(-127, 127).to(torch.int8)
    return torch._int_mm(q_x, q_weight.t()).float() * w_scale


def _per_tensor_activations(x, q_weight, w_scale):
    x_scale = x.abs().amax() / 127  # one scale: the outlier row costs the others their precision
    q_x = torch.round(x / x_scale).clamp(-127, 127).to(torch.int8)
    return torch._int_mm(q_x, q_weight.t()).float() * x_scale * w_scale


def _no_int_mm(x, q_weight, w_scale):
    return x @ (q_weight.float() * w_scale[:, None]).T


CASES = {
    "w8a8_linear": ([w8a8_linear], [
        ("multiplies in floating point", [_float_product], "not quantized"),
        ("forgets the activations' scale", [_no_activation_scale], "activations' scale"),
        ("quantizes the activations per tensor", [_per_tensor_activations], "per-row"),
        ("never calls torch._int_mm", [_no_int_mm], "never called"),
    ]),
}
