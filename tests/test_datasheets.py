"""utils.datasheets: the sheets, and matching a CUDA device name to the right one (or to none)."""

import pytest

from utils import datasheets


@pytest.mark.parametrize(("device_name", "sheet"), [
    ("NVIDIA H200", "H200 SXM"),
    ("NVIDIA H200 NVL", "H200 NVL"),
    ("NVIDIA H100 80GB HBM3", "H100 SXM"),
    ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA A100-SXM4-40GB", "A100 40GB SXM"),  # Colab's A100
    ("NVIDIA A100-PCIE-40GB", "A100 40GB PCIe"),  # a 250 W card, not the 400 W SXM part
    ("NVIDIA A100 40GB PCIe", "A100 40GB PCIe"),
    ("NVIDIA A100-SXM-80GB", "A100 80GB SXM"),
    ("NVIDIA A100-SXM4-80GB", "A100 80GB SXM"),
    ("NVIDIA A100 80GB PCIe", "A100 80GB PCIe"),
    ("Tesla T4", "T4"),  # Colab's T4
    ("NVIDIA L4", "L4"),
    ("NVIDIA GeForce RTX 4090", "RTX 4090"),
])
def test_known_gpus_match_their_own_sheet(device_name, sheet):
    assert datasheets.match(device_name).name == sheet


@pytest.mark.parametrize("device_name", [
    "NVIDIA A100",  # no memory size: 40 GB and 80 GB differ in bandwidth
    "NVIDIA L40S",  # not an L4
    "NVIDIA GeForce RTX 4090 Laptop GPU",  # a laptop part: other clocks and power
    "NVIDIA GeForce RTX 4090 D",
    "NVIDIA GH200 480GB",
    "NVIDIA GeForce RTX 3090",
    "cpu",
])
def test_other_gpus_match_no_sheet(device_name):
    assert datasheets.match(device_name) is None


def test_sheets_are_dense_and_consistent():
    for sheet in datasheets.DATASHEETS:
        assert sheet.source.startswith("https://")
        assert sheet.fp16 >= sheet.fp32 and sheet.memory_gbps > 0 and sheet.memory_gb > 0
        if sheet.bf16 is not None:
            assert sheet.bf16 == sheet.fp16  # fp32 accumulate: the same tensor-core rate
    h200, h100 = datasheets.by_name("H200 SXM"), datasheets.by_name("H100 SXM")
    assert h200.bf16 == h100.bf16 and h200.memory_gbps > h100.memory_gbps  # same chip, faster memory
    t4 = datasheets.by_name("T4")
    assert t4.tflops("bf16") is None and t4.tflops("fp16") == 65.0


def test_a100_pcie_40gb_is_its_own_part():
    """The H100 review found an A100-PCIE-40GB compared with the 400 W SXM sheet: the PCIe card is quoted at the same
    peaks and bandwidth (NVIDIA's product brief PB-10137-001) but at 250 W, where its sustained rate falls further."""
    pcie, sxm = datasheets.match("NVIDIA A100-PCIE-40GB"), datasheets.match("NVIDIA A100-SXM4-40GB")
    assert (pcie.power_w, pcie.memory_gbps, pcie.memory_gb) == (250, 1555, 40)
    assert (sxm.power_w, sxm.memory_gbps, sxm.memory_gb) == (400, 1555, 40)
    assert pcie.bf16 == sxm.bf16 == 312.0 and pcie.source != sxm.source
    assert datasheets.by_name("A100 80GB PCIe").power_w == 300 and datasheets.by_name("A100 80GB SXM").power_w == 400


def test_every_sheet_matches_only_the_names_it_describes():
    """No two patterns claim one name: each sheet's own name, spelled as CUDA would, matches at most that sheet."""
    for sheet in datasheets.DATASHEETS:
        found = datasheets.match(f"NVIDIA {sheet.name}")
        assert found is None or found.name == sheet.name


def test_table_and_against_print_every_figure(capsys):
    datasheets.table()
    out = capsys.readouterr().out
    assert all(s.name in out for s in datasheets.DATASHEETS) and "A100-PCIE-Prduct-Brief.pdf" in out
    datasheets.against("T4", {"fp32": (7.0, 6.5), "bf16": (50.0, 40.0), "fp16": (60.0, 52.0)}, 256.0, here="a T4")
    out = capsys.readouterr().out
    assert "fp16 matmul" in out and "(80%)" in out and "bf16" not in out  # the T4 sheet has no bf16 rate
    assert "a T4 against the T4 datasheet (70 W" in out and "256 (80%)" in out


def test_bad_lookups_are_clear_errors():
    with pytest.raises(KeyError, match="there are"):
        datasheets.by_name("H300")
    with pytest.raises(ValueError, match="precision"):
        datasheets.by_name("T4").tflops("int8")
