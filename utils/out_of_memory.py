"""Running out of memory and carrying on: recognise the error, whichever allocator raised it
(:func:`is_out_of_memory`); run a step that may fail, release what it held and return instead of raising
(:func:`try_step` → :class:`StepOutcome`); and find the largest batch that fits by doubling, then bisection
(:func:`largest_batch` → :class:`BatchSearch`, with :func:`fits_in_memory` turning a training step into the
``fits(batch)`` it asks).

:func:`largest_batch` takes any ``fits(batch) -> bool``: a prediction from sizes (``utils.memory_calculator``) or
real training steps on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from utils.env import get_device
from utils.memory import format_bytes, memory_stats, release_memory

#: What the message of a RuntimeError that means "out of memory" contains, besides torch.OutOfMemoryError: the CPU
#: allocator's refusal, a CUDA call that failed for memory outside PyTorch's allocator (``CUDA error: out of
#: memory``, e.g. loading a kernel's code on first use when the allocator has taken the whole GPU), and cuBLAS
#: failing to allocate its own memory.
_OUT_OF_MEMORY_MESSAGES = ("can't allocate memory", "CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED")


def is_out_of_memory(err: BaseException) -> bool:
    """True for ``torch.OutOfMemoryError`` (PyTorch's CUDA allocator could not serve a request) and for the
    RuntimeErrors that mean the same from elsewhere: the CPU allocator's "can't allocate memory" (a request the
    operating system refused), ``CUDA error: out of memory`` (a CUDA call, such as loading a kernel's code on its
    first use, found no memory left outside the allocator: recoverable, unlike most CUDA errors) and cuBLAS's
    ``CUBLAS_STATUS_ALLOC_FAILED``."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and any(m in str(err) for m in _OUT_OF_MEMORY_MESSAGES)


@dataclass(frozen=True)
class StepOutcome:
    """What :func:`try_step` saw: whether the step ran, and the memory before, during and after the error."""

    ok: bool
    error: str | None = None  # the first line of the out-of-memory message
    before_bytes: int = 0  # allocated before the step (CUDA: memory_allocated; CPU: RSS)
    held_bytes: int = 0  # allocated while the error was being handled: what the failed step still held
    after_bytes: int = 0  # allocated after releasing
    device: str = ""  # where it ran (the before/held/after readings are the allocator's on CUDA, RSS on a CPU)

    def report(self, *, slack_bytes: int = 2**20, cap_bytes: int | None = None) -> str:
        """For a step that was meant not to fit: the error and the memory before, while handling it and after
        releasing, as two lines. The error is cut after its last whole sentence within 150 characters. With
        ``cap_bytes`` (a :func:`memory_budget`'s ``cap_bytes``) it adds that the cap refused the allocation: the
        error's "free" memory is the whole GPU's, which the cap does not change.

        Raises:
            AssertionError: if the step ran after all, or, on a GPU, if releasing left more than ``slack_bytes``
                allocated beyond what was there before the step.
        """
        assert not self.ok, "the step ran: it was meant not to fit"
        if self.device.startswith("cuda"):
            assert self.after_bytes <= self.before_bytes + slack_bytes, (
                f"releasing left {format_bytes(self.after_bytes - self.before_bytes)} of the failed step allocated")
        said = _first_sentences(self.error or "", 150)
        if cap_bytes is not None:
            said += f" The {format_bytes(cap_bytes)} cap on this process's allocator refused it, not the GPU."
        return (f"out of memory, caught: {said}\nallocated before the step "
                f"{format_bytes(self.before_bytes)} · while handling the error {format_bytes(self.held_bytes)} · "
                f"after releasing {format_bytes(self.after_bytes)}")


def _first_sentences(text: str, limit: int) -> str:
    """The sentences of ``text`` ("… . ") that fit in ``limit`` characters: at least the first, cut with "…" if
    that alone is longer."""
    sentences = [part + "." for part in text.strip().split(". ") if part]
    if sentences:
        sentences[-1] = sentences[-1].removesuffix("..")
    kept = ""
    for sentence in sentences:
        if kept and len(kept) + 1 + len(sentence) > limit:
            break
        kept = f"{kept} {sentence}".strip()
    return kept if len(kept) <= limit else kept[:limit - 1] + "…"


def try_step(fn: Callable[[], object], device: torch.device | str, *, release: Sequence[Any] = ()) -> StepOutcome:
    """Run ``fn()``; if it runs out of memory, release what it held and return instead of raising.

    Inside the ``except`` block the exception's traceback still references the failed call's frames, and with
    them every tensor they created: that is what ``held_bytes`` measures. Once the block is left they go; then
    :func:`utils.memory.release_memory` drops the gradients of ``release`` (models or optimizers), collects
    garbage and empties the cache. Errors other than running out of memory propagate unchanged.
    """
    dev = get_device(device)

    def allocated() -> int:
        return memory_stats(dev).allocated_bytes  # CUDA: memory_allocated; CPU: current RSS

    before = allocated()
    message, held = None, 0
    try:
        fn()
    except (torch.OutOfMemoryError, RuntimeError) as err:
        if not is_out_of_memory(err):
            raise
        message, held = (str(err).strip().splitlines() or ["out of memory"])[0], allocated()
    if message is None:
        return StepOutcome(ok=True, before_bytes=before, after_bytes=allocated(), device=str(dev))
    release_memory(dev, *release)
    return StepOutcome(ok=False, error=message, before_bytes=before, held_bytes=held, after_bytes=allocated(),
                       device=str(dev))


def fits_in_memory(run: Callable[[int], object], device: torch.device | str, *,
                   release: Sequence[Any] = ()) -> Callable[[int], bool]:
    """``fits(batch)``: True if ``run(batch)`` finished, False if it ran out of memory (released by
    :func:`try_step`, so the next attempt starts clean). For :func:`largest_batch`."""
    def fits(batch: int) -> bool:
        outcome = try_step(lambda: run(batch), device, release=release)
        if outcome.ok:
            release_memory(device, *release)  # the next, larger attempt starts from the same state
        return outcome.ok

    return fits


@dataclass(frozen=True)
class BatchSearch:
    """What :func:`largest_batch` found: the largest batch that fitted, and every batch it tried, in order."""

    largest: int  # 0 if not even 1 fits
    tried: tuple[tuple[int, bool], ...]
    limit: int
    #: batch → (peak allocated, peak reserved) of each attempt that fitted, where the search measured them
    #: (:func:`search_largest_batch`)
    peaks: dict[int, tuple[int, int]] = field(default_factory=dict)

    @property
    def limit_reached(self) -> bool:
        """True when the limit itself fitted: the true largest batch may be larger."""
        return self.largest == self.limit

    def __str__(self) -> str:
        steps = ", ".join(f"{b}{'✓' if ok else '✗'}" for b, ok in self.tried)
        bound = " (the limit: larger ones were not tried)" if self.limit_reached else ""
        return f"largest batch {self.largest:,}{bound} after {len(self.tried)} tries: {steps}"


def largest_batch(fits: Callable[[int], bool], *, start: int = 1, limit: int = 1 << 16,
                  resolution: float = 0.0) -> BatchSearch:
    """The largest batch ``b`` in [1, ``limit``] with ``fits(b)``, assuming that a batch fits if a larger one does.

    Doubles from ``start`` until a batch fails (or ``limit`` is reached), then bisects between the last batch
    that fitted and the first that failed: about 2·log₂(answer) calls. With ``resolution`` > 0 it stops once the
    gap is at most that fraction of the batch that fitted (0.05: within 5%), saving the last few, largest tries.
    Wrap a training step with :func:`fits_in_memory` to search on a real GPU.

    Raises:
        ValueError: for ``start`` outside [1, limit] or a negative resolution.
    """
    if not 1 <= start <= limit:
        raise ValueError(f"need 1 <= start <= limit, got start={start}, limit={limit}")
    if resolution < 0:
        raise ValueError(f"resolution must be >= 0, got {resolution}")
    tried: list[tuple[int, bool]] = []

    def attempt(batch: int) -> bool:
        ok = bool(fits(batch))
        tried.append((batch, ok))
        return ok

    good, bad = 0, None
    batch = start
    while True:  # grow: start, 2·start, 4·start, ... until a failure or the limit
        if attempt(batch):
            good = batch
            if batch == limit:
                return BatchSearch(good, tuple(tried), limit)
            batch = min(2 * batch, limit)
        else:
            bad = batch
            break
    while bad - good > max(1, resolution * good):  # bisect (good fits, bad does not)
        middle = (good + bad) // 2
        if attempt(middle):
            good = middle
        else:
            bad = middle
    return BatchSearch(good, tuple(tried), limit)


# ── A smaller GPU, emulated: a cap on what this process's allocator may reserve ────────────────────────────


@dataclass(frozen=True)
class MemoryBudget:
    """What :func:`memory_budget` set: the cap on this process's allocator, and what it counts."""

    device: str
    budget_bytes: int  # the budget asked for
    cap_bytes: int | None  # what the allocator may reserve: the budget, or the whole GPU if it is smaller
    fraction: float | None  # of the GPU's memory (torch.cuda.set_per_process_memory_fraction)
    reserved_at_start: int  # what this process's allocator held when the cap was set (it counts)
    available_bytes: int | None  # what this process could reserve at the start: free memory + its own reserved
    what: str

    @property
    def active(self) -> bool:
        return self.cap_bytes is not None

    @property
    def whole_budget(self) -> bool:
        """True when the cap is the whole budget (the GPU has that much) and the GPU had room for all of it."""
        return (self.cap_bytes == self.budget_bytes and self.available_bytes is not None
                and self.available_bytes >= self.budget_bytes)

    def __str__(self) -> str:
        return self.what


@contextmanager
def memory_budget(budget_bytes: int, device: torch.device | str) -> Iterator[MemoryBudget]:
    """Inside the ``with`` block, this process's caching allocator may reserve at most ``budget_bytes``
    (``torch.cuda.set_per_process_memory_fraction``, undone on exit): a smaller GPU, emulated on a large one.

    The cap counts only this process's allocator — its reserved memory, as ``torch.cuda.max_memory_reserved``
    reports it — including what it holds when the block starts (start from a clean state). It does not count this
    process's CUDA context (a few hundred MiB outside the allocator, which a real card of that size would also
    hold) nor other processes. They are not subtracted: ``mem_get_info``'s used memory mixes them, so it cannot
    say what is this process's. Where other processes leave less free memory than the budget, a search inside it
    stops short; :attr:`MemoryBudget.available_bytes` and the ``what`` sentence say so. A GPU smaller than the
    budget is capped at its whole memory. On a CPU nothing is capped (the operating system swaps, then kills,
    rather than raising), and the budget says so.
    """
    dev = get_device(device)
    if dev.type != "cuda":
        yield MemoryBudget(str(dev), budget_bytes, None, None, 0, None,
                           "No cap on a CPU: there is no fixed memory to fill — the operating system swaps, then "
                           "kills the process, instead of raising.")
        return
    release_memory(dev)
    total = torch.cuda.get_device_properties(dev).total_memory
    cap = min(budget_bytes, total)
    reserved = torch.cuda.memory_reserved(dev)
    free, _ = torch.cuda.mem_get_info(dev)
    available = free + reserved
    what = (f"This process's allocator may reserve {format_bytes(cap)} (memory fraction {cap / total:.3f} of "
            f"{format_bytes(total)}); it holds {format_bytes(reserved)} now, which counts. Counted: this process's "
            "reserved memory only, not its CUDA context nor other processes.")
    if cap < budget_bytes:
        what += f" This GPU has less than {format_bytes(budget_bytes)}: the cap is the whole GPU."
    if available < cap:
        what += (f" Other processes leave this one only {format_bytes(available)}: the search stops there, short "
                 "of the cap.")
    torch.cuda.set_per_process_memory_fraction(cap / total, dev)
    try:
        yield MemoryBudget(str(dev), budget_bytes, cap, cap / total, reserved, available, what)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
        release_memory(dev)


def search_largest_batch(run: Callable[..., object], device: torch.device | str, *, start: int = 1,
                         limit: int = 1 << 16, resolution: float = 0.0, release: Sequence[Any] = (),
                         inputs: Callable[[int], tuple] | None = None) -> BatchSearch:
    """:func:`largest_batch` over real steps: ``run(batch)`` — or, with ``inputs``, ``run(*inputs(batch))``, e.g.
    ``search_largest_batch(partial(train_step, model, optimizer), device, inputs=make_batch)`` — under
    :func:`fits_in_memory`, and for each batch that fitted its peaks (allocated, reserved), read with
    ``max_memory_allocated`` / ``max_memory_reserved`` after a reset (:attr:`BatchSearch.peaks`; on a CPU the RSS
    high-water mark for both). Run it inside :func:`memory_budget` to search a smaller GPU."""
    dev = get_device(device)
    peaks: dict[int, tuple[int, int]] = {}

    def measured(batch: int) -> None:
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        run(*inputs(batch)) if inputs is not None else run(batch)
        if dev.type == "cuda":
            peaks[batch] = (torch.cuda.max_memory_allocated(dev), torch.cuda.max_memory_reserved(dev))
        else:
            stats = memory_stats(dev)
            peaks[batch] = (stats.peak_allocated_bytes, stats.peak_allocated_bytes)

    search = largest_batch(fits_in_memory(measured, dev, release=release), start=start, limit=limit,
                           resolution=resolution)
    return BatchSearch(search.largest, search.tried, search.limit, peaks)


def budget_rows(predicted: dict[str, int], searches: dict[str, BatchSearch]) -> list[dict[str, object]]:
    """Table rows: per variant, the largest batch the calculator predicts (``predicted``) and, where a search ran
    (``searches``), the one measured, against the first search's, with the peaks (allocated, reserved) of the step at
    that batch. A search that reached its limit shows "≥": its answer is a lower bound."""
    first = next(iter(searches.values()), None)
    rows = []
    for label, guess in predicted.items():
        found = searches.get(label)
        row: dict[str, object] = {"variant": label, "predicted": f"{guess:,}", "measured": "—", "vs baseline": "—",
                                  "peak allocated": "—", "peak reserved": "—"}
        if found is not None:
            row["measured"] = ("≥ " if found.limit_reached else "") + f"{found.largest:,}"
            if first is not None and first.largest:
                row["vs baseline"] = f"{found.largest / first.largest:.1f}×"
            if found.largest in found.peaks:
                allocated, reserved = found.peaks[found.largest]
                row["peak allocated"], row["peak reserved"] = format_bytes(allocated), format_bytes(reserved)
        rows.append(row)
    return rows


def record_searches(figures: dict[str, BatchSearch], budget: MemoryBudget) -> None:
    """Record each search's largest batch (``utils.results.record``, unit "sequences") when it measured the whole
    budget: the GPU had that much, other processes left room for it, and the search did not stop at its limit (a
    lower bound). Otherwise print why the figure is not recorded."""
    from utils import results

    for name, search in figures.items():
        if not budget.whole_budget:
            print(f"{name} not recorded: the search ran under a cap of {format_bytes(budget.cap_bytes or 0)}, not "
                  f"the whole {format_bytes(budget.budget_bytes)} budget.")
        elif search.limit_reached:
            print(f"{name} not recorded: {search.largest:,} is only a lower bound (the search reached its limit).")
        else:
            results.record(name, search.largest, "sequences")
