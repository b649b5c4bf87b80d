"""The Python fallback of the op policy: a torch-function mode for listed names no autocast kernel reaches.

Most listed ops become FP32 through kernels at the autocast dispatch keys (:mod:`lightning_mp.policy.dispatch`).
A pure-Python composite (``F.softmin``, ``F.normalize``, a user-added ``F.softsign``...) has no aten op of its
own: it is FP32 through the listed aten ops it calls (:mod:`lightning_mp.policy.aten`), and when those are not
listed, ``Fp32Policy.op_context()`` pushes the mode below for it (``Fp32Policy.python_only_ops``; none with the
default list). The helpers here are shared with the module hooks.

What "an op runs in FP32" means
-------------------------------
The contract is the one of autocast's FP32 list: every 16-bit floating tensor
argument (float16 / bfloat16, also inside tuples, lists and dicts) is upcast to
float32, the op runs with autocast disabled for the devices of its tensors (so
an op that autocast would lower, e.g. a user-added ``"matmul"``, is not cast
back down), and the result is therefore FP32. (Ops that take a ``dtype=``
argument -- softmax, log_softmax, sum, mean, prod, cumsum, cumprod, the linalg
norms -- are instead called with ``dtype=torch.float32``, as CUDA autocast does:
same result, and kernels that can convert on the fly skip the FP32 copy of the
input.) Integer and bool tensors, FP32
and FP64 tensors are passed through unchanged. Calls with an explicit ``dtype=``
or ``out=`` are left exactly as written (the caller chose the precision;
autocast does the same). In-place variants (``exp_``, ``__ipow__``) can never
be FP32 -- they must write into the 16-bit tensor -- and are rejected.

What the mode costs
-------------------
While the mode is pushed, *every* torch call made from Python (functions, ``Tensor`` methods, even attribute
reads such as ``x.shape``) first goes through its ``__torch_function__``: one dict lookup plus the re-call, a
fixed ~1 us per torch call whatever the tensor size (a small GPT forward makes ~100-150 such calls); a listed
call adds ~10 us of bookkeeping plus the upcast copies. The mode is thread-local and not replayed by activation
checkpointing (use ``Fp32Policy.checkpoint_context_fn()``); Dynamo traces through it (one mode object per
policy, so compiled graphs stay valid). The body of a Python-level torch function runs with the mode suspended,
so only the composite itself is intercepted, not what it calls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import repeat
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_mp.formats import HALF_DTYPES, upcast

# --------------------------------------------------------------------------------------
# Upcasting and autocast toggling (shared by the op mode and the module hooks).
# --------------------------------------------------------------------------------------


def _to_fp32(obj: Any, devices: set[str] | None) -> Any:
    """Return ``obj`` with 16-bit floating tensors upcast to float32, recursing into
    tuples (incl. namedtuples such as PackedSequence), lists and dicts. Containers
    that hold nothing to upcast are returned as the same object. If ``devices`` is
    given, the device type of every tensor seen is added to it."""
    if isinstance(obj, torch.Tensor):
        if devices is not None:
            # is_cpu is a flag read; building device.type allocates, so only for non-CPU.
            devices.add("cpu" if obj.is_cpu else obj.device.type)
        return upcast(obj)
    if isinstance(obj, (tuple, list)):
        return _to_fp32_seq(obj, devices)
    if isinstance(obj, dict):
        changed = {key: _to_fp32(value, devices) for key, value in obj.items()}
        if all(changed[key] is value for key, value in obj.items()):
            return obj
        result = obj.copy()  # keeps the dict subclass (e.g. OrderedDict)
        result.update(changed)
        return result
    return obj


def _to_fp32_seq(seq: tuple[Any, ...] | list[Any], devices: set[str] | None) -> Any:
    # A plain loop: this runs on every listed op, and is cheaper than a comprehension
    # + all(zip(...)) for the usual 1-3 arguments.
    items: list[Any] | None = None
    for i, item in enumerate(seq):
        new = _to_fp32(item, devices)
        if new is not item:
            if items is None:
                items = list(seq)
            items[i] = new
    if items is None:
        return seq
    if type(seq) is tuple:
        return tuple(items)
    if type(seq) is list:
        return items
    if isinstance(seq, tuple) and hasattr(seq, "_fields"):  # namedtuple, PackedSequence
        return type(seq)(*items)
    return type(seq)(items)


_NO_AUTOCAST_DEVICES: set[str] = set()  # device types autocast does not know (meta, ...)
_any_autocast_enabled: Callable[[], bool] = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def _autocast_enabled(device_type: str) -> bool:
    if device_type in _NO_AUTOCAST_DEVICES:
        return False
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:
        _NO_AUTOCAST_DEVICES.add(device_type)
        return False


# Batch norm in mixed dtype. torch 2.13's CPU kernels and CUDA's (native and cuDNN) take a 16-bit input with
# FP32 weight, bias and running statistics: mean and variance are accumulated in FP32 inside the kernel, the
# running statistics are updated in FP32, the output and the input gradient are 16-bit, the weight and bias
# gradients FP32 (the arrangement cuDNN and autocast use). That is everything _WHY_NORM_LAYER asks for, and it
# saves what an upcast costs: autograd keeps the tensor batch_norm was given, so a `.float()` before it stores
# an FP32 copy of every normalised activation (in a ResNet, about half of all saved activations) and hands an
# FP32 output to the next layer. Other devices (and 16-bit weights or statistics) keep the upcast.
_NATIVE_MIXED_BATCH_NORM_DEVICES = frozenset({"cpu", "cuda"})
_BATCH_NORM_FUNCS = frozenset({F.batch_norm, torch.batch_norm, torch.native_batch_norm})
_FLAT = frozenset({torch.Tensor, nn.Parameter, type(None), float, bool, int})  # not nested, no subclass to trace
_NOT_FP32 = frozenset({torch.float16, torch.bfloat16, torch.float64})  # floating and not FP32


def _native_mixed_batch_norm(input: Any, others: Iterable[Any]) -> bool:  # noqa: A002 (torch's name)
    """Whether batch norm can take ``input`` as it is: a 16-bit tensor on a device whose kernels run mixed
    dtype, and every floating tensor in ``others`` (nested tuples/lists/dicts, or a module's parameters and
    buffers) FP32. ``None`` and non-floating entries (``num_batches_tracked``, flags, eps) do not matter."""
    if not isinstance(input, torch.Tensor) or input.dtype not in HALF_DTYPES:
        return False
    if not (input.is_cpu or input.device.type in _NATIVE_MIXED_BATCH_NORM_DEVICES):
        return False
    if isinstance(others, tuple) and not {*map(type, others)} - _FLAT:  # batch_norm's own arguments: C-level passes
        return not {*map(getattr, others, repeat("dtype"), repeat(None))} & _NOT_FP32
    stack = list(others)
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.is_floating_point() and item.dtype != torch.float32:
                return False
        elif isinstance(item, (tuple, list)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return True


def _call_fp32(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any] | None, set_dtype: bool
) -> Any:
    """Run one listed op in FP32 (see the module docstring for the contract).

    ``set_dtype``: the op takes ``dtype=`` (softmax, sum, cumsum, ...). Then a 16-bit
    input is not copied to FP32 first; the op is called with ``dtype=torch.float32``
    instead, as CUDA autocast does. Same result, but kernels that convert on the fly
    skip a full FP32 copy of the input (CUDA softmax reads fp16 and writes fp32 in
    one pass); where a kernel cannot (CPU softmax), ATen makes the copy itself.

    Batch norm with a 16-bit input and FP32 weight/statistics is called as it is (its kernels compute the
    statistics in FP32; see ``_native_mixed_batch_norm``): the result is then 16-bit, not FP32."""
    if kwargs and (kwargs.get("dtype") is not None or kwargs.get("out") is not None):
        # An explicit precision or output buffer is the caller's decision.
        return func(*args, **kwargs)
    for arg in args:
        if isinstance(arg, torch.dtype):  # dtype given positionally: explicit as well
            return func(*args, **kwargs) if kwargs else func(*args)

    first = args[0] if args else None
    if func in _BATCH_NORM_FUNCS and _native_mixed_batch_norm(first, (args[1:], kwargs)):
        # 16-bit input, FP32 weight and running stats: statistics in FP32 inside the kernel, no FP32 copy of
        # the input for autograd to save (see _native_mixed_batch_norm). Autocast still goes off for the call.
        devices = {"cpu" if first.is_cpu else first.device.type} if _any_autocast_enabled() else ()
    elif set_dtype and isinstance(first, torch.Tensor) and first.dtype in HALF_DTYPES:
        kwargs = dict(kwargs) if kwargs else {}
        kwargs["dtype"] = torch.float32
        devices = {"cpu" if first.is_cpu else first.device.type} if _any_autocast_enabled() else ()
    elif _any_autocast_enabled():
        devices = set()
        args = _to_fp32_seq(args, devices)
        if kwargs:
            kwargs = _to_fp32(kwargs, devices)
    else:
        args = _to_fp32_seq(args, None)
        if kwargs:
            return func(*args, **_to_fp32(kwargs, None))
        return func(*args)

    # Autocast would otherwise re-cast ops on its lower-precision list (a user may
    # list "matmul"). Toggling is a cheap C call per device, undone in finally so an
    # exception inside the op cannot leave autocast off.
    disabled = [device_type for device_type in devices if _autocast_enabled(device_type)]
    for device_type in disabled:
        torch.set_autocast_enabled(device_type, False)
    try:
        return func(*args, **kwargs) if kwargs else func(*args)
    finally:
        for device_type in disabled:
            torch.set_autocast_enabled(device_type, True)


class _Fp32OpMode(TorchFunctionMode):
    """Routes the listed callables through ``_call_fp32``; everything else passes through.

    ``__torch_function__`` is entered for *every* torch call while the mode is
    active, so the unlisted path is kept to one dict lookup and the re-call.
    The mode is popped while ``__torch_function__`` runs, so the re-call does not
    recurse into it."""

    def __init__(self, table: dict[Callable[..., Any], bool]) -> None:
        super().__init__()
        self._lookup = table.get  # listed callable -> whether it accepts dtype=; None if unlisted

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: A002 (torch's signature)
        try:
            set_dtype = self._lookup(func)
        except TypeError:  # an unhashable callable cannot be listed
            set_dtype = None
        if set_dtype is None:
            return func(*args, **kwargs) if kwargs else func(*args)
        return _call_fp32(func, args, kwargs, set_dtype)
