"""utils.number_formats: values whose storage is known independently (by hand from the bit layouts, or IEEE's
limits) come out as expected, with the right outcome per format."""

import math

import pytest
import torch

from utils import number_formats as nf


def by_format(value):
    return {s.format.name: s for s in nf.stored_values(value)}


def test_formats_and_their_bits():
    names = [f.name for f in nf.FORMATS]
    assert names[:4] == ["float32", "tf32", "float16", "bfloat16"]
    assert {f.name: f.bits for f in nf.FORMATS[:4]} == {"float32": 32, "tf32": 19, "float16": 16, "bfloat16": 16}
    if hasattr(torch, "float8_e4m3fn"):
        assert {f.name: f.bits for f in nf.FORMATS if f.name.startswith("float8")} == {"float8_e4m3fn": 8,
                                                                                       "float8_e5m2": 8}


def test_one_tenth_rounds_within_each_formats_unit_roundoff():
    stored = by_format(0.1)
    # 0.1 = 1.10011001100110011…₂ × 2⁻⁴: ten mantissa bits keep 1.1001100110₂, so TF32 and fp16 agree exactly
    assert stored["tf32"].value == stored["float16"].value == 0.0999755859375
    assert stored["bfloat16"].value == 0.10009765625  # 1.1001101₂ × 2⁻⁴ (rounded up)
    for s in stored.values():
        assert s.outcome == "rounded" and 0 < s.relative_error <= 2.0 ** -(s.format.mantissa_bits + 1)


def test_overflow_underflow_and_subnormals():
    big, tiny, small = by_format(70_000.0), by_format(1e-8), by_format(1e-5)
    assert big["float16"].outcome == "overflow to inf" and math.isinf(big["float16"].value)  # fp16's max: 65,504
    assert big["bfloat16"].value == 70_144 and big["bfloat16"].outcome == "rounded"  # steps of 2⁹ at 2¹⁶
    assert big["float32"].outcome == "exact" and big["tf32"].value == 70_016  # steps of 2⁶ with 10 bits
    assert tiny["float16"].outcome == "underflow to 0" and tiny["bfloat16"].outcome == "rounded"
    assert small["float16"].outcome.startswith("subnormal")  # below fp16's smallest normal, 6.1e-5
    assert small["bfloat16"].outcome == "rounded"  # bf16 has fp32's range
    fp32_max = torch.finfo(torch.float32).max
    assert by_format(fp32_max)["tf32"].outcome == "overflow to inf"  # 23 ones round up past the top exponent


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="this torch has no fp8 types")
def test_fp8_beyond_its_range():
    stored = by_format(500.0)  # e4m3fn: largest 448, steps of 32 above 256; no infinity
    assert stored["float8_e4m3fn"].outcome.startswith("overflow") and stored["float8_e5m2"].value == 512
    assert by_format(448.0)["float8_e4m3fn"].outcome == "exact"


def test_exact_values_and_signs():
    for value in (0.0, 1.0, -2.5, 0.375):
        for s in nf.stored_values(value):
            assert s.outcome == "exact" and s.value == value and s.relative_error == 0


def test_rows_for_a_table():
    rows = nf.stored_as(70_000.0)
    assert [r["format"] for r in rows] == [f.name for f in nf.FORMATS]
    assert rows[2]["relative error"] == "—" and rows[2]["what happened"] == "overflow to inf"


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, "0.1", True, None])
def test_bad_values_are_refused_with_the_reason(bad):
    with pytest.raises(ValueError, match="finite number|a number is needed"):
        nf.stored_as(bad)


def test_round_mantissa_matches_bf16_and_rounds_ties_to_even():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0)) * 100
    assert torch.equal(nf.round_mantissa(x, 7), x.to(torch.bfloat16).float())
    ties = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11)])
    assert nf.round_mantissa(ties, 10).tolist() == [1.0, 1 + 2**-9, -1.0]
    assert torch.equal(nf.round_mantissa(x, 23), x)
    with pytest.raises(ValueError, match="between 0 and 23"):
        nf.round_mantissa(x, 24)


def test_unit_roundoff():
    assert nf.unit_roundoff(10) == 2**-11 and math.isclose(nf.unit_roundoff(23), 2**-24)


def test_ranges_from_finfo_and_the_bit_layout():
    rows = {r["format"]: r for r in nf.ranges(fp8_note="no fp8 here")}
    assert rows["float16"]["max"] == "6.55e+04" and rows["float16"]["smallest normal"] == "6.1e-05"
    assert float(rows["float16"]["smallest subnormal"]) == pytest.approx(2.0**-24, rel=1e-2)  # 2^-14 · 2^-10
    assert rows["bfloat16"]["smallest normal"] == rows["float32"]["smallest normal"]  # fp32's range
    assert rows["tf32"]["mantissa bits"] == 10 and rows["tf32"]["eps (gap above 1)"] == f"{2.0**-10:.3g}"
    assert rows["bfloat16"]["eps (gap above 1)"] == f"{2.0**-7:.3g}"
    if hasattr(torch, "float8_e4m3fn"):
        assert rows["float8_e4m3fn"]["max"] == "448" and "no fp8 here" in rows["float8_e4m3fn"]["note"]


def test_round_trips_name_what_happened():
    rows = nf.round_trips({"big": 7e4, "tiny": 1e-8, "small": 1e-5})
    assert rows[0]["as float16"] == "inf (overflow to inf)" and rows[0]["as bfloat16"] == "70144 (rounded)"
    assert rows[1]["as float16"].endswith("(underflow to 0)") and "rounded" in rows[1]["as bfloat16"]
    assert "subnormal" in rows[2]["as float16"]
    with pytest.raises(ValueError, match="unknown formats"):
        nf.round_trips({"x": 1.0}, names=("float12",))
