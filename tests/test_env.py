"""utils.env: device choice, capabilities, report, GPU readings."""

import os
import sys
import types

import pytest
import torch

from utils import env


def test_get_device_default_is_cpu_without_gpu(monkeypatch):
    monkeypatch.delenv(env.DEVICE_ENV_VAR, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert env.get_device() == torch.device("cpu")


def test_get_device_env_var_overrides(monkeypatch):
    monkeypatch.setenv(env.DEVICE_ENV_VAR, "cpu")
    assert env.get_device() == torch.device("cpu")


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "not a device"])
def test_unknown_device_string_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="unknown device"):
        env.get_device(bad)


def test_unsupported_device_type_is_a_clear_error():
    with pytest.raises(ValueError, match="not supported by this course"):
        env.get_device("meta")


def test_cuda_without_gpu_says_why(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="PyTorch sees no CUDA GPU"):
        env.get_device("cuda")


def test_why_no_cuda_names_cpu_only_build(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    assert "CPU-only build" in env.why_no_cuda()


def test_why_no_cuda_names_colab_runtime(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    assert env.in_colab()
    assert "Change runtime type" in env.why_no_cuda()


def test_why_no_cuda_names_hidden_devices(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert "CUDA_VISIBLE_DEVICES" in env.why_no_cuda()


def test_by_device_picks_by_type():
    assert env.by_device("cpu", cpu=1, cuda=2) == 1
    assert env.by_device(torch.device("cuda", 0), cpu=1, cuda=2) == 2


@pytest.mark.parametrize(
    ("name", "slug"),
    [("NVIDIA H100 80GB HBM3", "h100"), ("Tesla T4", "t4"), ("NVIDIA GeForce RTX 4090", "rtx-4090"),
     ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA L4", "l4"), ("", "gpu")],
)
def test_gpu_slug(name, slug):
    assert env.gpu_slug(name) == slug


def test_cpu_capabilities_and_report():
    caps = env.capabilities("cpu")
    assert caps.device == "cpu" and caps.arch is None and not caps.tf32
    text = env.report("cpu")
    assert f"PyTorch {torch.__version__}" in text and "Device cpu" in text


def test_seed_everything_makes_draws_repeat():
    env.seed_everything(3)
    a = torch.randn(4)
    env.seed_everything(3)
    torch.testing.assert_close(torch.randn(4), a)


# ── GPU readings: clocks, power, clock-event reasons, host link ─────────────────────────────────────────────


def test_clock_reason_names():
    assert env.clock_reason_names(0) == []
    assert env.clock_reason_names(0x4) == ["power cap"]
    assert env.clock_reason_names(0x1 | 0x40) == ["idle", "thermal (hardware)"]
    assert env.clock_reason_names(0x10000) == ["other (0x10000)"]


def test_conditions_summary_from_samples():
    conditions = env.GpuConditions(device="cuda:0", source="NVML", max_sm_clock_mhz=1980, power_limit_w=700,
                                   samples=[env.GpuSample(0.01 * i, 1755 + i, 690.0, 0x4 if i else 0x0)
                                            for i in range(5)])
    assert conditions.sm_clock_mhz == 1757 and conditions.power_w == 690
    assert conditions.reasons() == ["power cap"]
    text = str(conditions)
    assert "1,757 MHz of 1,980 max" in text and "690 W (limit 700 W)" in text and "power cap" in text


def test_conditions_without_readings_say_why():
    with env.gpu_conditions("cpu") as conditions:
        pass
    assert not conditions.samples and conditions.sm_clock_mhz is None
    assert "CPU" in str(conditions)


class FakeNvml:
    """Enough of pynvml for utils.env's reader."""

    NVML_CLOCK_SM = 1

    class NVMLError(Exception):
        pass

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return ("handle", uuid)

    def nvmlDeviceGetMaxClockInfo(self, handle, clock):
        return 1980

    def nvmlDeviceGetEnforcedPowerLimit(self, handle):
        return 700_000

    def nvmlDeviceGetClockInfo(self, handle, clock):
        return 1755

    def nvmlDeviceGetPowerUsage(self, handle):
        return 690_500

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return 0x4

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle):
        return 5

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle):
        return 16


def test_reader_through_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml())
    monkeypatch.setattr(env._Reader, "_uuid", lambda self: "GPU-1234")
    reader = env._Reader(torch.device("cuda", 0))
    assert reader.source == "NVML" and reader.max_sm_clock_mhz == 1980 and reader.power_limit_w == 700
    assert reader.read() == (1755.0, 690.5, 0x4)


def test_reader_falls_back_to_nvidia_smi(monkeypatch, tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '1410, 301.25, 0x0000000000000020'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails: not installed
    monkeypatch.setattr(env._Reader, "_uuid", lambda self: "GPU-1234")
    reader = env._Reader(torch.device("cuda", 0))
    assert reader.source == "nvidia-smi"
    assert reader.read() == (1410.0, 301.25, 0x20)


def test_host_link_rates():
    assert env.HostLink(4, 16, "test").gbps == pytest.approx(31.5, rel=1e-2)
    assert env.HostLink(5, 16, "test").gbps == pytest.approx(63.0, rel=1e-2)
    assert env.HostLink(9, 16, "test").gbps is None and "unknown rate" in str(env.HostLink(9, 16, "test"))
    assert "CPU" in env.host_link("cpu")
