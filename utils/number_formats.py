"""How the floating-point formats of deep learning store one value: what is kept, the rounding error, and whether it
overflows or underflows — for fp32, TF32, fp16, bf16 and (where the installed torch has them) the two fp8 formats.

    utils.plot.table(utils.number_formats.stored_as(70_000.0))

Every format but TF32 is a real cast (``torch.tensor(value, dtype=float64).to(dtype)``, round to nearest even, as
the GPU's conversions do); TF32 is not a storage type — the tensor cores read fp32 inputs with 10 of their 23
mantissa bits — so it is emulated by rounding the fp32 value's mantissa (:func:`round_mantissa`, which also
emulates any such format on whole tensors, e.g. a matmul's inputs in notebook 07).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["FORMATS", "Format", "Stored", "ranges", "round_mantissa", "round_trips", "stored_as", "stored_values",
           "unit_roundoff"]


@dataclass(frozen=True)
class Format:
    name: str
    dtype: torch.dtype  # TF32: float32, with the mantissa rounded to 10 bits
    exponent_bits: int
    mantissa_bits: int

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits


def _formats() -> tuple[Format, ...]:
    formats = [Format("float32", torch.float32, 8, 23),
               Format("tf32", torch.float32, 8, 10),
               Format("float16", torch.float16, 5, 10),
               Format("bfloat16", torch.bfloat16, 8, 7)]
    if hasattr(torch, "float8_e4m3fn"):
        formats.append(Format("float8_e4m3fn", torch.float8_e4m3fn, 4, 3))  # no infinity
    if hasattr(torch, "float8_e5m2"):
        formats.append(Format("float8_e5m2", torch.float8_e5m2, 5, 2))
    return tuple(formats)


FORMATS: tuple[Format, ...] = _formats()


@dataclass(frozen=True)
class Stored:
    """One format's copy of a value."""

    format: Format
    value: float  # what the format holds, read back as a Python float
    relative_error: float  # |stored − value| / |value| (0 for value 0; inf after overflow or underflow)
    outcome: str  # exact, rounded, subnormal: ..., underflow to 0, overflow to inf / NaN / clamped to the largest

    def row(self) -> dict[str, str]:
        fmt, info = self.format, torch.finfo(self.format.dtype)
        return {"format": fmt.name, "bits (s·e·m)": f"1·{fmt.exponent_bits}·{fmt.mantissa_bits}",
                "stored as": f"{self.value:.9g}",
                "relative error": "—" if not math.isfinite(self.relative_error) else f"{self.relative_error:.1e}",
                "what happened": self.outcome, "largest": f"{_largest(fmt, info):.4g}",
                "smallest normal": f"{info.smallest_normal:.3g}"}


def round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` as float32 with its mantissa rounded (to nearest, ties to even) to ``bits`` explicit bits: what a
    format with fp32's exponent range and ``bits`` mantissa bits holds (TF32: 10, bf16: 7). Finite inputs only.

    Raises:
        ValueError: for ``bits`` outside 0..23.
    """
    if not 0 <= bits <= 23:
        raise ValueError(f"bits must be between 0 and 23 (fp32 has 23 explicit mantissa bits), got {bits}")
    x = x.detach().to(torch.float32).contiguous()
    drop = 23 - bits
    if drop == 0:
        return x.clone()
    raw = x.view(torch.int32)
    lowest_kept = (raw >> drop) & 1
    rounded = (raw + ((1 << (drop - 1)) - 1) + lowest_kept) & ~((1 << drop) - 1)
    return rounded.view(torch.float32)


def unit_roundoff(bits: int) -> float:
    """2^-(bits + 1): the largest relative error of rounding to nearest with ``bits`` explicit mantissa bits."""
    return math.ldexp(1.0, -(bits + 1))


def _largest(fmt: Format, info: torch.finfo) -> float:
    if fmt.name == "tf32":  # fp32's exponent, 10 mantissa bits
        return (2 - 2.0 ** -10) * 2.0 ** 127
    return float(info.max)


def _store(value: float, fmt: Format) -> float:
    x = torch.tensor(value, dtype=torch.float64).to(fmt.dtype)
    if fmt.name == "tf32" and x.isfinite():
        x = round_mantissa(x, fmt.mantissa_bits)
    return x.to(torch.float64).item()


def _outcome(value: float, stored: float, fmt: Format) -> tuple[str, float]:
    if math.isnan(stored):
        return "overflow to NaN", math.inf
    if math.isinf(stored):
        return "overflow to inf", math.inf
    if value != 0 and stored == 0:
        return "underflow to 0", math.inf
    error = 0.0 if value == 0 else abs(stored - value) / abs(value)
    largest = _largest(fmt, torch.finfo(fmt.dtype))
    if abs(stored) == largest and error > 2.0 ** -(fmt.mantissa_bits + 1):  # beyond rounding: a saturating cast
        return "overflow: clamped to the largest", error
    if stored != 0 and abs(stored) < torch.finfo(fmt.dtype).smallest_normal:
        return "subnormal: fewer significant bits", error
    return ("exact" if error == 0 else "rounded"), error


def stored_as(value: float, formats: tuple[Format, ...] = FORMATS) -> list[dict[str, str]]:
    """One table row per format: how it stores ``value`` (see :class:`Stored`). Rows for :func:`utils.plot.table`.

    Raises:
        ValueError: for a value that is not a finite number (there is nothing to round).
    """
    return [s.row() for s in stored_values(value, formats)]


def stored_values(value: float, formats: tuple[Format, ...] = FORMATS) -> list[Stored]:
    """The :class:`Stored` copies of ``value`` in each format (what :func:`stored_as` tabulates)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"a number is needed, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"type a finite number: {value} is already the format's special value, nothing to round")
    out = []
    for fmt in formats:
        stored = _store(value, fmt)
        outcome, error = _outcome(value, stored, fmt)
        out.append(Stored(fmt, stored, error, outcome))
    return out


def _subnormal(fmt: Format, info: torch.finfo) -> float:
    """The smallest non-zero value: the smallest normal times 2^-mantissa bits (TF32: fp32's exponent, 10 bits)."""
    return info.smallest_normal * 2.0 ** -fmt.mantissa_bits


def ranges(formats: tuple[Format, ...] = FORMATS, *, fp8_note: str = "") -> list[dict[str, str]]:
    """One table row per format: bits, mantissa bits, the largest value, the smallest normal and subnormal, and eps
    (the gap above 1), from ``torch.finfo`` (TF32 from its bit layout: fp32's range, 10 mantissa bits). Values at or
    below half the smallest subnormal round to zero. ``fp8_note`` is added to the fp8 rows (e.g. whether this GPU
    has fp8 tensor cores)."""
    notes = {"tf32": "stored as fp32; tensor cores read 1 + 8 + 10 bits of each matmul input",
             "float8_e4m3fn": "no infinity; scaled per tensor", "float8_e5m2": "fp16's range, 2 mantissa bits"}
    rows = []
    for fmt in formats:
        info = torch.finfo(fmt.dtype)
        note = notes.get(fmt.name, "")
        if fmt.name.startswith("float8") and fp8_note:
            note = f"{note}; {fp8_note}"
        rows.append({"format": fmt.name, "bits": fmt.bits, "mantissa bits": fmt.mantissa_bits,
                     "max": f"{_largest(fmt, info):.3g}", "smallest normal": f"{info.smallest_normal:.3g}",
                     "smallest subnormal": f"{_subnormal(fmt, info):.3g}",
                     "eps (gap above 1)": f"{2.0 ** -fmt.mantissa_bits:.3g}", "note": note})
    return rows


def round_trips(values: dict[str, float], names: tuple[str, ...] = ("float16", "bfloat16")) -> list[dict[str, str]]:
    """Table rows: each named value as stored in each of the formats ``names``, and what happened to it.

    Raises:
        ValueError: for an unknown format name, or a value that is not a finite number.
    """
    known = {f.name: f for f in FORMATS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown formats {unknown}; known: {list(known)}")
    rows = []
    for label, value in values.items():
        row = {"value": label}
        for stored in stored_values(value, tuple(known[n] for n in names)):
            row[f"as {stored.format.name}"] = f"{stored.value:.8g} ({stored.outcome})"
        rows.append(row)
    return rows
