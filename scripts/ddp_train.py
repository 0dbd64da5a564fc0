"""DistributedDataParallel on the course's Transformer: checked against one process, then timed variant by variant.

    python -m torch.distributed.run --standalone --nproc-per-node=2 scripts/ddp_train.py --device cuda --check

``--check`` (fp32, no dropout): one SGD step of DDP, every rank on its own shard of a batch, must give the
gradients and weights of one process training on the whole batch; gradient accumulation with ``no_sync`` must give
the same gradients again while all-reducing once per optimizer step instead of once per micro-batch (a
communication hook counts the calls). Then every variant in ``--variants`` is timed at the same per-process batch
(``collective_bench``: the ranks make the same number of steps):

    plain          the model without DDP: the one-GPU baseline (run it with --nproc-per-node=1)
    ddp            DDP with its defaults (25 MB buckets)
    bucket_1mb     DDP with 1 MB gradient buckets (more, smaller all-reduces, started earlier)
    bucket_100mb   DDP with 100 MB buckets (fewer, larger all-reduces, started later)
    bucket_view    gradient_as_bucket_view=True (gradients live in the buckets: no copy, less memory)
    static_graph   static_graph=True (the graph is the same every step: DDP skips its per-step bookkeeping)
    compress_hook  gradients all-reduced in bf16 (fp16 before Ampere and on CPU kept bf16) by a comm hook
    accum_sync     4 micro-batches per optimizer step, all-reduced after every micro-batch
    accum_no_sync  4 micro-batches per optimizer step, under no_sync() but the last

``--profile-trace PATH`` profiles three steps of ``ddp`` (rank 0 saves the Perfetto trace) and reports how much of
the communication ran while the GPU computed. Rank 0 writes everything as JSON (``--result``).
"""

import copy
import gc
import sys
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course's utils, however this is started

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from utils import distributed as D
from utils.data import synthetic_tokens
from utils.models import TransformerConfig, TransformerModel
from utils.profile import profile_steps
from utils.train import lm_loss, train_step

#: Model sizes: the seed's Transformer (76 M parameters) on GPUs, a tiny one of the same design on CPU.
CONFIGS = {"seed": TransformerConfig(),
           "tiny": TransformerConfig(vocab_size=512, d_model=64, nhead=4, num_layers=2, dim_feedforward=128)}
ACCUMULATE = 4  # micro-batches per optimizer step in the accumulation variants
VARIANTS = ("plain", "ddp", "bucket_1mb", "bucket_100mb", "bucket_view", "static_graph", "compress_hook",
            "accum_sync", "accum_no_sync")


def wrap(model, ctx, variant):
    """The model as the variant trains it (DDP with the variant's options, or itself for 'plain')."""
    if variant == "plain":
        return model
    options = {"bucket_1mb": {"bucket_cap_mb": 1}, "bucket_100mb": {"bucket_cap_mb": 100},
               "bucket_view": {"gradient_as_bucket_view": True}, "static_graph": {"static_graph": True}}
    ddp = DDP(model, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None,
              **options.get(variant, {}))
    if variant == "compress_hook":
        bf16 = ctx.device.type == "cpu" or D.native_bf16(ctx.device)
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook if bf16 else default_hooks.fp16_compress_hook)
    return ddp


def counting_hook(counter):
    """A DDP communication hook that all-reduces as DDP would and counts its calls (one per bucket)."""
    def hook(state, bucket):
        counter[0] += 1
        return default_hooks.allreduce_hook(state, bucket)
    return hook


def shard(ctx, batch, seq, vocab, seed):
    """The whole batch (world × batch sequences, same on every rank) and this rank's shard of it."""
    x, y = synthetic_tokens(ctx.world_size * batch, seq, vocab, generator=torch.Generator().manual_seed(seed))
    mine = slice(ctx.rank * batch, (ctx.rank + 1) * batch)
    return (x.to(ctx.device), y.to(ctx.device)), (x[mine].to(ctx.device), y[mine].to(ctx.device))


def worst_relative(a, b):
    """Largest difference between matching tensors, relative to each tensor's largest magnitude."""
    return max(((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item() for x, y in zip(a, b, strict=True))


def check(ctx, config, batch, seq, tol=1e-4):
    """DDP after one step == one process on the whole batch; no_sync accumulation == the same gradients."""
    config = replace(config, dropout=0.0)
    torch.manual_seed(0)
    reference = TransformerModel(config).to(ctx.device)
    model = copy.deepcopy(reference)
    (full_x, full_y), (x, y) = shard(ctx, batch, seq, config.vocab_size, seed=1)
    lm_loss(reference(full_x), full_y).backward()
    ref_grads = [p.grad.clone() for p in reference.parameters()]
    torch.optim.SGD(reference.parameters(), lr=0.5).step()

    ddp = wrap(model, ctx, "ddp")
    calls = [0]
    ddp.register_comm_hook(None, counting_hook(calls))
    lm_loss(ddp(x), y).backward()
    grad_err = worst_relative([p.grad for p in model.parameters()], ref_grads)
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    weight_err = worst_relative(list(model.parameters()), list(reference.parameters()))
    assert grad_err < tol and weight_err < tol, f"DDP differs from one process: {grad_err:.1e} / {weight_err:.1e}"
    D.log(ctx, f"✅ one DDP step on {ctx.world_size} shards == one process on the whole batch: gradients within "
               f"{grad_err:.1e}, weights within {weight_err:.1e} (relative, fp32)")

    accumulation = {}
    for no_sync in (False, True):  # the same whole-batch gradient, from 2 micro-batches per rank
        torch.manual_seed(0)
        ddp = wrap(TransformerModel(config).to(ctx.device), ctx, "ddp")
        calls = [0]
        ddp.register_comm_hook(None, counting_hook(calls))
        for i, (mx, my) in enumerate(zip(x.chunk(2), y.chunk(2), strict=True)):
            with ddp.no_sync() if no_sync and i == 0 else nullcontext():
                (lm_loss(ddp(mx), my) / 2).backward()
        err = worst_relative([p.grad for p in ddp.module.parameters()], ref_grads)
        assert err < tol, f"accumulation {'with' if no_sync else 'without'} no_sync: gradients off by {err:.1e}"
        accumulation["no_sync" if no_sync else "sync_every_micro_batch"] = {"allreduce_calls": calls[0],
                                                                             "grad_err": err}
    D.log(ctx, f"✅ accumulating 2 micro-batches gives the whole-batch gradients, with no_sync "
               f"({accumulation['no_sync']['allreduce_calls']} all-reduce calls) and without "
               f"({accumulation['sync_every_micro_batch']['allreduce_calls']} calls)")
    return {"grad_err": grad_err, "weight_err": weight_err, "accumulation": accumulation, "tolerance": tol}


def step_fn(model, optimizer, variant, x, y, amp_dtype):
    """One optimizer step of the variant on (x, y)."""
    if not variant.startswith("accum"):
        return lambda: train_step(model, optimizer, x, y, amp_dtype=amp_dtype, max_grad_norm=None)
    micro = list(zip(x.chunk(ACCUMULATE), y.chunk(ACCUMULATE), strict=True))

    def accumulate():
        optimizer.zero_grad(set_to_none=True)
        for i, (mx, my) in enumerate(micro):
            skip_sync = variant == "accum_no_sync" and i < len(micro) - 1
            with model.no_sync() if skip_sync else nullcontext(), \
                    torch.autocast(x.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = lm_loss(model(mx), my) / len(micro)
                loss.backward()
        optimizer.step()
    return accumulate


def main() -> None:
    parser = D.script_arguments(__doc__.splitlines()[0])
    parser.add_argument("--config", choices=tuple(CONFIGS), default=None, help="default: seed on GPU, tiny on CPU")
    parser.add_argument("--batch", type=int, default=None, help="sequences per process (default by device)")
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--variants", default="ddp", help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--min-run-s", type=float, default=None, help="seconds of timing per variant")
    parser.add_argument("--profile-trace", type=Path, default=None)
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}: choose from {', '.join(VARIANTS)}")
    ctx = D.setup(args.device, timeout_s=args.timeout_s)
    on_gpu = ctx.device.type == "cuda"
    config = CONFIGS[args.config or ("seed" if on_gpu else "tiny")]
    batch = args.batch or (32 if on_gpu else 4)
    seq = args.seq or (256 if on_gpu else 32)
    min_run_s = args.min_run_s or (1.5 if on_gpu else 0.3)
    amp_dtype = (torch.bfloat16 if D.native_bf16(ctx.device) else torch.float16) if on_gpu else None
    out = {"world_size": ctx.world_size, "backend": ctx.backend, "batch_per_rank": batch, "seq": seq,
           "device": torch.cuda.get_device_name(ctx.device) if on_gpu else "cpu",
           "amp": str(amp_dtype).removeprefix("torch.") if amp_dtype else "fp32", "variants": {}}
    try:
        if args.check:
            out["check"] = check(ctx, config, 2, min(seq, 64))
        torch.manual_seed(0)
        init_state = TransformerModel(config).state_dict()
        out["parameters"] = sum(v.numel() for v in init_state.values())
        out["grad_bytes"] = 4 * out["parameters"]  # fp32 gradients: what DDP all-reduces every step
        _, (x, y) = shard(ctx, batch, seq, config.vocab_size, seed=2)
        for variant in variants:
            with torch.device(ctx.device):  # built where it trains (faster than on the CPU, then copied)
                model = TransformerModel(config)
            model.load_state_dict(init_state)
            wrapped = wrap(model, ctx, variant)
            optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-4, fused=on_gpu)
            step = step_fn(wrapped, optimizer, variant, x, y, amp_dtype)
            if on_gpu:
                torch.cuda.reset_peak_memory_stats(ctx.device)
            timing = D.collective_bench(step, ctx, label=variant, warmup=3, min_run_time=min_run_s)
            entry = {"timing": D.timing_to_dict(timing), "tokens_per_s": ctx.world_size * batch * seq / timing.median_s,
                     "peak_bytes": torch.cuda.max_memory_allocated(ctx.device) if on_gpu else None}
            D.log(ctx, f"{variant:>14}: {timing.median_s * 1e3:8.2f} ms per step (IQR {timing.iqr_s * 1e3:.2f}), "
                       f"{entry['tokens_per_s']:,.0f} tokens/s over {ctx.world_size} process(es)")
            if variant == "ddp" and args.profile_trace is not None:
                prof = profile_steps(step, steps=3, warmup=1, device=ctx.device, step_s=timing.median_s,
                                     trace_path=args.profile_trace if ctx.is_main else None)
                entry["profile"] = {**D.communication_overlap(prof.kernels, steps=prof.steps),
                                    "busy_s": prof.busy_s, "wall_s": prof.wall_s, "bottleneck": prof.bottleneck(),
                                    "trace": str(args.profile_trace)}
            out["variants"][variant] = entry
            del model, wrapped, optimizer, step
            gc.collect()
            if on_gpu:
                torch.cuda.empty_cache()
        D.write_result(ctx, args.result, out)
    finally:
        D.teardown()


if __name__ == "__main__":
    main()
