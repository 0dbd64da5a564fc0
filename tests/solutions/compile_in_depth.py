"""Solutions to notebook 04b's exercises."""

import torch


def clip_scale_fixed(x):
    peak = x.abs().max()
    return 2 * torch.where(peak > 1.0, x / peak, x)


def compile_once(fn, backend):
    return torch.compile(fn, backend=backend, dynamic=True)


def compile_once_marked(fn, backend):
    """The other correct answer: mark the batch dimension dynamic on every input before the call."""
    compiled = torch.compile(fn, backend=backend)

    def call(x):
        torch._dynamo.mark_dynamic(x, 0)
        return compiled(x)

    return call


def _clip_scale_item(x):
    peak = x.abs().max().item()
    return 2 * (x / peak if peak > 1.0 else x)


CASES = {
    "graph_break_fixed": ([clip_scale_fixed], [
        ("keeps the Python branch", [lambda x: 2 * (x / x.abs().max() if x.abs().max() > 1.0 else x)], "graph break"),
        ("reads the peak with .item()", [_clip_scale_item], "graph break"),
        ("always divides by the peak", [lambda x: 2 * x / x.abs().max()], "differs"),
        ("forgets the factor 2", [lambda x: torch.where(x.abs().max() > 1.0, x / x.abs().max(), x)], "differs"),
    ]),
    "compiles_once": ([compile_once], [
        ("compiles with dynamic=False", [lambda fn, backend: torch.compile(fn, backend=backend, dynamic=False)],
         "dynamic=False"),
        ("keeps the default dynamic=None", [lambda fn, backend: torch.compile(fn, backend=backend)], "default"),
        ("ignores the backend it is given", [lambda fn, backend: torch.compile(fn, backend="eager", dynamic=True)],
         "backend=backend"),
        ("does not compile at all", [lambda fn, backend: fn], "nothing was compiled"),
    ]),
}
