"""FSDP2 (``fully_shard``) on the course's Transformer: a distributed checkpoint saved on some GPUs and resumed on
another number of them, memory per GPU against DDP, and a model too big for one GPU's budget trained sharded.

    python -m torch.distributed.run --standalone --nproc-per-node=2 scripts/fsdp_train.py --device cuda \
        --phases save --checkpoint-dir /tmp/ckpt
    python -m torch.distributed.run --standalone --nproc-per-node=4 scripts/fsdp_train.py --device cuda \
        --phases resume --checkpoint-dir /tmp/ckpt --time-batch 16

1. **save.** Train steps 1–4 of a global batch (``--global-batch`` sequences, split evenly over the ranks), saving a
   distributed checkpoint (``torch.distributed.checkpoint``: every rank writes its own shards) after step 2. The
   losses of steps 3–4 are those of an uninterrupted run.
2. **resume.** A fresh model with other weights, on any number of ranks that divides the global batch, loads the
   checkpoint — each rank reads the pieces of its own shards, however the saving run split them — and trains steps
   3–4 of the same global batch: the losses must be the saving run's (fp32, up to the order of the sums). With
   ``--time-batch B`` the resumed model's training step (B sequences per rank, bf16 autocast where the GPU has
   bf16) is then timed, for comparing launches (e.g. one node against two).
3. **memory.** The same model and batch trained by DDP and by FSDP2 (bf16 ``MixedPrecisionPolicy`` where the GPU has
   bf16): peak allocated memory per GPU, the bytes of parameters, gradients and optimizer state each rank holds,
   and the time per step in alternating rounds (``utils.distributed.interleaved_bench``); then a profile of each.
4. **too_big** (GPU only): a budget per GPU is emulated with ``torch.cuda.set_per_process_memory_fraction``, below
   what one GPU needs to train the model (parameters, gradients and AdamW's two moments, 16 bytes per parameter)
   but well above what half of that state needs. The model is the largest of ``TOO_BIG_CANDIDATES`` whose budget
   fits in half of the GPU's memory (none on a small GPU: the part is skipped, and the result says why). Training
   it on one GPU runs out of memory (each rank tries on its own); sharded over the ranks, it trains.

Every rank reports where it ran (node, local rank, GPU); rank 0 writes the numbers as JSON (``--result``).
"""

import copy
import gc
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course's utils, however this is started
sys.path.insert(0, str(Path(__file__).resolve().parent))  # and ddp_train beside it, however this is imported

import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ddp_train import shard_model
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.nn.parallel import DistributedDataParallel as DDP

from utils import distributed as D
from utils.data import synthetic_tokens
from utils.models import TransformerConfig, TransformerModel, count_parameters
from utils.out_of_memory import is_out_of_memory
from utils.profile import profile_steps
from utils.train import lm_loss

# FSDP2 warns that a unit returned a view (a Linear on [B, T, d] does): only an in-place op on it would be wrong,
# and nothing here modifies a module's output in place.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")

#: Model sizes (parameter_count() gives each one's parameters; the results report them).
CONFIGS = {
    "tiny": TransformerConfig(vocab_size=512, d_model=64, nhead=4, num_layers=2, dim_feedforward=128, dropout=0.0),
    "seed": TransformerConfig(dropout=0.0),
    "large": TransformerConfig(d_model=1024, nhead=16, num_layers=8, dim_feedforward=4096, dropout=0.0),
    "xl": TransformerConfig(d_model=2048, nhead=16, num_layers=8, dim_feedforward=8192, dropout=0.0),
}
#: The emulated budget per GPU, in bytes per parameter of the model that must not fit: one GPU needs 16 (fp32
#: parameters and gradients, AdamW's two moments) and more for activations; sharded over two GPUs that state is 8,
#: and the layers gathered for the moment, their gradients and the activations fit in the 6 left.
BUDGET_BYTES_PER_PARAM = 14
#: The models tried for "too big for one GPU", largest first, and the share of the GPU's memory their budget must fit
#: in (the rest leaves room for the CUDA context and whatever else holds memory on the GPU).
TOO_BIG_CANDIDATES = ("xl", "large")
TOO_BIG_SHARE = 0.5


def parameter_count(config):
    """Parameters of a TransformerModel of this config, counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        return count_parameters(TransformerModel(config))


def too_big_choice(total_bytes):
    """(name, parameters, budget bytes) of the largest of TOO_BIG_CANDIDATES whose emulated budget,
    BUDGET_BYTES_PER_PARAM × its parameters, fits in TOO_BIG_SHARE of a GPU's ``total_bytes``; None if none does."""
    for name in TOO_BIG_CANDIDATES:
        params = parameter_count(CONFIGS[name])
        if BUDGET_BYTES_PER_PARAM * params <= TOO_BIG_SHARE * total_bytes:
            return name, params, BUDGET_BYTES_PER_PARAM * params
    return None


def shard(model, ctx, mp_policy):
    """:func:`ddp_train.shard_model` over every rank of the run."""
    return shard_model(model, init_device_mesh(ctx.device.type, (ctx.world_size,)), mp_policy)


#: Set by --bf16: bf16 mixed precision on a CPU too (the tests run the GPUs' code path that way).
FORCE_BF16 = False


def precision(ctx):
    """(autocast dtype for DDP, FSDP2 mixed-precision policy): bf16 compute with fp32 gradient reduction on GPUs
    that have bf16, fp32 elsewhere."""
    if FORCE_BF16 or D.native_bf16(ctx.device):
        return torch.bfloat16, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None, MixedPrecisionPolicy()


def batch_for(ctx, step, batch, seq, vocab):
    """This rank's batch of a given step (different on every rank, the same on every run)."""
    gen = torch.Generator().manual_seed(10_000 + step * ctx.world_size + ctx.rank)
    x, y = synthetic_tokens(batch, seq, vocab, generator=gen)
    return x.to(ctx.device), y.to(ctx.device)


def train_step(model, optimizer, x, y, amp_dtype):
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
        loss = lm_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.detach()


def mean_over_ranks(value):
    t = value.detach().float().reshape(1).clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def release(ctx):
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()


def memory(ctx, config, batch, seq, min_run_s, rounds):
    """DDP and FSDP2 on the same model and batch: time per step, in alternating rounds (``D.interleaved_bench``);
    then, after every round (a finished profiler session can slow what runs after it), each once more: its peak
    memory over a few steps, the state bytes per rank and a profile."""
    amp_dtype, mp_policy = precision(ctx)
    torch.manual_seed(0)
    init_state = TransformerModel(config).state_dict()  # on the CPU: outside every peak
    x, y = batch_for(ctx, 0, batch, seq, config.vocab_size)

    def build(kind):
        """The step of DDP under autocast, or of FSDP2 (whose policy casts the parameters), built afresh; the peak
        is counted from the built model on (FSDP2's shards, not the whole model before sharding)."""
        with torch.device(ctx.device):  # built where it trains (faster than on the CPU, then copied)
            model = TransformerModel(config)
        model.load_state_dict(init_state)
        if kind == "ddp":
            model, step_amp = DDP(model, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None), amp_dtype
        else:
            model, step_amp = shard(model, ctx, mp_policy), None
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
            torch.cuda.reset_peak_memory_stats(ctx.device)

        def step():
            return train_step(model, optimizer, x, y, step_amp)

        step.model, step.optimizer = model, optimizer  # for measure(), released with the step
        return step

    def measure(kind, step, timing):
        peak = torch.cuda.max_memory_allocated(ctx.device) if ctx.device.type == "cuda" else None
        state = D.model_state_bytes(step.model, step.optimizer)
        prof = profile_steps(step, steps=3, warmup=2, device=ctx.device, step_s=timing.median_s)
        D.log(ctx, f"{kind:>4}: model state per rank {state['total'] / 2**20:,.1f} MiB"
                   + (f", peak allocated {peak / 2**20:,.0f} MiB" if peak is not None else "")
                   + f", {timing.median_s * 1e3:.2f} ms per step")
        return {"peak_bytes": peak, "state_bytes": state,
                "profile": {**D.communication_overlap(prof.kernels, steps=prof.steps), "busy_s": prof.busy_s,
                            "kernels_per_step": prof.kernels_per_step,
                            "comm_calls_per_step": sum(1 for k in prof.kernels
                                                       if D.COMMUNICATION.search(k.name)) / prof.steps}}

    timings, extras = D.interleaved_bench({kind: (lambda kind=kind: build(kind)) for kind in ("ddp", "fsdp")}, ctx,
                                          rounds=rounds, warmup=3, block_s=min_run_s / rounds, measure=measure)
    release(ctx)
    return {"parameters": parameter_count(config), "rounds": rounds,
            **{kind: {"timing": D.timing_to_dict(timings[kind]), **extras[kind],
                      "tokens_per_s": ctx.world_size * batch * seq / timings[kind].median_s} for kind in timings}}


def too_big(ctx, batch, seq):
    """Emulate a smaller GPU, show that one GPU cannot train the model and that FSDP2 over the ranks can; on a GPU
    too small for any of TOO_BIG_CANDIDATES' budgets, say so instead."""
    total = torch.cuda.get_device_properties(ctx.device).total_memory
    choice = too_big_choice(total)
    if choice is None:
        smallest = TOO_BIG_CANDIDATES[-1]
        need = BUDGET_BYTES_PER_PARAM * parameter_count(CONFIGS[smallest])
        reason = (f"the smallest model tried ('{smallest}') needs a budget of {need / 2**30:.2f} GiB, more than "
                  f"{TOO_BIG_SHARE:.0%} of this GPU's {total / 2**30:.2f} GiB")
        D.log(ctx, f"a model too big for one GPU: skipped — {reason}")
        return {"skipped": reason, "total_bytes": total}
    name, params, budget = choice
    config = CONFIGS[name]
    amp_dtype, mp_policy = precision(ctx)
    torch.manual_seed(0)
    cpu_model = TransformerModel(config)
    release(ctx)
    torch.cuda.set_per_process_memory_fraction(budget / total, ctx.device)
    out = {"config": name, "parameters": params, "budget_bytes": budget, "total_bytes": total,
           "budget_bytes_per_param": BUDGET_BYTES_PER_PARAM}
    x, y = batch_for(ctx, 0, batch, seq, config.vocab_size)
    try:
        torch.cuda.reset_peak_memory_stats(ctx.device)
        model = copy.deepcopy(cpu_model).to(ctx.device)  # one GPU, no DDP: no collective can be left waiting
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        try:
            train_step(model, optimizer, x, y, amp_dtype)
            torch.cuda.synchronize(ctx.device)
            out["one_gpu"] = "trained (the budget was not too small)"
        except RuntimeError as err:  # torch.OutOfMemoryError, or cuBLAS failing to allocate its workspace
            if not is_out_of_memory(err):
                raise
            # PyTorch's message also gives the whole GPU's free memory, which the emulated budget does not change:
            # say instead what this process held against its budget
            asked = re.search(r"Tried to allocate ([\d.]+ \w+)", str(err))
            out["one_gpu"] = (f"out of memory: PyTorch held {torch.cuda.max_memory_allocated(ctx.device) / 2**30:.2f}"
                              f" GiB of the {budget / 2**30:.2f} GiB budget and needed "
                              + (f"{asked.group(1)} more" if asked else "more"))
        del model, optimizer
        release(ctx)
        dist.barrier()
        D.log(ctx, f"one GPU, the '{name}' model ({params / 1e6:,.0f} M parameters), budget {budget / 2**30:.2f} GiB: "
                   f"{out['one_gpu']}")
        torch.cuda.reset_peak_memory_stats(ctx.device)
        model = shard(cpu_model, ctx, mp_policy)  # fully_shard moves each unit to the GPU and keeps a shard
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        losses = [mean_over_ranks(train_step(model, optimizer, *batch_for(ctx, s, batch, seq, config.vocab_size),
                                             None)) for s in range(3)]
        out.update(fsdp_losses=losses, fsdp_peak_bytes=torch.cuda.max_memory_allocated(ctx.device),
                   fsdp_state_bytes=D.model_state_bytes(model, optimizer))
        shown = ", ".join(f"{v:.3f}" for v in losses)
        D.log(ctx, f"FSDP2 over {ctx.world_size} GPUs: trained 3 steps (losses {shown}), peak "
                   f"{out['fsdp_peak_bytes'] / 2**30:.2f} GiB per GPU within the budget")
        del model, optimizer
    finally:
        release(ctx)
        torch.cuda.set_per_process_memory_fraction(1.0, ctx.device)
    return out


def global_batch(ctx, step, size, seq, vocab):
    """This rank's share of step ``step``'s global batch of ``size`` sequences: the same global batch on every run,
    whatever its number of ranks, split into equal consecutive slices."""
    if size % ctx.world_size:
        raise SystemExit(f"--global-batch {size} does not split evenly over {ctx.world_size} ranks")
    x, y = synthetic_tokens(size, seq, vocab, generator=torch.Generator().manual_seed(10_000 + step))
    mine = slice(ctx.rank * size // ctx.world_size, (ctx.rank + 1) * size // ctx.world_size)
    return x[mine].to(ctx.device), y[mine].to(ctx.device)


def fresh(ctx, config, seed):
    """A sharded model from ``seed`` (fp32 throughout: losses comparable between runs) and its AdamW."""
    torch.manual_seed(seed)
    model = shard(TransformerModel(config), ctx, MixedPrecisionPolicy())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train(ctx, model, optimizer, config, steps, size, seq):
    """Train ``steps`` (0-based) of the global batch; the loss of each, averaged over the ranks (their slices are
    equal, so this is the global batch's mean loss)."""
    return [mean_over_ranks(train_step(model, optimizer, *global_batch(ctx, s, size, seq, config.vocab_size), None))
            for s in steps]


def save(ctx, config, size, seq, folder):
    """Steps 1–2, the checkpoint, steps 3–4: what a run that is never interrupted trains."""
    model, optimizer = fresh(ctx, config, 0)
    before = train(ctx, model, optimizer, config, range(2), size, seq)
    start = time.perf_counter()
    model_state, optim_state = get_state_dict(model, optimizer)  # sharded: every rank has only its part
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(folder))
    save_s = time.perf_counter() - start
    after = train(ctx, model, optimizer, config, range(2, 4), size, seq)
    files = sorted((p.name, p.stat().st_size) for p in Path(folder).iterdir() if p.is_file())
    D.log(ctx, f"saved by {ctx.world_size} rank{'s' if ctx.world_size > 1 else ''} after step 2 ({len(files)} files); "
               "losses of steps 1–4: " + ", ".join(f"{v:.6f}" for v in before + after))
    return {"ranks": ctx.world_size, "losses": before + after, "files": files, "save_s": save_s}


def resume(ctx, config, size, seq, folder):
    """A fresh model with other weights loads the checkpoint into this run's shards and trains steps 3–4."""
    model, optimizer = fresh(ctx, config, 123)  # other initial weights: everything must come from the checkpoint
    start = time.perf_counter()
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(folder))  # in place, into this rank's shards, resharded as needed
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    load_s = time.perf_counter() - start
    losses = train(ctx, model, optimizer, config, range(2, 4), size, seq)
    D.log(ctx, f"loaded by {ctx.world_size} ranks in {load_s:.2f} s; losses of steps 3–4: "
               + ", ".join(f"{v:.6f}" for v in losses))
    return {"ranks": ctx.world_size, "losses": losses, "load_s": load_s}, model, optimizer


def timed(ctx, model, optimizer, config, batch, seq, min_run_s):
    """The resumed model's training step at ``batch`` sequences per rank (bf16 autocast where the GPU has bf16),
    timed by D.collective_bench: one number per launch, for comparing launches."""
    amp_dtype, _ = precision(ctx)
    x, y = batch_for(ctx, 0, batch, seq, config.vocab_size)
    timing = D.collective_bench(lambda: train_step(model, optimizer, x, y, amp_dtype), ctx, label="step",
                                min_run_time=min_run_s)
    D.log(ctx, f"training step at {batch} sequences per rank: {timing.median_s * 1e3:.2f} ms")
    return {"timing": D.timing_to_dict(timing), "batch_per_rank": batch, "seq": seq,
            "amp": str(amp_dtype).removeprefix("torch.") if amp_dtype else "fp32"}


def placement(ctx):
    """Where every rank runs: its node (the rendezvous's GROUP_RANK), its local rank and its GPU, as the host
    numbers it (CUDA_VISIBLE_DEVICES resolved)."""
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v]
    gpu = (visible[ctx.local_rank] if ctx.local_rank < len(visible) else str(ctx.local_rank)) if ctx.device.type == \
        "cuda" else "cpu"
    mine = {"rank": ctx.rank, "node": int(os.environ.get("GROUP_RANK", 0)), "local_rank": ctx.local_rank, "gpu": gpu}
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    return everyone


def main() -> None:
    parser = D.script_arguments(__doc__.splitlines()[0])
    parser.add_argument("--checkpoint-dir", type=Path, default=None, help="where save writes and resume reads")
    parser.add_argument("--phases", default="save,resume,memory,too_big", help="which parts to run, in this order")
    parser.add_argument("--global-batch", type=int, default=None, help="sequences per step over all ranks")
    parser.add_argument("--time-batch", type=int, default=None, help="after resume: time the step at this batch")
    parser.add_argument("--min-run-s", type=float, default=None)
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds of DDP's and FSDP2's steps")
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision even on a CPU")
    args = parser.parse_args()
    global FORCE_BF16
    FORCE_BF16 = args.bf16
    phases = set(args.phases.split(","))
    if phases & {"save", "resume"} and args.checkpoint_dir is None:
        parser.error("save and resume need --checkpoint-dir")
    ctx = D.setup(args.device, timeout_s=args.timeout_s)
    on_gpu = ctx.device.type == "cuda"
    out = {"world_size": ctx.world_size, "backend": ctx.backend,
           "device": torch.cuda.get_device_name(ctx.device) if on_gpu else "cpu", "placement": placement(ctx)}
    config, seq = CONFIGS["seed" if on_gpu else "tiny"], 128 if on_gpu else 16
    size = args.global_batch or (8 if on_gpu else 4)
    try:
        # save, resume and the step timed after it come first, before the memory phase's profiles (a finished
        # profiler session can slow host-bound code for the rest of the process)
        if "save" in phases:
            out["save"] = save(ctx, config, size, seq, args.checkpoint_dir)
        if "resume" in phases:
            out["resume"], model, optimizer = resume(ctx, config, size, seq, args.checkpoint_dir)
            if args.time_batch:
                out["timed"] = timed(ctx, model, optimizer, config, args.time_batch, 256 if on_gpu else 32,
                                     args.min_run_s or (2.0 if on_gpu else 0.3))
            del model, optimizer
            release(ctx)
        if "memory" in phases:
            size, batch, seq = ("large", 8, 256) if on_gpu else ("tiny", 4, 32)
            out["memory"] = memory(ctx, CONFIGS[size], batch, seq, args.min_run_s or (1.5 if on_gpu else 0.2),
                                   args.rounds or (10 if on_gpu else 4))
            out["memory"]["config"] = size
        if "too_big" in phases and on_gpu:
            out["too_big"] = too_big(ctx, 2, 256)
        elif "too_big" in phases:
            out["too_big"] = None
            D.log(ctx, "a model too big for one GPU: skipped on CPU — set_per_process_memory_fraction limits the "
                       "CUDA caching allocator, and a CPU has no per-process budget to emulate")
        D.write_result(ctx, args.result, out)
    finally:
        D.teardown()


if __name__ == "__main__":
    main()
