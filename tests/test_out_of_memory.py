"""utils.out_of_memory: recognising out-of-memory errors, a step that fails and releases what it held, and the
search for the largest batch that fits (on CPU with a function, on a GPU with real allocations and steps).
"""

import math

import pytest
import torch

from tests.tiny_transformer import SMALL, small_lm
from utils import memory, out_of_memory, train

MiB = 2**20
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")




def test_is_out_of_memory_knows_both_allocators():
    assert out_of_memory.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    try:
        torch.empty(2**62, dtype=torch.uint8)
    except RuntimeError as err:
        assert out_of_memory.is_out_of_memory(err)
    assert not out_of_memory.is_out_of_memory(RuntimeError("shape mismatch"))
    assert not out_of_memory.is_out_of_memory(ValueError("can't allocate memory"))
    # a CUDA call that found no memory outside the allocator (e.g. loading a kernel lazily), and cuBLAS
    assert out_of_memory.is_out_of_memory(RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be ..."))
    cublas = "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"
    assert out_of_memory.is_out_of_memory(RuntimeError(cublas))
    assert not out_of_memory.is_out_of_memory(RuntimeError("CUDA error: an illegal memory access was encountered"))


def test_try_step_catches_out_of_memory_and_lets_other_errors_through():
    ok = out_of_memory.try_step(lambda: torch.ones(4), "cpu")
    assert ok.ok and ok.error is None
    model, x, y = small_lm()

    def half_done():  # gradients exist, then the next allocation fails
        train.lm_loss(model(x), y).backward()
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    failed = out_of_memory.try_step(half_done, "cpu", release=[model])
    assert not failed.ok and failed.error.startswith("CUDA out of memory")
    assert all(p.grad is None for p in model.parameters()), "release= must drop the half-done gradients"
    with pytest.raises(ValueError, match="not memory"):
        out_of_memory.try_step(lambda: (_ for _ in ()).throw(ValueError("not memory")), "cpu")
    with pytest.raises(RuntimeError, match="size"):
        out_of_memory.try_step(lambda: torch.ones(2) @ torch.ones(3), "cpu")


@pytest.mark.parametrize("answer", [1, 2, 3, 7, 8, 9, 100, 777, 1000, 4095])
def test_largest_batch_finds_the_threshold_in_few_tries(answer):
    search = out_of_memory.largest_batch(lambda b: b <= answer, limit=4096)
    assert search.largest == answer
    assert len(search.tried) <= 2 * math.log2(answer + 1) + 3
    assert not search.limit_reached or answer == 4096


def test_largest_batch_edges_and_resolution():
    assert out_of_memory.largest_batch(lambda b: False).largest == 0
    top = out_of_memory.largest_batch(lambda b: True, limit=1000)
    assert top.largest == 1000 and top.limit_reached and "the limit" in str(top)
    coarse = out_of_memory.largest_batch(lambda b: b <= 777, start=4, resolution=0.05)
    assert 777 / 1.05 <= coarse.largest <= 777 and len(coarse.tried) < 15
    assert out_of_memory.largest_batch(lambda b: b <= 5, start=64).largest == 5  # start too big: bisect below it
    for bad in ({"start": 0}, {"start": 10, "limit": 5}, {"resolution": -1}):
        with pytest.raises(ValueError):
            out_of_memory.largest_batch(lambda b: True, **bad)


def test_fits_in_memory_turns_out_of_memory_into_false():
    def run(batch):
        if batch > 6:
            raise torch.OutOfMemoryError("CUDA out of memory")
    fits = out_of_memory.fits_in_memory(run, "cpu")
    assert fits(6) and not fits(7)
    assert out_of_memory.largest_batch(fits).largest == 6


# --- on a real GPU --------------------------------------------------------------------------------


@cuda
def test_cuda_try_step_releases_a_real_out_of_memory():
    model, x, y = small_lm()
    model = model.cuda()
    before = torch.cuda.memory_allocated()
    total = torch.cuda.get_device_properties(0).total_memory

    def too_big():
        keep = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")  # held by the frame when it fails
        torch.empty(2 * total, dtype=torch.uint8, device="cuda")
        del keep

    outcome = out_of_memory.try_step(too_big, "cuda", release=[model])
    assert not outcome.ok and "out of memory" in outcome.error.lower()
    assert outcome.held_bytes >= before + 64 * MiB, "the traceback still holds the frame's tensor"
    assert outcome.after_bytes == before
    assert out_of_memory.try_step(lambda: model(x.cuda()).sum().backward(), "cuda").ok  # carries on


@cuda
def test_cuda_largest_batch_under_a_memory_fraction():
    # The fraction caps all that this process's allocator reserves, and earlier tests in the same process (an
    # xdist worker) may still hold memory: the budget is what is reserved now plus 2 GiB to search in.
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    held = torch.cuda.memory_reserved()
    headroom = 2 * 2**30
    budget = held + headroom
    torch.cuda.set_per_process_memory_fraction(budget / total)
    try:
        fits = out_of_memory.fits_in_memory(lambda b: torch.empty(b * MiB, dtype=torch.uint8, device="cuda"), "cuda")
        search = out_of_memory.largest_batch(fits, start=64, limit=1 << 14)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert headroom / MiB * 0.8 < search.largest <= budget / MiB, (search, f"{held / MiB:.0f} MiB held before")


@cuda
def test_cuda_largest_batch_of_real_training_steps_in_a_budget():
    model, _, _ = small_lm()
    model = model.cuda()
    optimizer = torch.optim.AdamW(model.parameters())

    def run(b):
        x = torch.randint(0, SMALL.vocab_size, (b, 64), device="cuda")
        train.train_step(model, optimizer, x, x)

    fits = out_of_memory.fits_in_memory(run, "cuda", release=[optimizer])
    assert fits(8)  # AdamW's state exists before the budget is set
    memory.release_memory("cuda")
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 256 * MiB) / total)
    try:
        search = out_of_memory.largest_batch(fits, start=8, limit=1 << 14, resolution=0.05)
        assert fits(search.largest), "after the failed attempts, the largest batch still runs"
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert 8 < search.largest < search.limit and any(not ok for _, ok in search.tried), search
    assert all(p.grad is None for p in model.parameters())
