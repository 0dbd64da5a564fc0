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


# ── Does this build run on this GPU? ────────────────────────────────────────────────────────────────────────

WHEEL_CU130 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]  # torch 2.14's CUDA 13.0 wheel: no PTX


@pytest.mark.parametrize(("arch", "arch_list", "kind", "via"), [
    ("sm_90", WHEEL_CU130, "native", "sm_90"),
    ("sm_89", WHEEL_CU130, "binary-compatible", "sm_86"),  # an RTX 4090 or L4: the H100 review's false alarm
    ("sm_89", ["sm_80"], "binary-compatible", "sm_80"),
    ("sm_86", ["sm_80", "sm_90"], "binary-compatible", "sm_80"),
    ("sm_103", WHEEL_CU130, "binary-compatible", "sm_100"),  # B300 on a B200 cubin
    ("sm_121", WHEEL_CU130, "binary-compatible", "sm_120"),
    ("sm_90", ["sm_80"], "unsupported", None),  # no cubin of major 9, no PTX
    ("sm_90", ["sm_80", "compute_80"], "PTX JIT", "compute_80"),
    ("sm_90", ["sm_80", "compute_70", "compute_80"], "PTX JIT", "compute_80"),  # the newest usable PTX
    ("sm_75", ["sm_80"], "unsupported", None),  # cubins never run on an older GPU
    ("sm_75", ["sm_80", "compute_80"], "unsupported", None),  # nor newer PTX
    ("sm_70", WHEEL_CU130, "unsupported", None),  # V100 on a wheel that dropped Volta
    ("sm_120", ["sm_90", "sm_100"], "unsupported", None),  # no cubin across major versions
    ("sm_100", ["sm_90a", "compute_90a"], "unsupported", None),  # arch-specific code runs on 9.0 only
    ("sm_90", ["sm_90a"], "native", "sm_90a"),
    ("sm_100", ["sm_90", "compute_90"], "PTX JIT", "compute_90"),
    ("sm_103", ["sm_100f"], "binary-compatible", "sm_100f"),
    ("sm_87", ["sm_80", "sm_86"], "unsupported", None),  # Jetson Orin: no binary compatibility for Tegra
    ("sm_87", ["sm_86", "compute_86"], "PTX JIT", "compute_86"),
    ((8, 9), ["sm_86"], "binary-compatible", "sm_86"),
])
def test_arch_support_follows_cuda_compatibility(arch, arch_list, kind, via):
    support = env.arch_support(arch, arch_list)
    assert (support.kind, support.via) == (kind, via), support
    assert support.runs == (kind != "unsupported")
    assert str(support).startswith(f"{support.arch}: {kind}")


def test_arch_support_says_why():
    assert "runs the sm_86 machine code" in env.arch_support("sm_89", WHEEL_CU130).reason
    assert "all newer than sm_70" in env.arch_support("sm_70", WHEEL_CU130).reason
    assert "install a build that lists sm_90" in env.arch_support("sm_90", ["sm_80"]).reason
    assert "CPU-only" in env.arch_support("sm_90", []).reason
    assert "compiles the compute_80 PTX" in env.arch_support("sm_90", ["compute_80"]).reason


@pytest.mark.parametrize("bad", ["sm90", "8.6", "sm_9", "compute_", None])
def test_arch_support_rejects_what_is_not_an_arch(bad):
    with pytest.raises(ValueError, match="not a CUDA architecture"):
        env.arch_support(bad, ["sm_80"]) if bad else env.parse_arch(bad)
    with pytest.raises(ValueError, match="not a CUDA architecture"):
        env.arch_support("sm_80", ["sm_80", bad])


def test_parse_arch():
    assert env.parse_arch("sm_86") == ("sm", (8, 6), "")
    assert env.parse_arch("compute_120") == ("compute", (12, 0), "")
    assert env.parse_arch("sm_100a") == ("sm", (10, 0), "a")


def _caps(cc, **kw):
    base = dict(device="cuda:0", name="Tesla T4", compute_capability=cc, sm_count=40, total_memory_bytes=16 << 30,
                l2_cache_bytes=4 << 20, bf16=cc >= (8, 0), tf32=cc >= (8, 0), fp8=cc >= (8, 9),
                flash_attention=cc >= (8, 0), mem_efficient_attention=True, triton=True, nvcc=None, cxx="/usr/bin/c++")
    return env.Capabilities(**{**base, **kw})


def test_why_not_gates_precisions_on_capability():
    t4, a100, cpu = _caps((7, 5)), _caps((8, 0), name="NVIDIA A100-SXM4-40GB"), env.capabilities("cpu")
    assert t4.why_not("fp32") is None and t4.why_not("fp16") is None
    assert "no TF32 tensor cores" in t4.why_not("tf32") and "sm_75" in t4.why_not("tf32")
    assert "emulate bf16 slowly" in t4.why_not("bf16")
    assert all(a100.why_not(p) is None for p in ("fp32", "tf32", "fp16", "bf16"))
    assert "a CPU has no TF32" in cpu.why_not("tf32") and cpu.why_not("bf16") is None
    with pytest.raises(ValueError, match="precision"):
        t4.why_not("fp8")


def test_capability_rows_cover_every_capability():
    rows = env.capability_rows(_caps((7, 5)))
    assert [r["capability"] for r in rows] == ["bf16", "TF32 matmul", "fp8 tensor cores", "flash SDPA",
                                               "memory-efficient SDPA", "Triton (compiled)", "nvcc", "C++ compiler"]
    by = {r["capability"]: r for r in rows}
    assert by["bf16"]["here"] == "no" and by["nvcc"]["here"] == "no (no CUDA toolkit found)"
    cpu_rows = {r["capability"]: r for r in env.capability_rows(env.capabilities("cpu"))}
    assert "CPU autocast" in cpu_rows["bf16"]["here"]


def test_install_findings_on_this_cpu_machine(monkeypatch):
    monkeypatch.setenv(env.DEVICE_ENV_VAR, "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    findings = env.install_findings("cpu")
    if torch.version.cuda is None:
        assert "CPU-only build" in findings[0]
    else:
        assert "sees no GPU" in findings[0]
    monkeypatch.setattr(torch.version, "cuda", None)
    assert "CPU-only build" in env.install_findings("cpu")[0]


def test_install_findings_on_a_gpu(monkeypatch):
    """A T4 with a wheel that has sm_75: no arch finding; with a wheel that dropped it: 'cannot run'."""
    monkeypatch.setattr(env, "get_device", lambda device=None: torch.device("cuda", 0))
    monkeypatch.setattr(env, "capabilities", lambda device=None: _caps((7, 5)))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    findings = env.install_findings("cuda", arch_list=WHEEL_CU130)
    assert not any("sm_75" in f for f in findings)
    assert any("No native bf16" in f for f in findings) and any("No nvcc" in f for f in findings)
    findings = env.install_findings("cuda", arch_list=["sm_80", "sm_90"])
    assert any(f.startswith("This build cannot run on this GPU (sm_75)") for f in findings)
    monkeypatch.setattr(env, "capabilities", lambda device=None: _caps((9, 0), name="NVIDIA H100 80GB HBM3"))
    findings = env.install_findings("cuda", arch_list=["sm_80", "compute_80"])
    assert any("compiles the compute_80 PTX" in f and "starts faster" in f for f in findings)
    assert env.install_findings("cuda", arch_list=["sm_90"]) == ["No nvcc: notebook 06 skips its CUDA C++ extension "
                                                                "(the Triton kernel still runs). Install the CUDA "
                                                                "toolkit matching torch.version.cuda to build "
                                                                "extensions."]


# ── Burst against sustained ─────────────────────────────────────────────────────────────────────────────────


def test_instant_power_is_read_where_the_driver_has_it():
    import types

    class Value:  # NVML's c_nvmlFieldValue_t, as far as the reader looks
        def __init__(self, ret, milliwatts):
            self.nvmlReturn, self.valueType = ret, 1
            self.value = types.SimpleNamespace(uiVal=milliwatts)

    def reader(field_values):
        r = env._Reader(torch.device("cpu"))
        r._nvml = types.SimpleNamespace(NVML_FI_DEV_POWER_INSTANT=186, nvmlDeviceGetFieldValues=field_values)
        return r

    assert reader(lambda h, ids: [Value(0, 612_000)])._instant_power_w() == 612.0
    unsupported = reader(lambda h, ids: [Value(3, 0)])  # NVML_ERROR_NOT_SUPPORTED: fall back, and stop asking
    assert unsupported._instant_power_w() is None and unsupported._no_instant_power

    def broken(h, ids):
        raise RuntimeError("an old driver")

    assert reader(broken)._instant_power_w() is None
