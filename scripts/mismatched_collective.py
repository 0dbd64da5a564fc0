"""A collective that one rank never joins: with a timeout it fails with an error instead of hanging forever.

    python -m torch.distributed.run --standalone --nproc-per-node=2 scripts/mismatched_collective.py --timeout-s 5

Rank 0 all-reduces a tensor; every other rank takes another code path (here: it sleeps, as a rank stuck in data
loading or in a branch the others did not take would) and never calls the all-reduce. Without a timeout rank 0
would wait forever. With a process group's ``timeout`` (``init_process_group(timeout=...)``, or ``new_group`` as
here), the collective fails after the timeout. Under gloo the call raises. NCCL runs collectives asynchronously:
its watchdog thread notices the timeout and aborts the communicator, but a plain ``torch.cuda.synchronize()`` may
then return as if the all-reduce had completed (torch 2.11 did), and the process runs on. So rank 0 waits with
``work.wait(timeout)``, which blocks the calling thread and raises when the timeout passes, under either backend.
torchrun sees a failed rank, stops the others, and the launch fails with the timeout named in its output.

The default group is joined with the usual timeout (``utils.distributed.setup``): joining also waits for every
process to start, which on a busy machine can take longer than a few seconds, and a failure there would not be the
mistake this script makes. All ranks then make the group of the short ``--timeout-s`` together, after a barrier,
and the mismatched all-reduce runs in it.

NCCL's watchdog also acts on the timeout: it signals every rank to dump its flight recorder (a record of recent
collectives and their stacks, for post-mortem debugging), then sleeps 4 × ``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC``
(15 s by default: a minute) whether or not a dump was asked for. The notebook's demonstration runs with
``utils.distributed.FAIL_FAST_NCCL_ENV`` (no dump, a 1 s sleep), so neither delays the exit; a real training run
keeps the defaults.
"""

import contextlib
import datetime
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course's utils, however this is started

import torch
import torch.distributed as dist

from utils import distributed as D


def main() -> None:
    args = D.script_arguments(__doc__.splitlines()[0]).parse_args()
    with contextlib.suppress(ImportError, ValueError, OSError):  # this run fails on purpose: no core file for it
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    ctx = D.setup(args.device)  # joining waits for every process to start: the usual timeout
    try:
        dist.barrier()  # everyone is here: the mismatch below is the only problem
        group = dist.new_group(timeout=datetime.timedelta(seconds=args.timeout_s))  # every rank makes it
        dist.barrier(group=group)  # and joins it: its connections exist before the mismatch
        if ctx.rank == 0:
            D.log(ctx, f"rank 0 calls all_reduce; the other rank never will (timeout {args.timeout_s:g} s)")
            t = torch.ones(4, device=ctx.device)
            work = dist.all_reduce(t, group=group, async_op=True)
            # NCCL is asynchronous: only a wait with a timeout blocks this thread and raises here when it passes
            work.wait(timeout=datetime.timedelta(seconds=args.timeout_s))
            D.log(ctx, "unreachable: the all-reduce completed")
        else:
            time.sleep(10 * args.timeout_s + 60)  # torchrun stops this rank once rank 0 has failed
        D.write_result(ctx, args.result, {"completed": True})
    finally:
        D.teardown()


if __name__ == "__main__":
    main()
