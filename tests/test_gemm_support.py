"""Are 16-bit GEMMs fast here, per op family: the probe, the decision on its figures (injected, so every CPU kind
decides every row), the agreement of the ranks, and the verdict's cache."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

import lightning_mp.gemm.support as gs
from lightning_mp.gemm.emulation import GemmEmulation
from lightning_mp.gemm.ops import FAMILIES
from lightning_mp.gemm.support import gemm_support

HALF = (torch.bfloat16, torch.float16)

pytestmark = pytest.mark.usefixtures("fresh_gemm_detection")


def mock_cpu(monkeypatch, onednn: bool, slowdown: float | dict | None = None):
    """This CPU as one whose oneDNN check says ``onednn`` and whose probe measures ``slowdown`` (16-bit / FP32 time:
    one figure for every family, or a figure per family); by default the figures of a CPU the check is right about
    (1.0x where it says native, 20x where not). Returns the dtypes probed."""
    calls = []
    slowdown = (1.0 if onednn else 20.0) if slowdown is None else slowdown
    figures = slowdown if isinstance(slowdown, dict) else dict.fromkeys(FAMILIES, slowdown)

    def probe(dtype):
        calls.append(dtype)
        return dict(figures)

    monkeypatch.setattr(gs, "_torch_reports_native", lambda dtype: onednn)
    monkeypatch.setattr(gs, "_probe", probe)
    return calls


# Measured with this module's probe (1 thread, CPU time, torch 2.13.0), per family in FAMILIES' order: matmul, conv
# forward, conv input grad, conv weight grad. The AMD row's matmul is its figure in docs/benchmarks.md; its
# convolutions are the AVX2 simulation's (both run torch's fallback).
CPUS = {
    "Intel Xeon AVX512-FP16, fp16": (True, (1.2, 1.6, 1.5, 31.0), {"conv weight grad"}),
    "Intel Xeon AVX512-FP16, bf16 (AMX)": (True, (0.4, 0.8, 0.7, 1.0), set()),
    "AMD EPYC AVX512-BF16, bf16": (True, (0.3, 0.5, 0.5, 0.7), set()),
    "AMD EPYC AVX512-BF16, fp16": (False, (16.0, 10.9, 16.5, 12.4), set(FAMILIES)),
    "AVX2, fp16": (False, (28.2, 19.5, 16.3, 12.8), set(FAMILIES)),
    "AVX2, bf16 (its input gradient nearest the line)": (False, (23.3, 14.5, 4.1, 13.6), set(FAMILIES)),
    "ARM with fast fp16 NEON (oneDNN says no)": (False, (1.1, 1.3, 1.2, 1.4), set()),
}


@pytest.mark.parametrize("cpu", CPUS)
def test_each_cpu_kind_emulates_exactly_its_slow_families_and_says_which_run_native(monkeypatch, cpu):
    """The decision on each CPU kind's measured figures, whatever CPU runs the test."""
    onednn, figures, slow = CPUS[cpu]
    mock_cpu(monkeypatch, onednn, dict(zip(FAMILIES, figures)))
    gemm = GemmEmulation("auto")
    line = gemm.setup("cpu", torch.float16)
    assert gemm.families == slow and gemm.emulated is bool(slow) and gemm.support.native is not slow
    native = [f for f in FAMILIES if f not in slow]
    if slow and native:  # the one line names both sides
        assert f"native fp16 kernels for {', '.join(native)}; emulated " in line
        assert line.split("; emulated ")[1].split(";")[0].endswith(" for " + ", ".join(f for f in FAMILIES if f in slow))
    else:
        assert line.startswith("16-bit GEMMs: emulated (" if slow else "16-bit GEMMs: native fp16 kernels;")
    assert all(f"{f} {r:.1f}x" in line for f, r in zip(FAMILIES, figures))  # the figures behind it
    assert ("oneDNN reports native fp16" if onednn else "oneDNN reports no native fp16") in line


def test_the_xeon_fp16_convolution_weight_gradient_runs_in_fp32_while_the_rest_stays_native(monkeypatch):
    """On the Intel figures, a Conv2d + Linear step under the run's kernels: the weight gradient's convolution is
    computed in FP32, the forward, the input gradient and the matrix products in fp16; every gradient is fp16."""
    from tests.test_gemm_emulation import Recorder

    mock_cpu(monkeypatch, True, dict(zip(FAMILIES, CPUS["Intel Xeon AVX512-FP16, fp16"][1])))
    gemm = GemmEmulation("auto")
    gemm.setup("cpu", torch.float16)
    conv, linear = torch.nn.Conv2d(4, 8, 3, padding=1).half(), torch.nn.Linear(8 * 36, 3).half()
    x = torch.randn(2, 4, 6, 6).half().requires_grad_()
    recorder = Recorder()
    try:
        with recorder, gemm.context():
            linear(conv(x).flatten(1)).sum().backward()
    finally:
        gemm.remove()
    by_op = {}
    for op, dtypes in recorder.gemms():
        by_op.setdefault(op, []).append(dtypes)
    assert by_op["convolution"] == [{torch.float16}]
    # two calls: the input gradient natively in fp16, the weight and bias gradients in FP32
    assert sorted(by_op["convolution_backward"], key=str) == [{torch.float16}, {torch.float32}]
    assert all(dtypes == {torch.float16} for op, seen in by_op.items() if op not in ("convolution", "convolution_backward")
               for dtypes in seen)
    assert {p.grad.dtype for p in (*conv.parameters(), *linear.parameters())} == {torch.float16}
    assert x.grad.dtype == torch.float16


@pytest.mark.parametrize("dtype", HALF)
def test_cuda_is_native_without_probing(monkeypatch, dtype):
    calls = mock_cpu(monkeypatch, onednn=False)
    s = gemm_support("cuda", dtype)
    assert s.native and not s.slow and "CUDA" in s.reason and calls == []


@pytest.mark.parametrize("dtype", HALF)
def test_onednn_reporting_native_does_not_spare_the_probe(monkeypatch, dtype):
    """Supported is not fast: oneDNN's check is quoted, and the probe decides."""
    calls = mock_cpu(monkeypatch, onednn=True, slowdown={**dict.fromkeys(FAMILIES, 1.0), "conv weight grad": 80.0})
    s = gemm_support("cpu", dtype)
    assert calls == [dtype] and not s.native and s.slow == {"conv weight grad"} and s.slowdown == 80.0
    assert "oneDNN reports native" in s.reason and gs.cpu_capability() in s.reason


@pytest.mark.parametrize("dtype", HALF)
def test_cpu_not_native_when_the_probe_is_slow_and_probed_once_per_process(monkeypatch, dtype):
    calls = mock_cpu(monkeypatch, onednn=False, slowdown=17.6)
    s = gemm_support("cpu", dtype)
    assert not s.native and s.slowdown == 17.6 and "matmul 17.6x" in s.reason and s.slow == set(FAMILIES)
    gemm_support("cpu", dtype)
    assert calls == [dtype]  # probed once per process, not once per run


@pytest.mark.parametrize("figure, slow", [(1.99, False), (2.0, True)])
def test_the_line_is_2x_the_fp32_time(monkeypatch, figure, slow):
    mock_cpu(monkeypatch, onednn=True, slowdown={**dict.fromkeys(FAMILIES, 1.0), "conv forward": figure})
    assert gemm_support("cpu", torch.float16).slow == ({"conv forward"} if slow else set())


def test_fp32_and_unprobed_devices_are_native(monkeypatch):
    calls = mock_cpu(monkeypatch, onednn=False)
    assert gemm_support("cpu", torch.float32).native
    assert gemm_support("mps", torch.float16).native
    assert calls == []


def test_a_support_built_as_not_native_without_families_names_them_all():
    """The four-argument form (as tests and tools build it) keeps its meaning: not native is every family slow."""
    assert gs.GemmSupport("cpu", torch.float16, False, "why").slow == set(FAMILIES)
    assert gs.GemmSupport("cpu", torch.float16, True, "why").slow == set()


# ------------------------------------------------------------------------------------------------ the probe
class FakeClock:
    """``time.thread_time`` advanced by the calls the probe times: each family's FP32 and 16-bit op cost the seconds
    given (a list per op: one figure per call, the last repeated)."""

    def __init__(self, costs):
        self.now, self.costs, self.counts = 0.0, costs, {}

    def __call__(self):
        return self.now

    def calls(self, dtype):
        def op(family, which):
            def run():
                n = self.counts[(family, which)] = self.counts.get((family, which), 0) + 1
                seq = self.costs[family][which]
                self.now += seq[min(n - 1, len(seq) - 1)]
            return run

        return {f: (op(f, 0), op(f, 1)) for f in FAMILIES}


def test_the_probe_takes_the_best_of_interleaved_repeats_and_stops_timing_a_clear_fallback(monkeypatch):
    costs = {
        "matmul": ([9.0, 1.0, 1.2], [9.0, 5.0, 1.5, 1.1]),  # first calls pay kernel selection; a disturbed repeat
        "conv forward": ([1.0], [1.9]),
        "conv input grad": ([1.0], [2.5]),
        "conv weight grad": ([9.0, 1.0], [50.0, 80.0]),  # a fallback: 80x at the first timed repeat
    }
    clock = FakeClock(costs)
    monkeypatch.setattr(gs.time, "thread_time", clock)
    monkeypatch.setattr(gs, "_family_calls", clock.calls)
    ratios = gs._probe(torch.float16)
    assert ratios == pytest.approx({"matmul": 1.1, "conv forward": 1.9, "conv input grad": 2.5, "conv weight grad": 80.0})
    assert clock.counts[("conv weight grad", 1)] == 2  # the warm-up and one repeat: a fallback costs the most
    assert clock.counts[("matmul", 1)] == 1 + gs._PROBE_REPEATS


@pytest.mark.parametrize("dtype", HALF)
def test_the_real_probe_on_this_machine_leaves_the_threads_and_agrees_with_a_native_onednn(dtype):
    """Whatever this CPU is: every family measured and the thread count as it was (its cost, 6-32 ms of CPU time on
    the three CPU kinds, is measured by benchmarks/gemm_families.py, not here), also under a caller's autocast."""
    threads = torch.get_num_threads()
    gemm_support.cache_clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the FP32 timings stay FP32 (else matmul came out ~1x)
        s = gemm_support("cpu", dtype)
    assert torch.get_num_threads() == threads
    assert [f for f, _ in s.slowdowns] == list(FAMILIES) and all(r > 0 for _, r in s.slowdowns)
    if dtype == torch.bfloat16 and gs._torch_reports_native(dtype):  # bf16 in oneDNN: every family has a kernel
        assert s.native, s.reason


def test_this_xeons_fp16_weight_gradient_is_found_slow():
    """On an Intel Xeon with AVX512-FP16 and no AMX-FP16 (oneDNN's reference kernel for the fp16 weight gradient),
    the real probe finds that family slow; elsewhere there is nothing of this kind to check."""
    flags = open("/proc/cpuinfo").read() if gs.cpu_capability() == "AVX512" else ""
    if not ("avx512_fp16" in flags and "amx_fp16" not in flags and gs._torch_reports_native(torch.float16)):
        pytest.skip("not an AVX512-FP16 CPU without AMX-FP16")
    s = gemm_support("cpu", torch.float16)
    assert "conv weight grad" in s.slow and dict(s.slowdowns)["conv weight grad"] > 10, s.reason
    assert "matmul" not in s.slow, s.reason


# ------------------------------------------------------------------------------------------------ every rank
def fake_ranks(figures_per_rank):
    """Each rank (a thread) with its own probe figures agrees through a MAX all-reduce faked with a barrier; returns
    each rank's verdict."""
    world = len(figures_per_rank)
    barrier, tables, out = threading.Barrier(world, timeout=20), {}, {}

    def run(rank):
        def agree(values):
            tables[rank] = values.clone()
            barrier.wait()
            values.copy_(torch.stack([tables[r] for r in range(world)]).amax(0))
            barrier.wait()
            return values

        own = gs._verdict("cpu", torch.float16, dict(zip(FAMILIES, figures_per_rank[rank])))
        out[rank] = gs.agreed(own, agree)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [out[r] for r in range(world)]


def test_every_rank_emulates_the_families_any_rank_found_slow_with_the_same_text():
    """One rank's timing was disturbed and put the conv forward just over the line: every rank emulates it, and
    every rank's verdict reads the same (the largest figure of each family)."""
    supports = fake_ranks([(1.2, 1.9, 1.5, 31.0), (1.3, 2.1, 1.4, 29.0)])
    assert supports[0] == supports[1]
    assert supports[0].slow == {"conv forward", "conv weight grad"}
    assert "matmul 1.3x, conv forward 2.1x, conv input grad 1.5x, conv weight grad 31.0x" in supports[0].reason


def test_setup_agrees_through_the_function_it_is_given(monkeypatch):
    """GemmEmulation.setup hands the probe's figures to ``agree`` (the run passes agree_on_max_): another rank's
    slower forward moves this rank's decision; without ``agree`` (one process) the own figures decide."""
    mock_cpu(monkeypatch, onednn=True, slowdown=dict(zip(FAMILIES, (1.2, 1.6, 1.5, 31.0))))
    other_rank = torch.tensor([1.1, 2.4, 1.2, 40.0], dtype=torch.float64)
    seen = []

    def agree(values):
        seen.append(values.clone())
        return torch.maximum(values, other_rank, out=values)

    alone, together = GemmEmulation("auto"), GemmEmulation("auto")
    alone.setup("cpu", torch.float16, hold=False)
    together.setup("cpu", torch.float16, hold=False, agree=agree)
    assert alone.families == {"conv weight grad"} and together.families == {"conv weight grad", "conv forward"}
    assert torch.equal(seen[0], torch.tensor([1.2, 1.6, 1.5, 31.0], dtype=torch.float64))
    assert "conv forward 2.4x" in together.describe() and "conv weight grad 40.0x" in together.describe()


def test_unprobed_verdicts_make_no_collective():
    """CUDA decides the same everywhere: no all-reduce at setup (a collective on some ranks only would hang)."""
    called = []
    for device, dtype in itertools.product(("cuda", "mps"), HALF):
        support = gemm_support(device, dtype)
        assert gs.agreed(support, called.append) is support
    assert called == []
