"""Where the course runs: device choice, what the device can do, and a one-call environment report.

Every notebook starts with ``device = utils.env.get_device()`` and sizes its work with
``utils.env.by_device(device, cpu=..., cuda=...)``, so the same cells run on a laptop CPU, a Colab T4 and an H100.
"""

from __future__ import annotations

import os
import platform
import random
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import TypeVar

import torch

T = TypeVar("T")

#: Set COURSE_DEVICE=cpu to run the course on the CPU of a GPU machine (or cuda:1 to pick a GPU).
DEVICE_ENV_VAR = "COURSE_DEVICE"


def in_colab() -> bool:
    """True inside a Google Colab runtime (Colab's kernel imports ``google.colab`` at start)."""
    return "google.colab" in sys.modules


def get_device(preferred: str | torch.device | None = None) -> torch.device:
    """The device the course computes on.

    ``preferred`` (or the environment variable ``COURSE_DEVICE``) may be ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
    Without either, the current CUDA GPU is used when PyTorch sees one, otherwise the CPU.

    Raises:
        ValueError: for a device string PyTorch does not know, a type the course does not support, or a GPU
            index that does not exist.
        RuntimeError: when CUDA is asked for but PyTorch sees no GPU (the message says why).
    """
    choice = preferred if preferred is not None else (os.environ.get(DEVICE_ENV_VAR) or None)
    if choice is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    try:
        device = torch.device(choice)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"unknown device {choice!r}: expected 'cpu', 'cuda' or 'cuda:N'") from err
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"device {choice!r} is not supported by this course: use 'cpu', 'cuda' or 'cuda:N'")
    if not torch.cuda.is_available():
        raise RuntimeError(f"device {choice!r} was asked for, but PyTorch sees no CUDA GPU: {why_no_cuda()}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise ValueError(f"cuda:{index} does not exist: PyTorch sees {torch.cuda.device_count()} GPU(s)")
    return torch.device("cuda", index)


def by_device(device: torch.device | str, *, cpu: T, cuda: T) -> T:
    """Pick a size (or any setting) for the device: small on CPU so CI stays fast, full size on a GPU."""
    return cuda if torch.device(device).type == "cuda" else cpu


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's (if installed) and PyTorch's generators (CPU and every GPU)."""
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover - numpy is in requirements.txt
        pass
    torch.manual_seed(seed)


def synchronize(device: torch.device | str) -> None:
    """Wait for all queued work on ``device`` (a no-op on CPU, where work is synchronous)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def nvidia_smi_driver() -> str | None:
    """The NVIDIA driver version that ``nvidia-smi`` reports, or None without one (10 s timeout)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()
    except (subprocess.SubprocessError, OSError):
        return None
    return out.splitlines()[0].strip() if out else None


def why_no_cuda() -> str:
    """One sentence on why PyTorch sees no GPU, and what to do about it."""
    if torch.version.cuda is None:
        return ("this PyTorch is a CPU-only build (torch.version.cuda is None): reinstall a CUDA build, "
                "e.g. `pip install torch --index-url https://download.pytorch.org/whl/cu128`")
    if in_colab():
        return "this Colab runtime has no GPU: Runtime → Change runtime type → a GPU (e.g. T4), then rerun"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU from this process"
    driver = nvidia_smi_driver()
    if driver is None:
        return ("no NVIDIA driver answered (`nvidia-smi` is missing or failed): this machine has no usable "
                "NVIDIA GPU, or its driver is not installed")
    return (f"the NVIDIA driver {driver} is installed but CUDA failed to initialise; a driver too old for this "
            f"PyTorch's CUDA {torch.version.cuda} is the usual cause: update the driver or install a torch "
            "built for an older CUDA")


@dataclass(frozen=True)
class Capabilities:
    """What one device can do, as the course's notebooks need to know it."""

    device: str
    name: str
    compute_capability: tuple[int, int] | None
    sm_count: int | None
    total_memory_bytes: int | None
    l2_cache_bytes: int | None
    bf16: bool  # native bf16 arithmetic (Ampere+); CPU autocast also runs bf16, usually slowly
    tf32: bool  # TF32 tensor cores for fp32 matmuls (Ampere+)
    fp8: bool  # fp8 tensor cores (Ada / Hopper+)
    flash_attention: bool  # SDPA's FlashAttention backend
    mem_efficient_attention: bool  # SDPA's memory-efficient backend
    triton: bool  # Triton can compile for this device (on CPU: only its interpreter, TRITON_INTERPRET=1)
    nvcc: str | None  # path of nvcc, which custom CUDA C++ extensions need
    cxx: str | None  # path of a C++ compiler, which any C++ extension (and torch.compile on CPU) needs

    @property
    def arch(self) -> str | None:
        """``sm_XY`` for a GPU (what TORCH_CUDA_ARCH_LIST and nvcc call it), None on CPU."""
        if self.compute_capability is None:
            return None
        return f"sm_{self.compute_capability[0]}{self.compute_capability[1]}"


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def find_nvcc() -> str | None:
    """The nvcc that torch.utils.cpp_extension would use (CUDA_HOME first, then PATH), or None."""
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux), else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def capabilities(device: torch.device | str | None = None) -> Capabilities:
    """Read the capabilities of ``device`` (default: ``get_device()``) off the hardware and this PyTorch build."""
    device = get_device(device)
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")
    if device.type == "cpu":
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = None
        return Capabilities(
            device="cpu", name=cpu_name(), compute_capability=None, sm_count=None, total_memory_bytes=total,
            l2_cache_bytes=None, bf16=True, tf32=False, fp8=False, flash_attention=False,
            mem_efficient_attention=False, triton=False, nvcc=find_nvcc(), cxx=cxx,
        )
    props = torch.cuda.get_device_properties(device)
    cc = (props.major, props.minor)
    flash_built = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)()
    return Capabilities(
        device=str(device), name=props.name, compute_capability=cc, sm_count=props.multi_processor_count,
        total_memory_bytes=props.total_memory, l2_cache_bytes=getattr(props, "L2_cache_size", None),
        bf16=cc >= (8, 0), tf32=cc >= (8, 0), fp8=cc >= (8, 9),
        flash_attention=bool(flash_built) and cc >= (8, 0), mem_efficient_attention=cc >= (5, 0),
        triton=_triton_importable() and cc >= (7, 0), nvcc=find_nvcc(), cxx=cxx,
    )


def device_slug(device: torch.device | str | None = None) -> str:
    """A short file-name-safe name for the device's model: 'h100', 'a100', 't4', 'rtx-4090', or 'cpu'.

    The reference-run tool names ``results/<slug>.json`` with it.
    """
    device = get_device(device)
    if device.type == "cpu":
        return "cpu"
    return gpu_slug(torch.cuda.get_device_name(device))


def gpu_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' → 'h100', 'Tesla T4' → 't4', 'NVIDIA GeForce RTX 4090' → 'rtx-4090'."""
    words = [w for w in re.split(r"[\s_-]+", name.strip()) if w]
    words = [w for w in words if w.lower() not in {"nvidia", "geforce", "tesla", "quadro"}]
    if not words:
        return "gpu"
    keep = words[:2] if words[0].lower() in {"rtx", "gtx"} and len(words) > 1 else words[:1]
    return re.sub(r"[^a-z0-9-]", "", "-".join(keep).lower()) or "gpu"


def _mark(flag: bool) -> str:
    return "yes" if flag else "no"


def report(device: torch.device | str | None = None) -> str:
    """A few lines on versions, the device and its capabilities: what every notebook prints first."""
    from utils.memory import format_bytes  # local import: memory imports nothing from env, keep it so

    device = get_device(device)
    caps = capabilities(device)
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    lines = [
        f"Python {platform.python_version()} · PyTorch {torch.__version__} · "
        f"CUDA build {torch.version.cuda or 'none (CPU-only build)'} · cuDNN {cudnn or 'n/a'}",
    ]
    if device.type == "cuda":
        lines.append(
            f"Device {device}: {caps.name} · {caps.arch} · {caps.sm_count} SMs · "
            f"{format_bytes(caps.total_memory_bytes or 0)} · L2 {format_bytes(caps.l2_cache_bytes or 0)} · "
            f"driver {nvidia_smi_driver() or 'unknown'} · {torch.cuda.device_count()} GPU(s) visible"
        )
        lines.append(
            f"bf16 {_mark(caps.bf16)} · TF32 {_mark(caps.tf32)} · fp8 {_mark(caps.fp8)} · "
            f"flash SDPA {_mark(caps.flash_attention)} · Triton {_mark(caps.triton)} · "
            f"nvcc {_mark(caps.nvcc is not None)}"
        )
    else:
        lines.append(
            f"Device cpu: {caps.name} · {os.cpu_count()} cores, torch uses {torch.get_num_threads()} threads · "
            f"{format_bytes(caps.total_memory_bytes or 0)} RAM"
        )
        lines.append(f"No CUDA GPU: {why_no_cuda()}. GPU-only cells run their CPU counterpart or say why not.")
    if in_colab():
        lines.append("Running on Google Colab.")
    return "\n".join(lines)


def print_report(device: torch.device | str | None = None) -> None:
    """Print :func:`report` (the setup cell of every notebook calls this)."""
    print(report(device))
