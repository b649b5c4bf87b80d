"""Are 16-bit GEMMs native here: oneDNN's check, the probe, and the verdict's cache."""

from __future__ import annotations

import time

import pytest
import torch

import lightning_mp.gemm.support as gs
from lightning_mp.gemm.support import gemm_support

HALF = (torch.bfloat16, torch.float16)


pytestmark = pytest.mark.usefixtures("fresh_gemm_detection")


def mock_cpu(monkeypatch, onednn: bool, slowdown: float = 20.0):
    calls = []

    def probe(dtype):
        calls.append(dtype)
        return slowdown

    monkeypatch.setattr(gs, "_torch_reports_native", lambda dtype: onednn)
    monkeypatch.setattr(gs, "_probe_slowdown", probe)
    return calls


@pytest.mark.parametrize("dtype", HALF)
def test_cuda_is_native_without_probing(monkeypatch, dtype):
    calls = mock_cpu(monkeypatch, onednn=False)
    s = gemm_support("cuda", dtype)
    assert s.native and "CUDA" in s.reason and calls == []


@pytest.mark.parametrize("dtype", HALF)
def test_cpu_native_when_onednn_reports_it_without_probing(monkeypatch, dtype):
    calls = mock_cpu(monkeypatch, onednn=True)
    s = gemm_support("cpu", dtype)
    assert s.native and "oneDNN reports native" in s.reason and calls == []
    assert gs.cpu_capability() in s.reason


@pytest.mark.parametrize("dtype", HALF)
def test_cpu_not_native_when_the_probe_is_slow(monkeypatch, dtype):
    calls = mock_cpu(monkeypatch, onednn=False, slowdown=17.6)
    s = gemm_support("cpu", dtype)
    assert not s.native and s.slowdown == 17.6 and "17.6x the FP32 time" in s.reason
    gemm_support("cpu", dtype)
    assert calls == [dtype]  # probed once per process, not once per run


def test_cpu_native_when_the_probe_is_fast_even_if_onednn_says_no(monkeypatch):
    mock_cpu(monkeypatch, onednn=False, slowdown=1.1)  # e.g. ARM fp16 through torch's own NEON kernels
    assert gemm_support("cpu", torch.float16).native


def test_fp32_and_unprobed_devices_are_native(monkeypatch):
    calls = mock_cpu(monkeypatch, onednn=False)
    assert gemm_support("cpu", torch.float32).native
    assert gemm_support("mps", torch.float16).native
    assert calls == []


def test_real_detection_on_this_machine_is_quick_and_agrees_with_onednn():
    t0 = time.perf_counter()
    verdicts = {dtype: gemm_support("cpu", dtype) for dtype in HALF}
    assert time.perf_counter() - t0 < 1.0  # a few ms each; 1 s leaves room for a loaded 2-core machine
    if gs._torch_reports_native(torch.bfloat16):
        assert verdicts[torch.bfloat16].native
    for s in verdicts.values():
        assert s.native or s.slowdown >= gs._SLOW_FACTOR
