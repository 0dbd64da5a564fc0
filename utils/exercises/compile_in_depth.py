"""Checks for the exercises of notebook 04b · torch.compile in depth.

The checks run Dynamo only (``backend="eager"`` or a counting backend), never Inductor: graph breaks and
recompiles are decided while Dynamo captures the graph, so they are visible without generating any code, and the
checks stay cheap on a CPU.
"""

from __future__ import annotations

import torch

from utils.exercises import Miss, exercise


def _clip_scale_reference(x: torch.Tensor) -> torch.Tensor:
    """The notebook's `clip_scale`, in eager mode: the behaviour the fixed version must keep."""
    if x.abs().max() > 1.0:
        x = x / x.abs().max()
    return 2 * x


@exercise("1 · Fix a graph break")
def graph_break_fixed(answer) -> str:
    """``answer(x)`` must compute what ``clip_scale`` computes, on both sides of its branch, as one graph."""
    gen = torch.Generator().manual_seed(4)
    probes = {"values above 1": torch.randn(100, generator=gen) * 5,
              "values within ±1": torch.rand(100, generator=gen) * 0.5,
              "a 2-D tensor": torch.randn(8, 16, generator=gen) * 3}
    for what, x in probes.items():  # eager first: a wrong result is reported before any graph question
        got = answer(x.clone())
        if got is None:
            raise NotImplementedError("clip_scale_fixed returns None: return the tensor")
        if not isinstance(got, torch.Tensor):
            raise Miss(f"it returns a {type(got).__name__}; return a tensor shaped like x")
        expected = _clip_scale_reference(x.clone())
        if got.shape != expected.shape or not torch.allclose(got, expected, rtol=1e-5, atol=1e-6):
            raise Miss(f"on {what} the result differs from clip_scale's (largest difference "
                       f"{(got - expected).abs().max().item() if got.shape == expected.shape else 'shape'}): "
                       "scale by the peak only when it exceeds 1, then double")
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(answer)(probes["values above 1"].clone())
    if explanation.graph_break_count:
        reason = explanation.break_reasons[0].reason.splitlines()[0][:100]
        raise Miss(f"it still has {explanation.graph_break_count} graph break(s), the first: {reason} — keep the "
                   "peak a tensor (no .item(), no Python `if` on it): torch.where chooses on the device")
    strict = torch.compile(answer, fullgraph=True, backend="eager")
    for what, x in probes.items():
        torch.testing.assert_close(strict(x.clone()), _clip_scale_reference(x.clone()), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, what=what: f"compiled with fullgraph=True, on {what}: {m}")
    torch._dynamo.reset()
    return "one graph (fullgraph=True accepts it), and the same result as clip_scale on both sides of the branch."


def _pool(x: torch.Tensor) -> torch.Tensor:
    return x.softmax(dim=-1).mean(dim=0)


_BATCH_SIZES = (3, 5, 8, 13)


@exercise("2 · Stop the recompiles")
def compiles_once(answer) -> str:
    """``answer(fn, backend)`` returns ``fn`` compiled with ``backend`` such that calls with several batch sizes
    (dimension 0) are served by one compiled graph."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = answer(_pool, counter)
    if compiled is None:
        raise NotImplementedError("compile_once returns None: return the compiled function")
    if not callable(compiled):
        raise Miss(f"it returns a {type(compiled).__name__}; return the compiled function")
    gen = torch.Generator().manual_seed(5)
    for n in _BATCH_SIZES:
        x = torch.randn(n, 16, generator=gen)
        torch.testing.assert_close(compiled(x), _pool(x), msg=lambda m, n=n: f"at batch {n} the result differs: {m}")
    graphs = counter.frame_count
    torch._dynamo.reset()
    sizes = ", ".join(map(str, _BATCH_SIZES))
    if graphs == 0:
        raise Miss("nothing was compiled with the backend it was given: pass backend=backend to torch.compile")
    if graphs == len(_BATCH_SIZES):
        raise Miss(f"{graphs} compiles for the batch sizes {sizes}: every new size is a new graph, as with "
                   "dynamic=False — make dimension 0 symbolic")
    if graphs == 2:
        raise Miss("2 compiles: that is the default (dynamic=None), which recompiles once and only then makes the "
                   "size symbolic — make it symbolic from the first call (dynamic=True or mark_dynamic)")
    if graphs != 1:
        raise Miss(f"{graphs} compiles for the batch sizes {sizes}; one graph can serve them all")
    return f"one graph served the batch sizes {sizes}, and the results match eager."
