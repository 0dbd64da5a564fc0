"""All-reduce across the processes of a torchrun launch: checked, then timed over message sizes.

    python -m torch.distributed.run --standalone --nproc-per-node=2 scripts/allreduce_bench.py --device cuda

Every rank first checks that a sum-all-reduce of seeded random tensors (odd sizes included) equals the sum it
computes itself from every rank's seed. Then it times ``all_reduce`` on float32 messages from ``--min-bytes`` to
``--max-bytes`` (×4 each step): algorithm bandwidth = message bytes / time, bus bandwidth = algorithm bandwidth ×
2(n−1)/n (what each rank's link must carry in a ring all-reduce). Rank 0 writes the table as JSON (``--result``).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course's utils, however this is started

import torch
import torch.distributed as dist

from utils import distributed as D


def check_sum(ctx: D.Context, numel: int) -> None:
    """all_reduce(SUM) of rank-seeded random tensors equals the sum of every rank's tensor, rebuilt locally."""
    def tensor_of(rank: int) -> torch.Tensor:
        return torch.randn(numel, generator=torch.Generator().manual_seed(1000 + rank))

    t = tensor_of(ctx.rank).to(ctx.device)
    dist.all_reduce(t)
    expected = sum(tensor_of(r) for r in range(ctx.world_size))
    torch.testing.assert_close(t.cpu(), expected, rtol=1e-5, atol=1e-5 * ctx.world_size)


def main() -> None:
    parser = D.script_arguments(__doc__.splitlines()[0])
    parser.add_argument("--min-bytes", type=int, default=1 << 10)
    parser.add_argument("--max-bytes", type=int, default=1 << 30)
    parser.add_argument("--min-run-s", type=float, default=0.2, help="seconds of timing per message size")
    args = parser.parse_args()
    ctx = D.setup(args.device, timeout_s=args.timeout_s)
    try:
        for numel in (1, 1_000_003, 4096):
            check_sum(ctx, numel)
        D.log(ctx, f"✅ all_reduce(SUM) over {ctx.world_size} ranks ({ctx.backend}) equals the sum computed "
                   "locally (1, 1,000,003 and 4,096 elements)")
        rows = []
        size = args.min_bytes
        while size <= args.max_bytes:
            buffer = torch.randn(size // 4, device=ctx.device)  # float32; values are not checked while timing

            def all_reduce(buffer=buffer):
                dist.all_reduce(buffer)

            timing = D.collective_bench(all_reduce, ctx, label=f"{size} B", warmup=3, min_run_time=args.min_run_s,
                                        min_blocks=5)
            alg_gbps = size / timing.median_s / 1e9
            rows.append({"bytes": size, "timing": D.timing_to_dict(timing), "alg_gbps": alg_gbps,
                         "bus_gbps": alg_gbps * D.allreduce_bus_factor(ctx.world_size)})
            D.log(ctx, f"{size:>13,} B: {timing.median_s * 1e6:10.1f} µs  bus {rows[-1]['bus_gbps']:8.2f} GB/s")
            del buffer
            size *= 4
        name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
        D.write_result(ctx, args.result, {"world_size": ctx.world_size, "backend": ctx.backend, "device": name,
                                          "rows": rows})
    finally:
        D.teardown()


if __name__ == "__main__":
    main()
