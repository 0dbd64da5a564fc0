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


def test_step_outcome_report_says_what_was_released_and_checks_it():
    failed = out_of_memory.StepOutcome(ok=False, error="CUDA out of memory. Tried to allocate 2 GiB", before_bytes=100,
                                       held_bytes=5000, after_bytes=100, device="cuda:0")
    text = failed.report()
    assert text.startswith("out of memory, caught: CUDA out of memory") and "while handling the error 4.88 KiB" in text
    with pytest.raises(AssertionError, match="meant not to fit"):
        out_of_memory.StepOutcome(ok=True, device="cuda:0").report()
    real = ("CUDA out of memory. Tried to allocate 16.21 GiB. GPU 0 has a total capacity of 139.80 GiB of which "
            "124.92 GiB is free. Including non-PyTorch memory, this process has 1.2 GiB memory in use.")
    capped = out_of_memory.StepOutcome(ok=False, error=real, before_bytes=100, held_bytes=5000, after_bytes=100,
                                       device="cuda:0").report(cap_bytes=16 * 2**30)
    first_line = capped.splitlines()[0]
    assert first_line.endswith("124.92 GiB is free. The 16.00 GiB cap on this process's allocator refused it, not "
                               "the GPU."), first_line
    kept = out_of_memory.StepOutcome(ok=False, error="x", before_bytes=0, held_bytes=0, after_bytes=2 * MiB,
                                     device="cuda:0")
    with pytest.raises(AssertionError, match="releasing left 2.00 MiB"):
        kept.report()
    out_of_memory.StepOutcome(ok=False, error="x", before_bytes=0, after_bytes=2 * MiB, device="cpu").report()  # RSS
    outcome = out_of_memory.try_step(lambda: torch.empty(2**62, dtype=torch.uint8), "cpu")
    assert outcome.device == "cpu" and not outcome.ok


def test_memory_budget_on_a_cpu_caps_nothing_and_says_why():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU branch")
    with out_of_memory.memory_budget(16 * 2**30, "cpu") as budget:
        assert not budget.active and not budget.whole_budget
    assert "No cap on a CPU" in str(budget)


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch.cuda answering like an 80 GiB GPU with 1 GiB reserved and ``free`` bytes free; logs the fractions."""
    fractions, state = [], {"free": 70 * 2**30}
    monkeypatch.setattr(out_of_memory, "get_device", lambda device=None: torch.device("cuda:0"))
    monkeypatch.setattr(out_of_memory, "release_memory", lambda *args: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: type("P", (), {"total_memory": 80 * 2**30})())
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 2**30)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (state["free"], 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, device=None: fractions.append(fraction))
    return fractions, state


def test_memory_budget_caps_this_process_allocator_and_undoes_it(fake_gpu):
    fractions, state = fake_gpu
    with out_of_memory.memory_budget(16 * 2**30, "cuda") as budget:
        assert fractions == [0.2]
    assert fractions == [0.2, 1.0] and budget.whole_budget and budget.cap_bytes == 16 * 2**30
    assert "not its CUDA context nor other processes" in budget.what and "holds 1.00 GiB now" in budget.what
    with out_of_memory.memory_budget(100 * 2**30, "cuda") as whole:
        pass
    assert whole.cap_bytes == 80 * 2**30 and not whole.whole_budget and "the cap is the whole GPU" in whole.what
    state["free"] = 10 * 2**30  # other processes hold most of the GPU
    with out_of_memory.memory_budget(16 * 2**30, "cuda") as crowded:
        pass
    assert not crowded.whole_budget and "Other processes leave this one only 11.00 GiB" in crowded.what


def test_search_largest_batch_records_the_peaks_of_every_batch_that_fitted():
    made = []

    def step(inputs, targets):
        if len(inputs) > 50:
            raise torch.OutOfMemoryError("CUDA out of memory")

    def batch_of(b):
        made.append(b)
        return torch.zeros(b, 2), torch.zeros(b, 2)

    search = out_of_memory.search_largest_batch(step, "cpu", start=8, limit=1000, inputs=batch_of)
    assert search.largest == 50 and made == [b for b, _ in search.tried]
    assert set(search.peaks) == {b for b, ok in search.tried if ok} and all(a > 0 for a, _ in search.peaks.values())


def test_budget_rows_and_record_searches(capsys):
    from utils import results

    base = out_of_memory.BatchSearch(80, ((32, True), (128, False)), 1000, {80: (15 * 2**30, 16 * 2**30 - 1)})
    capped = out_of_memory.BatchSearch(1000, ((1000, True),), 1000)
    rows = out_of_memory.budget_rows({"baseline": 85, "bf16": 108, "combined": 2207},
                                     {"baseline": base, "combined": capped})
    assert rows[0]["measured"] == "80" and rows[0]["vs baseline"] == "1.0×" and rows[0]["peak allocated"] == "15.00 GiB"
    assert rows[1]["measured"] == "—" and rows[2]["measured"] == "≥ 1,000" and rows[2]["vs baseline"] == "12.5×"
    whole = out_of_memory.MemoryBudget("cuda:0", 2**34, 2**34, 0.2, 0, 2**36, "")
    out_of_memory.record_searches({"max_batch_test_base": base, "max_batch_test_capped": capped}, whole)
    assert results.RECORDED["max_batch_test_base"].value == 80 and "max_batch_test_capped" not in results.RECORDED
    assert "only a lower bound" in capsys.readouterr().out
    small = out_of_memory.MemoryBudget("cuda:0", 2**34, 2**33, 1.0, 0, 2**33, "")
    out_of_memory.record_searches({"max_batch_test_small": base}, small)
    assert "max_batch_test_small" not in results.RECORDED and "not the whole" in capsys.readouterr().out
