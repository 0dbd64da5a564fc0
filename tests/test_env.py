"""utils.env: device choice, capabilities, report."""

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
