"""utils.bias_gelu: bad inputs fail clearly on every entry point, good inputs give the reference's answer, the
autograd formula matches PyTorch's, the operators pass opcheck, work with a bias in another dtype (a model under
autocast), and the operator byte counts from a profile are right. Everything here runs on CPU; tests marked for
a GPU run where CUDA is (every CUDA kernel version, autocast + torch.compile). The build machinery is tested in
tests/test_extension.py.

The CPU extension is built once into the repository's build/ folder (notebook 06 reuses it): about 10 s on a
2-core machine the first time, milliseconds afterwards.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from utils import bias_gelu as bg

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="session")
def cpu_ext():
    """The CPU extension, built (or found built) once per test session."""
    return bg.build_extension("cpu")


def make_inputs(shape, dtype=torch.float32, device="cpu", seed=0, bias_dtype=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(device, dtype)
    bias = torch.randn(shape[-1] if shape else 1, generator=gen).to(device, bias_dtype or dtype)
    return x, bias


def assert_matches_reference(out, x, bias):
    """out against the float32 reference of the same inputs, bias rounded to x's dtype as the operators do."""
    assert out.shape == x.shape and out.dtype == x.dtype and out.device == x.device
    expected = bg.reference(x.float(), bias.to(x.dtype).float())
    torch.testing.assert_close(out.float(), expected, **bg.tolerance(x.dtype))


# ── Bad inputs: a clear error, never garbage ────────────────────────────────────────────────────────────────


def _bad_inputs():
    x, b = make_inputs((29, 37))
    return {
        "float64": ((x.double(), b.double()), TypeError, "float32, float16 or bfloat16"),
        "int64": ((x.long(), b.long()), TypeError, "float32, float16 or bfloat16"),
        "float64 bias": ((x, b.double()), TypeError, "bias must be float32, float16 or bfloat16"),
        "mixed dtypes": ((x, b.half()), TypeError, "same dtype"),
        "bias too long": ((x, torch.randn(38)), ValueError, r"bias \[cols\]"),
        "bias 2-D": ((x, b[None]), ValueError, r"bias \[cols\]"),
        "x 0-D": ((x[0, 0], b[:1]), ValueError, r"x \[\.\.\., cols\]"),
        "x transposed": ((x.t(), torch.randn(29)), ValueError, "contiguous"),
        "bias strided": ((x, torch.randn(74)[::2]), ValueError, "contiguous"),
        "x not a tensor": (([1.0, 2.0], b[:2]), TypeError, "must be a torch.Tensor"),
    }


BAD = _bad_inputs()
ENTRY_POINTS = {
    "C++ CPU kernel": bg.bias_gelu_cpu,
    "custom_op course::bias_gelu_cpp": bg.bias_gelu_cpp,
    "Triton launcher": bg.bias_gelu_triton_launch,
    "triton_op course::bias_gelu_triton": bg.bias_gelu_triton,
}
OPERATORS = [name for name in ENTRY_POINTS if "course::" in name]


# the operators accept a bias in another dtype and round it (tested below): "mixed dtypes" is bad only for the kernels
BAD_CASES = [(entry, case) for entry in ENTRY_POINTS for case in BAD
             if not (case == "mixed dtypes" and entry in OPERATORS)]


@pytest.mark.parametrize(("entry", "case"), BAD_CASES)
def test_bad_inputs_raise_clear_errors(entry, case):
    args, error, message = BAD[case]
    if case == "x not a tensor" and entry in OPERATORS:  # the operator's schema rejects it before our checks
        error, message = RuntimeError, "Expected a value of type 'Tensor'"
    with pytest.raises(error, match=message):
        ENTRY_POINTS[entry](*args)


def test_mixed_dtypes_error_points_to_the_operators():
    x, b = make_inputs((4, 8), bias_dtype=torch.float16)
    with pytest.raises(TypeError, match="round bias to x's dtype for you"):
        bg.bias_gelu_cpu(x, b)


def test_cpu_tensor_to_the_cuda_kernel_is_refused_before_any_build():
    x, b = make_inputs((4, 8))
    with pytest.raises(ValueError, match="needs cuda tensors, got x on cpu"):
        bg.bias_gelu_cuda(x, b)
    with pytest.raises(ValueError, match="unknown CUDA variant"):
        bg.bias_gelu_cuda_variant(x, b, "fastest")


@pytest.mark.skipif(CUDA, reason="on a GPU the Triton kernel compiles for CUDA tensors")
def test_cpu_tensor_to_compiled_triton_says_how_to_interpret():
    x, b = make_inputs((4, 8))
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        bg.bias_gelu_triton_launch(x, b)


@pytest.mark.parametrize("case", [c for c in BAD if c not in ("x not a tensor", "float64 bias")])
def test_cpp_kernel_checks_its_own_inputs(cpu_ext, case):
    """The C++ TORCH_CHECKs guard callers that go straight to torch.ops.course_ext."""
    args, _, _ = BAD[case]
    with pytest.raises(RuntimeError, match="bias_gelu_cpu: "):
        torch.ops.course_ext.bias_gelu_cpu(*args)


def test_raw_cpp_op_has_a_fake_and_compiles(cpu_ext):
    """The C++ op is registered for the CPU dispatch key (not as a catch-all), so utils adds a fake: meta tensors
    give an output's shape without computing it, and torch.compile(fullgraph=True) traces a call to the raw op."""
    x, b = make_inputs((4, 8))
    out = torch.ops.course_ext.bias_gelu_cpu(x.to("meta"), b.to("meta"))
    assert out.device.type == "meta" and out.shape == x.shape
    compiled = torch.compile(lambda a, c: torch.ops.course_ext.bias_gelu_cpu(a, c), fullgraph=True)
    assert_matches_reference(compiled(x, b), x, b)


@pytest.mark.parametrize("shape", [(0, 781), (5, 0), (0,), (2, 0, 3)])
@pytest.mark.parametrize("entry", ["C++ CPU kernel", "custom_op course::bias_gelu_cpp"])
def test_empty_tensors_give_empty_results(cpu_ext, entry, shape):
    x, b = make_inputs(shape)
    out = ENTRY_POINTS[entry](x, b)
    assert out.shape == x.shape and out.dtype == x.dtype and out.numel() == 0


# ── Good inputs: the reference's answer ─────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_kernel_matches_reference_on_an_irregular_shape(cpu_ext, dtype):
    x, b = make_inputs((1823, 781), dtype)
    assert_matches_reference(bg.bias_gelu_cpu(x, b), x, b)


def test_cpu_kernel_on_3d_input_and_offset_view(cpu_ext):
    x, b = make_inputs((3, 5, 781))
    assert_matches_reference(bg.bias_gelu_cpp(x, b), x, b)
    offset = torch.randn(1 + 7 * 13)[1:].view(7, 13)  # contiguous, but starts one element into its storage
    b13 = torch.randn(13)
    assert_matches_reference(bg.bias_gelu_cpu(offset, b13), offset, b13)


@pytest.mark.parametrize(("x_dtype", "bias_dtype"), [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                                     (torch.float32, torch.bfloat16)], ids=str)
def test_operator_rounds_bias_to_x_dtype(cpu_ext, x_dtype, bias_dtype):
    x, b = make_inputs((37, 29), x_dtype, bias_dtype=bias_dtype)
    out = bg.bias_gelu_cpp(x, b)
    assert out.dtype == x_dtype
    assert_matches_reference(out, x, b)


def test_tolerance_is_stated_per_dtype():
    assert bg.tolerance(torch.float32) == {"rtol": 1e-5, "atol": 1e-6}
    assert bg.tolerance(torch.bfloat16)["rtol"] == torch.finfo(torch.bfloat16).eps
    with pytest.raises(ValueError):
        bg.tolerance(torch.float64)
    with pytest.raises(ValueError, match="roundings"):
        bg.tolerance(torch.float16, roundings=3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_eager_in_16_bits_needs_the_tolerance_of_two_roundings(dtype):
    """Eager rounds x + bias before gelu: one ulp of rtol is not enough in the negative tail, eps / 8 of atol is."""
    z = torch.linspace(-12, 12, 20_001).to(dtype)[:, None]
    bias = torch.linspace(-4, 4, 81).to(dtype)
    eager, ref = bg.reference(z, bias).float(), bg.reference(z.float(), bias.float())
    with pytest.raises(AssertionError):
        torch.testing.assert_close(eager, ref, **bg.tolerance(dtype))
    torch.testing.assert_close(eager, ref, **bg.tolerance(dtype, roundings=2))


def test_reference_exact_keeps_the_negative_tail():
    """The tanh form loses the tail to cancellation even in float64; the sigmoid form is the same function."""
    z = torch.tensor([-12.0, -6.0, -1.0, 0.5, 3.0])
    exact = bg.reference_exact(z, torch.zeros(1))
    torch.testing.assert_close(exact.float(), bg.reference(z, torch.zeros(1)), rtol=1e-5, atol=1e-6)
    assert exact[0] < 0 and abs(exact[0]) < 1e-40  # gelu(-12) ≈ -3e-61, far below float64's 1e-16 · |z|
    assert bg.reference(z.double(), torch.zeros(1, dtype=torch.float64))[0] == 0  # the tanh form: cancelled


def test_bytes_moved():
    x, b = make_inputs((10, 4), torch.float16)
    assert bg.bytes_moved(x, b) == (2 * 40 + 4) * 2
    assert bg.eager_bytes_moved(x, b) == (4 * 40 + 4) * 2
    assert bg.bytes_moved(x, b.float()) == 2 * 40 * 2 + 4 * 4


def test_operator_bytes_counts_what_eager_reads_and_writes():
    x, b = make_inputs((64, 32), torch.bfloat16)
    ops = bg.operator_bytes(lambda: bg.reference(x, b))
    assert [r["operator"] for r in ops] == ["aten::add", "aten::gelu"]
    assert sum(r["read_bytes"] + r["written_bytes"] for r in ops) == bg.eager_bytes_moved(x, b)
    # an fp32 bias (as under autocast): add promotes to float32, and every later byte doubles
    x, b = make_inputs((64, 32), torch.bfloat16, bias_dtype=torch.float32)
    ops = bg.operator_bytes(lambda: bg.reference(x, b))
    assert [r["output dtype"] for r in ops] == ["float32", "float32"]
    assert bg.operator_bytes(lambda: x.view(-1)) == []  # a view moves nothing
    assert [(r["read_bytes"], r["written_bytes"]) for r in ops] == [(64 * 32 * 2 + 32 * 4, 64 * 32 * 4),
                                                                   (64 * 32 * 4, 64 * 32 * 4)]


# ── Operators: autograd, opcheck, autocast ──────────────────────────────────────────────────────────────────


def test_backward_matches_autograd_of_the_reference(cpu_ext):
    x, b = make_inputs((2, 37, 29))
    x.requires_grad_()
    b.requires_grad_()
    grad_out = torch.randn_like(x)
    ours = torch.autograd.grad(bg.bias_gelu_cpp(x, b), (x, b), grad_out)
    expected = torch.autograd.grad(bg.reference(x, b), (x, b), grad_out)
    for got, want in zip(ours, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_cpp_op_passes_opcheck_on_cpu(cpu_ext):
    for shape, dtype, bias_dtype, grad in (((8, 16), torch.float32, torch.float32, True),
                                           ((2, 3, 5), torch.float32, torch.float32, False),
                                           ((8, 16), torch.bfloat16, torch.float32, True)):
        x, b = make_inputs(shape, dtype, bias_dtype=bias_dtype)
        torch.library.opcheck(bg.bias_gelu_cpp, (x.requires_grad_(grad), b.requires_grad_(grad)))


class MLPBlock(torch.nn.Module):
    """Linear (no bias) → bias + GELU by ``act`` with an fp32 bias parameter → Linear: a Transformer MLP."""

    def __init__(self, d_model: int, act) -> None:
        super().__init__()
        self.up = torch.nn.Linear(d_model, 4 * d_model, bias=False)
        self.bias = torch.nn.Parameter(torch.randn(4 * d_model) * 0.1)
        self.down = torch.nn.Linear(4 * d_model, d_model)
        self.act = act

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(h), self.bias))


def run_mlp_under_autocast(act, device, dtype, compiled=False):
    torch.manual_seed(0)
    block = MLPBlock(64, act).to(device)
    fn = torch.compile(block, fullgraph=True) if compiled else block
    h = torch.randn(4, 32, 64, device=device)
    with torch.autocast(device, dtype=dtype):
        out = fn(h)
    out.float().square().mean().backward()
    return out, block.bias.grad


def test_cpp_op_in_a_model_under_cpu_autocast(cpu_ext):
    """bf16 autocast: the Linear gives bf16, the bias parameter is fp32; forward and backward work and agree
    with eager PyTorch (whose add promotes to fp32) within bf16's resolution."""
    out, bias_grad = run_mlp_under_autocast(bg.bias_gelu_cpp, "cpu", torch.bfloat16)
    ref_out, ref_bias_grad = run_mlp_under_autocast(bg.reference, "cpu", torch.bfloat16)
    assert out.dtype == torch.bfloat16 and bias_grad.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=2e-2, atol=2e-2 * ref_out.abs().max().item())
    torch.testing.assert_close(bias_grad, ref_bias_grad, rtol=2e-2, atol=2e-2 * ref_bias_grad.abs().max().item())


def test_triton_kernel_in_the_interpreter():
    """Triton's CPU interpreter must be switched on before triton is imported: a fresh process."""
    script = textwrap.dedent("""
        import os
        os.environ["TRITON_INTERPRET"] = "1"
        import torch
        from utils import bias_gelu as bg
        assert bg.TRITON_INTERPRETED
        gen = torch.Generator().manual_seed(0)
        cases = [(bg.bias_gelu_triton_launch, (1823, 781)), (bg.bias_gelu_triton_launch, (1, 1)),
                 (bg.bias_gelu_triton_launch, (0, 5)), (bg.bias_gelu_triton, (37, 29))]
        for fn, shape in cases:
            for dtype in (torch.float32, torch.float16):  # bf16 is wrong in the interpreter (numpy has none)
                x = torch.randn(shape, generator=gen).to(dtype)
                b = torch.randn(shape[-1], generator=gen).to(dtype)
                torch.testing.assert_close(fn(x, b).float(), bg.reference(x.float(), b.float()),
                                           **bg.tolerance(dtype))
        x = torch.randn(37, 29, generator=gen).half()
        b = torch.randn(29, generator=gen)  # an fp32 bias: the operator rounds it to fp16
        kit = bg.toolchain("cpu")
        assert kit.triton_why_not is None, kit.triton_why_not
        registered = bg.register_triton(bg.bias_gelu_kernel, kit, example=(x, b.half()))
        assert registered.available and registered.op is bg.bias_gelu_triton
        assert registered.dtypes == (torch.float32, torch.float16)
        out = bg.bias_gelu_triton(x, b)
        assert out.dtype == torch.float16
        torch.testing.assert_close(out.float(), bg.reference(x.float(), b.half().float()), **bg.tolerance(x.dtype))
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=bg.REPO_ROOT, capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONPATH": str(bg.REPO_ROOT)})
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


# ── On a GPU ────────────────────────────────────────────────────────────────────────────────────────────────

GPU_SHAPES = [(1823, 781), (1, 1), (3, 5, 8), (7, 24), (2, 64), (33, 1000), (513, 4104)]


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("entry", ["cuda", "triton", *bg.CUDA_VARIANTS])
def test_gpu_kernels_match_reference(entry, dtype):
    if entry in bg.CUDA_VARIANTS:
        def launch(x, b):
            return bg.bias_gelu_cuda_variant(x, b, entry)
    else:
        launch = bg.bias_gelu_cuda if entry == "cuda" else bg.bias_gelu_triton_launch
    tanh = entry == "rows + tanh.approx"  # documented as inaccurate for z < 0: only its shape handling is tested
    for shape in GPU_SHAPES:
        x, b = make_inputs(shape, dtype, "cuda")
        out = launch(x, b)
        if tanh:
            assert out.shape == x.shape and torch.isfinite(out).all()
        else:
            assert_matches_reference(out, x, b)
    offset = torch.empty(1 + 1823 * 781, device="cuda", dtype=dtype)[1:].view(1823, 781)
    offset.copy_(torch.randn(1823, 781, device="cuda"))  # 1 element into its allocation: not 16-byte aligned
    b = torch.randn(781, device="cuda").to(dtype)
    if not tanh:
        assert_matches_reference(launch(offset, b), offset, b)
    assert launch(*make_inputs((0, 781), dtype, "cuda")).shape == (0, 781)


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_rows_kernel_keeps_the_first_versions_bits(dtype):
    """The index change alone (flat → rows) must not change one bit: same arithmetic, other addressing."""
    for shape in [(1823, 781), (4096, 4096), (7, 24)]:
        x, b = make_inputs(shape, dtype, "cuda")
        assert torch.equal(bg.bias_gelu_cuda_variant(x, b, "flat (first version)"),
                           bg.bias_gelu_cuda_variant(x, b, "rows"))
    x, b = make_inputs((64, 4096), dtype, "cuda")
    assert torch.equal(bg.bias_gelu_cuda(x, b), bg.bias_gelu_cuda_variant(x, b, bg.CUDA_BEST[dtype]))


@needs_cuda
def test_gpu_tanh_approx_loses_the_negative_tail():
    """What CUDA_VARIANTS says about tanh.approx: 1 + tanh(u) cancels for z < 0, the relative error grows."""
    z = torch.linspace(-6, -2, 4001, device="cuda")[None]
    zero = torch.zeros(z.shape[-1], device="cuda")
    exact = bg.reference_exact(z, zero)
    rel = lambda out: ((out.double() - exact).abs() / exact.abs()).max().item()  # noqa: E731
    assert rel(bg.bias_gelu_cuda_variant(z, zero, "rows + tanh.approx")) > 1e-2
    assert rel(bg.bias_gelu_cuda_variant(z, zero, "rows + fast exp")) < 1e-4
    assert rel(bg.bias_gelu_cuda_variant(z, zero, "rows")) < 1e-5


@needs_cuda
def test_gpu_bad_devices():
    x, b = make_inputs((4, 8), device="cuda")
    with pytest.raises(ValueError, match="one device"):
        bg.bias_gelu_cpp(x, b.cpu())
    bg.build_extension("cuda")
    with pytest.raises(RuntimeError, match="expected x and bias on one CUDA device"):
        torch.ops.course_ext.bias_gelu_cuda(x, b.cpu())
    with pytest.raises(RuntimeError, match="variant must be"):
        torch.ops.course_ext.bias_gelu_cuda_variant(x, b, 7)


@needs_cuda
@pytest.mark.parametrize("op", [bg.bias_gelu_cpp, bg.bias_gelu_triton], ids=["cpp", "triton"])
def test_gpu_ops_pass_opcheck(op):
    for dtype, bias_dtype, grad in ((torch.float32, torch.float32, True), (torch.bfloat16, torch.bfloat16, False),
                                    (torch.bfloat16, torch.float32, True)):
        x, b = make_inputs((8, 40), dtype, "cuda", bias_dtype=bias_dtype)
        torch.library.opcheck(op, (x.requires_grad_(grad), b.requires_grad_(grad)))


@needs_cuda
@pytest.mark.parametrize("op", [bg.bias_gelu_cpp, bg.bias_gelu_triton], ids=["cpp", "triton"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gpu_ops_in_a_model_under_autocast(op, compiled):
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    out, bias_grad = run_mlp_under_autocast(op, "cuda", dtype, compiled=compiled)
    ref_out, ref_bias_grad = run_mlp_under_autocast(bg.reference, "cuda", dtype)
    assert out.dtype == dtype and bias_grad.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=2e-2, atol=2e-2 * ref_out.abs().max().item())
    torch.testing.assert_close(bias_grad, ref_bias_grad, rtol=2e-2, atol=2e-2 * ref_bias_grad.abs().max().item())


def test_issue_table_puts_instructions_against_the_budget():
    """One synthetic ncu row: 1,000 warp instructions for 4,000 bf16 elements = 8 instructions per element, 2 per
    byte; 2 SMs × 4 × 32 at 1 GHz issue 256e9 per second, and 16 GB/s moves 4e9 bf16 elements: a budget of 64."""
    launch = {"label": "CUDA rows", "smsp__inst_executed.sum": 1000.0, "sm__cycles_elapsed.avg.per_second": 1e9,
              "dram__bytes_read.sum": 8000.0, "dram__bytes_write.sum": 8000.0,
              "smsp__issue_active.avg.pct_of_peak_sustained_active": 12.5, "launch__registers_per_thread": 40.0,
              "sm__warps_active.avg.pct_of_peak_sustained_active": 50.0}
    row = bg.issue_table([launch], torch.empty(4000, dtype=torch.bfloat16), sm_count=2, copy_gbps=16.0)[0]
    assert (row["instructions / element"], row["per byte"], row["budget / element"]) == ("8.0", "2.0", "64")
    assert (row["registers"], row["issue busy"], row["SM clock"]) == (40, "12%", "1,000 MHz")


def test_importing_utils_does_not_import_triton():
    """Notebook 06 sets TRITON_INTERPRET=1 on a CPU after `import utils`; Triton reads it when it is first imported
    (its library helpers are JIT functions made then), so no module that `import utils` loads may import Triton."""
    code = "import sys, utils; sys.exit('triton' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"`import utils` imported Triton: {result.stderr[-500:]}"


# ── What runs here: every missing piece simulated (notebook 06 prints the reason and skips the path) ──────────

from utils import extension  # noqa: E402
from utils.bench import Comparison  # noqa: E402


def _not_built(monkeypatch, tmp_path):
    """No earlier build: toolchain() must then ask for the tools."""
    monkeypatch.setattr(extension, "BUILD_ROOT", tmp_path)
    monkeypatch.setattr(extension, "build_directory", lambda spec, root=tmp_path: tmp_path / spec.name)
    monkeypatch.setattr(extension, "library_path", lambda spec, root=tmp_path: tmp_path / spec.name / "x.so")


def test_toolchain_on_a_cpu_with_the_interpreter(monkeypatch):
    monkeypatch.setattr(bg, "TRITON_INTERPRETED", True)
    kit = bg.toolchain("cpu")
    assert kit.triton_why_not is None and kit.triton_dtypes == (torch.float32, torch.float16)  # numpy has no bf16
    assert kit.cpp_kind == "cpu" and kit.dtype == torch.float32
    assert [row["path"] for row in kit.rows()] == ["Triton kernel", "C++ extension (cpu)", "torch.compile"]


def test_toolchain_on_a_cpu_without_the_interpreter_says_how_to_switch_it_on(monkeypatch):
    monkeypatch.setattr(bg, "TRITON_INTERPRETED", False)
    kit = bg.toolchain("cpu")
    assert "TRITON_INTERPRET=1" in kit.triton_why_not and kit.triton_dtypes == ()


def test_without_triton_the_kernel_cell_runs_and_every_triton_path_says_why(monkeypatch, capsys):
    monkeypatch.setattr(bg, "triton", None)
    kit = bg.toolchain("cpu")
    assert kit.triton_why_not == bg.TRITON_MISSING
    triton, tl = bg.import_triton()

    @triton.autotune(configs=bg.triton_configs(), key=["n"])
    @triton.jit
    def kernel(x_ptr, n, BLOCK: tl.constexpr):  # a kernel cell, as the notebook has it
        pass

    assert isinstance(kernel, bg.MissingKernel) and bg.triton_configs() == []
    with pytest.raises(RuntimeError, match="Triton is not installed"):
        kernel[(1,)](None, 1)
    result = bg.register_triton(kernel, kit)
    assert not result.available and result.launch is None and result.op is None
    assert "Triton kernel: skipped, Triton is not installed" in capsys.readouterr().out


def test_no_compiler_no_ninja_no_nvcc_are_each_named(monkeypatch, tmp_path):
    _not_built(monkeypatch, tmp_path)
    monkeypatch.setattr(extension, "find_cxx", lambda: None)
    kit = bg.toolchain("cpu")
    assert "no C++ compiler" in kit.cpp_why_not and "C++ compiler" in kit.compile_why_not
    monkeypatch.setattr(extension, "find_cxx", lambda: "/usr/bin/c++")
    monkeypatch.setattr(extension, "find_ninja", lambda: None)
    assert "pip install ninja" in bg.toolchain("cpu").cpp_why_not
    monkeypatch.setattr(extension, "find_ninja", lambda: "/usr/bin/ninja")
    assert bg.toolchain("cpu").cpp_why_not is None
    import utils.env

    monkeypatch.setattr(utils.env, "find_nvcc", lambda: None)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert "no nvcc" in extension.why_not_buildable(cuda=True)
    monkeypatch.setattr(torch.version, "cuda", None)
    assert "without CUDA" in extension.why_not_buildable(cuda=True)
    assert extension.why_not_buildable(cuda=False) is None


def test_an_earlier_build_needs_no_tools(cpu_ext, monkeypatch):
    monkeypatch.setattr(extension, "find_cxx", lambda: None)
    monkeypatch.setattr(extension, "find_ninja", lambda: None)
    assert bg.toolchain("cpu").cpp_why_not is None


def test_build_cpp_skips_with_the_reason_and_build_refuses_early(monkeypatch, tmp_path, capsys):
    _not_built(monkeypatch, tmp_path)
    monkeypatch.setattr(extension, "find_ninja", lambda: None)
    kit = bg.toolchain("cpu")
    result = bg.build_cpp(kit)
    assert not result.available and result.launch is None and "ninja" in result.why_not
    assert "C++ (cpu): skipped, no ninja" in capsys.readouterr().out
    spec = extension.ExtensionSpec("course_never_built", bg.CPU_SOURCES, bg.HEADERS[:1])
    with pytest.raises(RuntimeError, match="cannot build course_never_built here: no ninja"):
        extension.build(spec, root=tmp_path)


def test_ninja_beside_this_python_is_found(monkeypatch, tmp_path):
    """pip install ninja puts it in the environment's bin/, which is not on PATH unless the venv is activated."""
    (tmp_path / "ninja").write_text("#!/bin/sh\n")
    monkeypatch.setattr(extension.shutil, "which", lambda name: None)
    monkeypatch.setattr(extension.sys, "executable", str(tmp_path / "python"))
    assert extension.find_ninja() == str(tmp_path / "ninja")
    (tmp_path / "ninja").unlink()
    assert extension.find_ninja() is None


@pytest.mark.parametrize(("cc", "dtypes", "dtype", "why"), [
    ((9, 0), DTYPES, torch.bfloat16, None),
    ((7, 5), [torch.float32, torch.float16], torch.float16, None),  # a T4: no bf16 in Triton, fp16 activations
    ((6, 1), [], torch.float16, "compute capability 7.0"),
])
def test_toolchain_on_gpus_by_compute_capability(monkeypatch, tmp_path, cc, dtypes, dtype, why):
    _not_built(monkeypatch, tmp_path)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc)
    monkeypatch.setattr(bg, "TRITON_INTERPRETED", False)
    kit = bg.toolchain(torch.device("cuda"))
    assert list(kit.triton_dtypes) == dtypes and kit.dtype == dtype and kit.cpp_kind == "cuda"
    assert kit.triton_why_not is None if why is None else why in kit.triton_why_not
    assert (kit.compile_why_not is None) == (why is None)


def test_check_kernel_fails_on_a_wrong_kernel_and_on_nothing_to_check():
    with pytest.raises(ValueError, match="differs from the float32 reference in torch.float32"):
        bg.check_kernel(lambda x, b: torch.relu(x + b), "cpu", [torch.float32], name="wrong")
    with pytest.raises(ValueError, match="no dtype to check"):
        bg.check_kernel(bg.reference, "cpu", [])
    rows = bg.check_kernel(bg.reference, "cpu", [torch.float32], shape=(37, 29))
    assert rows[0]["dtype"] == "float32" and rows[0]["aligned + offset"] == "✓"


def test_check_outputs_names_the_variant_that_differs():
    x, b = make_inputs((64, 48), torch.bfloat16)
    text = bg.check_outputs({"eager": lambda: bg.reference(x, b)}, x, b, roundings={"eager": 2})
    assert text.startswith("All 1 match")
    with pytest.raises(ValueError, match="eager differs"):  # two roundings do not pass the tolerance of one
        bg.check_outputs({"eager": lambda: bg.reference(x, b) * 1.01}, x, b)


def test_traffic_and_how_a_speedup_splits_into_bytes_and_rate():
    x, b = make_inputs((1000, 100))
    t = bg.traffic(x, b)
    assert t.eager_bytes == bg.eager_bytes_moved(x, b) and t.fused_bytes == bg.bytes_moved(x, b)
    assert "add → gelu" in str(t) and f"{t.ratio:.2f}× fewer bytes" in str(t)
    # eager 4 s per call, the kernel 1 s: 4× = the byte ratio (~2×) × the rest (~2×); rates against a limit
    cmp = Comparison.from_rounds({"eager": [4.0] * 6, "k": [1.0] * 6}, work=None)
    cmp = Comparison(cmp.timings, "eager", work=bg_work(t.fused_bytes), limit=t.fused_bytes / 1e9)
    text = t.parts(cmp, "k")
    assert text.startswith(f"k: 4.00× eager = {t.ratio:.2f}× fewer bytes × {4 / t.ratio:.2f}× the rate")
    assert "it streams at 100% of copy bandwidth, eager's kernels at" in text
    amp = bg.traffic(x.bfloat16(), b, autocast=torch.bfloat16)
    assert [op["output dtype"] for op in amp.ops] == ["float32", "float32"] and amp.ratio > 3


def bg_work(nbytes):
    from utils.bench import Work

    return Work(nbytes, "bytes")


def test_issue_budget():
    # 2 SMs × 4 × 32 at 1 GHz = 256e9 instructions/s; 16 GB/s moves 4e9 bf16 elements (2 × 2 bytes): 64
    assert bg.issue_budget(2, 1000.0, 16.0, 2) == pytest.approx(64)


def test_the_lesson_shows_the_rows_kernel():
    text = bg.cuda_excerpt()
    assert text.lstrip().startswith("template <typename T, int VEC, Math M>") and "bias_gelu_rows_kernel" in text
    assert "[end lesson]" not in text and "bias_gelu_flat_kernel" not in text


def test_notebook_kernel_is_this_modules_kernel():
    """Notebook 06 defines the Triton kernel inline for the reader to edit; this module keeps the same code so that
    these tests (and ncu's child process) test what the lesson shows (d2l's #@save)."""
    import nbformat

    nb = nbformat.read(bg.REPO_ROOT / "notebooks" / "06_custom_kernels.ipynb", as_version=4)
    cell = next(c.source for c in nb.cells if c.cell_type == "code" and "def bias_gelu_kernel(" in c.source)
    ours = bg.source_of(bg.bias_gelu_kernel)
    assert cell[cell.index("def bias_gelu_kernel("):].strip() == ours[ours.index("def bias_gelu_kernel("):].strip()


def test_eager_error_names_the_reference_itself():
    import torch

    from utils import bias_gelu as bg

    ref = torch.ones(4)
    assert bg._eager_error(ref.clone(), ref) == "0 (the reference)"
    assert bg._eager_error(ref + 2e-3, ref) == "2.0e-03"
