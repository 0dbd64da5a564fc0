"""What the vendor says a GPU can do: dense peak rates and memory bandwidth from NVIDIA's datasheets, and which
sheet describes the GPU in this machine.

Every figure is *dense* (without 2:4 structured sparsity, which datasheets often quote at twice the rate) and,
for tensor-core rates, with fp32 accumulation, which is what PyTorch's matmuls use. Datasheet peaks are ceilings
at the clock the vendor assumed, not always the highest the SMs reach (H100/H200 SXM: bf16 989.4 = 132 SMs ×
4,096 FLOP/clock × 1,830 MHz, fp32 67 = 132 × 256 × 1,980 MHz): measured rates land below them, and how far below
is itself worth knowing (notebook 00 measures it). A sheet is matched to a GPU only when the name leaves no doubt:
an A100 40 GB is not an A100 80 GB (different memory bandwidth), a PCIe card is not its SXM sibling (the A100 40GB
PCIe is quoted at the SXM part's peaks but runs at 250 W, not 400 W, so its sustained rate falls further; an H100
PCIe also has lower clocks), a laptop RTX 4090 is not the desktop card; for a name that could be several parts,
and for every GPU not listed, :func:`match` returns None.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

PRECISIONS = ("fp32", "tf32", "fp16", "bf16")

_H100_SHEET = "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
_A100_PDF = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
#: the A100 80GB datasheet (PCIe 300 W and 1,935 GB/s; SXM 400 W and 2,039 GB/s)
_A100_80GB_SHEET = _A100_PDF + "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
#: the first A100 datasheet, of the 40 GB parts ("A100 for NVLink": SXM4, 400 W; 1,555 GB/s)
_A100_40GB_SHEET = _A100_PDF + "nvidia-a100-datasheet.pdf"
#: NVIDIA A100 40GB PCIe GPU Accelerator, Product Brief PB-10137-001 (250 W, 1,555 GB/s, the same peak rates)
_A100_40GB_PCIE_BRIEF = _A100_PDF + "A100-PCIE-Prduct-Brief.pdf"


@dataclass(frozen=True)
class Datasheet:
    """Dense peaks of one GPU model: TFLOP/s per matmul precision (None: no tensor-core support), GB/s, GB."""

    name: str
    fp32: float  # plain fp32 (CUDA cores, no tensor cores)
    tf32: float | None
    fp16: float
    bf16: float | None
    memory_gbps: float
    memory_gb: float
    power_w: int  # the board power the rates are quoted at (maximum TDP)
    source: str
    pattern: str  # a regular expression the full CUDA device name must match

    def tflops(self, precision: str) -> float | None:
        """The dense peak for ``precision`` ("fp32", "tf32", "fp16", "bf16"); None where the GPU has none."""
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        return getattr(self, precision)


DATASHEETS: tuple[Datasheet, ...] = (
    Datasheet("H200 SXM", 67.0, 494.7, 989.4, 989.4, 4800, 141, 700,
              "https://www.nvidia.com/en-us/data-center/h200/", r"(NVIDIA )?H200( SXM.*)?"),
    Datasheet("H200 NVL", 60.0, 417.5, 835.5, 835.5, 4800, 141, 600,
              "https://www.nvidia.com/en-us/data-center/h200/", r"(NVIDIA )?H200 NVL"),
    Datasheet("H100 SXM", 67.0, 494.7, 989.4, 989.4, 3350, 80, 700, _H100_SHEET,
              r"(NVIDIA )?H100 80GB HBM3|(NVIDIA )?H100 SXM.*"),
    Datasheet("H100 PCIe", 51.0, 378.0, 756.5, 756.5, 2000, 80, 350, _H100_SHEET, r"(NVIDIA )?H100 PCIe"),
    Datasheet("H100 NVL", 60.0, 417.5, 835.5, 835.5, 3900, 94, 400, _H100_SHEET, r"(NVIDIA )?H100 NVL"),
    Datasheet("A100 40GB SXM", 19.5, 156.0, 312.0, 312.0, 1555, 40, 400, _A100_40GB_SHEET,
              r"(NVIDIA )?A100[- ]SXM4?[- ]40GB"),
    Datasheet("A100 40GB PCIe", 19.5, 156.0, 312.0, 312.0, 1555, 40, 250, _A100_40GB_PCIE_BRIEF,
              r"(NVIDIA )?A100[- ]PCIE[- ]40GB|(NVIDIA )?A100 40GB PCIe"),
    Datasheet("A100 80GB SXM", 19.5, 156.0, 312.0, 312.0, 2039, 80, 400, _A100_80GB_SHEET,
              r"(NVIDIA )?A100[- ]SXM4?[- ]80GB"),
    Datasheet("A100 80GB PCIe", 19.5, 156.0, 312.0, 312.0, 1935, 80, 300, _A100_80GB_SHEET,
              r"(NVIDIA )?A100 80GB PCIe|(NVIDIA )?A100[- ]PCIE[- ]80GB"),
    Datasheet("L4", 30.3, 60.0, 121.0, 121.0, 300, 24, 72,
              "https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet", r"(NVIDIA )?L4"),
    Datasheet("T4", 8.1, None, 65.0, None, 320, 16, 70,
              "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/"
              "t4-tensor-core-datasheet-951643.pdf", r"(Tesla |NVIDIA )?T4"),
    Datasheet("RTX 4090", 82.6, 82.6, 165.2, 165.2, 1008, 24, 450,
              "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf",
              r"(NVIDIA )?(GeForce )?RTX 4090"),
)


def by_name(name: str) -> Datasheet:
    """The sheet called ``name`` ("H200 SXM", "T4", ...).

    Raises:
        KeyError: naming the sheets there are.
    """
    for sheet in DATASHEETS:
        if sheet.name == name:
            return sheet
    raise KeyError(f"no datasheet called {name!r}; there are: {', '.join(s.name for s in DATASHEETS)}")


def match(device_name: str) -> Datasheet | None:
    """The sheet that describes a GPU by its CUDA name (``torch.cuda.get_device_name()``), or None.

    The whole name must match one sheet's pattern: "NVIDIA A100-SXM4-40GB" → A100 40GB SXM, "NVIDIA
    A100-PCIE-40GB" → A100 40GB PCIe (250 W, not the SXM part's 400 W), "Tesla T4" → T4,
    "NVIDIA H100 80GB HBM3" → H100 SXM; "NVIDIA L40S", "NVIDIA GeForce RTX 4090 Laptop GPU" or "NVIDIA A100"
    without its memory size → None rather than a sheet of another part.
    """
    name = re.sub(r"\s+", " ", device_name.strip())
    found = [sheet for sheet in DATASHEETS if re.fullmatch(sheet.pattern, name, flags=re.IGNORECASE)]
    if len(found) > 1:  # two patterns claiming one name is a bug in the table, not an ambiguity to guess at
        raise AssertionError(f"{device_name!r} matches several datasheets: {[s.name for s in found]}")
    return found[0] if found else None


def table(sheets: Sequence[Datasheet] = DATASHEETS) -> None:
    """Print the sheets' dense peaks, memory and power as a table, then the page each row comes from."""
    from utils.plot import table as print_table

    print_table([{"GPU": s.name, "fp32": s.fp32, "tf32": s.tf32 or "—", "fp16": s.fp16, "bf16": s.bf16 or "—",
                  "memory": f"{s.memory_gb} GB", "GB/s": f"{s.memory_gbps:,}", "power": f"{s.power_w} W"}
                 for s in sheets], title="Datasheet peaks: dense TFLOP/s, memory and its bandwidth, board power")
    for source in dict.fromkeys(s.source for s in sheets):
        print(f"  {', '.join(s.name for s in sheets if s.source == source)}: {source}")


def against(sheet: Datasheet | str, matmul: Mapping[str, tuple[float, float]], copy_gbps: float, *,
            here: str = "measured here") -> None:
    """Print the rates measured here as a percentage of a sheet's figures: ``matmul`` maps a precision to its
    (burst, sustained) TFLOP/s, ``copy_gbps`` is the copy bandwidth; precisions the sheet has no rate for are left
    out. ``sheet`` is a :class:`Datasheet` or its name."""
    from utils.plot import table as print_table

    sheet = by_name(sheet) if isinstance(sheet, str) else sheet

    def share(value: float, peak: float) -> str:
        percent = 100 * value / peak
        return f"{value:,.4g} ({percent:.0f}%)" if percent >= 1 else f"{value:,.4g} (< 1%)"

    rows = [{"figure": f"{name} matmul (TFLOP/s)", "datasheet": f"{sheet.tflops(name):,.4g}",
             "burst": share(burst, sheet.tflops(name)), "sustained": share(sustained, sheet.tflops(name))}
            for name, (burst, sustained) in matmul.items() if sheet.tflops(name)]
    rows.append({"figure": "copy bandwidth (GB/s)", "datasheet": f"{sheet.memory_gbps:,}", "burst": "—",
                 "sustained": share(copy_gbps, sheet.memory_gbps)})
    print_table(rows, title=f"{here} against the {sheet.name} datasheet ({sheet.power_w} W; {sheet.source})")
