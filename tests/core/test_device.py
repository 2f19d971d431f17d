"""rlfunc.device on this CPU-only machine (no CUDA, no torch_npu), with stand-ins for the others."""

import importlib.util
from types import SimpleNamespace

import pytest
import torch

import rlfunc.device as D
from rlfunc.device import autocast_dtype, distributed_backend, npu_available, resolve_device, supports_vmap
from rlfunc.errors import ConfigError

HAS_CUDA = torch.cuda.is_available()
HAS_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None


@pytest.mark.skipif(HAS_CUDA or HAS_TORCH_NPU, reason="expects a CPU-only machine")
def test_auto_is_cpu_here():
    assert not npu_available()
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device() == torch.device("cpu")


def test_auto_prefers_npu_then_cuda(monkeypatch):
    monkeypatch.setattr(D, "npu_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")


@pytest.mark.parametrize("name, expected", [("cpu", torch.device("cpu")), ("cpu:0", torch.device("cpu", 0))])
def test_cpu_names(name, expected):
    got = resolve_device(name)
    assert isinstance(got, torch.device) and got == expected and got.type == "cpu"


def test_torch_device_passes_through():
    dev = torch.device("cpu", 0)
    assert resolve_device(dev) is dev


@pytest.mark.parametrize("name", ["gpu", "CPU", "tpu", "", "cuda0", "mps", "cpu:abc", "cpu:-1"])
def test_bad_names_raise_config_error_naming_the_value(name):
    with pytest.raises(ConfigError) as info:
        resolve_device(name)
    assert repr(name) in str(info.value)
    assert "expected one of auto, cpu, cuda, npu" in str(info.value)


@pytest.mark.skipif(HAS_TORCH_NPU, reason="torch_npu is installed here")
@pytest.mark.parametrize("name", ["npu", "npu:0"])
def test_npu_without_torch_npu_raises(name):
    with pytest.raises(ConfigError, match="torch_npu") as info:
        resolve_device(name)
    assert repr(name) in str(info.value)


@pytest.mark.skipif(HAS_CUDA, reason="this machine has CUDA")
def test_cuda_without_cuda_raises():
    with pytest.raises(ConfigError, match="no CUDA device"):
        resolve_device("cuda:0")


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        resolve_device("gpu")


def test_distributed_backend():
    assert distributed_backend(torch.device("cpu")) == "gloo"
    assert distributed_backend(torch.device("cuda")) == "nccl"
    assert distributed_backend(torch.device("cuda", 1)) == "nccl"
    # torch.device("npu") needs torch_npu registered; the function only reads ``.type``.
    assert distributed_backend(SimpleNamespace(type="npu")) == "hccl"
    assert distributed_backend(SimpleNamespace(type="meta")) == "gloo"


def test_supports_vmap():
    assert supports_vmap(torch.device("cpu"))
    assert supports_vmap(torch.device("cuda"))
    assert not supports_vmap(SimpleNamespace(type="npu"))


def test_autocast_dtype():
    assert autocast_dtype(torch.device("cpu")) is torch.bfloat16
    assert autocast_dtype(SimpleNamespace(type="npu")) is torch.float16


@pytest.mark.parametrize("bf16, expected", [(True, torch.bfloat16), (False, torch.float16)])
def test_autocast_dtype_cuda(monkeypatch, bf16, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    assert autocast_dtype(torch.device("cuda")) is expected


def test_span_is_a_no_op_unless_a_profiler_records(tmp_path):
    import contextlib

    from rlfunc.device import profiler, span

    assert isinstance(span("x"), contextlib.nullcontext)
    with profiler(torch.device("cpu"), str(tmp_path), wait=0, warmup=0, active=1, worker="w") as prof:
        assert isinstance(span("x"), torch.profiler.record_function)
        with span("the_range"):
            torch.ones(3).sum()
        prof.step()
    (trace,) = tmp_path.glob("w*.pt.trace.json")
    assert '"the_range"' in trace.read_text()


def test_set_threads_caps_at_the_cores_this_process_may_use(monkeypatch):
    # Regression: `--torch-threads 100000` made torch's thread pool crash the process (exit 139),
    # leaving a run dir that a rerun refused as not empty. It is capped at the cores, with a warning.
    import os
    import warnings

    from rlfunc.device import set_threads

    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
        with pytest.warns(UserWarning, match="torch_threads=100000: this process may run on 2 cores; using 2"):
            assert set_threads(100000) == 2
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # within the cores: no warning
            assert set_threads(1) == 1
            assert set_threads(0) == 1  # 0: torch's setting is left as it is
    finally:
        torch.set_num_threads(before)


def test_a_run_with_more_torch_threads_than_cores_trains(tmp_path):
    # Regression: the input that crashed the process; in a subprocess, so that old code's segfault fails
    # only this test.
    import subprocess
    import sys

    code = ("from rlfunc.algos.ppo import preset; from rlfunc.run import train; "
            f"train(preset('CartPole-v1', total_steps=256, torch_threads=100000, device='cpu'), {str(tmp_path / 'r')!r}, "
            "progress=False, tensorboard=False, evaluate=False)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "torch_threads=100000: this process may run on" in done.stderr
    assert (tmp_path / "r" / "metrics.jsonl").read_text().count("\n") == 1
