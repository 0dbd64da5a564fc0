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


def cache_demo(device: torch.device | str, *, mib: int = 512) -> tuple[list[dict[str, object]], str]:
    """Allocated against reserved, step by step: a ``mib`` MiB tensor, ``del``, the same size again, ``del`` and
    ``torch.cuda.empty_cache()``. Returns table rows (bytes formatted) and the sentence the numbers say: what
    stayed reserved after ``del``, whether the second tensor came from the cache, what ``empty_cache()`` gave
    back. On a CPU, with no caching allocator, the same steps read the process's RSS: the C library maps a block
    this large straight from the operating system and returns it on ``free``, which the sentence checks."""
    from utils.memory import memory_stats, release_memory

    dev = get_device(device)
    release_memory(dev)
    rows: list[dict[str, int | str]] = []

    def note(what: str) -> None:
        stats = memory_stats(dev)
        rows.append({"after": what, "allocated": stats.allocated_bytes, "reserved": stats.reserved_bytes})

    note("clean start")
    if dev.type != "cuda":
        block = torch.ones(mib * MiB // 4)  # every page written
        note(f"a {mib} MiB tensor, every page written")
        del block
        note("del")
        start, held, freed = (int(r["reserved"]) for r in rows)
        returned = held - freed > mib * MiB // 2
        said = (f"CPU, no caching allocator: RSS {format_bytes(start)} → {format_bytes(held)} → {format_bytes(freed)}"
                f" after del: {'given back to the operating system' if returned else 'kept by the C library'}.")
    else:
        block = torch.empty(mib * MiB, dtype=torch.uint8, device=dev)
        note(f"block = torch.empty({mib} MiB)")
        del block
        note("del block")
        block = torch.empty(mib * MiB, dtype=torch.uint8, device=dev)
        note("the same size again")
        del block
        torch.cuda.empty_cache()
        note("del block; empty_cache()")
        start, _, freed, again, emptied = (int(r["reserved"]) for r in rows)
        came = "came from the cache" if again == freed else f"changed reserved by {format_bytes(again - freed)}"
        said = (f"After del, {format_bytes(freed - start)} more than at the start stayed reserved (cached, not given "
                f"back); the same size again {came}; empty_cache() gave {format_bytes(again - emptied)} back.")
    table = [{"after": r["after"], "allocated": format_bytes(int(r["allocated"])),
              "reserved": format_bytes(int(r["reserved"]))} for r in rows]
    return table, said


def empty_cache_refills(nbytes: int, device: torch.device | str, *, calls: int = 20) -> int:
    """Of ``calls`` rounds of ``empty_cache()`` then ``torch.empty(nbytes)``: how many made reserved memory grow,
    i.e. asked the driver for a new segment (``cudaMalloc``) because ``empty_cache()`` had given the last one back.
    Fewer than ``calls`` means the cache served the others: ``empty_cache()`` returns only segments with no live
    tensor in them. CUDA only.

    Raises:
        RuntimeError: on a CPU.
    """
    dev = get_device(device)
    if dev.type != "cuda":
        raise RuntimeError("empty_cache_refills needs the CUDA caching allocator")
    grew = 0
    for _ in range(calls):
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(dev)
        block = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        grew += torch.cuda.memory_reserved(dev) > before
        del block
    return grew


def probe_settings(*, timeout_s: float = 180.0) -> dict[str, ProbeResult]:
    """:func:`allocator_probe` for the defaults and for ``expandable_segments:True`` through each variable of
    :data:`ALLOC_CONF_VARS`, the child processes run side by side (each needs its own process: the allocator reads
    its settings once). Keys: "no variable (defaults)" and the variables' names."""
    from concurrent.futures import ThreadPoolExecutor

    settings = [None, *ALLOC_CONF_VARS]
    with ThreadPoolExecutor(len(settings)) as pool:
        done = list(pool.map(lambda v: allocator_probe(v, timeout_s=timeout_s), settings))
    return {("no variable (defaults)" if v is None else v): p for v, p in zip(settings, done, strict=True)}


def probe_rows(probes: dict[str, ProbeResult]) -> list[dict[str, object]]:
    """Table rows of :func:`probe_settings`: the setting, whether expandable segments were in use, reserved
    memory with the big tensor and after ``empty_cache()``, and the first warning the child printed."""
    return [{"set": label if p.variable is None else f"{label}={p.value}",
             "expandable segments in use": {True: "yes", False: "no", None: "unknown"}[p.expandable_segments],
             "reserved with the big tensor": format_bytes(p.reserved_after("one tensor")),
             "after empty_cache()": format_bytes(p.reserved_after("empty_cache")),
             "warning": p.warnings[0][-70:] if p.warnings else "none"} for label, p in probes.items()]


#: An expandable segment maps physical memory in pages of this size in the large pool (kLargeBuffer in
#: CUDACachingAllocator.cpp).
EXPANDABLE_PAGE = 20 * MiB


def probe_summary(probes: dict[str, ProbeResult]) -> str:
    """What the probes say, from their numbers: for each variable, honoured or ignored (and any warning); with
    expandable segments, the reserved memory the big tensor needed against the defaults, and what stayed after
    ``empty_cache()`` (whole :data:`EXPANDABLE_PAGE` pages)."""
    lines = []
    for name in ALLOC_CONF_VARS:
        p = probes[name]
        status = {True: "honoured", False: "IGNORED (no error)", None: "could not be read back"}[
            p.expandable_segments]
        lines.append(f"{name}={p.value}: {status} by PyTorch {p.torch_version}"
                     + (f", with a warning: {p.warnings[0]}" if p.warnings else ", no warning"))
    default = probes["no variable (defaults)"]
    honoured = [p for name, p in probes.items() if name in ALLOC_CONF_VARS and p.expandable_segments]
    if honoured:
        on = honoured[0]
        kept, pages = on.reserved_after("empty_cache"), -(-default.reserved_after("empty_cache") // EXPANDABLE_PAGE)
        lines.append(f"With expandable segments the big tensor needed {format_bytes(on.reserved_after('one tensor'))}"
                     f" reserved, against {format_bytes(default.reserved_after('one tensor'))} with the defaults; "
                     f"after empty_cache() {format_bytes(kept)} stay"
                     + (f": whole {format_bytes(EXPANDABLE_PAGE)} pages, {pages} of them." if kept
                        == pages * EXPANDABLE_PAGE else "."))
    return "\n".join(lines)
