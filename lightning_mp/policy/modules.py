"""The forward that runs a listed module in FP32 (its parameters are kept FP32 by the masters).

A listed module gets an instance ``forward`` (:class:`Fp32Forward`, in the module's ``__dict__``, where Fabric's
marked methods and accelerate's hooks put theirs): it upcasts the module's 16-bit inputs and calls the class's
``forward`` with autocast off for the module's device type (or, where the subtree holds 16-bit parameters, with FP32
as autocast's low-precision dtype), so the whole subtree (children included) computes in FP32. The class is never
touched, and ``remove()`` takes the instance ``forward`` out again.

A forward of our own, not a pre-hook and a forward hook, because ``torch.compile`` must trace the switch: Dynamo in
torch 2.11 traces no autocast setter (``torch.set_autocast_enabled`` is "marked as skipped"), only a
``with torch.autocast(...)`` block, and a block cannot open in one hook and close in another. Compiled, the block is
two nodes of the graph (``_enter_autocast``/``_exit_autocast``), and ``fullgraph=True`` compiles a model with listed
modules into as many graphs as without them. Eager, the block would cost ~20 us a call (``torch.autocast``'s
constructor checks the device and the dtype); the two setters cost ~1.5 us, so eager code calls those.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from lightning_mp.formats import HALF_DTYPES
from lightning_mp.policy.mode import _native_mixed_batch_norm


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


class Fp32Forward:
    """A listed module's ``forward`` in FP32, set on the instance by :meth:`Fp32Forwards.attach`.

    Upcasts 16-bit floating inputs (args and kwargs, nested, e.g. LSTM's ``(h, c)``) and runs the forward it
    stands in front of (the class's, or an instance ``forward`` that was there before) with autocast off for
    ``device_type``; autocast comes back on every way out, an exception included. Pre-hooks run before it and forward
    hooks after it, as around any ``forward``, and see the arguments as the caller gave them. Cost per call: a Python
    call, two autocast setters and the input upcast copies; ``nn.Module.__call__`` keeps its fast path (no hooks).

    BatchNorm layers (``_BatchNorm``: BatchNorm1d/2d/3d, SyncBatchNorm, the lazy ones) whose parameters and running
    statistics are FP32 take a 16-bit input as it is, on devices whose kernels run batch norm in mixed dtype (see
    ``_native_mixed_batch_norm``): statistics in FP32 inside, 16-bit output, and no FP32 copy of the activation
    for autograd to keep.

    It holds its module: ``copy.deepcopy`` and pickling of the model give the copy a forward of its own that runs the
    copy in FP32; ``remove()`` affects the original only."""

    def __init__(self, module: nn.Module, device_type: str, inner: Callable[..., Any] | None) -> None:
        self.module = module
        self.device_type = device_type
        self.inner = inner  # the instance forward found there (Fabric's, accelerate's); None: the class's
        self.active = True

    def remove(self) -> None:
        """Take this forward out (idempotent). Where something has since put its own forward in front of this one
        and calls it, this one passes calls through from then on."""
        self.active = False
        if self.module.__dict__.get("forward") is self:
            if self.inner is None:
                del self.module.__dict__["forward"]
            else:
                self.module.__dict__["forward"] = self.inner

    def _forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module, device_type = self.module, self.device_type
        if not self.active:
            return self._forward(args, kwargs)
        if not (
            isinstance(module, _BatchNorm)
            and args
            and _native_mixed_batch_norm(args[0], (*module._parameters.values(), *module._buffers.values()))
        ):
            args = _upcast_tree(args)
            kwargs = _upcast_tree(kwargs)
        if not torch.is_autocast_enabled(device_type):
            return self._forward(args, kwargs)
        if _holds_16_bit(module):
            # A subtree that holds a 16-bit parameter or buffer (a part loaded in bf16, no master weights) would raise
            # on mixed dtypes in its matmuls and norms with autocast off: autocast stays on with FP32 as its
            # low-precision dtype, so those cast their 16-bit arguments up (and the policy's kernels, if active,
            # upcast the listed ops). Dynamo traces this setter from torch 2.13 on (it guards on the dtypes); torch
            # 2.11's breaks the graph here, and fullgraph=True refuses it.
            previous = torch.get_autocast_dtype(device_type)
            torch.set_autocast_dtype(device_type, torch.float32)
            try:
                return self._forward(args, kwargs)
            finally:
                torch.set_autocast_dtype(device_type, previous)
        if torch.compiler.is_compiling():
            with torch.autocast(device_type, enabled=False):  # the one autocast switch torch 2.11's Dynamo traces
                return self._forward(args, kwargs)
        torch.set_autocast_enabled(device_type, False)
        try:
            return self._forward(args, kwargs)
        finally:
            torch.set_autocast_enabled(device_type, True)


class Fp32Forwards:
    """Puts FP32 forwards on the modules of one device type (``Fp32Policy.install``, the autopilot)."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type

    def attach(self, module: nn.Module) -> list[Fp32Forward]:
        """Put an FP32 forward on ``module`` in front of the one it has; returns it in a list, the handles to remove."""
        forward = Fp32Forward(module, self.device_type, module.__dict__.get("forward"))
        module.__dict__["forward"] = forward
        return [forward]


# Forwards that compute in FP32 without an FP32 forward wherever the policy's kernels are active: one call to an op the
# kernels compute in FP32 (they upcast its 16-bit inputs as the FP32 forward would; batch norm's takes a 16-bit input
# as it is where the FP32 forward would too), or none that autocast touches (an FP32 table's lookup is FP32).
# Subclasses that keep the forward count too. An FP32 forward costs ~230 Python bytecodes a call (the input walk, the
# setters; the forward hooks it replaced, ~400), the kernel ~50.
_ONE_OP_FORWARDS: dict[Callable[..., Any], str | None] = {
    nn.LayerNorm.forward: "layer_norm", nn.GroupNorm.forward: "group_norm", nn.RMSNorm.forward: "rms_norm",
    _BatchNorm.forward: "batch_norm", _InstanceNorm.forward: "instance_norm", nn.Embedding.forward: None,
}


def needs_fp32_forward(module: nn.Module, kernel_ops: frozenset[str] | None) -> bool:
    """Whether a kept module needs an :class:`Fp32Forward`; ``kernel_ops``: the ops the active kernels compute in
    FP32 wherever the module runs, ``None`` where no kernels are active (every kept module needs one then)."""
    if kernel_ops is None:
        return True
    op = _ONE_OP_FORWARDS.get(type(module).forward, "")
    return op is not None and op not in kernel_ops


class Fp32ModuleHandle:
    """Returned by ``Fp32Policy.install``; ``remove()`` takes every FP32 forward out again.

    Also a context manager (``with policy.install(model, "cpu"): ...``). Copies of the model made while installed
    (``copy.deepcopy``, pickling) carry FP32 forwards of their own and keep running those modules in FP32;
    ``remove()`` only affects the original modules."""

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

