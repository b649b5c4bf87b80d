"""Explicit, user-editable FP32 policy for mixed precision training.

``torch.autocast`` decides per op whether it runs in 16 bits or in FP32, and its lists differ per device (on the
CPU it leaves softmax, layer_norm, sum, mean, exp... in 16 bits; CUDA runs them in FP32), so one model trains with
different numerics on the two. The policy makes the FP32 part explicit and identical everywhere
(``docs/policy.md``): ``DEFAULT_FP32_OPS`` and ``DEFAULT_FP32_MODULES`` (:mod:`lightning_mp.policy.ops`, each entry
with its reason), and :class:`Fp32Policy`, which validates a selection and applies it: ``activate()`` (or
``op_context()``) for ops, ``install()`` for modules, ``describe()`` for docs. Users edit the lists with set and
tuple operations::

    Fp32Policy(ops=DEFAULT_FP32_OPS - {"softmax", "softmin", "gumbel_softmax"})
    Fp32Policy(ops=DEFAULT_FP32_OPS | {"tanh", torch.sigmoid})
    Fp32Policy(modules=NORM_MODULES)                      # RNNs and embeddings back to 16 bits

The pieces: ``names`` (what a name covers), ``aten`` (the aten ops a name reaches), ``dispatch`` (the kernels at
the autocast keys), ``mode`` (the Python fallback for pure-Python composites), ``modules`` (listed modules' FP32
forward) and ``describe`` (``describe()``'s Markdown), each a module of :mod:`lightning_mp.policy`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable
from typing import Any, Union

import torch
import torch.nn as nn

from lightning_mp.policy.aten import OpReach, kernel_plan, reach_of
from lightning_mp.policy.describe import describe_policy
from lightning_mp.policy.dispatch import Fp32Activation, switched_on
from lightning_mp.policy.mode import _Fp32OpMode
from lightning_mp.policy.modules import Fp32ModuleHandle, Fp32Forwards, needs_fp32_forward, refuse_16_bit_batch_norm
from lightning_mp.policy.ops import (
    _DTYPE_OPS,
    BF16_FP32_OPS,
    DEFAULT_FP32_MODULES,
    DEFAULT_FP32_OPS,
    EMBEDDING_MODULES,
    NORM_MODULES,
    RECURRENT_MODULES,
)
from lightning_mp.policy.names import validate_modules, validate_ops

__all__ = [
    "BF16_FP32_OPS",
    "DEFAULT_FP32_MODULES",
    "Fp32Activation",
    "DEFAULT_FP32_OPS",
    "EMBEDDING_MODULES",
    "NORM_MODULES",
    "RECURRENT_MODULES",
    "Fp32ModuleHandle",
    "Fp32Policy",
    "refuse_16_bit_batch_norm",
]

OpSpec = Union[str, Callable[..., Any]]
_NULL_CONTEXT = contextlib.nullcontext()


def _warn_python_only(names: frozenset[str], reach: dict[str, OpReach]) -> None:
    via = sorted({n for name in names for n in reach[name].via_names})
    hint = f"also remove {sorted(names)}" + (f", or list {via}" if via else "")
    warnings.warn(
        f"fp32_ops: {sorted(names)} have no aten op of their own"
        + (f" and the ops they are FP32 through ({', '.join(via)}) are not listed" if via else "")
        + ", so op_context() intercepts them with a torch-function mode: about 1 us on every torch call inside "
        f"it, and activation checkpointing needs policy.checkpoint_context_fn(). HINT: {hint}.",
        UserWarning,
        stacklevel=3,
    )


class _OpContext:
    """``op_context()``: a hold on the policy's kernels for the block, plus the Python fallback mode if needed."""

    def __init__(self, policy: Fp32Policy) -> None:
        self._policy = policy
        self._activation: Fp32Activation | None = None

    def __enter__(self) -> None:
        self._activation = self._policy.activate()
        mode = self._policy.fallback_mode()
        if mode is not None:
            try:
                mode.__enter__()
            except BaseException:
                self._activation.remove()
                raise

    def __exit__(self, *exc_info: object) -> None:
        try:
            mode = self._policy.fallback_mode()
            if mode is not None:
                mode.__exit__(*exc_info)
        finally:
            if self._activation is not None:
                self._activation.remove()


class Fp32Policy:
    """Which ops and which modules run in FP32 under mixed precision.

    Args:
        ops: op names and/or torch callables computed in FP32 under ``torch.autocast`` (see the module
            docstring for the exact contract). A name stands for every public
            callable of that name in ``torch``, ``torch.nn.functional``,
            ``torch.special``, ``torch.linalg`` and the ``torch.Tensor`` methods,
            plus its operator dunders (``"pow"`` covers ``x ** 2``), and for the aten ops they lower to
            (``describe()`` lists them). A callable is
            normalised to its name, so ``torch.tanh`` also covers ``x.tanh()``.
            Other torch functions are given by dotted path (``"torch.fft.rfft"``).
            Invalid entries raise ``TypeError``/``ValueError`` naming ``fp32_ops``.
        modules: ``nn.Module`` subclasses whose instances keep FP32 parameters and
            run their forward in FP32 (``isinstance`` check, so subclasses count).
            Invalid entries raise ``TypeError``/``ValueError`` naming ``fp32_modules``.

    Ops are made FP32 by kernels at the autocast dispatch keys (CPU and CUDA), switched on process-wide by
    :meth:`activate` (see :mod:`lightning_mp.policy.dispatch`): unlisted ops cost nothing, outside
    ``torch.autocast`` nothing changes, and activation checkpointing and ``torch.compile`` follow the policy.
    Pure-Python composites (``F.softmin``, ``F.normalize``, ...) have no aten op of their own: they are FP32
    through the listed ops they call, and where those are not listed (``DEFAULT_FP32_OPS - {"softmax"}`` keeps
    ``softmin``), ``op_context()`` intercepts them with a torch-function mode, which costs about a microsecond
    on *every* torch call inside it (a ``UserWarning`` says so when the policy is built); ``describe()`` says
    which names are handled how.
    """

    def __init__(
        self,
        ops: Iterable[OpSpec] = DEFAULT_FP32_OPS,
        modules: Iterable[type[nn.Module]] = DEFAULT_FP32_MODULES,
    ) -> None:
        self._aliases = validate_ops(ops)
        self._modules = validate_modules(modules)
        self._ops = frozenset(self._aliases)
        self._reach: dict[str, OpReach] = {name: reach_of(name, aliases) for name, aliases in self._aliases.items()}
        self._packets = frozenset(packet for reach in self._reach.values() for packet in reach.packets)
        # Names no kernel reaches: composites whose FP32 ops are not all listed, and Python-only user additions.
        # The fallback mode's table: callable -> whether it takes dtype= (see _call_fp32).
        self._python_only = frozenset(
            name for name, reach in self._reach.items()
            if not reach.packets and not (reach.via and reach.via <= self._packets)
        )
        if self._python_only:
            _warn_python_only(self._python_only, self._reach)
        # The table's names left out: 16 bits on every device, also where autocast's own list says FP32 (CUDA's exp)
        self._unlisted = DEFAULT_FP32_OPS - self._ops
        self._lowered = frozenset(
            packet for name, found in validate_ops(self._unlisted).items() for packet in reach_of(name, found).packets
        ) - self._packets
        self._table: dict[Callable[..., Any], bool] = {
            func: name in _DTYPE_OPS for name in self._python_only for _, func in self._aliases[name]
        }
        self._mode: _Fp32OpMode | None = None
        self._plan: frozenset[Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # by names: the resolved callables include Tensor methods (TensorBase.pow...) that cannot be pickled,
        # and a policy travels with the plugin to ddp_spawn workers
        return {"ops": sorted(self._ops), "modules": self._modules}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["ops"], state["modules"])

    @property
    def ops(self) -> frozenset[str]:
        """Canonical names of the FP32 ops (accepted back by ``Fp32Policy(ops=...)``)."""
        return self._ops

    @property
    def modules(self) -> tuple[type[nn.Module], ...]:
        """The FP32 module classes, in the given order, without duplicates."""
        return self._modules

    @property
    def python_only_ops(self) -> frozenset[str]:
        """Listed names no autocast kernel reaches: ``op_context()`` intercepts them in Python (see the class
        docstring). Empty for the default list."""
        return self._python_only

    def keeps_fp32(self, module: nn.Module) -> bool:
        """Whether this module's own parameters stay FP32 (``isinstance`` of a listed class)."""
        return bool(self._modules) and isinstance(module, self._modules)

    def kernel_plan(self) -> frozenset[tuple[str, str, Any]]:
        """(autocast key, aten overload, rule) for every kernel :meth:`activate` registers (computed once)."""
        if self._plan is None:
            plan = kernel_plan(self._packets, self._lowered)
            self._plan = frozenset((key, overload, rule) for (key, overload), rule in plan.items())
        return self._plan

    def activate(self, on: bool = True) -> Fp32Activation:
        """Switch the listed ops to FP32 under ``torch.autocast``, process-wide, until ``.remove()``.

        Registers the policy's kernels at the autocast keys; the handle's ``remove()`` (or leaving it as a
        context manager) takes them out when the last hold goes. Holds are counted: activating the same or
        another policy again while active only adds a hold; while several different policies are active, the
        union of their ops is FP32. Active for every thread and through the backward pass, so activation
        checkpointing (reentrant or not), which replays autocast for its recomputation, recomputes the listed
        ops in FP32 without a ``context_fn`` (the backward itself runs outside autocast, as torch advises, and
        is untouched). Hold it
        for a whole fit (a plugin: from setup to teardown): registering is a table update per overload, cheap
        once but not meant for every step. Kernels exist for the CPU and CUDA autocast keys; on other devices
        the listed ops follow autocast's own lists.

        ``on=False`` registers the kernels switched off: they do what autocast does until :meth:`switched_on`
        switches them on around a forward or backward (the registration paid once; outside those blocks the listed
        ops compute as under autocast alone, at the cost of a Python call each)."""
        return Fp32Activation(self.kernel_plan(), on=on)

    def switched_on(self) -> contextlib.AbstractContextManager[None]:
        """This policy's registered kernels compute in FP32 inside the block (process-wide, nests; counters, no
        registration: hold ``activate(on=False)`` around it)."""
        return switched_on(self.kernel_plan())

    def fallback_mode(self) -> _Fp32OpMode | None:
        """The torch-function mode for ``python_only_ops`` (``None`` when there are none), one per policy."""
        if not self._table:
            return None
        # one mode object for the policy's lifetime: torch.compile guards on the active mode, so a new object per
        # step would invalidate every compiled graph (recompiling each step until Dynamo gives up)
        if self._mode is None:
            self._mode = _Fp32OpMode(self._table)
        return self._mode

    def op_context(self) -> contextlib.AbstractContextManager[Any]:
        """Context in which every listed op computes in FP32 under ``torch.autocast``.

        ``activate()`` for the block, plus the torch-function mode for ``python_only_ops`` (none by default).
        Outside ``torch.autocast`` it changes nothing (the ops then run in the dtype they are given). Nothing
        leaks out of the block, also when it raises. Inside an ``activate()`` hold it costs a counter; on its
        own it registers and removes the kernels each time, so hold ``activate()`` around a training loop, and
        keep it held through ``backward()`` when activation checkpointing recomputes the forward. An empty op
        list gives a no-op context."""
        if not self._aliases:
            return _NULL_CONTEXT
        return _OpContext(self)

    def checkpoint_context_fn(self) -> Callable[[], tuple[Any, Any]]:
        """``context_fn`` for ``torch.utils.checkpoint(..., use_reentrant=False)``.

        Needed only when ``python_only_ops`` is not empty (the fallback mode is thread-local and not replayed
        by the recomputation) or the policy is not held with ``activate()`` through the backward: it re-enters
        ``op_context()`` for the recomputation. With the policy active, checkpointing needs no ``context_fn``."""

        def context_fn() -> tuple[Any, Any]:
            return contextlib.nullcontext(), self.op_context()

        return context_fn

    def install(self, root: nn.Module, device_type: str, kernels_active: bool = False) -> Fp32ModuleHandle:
        """Run the forward of every submodule with ``keeps_fp32(m)`` in FP32.

        16-bit floating inputs (args and kwargs, nested) are upcast to float32 and
        autocast is disabled for ``device_type`` during that forward; outputs are FP32. The exception is BatchNorm
        with FP32 parameters and statistics on CPU and CUDA: its kernels take the 16-bit input as it is, compute the
        statistics in FP32 inside and return a 16-bit output (no FP32 copy of the activation for autograd to keep).
        An instance ``forward`` in front of the module's own (``modules.Fp32Forward``); ``handle.remove()`` takes it
        out. ``kernels_active``: the kernels are active wherever the model runs (a plugin's fit); modules whose forward
        is one listed op (``nn.LayerNorm``...) or an embedding lookup then compute in FP32 without one."""
        if not isinstance(root, nn.Module):
            raise TypeError(f"install() expects an nn.Module as root, got {type(root).__name__}.")
        if isinstance(device_type, torch.device):
            device_type = device_type.type
        if not isinstance(device_type, str):
            raise TypeError(f"device_type must be a str such as 'cpu' or 'cuda', got {device_type!r}.")
        device_type = device_type.split(":", 1)[0]
        try:
            torch.is_autocast_enabled(device_type)
        except RuntimeError as err:
            raise ValueError(f"device_type {device_type!r} is not supported by torch.autocast: {err}") from None

        forwards = Fp32Forwards(device_type)
        modules: list[nn.Module] = []
        handles: list[Any] = []
        for module in root.modules():
            if self.keeps_fp32(module):
                modules.append(module)
                if needs_fp32_forward(module, self._ops if kernels_active else None):
                    handles.extend(forwards.attach(module))
        return Fp32ModuleHandle(tuple(modules), handles)

    def describe(self) -> str:
        """Markdown tables of the FP32 ops and modules (for printing or a README)."""
        return describe_policy(self._aliases, self._modules, self._reach, self._python_only, self._unlisted)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Fp32Policy):
            return NotImplemented
        return self._ops == other._ops and set(self._modules) == set(other._modules)

    def __hash__(self) -> int:
        return hash((self._ops, frozenset(self._modules)))

    def __repr__(self) -> str:
        ops = "DEFAULT_FP32_OPS" if self._ops == DEFAULT_FP32_OPS else f"<{len(self._ops)} ops>"
        mods = ", ".join(cls.__name__ for cls in self._modules)
        return f"Fp32Policy(ops={ops}, modules=({mods}))"
