"""All-reduce across the processes of a torchrun launch, on 2, 4, …, N of them: checked, then timed over message sizes.

    python -m torch.distributed.run --standalone --nproc-per-node=4 scripts/allreduce_bench.py --device cuda

For every group size ``n`` of ``--ranks`` (default: 2, 4, … up to the world size, and the world size itself), the
first ``n`` ranks form a process group and the others sit it out. Each group first checks that a sum-all-reduce of
seeded random tensors (odd sizes included) equals the sum it computes itself from every member's seed. Then it
times ``all_reduce`` on float32 messages from ``--min-bytes`` to ``--max-bytes`` (×4 each step): algorithm
bandwidth = message bytes / time, bus bandwidth = algorithm bandwidth × 2(n−1)/n (what each rank's link must carry
in a ring all-reduce). Rank 0 writes one sweep per group size as JSON (``--result``).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course's utils, however this is started

import torch
import torch.distributed as dist

from utils import distributed as D


def check_sum(ctx: D.Context, numel: int, group, members: int) -> None:
    """all_reduce(SUM) over the first ``members`` ranks of rank-seeded random tensors equals the sum of every
    member's tensor, rebuilt locally."""
    def tensor_of(rank: int) -> torch.Tensor:
        return torch.randn(numel, generator=torch.Generator().manual_seed(1000 + rank))

    t = tensor_of(ctx.rank).to(ctx.device)
    dist.all_reduce(t, group=group)
    expected = sum(tensor_of(r) for r in range(members))
    torch.testing.assert_close(t.cpu(), expected, rtol=1e-5, atol=1e-5 * members)


def sweep(ctx: D.Context, members: int, group, sizes: list[int], min_run_s: float) -> list[dict]:
    """One row per message size: the all-reduce over the first ``members`` ranks timed by D.collective_bench
    (ranks outside the group call nothing and wait at its barriers)."""
    inside = ctx.rank < members
    if inside:
        for numel in (1, 1_000_003, 4096):
            check_sum(ctx, numel, group, members)
    rows = []
    for size in sizes:
        buffer = torch.randn(size // 4, device=ctx.device) if inside else None  # float32; not checked while timed

        def all_reduce(buffer=buffer):
            if buffer is not None:
                dist.all_reduce(buffer, group=group)

        timing = D.collective_bench(all_reduce, ctx, label=f"{size} B", warmup=3, min_run_time=min_run_s,
                                    min_blocks=5)
        alg_gbps = size / timing.median_s / 1e9
        rows.append({"bytes": size, "timing": D.timing_to_dict(timing), "alg_gbps": alg_gbps,
                     "bus_gbps": alg_gbps * D.allreduce_bus_factor(members)})
        del buffer
    return rows


def main() -> None:
    parser = D.script_arguments(__doc__.splitlines()[0])
    parser.add_argument("--min-bytes", type=int, default=1 << 10)
    parser.add_argument("--max-bytes", type=int, default=1 << 30)
    parser.add_argument("--min-run-s", type=float, default=0.2, help="seconds of timing per message size")
    parser.add_argument("--ranks", default=None, help="comma-separated group sizes (default: 2, 4, …, world)")
    args = parser.parse_args()
    ctx = D.setup(args.device, timeout_s=args.timeout_s)
    try:
        counts = ([int(n) for n in args.ranks.split(",")] if args.ranks
                  else [n for n in D.gpu_counts(ctx.world_size) if n >= 2])
        if not counts or any(not 2 <= n <= ctx.world_size for n in counts):
            raise SystemExit(f"--ranks: group sizes from 2 to {ctx.world_size}, got {counts}")
        sizes = [s for s in (args.min_bytes << 2 * k for k in range(32)) if s <= args.max_bytes]
        sweeps = []
        for n in counts:
            group = dist.new_group(list(range(n))) if n < ctx.world_size else None  # every rank creates it
            rows = sweep(ctx, n, group, sizes, args.min_run_s)
            sweeps.append({"ranks": n, "rows": rows})
            last = rows[-1]
            D.log(ctx, f"✅ all_reduce(SUM) over {n} ranks ({ctx.backend}) equals the sum computed locally; "
                       f"{last['bytes']:,} B: {last['timing']['median_s'] * 1e6:,.1f} µs per call, bus "
                       f"{last['bus_gbps']:,.2f} GB/s")
        name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
        D.write_result(ctx, args.result, {"world_size": ctx.world_size, "backend": ctx.backend, "device": name,
                                          "sweeps": sweeps, "rows": sweeps[-1]["rows"]})
    finally:
        D.teardown()


if __name__ == "__main__":
    main()
