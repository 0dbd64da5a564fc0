"""Where the course runs: device choice, what the device can do, a one-call environment report, whether this
PyTorch build carries code for the GPU (:func:`arch_support`), what to fix in an install (:func:`install_findings`),
and readings taken off the GPU while it works (SM clock, board power, why the clock is held back, the PCIe link).

Every notebook starts with ``device = utils.env.get_device()`` and sizes its work with
``utils.env.by_device(device, cpu=..., cuda=...)``, so the same cells run on a laptop CPU, a Colab T4 and an H100.
"""

from __future__ import annotations

import contextlib
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar

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


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity (``taskset``, a container's cpuset), not the machine's count.

    ``os.cpu_count()`` counts the machine's CPUs; a DataLoader that starts that many workers on 2 allowed cores
    oversubscribes them (and PyTorch warns that it "will create 8 worker processes ... suggested max ... is 2").
    """
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


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

    def why_not(self, precision: str) -> str | None:
        """Why a matmul in ``precision`` ("fp32", "tf32", "fp16", "bf16") is not worth measuring here, or None.

        TF32 needs the tensor cores of Ampere (sm_80) or newer; a CPU has none. bf16 on a GPU before Ampere has no
        tensor-core support: PyTorch would emulate it slowly. A CPU runs fp16 and bf16 (slowly without
        AVX512-BF16 or AMX), so they are measured there, at a smaller size.

        Raises:
            ValueError: for another precision.
        """
        if precision not in ("fp32", "tf32", "fp16", "bf16"):
            raise ValueError(f"precision must be fp32, tf32, fp16 or bf16, got {precision!r}")
        here = "a CPU" if self.compute_capability is None else f"{self.name} ({self.arch})"
        if precision == "tf32" and not self.tf32:
            return f"{here} has no TF32 tensor cores (Ampere, sm_80, or newer GPUs have them)"
        if precision == "bf16" and not self.bf16:
            return f"{here} has no bf16 tensor cores (before Ampere, sm_80): PyTorch would emulate bf16 slowly"
        return None


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


def triton_version() -> str | None:
    """The installed Triton's version (``triton`` or the nightlies' ``pytorch-triton``), or None; without importing
    it (on a CPU, TRITON_INTERPRET=1 must be set before the first import)."""
    from importlib import metadata

    for package in ("triton", "pytorch-triton"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(package)
    return None


def capability_rows(caps: Capabilities) -> list[dict[str, str]]:
    """The capabilities of one device as table rows: whether it has each, what each needs, where the course uses
    it (what notebook 00 prints)."""
    gpu = caps.compute_capability is not None

    def here(flag: bool, detail: str | None = None) -> str:
        return ("yes" if flag else "no") + (f" ({detail})" if detail else "")

    triton = triton_version()
    triton_note = (triton if caps.triton else "pip install triton" if triton is None
                   else "needs sm_70 or newer" if gpu else "on a CPU its interpreter only: TRITON_INTERPRET=1")
    return [
        {"capability": "bf16", "here": here(caps.bf16, None if gpu else "CPU autocast, fast with AVX512-BF16 or AMX"),
         "needs": "Ampere (sm_80) or newer for fast bf16", "used in": "03 mixed precision, 04 compile"},
        {"capability": "TF32 matmul", "here": here(caps.tf32), "needs": "Ampere or newer tensor cores",
         "used in": "00, 03"},
        {"capability": "fp8 tensor cores", "here": here(caps.fp8), "needs": "Ada (sm_89), Hopper (sm_90) or newer",
         "used in": "03 number formats"},
        {"capability": "flash SDPA", "here": here(caps.flash_attention), "needs": "sm_80+ and a build with it",
         "used in": "attention (07, 08, 09)"},
        {"capability": "memory-efficient SDPA", "here": here(caps.mem_efficient_attention), "needs": "a CUDA GPU",
         "used in": "attention (07, 08, 09)"},
        {"capability": "Triton (compiled)", "here": here(caps.triton, triton_note),
         "needs": "a GPU of compute capability 7.0+", "used in": "04 compile, 06 custom kernels"},
        {"capability": "nvcc", "here": here(caps.nvcc is not None, caps.nvcc or "no CUDA toolkit found"),
         "needs": "the CUDA toolkit", "used in": "06 CUDA C++ extension"},
        {"capability": "C++ compiler", "here": here(caps.cxx is not None, caps.cxx or "none on PATH"),
         "needs": "g++ or clang", "used in": "06 extensions, compile on CPU"},
    ]


# ── Does this build run on this GPU? CUDA's compatibility rules ─────────────────────────────────────────────

#: Compute capabilities of Tegra (Jetson, Thor) GPUs: cubins are binary-compatible across minor versions only among
#: discrete GPUs, not for Tegra, nor between Tegra and discrete GPUs (CUDA C++ Programming Guide, "Binary
#: Compatibility"). Thor was sm_101 before CUDA 13 renamed it sm_110.
TEGRA_CAPABILITIES = frozenset({(3, 2), (5, 3), (6, 2), (7, 2), (8, 7), (10, 1), (11, 0)})

_ARCH_ENTRY = re.compile(r"^(sm|compute)_(\d+)(\d)([af]?)$")

ArchKind = Literal["native", "binary-compatible", "PTX JIT", "unsupported"]


def parse_arch(entry: str) -> tuple[str, tuple[int, int], str]:
    """An entry of ``torch.cuda.get_arch_list()``: 'sm_86' → ('sm', (8, 6), ''), 'compute_90' → ('compute', (9, 0),
    ''), 'sm_100a' → ('sm', (10, 0), 'a'). ``sm`` is machine code (a cubin), ``compute`` PTX; the suffix ``a``
    marks arch-specific code (runs on that capability only), ``f`` family-specific code (CUDA 12.9+).

    Raises:
        ValueError: for anything else.
    """
    found = _ARCH_ENTRY.match(entry.strip()) if isinstance(entry, str) else None
    if found is None:
        raise ValueError(f"not a CUDA architecture like 'sm_86' or 'compute_90': {entry!r}")
    kind, major, minor, suffix = found.groups()
    return kind, (int(major), int(minor)), suffix


@dataclass(frozen=True)
class ArchSupport:
    """How a PyTorch build runs on one GPU architecture: ``kind``, the entry of the arch list that serves it
    (``via``), and the reason in words. Build it with :func:`arch_support`."""

    arch: str
    kind: ArchKind
    via: str | None
    reason: str

    @property
    def runs(self) -> bool:
        """Whether the build runs on this GPU at all (natively, through a compatible cubin, or by JIT)."""
        return self.kind != "unsupported"

    def __str__(self) -> str:
        return f"{self.arch}: {self.kind}, {self.reason}"


def _ptx_serves(ptx: tuple[int, int], suffix: str, gpu: tuple[int, int]) -> bool:
    if suffix == "a":  # arch-specific PTX: that capability only
        return ptx == gpu
    if suffix == "f":  # family-specific PTX: the same major version
        return ptx[0] == gpu[0] and ptx[1] <= gpu[1]
    return ptx <= gpu


def arch_support(arch: str | tuple[int, int], arch_list: Sequence[str]) -> ArchSupport:
    """Whether a build whose ``torch.cuda.get_arch_list()`` is ``arch_list`` runs on a GPU of ``arch`` (``"sm_89"``
    or ``(8, 9)``), and how, by CUDA's compatibility rules (CUDA C++ Programming Guide, "Binary Compatibility" and
    "Application Compatibility"):

    * **native**: the list has machine code (a cubin) for this capability: ``sm_89`` (or ``sm_90a`` on a 9.0 GPU).
    * **binary-compatible**: a cubin of the same major version and a lower minor one. A cubin for ``sm_8x`` runs
      on ``sm_8y`` for every y ≥ x, so a build with ``sm_86`` runs on an RTX 4090 or an L4 (``sm_89``). Never
      across major versions, not for Tegra GPUs (:data:`TEGRA_CAPABILITIES`), and never from an arch-specific
      cubin (``sm_90a``). The build's own kernels then use only what 8.6 has (no fp8); cuBLAS and cuDNN ship
      kernels of their own for each GPU.
    * **PTX JIT**: a ``compute_XY`` entry (PTX, a virtual instruction set) of this capability or an older one. The
      driver compiles it for this GPU at first use: a slow first start (minutes for all of PyTorch's kernels),
      cached afterwards (``~/.nv/ComputeCache``).
    * **unsupported**: none of these. Kernels then fail with "no kernel image is available for execution on the
      device": install a build that lists this GPU.

    The best entry serves: the native cubin, else the newest compatible cubin, else the newest usable PTX.

    Raises:
        ValueError: for an arch or a list entry that is not ``sm_XY`` / ``compute_XY`` (optionally with a suffix
            ``a`` or ``f``).
    """
    gpu = arch if isinstance(arch, tuple) else parse_arch(arch)[1]
    name = f"sm_{gpu[0]}{gpu[1]}"
    entries = [(entry, *parse_arch(entry)) for entry in arch_list]
    if not entries:
        return ArchSupport(name, "unsupported", None,
                           "this build carries no GPU code (a CPU-only build): install a CUDA build of PyTorch")
    cubins = [(cc, entry, suffix) for entry, kind, cc, suffix in entries if kind == "sm"]
    native = [entry for cc, entry, _ in cubins if cc == gpu]
    if native:
        return ArchSupport(name, "native", native[0], f"this build carries machine code for {name}")
    discrete = gpu not in TEGRA_CAPABILITIES
    compatible = [(cc, entry) for cc, entry, suffix in cubins
                  if discrete and suffix != "a" and cc not in TEGRA_CAPABILITIES and cc[0] == gpu[0] and cc[1] < gpu[1]]
    if compatible:
        cc, entry = max(compatible)
        return ArchSupport(name, "binary-compatible", entry,
                           f"it runs the {entry} machine code (a cubin for {cc[0]}.{cc[1]} runs on every {cc[0]}.x "
                           f"GPU with x ≥ {cc[1]}); this build's own kernels use only what {entry} has")
    ptx = [(cc, entry) for entry, kind, cc, suffix in entries if kind == "compute" and _ptx_serves(cc, suffix, gpu)]
    if ptx:
        cc, entry = max(ptx)
        return ArchSupport(name, "PTX JIT", entry,
                           f"no machine code for {name}, but the driver compiles the {entry} PTX for it at first use "
                           "(slow the first time, cached afterwards)")
    listed = " ".join(arch_list)
    if all(cc > gpu for cc, _, _ in cubins):
        advice = f"this build's GPUs are all newer than {name}: an older PyTorch release may still list it"
    else:
        advice = (f"no cubin for {gpu[0]}.x with x ≤ {gpu[1]} and no PTX for {gpu[0]}.{gpu[1]} or older: install a "
                  f"build that lists {name} (pytorch.org/get-started/locally)")
    return ArchSupport(name, "unsupported", None, f"{advice} (this build: {listed})")


def install_findings(device: torch.device | str | None = None, arch_list: Sequence[str] | None = None) -> list[str]:
    """What to fix in this install before the course, one sentence each with what to do; empty when nothing.

    Looks at the build (CPU-only?), whether a GPU is seen, whether this build runs on it (:func:`arch_support`, with
    ``arch_list`` defaulting to ``torch.cuda.get_arch_list()``), bf16, Triton, nvcc and a C++ compiler. Shortfalls
    that need a measurement (a rate far under the datasheet) are for the caller to add.
    """
    device = get_device(device)
    caps = capabilities(device)
    found = []
    if torch.version.cuda is None:
        found.append("This PyTorch is a CPU-only build. Install a CUDA build: `pip install torch --index-url "
                     "https://download.pytorch.org/whl/cu128` (pick yours at pytorch.org/get-started/locally).")
    elif device.type == "cpu" and torch.cuda.is_available():
        found.append(f"{DEVICE_ENV_VAR}=cpu keeps the course on the CPU, though PyTorch sees "
                     f"{torch.cuda.device_count()} GPU(s): unset it to use the GPU.")
    elif device.type == "cpu":
        found.append(f"PyTorch is a CUDA {torch.version.cuda} build but sees no GPU: {why_no_cuda()}.")
    if device.type == "cuda":
        support = arch_support(caps.arch, torch.cuda.get_arch_list() if arch_list is None else arch_list)
        if support.kind == "unsupported":
            found.append(f"This build cannot run on this GPU ({caps.arch}): {support.reason}.")
        elif support.kind == "PTX JIT":
            found.append(f"{support.reason[0].upper()}{support.reason[1:]}. A build that lists {caps.arch} "
                         "starts faster.")
        if not caps.bf16:
            found.append("No native bf16 (a GPU before Ampere): notebook 03 runs fp16 with a GradScaler only.")
        if not caps.triton:
            why = "Triton is not installed" if triton_version() is None else "Triton needs compute capability 7.0+"
            found.append(f"{why}: torch.compile falls back to eager code and notebook 06 skips its Triton kernel.")
        if caps.nvcc is None:
            found.append("No nvcc: notebook 06 skips its CUDA C++ extension (the Triton kernel still runs). Install "
                         "the CUDA toolkit matching torch.version.cuda to build extensions.")
    if caps.cxx is None:
        found.append("No C++ compiler on PATH: torch.compile on CPU and C++ extensions need g++ or clang.")
    return found


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
    from utils.memory import format_bytes  # local import: utils.memory imports from env (no cycle at load)

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
            f"Device cpu: {caps.name} · {usable_cpus()} cores, torch uses {torch.get_num_threads()} threads · "
            f"{format_bytes(caps.total_memory_bytes or 0)} RAM"
        )
        lines.append(f"No CUDA GPU: {why_no_cuda()}. GPU-only cells run their CPU counterpart or say why not.")
    if in_colab():
        lines.append("Running on Google Colab.")
    return "\n".join(lines)


def print_report(device: torch.device | str | None = None) -> None:
    """Print :func:`report` (the setup cell of every notebook calls this)."""
    print(report(device))


# ── Readings off the GPU while it works: clocks, power, why the clock is held back, the host link ────────────

#: NVML's clock-event ("throttle") reason bits, named as a reader would say them. The bit values are NVML's
#: ABI (nvml.h, ``nvmlClocksEventReason*``), the same in every driver since they were introduced.
CLOCK_EVENT_REASONS = {
    0x1: "idle",
    0x2: "application clock setting",
    0x4: "power cap",
    0x8: "hardware slowdown",
    0x10: "sync boost",
    0x20: "thermal (software)",
    0x40: "thermal (hardware)",
    0x80: "power brake (hardware)",
    0x100: "display clock setting",
}


def clock_reason_names(mask: int) -> list[str]:
    """The reasons set in an NVML clock-event bitmask, e.g. ``0x4`` → ``["power cap"]``; unknown bits as hex."""
    names = [name for bit, name in CLOCK_EVENT_REASONS.items() if mask & bit]
    unknown = mask & ~sum(CLOCK_EVENT_REASONS)
    return names + ([f"other (0x{unknown:x})"] if unknown else [])


@dataclass(frozen=True)
class GpuSample:
    """One reading: seconds since sampling started, SM clock (MHz), board power (W), clock-event bitmask."""

    t_s: float
    sm_clock_mhz: float | None
    power_w: float | None
    reasons: int


@dataclass
class GpuConditions:
    """What the GPU ran at while a measurement ran: readings every few milliseconds, and their summary.

    ``source`` says where the readings came from (``"NVML"`` or ``"nvidia-smi"``); when none could be taken,
    ``samples`` is empty and ``unavailable`` says why (a CPU device, no NVIDIA driver, a VM that hides it, ...).
    """

    device: str
    source: str | None = None
    unavailable: str | None = None
    max_sm_clock_mhz: float | None = None
    power_limit_w: float | None = None
    samples: list[GpuSample] = field(default_factory=list)

    def _values(self, name: str) -> list[float]:
        return [v for s in self.samples if (v := getattr(s, name)) is not None]

    @property
    def sm_clock_mhz(self) -> float | None:
        """Median SM clock over the samples."""
        values = self._values("sm_clock_mhz")
        return statistics.median(values) if values else None

    @property
    def power_w(self) -> float | None:
        """Median board power over the samples (NVML's instant reading where the driver offers it, else its average
        over about a second)."""
        values = self._values("power_w")
        return statistics.median(values) if values else None

    @property
    def max_power_w(self) -> float | None:
        values = self._values("power_w")
        return max(values) if values else None

    def reasons(self, share: float = 0.25) -> list[str]:
        """Clock-event reasons active in at least ``share`` of the samples ("idle" left out: we are working)."""
        if not self.samples:
            return []
        counts: dict[str, int] = {}
        for sample in self.samples:
            for name in clock_reason_names(sample.reasons):
                counts[name] = counts.get(name, 0) + 1
        return [n for n, c in counts.items() if c >= share * len(self.samples) and n != "idle"]

    def __str__(self) -> str:
        if not self.samples:
            return f"no clock or power readings: {self.unavailable or 'nothing was sampled'}"
        parts = []
        if self.sm_clock_mhz is not None:
            top = f" of {self.max_sm_clock_mhz:,.0f} max" if self.max_sm_clock_mhz else ""
            parts.append(f"SM clock {self.sm_clock_mhz:,.0f} MHz{top}")
        if self.power_w is not None:
            cap = f" (limit {self.power_limit_w:,.0f} W)" if self.power_limit_w else ""
            parts.append(f"{self.power_w:,.0f} W{cap}")
        held = self.reasons()
        parts.append(f"clock held back by: {', '.join(held)}" if held else "clock not held back")
        return " · ".join(parts) + f" [{len(self.samples)} {self.source} readings]"


class _Reader:
    """Reads one GPU's clock, power and clock-event reasons through NVML, else nvidia-smi."""

    def __init__(self, device: torch.device) -> None:
        self._no_instant_power = False
        self.device = device
        self.source: str | None = None
        self.unavailable: str | None = None
        self.max_sm_clock_mhz: float | None = None
        self.power_limit_w: float | None = None
        self._nvml = self._handle = self._smi = None
        if device.type != "cuda":
            self.unavailable = "a CPU has no GPU clock or board power to read"
            return
        why_not_nvml = self._open_nvml()
        if why_not_nvml is None:
            self.source = "NVML"
            return
        smi = shutil.which("nvidia-smi")
        if smi is not None and self._smi_read(smi) is not None:
            self.source, self._smi = "nvidia-smi", smi
            return
        self.unavailable = f"NVML: {why_not_nvml}; nvidia-smi: {'not found' if smi is None else 'gave no reading'}"

    def _uuid(self) -> str | None:
        uuid = getattr(torch.cuda.get_device_properties(self.device), "uuid", None)
        if uuid is None:
            return None
        text = str(uuid)
        return text if text.startswith("GPU-") else f"GPU-{text}"

    def _open_nvml(self) -> str | None:
        try:
            import pynvml
        except ImportError:
            return "the nvidia-ml-py package is not installed (pip install nvidia-ml-py)"
        try:
            pynvml.nvmlInit()
            handle = None
            uuid = self._uuid()
            if uuid is not None:
                with contextlib.suppress(pynvml.NVMLError):
                    handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            if handle is None:  # CUDA's numbering can differ from NVML's: torch maps it (CUDA_VISIBLE_DEVICES)
                index_of = getattr(torch.cuda, "_get_nvml_device_index", lambda d: d.index or 0)
                handle = pynvml.nvmlDeviceGetHandleByIndex(index_of(self.device))
            self._nvml, self._handle = pynvml, handle
            with contextlib.suppress(pynvml.NVMLError):
                self.max_sm_clock_mhz = float(pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM))
            with contextlib.suppress(pynvml.NVMLError):
                self.power_limit_w = pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000
            if self.read() is None:
                return "the driver answered but gave no clock or power reading"
        except Exception as err:  # NVMLError and its many subclasses, or a driver without the library
            return f"{type(err).__name__}: {err}"
        return None

    def _smi_read(self, smi: str) -> tuple[float | None, float | None, int] | None:
        target = self._uuid() or str(self.device.index or 0)
        try:
            out = subprocess.run([smi, "-i", target, "--format=csv,noheader,nounits",
                                  "--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active"],
                                 capture_output=True, text=True, timeout=5, check=True).stdout
            clock, power, reasons = (field.strip() for field in out.strip().splitlines()[0].split(","))
        except (subprocess.SubprocessError, OSError, ValueError, IndexError):
            return None

        def number(text: str) -> float | None:
            try:
                return float(text)
            except ValueError:  # "[N/A]", "[Not Supported]"
                return None

        try:
            mask = int(reasons, 16)
        except ValueError:
            mask = 0
        return number(clock), number(power), mask

    def _instant_power_w(self) -> float | None:
        """The board power now, in W, from NVML's instant-power field; None where the driver lacks it.

        ``nvmlDeviceGetPowerUsage`` averages over about a second on recent GPUs (Ampere, Hopper), so a 50 ms burst
        after a rest would read the rest's power; the instant field reads the burst. Once it fails, it is not asked
        again, and the readings fall back to the average."""
        field = getattr(self._nvml, "NVML_FI_DEV_POWER_INSTANT", None)
        if field is None or self._no_instant_power:
            return None
        try:
            (value,) = self._nvml.nvmlDeviceGetFieldValues(self._handle, [field])
            if value.nvmlReturn != 0:  # NVML_SUCCESS
                raise ValueError(f"NVML return {value.nvmlReturn}")
            milliwatts = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal"}.get(
                int(value.valueType), "uiVal")
            watts = float(getattr(value.value, milliwatts)) / 1000
        except Exception:  # NVMLError, an old driver, an unexpected value type
            self._no_instant_power = True
            return None
        if not watts > 0:
            self._no_instant_power = True
            return None
        return watts

    def read(self) -> tuple[float | None, float | None, int] | None:
        """(SM MHz, W, reason bitmask), or None if nothing could be read. Power is the instant reading where the
        driver offers it (:meth:`_instant_power_w`), else NVML's average."""
        if self._nvml is not None:
            nvml, h = self._nvml, self._handle
            clock = power = None
            mask = 0
            with contextlib.suppress(nvml.NVMLError):
                clock = float(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM))
            power = self._instant_power_w()
            if power is None:
                with contextlib.suppress(nvml.NVMLError):
                    power = nvml.nvmlDeviceGetPowerUsage(h) / 1000
            reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
                nvml.nvmlDeviceGetCurrentClocksThrottleReasons
            with contextlib.suppress(nvml.NVMLError):
                mask = int(reasons(h))
            return None if clock is None and power is None else (clock, power, mask)
        if self.source == "nvidia-smi":
            return self._smi_read(self._smi)
        return None


@contextlib.contextmanager
def gpu_conditions(device: torch.device | str | None = None, *, interval_s: float = 0.02):
    """Sample the GPU's SM clock, board power and clock-event reasons in a background thread during a block::

        with utils.env.gpu_conditions(device) as conditions:
            timing = utils.bench.bench(work)
        print(conditions)  # "SM clock 1,755 MHz of 1,980 max · 690 W (limit 700 W) · clock held back by: power cap"

    NVML (``nvidia-ml-py``) is read every ``interval_s``; without it, ``nvidia-smi`` every 0.2 s at most. On a
    CPU, or where neither answers, the block runs unobserved and the result says why. One reading is always
    taken at the end, so a block shorter than the interval still gets one.
    """
    device = get_device(device)
    reader = _Reader(device)
    conditions = GpuConditions(device=str(device), source=reader.source, unavailable=reader.unavailable,
                               max_sm_clock_mhz=reader.max_sm_clock_mhz, power_limit_w=reader.power_limit_w)
    if reader.source is None:
        yield conditions
        return
    interval = interval_s if reader.source == "NVML" else max(interval_s, 0.2)
    stop = threading.Event()
    start = time.perf_counter()

    def sample() -> None:
        reading = reader.read()
        if reading is not None:
            conditions.samples.append(GpuSample(time.perf_counter() - start, *reading))

    def loop() -> None:
        while not stop.wait(interval):
            sample()

    thread = threading.Thread(target=loop, name="gpu-conditions", daemon=True)
    thread.start()
    try:
        yield conditions
    finally:
        stop.set()
        thread.join(timeout=10)
        sample()


@dataclass(frozen=True)
class HostLink:
    """The GPU's link to the host: PCIe generation and width, and the bandwidth that gives per direction."""

    generation: int
    width: int
    source: str

    #: usable GB/s per lane and direction after line encoding (8b/10b up to gen 2, 128b/130b from gen 3)
    PER_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}

    @property
    def gbps(self) -> float | None:
        per_lane = self.PER_LANE_GBPS.get(self.generation)
        return per_lane * self.width if per_lane else None

    def __str__(self) -> str:
        rate = f"{self.gbps:.1f} GB/s per direction" if self.gbps else "unknown rate"
        return f"PCIe gen {self.generation} x{self.width}: {rate} ({self.source})"


def host_link(device: torch.device | str | None = None) -> HostLink | str:
    """The PCIe link between the host and this GPU at its best (max generation and width), or why it is unknown.

    Reads NVML's maximum link generation and width (the current ones drop while the GPU idles, to save power),
    else ``nvidia-smi --query-gpu=pcie.link.gen.max,pcie.link.width.max``. Returns a sentence instead of a
    :class:`HostLink` on a CPU, or where neither answers (some VMs hide the link).
    """
    device = get_device(device)
    if device.type != "cuda":
        return "a CPU device has no host link"
    reader = _Reader(device)
    if reader.source == "NVML":
        nvml, h = reader._nvml, reader._handle
        try:
            # the most this GPU *in this slot* can do (a gen 5 GPU in a gen 4 slot runs gen 4)
            gen, width = nvml.nvmlDeviceGetMaxPcieLinkGeneration(h), nvml.nvmlDeviceGetMaxPcieLinkWidth(h)
            return HostLink(int(gen), int(width), "NVML")
        except Exception as err:  # NVMLError: not supported here
            why = f"NVML: {type(err).__name__}: {err}"
    else:
        why = reader.unavailable or "no NVML"
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        try:
            out = subprocess.run([smi, "-i", reader._uuid() or str(device.index or 0), "--format=csv,noheader",
                                  "--query-gpu=pcie.link.gen.max,pcie.link.width.max"],
                                 capture_output=True, text=True, timeout=5, check=True).stdout
            gen, width = (int(v.strip()) for v in out.strip().splitlines()[0].split(","))
            return HostLink(gen, width, "nvidia-smi")
        except (subprocess.SubprocessError, OSError, ValueError, IndexError):
            why += "; nvidia-smi gave no PCIe reading"
    return f"the host link could not be read ({why})"


@contextlib.contextmanager
def deterministic_algorithms():
    """``torch.use_deterministic_algorithms(True)`` inside the block, the previous setting restored after it.

    Deterministic kernels replace those that accumulate with atomics in a varying order (``index_add_``,
    ``scatter_add_``, some backward passes); an op without one raises. On CUDA, cuBLAS also needs
    ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (or ``:16:8``) set before the process's first cuBLAS call.
    """
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)
