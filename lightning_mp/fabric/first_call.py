"""The Fabric plugin's one-time set-up at a model's first forward, and what Fabric's strategy made of the model.

Fabric calls the precision's ``convert_module`` before its strategy wraps the module in ``DistributedDataParallel``
(``"ddp"``, ``"ddp_spawn"``) or shards it with the user's ``parallelize_fn`` (``ModelParallelStrategy``:
``fully_shard``), and hands the precision neither result. With master weights both matter: DDP's own gradient
sync must go off (the step averages the FP32 gradients once, as under the Trainer), and under FSDP2 the FP32 shards
are the masters (no 16-bit copies of our own). So under a distributed strategy the plugin waits for each converted
module's first call: :class:`FirstCalls` registers one process-wide forward pre-hook
(``torch.nn.modules.module.register_module_forward_pre_hook``) at ``convert_module`` and removes it once every
module it waits for has been called (:class:`FirstForward` holds the modules and does the set-up). The first call
whose subtree holds such a module (Fabric's module wrapper, a ``torch.compile`` wrapper, the DDP wrapper, or the
module itself) comes before Fabric enters the precision's ``forward_context``, and its subtree holds the wrapper, if
there is one.

Cost: while the hook is registered, every module call in the process takes torch's hooked call path plus one
identity scan of the called module's subtree; the first forward of each model ends it (typically one call per
model, the outermost), and from then on nothing of this runs.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.nn.parallel import DistributedDataParallel

from lightning_mp.numerics.distributed import world_size
from lightning_mp.numerics.sharding import is_sharded


def distributed() -> bool:
    """Whether a strategy may wrap or shard what ``convert_module`` gets (a process group is up)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class FirstCalls:
    """Calls ``on_first_call(module, ddp_wrapper_or_None)`` once per watched module, at its first call (through
    whatever wraps it), before that call's forward runs. Holds its owner weakly (the hook is process-wide)."""

    def __init__(self, on_first_call: Callable[[nn.Module, DistributedDataParallel | None], None]) -> None:
        self._on_first_call = weakref.WeakMethod(on_first_call)
        self._waiting: list[nn.Module] = []
        self._handle: Any = None

    @property
    def bound(self) -> bool:
        """False in a copy unpickled from another process (``ddp_spawn``): its owner makes a fresh one."""
        return self._on_first_call is not None

    def watch(self, module: nn.Module) -> None:
        self._waiting.append(module)
        if self._handle is None:
            self._handle = register_module_forward_pre_hook(_Hook(weakref.ref(self)))

    def remove(self) -> None:
        """The hook out (idempotent): at teardown, or when nothing is waiting any more."""
        self._waiting.clear()
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _called(self, module: nn.Module) -> None:
        subtree = list(module.modules())
        ids = set(map(id, subtree))
        found = [m for m in self._waiting if id(m) in ids]
        if not found:
            return
        self._waiting = [m for m in self._waiting if id(m) not in ids]
        if not self._waiting:
            self.remove()  # before the callback: an error there leaves no process-wide hook behind
        callback = self._on_first_call()
        for m in found:
            wrapper = next((w for w in subtree if isinstance(w, DistributedDataParallel) and w.module is m), None)
            if callback is not None:
                callback(m, wrapper)

    def __getstate__(self) -> dict[str, Any]:
        # ddp_spawn pickles the plugin before fabric.setup: nothing is watched yet, and a hook is per process
        return {"_waiting": [], "_handle": None, "_on_first_call": None}


class _Hook:
    """The process-wide pre-hook: an object holding its :class:`FirstCalls` weakly, so a plugin (and its model)
    dropped without teardown is collected, and its finalizer removes the hook."""

    def __init__(self, owner: weakref.ref) -> None:
        self.owner = owner

    def __call__(self, module: nn.Module, args: Any) -> None:
        owner = self.owner()  # under torch.compile nothing is set up: the eager call around the graph did it
        if owner is not None and owner._waiting and not torch.compiler.is_compiling():
            owner._called(module)


class FirstForward:
    """The modules ``fabric.setup`` converted, set up at the first forward (the device is known then): ``connect``
    on the core, and under a distributed strategy with master weights the conversion itself, once the module's first
    call has shown what wraps it (:class:`FirstCalls`); DDP's own sync then goes off (``core.data_parallel``)."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self._pending: list[nn.Module] = []  # converted modules whose device set-up waits for the first forward
        self._unconverted: list[nn.Module] = []  # distributed, master weights: converted at their first call
        self._calls: FirstCalls | None = None

    def convert(self, module: nn.Module) -> nn.Module:
        self._pending.append(module)  # several fabric.setup() calls (a GAN's two models) share one store
        if not distributed():
            return self.core.convert(module)
        # the strategy wraps (DDP) or shards (fully_shard) the module after convert_module: its masters are chosen at
        # its first call, which shows what wraps it (MasterWeights builds nothing before a forward anyway). Without
        # master weights the module is converted now, and its first call still shows the DDP wrapper: a precision
        # schedule's later rung with master weights turns DDP's own sync off there (core.data_parallel, replayed)
        if self._calls is None or not self._calls.bound:
            self._calls = FirstCalls(self._first_call)
            weakref.finalize(self, FirstCalls.remove, self._calls)
        if self.core.master_weights:
            self._unconverted.append(module)
        else:
            self.core.convert(module)
        self._calls.watch(module)
        return module

    def set_up(self) -> None:
        """The one-time set-up of the modules converted since the last one (from ``forward_context``, or earlier)."""
        if not self._pending:
            return
        modules, self._pending = self._pending, []
        for module in self._unconverted:
            self.core.convert(module)  # sharded by now (FSDP2: the shards are the masters) or wrapped (DDP)
        self._unconverted.clear()
        for module in modules:
            self._refuse_lean_converted_before_sharding(module)
        root = modules[0] if len(modules) == 1 else nn.ModuleList(modules)
        if self.core.connect(root, root, [], [], hold_kernels=False) and self.core.fp8.enabled:
            rank_zero_info(self.core.fp8.describe())  # which Linears compute in FP8, and emulated or not

    def _refuse_lean_converted_before_sharding(self, module: nn.Module) -> None:
        # lean bf16 converts at convert_module (DDP then wraps the bf16 Parameters), but fully_shard runs after it and
        # replaces every Parameter with a new DTensor one: the remainders belong to Parameters no longer in the model
        if self.core.lean is None or self.core.sharded or not is_sharded(module):
            return
        raise NotImplementedError(
            f"lightning_mp.fabric.MixedPrecisionPlugin(precision={self.core.format.name!r}, "
            f"master_weights='compensated') under ModelParallelStrategy: {type(module).__name__} was converted at "
            "fabric.setup, before fully_shard replaced its Parameters, so the optimizer would step the bf16 shards "
            "without their remainders and model.state_dict() (fabric.save) would hold the weights of fabric.setup. "
            "HINT: under ModelParallelStrategy use the default master_weights=True (the FP32 shards are the masters); "
            "master_weights='compensated' works under strategy='ddp'."
        )

    def _first_call(self, module: nn.Module, wrapper: DistributedDataParallel | None) -> None:
        self.set_up()
        if wrapper is not None:
            self.core.data_parallel(wrapper)
        elif self.core.masters is not None and not is_sharded(module) and world_size() > 1:
            raise NotImplementedError(
                f"lightning_mp.fabric.MixedPrecisionPlugin(precision={self.core.format.name!r}) with master weights "
                f"on {world_size()} ranks: {type(module).__name__} was called without the DistributedDataParallel "
                "wrapper Fabric made, and is not sharded by fully_shard, so its FP32 gradients would not be averaged. "
                "HINT: call the module fabric.setup() returned, under strategy='ddp', 'ddp_spawn' or "
                "ModelParallelStrategy (fully_shard); or pass master_weights=False."
            )

    def remove(self) -> None:
        """At teardown: the process-wide hook out, nothing pending."""
        if self._calls is not None:
            self._calls.remove()
        self._pending.clear()
        self._unconverted.clear()
