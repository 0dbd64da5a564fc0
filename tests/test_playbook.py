"""utils.playbook: the tips, the diagnosis of a profiled step, findings and their verdicts, idle gaps, rounding."""


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


def timing(label, median, spread=0.01, blocks=7):
    times = tuple(median * (1 + spread * (i - blocks // 2) / blocks) for i in range(blocks))
    return bench._timing_from(label, times, 10, torch.device("cpu"))


def test_every_bottleneck_names_known_tips():
    for keys in playbook.TIPS_FOR.values():
        assert keys and all(k in playbook.TIPS for k in keys)
    assert {t.key for t in playbook.TIPS.values()} == set(playbook.TIPS)


def test_conv_kernels_are_told_apart_from_matmuls():
    assert playbook.kind_of_kernel("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc") == "conv"
    assert playbook.kind_of_kernel("sm80_xmma_wgrad_implicit_gemm_indexed_tf32f32") == "conv"
    assert playbook.kind_of_kernel("aten::convolution_backward") == "conv"
    assert playbook.kind_of_kernel("sm90_xmma_gemm_bf16bf16_bf16f32") == "matmul"
    assert playbook.kind_of_kernel("void convert_fp32_to_bf16_kernel") == "other"
    assert playbook.kind_of_kernel("flash_fwd_kernel") == "attention"
    assert playbook.kind_of_kernel("void fft2d_r2c_32x32<float, false, 1u, false>") == "conv"  # cuDNN's FFT algorithm
    assert playbook.kind_of_kernel("void flip_filter<float, float>") == "conv"
    assert playbook.kind_of_kernel("void nchwToNhwcKernel<__nv_bfloat16>") == "other"  # a layout conversion


def test_diagnose_launch_bound_step_names_cuda_graphs():
    d = playbook.diagnose(gpu_profile(1000, [("vectorized_elementwise_kernel", 20, 5.0)]))
    assert d.bound == "launch-bound" and d.share == pytest.approx(0.9)
    assert d.tip.key == "cuda_graphs" and "waits for the host 90%" in str(d)


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
    assert d.bound == "partly launch-bound" and [t.key for t in d.tips] == ["tf32", "cuda_graphs"]


def test_diagnose_on_cpu_names_only_cpu_tips():
    overhead = playbook.diagnose(gpu_profile(1000, [("aten::addmm", 2, 100.0)], on_gpu=False))
    assert overhead.bound == "overhead-bound" and overhead.tip.key == "compile"
    matmul = playbook.diagnose(gpu_profile(1000, [("aten::addmm", 2, 450.0)], on_gpu=False))
    assert matmul.largest == "matmul" and matmul.tips == () and "no tip" in str(matmul)
    conv = playbook.diagnose(gpu_profile(1000, [("aten::convolution", 2, 450.0)], on_gpu=False))
    assert [t.key for t in conv.tips] == ["channels_last"]


def test_diagnose_rejects_what_is_not_a_profile():
    with pytest.raises(TypeError, match="StepProfile"):
        playbook.diagnose({"idle": 0.5})


def test_holds_reads_the_promise():
    fast = bench.compare(timing("base", 3e-3), timing("tip", 1e-3))
    assert playbook.holds(fast, playbook.TIPS["tf32"]) == "yes"
    some = bench.compare(timing("base", 2e-3), timing("tip", 1e-3))
    assert playbook.holds(some, playbook.TIPS["tf32"]).startswith("partly: faster, but under the promised 3×")
    assert playbook.holds(some, playbook.TIPS["pinned_memory"]) == "yes"  # no number promised
    same = bench.compare(timing("base", 1e-3), timing("tip", 1.01e-3))
    assert playbook.holds(same, playbook.TIPS["compile"]) == "no: no difference beyond the noise"
    slow = bench.compare(timing("base", 1e-3), timing("tip", 2e-3))
    assert playbook.holds(slow, playbook.TIPS["compile"]) == "no: 2.00× slower"
    assert playbook.holds(slow, playbook.TIPS["determinism"], expected="slower") == "yes"


def test_speedup_band_brackets_the_speedup():
    c = bench.compare(timing("base", 2e-3, spread=0.1), timing("tip", 1e-3, spread=0.1))
    low, high = playbook.speedup_band(c)
    (b1, b3), (c1, c3) = c.baseline.quartiles_s, c.candidate.quartiles_s
    assert low < c.speedup < high and (low, high) == pytest.approx((b1 / c3, b3 / c1))


def test_findings_rows_print_and_chart(capsys):
    findings = playbook.Findings()
    findings.measured("tf32", bench.compare(timing("fp32", 3e-3), timing("tf32", 1e-3)))
    assert "as expected" in capsys.readouterr().out
    findings.measured("compile", bench.compare(timing("eager", 1e-3), timing("compiled", 1e-3)), label="compile · MLP",
                      why="the GPU was idle")
    assert "the GPU was idle" in capsys.readouterr().out
    findings.skipped("cuda_graphs", "no GPU")
    assert "skipped — no GPU" in capsys.readouterr().out
    findings.observed("to_device", ".cuda() fails without a GPU", "yes (behaviour)")
    rows = findings.rows()
    assert [r["claim"] for r in rows] == ["TF32 matmuls", "compile · MLP", "CUDA graphs", ".to(device) vs .cuda()"]
    assert list(rows[0]) == ["claim", "what the guide promises", "measured here", "holds?"]
    assert rows[1]["holds?"].startswith("no") and rows[2]["holds?"] == "not measured here"
    assert len(findings) == 4 and "compile · MLP" in findings and findings["TF32 matmuls"].holds == "yes"
    assert isinstance(findings.chart(title="t"), matplotlib.figure.Figure)


def test_measured_for_names_where_a_tip_was_timed(capsys):
    findings = playbook.Findings()
    slow = bench.compare(timing("eager", 1e-3), timing("compiled", 2e-3))
    findings.measured("compile", slow, label="torch.compile · MLP", workload="MLP")
    findings.skipped("compile", "too slow on a CPU", label="torch.compile · Transformer", workload="Transformer")
    findings.measured("tf32", bench.compare(timing("fp32", 3e-3), timing("tf32", 1e-3)), label="TF32 · matmul")
    findings.measured("cuda_graphs", slow, label="CUDA graphs · partial", workload="MLP")
    findings.measured("cuda_graphs", bench.compare(timing("eager", 3e-3), timing("graph", 1e-3)),
                      label="CUDA graphs · whole step", workload="MLP")
    capsys.readouterr()
    assert findings.measured_for("compile", "MLP") == "torch.compile · MLP: 2.00× slower"  # its own, nothing else
    assert findings.measured_for("compile", "Transformer") == (
        "not timed on Transformer; torch.compile · MLP: 2.00× slower")
    assert findings.measured_for("tf32", "Transformer") == "not timed on Transformer; TF32 · matmul: 3.00× faster"
    assert findings.measured_for("cuda_graphs", "MLP") == (
        "CUDA graphs · partial: 2.00× slower; CUDA graphs · whole step: 3.00× faster")
    assert findings.measured_for("sdpa", "MLP") == "not timed in this run"
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
    with pytest.raises(TypeError, match="Comparison"):
        findings.measured("tf32", 1.5)


def test_idle_gaps_between_kernels_with_their_ranges():
    kernels = [profile.Kernel("a", 0.0, 10.0), profile.Kernel("b", 5.0, 10.0),  # overlap: no gap
               profile.Kernel("c", 40.0, 10.0), profile.Kernel("d", 100.0, 5.0)]
    gaps = playbook.idle_gaps(kernels, ranges=[("forward", 0.0, 45.0), ("optimizer", 45.0, 200.0)])
    assert [(g.start_us, g.duration_us, g.next_kernel, g.inside) for g in gaps] == [
        (50.0, 50.0, "d", "optimizer"), (15.0, 25.0, "c", "forward")]
    assert playbook.idle_gaps([], top=3) == [] and len(playbook.idle_gaps(kernels, top=1)) == 1
    with pytest.raises(ValueError, match="top"):
        playbook.idle_gaps(kernels, top=-1)


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
    """The kernels cuDNN really runs for a convolution's forward and backward (NCHW and channels_last, fp32 and
    16-bit) must land in the conv class, or diagnose() and the notebook's conv shares would call them matmuls."""
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    for memory_format in (torch.contiguous_format, torch.channels_last):
        for amp in (None, dtype):
            # convolution-heavy: 2·64·14²·512²·9 ≈ 59 GFLOP forward and as much for each gradient, against
            # elementwise work on 6.4 M outputs
            conv = torch.nn.Conv2d(512, 512, 3, padding=1).cuda().to(memory_format=memory_format)
            x = torch.randn(64, 512, 14, 14, device="cuda").contiguous(memory_format=memory_format)
            x.requires_grad_(True)  # the input's gradient too (dgrad kernels), not only the weight's (wgrad)

            def step(conv=conv, x=x, amp=amp):
                with torch.autocast("cuda", dtype=amp or torch.float32, enabled=amp is not None):
                    conv(x).float().square().mean().backward()

            prof = profile.profile_steps(step, steps=3, device="cuda")
            kinds = playbook.time_by_class(prof)
            names = sorted({k.name[:80] for k in prof.kernels})
            assert kinds["conv"] >= 0.5 * sum(kinds.values()), f"{memory_format}, {amp}: {kinds}; kernels: {names}"
            row = playbook.step_row(prof, "conv")
            assert row["conv"] != "0 ns" and set(row) >= {"conv", "matmul", "attention", "other", "idle"}


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
    long, found by idle_gaps and placed after the first range."""
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
    ranges = playbook.annotation_ranges(raw, on_gpu=True)
    assert {name for name, _, _ in ranges} >= {"before", "after"}
    longest = playbook.idle_gaps(profile.gpu_kernels(raw), ranges=ranges, top=1)[0]
    # it begins where "before" ends (at its boundary, or just inside by rounding), never inside "after"
    assert longest.duration_us >= 4_000 and longest.inside in (None, "before")
