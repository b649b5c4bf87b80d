"""Each op family of a model, timed in FP32, with torch's native 16-bit kernels and emulated (FP32 on the 16-bit values,
rounded once): what ``gemm="auto"`` decides on (``lightning_mp.gemm.support``), at a model's sizes.

    python benchmarks/gemm_families.py                      # fp16 and bf16, the demo ResNet's 64x32x16x16 conv
    python benchmarks/gemm_families.py --dtype fp16 --rounds 9 --conv 64 32 16 --mm 2048 256 1024

One thread, CPU time of this thread (``time.thread_time``: other processes' time is not in it), the variants
interleaved within each round, the median over rounds. Prints the CPU's torch capability, oneDNN's own check and the
plugin's verdict (its probe runs on small sizes, once per process) beside the figures.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lightning_mp.gemm.emulation import EmulatedGemmMode
from lightning_mp.gemm.ops import FAMILIES
from lightning_mp.gemm.support import _torch_reports_native, cpu_capability, gemm_support

aten = torch.ops.aten
CONV = ([1, 1], [1, 1], [1, 1], False, [0, 0], 1)  # stride, padding, dilation, transposed, output padding, groups
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def family_calls(t: tuple[torch.Tensor, ...]) -> dict:
    a, b, x, w, g = t
    return {
        "matmul": lambda: torch.mm(a, b),
        "conv forward": lambda: aten.convolution(x, w, None, *CONV),
        "conv input grad": lambda: aten.convolution_backward(g, x, w, None, *CONV, [True, False, False]),
        "conv weight grad": lambda: aten.convolution_backward(g, x, w, None, *CONV, [False, True, False]),
    }


def timed(call, mode=None) -> float:
    start = time.thread_time()
    if mode is None:
        call()
    else:
        with mode:
            call()
    return time.thread_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median is printed")
    parser.add_argument("--conv", nargs=3, type=int, default=[64, 32, 16], metavar=("N", "C", "HW"),
                        help="a 3x3 convolution C->C on N images of HWxHW (default: the demo ResNet's second stage)")
    parser.add_argument("--mm", nargs=3, type=int, default=[2048, 256, 1024], metavar=("M", "K", "N"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    (n, c, hw), (m, k, n_out) = args.conv, args.mm
    fp32 = tuple(torch.randn(s, generator=gen) for s in ((m, k), (k, n_out), (n, c, hw, hw), (c, c, 3, 3), (n, c, hw, hw)))
    print(f"torch {torch.__version__}, CPU capability {cpu_capability()}, 1 thread, CPU time, median of "
          f"{args.rounds} interleaved rounds; conv 3x3 {n}x{c}x{hw}x{hw}, mm {m}x{k}x{n_out}")
    for name in args.dtype:
        dtype = DTYPES[name]
        support = gemm_support("cpu", dtype)
        print(f"\n{name}: oneDNN reports {'native' if _torch_reports_native(dtype) else 'no native'} {name}; the plugin's "
              f"probe: {support.reason}; emulated under gemm='auto': {sorted(support.slow) or 'none'}")
        calls32, calls16 = family_calls(fp32), family_calls(tuple(t.to(dtype) for t in fp32))
        times: dict[tuple[str, str], list[float]] = {}
        for family in FAMILIES:
            variants = {"FP32": (calls32[family], None), f"native {name}": (calls16[family], None),
                        f"emulated {name}": (calls16[family], EmulatedGemmMode(dtype))}
            for variant, (call, mode) in variants.items():
                timed(call, mode)  # first calls build the kernels
            for _ in range(args.rounds):
                for variant, (call, mode) in variants.items():
                    times.setdefault((family, variant), []).append(timed(call, mode))
        print(f"| op family | FP32 ms | native {name} ms (x FP32) | emulated {name} ms (x FP32) |")
        print("|---|---|---|---|")
        for family in FAMILIES:
            ms = [statistics.median(times[(family, v)]) * 1e3 for v in ("FP32", f"native {name}", f"emulated {name}")]
            print(f"| {family} | {ms[0]:.2f} | {ms[1]:.2f} ({ms[1] / ms[0]:.2f}x) | {ms[2]:.2f} ({ms[2] / ms[0]:.2f}x) |")


if __name__ == "__main__":
    main()
