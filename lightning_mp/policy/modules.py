"""Module hooks that run a listed module's forward in FP32 (its parameters are kept FP32 by the masters).

Forward hooks, so a module's ``forward`` is never replaced and ``remove()`` restores it exactly. The pre-hook
upcasts the inputs and switches autocast off for the module's device type (or, where the subtree holds 16-bit
parameters, makes FP32 its low-precision dtype), so the whole subtree (children included) computes in FP32; the
post-hook switches it back. Both are plain tensor ops and autocast setters that Dynamo traces into the graph, so
``torch.compile(fullgraph=True)`` compiles a model with listed modules into as many graphs as without them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from lightning_mp.formats import HALF_DTYPES
from lightning_mp.policy.mode import _native_mixed_batch_norm

# --------------------------------------------------------------------------------------
# Module hooks.
# --------------------------------------------------------------------------------------

class _Frames(threading.local):
    """Per-thread stack of (module, device_type, autocast was enabled, autocast dtype before if it was set to
    FP32 instead) for FP32 forwards in progress. Autocast
    state is thread-local, so the bookkeeping is too; kept at module level (not on the hook object) so that
    installed models stay deep-copyable/picklable. The list exists from a thread's first access on (``__init__``
    runs per thread): a lazily created one would make Dynamo recompile once it appears."""

    def __init__(self) -> None:
        self.stack: list[tuple[nn.Module, str, bool, torch.dtype | None]] = []


_FORWARD_FRAMES = _Frames()


def _frames() -> list[tuple[nn.Module, str, bool, torch.dtype | None]]:
    return _FORWARD_FRAMES.stack


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


def _holds_16_bit(module: nn.Module) -> bool:
    """Whether a 16-bit floating parameter or buffer sits in the module's subtree. A leaf (norm layers, RNNs,
    embeddings) reads its own two dicts (under a microsecond); a container walks its subtree."""
    for mod in module.modules() if module._modules else (module,):
        for tensor in (*mod._parameters.values(), *mod._buffers.values()):
            if tensor is not None and tensor.dtype in HALF_DTYPES:
                return True
    return False


class Fp32ForwardHooks:
    """Forward pre-hook + always-called forward hook that run a module's forward in FP32.

    The pre-hook upcasts 16-bit floating inputs (args and kwargs, nested, e.g.
    LSTM's ``(h, c)``) and switches autocast off for ``device_type`` (see ``pre`` for
    subtrees with 16-bit parameters); the post-hook is registered with
    ``always_call=True`` so it restores autocast even when forward raises. (A
    BaseException such as KeyboardInterrupt skips it, but the enclosing
    ``torch.autocast`` block restores its state on exit anyway.) Cost per call: two
    Python hook calls (a few microseconds) plus the input upcast copies.

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
        # FP32 through the whole subtree: autocast off for it (its ops then see the FP32 inputs and parameters;
        # nothing at the autocast keys runs). A subtree that holds a 16-bit parameter or buffer (a part loaded in
        # bf16, no master weights) would then raise on mixed dtypes in its matmuls and norms: there autocast stays
        # on with FP32 as its low-precision dtype, so those cast their 16-bit arguments up (and the policy's
        # kernels, if active, upcast the listed ops). Dynamo traces the autocast calls into the graph and guards
        # on the parameter dtypes; install() checked that autocast knows device_type.
        enabled = torch.is_autocast_enabled(self.device_type)
        previous = torch.get_autocast_dtype(self.device_type) if enabled and _holds_16_bit(module) else None
        _frames().append((module, self.device_type, enabled, previous))
        if previous is not None:
            torch.set_autocast_dtype(self.device_type, torch.float32)
        elif enabled:
            torch.set_autocast_enabled(self.device_type, False)
        return args, kwargs

    def attach(self, module: nn.Module) -> list[Any]:
        """Hook ``module``: the pre-hook appended (runs right before forward), the post-hook prepended (runs right
        after it), so the FP32 region is as tight as hooks allow. Returns the two handles."""
        return [
            module.register_forward_pre_hook(self.pre, with_kwargs=True),
            module.register_forward_hook(self.post, prepend=True, always_call=True),
        ]

    def post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        frames = _frames()
        # Only undo a frame this module pushed: if our own pre-hook never ran (an
        # earlier pre-hook raised), there is nothing to restore.
        if frames and frames[-1][0] is module:
            _, device_type, enabled, previous = frames.pop()
            if previous is not None:
                torch.set_autocast_dtype(device_type, previous)
            elif enabled:
                torch.set_autocast_enabled(device_type, True)
        return None


# Forwards that compute in FP32 without hooks wherever the policy's kernels are active: one call to an op the kernels
# compute in FP32 (they upcast its 16-bit inputs as the pre-hook would; batch norm's takes a 16-bit input as it is
# where the hooks would too), or none that autocast touches (an FP32 table's lookup is FP32). Subclasses that keep the forward count too. Hooks cost ~350 Python bytecodes per call
# (nn.Module's hooked call path, the two hooks, the input walk), seven times the kernel's.
_ONE_OP_FORWARDS: dict[Callable[..., Any], str | None] = {
    nn.LayerNorm.forward: "layer_norm", nn.GroupNorm.forward: "group_norm", nn.RMSNorm.forward: "rms_norm",
    _BatchNorm.forward: "batch_norm", _InstanceNorm.forward: "instance_norm", nn.Embedding.forward: None,
}


def needs_hooks(module: nn.Module, kernel_ops: frozenset[str] | None) -> bool:
    """Whether a kept module's forward needs the FP32 hooks; ``kernel_ops``: the ops the active kernels compute in
    FP32 wherever the module runs, ``None`` where no kernels are active (every kept module needs them then)."""
    if kernel_ops is None:
        return True
    op = _ONE_OP_FORWARDS.get(type(module).forward, "")
    return op is not None and op not in kernel_ops


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


def refuse_16_bit_batch_norm(root: nn.Module, keeps_fp32: Callable[[nn.Module], bool], ops: frozenset[str]) -> None:
    """Raise where a BatchNorm would get 16-bit weights beside its FP32 running statistics with ``batch_norm`` not
    in ``fp32_ops``: torch's batch_norm kernels refuse that mix ("expected scalar type BFloat16 but found Float")
    on the first forward. Listed, the policy's kernel upcasts all of it; kept FP32, the weights match the
    statistics."""
    if "batch_norm" in ops:
        return
    for name, module in root.named_modules():
        if isinstance(module, _BatchNorm) and module.affine and module.track_running_stats and not keeps_fp32(module):
            raise ValueError(
                f"{type(module).__name__} {name!r} would run with 16-bit weights and FP32 running statistics, which "
                "torch's batch_norm refuses: fp32_modules leaves it out and fp32_ops has no 'batch_norm'. HINT: keep "
                "'batch_norm' in fp32_ops or the BatchNorm classes (NORM_MODULES) in fp32_modules, as the defaults do."
            )

