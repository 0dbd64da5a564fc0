"""Running out of memory and carrying on: recognise the error, whichever allocator raised it
(:func:`is_out_of_memory`); run a step that may fail, release what it held and return instead of raising
(:func:`try_step` → :class:`StepOutcome`); and find the largest batch that fits by doubling, then bisection
(:func:`largest_batch` → :class:`BatchSearch`, with :func:`fits_in_memory` turning a training step into the
``fits(batch)`` it asks).

:func:`largest_batch` takes any ``fits(batch) -> bool``: a prediction from sizes (``utils.memory_calculator``) or
real training steps on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from utils.env import get_device
from utils.memory import memory_stats, release_memory

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
        return StepOutcome(ok=True, before_bytes=before, after_bytes=allocated())
    release_memory(dev, *release)
    return StepOutcome(ok=False, error=message, before_bytes=before, held_bytes=held, after_bytes=allocated())


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
