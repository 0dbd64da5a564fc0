"""utils.compile: the backend chosen per machine, generated code read back, first calls from cold caches, the
break-even from one comparison, and checks against eager that fail when they compared nothing. Compiles here use
Dynamo's "eager" backend (no code generation), so the tests stay quick on a CPU."""

from __future__ import annotations

import copy
import dataclasses
import logging
import math

import pytest
import torch

from utils import compile as uc
from utils.bench import Comparison
from utils.compile_cache import GraphCounts
from utils.env import Capabilities

CPU = Capabilities(device="cpu", name="a CPU", compute_capability=None, sm_count=None, total_memory_bytes=None,
                   l2_cache_bytes=None, bf16=True, tf32=False, fp8=False, flash_attention=False,
                   mem_efficient_attention=False, triton=False, nvcc=None, cxx="/usr/bin/c++")
H100 = dataclasses.replace(CPU, device="cuda:0", name="NVIDIA H100", compute_capability=(9, 0), sm_count=132,
                           triton=True)


def test_choose_backend_uses_inductor_where_it_can_generate_code_and_says_why_not_elsewhere():
    assert uc.choose_backend(CPU).name == "inductor" and not uc.choose_backend(CPU).cuda_graphs
    no_compiler = uc.choose_backend(dataclasses.replace(CPU, cxx=None))
    assert no_compiler.name == "aot_eager" and "C++ compiler" in str(no_compiler) and not no_compiler.generates_code
    gpu = uc.choose_backend(H100)
    assert gpu.name == "inductor" and gpu.cuda_graphs and "Triton" in str(gpu)
    old = uc.choose_backend(dataclasses.replace(H100, name="Tesla P100", compute_capability=(6, 0), triton=False))
    assert old.name == "aot_eager" and not old.cuda_graphs and "sm_60" in str(old)


def test_autotune_skip_reason_applies_inductors_sm_rule():
    assert uc.autotune_skip_reason(H100) is None
    t4 = uc.autotune_skip_reason(dataclasses.replace(H100, name="Tesla T4", compute_capability=(7, 5), sm_count=40))
    assert t4 is not None and "40 SMs" in t4 and str(uc.MIN_SMS_FOR_MATMUL_TEMPLATES) in t4
    assert uc.autotune_skip_reason(dataclasses.replace(H100, sm_count=uc.MIN_SMS_FOR_MATMUL_TEMPLATES)) is None
    assert "CPU" in uc.autotune_skip_reason(CPU)
    assert "Triton" in uc.autotune_skip_reason(dataclasses.replace(H100, triton=False))


TRITON_MODULE = '''
triton_poi_fused_add_0 = async_compile.triton('triton_poi_fused_add_0', \'\'\'
@triton.jit
def triton_poi_fused_add_0(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    xindex = tl.arange(0, XBLOCK)
    tmp0 = tl.load(in_ptr0 + xindex)
    tl.store(out_ptr0 + xindex, tmp0 + 1)
    pass
\'\'\')
triton_red_fused_sum_1 = async_compile.triton('triton_red_fused_sum_1', \'\'\'
\'\'\')
def call(args):
    pass
'''


def test_generated_reads_kernel_names_language_and_an_excerpt():
    code = uc.Generated(output=None, modules=(TRITON_MODULE,))
    assert code.kernels == ["triton_poi_fused_add_0", "triton_red_fused_sum_1"] and code.language == "Triton"
    excerpt = code.excerpt()
    assert excerpt.startswith("def triton_poi_fused_add_0(") and "tl.store" in excerpt
    assert "2 generated Triton kernels" in str(code)
    cpp_module = "cpp_fused_0 = async_compile.cpp_pybinding(['float*'], '''\nextern \"C\" void kernel()\n'''"
    cpp = uc.Generated(None, (cpp_module,))
    assert cpp.kernels == ["cpp_fused_0"] and cpp.language == "C++" and "extern" in cpp.excerpt()
    nothing = uc.Generated(None, ())
    assert nothing.kernels == [] and "no code generated" in str(nothing) and "no kernel" in nothing.excerpt()


def test_generated_on_a_real_compile_returns_the_output():
    out = uc.generated(torch.compile(lambda x: x * 2, backend="eager"), torch.ones(3))
    torch.testing.assert_close(out.output, torch.full((3,), 2.0))
    assert out.modules == ()  # the eager backend generates no code


def test_captured_logs_collects_messages_and_restores_the_loggers():
    logger = logging.getLogger("torch._dynamo")
    handlers, propagate = logger.handlers[:], logger.propagate
    with uc.captured_logs() as messages:
        logging.getLogger("torch._dynamo.some_module").warning("hello %s", "there")
    assert any("hello there" in m for m in messages)
    assert logger.handlers == handlers and logger.propagate == propagate


def _counted_step():
    compiled = torch.compile(lambda x: torch.sin(x) + 1, backend="eager")
    x = torch.randn(8)
    return lambda: compiled(x)


def test_first_calls_times_each_call_and_counts_the_graphs():
    torch.compiler.reset()
    run = uc.first_calls("sin", _counted_step, calls=3)
    assert len(run.call_s) == 3 and all(t > 0 for t in run.call_s) and run.first_s == pytest.approx(sum(run.call_s))
    assert run.dynamo_graphs >= 1 and isinstance(run.graphs, GraphCounts)
    with pytest.raises(ValueError, match="at least 1 call"):
        uc.first_calls("x", _counted_step, calls=0)
    with pytest.raises(TypeError, match="must return the step"):
        uc.first_calls("x", lambda: 3)


def test_compile_cold_runs_checks_in_the_block_and_refuses_a_variant_that_compiled_nothing(capsys):
    torch.compiler.reset()
    seen = []
    out = uc.compile_cold({"sin": _counted_step}, checks={"sin": lambda: seen.append("checked")}, expect="soon")
    assert seen == ["checked"] and list(out) == ["sin"] and len(out["sin"].call_s) == 3
    assert "each from an empty cache: soon." in capsys.readouterr().out
    x = torch.randn(4)
    with pytest.raises(RuntimeError, match="compiled no graph"):
        uc.compile_cold({"eager": lambda: (lambda: torch.cos(x))})
    with pytest.raises(ValueError, match="not built"):
        uc.compile_cold({"sin": _counted_step}, checks={"other": lambda: None})


def _payoff():
    rounds = {"eager": [0.010] * 8, "fast": [0.005] * 8, "slow": [0.012] * 8}
    comparison = Comparison.from_rounds(rounds)
    compiled = {"fast": uc.Compiled("fast", lambda: None, (10.0, 0.005, 0.005), GraphCounts(2, 0), 1),
                "slow": uc.Compiled("slow", lambda: None, (3.0, 0.012, 0.012), GraphCounts(1, 0), 1)}
    return uc.payoff(comparison, compiled)


def test_payoff_takes_the_step_from_the_comparison_and_counts_break_even():
    p = _payoff()
    assert p.step_s("fast") == pytest.approx(0.005) == pytest.approx(p.comparison.time_s("fast"))
    assert p.cost_s("fast") == pytest.approx(10.01 - 3 * 0.005)  # the first calls less three steps
    assert p.steps("fast") == math.ceil(p.cost_s("fast") / 0.005)
    assert p.steps("slow") is None
    assert "never paid off" in p.explain("slow") and "slower" in p.explain("slow")
    assert f"paid off after {p.steps('fast'):,} steps" in p.explain("fast")
    rows = {r["variant"]: r for r in p.rows()}
    assert rows["slow"]["pays off after"] == "never" and rows["fast"]["Inductor graphs"] == "2 compiled, 0 from cache"
    xs, eager = p.curves()["eager"]
    _, fast = p.curves()["fast"]
    n = next(i for i, x in enumerate(xs) if x >= p.steps("fast"))
    assert fast[n] <= eager[n] and fast[0] > eager[0]  # the lines cross at the break-even
    with pytest.raises(KeyError, match="did not time"):
        uc.payoff(p.comparison, {"missing": p.compiled["fast"]})


def test_payoff_plot_names_each_break_even_and_marks_where_the_lines_cross():
    p = _payoff()
    assert p.legend("fast") == f"fast (pays off after {p.steps('fast'):,})"
    assert p.legend("slow") == "slow (never pays off)" and p.legend("eager") == "eager"
    fig = p.plot()
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["eager", p.legend("fast"), p.legend("slow")]
    dots = [line for line in ax.get_lines() if line.get_marker() == "o"]
    assert len(dots) == 1 and dots[0].get_xdata()[0] == p.steps("fast")  # only the variant that pays off
    assert dots[0].get_color() == next(line for line in ax.get_lines() if line.get_label() == p.legend("fast")
                                       ).get_color()


def test_check_outputs_passes_fails_and_refuses_to_have_compared_nothing(capsys):
    a = torch.ones(10)
    ok = uc.check_outputs({"x": a + 1e-7}, {"x": a}, tolerance=1e-5, title="t")
    assert ok.passed and ok.compared == 1 and "✅" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="differs beyond"):
        uc.check_outputs({"x": a * 1.1}, {"x": a}, tolerance=1e-5)
    with pytest.raises(AssertionError, match="not finite"):
        uc.check_outputs({"x": a * math.nan}, {"x": a})
    with pytest.raises(AssertionError, match="nothing was compared"):
        uc.check_outputs({"x": a, "y": a}, {"x": a * math.inf, "y": a * math.nan})
    partly = uc.check_outputs({"x": a, "y": a}, {"x": a, "y": a * math.inf})
    assert partly.passed and partly.compared == 1 and "1 skipped" in partly.summary()
    soft = uc.check_outputs({"x": a * 2}, {"x": a}, strict=False)
    assert not soft.passed
    grads = uc.check_outputs({"g": {"w": a, "b": a * 1.5}}, {"g": {"w": a, "b": a}}, strict=False)
    assert not grads.passed, "a dict counts by its worst entry"


def test_check_outputs_under_autocast_bounds_the_distance_to_fp32():
    fp32 = {"x": torch.ones(100)}
    eager = {"x": torch.ones(100) * 1.01}  # eager's own rounding: 1% from fp32
    assert uc.check_outputs({"x": torch.ones(100) * 0.99}, eager, fp32, strict=False).passed  # as far, other side
    assert not uc.check_outputs({"x": torch.ones(100) * 1.05}, eager, fp32, strict=False).passed


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(50, 16)
        self.head = torch.nn.Linear(16, 50)

    def forward(self, tokens):
        return self.head(torch.tanh(self.embedding(tokens)))


def _fresh_factory():
    torch.manual_seed(0)
    model = _Tiny()
    return lambda: (lambda m: (m, torch.optim.AdamW(m.parameters(), lr=1e-3)))(copy.deepcopy(model))


def _tokens():
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 50, (4, 12), generator=gen)
    return x, torch.roll(x, -1, dims=1)


def test_check_training_step_accepts_a_compiled_step_and_catches_one_without_clipping():
    from utils.train import lm_loss, train_step

    inputs, targets = _tokens()
    fresh = _fresh_factory()

    def compiled_step(m, opt):
        return lambda: train_step(torch.compile(m, backend="eager"), opt, inputs, targets, max_grad_norm=0.1)

    check = uc.check_training_step(compiled_step, fresh, inputs, targets, amp_dtype=None, max_norm=0.1)
    assert check.passed and check.compared == 2

    def unclipped(m, opt):
        cm = torch.compile(m, backend="eager")

        def step():
            opt.zero_grad()
            loss = lm_loss(cm(inputs), targets)
            loss.backward()
            opt.step()
            return loss.detach()
        return step

    with pytest.raises(AssertionError, match="clipped gradients differs"):
        uc.check_training_step(unclipped, fresh, inputs, targets, amp_dtype=None, max_norm=0.1)

    def not_compiled(m, opt):
        return lambda: train_step(m, opt, inputs, targets, max_grad_norm=0.1)

    with pytest.raises(AssertionError, match="eager with eager"):
        uc.check_training_step(not_compiled, fresh, inputs, targets, amp_dtype=None, max_norm=0.1)
    def compiled_once(m, opt):  # Dynamo reuses the graph captured above: the compiled module is what it finds
        cm = torch.compile(m, backend="eager")
        return lambda: train_step(cm, opt, inputs, targets, max_grad_norm=0.1)

    check = uc.check_training_step(compiled_once, fresh, inputs, targets, amp_dtype=None, max_norm=0.1, calls=3)
    assert check.passed and "after 3 steps" in check.title


def _clip_and_step(clip=True):
    def make(m, opt):
        @torch.compile(backend="eager")
        def clip_and_step():
            if clip:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
        return clip_and_step
    return make


def test_check_optimizer_step_compares_a_really_compiled_step(capsys):
    check = uc.check_optimizer_step(_clip_and_step(), _fresh_factory())
    assert check.passed and check.compared == 4
    assert "captured by Dynamo" in check.title and "clipped to 1.0000" in check.title
    with pytest.raises(AssertionError, match="differs beyond"):
        uc.check_optimizer_step(_clip_and_step(clip=False), _fresh_factory())

    def not_compiled(m, opt):
        return lambda: (torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0), opt.step())

    with pytest.raises(AssertionError, match="eager with eager"):
        uc.check_optimizer_step(not_compiled, _fresh_factory())


def test_check_training_step_runs_the_optimizer_check_when_asked(capsys):
    inputs, targets = _tokens()

    def compiled_step(m, opt):
        cm = torch.compile(m, backend="eager")
        return lambda: __import__("utils.train", fromlist=["train_step"]).train_step(cm, opt, inputs, targets)

    uc.check_training_step(compiled_step, _fresh_factory(), inputs, targets, amp_dtype=None,
                           optimizer_step=_clip_and_step())
    assert "its compiled clipping and optimizer step" in capsys.readouterr().out


def test_payoff_names_its_unit_in_the_plural():
    assert uc._plural("step") == "steps" and uc._plural("forward pass") == "forward passes"


def test_payoff_says_unresolved_for_an_inconclusive_or_same_verdict_and_leaves_it_out_of_the_plot(capsys):
    noisy = [0.010, 0.006, 0.012, 0.007, 0.011, 0.006, 0.012, 0.008]
    rounds = {"eager": [0.010] * 8, "noisy": noisy, "same": [0.0100001] * 8, "slow": [0.012] * 8}
    compiled = {name: uc.Compiled(name, lambda: None, (3.0, 0.01, 0.01), GraphCounts(1, 0), 1)
                for name in ("noisy", "same", "slow")}
    p = uc.payoff(Comparison.from_rounds(rounds), compiled)
    assert p.outcome("noisy") == "inconclusive" and p.outcome("same") == "same"
    rows = {r["variant"]: r["pays off after"] for r in p.rows()}
    assert rows == {"noisy": "unresolved", "same": "unresolved", "slow": "never"}
    assert "break-even unresolved" in p.summary("noisy") and "never" not in p.summary("noisy")
    assert "never paid off" in p.summary("slow")
    assert set(p.curves()) == {"eager", "slow"}
    unresolved = uc.payoff(p.comparison, {k: compiled[k] for k in ("noisy", "same")})
    assert unresolved.plot() is None and "No plot" in capsys.readouterr().out


def test_quiet_autotuning_reads_the_winner_of_every_shape():
    report = ("AUTOTUNE addmm(8192x4096, 8192x1024, 1024x4096)\nstrides: [1, 1]\ndtypes: torch.bfloat16\n"
              "  bias_addmm 0.1600 ms 100.0% \n  triton_mm_3 0.1700 ms 94.1% BLOCK_M=128\n"
              "SingleProcess AUTOTUNE benchmarking takes 1.0 seconds\n"
              "AUTOTUNE mm(64x64, 64x64)\nstrides: [1]\ndtypes: torch.float32\n  triton_mm_1 0.01 ms 100.0% x\n")
    assert uc._winners(report) == ["bias_addmm", "triton_mm_1"]
    tuned = uc.Autotuned(uc._winners(report))
    assert tuned.shapes == 2 and tuned.backend == "cuBLAS (ATen) and a Triton template"
    assert uc.Autotuned([]).backend == "not reported"
    with uc.quiet_autotuning() as got:
        import sys
        sys.stderr.write(report)
    assert got.chosen == ["bias_addmm", "triton_mm_1"]


def test_check_outputs_gives_the_unit_and_names_a_bound_set_by_its_floor(capsys):
    a = torch.ones(4)
    uc.check_outputs({"x": a}, {"x": a}, {"x": a * (1 + 1e-6)})
    out = capsys.readouterr().out
    assert "‖a − b‖ / ‖b‖" in out and "bound of x is mostly its 0.001 floor" in out


def test_the_graphs_reason_gives_the_bound_the_idle_time_sets():
    """CUDA graphs remove only the GPU's idle time: the reason states wall / busy as the bound and says whether the
    timed speed-up sits within it (04b's reduce-overhead against default)."""
    from types import SimpleNamespace

    from utils.bench import Verdict
    waits = SimpleNamespace(on_gpu=True, wall_s=2.0e-3, busy_s=1.6e-3, idle_s=0.4e-3, idle_fraction=0.2,
                            unit="forward pass")
    within = Verdict("reduce-overhead", "default", 1.2, (1.15, 1.24), 0.03, 12)
    assert uc.graphs_bound_reason(waits, within).endswith("at most 1.25×: the gain is within that bound")
    above = Verdict("reduce-overhead", "default", 1.5, (1.4, 1.6), 0.03, 12)
    assert "above that bound" in uc.graphs_bound_reason(waits, above)
    slower = Verdict("reduce-overhead", "default", 0.8, (0.75, 0.85), 0.03, 12)
    assert uc.graphs_bound_reason(waits, slower).endswith("cost more host time than it removed")
    unresolved = Verdict("reduce-overhead", "default", 1.1, (0.9, 1.3), 0.03, 12)
    assert uc.graphs_bound_reason(waits, unresolved).endswith("at most 1.25×")
    assert "CPU" in uc.graphs_bound_reason(SimpleNamespace(on_gpu=False), within)
