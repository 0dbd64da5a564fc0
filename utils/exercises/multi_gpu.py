"""Checks for the exercises of notebook 10 · Several GPUs."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from utils.exercises import Miss, close, exercise

# Bus bandwidths of a ring all-reduce as nccl-tests reports them next to the algorithm bandwidth (its
# PERFORMANCE.md: for 2 ranks the two are equal, for 4 ranks 1.5×, for 8 ranks 1.75×, for 16 ranks 1.875×).
_BUS_CASES = [((100.0, 2), 100.0), ((100.0, 4), 150.0), ((100.0, 8), 175.0), ((240.0, 16), 450.0)]


@exercise("1 · Bus bandwidth")
def bus_bandwidth(answer, *, rows: list[dict] | None = None, world_size: int | None = None) -> str:
    """``answer(alg_gbps, world_size)``: what each link carries in a ring all-reduce reaching ``alg_gbps``."""
    for (alg, n), expected in _BUS_CASES:
        got = answer(alg, n)
        if got is None:
            raise NotImplementedError("bus_bandwidth returns None: return GB/s")
        got = float(got)
        if close(got, expected, rel=1e-6):
            continue
        if close(got, alg, rel=1e-6):
            raise Miss(f"it ignores the number of ranks: with 2 ranks the two bandwidths are equal, but over {n} "
                       f"ranks each link carries more than the message ({expected:g} GB/s at {alg:g} GB/s)")
        if close(got, alg * (n - 1) / n, rel=1e-6):
            raise Miss("this counts one trip around the ring: a ring all-reduce is a reduce-scatter and then an "
                       "all-gather, and each sends (n−1)/n of the message")
        if close(got, 2 * alg, rel=1e-6):
            raise Miss(f"that is the limit for very many ranks; over {n} ranks each piece travels fewer than twice "
                       f"({expected:g} GB/s at {alg:g} GB/s)")
        if got and close(alg * alg / got, expected, rel=1e-6):
            raise Miss("the ratio is upside down: the links carry more than the algorithm bandwidth, not less")
        raise Miss(f"over {n} ranks at {alg:g} GB/s algorithm bandwidth nccl-tests reports {expected:g} GB/s bus "
                   f"bandwidth; yours says {got:.4g}")
    here = ""
    if rows and world_size:
        last = rows[-1]
        here = (f" Here: {answer(last['alg_gbps'], world_size):.4g} GB/s for the {last['bytes']:,}-byte message, the "
                f"script reported {last['bus_gbps']:.4g}.")
    return "each link carries 2(n−1)/n of the message: the number to put against the link's speed." + here


def _counting_hook(counter: list[int]):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def hook(state, bucket):
        counter[0] += 1
        return default_hooks.allreduce_hook(state, bucket)
    return hook


def _sgd_step(model: nn.Module, micro, *, scale: float = 1.0, stale: bool = False) -> list[torch.Tensor]:
    """The weights after one SGD step (lr 0.1) on the mean loss of the micro-batches (× scale; plus stale ones)."""
    model = copy.deepcopy(model)
    for p in model.parameters():
        p.grad = torch.ones_like(p) if stale else None
    loss = sum(F.mse_loss(model(x), y) for x, y in micro) / len(micro) * scale
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return [p.detach() for p in model.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.allclose(x, y, rtol=1e-5, atol=1e-7) for x, y in zip(a, b, strict=True))


@exercise("2 · Accumulate with no_sync")
def accumulate(answer) -> str:
    """``answer(ddp_model, optimizer, micro_batches, loss_fn)``: one step on the mean loss, one all-reduce."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    created = not dist.is_initialized()
    if created:  # a one-process group in this kernel: DDP runs its all-reduces (over one rank) as usual
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        gen = torch.Generator().manual_seed(1)
        micro = [(torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen)) for _ in range(4)]
        expected, too_large = _sgd_step(model, micro), _sgd_step(model, micro, scale=len(micro))
        stale = _sgd_step(model, micro, stale=True)

        probe, probe_calls = DDP(copy.deepcopy(model)), [0]  # how many hook calls one synchronised backward makes
        probe.register_comm_hook(None, _counting_hook(probe_calls))
        F.mse_loss(probe(micro[0][0]), micro[0][1]).backward()

        ddp, calls = DDP(model), [0]
        ddp.register_comm_hook(None, _counting_hook(calls))
        for p in model.parameters():
            p.grad = torch.ones_like(p)  # gradients left over from before: a step must not use them
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        steps = [0]
        optimizer.register_step_post_hook(lambda *_: steps.__setitem__(0, steps[0] + 1))
        answer(ddp, optimizer, micro, lambda m, x, y: F.mse_loss(m(x), y))
        if steps[0] == 0:
            raise Miss("the optimizer never stepped: call optimizer.step() once, after the last micro-batch")
        if steps[0] > 1:
            raise Miss(f"it stepped {steps[0]} times: accumulate every micro-batch's gradients, then step once")
        if calls[0] == 0:
            raise Miss("it never all-reduced: the last micro-batch must run outside no_sync() — with several GPUs "
                       "every rank would step with its own gradients")
        if calls[0] >= len(micro) * probe_calls[0]:
            raise Miss(f"it all-reduces after every micro-batch ({calls[0]} calls): run all but the last under "
                       "ddp_model.no_sync()")
        if calls[0] != probe_calls[0]:
            raise Miss(f"{calls[0]} all-reduce calls; one backward's worth ({probe_calls[0]}) is enough")
        weights = [p.detach() for p in model.parameters()]
        if _same(weights, expected):
            return (f"one all-reduce ({probe_calls[0]} bucket{'s' if probe_calls[0] > 1 else ''}) instead of "
                    f"{len(micro)}, and the step of the whole batch's mean loss.")
        if _same(weights, too_large):
            raise Miss(f"the gradients are {len(micro)}× too large: divide each micro-batch's loss by the number of "
                       "micro-batches, so that their sum is the mean")
        if _same(weights, stale):
            raise Miss("it kept gradients from before the call: start with optimizer.zero_grad()")
        raise Miss("the weights after the step differ from one SGD step on the mean loss of all micro-batches")
    finally:
        if created:
            dist.destroy_process_group()
