"""PyTorch's CUDA caching allocator and its settings: fragmentation, shown on the GPU (:func:`fragmentation_demo`);
the environment variables that configure the allocator (:data:`ALLOC_CONF_VARS`); and what a setting really does,
measured in a fresh child process, because the allocator reads its settings once, when CUDA starts
(:func:`allocator_probe` → :class:`ProbeResult`).

CUDA only: on CPU there is no caching allocator, and :func:`fragmentation_demo` raises a RuntimeError saying so.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from utils.env import get_device
from utils.memory import format_bytes
from utils.memory_snapshot import expandable_segments_enabled

#: The environment variables that configure PyTorch's CUDA caching allocator, and which releases read them
#: (from PyTorch's source and issue tracker; the notebook measures what the installed version does, and whether
#: it prints a warning about the variable: :attr:`ProbeResult.warnings`).
ALLOC_CONF_VARS = {
    "PYTORCH_CUDA_ALLOC_CONF": "the original name, read by every release that has these options; from 2.9 on "
                               "also an alias of PYTORCH_ALLOC_CONF, which some releases flag with a deprecation "
                               "warning",
    "PYTORCH_ALLOC_CONF": "the device-generic name, read from 2.9 on; in 2.9 its "
                          "expandable_segments option did not reach the CUDA allocator, without a warning "
                          "(pytorch/pytorch#183387, reported on 2.9.1; honoured by 2.11)",
}

MiB = 2**20


def fragmentation_demo(device: torch.device | str, *, tensors: int = 10, tensor_mib: int = 48,
                       big_mib: int = 288) -> list[dict[str, object]]:
    """Allocate ``tensors`` × ``tensor_mib`` MiB, free them all, then ask for one ``big_mib`` MiB tensor, then
    ``empty_cache()``; returns one row per stage with the allocated and reserved bytes above those at the start,
    and ``cached``: the free memory the allocator holds at that stage, all reserved minus all allocated (never
    negative, unlike the difference of the two columns above the start). CUDA only.

    With the default allocator each tensor of 10 MiB or more gets a segment (one cudaMalloc) of its own; freed
    segments stay cached, but free memory in different segments cannot be joined, so the big request needs a new
    segment though enough memory is cached: reserved grows past what is allocated (fragmentation) until
    ``empty_cache()`` returns the unused segments. With ``expandable_segments:True`` the tensors share one
    segment that grows; the freed space is contiguous and serves the big request. If the cache already holds a
    free block of ``big_mib`` MiB or more at the start (in segments that live tensors of earlier work keep
    reserved, which ``empty_cache()`` cannot return), the big tensor comes from there and nothing shows:
    :func:`fragmentation_verdict` reads the rows and says which of these happened.
    """
    dev = get_device(device)
    if dev.type != "cuda":
        raise RuntimeError("the caching allocator is a CUDA feature: there is nothing to fragment on CPU")
    rows: list[dict[str, object]] = []

    def stage(what: str) -> None:
        torch.cuda.synchronize(dev)
        allocated, reserved = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)
        rows.append({"stage": what, "allocated": allocated, "reserved": reserved, "cached": reserved - allocated})

    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    base_allocated, base_reserved = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)
    stage("start")
    parts = [torch.empty(tensor_mib * MiB, dtype=torch.uint8, device=dev) for _ in range(tensors)]
    stage(f"{tensors} tensors of {tensor_mib} MiB")
    del parts
    stage("all of them freed")
    big = torch.empty(big_mib * MiB, dtype=torch.uint8, device=dev)
    stage(f"one tensor of {big_mib} MiB")
    torch.cuda.empty_cache()
    stage("empty_cache()")
    del big
    torch.cuda.empty_cache()
    for row in rows:  # above what was there at the start
        row["allocated"] = int(row["allocated"]) - base_allocated  # type: ignore[call-overload]
        row["reserved"] = int(row["reserved"]) - base_reserved  # type: ignore[call-overload]
    return rows


def fragmentation_verdict(rows: list[dict[str, object]], *, expandable: bool | None = None) -> str:
    """What the rows of :func:`fragmentation_demo` show, decided from their numbers: a sentence.

    Fragmentation only if the big tensor needed new segments (reserved grew) although the cache held at least as
    much free memory as it asked for; a new segment with too little cached is no fragmentation; no new segment
    means the cache served it — contiguous freed space with expandable segments (``expandable``: whether the
    allocator uses them), else a free block left by earlier work.

    Raises:
        ValueError: if ``rows`` are not the five stages of :func:`fragmentation_demo`.
    """
    if len(rows) != 5 or not all({"allocated", "reserved", "cached"} <= set(r) for r in rows):
        raise ValueError("fragmentation_verdict() needs the five rows of fragmentation_demo(), each with "
                         "'allocated', 'reserved' and 'cached'")
    numbers = [{k: int(v) for k, v in row.items() if k != "stage"} for row in rows]  # type: ignore[call-overload]
    start, freed, big, emptied = (numbers[i] for i in (0, 2, 3, 4))
    need, cached, grew = big["allocated"], freed["cached"], big["reserved"] - freed["reserved"]
    if grew > 0 and cached >= need:
        said = (f"the {format_bytes(need)} tensor needed {format_bytes(grew)} of new segments although "
                f"{format_bytes(cached)} were cached and free: fragmentation — no free piece could hold it")
    elif grew > 0:
        said = (f"the cache held {format_bytes(cached)} free, less than the {format_bytes(need)} asked for, so a "
                f"new segment of {format_bytes(grew)} was needed: that is not fragmentation")
    else:
        said = f"the cache served the {format_bytes(need)} tensor without a new segment: " + (
            "with expandable segments the freed space is contiguous" if expandable else
            f"a large enough free block was cached before the demo began ({format_bytes(start['cached'])} free at "
            "its start, in segments that live tensors keep reserved), so there is no fragmentation to see")
    return f"{said}. empty_cache() then left {format_bytes(emptied['reserved'])} reserved above the start."


def _allocator_probe_main() -> None:  # pragma: no cover - runs in the child process on a GPU
    """The child process of :func:`allocator_probe`: run :func:`fragmentation_demo`, print JSON."""
    import json

    device = torch.device("cuda")
    torch.zeros(1, device=device)  # initialise CUDA (and the allocator, which reads its settings now)
    rows = fragmentation_demo(device)
    snapshot = torch.cuda.memory._snapshot()
    print(json.dumps({"torch": torch.__version__, "expandable_segments": expandable_segments_enabled(snapshot),
                      "rows": rows}))


@dataclass(frozen=True)
class ProbeResult:
    """What a child process with one allocator setting measured (:func:`allocator_probe`)."""

    variable: str | None  # the environment variable set, or None for the defaults
    value: str | None
    torch_version: str
    expandable_segments: bool | None  # what the allocator really used
    rows: list[dict[str, object]]
    warnings: list[str]  # the child's warnings about the variable (e.g. deprecation)

    def reserved_after(self, stage_prefix: str) -> int:
        return next(int(r["reserved"]) for r in self.rows if str(r["stage"]).startswith(stage_prefix))


def allocator_probe(variable: str | None, value: str = "expandable_segments:True", *,
                    timeout_s: float = 180.0) -> ProbeResult:
    """Run :func:`fragmentation_demo` in a fresh Python process with ``variable=value`` set (and the other
    allocator variables removed), and return what it measured and whether its allocator really used expandable
    segments. The allocator reads its settings once, when CUDA starts, so each setting needs its own process.

    Raises:
        RuntimeError: if the child fails or prints no result (its stderr's tail is in the message).
        subprocess.TimeoutExpired: past ``timeout_s``.
    """
    import json
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ALLOC_CONF_VARS}
    if variable is not None:
        env[variable] = value
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    done = subprocess.run([sys.executable, "-c", "import utils.allocator as m; m._allocator_probe_main()"],
                          capture_output=True, text=True, timeout=timeout_s, env=env, cwd=root)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"the allocator probe with {variable}={value} failed (exit {done.returncode}): {tail}")
    data = json.loads(lines[-1])
    warnings = [line.strip() for line in done.stderr.splitlines() if "ALLOC_CONF" in line]
    return ProbeResult(variable, value if variable else None, data["torch"], data["expandable_segments"],
                       data["rows"], warnings)
