"""utils.inference: child deadlines by the host's cores, the AOTInductor gate and report, the Hugging Face child's
report read as one comparison, a profile against the bytes, and the batch sweep's reading."""

import signal
from types import SimpleNamespace

import pytest

from utils import bench, gpt2, inference, isolate
from utils.memory import format_bytes


def test_child_deadline_grows_on_few_cores_within_its_bound():
    assert inference.child_deadline_s(100, cpus=16) == 100
    assert inference.child_deadline_s(100, cpus=64) == 100  # never shorter than the reference
    assert inference.child_deadline_s(100, cpus=8) == 200
    assert inference.child_deadline_s(100, cpus=2) == 250  # 8× capped at 2.5×
    assert inference.child_deadline_s(100, cpus=2, most=10) == 800
    with pytest.raises(ValueError):
        inference.child_deadline_s(0)


def test_aotinductor_gate_names_a_known_crash_few_cores_or_nothing():
    crash = inference.aotinductor_gate("cuda", torch_version="2.11.0+cu130", cpus=64, environ={})
    assert crash and "segmentation fault" in crash and "COURSE_TRY_AOTI" in crash
    assert inference.aotinductor_gate("cuda", torch_version="2.11.0+cu130", cpus=64,
                                      environ={"COURSE_TRY_AOTI": "1"}) is None
    few = inference.aotinductor_gate("cuda", torch_version="2.12.0", cpus=2, environ={})
    assert few and "this host has 2" in few
    assert inference.aotinductor_gate("cuda", torch_version="2.12.0", cpus=16, environ={}) is None
    assert inference.aotinductor_gate("cpu", torch_version="2.11.0", cpus=2, environ={}) is None  # tiny model


def child(returncode, result, *, timed_out=False, lines=()):
    return isolate.ChildRun("script.py", returncode, timed_out, 60, 1.0, result, list(lines))


STAGES = {"load the checkpoint": 0.1, "export": 1.0, "check the exported program": 0.1, "AOTInductor compile": 10.0}


def test_aotinductor_report_reads_success_crash_and_a_wrong_artifact():
    done = child(0, {"stage": isolate.DONE, "seconds": STAGES, "exported_relative_error": 0.0,
                     "relative_error": 2e-7, "package_bytes": 3 * 2**20})
    text = "\n".join(inference.aotinductor_report(done))
    assert "export 1.0" in text and "3.0 MiB" in text and "2.0e-07" in text
    crashed = child(-signal.SIGSEGV, {"stage": "load", "seconds": STAGES, "exported_relative_error": 0.0,
                                      "torch": "2.11.0"}, lines=["Fatal Python error: Segmentation fault"])
    text = "\n".join(inference.aotinductor_report(crashed))
    assert "SIGSEGV" in text and "in stage 'load'" in text and "not at fault" in text and "2.11.0" in text
    stopped = child(None, {"stage": "AOTInductor compile", "seconds": {}}, timed_out=True)
    text = "\n".join(inference.aotinductor_report(stopped))
    assert "none finished" in text and "did not finish within 60 s" in text and "not at fault" not in text
    with pytest.raises(AssertionError, match="exported program"):
        inference.aotinductor_report(child(1, {"stage": "load", "seconds": {}, "exported_relative_error": 0.1}))
    with pytest.raises(AssertionError, match="package"):
        inference.aotinductor_report(child(0, {"stage": isolate.DONE, "seconds": {}, "exported_relative_error": 0,
                                               "relative_error": 0.5, "package_bytes": 1}))


def timing(label, times):
    return {"label": label, "block_times_s": list(times)}


def test_read_hf_child_builds_one_comparison_against_the_fastest_hf_variant():
    result = {"stage": isolate.DONE, "variants": {
        "ours": {"first_call_s": 1.0, "graphs_compiled": 0, "graphs_loaded": 0, "greedy": True,
                 "timing": timing("ours", [0.06, 0.061, 0.062, 0.06])},
        "HF generate, dynamic cache": {"first_call_s": 2.0, "graphs_compiled": 0, "greedy": True,
                                       "timing": timing("d", [1.5, 1.6, 1.55, 1.5])},
        "HF generate, static cache": {"first_call_s": 14.0, "graphs_compiled": 1, "graphs_loaded": 0, "greedy": True,
                                      "timing": timing("s", [0.41, 0.42, 0.4, 0.41])}}}
    hf = inference.read_hf_child(child(0, result), 256)
    assert hf.best_hf == "HF generate, static cache"
    assert hf.comparison.verdict("ours").outcome == "faster"
    assert hf.comparison.rate("ours") == pytest.approx(256 / 0.0605, rel=0.02)
    assert "1 compiled, 0 from its cache" in hf.report() and "first call 2.00 s" in hf.report()
    assert "child process" in hf.comparison.title and "its own rounds" in hf.comparison.title
    assert hf.verdict_line("ours").startswith("ours vs HF generate, static cache: ")
    assert "faster" in hf.verdict_line("ours") and "whole generation" in hf.verdict_line("ours")


def test_read_hf_child_puts_each_first_call_against_a_call_of_the_rounds():
    """A first call far above a call of the rounds is named a one-off cost, beside the Inductor graphs it compiled
    (or "no Inductor graph", so the cost is not taken for a compile); one near a call is said to be about a call."""
    result = {"stage": isolate.DONE, "variants": {
        "ours": {"first_call_s": 0.08, "graphs_compiled": 0, "greedy": True,
                 "timing": timing("ours", [0.06, 0.061, 0.062, 0.06])},
        "HF generate, dynamic cache": {"first_call_s": 18.6, "graphs_compiled": 0, "greedy": True,
                                       "timing": timing("d", [2.9, 2.85, 2.87, 2.88])},
        "HF generate, static cache": {"first_call_s": 18.6, "graphs_compiled": 1, "graphs_loaded": 0, "greedy": True,
                                      "timing": timing("s", [0.59, 0.6, 0.58, 0.59])}}}
    hf = inference.read_hf_child(child(0, result), 256)
    lines = dict(line.split(": ", 1) for line in hf.lines)
    dynamic, static = lines["HF generate, dynamic cache"], lines["HF generate, static cache"]
    # a call is the comparison's one number per variant (its table's per call), not the variant's own median
    call = {label: bench.format_seconds(hf.comparison.time_s(label)) for label in hf.comparison.variants}
    assert call["HF generate, dynamic cache"] == "2.89 s" and call["ours"] == "60.0 ms"  # own medians: 2.88 s, 60.5 ms
    assert "15.7 s more than a call in the child's rounds (2.89 s): one-off costs" in dynamic
    assert dynamic.endswith("no Inductor graph compiled in it")
    assert "18.0 s more than a call" in static and static.endswith("1 compiled, 0 from its cache")
    assert "about a call's time in the child's rounds (60.0 ms)" in lines["ours"]
    assert all(f"({call[label]})" in line for label, line in lines.items())
    assert lines["ours"].startswith("first call 80.0 ms") and static.startswith("first call 18.6 s")
    result["variants"]["ours"]["first_call_s"] = 0.02  # a host busier in the rounds than in the first call
    ours = inference.read_hf_child(child(0, result), 256).lines[0]
    assert ours.startswith("ours: first call 20.0 ms, less than a call in the child's rounds (60.0 ms);")


def test_read_hf_child_without_ours_in_its_comparison_gives_a_line_not_a_key_error():
    """Ours failed in the child, both Hugging Face variants were timed: their comparison stands, ours has no verdict."""
    result = {"stage": isolate.DONE, "variants": {
        "ours": {"error": "RuntimeError: capture failed"},
        "HF generate, dynamic cache": {"first_call_s": 2.0, "greedy": True, "timing": timing("d", [1.5, 1.6, 1.5])},
        "HF generate, static cache": {"first_call_s": 14.0, "greedy": True, "timing": timing("s", [0.4, 0.41, 0.4])}}}
    hf = inference.read_hf_child(child(0, result), 256)
    assert hf.comparison is not None and "ours" not in hf.comparison.variants
    assert "not timed together" in hf.verdict_line("ours") and "capture failed" in hf.report()
    assert "not timed together" in inference.HFChild().verdict_line("ours")


def test_read_hf_child_keeps_the_last_comparison_after_a_deadline_and_says_why():
    """The child timed ours and the dynamic cache, then died compiling the static cache: that comparison stands, and
    each first call is put against a call of its rounds."""
    result = {"stage": "first call: HF generate, static cache", "variants": {
        "ours": {"first_call_s": 1.0, "greedy": True, "timing": timing("ours", [0.06, 0.06, 0.061])},
        "HF generate, dynamic cache": {"first_call_s": 2.0, "greedy": True, "timing": timing("d", [1.5, 1.6, 1.5])},
        "HF generate, static cache": {}}}
    hf = inference.read_hf_child(child(None, result, timed_out=True), 256)
    assert hf.best_hf == "HF generate, dynamic cache" and set(hf.comparison.variants) == {
        "ours", "HF generate, dynamic cache"}
    assert "did not finish" in hf.report() and hf.lines[2] == "HF generate, static cache: its first call did not finish"
    assert f"({bench.format_seconds(hf.comparison.time_s('ours'))})" in hf.lines[0]  # against the fallback's rounds


def test_read_hf_child_without_two_timed_variants_compares_nothing_and_a_wrong_token_fails():
    result = {"stage": isolate.DONE, "variants": {"ours": {"error": "RuntimeError: no triton"},
                                                  "HF generate, dynamic cache": {"first_call_s": 2.0, "greedy": True}}}
    hf = inference.read_hf_child(child(0, result), 8)
    assert hf.comparison is None and "not available here (RuntimeError: no triton)" in hf.report()
    assert "not timed against ours" in hf.report()
    wrong = {"stage": isolate.DONE, "variants": {"ours": {"first_call_s": 1.0, "greedy": False}}}
    with pytest.raises(AssertionError, match="not the greedy tokens"):
        inference.read_hf_child(child(0, wrong), 8)


def test_busy_against_bytes_puts_busy_time_against_the_copy_bandwidth():
    line = inference.busy_against_bytes(SimpleNamespace(busy_s=200e-6), 100 * 2**20, 4000.0, on_gpu=True)
    least = 100 * 2**20 / 4000e9
    assert f"{200e-6 / least:.1f}×" in line and f"{100 * least / 200e-6:.0f}% of copy" in line
    assert line.startswith("its kernels") and "100.0 MiB" in line


def test_batch_sweep_finds_the_knee_and_says_what_grew():
    model = gpt2.GPT2(gpt2.GPT2Config.tiny())
    per_call = {1: 0.010, 2: 0.0102, 4: 0.011, 8: 0.014}  # batch 8: 1.4× batch 1's step
    rounds = {f"batch {b}": [t, t * 1.01, t * 0.99, t] for b, t in per_call.items()}
    by_batch = bench.Comparison.from_rounds(rounds, work=bench.Work({f"batch {b}": b * 23 for b in per_call},
                                                                    "tokens"))
    sweep = inference.batch_sweep(by_batch, model, list(per_call), prompt=16, new_tokens=24, copy_gbps=100.0)
    assert sweep.knee == 8 and sweep.growth[8] == pytest.approx(1.4, rel=0.02)
    assert sweep.rates[4].tokens_per_s == pytest.approx(4 * 23 / 0.011, rel=0.02)
    assert sweep.kv_bytes_at_knee == gpt2.bytes_per_decode_step(model, 8, 28) - gpt2.bytes_per_decode_step(model, 0, 28)
    text = "\n".join(sweep.reading())
    assert "batch 8" in text and "batch 1 reads at" in text and len(sweep.rows()) == 4
    # the knee's arithmetic: the KV bytes batch 8 reads beyond batch 1's, at the copy bandwidth, against the growth:
    # from the average context (28 positions) to the whole buffer of 40, which a static cache reads masked
    low, high = (gpt2.bytes_per_decode_step(model, 1, n) - gpt2.bytes_per_decode_step(model, 0, n) for n in (28, 40))
    grew_s = (sweep.rates[8].ms_per_token - sweep.rates[1].ms_per_token) / 1e3
    assert f"its KV caches read {format_bytes(8 * low)}–{format_bytes(8 * high)} per step (the average context to " \
           "the whole buffer, which a static cache reads masked" in text, text
    assert f"), {format_bytes(7 * low)}–{format_bytes(7 * high)} more than batch 1's" in text
    lo_s, hi_s = 7 * low / 100e9, 7 * high / 100e9
    assert (f"those bytes take {bench.format_seconds(lo_s)}–{bench.format_seconds(hi_s)}, {lo_s / grew_s:.0%}–"
            f"{hi_s / grew_s:.0%} of the growth; the rest is not these bytes (not measured apart here)") in text, text
    assert "work of each kernel grew" not in text and "longer caches" not in text  # no cause it did not measure
    one = sweep.rates[1].pct_copy
    assert f"would take {one:.0f}% of its step; something other than the bytes sets the rest" in text
    flat = bench.Comparison.from_rounds({f"batch {b}": [0.01, 0.0101] for b in (1, 2)},
                                        work=bench.Work({"batch 1": 23, "batch 2": 46}, "tokens"))
    assert "nearly free at 2" in "\n".join(inference.batch_sweep(flat, model, [1, 2], prompt=16, new_tokens=24,
                                                                 copy_gbps=None).reading())
    with pytest.raises(ValueError, match="batch 1"):
        inference.batch_sweep(by_batch, model, [2, 4], prompt=16, new_tokens=24, copy_gbps=1.0)
    assert sweep.plot("sweep") is not None
    assert sweep.verdicts[8].outcome == "slower" and sweep.unresolved == []


def test_batch_sweep_reads_no_knee_from_a_growth_its_rounds_do_not_resolve():
    """A loaded CPU: batch 2's median step reads 1.35× batch 1's, but its rounds scatter across 1 — no knee, no
    cause, and no claim that extra sequences were free either; a resolved growth later is still the knee."""
    model = gpt2.GPT2(gpt2.GPT2Config.tiny())
    rounds = {"batch 1": [0.01] * 6, "batch 2": [0.005, 0.03, 0.004, 0.04, 0.013, 0.014], "batch 4": [0.0101] * 6}
    work = bench.Work({"batch 1": 23, "batch 2": 46, "batch 4": 92}, "tokens")
    sweep = inference.batch_sweep(bench.Comparison.from_rounds(rounds, work=work), model, [1, 2, 4], prompt=16,
                                  new_tokens=24, copy_gbps=100.0)
    assert sweep.growth[2] > sweep.GROWTH and sweep.verdicts[2].outcome == "inconclusive"
    assert sweep.knee is None and sweep.unresolved == [2]
    text = "\n".join(sweep.reading())
    assert "did not resolve" in text and "knee" in text
    assert "nearly free" not in text and "work of each kernel grew" not in text
    rounds["batch 4"] = [0.02, 0.021, 0.019, 0.02, 0.02, 0.0205]  # 2× batch 1's in every round
    sweep = inference.batch_sweep(bench.Comparison.from_rounds(rounds, work=work), model, [1, 2, 4], prompt=16,
                                  new_tokens=24, copy_gbps=100.0)
    assert sweep.knee == 4 and sweep.unresolved == [2]
    assert "grows by more than a quarter at batch 4" in "\n".join(sweep.reading())
