"""utils.profile: a step's kernels, busy vs idle time, top kernels, the Perfetto trace (CPU here, GPU when present)."""

import json
import re
import types

import pytest
import torch
from torch.autograd import DeviceType

from utils import profile


def steps_profile(kernels, *, steps=1, wall_s=1e-3, on_gpu=True):
    return profile.StepProfile(device="cuda:0" if on_gpu else "cpu", steps=steps, wall_s=wall_s,
                               kernels=[profile.Kernel(*k) for k in kernels], on_gpu=on_gpu)


def test_busy_time_is_the_union_of_kernel_intervals():
    # two kernels overlap (two streams) for 50 µs, a third runs alone: busy 150 + 100 = 250 µs of a 1 ms step
    prof = steps_profile([("a", 0.0, 100.0), ("b", 50.0, 100.0), ("c", 500.0, 100.0)])
    assert prof.busy_s == pytest.approx(250e-6)
    assert prof.idle_s == pytest.approx(750e-6) and prof.idle_fraction == pytest.approx(0.75)
    assert prof.kernels_per_step == 3


def test_overlapping_kernels_are_said_to_overlap():
    # programmatic dependent launch: each kernel starts 6 µs before the previous ends and waits; busy is the union
    chain = steps_profile([("gemv_kernel", 10.0 * i, 16.0) for i in range(10)], wall_s=110e-6)
    assert chain.busy_s == pytest.approx(106e-6) and chain.overlap == pytest.approx(160 / 106)
    text = chain.bottleneck()
    assert "matmul kernels take 100%" in text and "the kernels overlap: their durations add up to 1.5× the busy" in text
    serial = steps_profile([("gemv_kernel", 10.0 * i, 10.0) for i in range(10)], wall_s=110e-6)
    assert serial.overlap == pytest.approx(1.0) and "overlap" not in serial.bottleneck()


def test_per_step_numbers_divide_by_steps():
    prof = steps_profile([("k", 0.0, 10.0), ("k", 100.0, 10.0)], steps=2, wall_s=100e-6)
    assert prof.kernels_per_step == 1 and prof.busy_s == pytest.approx(10e-6)
    assert prof.top_kernels()[0]["calls per step"] == "1"


def test_bottleneck_reads_the_idle_share():
    idle = steps_profile([("ampere_sgemm_64x64", 0.0, 100.0)], wall_s=1e-3)
    assert idle.bottleneck().startswith("launch-bound: the GPU is idle 90%")
    graphed = idle.bottleneck(in_cuda_graphs=True)  # launches are not what it waits for: no "CUDA graphs" advice
    assert graphed.startswith("host-bound: the GPU is idle 90%") and "CUDA graphs help" not in graphed
    assert "already run from CUDA graphs" in graphed
    busy = steps_profile([("sm90_xmma_gemm_bf16", 0.0, 900.0), ("elementwise", 900.0, 80.0)], wall_s=1e-3)
    text = busy.bottleneck()
    assert text.startswith("GPU-bound: busy 98%") and "matmul kernels take 92%" in text


def test_kinds_and_top_kernels():
    prof = steps_profile([("nvjet_hsh_256x128", 0.0, 300.0), ("flash_fwd_kernel", 300.0, 200.0),
                          ("vectorized_elementwise_kernel", 500.0, 100.0), ("nvjet_hsh_256x128", 600.0, 300.0)])
    kinds = prof.time_by_kind()
    assert kinds == pytest.approx({"matmul": 600e-6, "attention": 200e-6, "other": 100e-6})
    top = prof.top_kernels(2)
    assert top[0]["kernel"] == "nvjet_hsh_256x128" and top[0]["share of busy"] == "67%"
    assert len(top) == 2 and set(prof.summary_row("eager")) >= {"step", "busy", "idle", "kernels"}


def test_a_cpu_backward_counts_its_matmuls_as_matmul():
    """On a CPU the backward's top-level operators are autograd's nodes ('…: AddmmBackward0'): a Linear's backward
    is matmul work, not 'other' (04's Amdahl bound and 07's MLP advice read 'other' as what fusion can save)."""
    assert profile.kind_of("autograd::engine::evaluate_function: AddmmBackward0") == "matmul"
    assert profile.kind_of("autograd::engine::evaluate_function: MmBackward0") == "matmul"
    assert profile.kind_of("autograd::engine::evaluate_function: GeluBackward0") == "other"
    layer = torch.nn.Linear(256, 256)
    x = torch.randn(64, 256, requires_grad=True)
    prof = profile.profile_steps(lambda: layer(x).sum().backward(), steps=2, device="cpu")
    backward = [k.name for k in prof.kernels if k.name.startswith("autograd::engine::evaluate_function")]
    assert any("AddmmBackward" in name for name in backward), backward
    assert prof.time_by_kind()["matmul"] > 0


def test_compare_profiles_names_what_shrank_and_what_grew():
    # the H200's BERT-Large fp32 case, per batch: the same largest matmul kernel got 1.2 ms faster, while other
    # kernels and idle time grew, so the batch is about as long; matmul is 75% of eager's 12 ms
    eager = steps_profile([("sm90_xmma_gemm_tf32", 0.0, 9000.0), ("vectorized_layer_norm", 9000.0, 2000.0)],
                          wall_s=12e-3)
    compiled = steps_profile([("sm90_xmma_gemm_tf32", 0.0, 7800.0), ("triton_per_fused_add_layer_norm", 7800.0,
                                                                      2600.0)], wall_s=11.7e-3)
    text = profile.compare_profiles(eager, compiled)
    assert text.startswith("per step, eager → compiled: 2 → 2 kernels, 12 ms → 11.7 ms")
    assert "matmul kernels shrank most (9 ms → 7.8 ms; the largest in both: sm90_xmma_gemm_tf32)" in text
    assert ("other kernels grew most (2 ms → 2.6 ms; the largest eager: vectorized_layer_norm, compiled: "
            "triton_per_fused_add_layer_norm)") in text
    assert "matmul kernels take 75% of eager's step: that work stays after compiling" in text
    assert "fusion" not in profile.compare_profiles(eager, compiled, fusion=False)  # a change of type is no fusion


def test_compare_profiles_says_where_a_kind_that_vanished_went():
    """BERT-Large bf16 on the H200: compiled, no kernel was classed as attention; its work moved into matmuls."""
    eager = steps_profile([("sm90_xmma_gemm_bf16", 0.0, 2700.0), ("flash_fwd_kernel", 2700.0, 1690.0)], wall_s=5e-3)
    compiled = steps_profile([("sm90_xmma_gemm_bf16", 0.0, 3440.0)], wall_s=4e-3)
    text = profile.compare_profiles(eager, compiled)
    assert "attention kernels shrank most" in text
    assert "no compiled kernel is classed as attention: that work runs in kernels of another kind there" in text


def test_compare_profiles_counts_idle_time_and_says_when_nothing_changed():
    eager = steps_profile([("flash_fwd", 0.0, 100.0), ("elementwise", 100.0, 100.0)], wall_s=1e-3)  # 800 µs idle
    graphed = steps_profile([("flash_fwd", 0.0, 100.0), ("elementwise", 100.0, 100.0)], wall_s=0.3e-3)
    text = profile.compare_profiles(eager, graphed, names=("eager", "CUDA graph"))
    assert "GPU idle time shrank most (800 µs → 100 µs)" in text and "no kind of time grew" in text
    assert "matmul kernels take 0% of eager's step" in text  # no matmul kernel here
    same = profile.compare_profiles(eager, eager)
    assert "no kind of time shrank" in same and "no kind of time grew" in same
    on_cpu = steps_profile([("aten::addmm", 0.0, 100.0)], on_gpu=False)
    assert "time outside operators" in profile.compare_profiles(on_cpu, steps_profile([], on_gpu=False))
    with pytest.raises(ValueError, match="same kind of device"):
        profile.compare_profiles(eager, on_cpu)


def test_inductor_kernels_named_after_attention_are_not_attention():
    """09b's GPT-2 compiled: Inductor's pointwise kernels around SDPA carry its name; the fused kernel is attention."""
    assert profile.kind_of("triton_poi_fused__scaled_dot_product_flash_attention_view_3") == "other"
    assert profile.kind_of("triton_per_fused__scaled_dot_product_cudnn_attention_add_1") == "other"
    assert profile.kind_of("cudnn_generated_fort_native_sdpa_sm80_flash_fprop_wmma_f16") == "attention"
    assert profile.kind_of("triton_tem_fused_flex_attention_0") == "attention"  # a template that is the attention


def test_compare_profiles_does_not_read_idle_time_inside_the_timings_noise():
    """09's ResNet-50: idle = the timed step less the kernels, so it carries the timing's band; a 1.6 ms change in
    a step timed to ±2.5 ms is not 'grew most'."""
    eager = steps_profile([("sm90_xmma_fprop_implicit_gemm", 0.0, 15000.0), ("bn_fw", 15000.0, 38000.0)],
                          wall_s=55.68e-3)  # 2.68 ms idle
    compiled = steps_profile([("sm90_xmma_fprop_implicit_gemm", 0.0, 14540.0), ("triton_poi_fused_add", 14540.0,
                                                                               21500.0)], wall_s=40.3e-3)  # 4.26 ms
    read = profile.compare_profiles(eager, compiled)
    assert "GPU idle time grew most (2.68 ms → 4.26 ms" in read  # without the noise: read as growth
    text = profile.compare_profiles(eager, compiled, idle_noise_s=2.5e-3)
    assert "GPU idle time grew most" not in text
    assert "GPU idle time 2.68 ms → 4.26 ms: a change within the timings' bands (±2.5 ms), not read" in text
    assert "other kernels shrank most" in text and "no kind of time grew" in text
    assert "attention may be lowered" not in text  # a ResNet has no attention kernel to lower
    with pytest.raises(ValueError, match="idle_noise_s"):
        profile.compare_profiles(eager, compiled, idle_noise_s=-1.0)


def test_compare_profiles_says_when_the_compiled_step_saved_nothing():
    """09b's bf16 batch-256 pair: the compile lost, so 'fusion can save in the rest' alone would mislead."""
    eager = steps_profile([("nvjet_hsh_256x128", 0.0, 27600.0), ("flash_fwd_kernel", 27600.0, 2000.0)], wall_s=31e-3)
    lost = steps_profile([("nvjet_hsh_256x128", 0.0, 34500.0), ("triton_poi_fused_softmax", 34500.0, 3000.0)],
                         wall_s=38e-3)
    text = profile.compare_profiles(eager, lost)
    assert "(attention may be lowered to other kernels), so fusion can save mostly in the rest; here the compiled " \
           "step saved nothing overall" in text
    assert "saved nothing" not in profile.compare_profiles(lost, eager, names=("compiled", "eager"))


def test_profile_steps_on_cpu_lists_top_level_operators_and_saves_a_trace(tmp_path):
    layer = torch.nn.Linear(64, 64)
    x = torch.randn(32, 64)
    prof = profile.profile_steps(lambda: torch.relu(layer(x)), steps=4, device="cpu",
                                 trace_path=tmp_path / "trace.json")
    names = [k.name for k in prof.kernels]
    assert names.count("aten::linear") == 4 and names.count("aten::relu") == 4  # nested ops are not listed
    assert prof.kernels_per_step == 2 and 0 < prof.busy_s <= prof.wall_s * 1.05
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert any(e.get("name") == "aten::linear" for e in trace["traceEvents"])
    assert "on the CPU" in prof.bottleneck()


def test_operator_calls_count_nested_calls_per_step():
    """Casts inside another operator (autocast's, inside aten::linear) are counted, though not listed as kernels."""
    layer = torch.nn.Linear(64, 64)
    x = torch.randn(8, 64)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):  # no cache: casts on every call
            layer(x)

    prof = profile.profile_steps(step, steps=3, device="cpu")
    assert prof.calls_per_step("aten::_to_copy") == 3  # the input, the weight and the bias, to bfloat16
    assert "aten::_to_copy" not in [k.name for k in prof.kernels] and prof.calls_per_step("aten::nothing") == 0


def test_step_time_from_the_caller_is_the_wall_and_a_cpus_operators_are_scaled_to_it():
    """On a CPU the profiler slows the operators it records as well as the host (an operator's busy time once came
    out at 22.8 ms of an 18.1 ms step, 'operators take 100% of the step'): they are scaled into the caller's step."""
    def step():
        return torch.randn(16, 16) @ torch.randn(16, 16)

    unscaled = profile.profile_steps(step, steps=2, device="cpu")
    prof = profile.profile_steps(step, steps=2, device="cpu", step_s=1.0)
    assert prof.wall_s == 1.0 and prof.busy_s <= 1.0
    assert prof.busy_s + prof.idle_s == pytest.approx(1.0)  # the profiled run's shares, in the caller's step
    assert sum(prof.time_by_kind().values()) == pytest.approx(prof.busy_s)
    assert 0 < unscaled.busy_s <= unscaled.wall_s == unscaled.profiled_wall_s


class FakeEvent:
    """A raw profiler event (torch.autograd._KinetoEvent's methods that utils.profile reads)."""

    def __init__(self, name, device, correlation, linked=0, start_ns=0, annotation=False):
        self._fields = (name, device, correlation, linked, start_ns, annotation)

    def name(self):
        return self._fields[0]

    def device_type(self):
        return self._fields[1]

    def correlation_id(self):
        return self._fields[2]

    def linked_correlation_id(self):
        return self._fields[3]

    def start_ns(self):
        return self._fields[4]

    def is_user_annotation(self):
        return self._fields[5]


def test_link_launches_names_the_launching_operator_and_the_launch_time():
    from torch.autograd import DeviceType

    cpu, cuda = DeviceType.CPU, DeviceType.CUDA
    events = [
        FakeEvent("backward", cpu, 4, start_ns=1_000, annotation=True),
        FakeEvent("aten::convolution_backward", cpu, 5, start_ns=2_000),
        FakeEvent("cudaLaunchKernel", cpu, 77, linked=5, start_ns=3_000),  # the runtime call of kernel 77
        FakeEvent("sm90_xmma_dgrad", cuda, 77, linked=5, start_ns=9_000),
        FakeEvent("sm90_xmma_wgrad", cuda, 78, linked=5, start_ns=9_500),  # no runtime call seen: the op's start
        FakeEvent("cudaStreamSynchronize", cpu, 5, start_ns=4_000),  # a CUPTI id equal to an op's: not an op
        FakeEvent("Memcpy HtoD", cuda, 79, linked=99, start_ns=9_900),  # its operator is not in the profile
        FakeEvent("cudaMemcpyAsync", cpu, 79, linked=99, start_ns=3_500),
        FakeEvent("orphan kernel", cuda, 80, start_ns=9_990),  # no link at all
    ]
    links = profile.link_launches(events, trace_start_ns=1_000)
    assert links == {77: ("aten::convolution_backward", 2.0), 78: ("aten::convolution_backward", 1.0),
                     79: ("", 2.5)}


def test_a_cpu_profile_has_no_launch_links_and_kernels_default_to_none():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.randn(8, 8) @ torch.randn(8, 8)
    assert profile._launches(prof) == {} and profile.gpu_kernels(prof) == []
    k = profile.Kernel("aten::mm", 0.0, 5.0)
    assert k.op == "" and k.launched_us is None and k.end_us == 5.0


def test_op_table_leaves_out_the_ranges():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, \
            torch.profiler.record_function("my_range"):
        torch.randn(64, 64) @ torch.randn(64, 64)
    table = profile.op_table(prof, row_limit=20)
    assert "aten::mm" in table and "my_range" not in table
    assert "my_range" in prof.key_averages().table()  # what it leaves out


def fake_gpu_profile():
    """What torch.profiler records for one aten::mm inside a record_function range, on a GPU: the range, the
    operator and the 80 µs kernel it launched, the kernel's time credited to the operator and to the range."""
    from torch.autograd.profiler_util import EventList, FunctionEvent

    kw = {"use_device": "cuda", "stack": [], "input_shapes": []}
    rng = FunctionEvent(0, "my_range", 1, 0, 200, is_user_annotation=True, **kw)
    op = FunctionEvent(1, "aten::mm", 1, 10, 100, **kw)
    kernel = FunctionEvent(2, "ampere_sgemm_128x64_nn", 1, 20, 100, device_type=DeviceType.CUDA, **kw)
    for parent in (op, rng):
        parent.append_kernel("ampere_sgemm_128x64_nn", 0, 80)
    events = EventList([rng, op, kernel], use_device="cuda")
    events._build_tree()
    return types.SimpleNamespace(events=lambda: events, key_averages=events.key_averages)


def self_device_shares(table):
    """The "Self CUDA %" column of a key_averages table, in percent."""
    lines = table.splitlines()
    at = re.split(r"\s{2,}", lines[1].strip()).index("Self CUDA %")  # cells are separated by runs of spaces
    rows = [re.split(r"\s{2,}", line.strip()) for line in lines[3:] if line and not line.startswith(("-", "Self"))]
    return [float(r[at].rstrip("%")) for r in rows]


def test_op_table_kernels_only_counts_each_kernel_once():
    prof = fake_gpu_profile()
    both = profile.op_table(prof)
    assert "aten::mm" in both and "ampere_sgemm" in both and "my_range" not in both
    assert sum(self_device_shares(both)) == pytest.approx(200.0)  # the operator's row repeats its kernel's time
    kernels = profile.op_table(prof, kernels_only=True)
    assert "ampere_sgemm" in kernels and "aten::mm" not in kernels and "my_range" not in kernels
    assert "CPU" not in kernels  # a kernel's row has no CPU time: no empty CPU columns
    assert sum(self_device_shares(kernels)) == pytest.approx(100.0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as cpu_prof:
        torch.randn(8, 8) @ torch.randn(8, 8)
    with pytest.raises(ValueError, match="GPU profile"):
        profile.op_table(cpu_prof, kernels_only=True)


def test_bad_arguments_are_clear_errors():
    with pytest.raises(TypeError, match="callable"):
        profile.profile_steps("not a function", device="cpu")
    with pytest.raises(ValueError, match="steps"):
        profile.profile_steps(lambda: None, steps=0, device="cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_kernels_exclude_annotations_and_fit_in_the_step():
    a = torch.randn(1024, 1024, device="cuda")

    def step():
        with torch.profiler.record_function("my_range"):
            return (a @ a).relu()

    prof = profile.profile_steps(step, steps=3, device="cuda")
    names = [k.name for k in prof.kernels]
    assert "my_range" not in names and prof.kernels_per_step >= 2
    assert prof.busy_s <= 1.05 * prof.wall_s and prof.time_by_kind()["matmul"] > 0
    assert prof.calls_per_step("aten::relu") == 1  # operators are counted on a GPU profile too


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_kernels_carry_the_operator_that_launched_them_and_when():
    """Backward kernels are launched from autograd's thread: their operator and launch time still come through."""
    a = torch.randn(512, 512, device="cuda", requires_grad=True)

    def step():
        with torch.profiler.record_function("backward"):
            (a @ a).relu().sum().backward()

    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as raw:
        step()
        torch.cuda.synchronize()
    kernels = profile.gpu_kernels(raw)
    linked = [k for k in kernels if k.op and k.launched_us is not None]
    assert len(linked) >= 0.9 * len(kernels), [(k.name[:40], k.op) for k in kernels]
    assert any(k.op in ("aten::mm", "aten::matmul") for k in linked)  # the forward's matmul
    # launched before it ran (the host's and the GPU's clocks are aligned to within a few µs)
    assert all(k.launched_us <= k.start_us + 50 for k in linked)
    ranges = [(e.name, e.time_range.start, e.time_range.end) for e in raw.events()
              if getattr(e, "is_user_annotation", False) and e.device_type == torch.autograd.DeviceType.CPU]
    (_, start, end), = [r for r in ranges if r[0] == "backward"]
    assert all(start <= k.launched_us < end for k in linked)  # every kernel of this step, from either thread


def test_host_syncs_refuses_a_cpu_and_a_non_callable():
    with pytest.raises(ValueError, match="CUDA"):
        profile.host_syncs(lambda: None, device="cpu")
    with pytest.raises(TypeError, match="callable"):
        profile.host_syncs(42, device="cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_host_syncs_counts_waits_for_the_gpu_and_restores_the_mode():
    a = torch.randn(256, 256, device="cuda", requires_grad=True)
    assert profile.host_syncs(lambda: (a @ a).relu_(), device="cuda") == 0
    assert profile.host_syncs(lambda: [(a @ a).sum().item() for _ in range(3)], device="cuda") == 3
    assert profile.host_syncs(lambda: (a @ a).sum().backward(), device="cuda") == 0
    assert torch.cuda.get_sync_debug_mode() == 0


@pytest.mark.parametrize(("name", "readable"), [
    ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::"
     "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}> >(int)",
     "elementwise_kernel (direct_copy_kernel_cuda)"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, at::detail::Array<char*, 1> >"
     "(int, at::native::FillFunctor<float>, at::detail::Array<char*, 1>)",
     "vectorized_elementwise_kernel (FillFunctor)"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>(float*, float const*, int)",
     "cunn_SoftMaxForward"),
    ("triton_poi_fused_add_gelu_0", "triton_poi_fused_add_gelu_0"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel",
     "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroup…"),
])
def test_a_kernel_name_is_cut_to_what_it_does(name, readable):
    """A templated ATen kernel's table name keeps its functor, not 70 characters of templates."""
    assert profile.readable_kernel_name(name) == readable
