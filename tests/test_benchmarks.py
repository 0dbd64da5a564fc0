"""utils.benchmarks: the guide's table, the checks, reading a row against the guide, the compile row, attention in a
compiled graph and in a profile, a decode step's floor, and the cross-check against another notebook's run."""

from __future__ import annotations

import json

import pytest
import torch

from utils import benchmarks as bm
from utils.bench import Comparison, Verdict, Work
from utils.profile import Kernel, StepProfile


def _comparison(times: dict[str, list[float]], items: float = 100) -> Comparison:
    return Comparison.from_rounds(times, work=Work(items, "images"))


def _profile(kernels: list[tuple[str, float]], wall_s: float = 1e-3, steps: int = 1, unit: str = "step") -> StepProfile:
    start, out = 0.0, []
    for name, us in kernels:
        out.append(Kernel(name, start, us))
        start += us
    return StepProfile(device="cuda:0", steps=steps, wall_s=wall_s, kernels=out, on_gpu=True, unit=unit)


def test_guide_table_has_the_four_rows():
    rows = bm.guide_table()
    assert [r["the guide's RTX 4090"] for r in rows] == ["1,850", "320", "145", "1.3–2×"]
    assert bm.GUIDE["BERT-Large inference"].notes == "batch 32, torch.compile"


def test_full_fp32_turns_tf32_off_and_restores_the_settings():
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True
    try:
        with bm.full_fp32():
            assert torch.get_float32_matmul_precision() == "highest"
            assert torch.backends.cudnn.allow_tf32 is False
        assert torch.get_float32_matmul_precision() == "high" and torch.backends.cudnn.allow_tf32 is True
    finally:
        torch.set_float32_matmul_precision("highest")


def test_check_close_returns_the_error_and_fails_beyond_the_tolerance_or_on_nan():
    ref = torch.ones(100)
    assert bm.check_close("x", ref * 1.001, ref, 1e-2) == pytest.approx(1e-3, rel=1e-3)
    with pytest.raises(AssertionError, match="bf16 weights: relative error 1.0e-01"):
        bm.check_close("bf16 weights", ref * 1.1, ref, 1e-2)
    with pytest.raises(AssertionError, match="nan"):
        bm.check_close("x", torch.full((100,), float("nan")), ref, 1e-2)
    with pytest.raises(ValueError, match="shapes differ"):
        bm.relative_error(torch.ones(3), torch.ones(4))


def _step(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss
    return step


def test_first_step_and_its_check():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    twin = torch.nn.Linear(8, 4)
    twin.load_state_dict(model.state_dict())
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    first = bm.first_step(_step(model), model, x, y)
    assert first[1].numel() == 8 * 4 + 4
    line = bm.check_first_step("twin", bm.first_step(_step(twin), twin, x, y), first, None)
    assert line.startswith("✅ twin") and "gradients 0e+00" in line
    overflowed = (first[0], None)  # a GradScaler's first scale overflowed: gradients not compared, and it says so
    assert "not compared" in bm.check_first_step("fp16", overflowed, first, torch.float16)
    with pytest.raises(AssertionError, match="off, loss"):
        bm.check_first_step("off", (first[0] * 2, first[1]), first, None)


def test_repeated_calls_times():
    calls = []
    bm.repeated(lambda: calls.append(1), 3)()
    assert len(calls) == 3
    with pytest.raises(ValueError):
        bm.repeated(lambda: None, 0)


def test_against_guide_is_the_same_only_inside_the_band():
    tight = _comparison({"guide": [0.100, 0.101, 0.099, 0.100, 0.101, 0.100], "best": [0.05] * 6})
    assert bm.against_guide(tight, "guide", tight.rate("guide")) == ("the same as the guide's 4090 figure, within "
                                                                    "this run's band")
    # 09 on the H200: a band of −5%/+4% holds the guide's figure without showing the two equal (wider than ±3%)
    c = _comparison({"guide": [0.10, 0.11, 0.09, 0.10, 0.12, 0.10], "best": [0.05, 0.05, 0.05, 0.05, 0.05, 0.05]})
    rate = c.rate("guide")  # about 1,000 images/s
    assert bm.against_guide(c, "guide", rate) == ("no different from the guide's 4090 figure at this run's "
                                                  "resolution (its band 930–1,000 holds 1,000)")
    assert bm.against_guide(c, "guide", rate / 2) == f"{2:.2f}× the guide's 4090 figure"
    assert bm.against_guide(c, "guide", rate, comparable=False).startswith("not comparable")
    with pytest.raises(ValueError):
        bm.against_guide(c, "guide", 0)


def test_guide_range_and_compile_pairs():
    assert [bm.guide_range(s) for s in (0.9, 1.3, 2.0, 2.5)] == ["below", "within", "within", "above"]
    # by the band where there is one: 09b's BERT pair, 1.36× with a band of 1.04–1.51×, is not 'within'
    assert bm.guide_range(1.36, (1.04, 1.51)) == "across 1.3" and bm.guide_range(1.9, (1.7, 2.2)) == "across 2"
    assert bm.guide_range(1.5, (1.4, 1.6)) == "within" and bm.guide_range(1.1, (1.0, 1.25)) == "below"
    c = _comparison({"eager": [0.2] * 8, "compiled": [0.1] * 8, "other": [0.4] * 8})
    pair = bm.CompilePair("model", c, "eager", "compiled", 12.4, guide=True)
    row = pair.row()
    assert row["speed-up"] == "2.00×" and row["the guide's 1.3–2×"] == "within" and row["compile time"] == "12 s"
    assert "the guide's setting" in row["model"]
    slow = bm.CompilePair("slow", c, "eager", "other", -1.0)
    assert slow.row()["compile time"] == "0 s"  # a negative difference of first calls is shown as none
    assert bm.compile_summary([pair, slow]) == "torch.compile speed-ups from 0.50× (slow) to 2.00× (model)"
    assert bm.compile_summary([pair]).startswith("torch.compile: 2.00× faster")
    with pytest.raises(ValueError):
        bm.compile_summary([])


def test_compile_pair_columns_have_the_pairs_own_speed_up():
    # a noisy baseline: the table's times divide its median by each variant's speed-up against it, so the ratio
    # of eager's and compiled's table times need not be the pair's own speed-up (the median of their ratios)
    c = _comparison({"guide": [0.30, 0.50, 0.31, 0.52, 0.33, 0.55, 0.30, 0.50],
                     "eager": [0.20, 0.22, 0.20, 0.23, 0.21, 0.20, 0.22, 0.21],
                     "compiled": [0.10, 0.20, 0.10, 0.21, 0.11, 0.19, 0.10, 0.20]})
    pair = bm.CompilePair("model", c, "eager", "compiled", 1.0)
    columns = pair.per_item_s()
    assert columns["eager"] == pytest.approx(c.time_s("eager") / 100)  # as the comparison's table shows it
    assert columns["eager"] / columns["compiled = eager ÷ speed-up"] == pytest.approx(pair.verdict.speedup)
    assert c.time_s("eager") / c.time_s("compiled") != pytest.approx(pair.verdict.speedup, rel=1e-3)
    assert set(pair.row()) >= {"eager", "compiled = eager ÷ speed-up", "speed-up", "verdict"}


def test_hedged_marks_a_resolved_difference_at_the_resolutions_edge():
    edge = _comparison({"a": [1.0] * 6 + [1.0] * 6, "b": [1 / 1.032] * 6 + [1 / 1.004, 1 / 1.26] * 3})
    v = edge.verdict("b")
    assert v.outcome == "faster" and v.band[0] < 1.03
    assert bm.hedged(v).startswith(v.short + " (band from 1.0") and "within the 3% resolution" in bm.hedged(v)
    assert bm.hedged(v, long=True).startswith(v.text) and bm.hedged(v, long=True).endswith(
        "within the 3% resolution: the effect may be that small")
    # a larger median whose band's end lies within the resolution: the note is about the band, not the effect
    wide = Verdict("b", "a", 1.17, (1.028, 1.28), 0.03, 12)
    assert bm.hedged(wide) == "1.17× faster (band from 1.028×, within the 3% resolution)"
    assert "about the" not in bm.hedged(wide, long=True)
    clear = _comparison({"a": [0.2] * 8, "b": [0.1] * 8}).verdict("b")
    assert bm.hedged(clear) == clear.short and bm.hedged(clear, long=True) == clear.text
    slow_edge = _comparison({"a": [1.0] * 12, "b": [1.032] * 6 + [1.004, 1.26] * 3}).verdict("b")
    assert slow_edge.outcome == "slower" and "within the 3% resolution" in bm.hedged(slow_edge)


def test_table_row_uses_the_comparisons_numbers():
    c = _comparison({"guide": [0.2] * 8, "best": [0.1] * 8})
    row = bm.table_row("GPT-2 generation", c, "guide", "best", "40% of the copy bandwidth", comparable=True,
                       note="host-bound")
    assert row["guide's 4090"] == "145" and row["best vs guide setting"] == "2.00× faster"
    assert row["vs the 4090"].endswith("(host-bound)") and row["limit"] == "40% of the copy bandwidth"
    same = bm.table_row("GPT-2 generation", c, "guide", "guide", "", comparable=False)
    assert same["best vs guide setting"] == "— (it is the best)"


def test_a_best_that_ties_with_the_next_is_named_with_it():
    c = _comparison({"guide": [0.2] * 8, "batch 128": [0.1, 0.101, 0.099, 0.1] * 2, "batch 256": [0.1] * 8})
    best = c.fastest
    tie = bm.best_against_next(c)
    assert tie.variant == best and tie.baseline != best and tie.outcome != "faster"
    row = bm.table_row("BERT-Large inference", c, "guide", best, "", comparable=True)
    assert row["best setting"].startswith(f"{best} (or {tie.baseline}: ")
    clear = _comparison({"guide": [0.2] * 8, "batch 128": [0.15] * 8, "batch 256": [0.1] * 8})
    assert bm.best_against_next(clear).outcome == "faster"
    assert bm.table_row("BERT-Large inference", clear, "guide", "batch 256", "", comparable=True)[
        "best setting"] == "batch 256"
    with pytest.raises(ValueError):
        bm.best_against_next(Comparison({"guide": c.timings["guide"]}, "guide"))  # nothing to be next


def test_transposed_turns_rows_into_lines():
    rows = [{"task": "A", "x": "1", "y": "2"}, {"task": "B", "x": "3", "y": "4"}]
    assert bm.transposed(rows) == [{"": "x", "A": "1", "B": "3"}, {"": "y", "A": "2", "B": "4"}]
    with pytest.raises(ValueError):
        bm.transposed([])


GENERATED = """
buf3 = torch.ops.aten._scaled_dot_product_efficient_attention.default(buf0, buf1, buf2, buf9, False)
buf7 = extern_kernels.mm(buf4, buf5)
"""


def test_attention_in_graph_reads_the_generated_code():
    assert bm.attention_ops([GENERATED, GENERATED]) == ["_scaled_dot_product_efficient_attention"]
    assert "memory-efficient" in bm.attention_in_graph([GENERATED])
    assert "no fused attention" in bm.attention_in_graph(["buf7 = extern_kernels.bmm(buf4, buf5)"])
    assert "no generated code" in bm.attention_in_graph([])
    cpu = "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v)"
    assert "FlashAttention for CPUs" in bm.attention_in_graph([cpu])


def test_attention_kernels_and_their_change():
    eager = _profile([("fmha_cutlassF_f32_aligned_64x64_rf_sm80", 300.0), ("sm90_xmma_gemm", 500.0)])
    compiled = _profile([("triton_per_fused__softmax_0", 200.0), ("sm90_xmma_gemm", 700.0)])
    assert list(bm.attention_kernels(eager)) == ["fmha_cutlassF_f32_aligned_64x64_rf_sm80"]
    text = bm.attention_change(eager, compiled)
    assert "eager: fmha_cutlassF" in text and "compiled: no attention kernel ran" in text
    two = _profile([("fmha_a", 300.0), ("flash_fwd_b", 100.0)])
    assert "(2 attention kernels by name)" in bm.attention_change(two, compiled)


def test_profile_reading_gives_the_verdict_then_the_profiles():
    c = _comparison({"eager": [0.2] * 8, "compiled": [0.25] * 8})
    eager = _profile([("fmha_cutlassF", 300.0), ("gemm", 500.0)])
    compiled = _profile([("triton_softmax", 400.0), ("gemm", 600.0)])
    lines = bm.profile_reading(c.verdict("compiled"), eager, compiled, names=("eager", "compiled")).splitlines()
    assert lines[0].startswith("compiled against eager: 1.25× slower") and len(lines) == 3
    assert "no attention kernel ran" in lines[2]
    # the clause on what fusion can save: for a compile pair only, and there the matmul work is what stays
    assert "fusion" not in lines[1] and "matmul and attention" not in lines[1]
    compiled_pair = bm.profile_reading(c.verdict("compiled"), eager, compiled, names=("eager", "compiled"),
                                       compile_pair=True).splitlines()
    assert "matmul kernels take 50% of eager's step: that work stays after compiling" in compiled_pair[1]
    assert "attention may be lowered" in compiled_pair[1] and compiled_pair[1].count("fusion") == 1


def test_decode_floor_names_the_floor():
    near = _profile([("gemv", 90.0)] * 10, wall_s=1e-3)
    assert "near the memory limit" in bm.decode_floor(near, 1e-3, 2.4e12 * 1e-3 * 0.8, 2400)
    many = _profile([(f"k{i}", 2.0) for i in range(300)], wall_s=1e-3)
    text = bm.decode_floor(many, 1e-3, 2.4e12 * 1e-4, 2400)
    assert "the bytes explain only 10% of the step; the rest, 900 µs, is 3.00 µs per kernel over its 300 kernels" \
        in text
    assert text.endswith("more bandwidth could shorten at most the bytes' 10%"), text
    one = _profile([("slow_kernel", 600.0), ("k", 10.0)], wall_s=1e-3)
    assert "slow_kernel" in bm.decode_floor(one, 1e-3, 2.4e12 * 1e-4, 2400)
    with pytest.raises(ValueError):
        bm.decode_floor(one, 0, 1, 1)


def test_cross_check_reads_the_other_notebooks_reference_run(tmp_path):
    entry = {"08_inference": {"run": None, "figures": {"gpt2_tok_s_kv_cache": {"value": 200.0, "unit": "tokens/s"}}}}
    (tmp_path / "h200.json").write_text(json.dumps(entry))
    kwargs = dict(notebook="08_inference", figure="gpt2_tok_s_kv_cache", gpu="NVIDIA H200", results_dir=tmp_path)
    within = bm.cross_check(210.0, **kwargs)
    assert str(within).endswith("1.05× that — within a factor 1.2 either way") and within.agrees and within.note == ""
    assert "reference run (H200)" in str(within)  # no run record: the file's GPU
    apart = bm.cross_check(95.0, **kwargs)
    assert "apart by more than a factor 1.2 either way" in str(apart) and "notebook sources changed since" in str(apart)
    assert "compiles earlier in either process" in str(apart)
    assert not apart.agrees and apart.note == "0.47× notebook 08's run of the same step: see the cross-check"
    built = bm.cross_check(95.0, **kwargs, earlier="a compile and a Triton build")
    assert "compiles earlier in the process (this one ran a compile and a Triton build)" in str(built)
    run = {"gpu": "NVIDIA H200", "date": "2026-11-27", "torch": "2.11.0+cu130", "shared_host": True}
    (tmp_path / "h200.json").write_text(json.dumps({"08_inference": entry["08_inference"] | {"run": run}}))
    assert "reference run (NVIDIA H200, 2026-11-27, torch 2.11.0+cu130, beside other notebooks)" in \
        str(bm.cross_check(210.0, **kwargs))
    nothing = bm.cross_check(95.0, **(kwargs | {"gpu": "NVIDIA H100 80GB HBM3"}))
    assert "nothing to cross-check against" in str(nothing) and nothing.ratio is None and nothing.note == ""
    assert "nothing to cross-check against" in str(bm.cross_check(95.0, **(kwargs | {"figure": "other"})))


def test_guide_chart_draws_the_guide_the_reference_runs_and_this_run(tmp_path):
    entry = {"09_benchmarks": {"run": None, "figures": {"best": {"value": 6000.0, "unit": "images/s"}}}}
    (tmp_path / "h200.json").write_text(json.dumps(entry))
    fig = bm.guide_chart([("ResNet-50", "images/s", {"the guide": 1850}, {"best": "best"})], notebook="09_benchmarks",
                         results_dir=tmp_path, here="this GPU", recorded={"best": 6100.0})
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels == ["the guide", "H200, reference run (best)", "this GPU (best)"]
    assert "the other GPUs' reference runs in results/" in fig._suptitle.get_text()
    same_kind = bm.guide_chart([("ResNet-50", "images/s", {"the guide": 1850}, {"best": "best"})],
                               notebook="09_benchmarks", results_dir=tmp_path, here="NVIDIA H200",
                               recorded={"best": 6100.0})  # its own kind's file: the run it replaces, left out
    assert [t.get_text() for t in same_kind.axes[0].get_yticklabels()] == ["the guide", "NVIDIA H200 (best)"]
    assert same_kind._suptitle.get_text() == "The guide's table: its RTX 4090, and this run"  # no other run drawn


def test_two_timings_of_one_step_say_both_and_which_is_quoted():
    first = _comparison({"guide": [0.4] * 8, "best": [0.1, 0.12, 0.09, 0.11] * 2})
    second = _comparison({"synthetic": [0.085, 0.086, 0.085, 0.0855] * 2, "decode": [0.05] * 8})
    text = bm.two_timings("best", first, second, second_variant="synthetic", first_where="in section 1",
                          second_where="here")
    assert text.startswith(f"best, timed in two comparisons: {bm.format_value(first.rate('best'))} images/s (band ")
    assert "in section 1;" in text and "outside the first's band" in text
    assert text.endswith("the rate quoted for the step elsewhere is the first")
    close = _comparison({"synthetic": [0.1, 0.1, 0.1, 0.1] * 2, "decode": [0.05] * 8})
    assert "inside the first's band" in bm.two_timings("best", first, close, second_variant="synthetic",
                                                       first_where="a", second_where="b")
    with pytest.raises(ValueError):
        bm.two_timings("a", Comparison.from_rounds({"a": [1, 1], "b": [1, 1]}), close, first_where="",
                       second_where="", second_variant="synthetic")


def test_first_call_code_returns_what_inductor_generated_without_resetting_dynamo():
    torch._dynamo.reset()
    before = torch.compile(lambda x: torch.sin(x) + 1)
    before(torch.ones(4))
    after = torch.compile(lambda x: torch.cos(x) * 2)
    out, code = bm.first_call_code(lambda: after(torch.ones(4)))
    assert torch.allclose(out, torch.cos(torch.ones(4)) * 2) and code and "cos" in "\n".join(code)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    before(torch.ones(4))  # still compiled: no new graph
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames
