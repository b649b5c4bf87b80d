"""Module hooks that run a listed module's forward in FP32 (its parameters are kept FP32 by the masters).

Forward hooks, so a module's ``forward`` is never replaced and ``remove()`` restores it exactly. The pre-hook
upcasts the inputs and switches autocast off for the module's device type, so the whole subtree (children
included) computes in FP32 with the FP32 parameters it has; the post-hook switches it back. Both are plain
tensor ops and autocast toggles that Dynamo traces into the graph, so ``torch.compile(fullgraph=True)`` compiles
a model with listed modules into as many graphs as without them.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_mp.formats import HALF_DTYPES
from lightning_mp.fp32_mode import _native_mixed_batch_norm

# --------------------------------------------------------------------------------------
# Module hooks.
# --------------------------------------------------------------------------------------

# Per-thread stack of (module, device_type, autocast_was_enabled) for FP32 forwards in
# progress. Autocast state is thread-local, so the bookkeeping is too; kept at module
# level (not on the hook object) so that installed models stay deep-copyable/picklable.
_FORWARD_FRAMES = threading.local()


def _frames() -> list[tuple[nn.Module, str, bool]]:
    frames = getattr(_FORWARD_FRAMES, "stack", None)
    if frames is None:
        frames = _FORWARD_FRAMES.stack = []
    return frames


def _upcast_tree(obj: Any) -> Any:
    """``obj`` with 16-bit floating tensors as FP32, recursing into tuples (namedtuples such as PackedSequence
    included), lists and dicts. Containers are rebuilt unconditionally: Dynamo cannot trace identity tests on
    them, and rebuilding a few-element tuple costs less than a microsecond. ``.float()`` is differentiable: the
    backward casts the gradient back to 16 bits."""
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.dtype in HALF_DTYPES else obj
    if isinstance(obj, tuple):
        items = [_upcast_tree(item) for item in obj]
        if hasattr(obj, "_fields"):  # namedtuple, PackedSequence
            return type(obj)(*items)
        return tuple(items) if type(obj) is tuple else type(obj)(items)
    if isinstance(obj, list):
        return [_upcast_tree(item) for item in obj]
    if isinstance(obj, dict):
        result = obj.copy()  # keeps the dict subclass (e.g. OrderedDict)
        for key, value in obj.items():
            result[key] = _upcast_tree(value)
        return result
    return obj


class _Fp32ForwardHooks:
    """Forward pre-hook + always-called forward hook that run a module's forward in FP32.

    The pre-hook upcasts 16-bit floating inputs (args and kwargs, nested, e.g.
    LSTM's ``(h, c)``) and disables autocast for ``device_type``; the post-hook is
    registered with ``always_call=True`` so it restores autocast even when forward
    raises. (A BaseException such as KeyboardInterrupt skips it, but the enclosing
    ``torch.autocast`` block restores its state on exit anyway.) Cost per call: two
    Python hook calls plus the input upcast copies.

    BatchNorm layers (``_BatchNorm``: BatchNorm1d/2d/3d, SyncBatchNorm, the lazy ones) whose parameters and
    running statistics are FP32 take a 16-bit input as it is, on devices whose kernels run batch norm in
    mixed dtype (see ``_native_mixed_batch_norm``): statistics in FP32 inside, 16-bit output, and no FP32
    copy of the activation for autograd to keep."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type

    def pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not (
            isinstance(module, _BatchNorm)
            and args
            and _native_mixed_batch_norm(args[0], (*module._parameters.values(), *module._buffers.values()))
        ):
            args = _upcast_tree(args)
            kwargs = _upcast_tree(kwargs)
        # install() checked that autocast knows device_type
        was_enabled = torch.is_autocast_enabled(self.device_type)
        _frames().append((module, self.device_type, was_enabled))
        if was_enabled:
            torch.set_autocast_enabled(self.device_type, False)
        return args, kwargs

    def post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        frames = _frames()
        # Only undo a frame this module pushed: if our own pre-hook never ran (an
        # earlier pre-hook raised), there is nothing to restore.
        if frames and frames[-1][0] is module:
            _, device_type, was_enabled = frames.pop()
            if was_enabled:
                torch.set_autocast_enabled(device_type, True)
        return None


class Fp32ModuleHandle:
    """Returned by ``Fp32Policy.install``; ``remove()`` takes every hook out again.

    Also a context manager (``with policy.install(model, "cpu"): ...``).
    Copies of the model made while installed (``copy.deepcopy``) carry the hooks
    with them and keep running those modules in FP32; ``remove()`` only affects
    the original modules."""

    def __init__(self, modules: tuple[nn.Module, ...], handles: list[Any]) -> None:
        self.modules = modules
        self._handles = handles

    def remove(self) -> None:
        """Restore the original forward behaviour exactly (idempotent)."""
        while self._handles:
            self._handles.pop().remove()

    def __enter__(self) -> Fp32ModuleHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "installed" if self._handles else "removed"
        return f"Fp32ModuleHandle({len(self.modules)} modules, {state})"
