"""Data-parallel training of the course's Transformer, DDP and FSDP2: checked against one process, then timed
variant by variant on 1, 2, …, N GPUs.

    python -m torch.distributed.run --standalone --nproc-per-node=4 scripts/ddp_train.py --device cuda --check \
        --variants plain:1,ddp:1,ddp:2,ddp:4,fsdp:2,fsdp:4

``--check`` (fp32, no dropout): one SGD step of DDP, every rank on its own shard of a batch, must give the
gradients and weights of one process training on the whole batch; gradient accumulation with ``no_sync`` must give
the same gradients again while all-reducing once per optimizer step instead of once per micro-batch (a
communication hook counts the calls and the bytes, after a first step: DDP's first backward all-reduces through
buckets of its own and only then rebuilds them in the order backward produced the gradients). Then every variant
in ``--variants`` is timed at the same per-process batch (``--batch``; ``name@N`` times a variant at N sequences
per process instead) on every process (``name:k`` on the first k alone, in a process group of their own, while the
others idle: e.g. ``ddp:1`` is one GPU's step, timed in the same rounds as the rest):

    plain          the model without DDP: ``plain:1`` is the one-GPU baseline; on every process, each trains alone
                   without communication — what sharing the machine costs
    ddp            DDP with its defaults (buckets closed once they hold 25 MiB)
    fsdp           FSDP2 (``fully_shard`` on the embedding, every encoder layer and the head, then the root), fp32
                   parameters under the same autocast as DDP: the two compared at one precision
    bucket_1mb     DDP with 1 MiB gradient buckets (more, smaller all-reduces, started earlier)
    bucket_100mb   DDP with 100 MiB buckets (fewer, larger all-reduces, started later)
    bucket_view    gradient_as_bucket_view=True (gradients live in the buckets: no copy, less memory)
    static_graph   static_graph=True (the graph is the same every step: DDP skips its per-step bookkeeping)
    compress_hook  gradients all-reduced in bf16 (fp16 before Ampere and on CPU kept bf16) by a comm hook
    accum_sync     4 micro-batches per optimizer step, all-reduced after every micro-batch
    accum_no_sync  4 micro-batches per optimizer step, under no_sync() but the last

The variants are timed in alternating rounds (``utils.distributed.interleaved_bench``: every round builds each
variant afresh and times one block of steps of about ``--min-run-s`` / ``--rounds``; an accumulation variant's
step holds as many sequences as the others', in 4 micro-batches; the notebook compares the variants round by round
with ``utils.distributed.compared``), and after all the rounds each variant of ``--profile`` is profiled once: its
kernels' time split into computation, communication not hidden by it, and idle time (``--profile-trace PATH``:
rank 0 also saves the Perfetto trace of DDP on every rank). Every variant reports its peak memory per GPU and the
bytes of parameters, gradients and AdamW state its rank 0 holds (``utils.distributed.model_state_bytes``: FSDP2's
shards only). All variants train under one precision: bf16 autocast on GPUs with bf16 arithmetic, fp32 elsewhere
(fp16 would need a GradScaler). Rank 0 writes everything as JSON (``--result``),
with the bytes each variant all-reduces per optimizer step.
"""

import copy
import os
import sys
import warnings
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course's utils, however this is started

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from utils import distributed as D
from utils.data import synthetic_tokens
from utils.models import TransformerConfig, TransformerModel
from utils.profile import profile_steps
from utils.train import lm_loss, train_step

# FSDP2 warns that a unit returned a view (a Linear on [B, T, d] does): only an in-place op on it would be wrong,
# and nothing here modifies a module's output in place.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
#: Model sizes: the seed's Transformer on GPUs, a tiny one of the same design on CPU (the result and the log give
#: the parameter count).
CONFIGS = {"seed": TransformerConfig(),
           "tiny": TransformerConfig(vocab_size=512, d_model=64, nhead=4, num_layers=2, dim_feedforward=128)}
ACCUMULATE = 4  # micro-batches per optimizer step in the accumulation variants
VARIANTS = ("plain", "ddp", "fsdp", "bucket_1mb", "bucket_100mb", "bucket_view", "static_graph", "compress_hook",
            "accum_sync", "accum_no_sync")


def shard_model(model, mesh, mp_policy=None):
    """FSDP2: shard the embedding, every encoder layer and the head as units of their own, then the root."""
    mp_policy = mp_policy or MixedPrecisionPolicy()
    # the logits leave the head in fp32 (the loss needs them so); inside, each unit's output stays in param_dtype
    last = replace(mp_policy, output_dtype=torch.float32) if mp_policy.param_dtype is not None else mp_policy
    for unit in (model.embedding, *model.encoder.layers):
        fully_shard(unit, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model.head, mesh=mesh, mp_policy=last)
    return fully_shard(model, mesh=mesh, mp_policy=last)


def wrap(model, ctx, variant, group=None):
    """The model as the variant trains it over ``group`` (default: all ranks): DDP with the variant's options,
    FSDP2, or the model itself for 'plain'."""
    if variant == "plain":
        return model
    if variant == "fsdp":
        mesh = (init_device_mesh(ctx.device.type, (ctx.world_size,)) if group is None
                else DeviceMesh.from_group(group, ctx.device.type))
        return shard_model(model, mesh)
    options = {"bucket_1mb": {"bucket_cap_mb": 1}, "bucket_100mb": {"bucket_cap_mb": 100},
               "bucket_view": {"gradient_as_bucket_view": True}, "static_graph": {"static_graph": True}}
    ddp = DDP(model, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None, process_group=group,
              **options.get(variant, {}))
    if variant == "compress_hook":
        bf16 = ctx.device.type == "cpu" or D.native_bf16(ctx.device)
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook if bf16 else default_hooks.fp16_compress_hook)
    return ddp


def counting_hook(counter):
    """A DDP communication hook that all-reduces as DDP would and counts its calls (one per bucket) and bytes."""
    def hook(state, bucket):
        buffer = bucket.buffer()
        counter["calls"] += 1
        counter["bytes"] += buffer.numel() * buffer.element_size()
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
    lm_loss(ddp(x), y).backward()
    grad_err = worst_relative([p.grad for p in model.parameters()], ref_grads)
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    weight_err = worst_relative(list(model.parameters()), list(reference.parameters()))
    assert grad_err < tol and weight_err < tol, f"DDP differs from one process: {grad_err:.1e} / {weight_err:.1e}"
    D.log(ctx, f"✅ one DDP step on {ctx.world_size} shards == one process on the whole batch: gradients within "
               f"{grad_err:.1e}, weights within {weight_err:.1e} (relative, fp32)")

    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    accumulation = {}
    for no_sync in (False, True):  # the same whole-batch gradient, from 2 micro-batches per rank
        torch.manual_seed(0)
        ddp = wrap(TransformerModel(config).to(ctx.device), ctx, "ddp")
        counter = {"calls": 0, "bytes": 0}
        ddp.register_comm_hook(None, counting_hook(counter))
        lm_loss(ddp(x), y).backward()  # a first step: DDP rebuilds its buckets after it (see the docstring)
        ddp.zero_grad(set_to_none=True)
        counter.update(calls=0, bytes=0)
        for i, (mx, my) in enumerate(zip(x.chunk(2), y.chunk(2), strict=True)):
            with ddp.no_sync() if no_sync and i == 0 else nullcontext():
                (lm_loss(ddp(mx), my) / 2).backward()
        err = worst_relative([p.grad for p in ddp.module.parameters()], ref_grads)
        assert err < tol, f"accumulation {'with' if no_sync else 'without'} no_sync: gradients off by {err:.1e}"
        accumulation["no_sync" if no_sync else "sync_every_micro_batch"] = {
            "allreduce_calls": counter["calls"], "allreduce_bytes": counter["bytes"], "grad_err": err}
    sync, skip = accumulation["sync_every_micro_batch"], accumulation["no_sync"]
    assert skip["allreduce_bytes"] == grad_bytes and sync["allreduce_bytes"] == 2 * grad_bytes, \
        f"all-reduced {skip['allreduce_bytes']} and {sync['allreduce_bytes']} bytes for {grad_bytes} of gradients"
    D.log(ctx, f"✅ accumulating 2 micro-batches gives the whole-batch gradients, with no_sync "
               f"({skip['allreduce_calls']} all-reduce calls, {skip['allreduce_bytes']:,} bytes) and without "
               f"({sync['allreduce_calls']} calls, {sync['allreduce_bytes']:,} bytes)")
    return {"grad_err": grad_err, "weight_err": weight_err, "accumulation": accumulation, "tolerance": tol,
            "grad_bytes": grad_bytes}


def idle():
    """The step of a rank that sits a variant out (the variant runs on fewer ranks)."""


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


def parse_variant(spec, default_batch, world_size):
    """(name, sequences per process, processes): 'ddp' → ('ddp', default_batch, world_size); 'ddp@32' → ('ddp', 32,
    world_size); 'ddp:1' and 'ddp@32:1' → on the first process alone."""
    rest, _, ranks = spec.partition(":")
    name, _, batch = rest.partition("@")
    return name, int(batch) if batch else default_batch, int(ranks) if ranks else world_size


def allreduce_bytes(name, grad_bytes, world_size):
    """Bytes a variant all-reduces per optimizer step: the fp32 gradient once, half of it in 16 bits with the
    compression hook, once per micro-batch when accumulating without no_sync; none without DDP or alone (a single
    rank's all-reduce moves nothing over a link). FSDP2 moves other collectives (see fsdp_train.py): 0 here."""
    if name in ("plain", "fsdp") or world_size < 2:
        return 0
    if name == "compress_hook":
        return grad_bytes // 2
    return ACCUMULATE * grad_bytes if name == "accum_sync" else grad_bytes


def measure(ctx, step, step_s, trace_path):
    """Peak memory since the variant was built, and a profile of three steps: computation, communication (how
    much of it hidden), the calls of communication kernels per step. ``step_s``, the timed step, puts a CPU's
    operators on the unprofiled step's time scale (``profile_steps``)."""
    peak = torch.cuda.max_memory_allocated(ctx.device) if ctx.device.type == "cuda" else None
    prof = profile_steps(step, steps=3, warmup=1, device=ctx.device, step_s=step_s, trace_path=trace_path)
    comm_calls = sum(1 for k in prof.kernels if D.COMMUNICATION.search(k.name)) / prof.steps
    return {"peak_bytes": peak,
            "profile": {**D.communication_overlap(prof.kernels, steps=prof.steps), "busy_s": prof.busy_s,
                        "kernels_per_step": prof.kernels_per_step, "comm_calls_per_step": comm_calls,
                        "profiled_wall_s": prof.profiled_wall_s, "trace": str(trace_path) if trace_path else None}}


def main() -> None:
    parser = D.script_arguments(__doc__.splitlines()[0])
    parser.add_argument("--config", choices=tuple(CONFIGS), default=None, help="default: seed on GPU, tiny on CPU")
    parser.add_argument("--batch", type=int, default=None, help="sequences per process (default by device)")
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--variants", default="ddp", help=f"comma-separated, of {', '.join(VARIANTS)}; name@N "
                                                          "for N sequences per process")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--min-run-s", type=float, default=None, help="seconds of timing per variant, all rounds")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of interleaved timing")
    parser.add_argument("--profile", default="all", help="which variants to profile (comma-separated), 'all' or ''")
    parser.add_argument("--profile-trace", type=Path, default=None)
    args = parser.parse_args()
    on_gpu = args.device == "cuda"
    batch = args.batch or (32 if on_gpu else 4)
    specs = [v for v in args.variants.split(",") if v]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        parsed = {spec: parse_variant(spec, batch, world) for spec in specs}
    except ValueError:
        parser.error(f"--variants {args.variants!r}: a batch after '@' and processes after ':' are whole numbers")
    unknown = {name for name, _, _ in parsed.values()} - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}: choose from {', '.join(VARIANTS)}")
    if any(not 1 <= ranks <= world for *_, ranks in parsed.values()):
        parser.error(f"--variants {args.variants!r}: a variant runs on 1 to {world} processes")
    ctx = D.setup(args.device, timeout_s=args.timeout_s)
    config_name = args.config or ("seed" if on_gpu else "tiny")
    config = CONFIGS[config_name]
    seq = args.seq or (256 if on_gpu else 32)
    rounds = args.rounds or (10 if on_gpu else 4)
    min_run_s = args.min_run_s or (2.0 if on_gpu else 0.3)
    amp_dtype = torch.bfloat16 if D.native_bf16(ctx.device) else None  # one precision for every variant
    out = {"world_size": ctx.world_size, "backend": ctx.backend, "batch_per_rank": batch, "seq": seq,
           "config": config_name,
           "device": torch.cuda.get_device_name(ctx.device) if on_gpu else "cpu", "rounds": rounds,
           "amp": str(amp_dtype).removeprefix("torch.") if amp_dtype else "fp32", "variants": {}}
    try:
        if args.check:
            out["check"] = check(ctx, config, 2, min(seq, 64))
        torch.manual_seed(0)
        with torch.device(ctx.device):
            init_state = {k: v.clone() for k, v in TransformerModel(config).state_dict().items()}
        out["parameters"] = sum(v.numel() for v in init_state.values())
        out["grad_bytes"] = 4 * out["parameters"]  # fp32 gradients: what DDP all-reduces every step
        D.log(ctx, f"the '{config_name}' Transformer: {out['parameters'] / 1e6:,.2f} M parameters, {seq} tokens per "
                   "sequence")
        data = {b: shard(ctx, b, seq, config.vocab_size, seed=2)[1] for b in sorted({b for _, b, _ in parsed.values()})}
        # a process group of the first k ranks for every variant on fewer than all (every rank creates each one)
        groups = {k: dist.new_group(list(range(k))) for k in sorted({k for *_, k in parsed.values()}) if k < world}

        def build(spec):
            name, b, k = parsed[spec]
            if on_gpu:
                torch.cuda.reset_peak_memory_stats(ctx.device)
            if ctx.rank >= k:
                return idle  # this rank sits the variant out
            with torch.device(ctx.device):  # built where it trains (faster than on the CPU, then copied)
                model = TransformerModel(config)
            model.load_state_dict(init_state)
            wrapped = wrap(model, ctx, name, groups.get(k))
            optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-4, fused=True)  # on DTensors too, CPU too
            step = step_fn(wrapped, optimizer, name, *data[b], amp_dtype)
            step.model, step.optimizer = wrapped, optimizer  # for measured(): the state this rank holds
            return step

        profiled = set(specs) if args.profile == "all" else set(filter(None, args.profile.split(",")))

        def measured(spec, step, timing):
            if step is idle:
                return {"peak_bytes": None, "state_bytes": None, "profile": None}
            state = D.model_state_bytes(step.model, step.optimizer)  # after the warm-up steps: gradients, AdamW
            if spec not in profiled:
                return {"peak_bytes": torch.cuda.max_memory_allocated(ctx.device) if on_gpu else None,
                        "state_bytes": state, "profile": None}
            widest_ddp = parsed[spec][0] == "ddp" and parsed[spec][2] == world
            trace = args.profile_trace if widest_ddp and ctx.is_main else None
            return {**measure(ctx, step, timing.median_s, trace), "state_bytes": state}

        timings, extras = D.interleaved_bench({spec: (lambda spec=spec: build(spec)) for spec in specs}, ctx,
                                              rounds=rounds, warmup=3 if on_gpu else 2, block_s=min_run_s / rounds,
                                              measure=measured)
        for spec in specs:
            name, b, k = parsed[spec]
            timing = timings[spec]
            entry = {"variant": name, "batch": b, "ranks": k, "tokens_per_rank": b * seq,
                     "timing": D.timing_to_dict(timing), "tokens_per_s": k * b * seq / timing.median_s,
                     "allreduce_bytes": allreduce_bytes(name, out["grad_bytes"], k), **extras[spec]}
            out["variants"][spec] = entry
            D.log(ctx, f"{spec:>16}: {timing.median_s * 1e3:8.2f} ms per step (IQR {timing.iqr_s * 1e3:.2f}, "
                       f"{rounds} rounds), {entry['tokens_per_s']:,.0f} tokens/s over {k} process(es)")
        D.write_result(ctx, args.result, out)
    finally:
        D.teardown()


if __name__ == "__main__":
    main()
