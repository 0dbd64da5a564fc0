"""utils.playbook: the tips, the diagnosis of a profiled step, findings and their verdicts, idle gaps, rounding."""

import contextlib
import re
import warnings

import matplotlib.figure
import pytest
import torch

from utils import bench, playbook, profile
from utils import number_formats as nf


def gpu_profile(wall_us, kernels, *, on_gpu=True):
    """A one-step profile of wall_us: (name, count, µs each) kernels laid end to end from t = 0."""
    laid, t = [], 0.0
    for name, count, each in kernels:
        for _ in range(count):
            laid.append(profile.Kernel(name, t, each))
            t += each
    return profile.StepProfile(device="cuda:0" if on_gpu else "cpu", steps=1, wall_s=wall_us / 1e6, kernels=laid,
                               on_gpu=on_gpu)


def comparison(speedups, names=("base", "tip")):
    """A comparison of two variants from paired rounds whose per-round speed-ups are ``speedups`` (a number: 12
    rounds of it)."""
    ratios = [speedups] * 12 if isinstance(speedups, (int, float)) else list(speedups)
    return bench.Comparison.from_rounds({names[0]: [1e-3] * len(ratios), names[1]: [1e-3 / r for r in ratios]})


NOISE = [0.5, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.5, 2.0, 0.6, 1.8]  # a band from 0.7× to 1.5×: inconclusive


def test_every_bottleneck_names_known_tips():
    for keys in playbook.TIPS_FOR.values():
        assert keys and all(k in playbook.TIPS for k in keys)
    assert {t.key for t in playbook.TIPS.values()} == set(playbook.TIPS)


def test_conv_kernels_are_told_apart_from_matmuls():
    assert playbook.kind_of_kernel("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc") == "conv"
    assert playbook.kind_of_kernel("sm80_xmma_wgrad_implicit_gemm_indexed_tf32f32") == "conv"
    assert playbook.kind_of_kernel("aten::convolution_backward") == "conv"
    assert playbook.kind_of_kernel("sm90_xmma_gemm_bf16bf16_bf16f32") == "matmul"
    # Fused attention, whatever its name borrows from matmuls or convolutions.
    for name in ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, "
                 "cutlass::bfloat16_t>, true, false>(pytorch_flash::Flash_fwd_params)",
                 "fmha_cutlassF_f32_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<float>::Params)",
                 "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0"):
        assert playbook.kind_of_kernel(name) == "attention", name
        assert profile.kind_of(name) == "attention", name
    assert playbook.kind_of_kernel("void convert_fp32_to_bf16_kernel") == "other"
    assert playbook.kind_of_kernel("flash_fwd_kernel") == "attention"
    assert playbook.kind_of_kernel("void fft2d_r2c_32x32<float, false, 1u, false>") == "conv"  # cuDNN's FFT algorithm
    assert playbook.kind_of_kernel("void flip_filter<float, float>") == "conv"
    assert playbook.kind_of_kernel("void nchwToNhwcKernel<__nv_bfloat16>") == "other"  # a layout conversion
    # by the operator that launched it: cuDNN runs some convolutions with kernels named like plain GEMMs
    assert playbook.kind_of_kernel("sm90_xmma_gemm_bf16bf16_bf16f32", "aten::cudnn_convolution") == "conv"
    assert playbook.kind_of_kernel("cutlass_80_tensorop_gemm", "aten::convolution_backward") == "conv"
    assert playbook.kind_of_kernel("sm90_xmma_gemm_bf16bf16_bf16f32", "aten::mm") == "matmul"
    assert playbook.kind_of_kernel("void nchwToNhwcKernel<__nv_bfloat16>", "aten::cudnn_convolution") == "other"
    assert playbook.kind_of_kernel("void elementwise_kernel", "aten::_convert_indices_from_coo_to_csr") == "other"


def test_diagnose_launch_bound_step_names_cuda_graphs():
    d = playbook.diagnose(gpu_profile(1000, [("vectorized_elementwise_kernel", 20, 5.0)]))
    assert d.bound == "launch-bound" and d.share == pytest.approx(0.9)
    assert d.tip.key == "cuda_graphs" and "waits for the host 90%" in str(d)
    assert d.largest_share == "idle 90% of the step"


@pytest.mark.parametrize(("kernels", "kind", "tip"), [
    ([("sm90_xmma_fprop_implicit_gemm", 3, 250.0), ("bn_fw_kernel", 5, 40.0)], "conv", "channels_last"),
    ([("ampere_sgemm_128x64_nn", 3, 250.0), ("vectorized_elementwise_kernel", 60, 3.0)], "matmul", "tf32"),
    ([("flash_fwd_kernel", 1, 700.0), ("nvjet_hsh_128x256", 1, 200.0)], "attention", "sdpa"),
    ([("vectorized_elementwise_kernel", 100, 9.0)], "other", "compile"),
])
def test_diagnose_gpu_bound_step_by_the_kind_with_most_time(kernels, kind, tip):
    d = playbook.diagnose(gpu_profile(1000, kernels))
    assert d.bound == "GPU-bound" and d.largest == kind and d.tip.key == tip


def test_partly_launch_bound_adds_cuda_graphs():
    d = playbook.diagnose(gpu_profile(1000, [("ampere_sgemm_128x64_nn", 1, 650.0)]))
    assert d.bound == "partly launch-bound" and [t.key for t in d.tips] == ["tf32", "autocast", "cuda_graphs"]
    # the idle share is named beside the kernels' share, each with what it is a share of
    assert "matmul kernels take 100% of the GPU time, and the GPU waits for the host 35% of the step" in str(d)
    assert d.largest_share == "matmul 100% of the GPU time" and d.idle == pytest.approx(0.35)


def test_the_matmul_tip_follows_the_steps_precision():
    matmuls = [("ampere_sgemm_128x64_nn", 3, 250.0), ("vectorized_elementwise_kernel", 60, 3.0)]
    assert [t.key for t in playbook.diagnose(gpu_profile(1000, matmuls)).tips] == ["tf32", "autocast"]
    # a GPU without TF32 (a T4): 16-bit autocast is what speeds fp32 matmuls up
    assert [t.key for t in playbook.diagnose(gpu_profile(1000, matmuls), tf32=False).tips] == ["autocast"]
    # under autocast the matmuls already run in 16 bits: TF32 would change nothing
    amp = playbook.diagnose(gpu_profile(1000, matmuls), amp=torch.bfloat16)
    assert amp.largest == "matmul" and amp.tips == ()
    assert str(amp).endswith("→ no tip of this playbook applies: its matmuls already run in bfloat16 under autocast "
                             "(TF32 changes fp32 matmuls only)")
    partly = playbook.diagnose(gpu_profile(1000, [("ampere_sgemm_128x64_nn", 1, 650.0)]), amp=torch.float16)
    assert [t.key for t in partly.tips] == ["cuda_graphs"]
    idle_first = playbook.diagnose(gpu_profile(1000, [("sm90_xmma_gemm_f32", 1, 320.0), ("bn_fw", 1, 280.0)]),
                                   amp=torch.bfloat16)
    assert idle_first.largest == "launch" and "tf32" not in [t.key for t in idle_first.tips]
    # other kinds do not depend on the precision
    conv = [("sm90_xmma_fprop_implicit_gemm", 3, 250.0), ("bn_fw_kernel", 5, 40.0)]
    assert playbook.diagnose(gpu_profile(1000, conv), amp=torch.bfloat16).tip.key == "channels_last"


def test_idle_longer_than_any_kind_of_kernel_puts_fewer_launches_first():
    # idle 40% of the step (400 µs) outlasts the largest kind, convolutions (320 µs): launches first, then conv's tips
    d = playbook.diagnose(gpu_profile(1000, [("sm90_xmma_fprop_implicit_gemm", 1, 320.0), ("bn_fw", 1, 280.0)]))
    assert d.bound == "partly launch-bound" and d.largest == "launch" and d.share == pytest.approx(0.4)
    assert [t.key for t in d.tips] == ["cuda_graphs", "fused_optimizer", "compile", "channels_last",
                                       "cudnn_benchmark"]
    assert ("waits for the host 40% of the step, longer than any kind of kernel runs (500 µs of step time per "
            "kernel") in str(d)
    assert "→ try CUDA graphs" in str(d)
    # elementwise work as the largest kind adds nothing: compile is a launch tip already
    other = playbook.diagnose(gpu_profile(1000, [("vectorized_elementwise_kernel", 10, 30.0),
                                                 ("sm90_xmma_gemm_f32", 1, 250.0)]))
    assert other.largest == "launch" and [t.key for t in other.tips] == ["cuda_graphs", "fused_optimizer", "compile"]


def test_diagnose_on_cpu_names_only_cpu_tips():
    overhead = playbook.diagnose(gpu_profile(1000, [("aten::addmm", 2, 100.0)], on_gpu=False))
    assert overhead.bound == "overhead-bound" and overhead.tip.key == "compile"
    matmul = playbook.diagnose(gpu_profile(1000, [("aten::addmm", 2, 450.0)], on_gpu=False))
    assert matmul.largest == "matmul" and matmul.tips == () and "no tip" in str(matmul)
    assert "none of them exists on this device" in str(matmul)
    assert overhead.largest_share == "overhead 80% of the step"
    assert matmul.largest_share == "matmul 100% of the operator time"
    conv = playbook.diagnose(gpu_profile(1000, [("aten::convolution", 2, 450.0)], on_gpu=False))
    assert [t.key for t in conv.tips] == ["channels_last"]


def test_diagnose_rejects_what_is_not_a_profile():
    with pytest.raises(TypeError, match="StepProfile"):
        playbook.diagnose({"idle": 0.5})


def test_holds_reads_the_promise_with_three_outcomes():
    tip = playbook.TIPS
    assert playbook.holds(comparison(3.0).verdict(), tip["tf32"]) == "yes"
    some = comparison(2.0).verdict()
    assert playbook.holds(some, tip["tf32"]) == "partly: faster, but under the promised 3×"
    assert playbook.holds(some, tip["pinned_memory"]) == "yes"  # no number promised
    # 1.085× against a promised 1.1×, with a band that reaches past it: not shown to fall short
    near = comparison([1.05, 1.06, 1.07, 1.08, 1.08, 1.08, 1.09, 1.10, 1.11, 1.12, 1.13, 1.14]).verdict()
    assert near.outcome == "faster" and near.band[1] > 1.1 > near.speedup
    assert playbook.holds(near, tip["channels_last"]) == "yes: within the band of the promised 1.1×"
    assert playbook.holds(comparison(0.99).verdict(), tip["compile"]) == "no: no difference > 3%"
    slow = comparison(0.5).verdict()
    assert playbook.holds(slow, tip["compile"]) == "no: 2.00× slower"
    assert playbook.holds(slow, tip["determinism"], expected="slower") == "yes"
    assert playbook.holds(comparison(0.99).verdict(), tip["to_device"], expected="same") == "yes"
    # noise is never a "no", whatever was expected
    noise = comparison(NOISE).verdict()
    assert noise.outcome == "inconclusive"
    for expected in ("faster", "slower", "same"):
        assert playbook.holds(noise, tip["cudnn_benchmark"], expected) == "inconclusive: could not resolve a 3% effect"


def test_measured_takes_a_verdict_between_two_variants_of_one_comparison(capsys):
    c = bench.Comparison.from_rounds({"for-loop": [4e-3] * 8, "for-each": [2e-3] * 8, "fused": [1e-3] * 8})
    findings = playbook.Findings()
    f = findings.measured("fused_optimizer", c, variant="fused", against="for-each", label="fused vs for-each")
    assert (f.verdict.variant, f.verdict.baseline, f.verdict.outcome) == ("fused", "for-each", "faster")
    assert f.verdict.speedup == pytest.approx(2.0) and f.comparison is c
    assert findings.measured("fused_optimizer", c.verdict("for-each")).comparison is None  # a Verdict alone
    assert capsys.readouterr().out.startswith("fused vs for-each: 2.00× faster")


def test_findings_rows_print_and_chart(capsys):
    findings = playbook.Findings()
    findings.measured("tf32", comparison(3.0, ("fp32", "tf32")), faster="matmuls dominate", same="not printed")
    assert capsys.readouterr().out.strip() == "tf32 vs fp32: 3.00× faster (band 3.00–3.00×) — matmuls dominate"
    findings.measured("compile", comparison(1.0, ("eager", "compiled")), label="compile · MLP",
                      same="the GPU was idle")
    assert "no difference larger than 3%" in (out := capsys.readouterr().out) and "the GPU was idle" in out
    findings.measured("cudnn_benchmark", comparison(NOISE, ("heuristics", "tuned")), same="not printed")
    assert "could not resolve a 3% effect" in (out := capsys.readouterr().out) and "not printed" not in out
    findings.skipped("cuda_graphs", "no GPU")
    assert "skipped — no GPU" in capsys.readouterr().out
    findings.observed("to_device", ".cuda() fails without a GPU", "yes (behaviour)")
    rows = findings.rows()
    assert [r["claim"] for r in rows] == ["TF32 matmuls", "compile · MLP", "cudnn.benchmark", "CUDA graphs",
                                          ".cuda() vs .to(device)"]
    assert list(rows[0]) == ["claim", "what the guide promises", "measured here", "outcome"]
    assert [r["measured here"] for r in rows[:3]] == ["3.00× faster", "no difference > 3%",
                                                      "inconclusive: 1.05×, band 0.70–1.50×"]
    # the protocol's outcomes: a resolved null is "no difference", noise "inconclusive", never "did not hold"
    assert [r["outcome"] for r in rows] == ["faster", "no difference", "inconclusive", "not measured here",
                                            "yes (behaviour)"]
    assert findings.counts() == ("5 claims: 1 faster, 0 slower, 1 no difference, 1 inconclusive, 1 seen without a "
                                 "timing (a behaviour or a cost), 1 not measured here")
    assert len(findings) == 5 and "compile · MLP" in findings and findings["TF32 matmuls"].holds == "yes"
    fig = findings.chart(title="t")
    assert isinstance(fig, matplotlib.figure.Figure)
    # a bar without a resolved difference still has a length: its label gives the ratio with the verdict
    assert [t.get_text() for t in fig.axes[0].texts] == ["3.00× faster", "1.00×, no difference > 3%",
                                                          "1.05×, inconclusive"]
    # a legend names the colours: one entry per outcome that occurs, none for one that does not
    legend = fig.axes[0].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["faster", "no difference", "inconclusive"]


def test_explain_gives_the_reason_for_the_outcome_that_happened(capsys):
    findings = playbook.Findings()
    findings.measured("channels_last", comparison(1.0, ("NCHW", "channels_last")), label="layout")
    findings.measured("determinism", comparison(1.0, ("off", "on")), label="det", expected="slower")
    findings.measured("sdpa", comparison(NOISE, ("math", "flash")), label="noisy")
    findings.measured("tf32", comparison(2.5, ("fp32", "tf32")), label="fast")
    capsys.readouterr()
    # "unexpected" explains a resolved outcome other than the one the tip promises
    assert findings.explain("layout", unexpected="the GPU waits for the host").endswith(
        "— the GPU waits for the host")
    assert findings.explain("det", unexpected="no kernel was swapped").endswith("— no kernel was swapped")
    assert "never for noise" not in findings.explain("noisy", unexpected="never for noise")
    assert findings.explain("fast", unexpected="not printed", faster="matmuls are 90%").endswith("— matmuls are 90%")
    assert "the GPU waits" in capsys.readouterr().out
    findings.observed("to_device", "ran", "yes (behaviour)")
    with pytest.raises(ValueError, match="no timed verdict"):
        findings.explain(".cuda() vs .to(device)", unexpected="?")
    with pytest.raises(ValueError, match="outcome"):
        findings.measured("tf32", comparison(2.0), why="the old keyword")


def test_measured_prints_the_unexpected_reason_only_for_an_unexpected_outcome(capsys):
    findings = playbook.Findings()
    findings.measured("pinned_memory", comparison(0.99, ("pageable", "pinned")), unexpected="the copy is 1% of it",
                      faster="not printed")
    assert capsys.readouterr().out.strip().endswith("— the copy is 1% of it")
    findings.measured("pinned_memory", comparison(1.5, ("pageable", "pinned")), label="fast", unexpected="hidden")
    assert "hidden" not in capsys.readouterr().out
    findings.measured("pinned_memory", comparison(NOISE, ("pageable", "pinned")), label="noise", unexpected="hidden")
    assert "hidden" not in capsys.readouterr().out


def test_chart_ticks_under_one_do_not_crowd_a_wide_axis(capsys):
    """A slower claim beside a 26× one (CUDA graphs): the axis spans two decades, where 0.6× 0.8× 1× ran together."""
    findings = playbook.Findings()
    findings.measured("compile", comparison(1 / 1.1, ("eager", "compiled")))
    findings.measured("cuda_graphs", comparison(26.0, ("eager", "graphed")))
    labels = [t.get_text() for t in findings.chart(title="t").axes[0].get_xticklabels()]
    assert "0.7×" in labels and "0.6×" not in labels and "0.8×" not in labels and "20×" in labels


def test_a_partial_gain_prints_its_measured_reason_and_the_promise(capsys):
    findings = playbook.Findings()
    findings.measured("tf32", comparison(2.0, ("fp32", "tf32")), faster="matmuls are 40%")
    assert capsys.readouterr().out.strip() == ("tf32 vs fp32: 2.00× faster (band 2.00–2.00×) — matmuls are 40% "
                                               "(under the promised 3×)")
    assert findings["TF32 matmuls"].holds == "partly: faster, but under the promised 3×"


def test_profile_change_names_a_host_bound_result():
    nchw = gpu_profile(33_300, [("sm90_xmma_fprop_implicit_gemm", 10, 318.0), ("bn_fw", 100, 243.2)])
    nhwc = gpu_profile(31_500, [("sm90_xmma_fprop_implicit_gemm", 10, 254.0), ("bn_fw", 100, 125.6)])
    text = playbook.profile_change(nchw, nhwc, kind="conv")
    assert text.startswith("conv kernels 3.18 ms → 2.54 ms per step (1.25× faster); GPU busy 27.5 ms → 15.1 ms, "
                           "110 → 110 kernels; GPU idle 17% → 52% of the step: the GPU work shrank 1.82×, but the "
                           "GPU waits for the host 52% of the step (host-bound in these rounds"), text
    same = playbook.profile_change(nhwc, nhwc, kind="conv")
    assert same.endswith(": the GPU work did not change; the GPU's wait for the host went 16.4 ms → 16.4 ms per "
                         "step: host-bound, the host sets the pace"), same
    assert "(unchanged)" in same and "kernels per step" not in same
    # under the 5% that counts as a real change: by how much, and which way
    slightly = gpu_profile(31_500, [("sm90_xmma_fprop_implicit_gemm", 10, 254.0), ("bn_fw", 100, 123.0)])
    assert ": the GPU work shrank by only 2%; " in playbook.profile_change(nhwc, slightly)
    assert ": the GPU work did not shrink (it grew 2%); " in playbook.profile_change(slightly, nhwc)
    busy = gpu_profile(1000, [("k", 10, 95.0)])  # a GPU that never waits: no word on the host
    assert playbook.profile_change(busy, busy).endswith(": the GPU work did not change")
    # 5–20%: a shift a short profile cannot resolve, never explained by a cause
    noisy = gpu_profile(1000, [("aten::addmm", 2, 400.0)], on_gpu=False)
    less = gpu_profile(1000, [("aten::addmm", 2, 348.0)], on_gpu=False)
    text = playbook.profile_change(noisy, less)
    assert text.endswith(": the operator work shrank 13%, unresolved by a 1-step profile (a shift under 20% can be "
                         "the profile's own noise)"), text
    assert "but" not in text.split(":")[-1]
    near = gpu_profile(31_500, [("sm90_xmma_fprop_implicit_gemm", 10, 255.0), ("bn_fw", 100, 125.6)])
    assert "conv kernels 2.54 ms → 2.55 ms per step (unchanged)" in playbook.profile_change(nhwc, near, kind="conv")
    cpu = playbook.profile_change(gpu_profile(1000, [("aten::addmm", 2, 400.0)], on_gpu=False),
                                  gpu_profile(600, [("aten::addmm", 2, 100.0)], on_gpu=False))
    assert "operator busy 800 µs → 200 µs" in cpu and "Python and dispatch between operators take 67%" in cpu
    assert "CUDA graphs" not in cpu
    with pytest.raises(TypeError, match="StepProfile"):
        playbook.profile_change(nchw, 1.0)
    with pytest.raises(ValueError, match="kind"):
        playbook.profile_change(nchw, nhwc, kind="gemm")


def test_measured_for_names_where_a_tip_was_timed(capsys):
    findings = playbook.Findings()
    slow = comparison(0.5, ("eager", "compiled"))
    findings.measured("compile", slow, label="torch.compile · MLP", workload="MLP")
    findings.skipped("compile", "too slow on a CPU", label="torch.compile · Transformer", workload="Transformer")
    findings.measured("tf32", comparison(3.0), label="TF32 · matmul")
    findings.measured("cuda_graphs", slow, label="CUDA graphs · partial", workload="MLP")
    findings.measured("cuda_graphs", comparison(3.0), label="CUDA graphs · whole step", workload="MLP")
    capsys.readouterr()
    assert findings.measured_for("compile", "MLP") == "torch.compile · MLP: 2.00× slower"  # its own, nothing else
    # elsewhere: under the workload it was timed on, which its label need not name
    assert findings.measured_for("compile", "Transformer") == (
        "not timed on Transformer; on MLP: torch.compile · MLP: 2.00× slower")
    assert findings.measured_for("tf32", "Transformer") == (
        "not timed on Transformer; in a benchmark of its own: TF32 · matmul: 3.00× faster")
    assert findings.measured_for("cuda_graphs", "MLP") == (
        "CUDA graphs · partial: 2.00× slower; CUDA graphs · whole step: 3.00× faster")
    assert findings.measured_for("cuda_graphs", "Transformer") == (
        "not timed on Transformer; on MLP: CUDA graphs · partial: 2.00× slower; CUDA graphs · whole step: 3.00× "
        "faster")
    assert [f.label for f in findings.timed_on("cuda_graphs", "MLP")] == ["CUDA graphs · partial",
                                                                         "CUDA graphs · whole step"]
    assert findings.timed_on("compile", "Transformer") == []  # skipped there: nothing timed
    assert findings.measured_for("sdpa", "MLP") == "not timed in this run"
    # timed, but recorded without a verdict (observed): named as what was seen there, not as "not timed"
    findings.observed("compile", "1.50× faster (host disturbed)", "unclear: the host was disturbed",
                      label="torch.compile · ResNet-50", workload="ResNet-50")
    assert findings.measured_for("compile", "ResNet-50") == "torch.compile · ResNet-50: 1.50× faster (host disturbed)"
    assert findings.timed_on("compile", "ResNet-50") == []  # no comparison: never read as "did not shorten it"
    assert findings["torch.compile · MLP"].workload == "MLP" and findings["TF32 · matmul"].workload is None
    with pytest.raises(KeyError, match="no tip"):
        findings.measured_for("turbo", "MLP")


def test_step_row_splits_convolutions_from_matmuls():
    p = gpu_profile(1000, [("sm90_xmma_fprop_implicit_gemm_bf16", 2, 200.0), ("nvjet_hsh_128x256", 1, 100.0),
                           ("vectorized_elementwise_kernel", 10, 10.0)])
    row = playbook.step_row(p, "NCHW")
    assert row["step"] == "NCHW" and p.summary_row("x")["matmul"] == "500 µs"  # summary_row counts convs as matmuls
    assert (row["conv"], row["matmul"], row["attention"], row["other"]) == ("400 µs", "100 µs", "0 ns", "100 µs")


def test_findings_bad_input_is_a_clear_error():
    findings = playbook.Findings()
    with pytest.raises(ValueError, match="no findings"):
        findings.rows()
    assert findings.chart(title="nothing") is None
    with pytest.raises(KeyError, match="no tip 'turbo'"):
        findings.skipped("turbo", "?")
    with pytest.raises(TypeError, match="Comparison or Verdict"):
        findings.measured("tf32", 1.5)
    with pytest.raises(KeyError, match="turbo"):
        findings.measured("tf32", comparison(2.0), variant="turbo")


def test_idle_gaps_between_kernels_with_their_ranges():
    kernels = [profile.Kernel("a", 0.0, 10.0), profile.Kernel("b", 5.0, 10.0),  # overlap: no gap
               profile.Kernel("c", 40.0, 10.0), profile.Kernel("d", 100.0, 5.0)]
    gaps = playbook.idle_gaps(kernels, ranges=[("forward", 0.0, 45.0), ("optimizer", 45.0, 200.0)])
    assert [(g.start_us, g.duration_us, g.next_kernel, g.inside) for g in gaps] == [
        (50.0, 50.0, "d", "optimizer"), (15.0, 25.0, "c", "forward")]
    assert playbook.idle_gaps([], top=3) == [] and len(playbook.idle_gaps(kernels, top=1)) == 1
    with pytest.raises(ValueError, match="top"):
        playbook.idle_gaps(kernels, top=-1)


def test_kernels_belong_to_the_range_they_were_launched_in():
    # "backward" launches from another thread: its kernels run on the GPU after the range's host time has ended
    ranges = [("forward", 0.0, 100.0), ("backward", 100.0, 110.0), ("forward", 200.0, 300.0)]
    kernels = [profile.Kernel("fwd", 50.0, 30.0, "aten::mm", 10.0), profile.Kernel("bwd1", 120.0, 40.0, "aten::mm",
                                                                                  101.0),
               profile.Kernel("bwd2", 160.0, 20.0, "aten::mm", 109.0), profile.Kernel("step", 190.0, 5.0, "", 150.0),
               profile.Kernel("aten::relu", 250.0, 8.0)]  # a CPU operator: launched when it started
    totals = playbook.range_totals(kernels, ranges)
    assert totals["forward"] == playbook.RangeTotal("forward", 2, 200.0, 2, 38.0)
    assert totals["backward"] == playbook.RangeTotal("backward", 1, 10.0, 2, 60.0)
    assert playbook.range_totals([], ranges)["backward"].kernels == 0


def test_kernels_outside_every_range_are_counted_from_the_kernels_not_by_subtraction():
    ranges = [("forward", 0.0, 100.0), ("backward", 100.0, 200.0), ("backward.inner", 120.0, 150.0)]
    inside = [profile.Kernel("fwd", 10.0, 0.1 + 0.2, "aten::mm", 10.0),  # durations whose sums leave a float residue
              profile.Kernel("bwd", 130.0, 0.3, "aten::mm", 130.0)]
    # every kernel inside a range: no row, where all-minus-the-ranges'-totals leaves a residue and, with the nested
    # range, counts the inner kernel twice
    assert playbook.outside_ranges(inside, ranges) is None
    totals = playbook.range_totals(inside, ranges)
    assert sum(k.duration_us for k in inside) - sum(t.device_us for t in totals.values()) != 0
    late = profile.Kernel("sync", 260.0, 2.0, "aten::copy_", 250.0)  # launched after the last range ended
    assert playbook.outside_ranges([*inside, late], ranges) == playbook.RangeTotal("(outside these ranges)", 0, 0.0,
                                                                                     1, 2.0)
    tiny = profile.Kernel("blip", 300.0, 1e-9, "", 300.0)  # outside, but a negligible share of the kernels' time
    assert playbook.outside_ranges([*inside, tiny], ranges) is None
    assert playbook.outside_ranges([], ranges) is None
    assert playbook.outside_ranges([late], []).kernels == 1  # no ranges at all: everything is outside


MISMATCH = "The AccumulateGrad node's stream does not match the stream of the node that produced the incoming gradient"


def test_accumulate_grad_stream_warning_is_switched_off_for_the_block_only(monkeypatch):
    settings = []
    monkeypatch.setattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch", settings.append,
                        raising=False)
    with playbook.no_accumulate_grad_stream_warning():
        assert settings == [False]
    assert settings == [False, True]
    with pytest.raises(RuntimeError), playbook.no_accumulate_grad_stream_warning():
        raise RuntimeError("a failing step")
    assert settings[-1] is True, "switched back on after an error too"


def test_accumulate_grad_stream_warning_filtered_where_torch_has_no_switch(monkeypatch):
    monkeypatch.delattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with playbook.no_accumulate_grad_stream_warning():
            warnings.warn(MISMATCH, UserWarning, stacklevel=1)
            warnings.warn("another warning", UserWarning, stacklevel=1)
        warnings.warn(MISMATCH, UserWarning, stacklevel=1)
    assert [str(w.message)[:20] for w in caught] == ["another warning", MISMATCH[:20]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_no_stream_mismatch_warning_from_repeated_backwards_through_graphed_callables():
    """The notebook's case: make_graphed_callables keeps AccumulateGrad nodes on its capture stream; eager backwards
    through the graphed module, inside the block, must not warn (outside it PyTorch >= 2.10 does)."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).cuda()
    x = torch.randn(16, 32, device="cuda")
    graphed = torch.cuda.make_graphed_callables(model, (x,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with playbook.no_accumulate_grad_stream_warning():
            for _ in range(4):
                graphed(x).sum().backward()
        torch.cuda.synchronize()
    assert not [w for w in caught if "AccumulateGrad" in str(w.message)], [str(w.message)[:80] for w in caught]


def test_a_gap_belongs_to_the_range_that_launched_the_kernel_it_waited_for():
    ranges = [("forward", 0.0, 100.0), ("optimizer", 100.0, 200.0), ("optimizer.inner", 150.0, 180.0)]
    kernels = [profile.Kernel("a", 0.0, 10.0, "aten::mm", 0.0), profile.Kernel("b", 60.0, 5.0, "aten::add", 55.0),
               profile.Kernel("c", 170.0, 5.0, "aten::add_", 160.0)]
    gaps = playbook.idle_gaps(kernels, ranges=ranges)
    assert [(g.duration_us, g.next_kernel, g.inside) for g in gaps] == [(105.0, "c", "optimizer.inner"),
                                                                       (50.0, "b", "forward")]


def test_annotation_ranges_of_a_cpu_profile():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, \
            torch.profiler.record_function("my_range"):
        torch.randn(64, 64) @ torch.randn(64, 64)
    ranges = playbook.annotation_ranges(prof, on_gpu=False)
    assert [name for name, _, _ in ranges] == ["my_range"] and ranges[0][1] < ranges[0][2]


def test_relative_error():
    ref = torch.tensor([3.0, 4.0], dtype=torch.float64)
    assert playbook.relative_error(torch.tensor([3.0, 4.5]), ref) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="shapes differ"):
        playbook.relative_error(torch.zeros(3), ref)


def test_quiet_stderr_keeps_c_level_writes_out(capfd):
    import os

    with playbook.quiet_stderr():
        os.write(2, b"profiler_start\n")
    os.write(2, b"visible\n")
    assert capfd.readouterr().err == "visible\n"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with playbook.quiet_stderr():
            warnings.warn("Warning: Profiler clears events at the end of each cycle.", UserWarning, stacklevel=1)
            warnings.warn("another warning", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["another warning"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_diagnose_a_real_launch_bound_gpu_step_and_its_gaps():
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(8)]).cuda()
    x = torch.randn(8, 32, device="cuda")

    def step():
        with torch.profiler.record_function("forward"):
            model(x).sum().backward()

    prof = profile.profile_steps(step, steps=3, device="cuda")
    d = playbook.diagnose(prof)
    assert d.bound in ("launch-bound", "partly launch-bound") and "cuda_graphs" in [t.key for t in d.tips]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as raw:
        step()
        torch.cuda.synchronize()
    ranges = playbook.annotation_ranges(raw, on_gpu=True)
    assert any(name == "forward" for name, _, _ in ranges)
    gaps = playbook.idle_gaps(profile.gpu_kernels(raw), ranges=ranges)
    assert gaps and all(g.duration_us > 0 for g in gaps)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
                    reason="needs a CUDA GPU with TF32 (Ampere or newer)")
def test_tf32_matmul_error_is_of_the_class_of_rounding_to_10_bits():
    gen = torch.Generator(device="cuda").manual_seed(0)
    a, b = (torch.randn(1024, 1024, device="cuda", generator=gen) for _ in range(2))
    exact = a.double() @ b.double()
    a10, b10 = (nf.round_mantissa(t, 10).double() for t in (a, b))
    emulated = playbook.relative_error(a10 @ b10, exact)
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        tf32 = playbook.relative_error(a @ b, exact)
    finally:
        torch.set_float32_matmul_precision(previous)
    fp32 = playbook.relative_error(a @ b, exact)  # "highest" again
    assert 10 * fp32 < tf32 < 10 * emulated  # reduced precision, of TF32's class (the notebook asserts the upper bound)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_real_cudnn_convolution_kernels_are_classed_as_conv():
    """The kernels cuDNN really runs for a convolution's forward and its two gradients (NCHW and channels_last, fp32
    and 16-bit) land in the conv class: by name (cuDNN's fprop/dgrad/wgrad/implicit-GEMM kernels) or by the operator
    that launched them. Not by their share of the time: on a small input layout conversions and elementwise kernels
    can take longer than the convolutions themselves."""
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    for memory_format in (torch.contiguous_format, torch.channels_last):
        for amp in (None, dtype):
            conv = torch.nn.Conv2d(512, 512, 3, padding=1).cuda().to(memory_format=memory_format)
            x = torch.randn(64, 512, 14, 14, device="cuda").contiguous(memory_format=memory_format)
            x.requires_grad_(True)  # the input's gradient too (dgrad kernels), not only the weight's (wgrad)

            def step(conv=conv, x=x, amp=amp):
                with torch.autocast("cuda", dtype=amp or torch.float32, enabled=amp is not None):
                    conv(x).float().square().mean().backward()

            prof = profile.profile_steps(step, steps=3, device="cuda")
            where = f"{memory_format}, {amp}: {sorted({(k.name[:60], k.op) for k in prof.kernels})}"
            by_name = [k for k in prof.kernels if re.search(r"fprop|dgrad|wgrad|implicit_(gemm|convolve)", k.name)]
            assert all(playbook.kind_of_kernel(k.name, k.op) == "conv" for k in by_name), where
            for op in ("aten::cudnn_convolution", "aten::convolution_backward"):  # forward; both gradients
                launched = [k for k in prof.kernels if k.op == op and not playbook.LAYOUT_CONVERSION.search(k.name)]
                assert launched, f"no kernel launched by {op} — {where}"
                assert all(playbook.kind_of_kernel(k.name, k.op) == "conv" for k in launched), where
            row = playbook.step_row(prof, "conv")
            assert row["conv"] != "0 ns" and set(row) >= {"conv", "matmul", "attention", "other", "idle"}
            assert playbook.time_by_class(prof)["matmul"] == 0.0, where  # a convolution step runs no matmul


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_range_totals_give_backward_its_kernels_on_a_real_step():
    """backward's kernels are launched from autograd's thread; by launch time they still land in its range, and
    the disjoint phases' GPU time adds up to at most all of it."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(64, 256, device="cuda")

    def step():
        with torch.profiler.record_function("forward"):
            loss = model(x).square().mean()
        with torch.profiler.record_function("backward"):
            loss.backward()
        with torch.profiler.record_function("optimizer"):
            optimizer.step()
            optimizer.zero_grad()

    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as raw:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    kernels = profile.gpu_kernels(raw)
    totals = playbook.range_totals(kernels, playbook.annotation_ranges(raw))
    phases = {name: totals[name] for name in ("forward", "backward", "optimizer")}
    assert all(t.calls == 3 for t in phases.values())
    assert phases["backward"].kernels >= phases["forward"].kernels >= 3 * 3  # two matmuls per forward, ≥ 4 backward
    assert sum(t.device_us for t in phases.values()) <= 1.001 * sum(k.duration_us for k in kernels)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_round_mantissa_and_relative_error_on_the_gpu():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(1)) * 100
    on_gpu = nf.round_mantissa(x.cuda(), 7)
    assert on_gpu.is_cuda and torch.equal(on_gpu.cpu(), nf.round_mantissa(x, 7))
    assert torch.equal(nf.round_mantissa(x.cuda(), 10).cpu(), nf.round_mantissa(x, 10))
    ref = x.double()
    err = playbook.relative_error(x.cuda().to(torch.bfloat16), ref)  # result on the GPU, reference on the CPU
    assert 0 < err < nf.unit_roundoff(7) and err == pytest.approx(playbook.relative_error(
        x.to(torch.bfloat16), ref))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_idle_gaps_and_ranges_of_a_step_with_a_forced_host_stall():
    """A step that sleeps on the host between two annotated ranges leaves an idle gap on the GPU at least that
    long, found by idle_gaps and put down to the range that launched the kernel it waited for."""
    import time

    a = torch.randn(256, 256, device="cuda")

    def step():
        with torch.profiler.record_function("before"):
            a @ a
        torch.cuda.synchronize()
        time.sleep(0.005)
        with torch.profiler.record_function("after"):
            a @ a

    step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as raw:
        step()
        torch.cuda.synchronize()
    ranges = playbook.annotation_ranges(raw)
    assert {name for name, _, _ in ranges} >= {"before", "after"}
    longest = playbook.idle_gaps(profile.gpu_kernels(raw), ranges=ranges, top=1)[0]
    # the GPU waited for the matmul that the host launched in "after", once it had slept
    assert longest.duration_us >= 4_000 and longest.inside == "after"


def test_a_partial_gain_reads_faster_under_the_promise(capsys):
    findings = playbook.Findings()
    findings.measured("tf32", comparison(1.5, ("fp32", "tf32")))
    assert findings["TF32 matmuls"].outcome == "faster, under the promised 3×"
    # a whole step is not what "3× faster matmuls" promises: no promise to fall short of
    findings.measured("tf32", comparison(1.5, ("fp32", "tf32")), label="step", promised=False)
    assert findings["step"].outcome == "faster" and findings["step"].tip.promised_speedup == 3.0
    assert "promised" not in capsys.readouterr().out.splitlines()[-1]


def test_launch_bound_readings_carry_the_hosts_cost_per_launch():
    # 20 kernels in a 1 ms step: 50 µs of host time per kernel, beside the costs measured apart
    d = playbook.diagnose(gpu_profile(1000, [("vectorized_elementwise_kernel", 20, 5.0)]),
                          launch_us={"ATen op": 4.2, "compiled call": 11.8})
    assert d.per_kernel_us == pytest.approx(50.0)
    # the step's time per kernel against the bare ATen op: the factor a reader scales by is not 1
    assert "(50.0 µs of step time per kernel, 11.9× an ATen op; host per call: ATen op 4.20 µs, compiled call " \
           "11.8 µs on this CPU)" in str(d)
    busy = playbook.diagnose(gpu_profile(1000, [("ampere_sgemm_128x64_nn", 3, 300.0)]), launch_us={"ATen op": 4.2})
    assert busy.bound == "GPU-bound" and "host:" not in str(busy)  # only where the step waits for the host
    cpu = playbook.diagnose(gpu_profile(1000, [("aten::addmm", 2, 100.0)], on_gpu=False))
    assert cpu.bound == "overhead-bound" and "500 µs of step time per operator" in str(cpu)


def tiny_workloads():
    return playbook.workloads("cpu", amp=None)


def test_workloads_and_their_step_train_a_fresh_copy():
    work = tiny_workloads()
    assert list(work) == ["MLP", "Transformer", "ResNet-50"]
    mlp = work["MLP"]
    before = [p.detach().clone() for p in mlp.model.parameters()]
    step = mlp.step()
    loss = step()
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert all(torch.equal(a, b) for a, b in zip(before, mlp.model.parameters(), strict=True))  # initial weights kept
    assert not all(torch.equal(a, b) for a, b in zip(before, step.model.parameters(), strict=True))
    assert mlp.row()["parameter tensors"] == "4" and mlp.row()["optimizer"] == "Adam"
    resnet = work["ResNet-50"]
    resnet.layout = torch.channels_last
    assert resnet.fresh().conv1.weight.is_contiguous(memory_format=torch.channels_last)
    assert resnet.inputs().is_contiguous(memory_format=torch.channels_last)


def test_same_first_step_accepts_an_equal_variant_and_rejects_another_batch():
    mlp = tiny_workloads()["MLP"]
    assert "computes the same first step" in playbook.same_first_step(mlp.step(), mlp.step(), mlp, what="v")
    other = mlp.step()
    shifted = playbook.within(contextlib.nullcontext, lambda: other(mlp.x + 1, mlp.y))
    shifted.model = other.model
    with pytest.raises(AssertionError, match="v: loss differs"):
        playbook.same_first_step(shifted, mlp.step(), mlp, what="v")


def test_same_gradients_checks_a_first_step_taken_elsewhere():
    mlp = tiny_workloads()["MLP"]
    taken = mlp.step()
    with pytest.raises(AssertionError, match="holds no gradients"):
        playbook.same_gradients(taken.model, mlp.step(), mlp, what="c")
    taken()
    assert "computes eager's first-step gradients" in playbook.same_gradients(taken.model, mlp.step(), mlp, what="c")
    taken()  # a second step: other gradients
    with pytest.raises(AssertionError, match="gradients differ"):
        playbook.same_gradients(taken.model, mlp.step(), mlp, what="c")


def test_within_runs_every_call_inside_the_context_and_keeps_attributes():
    entered = []

    @contextlib.contextmanager
    def switch():
        entered.append(True)
        yield

    def step():
        return len(entered)

    step.model = "m"
    wrapped = playbook.within(switch, step)
    assert wrapped() == 1 and wrapped() == 2 and wrapped.model == "m"


def test_explain_by_profiles_prints_every_outcome(capsys):
    mlp = tiny_workloads()["MLP"]
    steps = {"a": mlp.step(), "b": mlp.step()}
    c = bench.Comparison.from_rounds({"a": [1e-3] * 6, "b": [1e-3] * 6})  # a resolved null
    findings = playbook.Findings()
    findings.measured("set_to_none", c, label="x")
    capsys.readouterr()
    profiles = playbook.explain_by_profiles(findings, {"k": playbook.ToProfile(steps, c)}, steps=1, progress=False)
    out = capsys.readouterr().out
    assert set(profiles["k"]) == {"a", "b"} and out.startswith("x: no difference > 3% — ") and "operator" in out


def test_a_host_paced_change_is_read_from_the_hosts_wait_with_its_cost_per_call():
    # the MLP under compile: the GPU's work about the same, the step slower; the wait for the host grew
    eager = gpu_profile(1990, [("vectorized_elementwise_kernel", 33, 3.6)])
    compiled = gpu_profile(2410, [("triton_poi_fused", 30, 3.5)])
    text = playbook.profile_change(eager, compiled, launch_us={"ATen op": 11.0, "compiled call": 50.2})
    assert text.endswith("the GPU's wait for the host went 1.87 ms → 2.30 ms per step: host-bound, the host sets "
                         "the pace (30 launches per step, 80.3 µs of the step each, 7.3× an ATen op; host per "
                         "call: ATen op 11.0 µs, compiled call 50.2 µs on this CPU)"), text
    # a resolved shrink that leaves the GPU waiting: the remedy, with the host's cost per call beside it
    nchw = gpu_profile(33_300, [("sm90_xmma_fprop_implicit_gemm", 10, 318.0), ("bn_fw", 100, 243.2)])
    nhwc = gpu_profile(31_500, [("sm90_xmma_fprop_implicit_gemm", 10, 254.0), ("bn_fw", 100, 125.6)])
    shrunk = playbook.profile_change(nchw, nhwc, launch_us={"ATen op": 11.0})
    assert shrunk.endswith("(host-bound in these rounds: the GPU waited for the host, whose pace can vary within a "
                           "run; 110 launches per step, 286 µs of the step each, 26.0× an ATen op; host per call: "
                           "ATen op 11.0 µs on this CPU)"), shrunk
    # no cure is asserted: the host's pace varies within a run, and a profile cannot say what would remove the wait
    assert "only fewer launches" not in shrunk and "CUDA graphs" not in shrunk and "reduce-overhead" not in shrunk
    # a loader-fed epoch waits for its batches too
    fed = playbook.profile_change(nchw, nhwc, waits_for="the loader's batches and the step's launches")
    assert fed.endswith("(host-bound in these rounds: the GPU waited for the loader's batches and the step's "
                        "launches)")
    assert "CUDA graphs" not in fed
    assert playbook.host_per_call(None) == "" and playbook.host_per_call({}) == ""
    # one copy per call (.to(device) against .cuda()): one launch, whose time per launch would repeat the call's
    to_device = gpu_profile(400, [("Memcpy HtoD (Pageable -> Device)", 1, 300.0)])
    cuda = gpu_profile(412, [("Memcpy HtoD (Pageable -> Device)", 1, 301.0)])
    to_device.unit = cuda.unit = "copy"
    one = playbook.profile_change(to_device, cuda, launch_us={"ATen op": 10.0})
    assert one.endswith("the GPU's wait for the host went 100 µs → 111 µs per copy (1 launch per copy; host per "
                        "call: ATen op 10.0 µs on this CPU)"), one


def test_a_shrink_that_is_all_copies_is_said_from_the_counts():
    # a DataLoader epoch, pageable → pinned: the same 8 copies and 100 kernels; only the copies got shorter
    pageable = gpu_profile(472_000, [("Memcpy HtoD (Pageable -> Device)", 8, 5_800.0), ("conv_fprop", 100, 1_200.0)])
    pinned = gpu_profile(437_000, [("Memcpy HtoD (Pinned -> Device)", 8, 700.0), ("conv_fprop", 100, 1_190.0)])
    text = playbook.profile_change(pageable, pinned, waits_for="the loader's batches")
    assert ": the copies shrank 8.29× (8 → 8 per step, 46.4 ms → 5.60 ms); the kernels unchanged (100 → 100 per " \
           "step, 120 ms → 119 ms), but the GPU waits for the host" in text, text
    assert "the GPU work shrank" not in text
    # a step that got faster with its wait shrinking too: the saving split into GPU work and waiting, no cause named
    followed = gpu_profile(354_000, [("Memcpy HtoD (Pinned -> Device)", 8, 700.0), ("conv_fprop", 100, 1_190.0)])
    text = playbook.profile_change(pageable, followed, waits_for="the loader's batches")
    assert text.endswith("120 ms → 119 ms); the step saved 118 ms: 41.8 ms less GPU work, 76.2 ms less waiting for "
                         "the host (108 → 108 kernels per step)"), text
    assert "host-bound" not in text
    # kernels that changed by more than 5%, the copies still carrying most of it: both said, with their counts
    both = gpu_profile(437_000, [("Memcpy HtoD (Pinned -> Device)", 8, 700.0), ("conv_fprop", 100, 1_100.0)])
    assert "the copies shrank 8.29× (8 → 8 per step, 46.4 ms → 5.60 ms); the kernels shrank 1.09× (100 → 100 per " \
           "step, 120 ms → 110 ms)" in playbook.profile_change(pageable, both)
    # kernels that carry most of the change: the work as a whole, as before
    fewer = gpu_profile(300_000, [("Memcpy HtoD (Pinned -> Device)", 8, 700.0), ("conv_fprop", 100, 600.0)])
    assert ": the GPU work shrank 2.54×; the step saved 172 ms: 101 ms less GPU work" in \
        playbook.profile_change(pageable, fewer)


def test_a_label_names_the_variant_first_as_the_verdict_does(capsys):
    """".to(device) vs .cuda()" over a comparison whose baseline is .to(device) put "slower" on the advised call."""
    timed = comparison(1 / 1.05, (".to(device)", ".cuda()"))  # .cuda() the variant, 1.05× slower
    findings = playbook.Findings()
    with pytest.raises(ValueError, match="names the baseline"):
        findings.measured("to_device", timed, label=".to(device) vs .cuda()", expected="same")
    assert ".to(device) vs .cuda()" not in findings
    # the tip's own name reads as the notebook times it: variant first, baseline second
    assert playbook.TIPS["to_device"].name == ".cuda() vs .to(device)"
    findings.measured("to_device", timed, expected="same")
    assert capsys.readouterr().out.startswith(".cuda() vs .to(device): 1.05× slower")
    assert findings.rows()[0]["claim"] == ".cuda() vs .to(device)" and findings.rows()[0]["measured here"] == \
        "1.05× slower"
    # a label after the tip's name, in the verdict's order, and labels without " vs ", pass
    findings.measured("sdpa", comparison(2.0, ("math", "flash")), label="SDPA · flash vs math")
    findings.measured("tf32", comparison(2.0, ("fp32", "tf32")), label="TF32 · fp32 Transformer step")
    with pytest.raises(ValueError, match="name the variant first"):
        findings.measured("sdpa", comparison(2.0, ("math", "flash")), label="SDPA · math vs flash")


def test_same_step_apart_reads_the_drift_against_the_resolution():
    s2 = gpu_profile(30_800, [("k", 100, 152.0)])
    s3 = gpu_profile(33_300, [("k", 100, 152.0)])
    s5 = gpu_profile(30_100, [("k", 100, 152.0)])
    text = playbook.same_step_apart({"section 2": s2, "section 3": s3, "section 5": s5}, resolution=0.03,
                                    what="The channels_last step")
    assert text.startswith("The channels_last step took 30.8 ms in section 2, 33.3 ms in section 3, 30.1 ms in "
                           "section 5, with GPU busy 15.2 ms, 15.2 ms, 15.2 ms. "), text
    # an 8% (here 11%) drift with the same GPU work is read as the host's, never hidden under a 10% threshold
    assert ("With the same GPU work (within ±3%) it took 11% longer in section 3 than in section 5, beyond the ±3% "
            "the protocol resolves: the host slowed there, its wait grew 21% (14.9 ms → 18.1 ms per step)") in text
    assert text.endswith("Each comparison's verdict uses its own number, timed in rounds that alternate with its "
                         "partner")
    steady = playbook.same_step_apart({"a": s2, "b": gpu_profile(31_200, [("k", 100, 152.0)])}, resolution=0.03)
    assert "agree within the ±3% the protocol resolves: the host kept its pace" in steady
    other = playbook.same_step_apart({"a": s2, "b": gpu_profile(33_300, [("k", 100, 170.0)])}, resolution=0.03)
    assert "The GPU work differs by 12%, more than the ±3% the protocol resolves" in other
    with pytest.raises(ValueError, match="two readings"):
        playbook.same_step_apart({"a": s2}, resolution=0.03)
    with pytest.raises(ValueError, match="resolution"):
        playbook.same_step_apart({"a": s2, "b": s3}, resolution=3)


def test_explain_by_profiles_passes_the_hosts_cost_and_what_the_gpu_waits_for(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(playbook, "profile_change", lambda a, b, **kw: seen.append(kw) or "read")
    monkeypatch.setattr("utils.profile.profile_steps", lambda step, **kw: gpu_profile(1000, [("k", 1, 1.0)]))
    c = bench.Comparison.from_rounds({"a": [1e-3] * 6, "b": [1e-3] * 6})
    findings = playbook.Findings()
    findings.measured("pinned_memory", c, label="x")
    pair = playbook.ToProfile({"a": lambda: None, "b": lambda: None}, c, unit="epoch", waits_for="its batches")
    playbook.explain_by_profiles(findings, {"k": pair}, steps=1, progress=False, launch_us={"ATen op": 9.0})
    assert seen == [{"kind": None, "launch_us": {"ATen op": 9.0}, "waits_for": "its batches"}]
    assert capsys.readouterr().out.endswith("x: no difference > 3% — read\n")


def test_layout_conversions_put_channels_last_first():
    # ResNet-50 in NCHW under autocast: 12% of the GPU time converts layouts around cuDNN's NHWC convolutions
    nchw = gpu_profile(29_000, [("sm90_xmma_fprop_implicit_gemm", 10, 560.0), ("nchwToNhwcKernel", 10, 333.0),
                                ("bn_fw_tr_1C11_kernel_NCHW", 100, 190.0)])
    d = playbook.diagnose(nchw, amp=torch.bfloat16)
    assert d.bound == "GPU-bound" and [t.key for t in d.tips] == ["channels_last", "compile"]
    assert d.conversions == pytest.approx(0.12, abs=0.01)
    assert "NCHW↔NHWC layout conversions take 12% of the GPU time → try channels_last" in str(d)
    nhwc = gpu_profile(29_000, [("sm90_xmma_fprop_implicit_gemm", 10, 560.0), ("bn_fw", 100, 220.0)])
    assert [t.key for t in playbook.diagnose(nhwc).tips] == ["compile"] and "layout" not in str(playbook.diagnose(nhwc))
    # a launch-bound step still names fewer launches first
    idle = gpu_profile(10_000, [("nchwToNhwcKernel", 10, 33.0), ("k", 10, 100.0)])
    assert playbook.diagnose(idle).tips[0].key == "cuda_graphs"


def test_a_tip_measured_slower_on_the_step_is_named_last_and_marked():
    # the launch-bound MLP: default-mode compile measured slower in this run, CUDA graphs faster
    launch_bound = gpu_profile(1000, [("vectorized_elementwise_kernel", 20, 5.0)])
    findings = playbook.Findings()
    findings.measured("compile", comparison(0.87, ("eager", "compiled")), label="torch.compile · MLP",
                      workload="MLP")
    findings.measured("cuda_graphs", comparison(13.9, ("eager", "graphed")), label="CUDA graphs · MLP",
                      workload="MLP")
    d = playbook.diagnose(launch_bound, findings=findings, workload="MLP")
    assert [t.key for t in d.tips] == ["cuda_graphs", "fused_optimizer", "compile"] and d.slower == ("compile",)
    assert str(d).endswith("; also fused optimizer, torch.compile (measured slower here)"), str(d)
    assert d.tip_name() == "CUDA graphs" and d.tip_name(playbook.TIPS["compile"]).endswith("(measured slower here)")
    # measured on another workload only, or faster somewhere on this one: named as before
    assert playbook.diagnose(launch_bound, findings=findings, workload="Transformer").slower == ()
    findings.measured("compile", comparison(1.3, ("eager", "max-autotune")), label="torch.compile · MLP, tuned",
                      workload="MLP")
    assert playbook.diagnose(launch_bound, findings=findings, workload="MLP").slower == ()
    # the only tip measured slower: still named first, marked in its line
    other = gpu_profile(1000, [("vectorized_elementwise_kernel", 10, 90.0)])
    only = playbook.Findings()
    only.measured("compile", comparison(0.8, ("eager", "compiled")), label="c", workload="X")
    d = playbook.diagnose(other, findings=only, workload="X")
    assert d.tip.key == "compile" and "(torch.compile(model); measured slower here)" in str(d)
    assert playbook.diagnose(other).tip_name() == "torch.compile"


def test_a_gpu_shrink_under_20_percent_is_read_not_called_noise():
    """07b's Transformer under compile: GPU work 15% less (a GPU's kernel times repeat within 1%), the step faster:
    the saving is split into its parts; on a CPU the same shrink stays unresolved."""
    def step(wall_ms, kernels, *, on_gpu=True):
        laid = gpu_profile(0, kernels).kernels
        return profile.StepProfile(device="cuda:0" if on_gpu else "cpu", steps=1, wall_s=wall_ms / 1e3, kernels=laid,
                                   on_gpu=on_gpu)

    eager = step(10.0, [("vectorized_elementwise_kernel", 500, 15.0)])  # 7.5 ms busy
    compiled = step(8.0, [("triton_poi_fused", 375, 17.0)])  # 6.375 ms busy: 15% less
    text = playbook.profile_change(eager, compiled)
    assert "unresolved" not in text and "noise" not in text, text
    assert text.endswith("the step saved 2.00 ms: 1.12 ms less GPU work, 875 µs less waiting for the host (500 → 375 "
                         "kernels per step)"), text
    on_cpu = [step(p.wall_s * 1e3, [(k.name, 1, k.duration_us) for k in p.kernels], on_gpu=False)
              for p in (eager, compiled)]
    assert "unresolved by a 1-step profile" in playbook.profile_change(*on_cpu)
    # slower, with less GPU work: the shrink as measured, and the host's longer wait beside it
    slower = step(11.0, [("triton_poi_fused", 375, 17.0)])
    text = playbook.profile_change(eager, slower)
    assert ": the GPU work shrank 15%; the GPU's wait for the host went 2.50 ms → 4.62 ms per step" in text, text


def test_a_copy_shrink_under_20_percent_stays_unresolved_on_a_gpu():
    """07's .cuda() vs .to(device): one pageable copy 253 → 228 µs; the host stages it, so its time is not a
    kernel's steady one."""
    before = gpu_profile(312, [("Memcpy HtoD (Pageable -> Device)", 1, 253.0)])
    after = gpu_profile(312, [("Memcpy HtoD (Pageable -> Device)", 1, 228.0)])
    assert "the same copies in both (1 per step)" in playbook.profile_change(before, after)
    # other copies (pageable, then another pageable one) under 20%: unresolved, never a cause
    other = gpu_profile(312, [("Memcpy HtoD (Pageable -> Device)", 1, 200.0), ("Memcpy DtoH (Device -> Pageable)", 1,
                                                                                28.0)])
    assert "the GPU work shrank 10%, unresolved by a 1-step profile" in playbook.profile_change(before, other)


def test_a_wait_under_half_the_step_is_partly_host_bound():
    """07's channels_last at 25–30% idle: 'partly host-bound', as diagnose() names a step idle under half of it."""
    before = gpu_profile(30_000, [("sm90_xmma_fprop_implicit_gemm", 100, 270.0)])  # 27 ms busy, 10% idle
    after = gpu_profile(22_000, [("sm90_xmma_fprop_implicit_gemm", 100, 150.0)])  # 15 ms busy, 32% idle
    text = playbook.profile_change(before, after)
    assert "(partly host-bound in these rounds: " in text and "(host-bound" not in text, text


def test_the_same_copies_in_both_are_not_read_as_a_cause():
    """07's .cuda() vs .to(device): one identical pageable copy, 253 → 203 µs (1.25×, past the 20% rule)."""
    before = gpu_profile(312, [("Memcpy HtoD (Pageable -> Device)", 1, 253.0)])
    after = gpu_profile(280, [("Memcpy HtoD (Pageable -> Device)", 1, 203.0)])
    text = playbook.profile_change(before, after)
    assert ": the same copies in both (1 per step); a copy's time follows how the host stages it, so its change is " \
           "not read as a cause" in text, text
    assert "shrank 1.25×" not in text
    pinned = gpu_profile(280, [("Memcpy HtoD (Pinned -> Device)", 1, 60.0)])  # another copy: read as before
    assert "the same copies" not in playbook.profile_change(before, pinned)


def test_a_slower_step_splits_its_loss_into_gpu_work_and_waiting():
    """07b's determinism: 1.10× slower, GPU work 6% more: 1.7 ms of the 2.9 ms lost; the rest is waiting."""
    before = gpu_profile(29_000, [("sm90_xmma_fprop_implicit_gemm", 100, 275.0)])  # 27.5 ms busy
    after = gpu_profile(31_900, [("sm90_xmma_fprop_implicit_gemm", 100, 292.0)])  # 29.2 ms busy: 6% more
    text = playbook.profile_change(before, after)
    assert ": the GPU work did not shrink (it grew 6%); the step lost 2.90 ms: 1.70 ms more GPU work, 1.20 ms more " \
           "waiting for the host" in text, text
