"""utils.bias_gelu: bad inputs fail clearly on every entry point, good inputs give the reference's answer, the
autograd formula matches PyTorch's, the operators pass opcheck, and the build machinery (per-source directories,
stale locks, the deadline) works. Everything here runs on CPU; tests marked for a GPU run where CUDA is.

The CPU extension is built once into the repository's build/ folder (notebook 06 reuses it): about 10 s on a
2-core machine the first time, milliseconds afterwards.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from utils import bias_gelu as bg
from utils.env import find_nvcc

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
needs_nvcc = pytest.mark.skipif(find_nvcc() is None or torch.version.cuda is None,
                                reason="needs nvcc and a CUDA build of torch")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="session")
def cpu_ext():
    """The CPU extension, built (or found built) once per test session."""
    return bg.build_extension("cpu")


def make_inputs(shape, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(device, dtype)
    bias = torch.randn(shape[-1] if shape else 1, generator=gen).to(device, dtype)
    return x, bias


def assert_matches_reference(out, x, bias):
    assert out.shape == x.shape and out.dtype == x.dtype and out.device == x.device
    torch.testing.assert_close(out.float(), bg.reference(x.float(), bias.float()), **bg.tolerance(x.dtype))


# ── Bad inputs: a clear error, never garbage ────────────────────────────────────────────────────────────────


def _bad_inputs():
    x, b = make_inputs((29, 37))
    return {
        "float64": ((x.double(), b.double()), TypeError, "float32, float16 or bfloat16"),
        "int64": ((x.long(), b.long()), TypeError, "float32, float16 or bfloat16"),
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


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_bad_inputs_raise_clear_errors(entry, case):
    args, error, message = BAD[case]
    if case == "x not a tensor" and "op" in entry:  # the operator's schema rejects it before our checks
        error, message = RuntimeError, "Expected a value of type 'Tensor'"
    with pytest.raises(error, match=message):
        ENTRY_POINTS[entry](*args)


def test_cpu_tensor_to_the_cuda_kernel_is_refused_before_any_build():
    x, b = make_inputs((4, 8))
    with pytest.raises(ValueError, match="needs cuda tensors, got x on cpu"):
        bg.bias_gelu_cuda(x, b)


@pytest.mark.skipif(CUDA, reason="on a GPU the Triton kernel compiles for CUDA tensors")
def test_cpu_tensor_to_compiled_triton_says_how_to_interpret():
    x, b = make_inputs((4, 8))
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        bg.bias_gelu_triton_launch(x, b)


@pytest.mark.parametrize("case", [c for c in BAD if c != "x not a tensor"])
def test_cpp_kernel_checks_its_own_inputs(cpu_ext, case):
    """The C++ TORCH_CHECKs guard callers that go straight to torch.ops.course_ext."""
    args, _, _ = BAD[case]
    with pytest.raises(RuntimeError, match="bias_gelu_cpu: "):
        torch.ops.course_ext.bias_gelu_cpu(*args)


def test_cpp_kernel_refuses_another_device(cpu_ext):
    x, b = make_inputs((4, 8))
    with pytest.raises(RuntimeError, match="expected x and bias on one CPU device, got x on meta"):
        torch.ops.course_ext.bias_gelu_cpu(x.to("meta"), b.to("meta"))


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


def test_tolerance_is_stated_per_dtype():
    assert bg.tolerance(torch.float32) == {"rtol": 1e-5, "atol": 1e-6}
    assert bg.tolerance(torch.bfloat16)["rtol"] == torch.finfo(torch.bfloat16).eps
    with pytest.raises(ValueError):
        bg.tolerance(torch.float64)


def test_bytes_moved():
    x, b = make_inputs((10, 4), torch.float16)
    assert bg.bytes_moved(x, b) == (2 * 40 + 4) * 2
    assert bg.eager_bytes_moved(x, b) == (4 * 40 + 4) * 2


# ── Operators: autograd, opcheck ────────────────────────────────────────────────────────────────────────────


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
    for shape, grad in (((8, 16), True), ((2, 3, 5), False)):
        x, b = make_inputs(shape)
        torch.library.opcheck(bg.bias_gelu_cpp, (x.requires_grad_(grad), b.requires_grad_(grad)))


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
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=bg.REPO_ROOT, capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONPATH": str(bg.REPO_ROOT)})
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


# ── Building: directories, stale locks, deadline ───────────────────────────────────────────────────────────


def test_build_directory_changes_with_sources_and_arch(tmp_path):
    spec = bg.extension_spec("cuda", arch="9.0")
    assert bg.build_directory(spec, tmp_path) == bg.build_directory(dict(spec), tmp_path)
    assert bg.build_directory({**spec, "arch": "8.0"}, tmp_path) != bg.build_directory(spec, tmp_path)
    edited = {**spec, "cuda_sources": [spec["cuda_sources"][0] + "// edited\n"]}
    assert bg.build_directory(edited, tmp_path) != bg.build_directory(spec, tmp_path)
    assert bg.build_directory(spec, tmp_path).name.startswith("bias_gelu_cuda_ext-")


def test_build_guard_removes_a_stale_lock_and_excludes_other_builds(tmp_path):
    assert not (tmp_path / "lock").exists()
    with bg.build_guard(tmp_path) as removed:
        assert not removed  # nothing to remove
    (tmp_path / "lock").touch()  # what a build killed half-way leaves behind
    with bg.build_guard(tmp_path) as removed:
        assert removed and not (tmp_path / "lock").exists()
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="another build"), bg.build_guard(tmp_path, timeout_s=0.3):
            pass  # a second build of the same directory must wait for the first
        assert time.monotonic() - start < 5
    with bg.build_guard(tmp_path, timeout_s=0.3):  # the first one finished: free again
        pass


def test_build_guard_is_released_when_its_holder_dies(tmp_path):
    holder = (f"import fcntl, time; f = open({str(tmp_path / 'build.flock')!r}, 'w'); "
              "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(TimeoutError), bg.build_guard(tmp_path, timeout_s=0.3):
            pass
    finally:
        proc.kill()  # SIGKILL: no cleanup code runs, the kernel drops the OS lock
        proc.wait()
    with bg.build_guard(tmp_path, timeout_s=2):
        pass


def test_deadline_kills_the_whole_process_group(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    child = (f"import subprocess, time; p = subprocess.Popen(['sleep', '60']); "
             f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="killed with its children"):
        bg.run_with_deadline([sys.executable, "-c", child], timeout_s=1.5, log_path=tmp_path / "log")
    assert time.monotonic() - start < 10
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # the grandchild (think: nvcc) must be gone too, not only the Python child
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"grandchild {grandchild} survived the deadline")
    assert bg.run_with_deadline([sys.executable, "-c", "print('hi')"], timeout_s=30, log_path=tmp_path / "l2") == 0
    assert (tmp_path / "l2").read_text().strip() == "hi"


def test_stale_lock_does_not_hang_the_next_build(cpu_ext, capsys):
    """An interrupted build's lock in the real build directory: the next build removes it and finishes."""
    spec = bg.extension_spec("cpu")
    directory = bg.build_directory(spec)
    (directory / "lock").touch()
    bg._build_in_child(spec, directory, timeout_s=120)  # up to date: ninja has nothing to do
    assert "removed a stale lock" in capsys.readouterr().out


def test_a_running_build_is_waited_for_only_until_the_deadline(cpu_ext, tmp_path):
    spec = bg.extension_spec("cpu")
    start = time.monotonic()
    # another build of this directory is running (this process holds the guard): the child waits, then is killed
    with bg.build_guard(tmp_path), pytest.raises(TimeoutError, match="did not finish within 6 s") as caught:
        bg._build_in_child(spec, tmp_path, timeout_s=6)
    assert time.monotonic() - start < 30
    if "waiting for another build" in (tmp_path / "build.log").read_text():  # the child got that far (not on a
        assert "waiting for another build" in str(caught.value)  # loaded machine, where importing takes longer)


@needs_nvcc
def test_cuda_extension_compiles_and_checks_devices():
    """nvcc compiles the CUDA source without a GPU too; its TORCH_CHECK refuses CPU tensors."""
    bg.build_extension("cuda", arch=bg.cuda_arch_list() if CUDA else "8.0")
    x, b = make_inputs((4, 8))
    with pytest.raises(RuntimeError, match="bias_gelu_cuda: expected x and bias on one CUDA device, got x on cpu"):
        torch.ops.course_ext.bias_gelu_cuda(x, b)


# ── On a GPU ────────────────────────────────────────────────────────────────────────────────────────────────


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("entry", ["cuda", "triton"])
def test_gpu_kernels_match_reference(entry, dtype):
    launch = bg.bias_gelu_cuda if entry == "cuda" else bg.bias_gelu_triton_launch
    for shape in [(1823, 781), (1, 1), (3, 5, 8)]:
        x, b = make_inputs(shape, dtype, "cuda")
        assert_matches_reference(launch(x, b), x, b)
    offset = torch.empty(1 + 1823 * 781, device="cuda", dtype=dtype)[1:].view(1823, 781)
    offset.copy_(torch.randn(1823, 781, device="cuda"))  # 1 element into its allocation: not 16-byte aligned
    b = torch.randn(781, device="cuda").to(dtype)
    assert_matches_reference(launch(offset, b), offset, b)
    assert launch(*make_inputs((0, 781), dtype, "cuda")).shape == (0, 781)


@needs_cuda
def test_gpu_bad_devices():
    x, b = make_inputs((4, 8), device="cuda")
    with pytest.raises(ValueError, match="one device"):
        bg.bias_gelu_cpp(x, b.cpu())
    bg.build_extension("cuda", arch=bg.cuda_arch_list())
    with pytest.raises(RuntimeError, match="expected x and bias on one CUDA device"):
        torch.ops.course_ext.bias_gelu_cuda(x, b.cpu())


@needs_cuda
@pytest.mark.parametrize("op", [bg.bias_gelu_cpp, bg.bias_gelu_triton], ids=["cpp", "triton"])
def test_gpu_ops_pass_opcheck(op):
    for dtype, grad in ((torch.float32, True), (torch.bfloat16, False)):
        x, b = make_inputs((8, 40), dtype, "cuda")
        torch.library.opcheck(op, (x.requires_grad_(grad), b.requires_grad_(grad)))
