"""Solutions to notebook 01's exercises."""

import torch


def normalise_rows(x):
    return x / x.norm(dim=1, keepdim=True)


def load_on_cpu(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def three_stage_time_s(n_chunks, h2d_s, compute_s, d2h_s):
    return h2d_s + compute_s + d2h_s + (n_chunks - 1) * max(h2d_s, compute_s, d2h_s)


CASES = {
    "normalise_rows": ([normalise_rows], [
        ("hard-codes .cuda()", [lambda x: x.cuda() / x.norm(dim=1, keepdim=True)], "cuda"),
        ("normalises columns", [lambda x: x / x.norm(dim=0, keepdim=True)], "unit norm"),
        ("works in place", [lambda x: x.div_(x.norm(dim=1, keepdim=True))], "in place"),
    ]),
    "load_on_cpu": ([load_on_cpu], [
        ("moves after loading", [lambda p: {k: v.cpu() for k, v in torch.load(p, weights_only=True).items()}],
         "map_location"),
    ]),
    "three_stage_time_s": ([three_stage_time_s], [
        ("steady-state bound", [lambda n, a, b, c: n * max(a, b, c)], "steady-state"),
        ("serial time", [lambda n, a, b, c: n * (a + b + c)], "serial"),
    ]),
}
