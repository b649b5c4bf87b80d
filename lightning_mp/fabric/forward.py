"""What Fabric's module wrapper enters around each forward: ``MixedPrecisionPlugin.forward_context()``.

In order: the one-time set-up at the first forward (:mod:`.first_call`), the copies' refresh where their masters
changed (``core.begin``), the FP32 policy's kernels switched on and the emulated GEMMs' held until the end of the
backward (:mod:`.kernels`), then autocast to the 16-bit format (with the policy's torch-function fallback and the
GEMMs' emulation where those exist: :func:`lightning_mp.core.contexts.forward_context`). A forward under ``no_grad``
(evaluation) has no backward to end its span: the kernels go off when it ends.

Cost: a plain object with ``__enter__``/``__exit__`` (a generator-based context manager costs a generator, two
resumptions and their exception plumbing per forward), autocast entered alone where there is no fallback and no
emulation (no ``ExitStack``); a tiny MLP's forward pays a few microseconds here (``benchmarks/fabric_benchmark.py``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from lightning_mp.core.contexts import forward_context


class ForwardContext:
    """One forward's context; a fresh object per ``forward_context()`` call, so forwards can nest."""

    __slots__ = ("_plugin", "_inner", "_opened")

    def __init__(self, plugin: Any) -> None:
        self._plugin = plugin
        self._inner: contextlib.AbstractContextManager | None = None
        self._opened = False  # whether this forward switched the kernels on (a nested one finds them on)

    def __enter__(self) -> None:
        plugin = self._plugin
        core = plugin.core
        plugin._first_forward.set_up()
        ladder = plugin._ladder
        if ladder.starts is None and ladder.scheduled and core.sharded:  # until the first optimizer.step() resolves it
            ladder.refuse_gather_changes(core)  # FSDP2: a schedule it cannot follow, refused before the first step
        core.begin(force=plugin._force_refresh)
        plugin._force_refresh = False
        fmt = core.format
        if fmt.is_16bit:
            self._opened = plugin._kernels.forward()  # registered once; switched on until the backward's end
        # the hold is active: the context adds autocast (and the policy's fallback mode or the GEMMs' emulation)
        inner = forward_context(fmt, core.device_type, core.policy, plugin._kernels, core.gemm)
        try:
            inner.__enter__()
        except BaseException:
            self._end()
            raise
        self._inner = inner

    def __exit__(self, *exc_info: Any) -> None:
        try:
            self._inner.__exit__(*exc_info)
        finally:
            self._end()

    def _end(self) -> None:
        if self._opened and not torch.is_grad_enabled():  # no backward follows (evaluation): the kernels off now
            self._plugin._kernels.backward_done()
