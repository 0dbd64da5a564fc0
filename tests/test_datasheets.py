"""utils.datasheets: the sheets, and matching a CUDA device name to the right one (or to none)."""

import pytest

from utils import datasheets


@pytest.mark.parametrize(("device_name", "sheet"), [
    ("NVIDIA H200", "H200 SXM"),
    ("NVIDIA H200 NVL", "H200 NVL"),
    ("NVIDIA H100 80GB HBM3", "H100 SXM"),
    ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA A100-SXM4-40GB", "A100 40GB"),  # Colab's A100
    ("NVIDIA A100-PCIE-40GB", "A100 40GB"),
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


def test_bad_lookups_are_clear_errors():
    with pytest.raises(KeyError, match="there are"):
        datasheets.by_name("H300")
    with pytest.raises(ValueError, match="precision"):
        datasheets.by_name("T4").tflops("int8")
