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
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_mp.core.contexts import forward_context

# What the inputs' fast path keeps as it is (anything else: lightning_utilities' apply_to_collection, as Fabric's own)
_LEAVES = frozenset({int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device})


def cast_inputs(data: Any, dtype: torch.dtype) -> Any:
    """Every floating tensor in ``data`` as ``dtype`` (the others as they are), as Fabric's own ``convert_input``.

    Fabric passes ``(args, kwargs)``, a tuple of a tuple and a dict, which lightning_utilities' fast path does not
    take: its general path costs ~30 us a forward (3% of a tiny MLP's ~1.1 ms CPU step; Fabric's own ``bf16-mixed``
    pays it too). Plain tuples, lists and dicts of tensors and scalars are rebuilt here (~5 us); anything else inside
    (a named tuple, a dataclass, a custom object) sends the whole input through ``apply_to_collection``, which keeps
    its type. The structure is checked first, so no tensor is cast twice."""
    if _plain(data):
        return _cast(data, dtype)
    return apply_to_collection(data, Tensor, _cast, dtype)  # _cast(tensor, dtype) on each tensor it finds


def _plain(data: Any) -> bool:
    """Whether ``data`` holds only tensors and scalars in plain tuples, lists and dicts (types only, nothing cast)."""
    if isinstance(data, Tensor):
        return True
    cls = data.__class__
    if cls is tuple or cls is list:
        return all(map(_plain, data))
    if cls is dict:
        return all(map(_plain, data.values()))
    return cls in _LEAVES


def _cast(data: Any, dtype: torch.dtype) -> Any:
    if isinstance(data, Tensor):
        return data.to(dtype) if data.is_floating_point() else data
    cls = data.__class__
    if cls is tuple:
        return tuple([_cast(item, dtype) for item in data])
    if cls is list:
        return [_cast(item, dtype) for item in data]
    if cls is dict:
        return {key: _cast(value, dtype) for key, value in data.items()}
    return data


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
