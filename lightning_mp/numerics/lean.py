"""Lean bf16 (``master_weights="compensated"``): the model is a bf16 model, and its FP32 masters live on exactly.

Each trainable FP32 parameter outside the FP32-kept modules becomes bf16 for good (its ``.data``, torch's cast of the
master) and gets an int16 remainder and a tie bit, which rebuild the FP32 master bit for bit
(:mod:`lightning_mp.numerics.compensated`). The forward and backward run on the bf16 parameters; the user's optimizer
steps on FP32 values rebuilt bucket by bucket inside the step and split back. With
``optimizer_state_dtype=torch.bfloat16`` its per-element floating state (Adam's moments, momentum) is kept in bf16
between steps, stochastically rounded. Live bytes per parameter under AdamW: 2 + 2 + 0.125 + 2 + 8 = 14.125, or
10.125 with bf16 state, against 18 for FP32 masters with 16-bit copies and 16 for FP32 training.

Gradients, as FP32 masters have them: summed and clipped in FP32 where no process group reduces them, rounded back to
bf16 by the step (:meth:`LeanBf16.before_backward`, :meth:`LeanBf16.before_clipping`, :mod:`.lean_grads`).

What stays exact: ``model.state_dict()`` holds the rebuilt FP32 masters (checkpoints are precision-agnostic, as with
FP32 masters), ``load_state_dict`` splits FP32 values back exactly, an optimizer checkpoint's FP32 state is restored
in FP32 (torch would cast it to the parameters' bf16), and at the end of a fit the Parameters hold their FP32
masters again. What deliberately changes: between the steps of a fit the Parameters *are* bf16 (as under
``bf16-true``): a callback reading ``p`` sees the bf16 value, ``plugin.master(p)`` the FP32 one.

The parity guard (``parity_guard=fraction``): a sample of whole parameters is shadowed in FP32 and stepped by a
second optimizer of the same class with the same gradients; after each step the relative drift of the lean values
from their shadows and the fraction of updates the lean representation lost are kept in :attr:`LeanBf16.parity`
(and logged by ``LossScaleMonitor``). With FP32 state both are 0 (the masters are exact); with bf16 state they
measure what the rounding of the moments costs. Past :data:`DRIFT_WARNING` a warning says so, once. Off: nothing.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_mp.numerics.compensated import CompensatedStep, split_
from lightning_mp.numerics.lean_grads import grads_of, own_grad_dtype, retype_grads, upcast_accumulated
from lightning_mp.numerics.parity import ParityGuard
from lightning_mp.numerics.sharding import assign, like, local, reload_shards, require_gather_dtype

log = logging.getLogger("lightning_mp.plugin")

# FP32 bytes rebuilt per optimizer call. The step's transients (the bucket's FP32 values and gradients, its state's
# upcast and stochastic rounding) scale with it and bound the step's peak over the state at rest; ~10 launches each.
# At 25.4M parameters (the memory benchmark's GPT): 32 MiB buckets peak at 674 MiB, 4 MiB at 519, 1 MiB at 538.
BUCKET_BYTES = 4 << 20

# A drift of the lean values from their FP32 shadows past one bf16 ulp (relative) is worth a warning.
DRIFT_WARNING = torch.finfo(torch.bfloat16).eps


class LeanBf16:
    """bf16 Parameters with exact int16 remainders, stepped on their FP32 masters; see the module docstring.

    Args:
        optimizer_state_dtype: ``torch.float32`` or ``torch.bfloat16`` (per-element optimizer state between steps).
        parity_guard: fraction of the parameter tensors shadowed in FP32 (0: off).
    """

    def __init__(self, optimizer_state_dtype: torch.dtype, parity_guard: float) -> None:
        self.state_dtype = optimizer_state_dtype
        self.parity_fraction = parity_guard
        self.parity: tuple[float, float] | None = None  # (drift, lost fraction) of the last step
        self.steps: CompensatedStep | None = None
        self._names: dict[nn.Parameter, list[str]] = {}
        self._guards: dict[int, ParityGuard] = {}
        self._handles: list[Any] = []
        self._sharded: nn.Module | None = None  # an FSDP2 model, whose shards are bf16 with remainders
        self._warned = False

    # ------------------------------------------------------------------ set-up
    def convert(self, module: nn.Module, keep_fp32: Callable[[nn.Module], bool], sharded: bool = False) -> None:
        """Make ``module``'s trainable FP32 parameters (outside kept subtrees) bf16 with exact remainders.

        ``sharded`` (FSDP2): every trainable FP32 parameter, kept modules' too, since ``fully_shard`` needs one dtype
        per group of trainable parameters; a kept module still computes in FP32, from its bf16 parameters, as under
        FSDP2 with FP32 masters. Each rank splits its own shards; FSDP2 then all-gathers bf16 without a cast."""
        if self.steps is not None:
            raise ValueError(
                "master_weights='compensated' holds one model per plugin, and a second one was set up. HINT: set up "
                "one module (a container of both), or use master_weights=True for several."
            )
        if sharded:
            require_gather_dtype(module, torch.bfloat16)
        kept = set() if sharded else {p for m in module.modules() if keep_fp32(m) for p in m.parameters()}
        names: dict[nn.Parameter, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            if p.requires_grad and p.dtype == torch.float32 and p not in kept:
                names.setdefault(p, []).append(name)
        self._names.update(names)
        self.steps = CompensatedStep(list(self._names), BUCKET_BYTES, optimizer_state_dtype=self.state_dtype)
        own_grad_dtype(self.steps.params)  # bf16 gradients, also after an earlier fit or a schedule set FP32
        if sharded:
            self._sharded = module
            reload_shards(module)
        # partials, not bound methods (torch marks its public-API hooks with an attribute), nor closures (a model
        # pickled with them on: torch.save, a Fabric loop's plugin)
        self._handles.append(module.register_state_dict_post_hook(functools.partial(LeanBf16._save_masters, self)))
        self._handles.append(module.register_load_state_dict_pre_hook(functools.partial(LeanBf16._load_masters, self)))

    def watch(self, optimizers: Sequence[Optimizer]) -> None:
        """Keep these optimizers' FP32 state FP32 through ``load_state_dict`` (torch casts it to the bf16 params), and
        show bf16 state as FP32 in ``state_dict()``: torch's distributed checkpoint makes the state with a step of its
        own on the bf16 parameters (bf16 tensors) and loads the checkpoint into that ``state_dict()`` in place."""
        for optimizer in optimizers:  # torchao's quantized states cannot be cast to bf16 after their first step
            if self.state_dtype != torch.float32 and type(optimizer).__module__.startswith("torchao."):
                raise ValueError(f"optimizer_state_dtype=torch.bfloat16 with {type(optimizer).__qualname__} is not "
                                 "allowed: torchao quantizes its state. HINT: optimizer_state_dtype=None.")
        for optimizer in optimizers if self.state_dtype == torch.float32 else ():
            pre = optimizer._optimizer_load_state_dict_pre_hooks.values()  # watched already: our stash is there
            if any(getattr(h, "func", None) is _stash_fp32_state for h in pre):
                continue  # (Fabric: plugin.setup_optimizers, then again at the first optimizer.step())
            self._handles.append(optimizer.register_state_dict_post_hook(_upcast))
            stash: dict = {}  # ours, not an attribute on the user's optimizer
            stashing, restoring = (functools.partial(f, stash) for f in (_stash_fp32_state, _restore_fp32_state))
            self._handles.append(optimizer.register_load_state_dict_pre_hook(stashing))
            self._handles.append(optimizer.register_load_state_dict_post_hook(restoring))

    def remove(self) -> None:
        """Hooks off; the Parameters hold their FP32 masters again (a fit returns the FP32 model it trained)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.steps is not None:
            with torch.no_grad():
                for p in self.steps.params:
                    grad, p.grad = p.grad, None
                    assign(p, local(self.steps.master(p)))
                    p.grad_dtype = torch.float32  # autograd's default for the FP32 Parameter again
                    p.grad = None if grad is None else grad.float()
            if self._sharded is not None:
                reload_shards(self._sharded)
        self.steps, self._names, self._guards, self._sharded = None, {}, {}, None

    # ------------------------------------------------------------------ gradients
    def before_backward(self) -> None:
        """A backward is about to add into the gradients already there (an earlier micro-batch's): the bf16 ones
        become FP32 first (exact), so micro-batches sum in FP32, as FP32 masters sum theirs (cost and why:
        :func:`~lightning_mp.numerics.lean_grads.upcast_accumulated`)."""
        if self._fp32_grads():
            upcast_accumulated(self.steps.params)

    def before_clipping(self, optimizer: Optimizer) -> None:
        """Clipping is about to read this optimizer's gradients: the bf16 ones become FP32 (exact), so the norm and
        the scaled gradients the step reads are computed in FP32, as over FP32 masters (scaled in bf16 they would be
        rounded again). 4 B per element instead of 2 from here to the end of the step, when no activations are held."""
        if self._fp32_grads():
            retype_grads(grads_of(optimizer, self._names, torch.bfloat16), torch.float32)

    def _fp32_grads(self) -> bool:
        # Under DDP the reducer copies the gradients into buckets of the parameters' dtype (an FP32 one would not fit)
        # and under FSDP2 the reduce-scatter writes bf16 shards: there gradients stay bf16, micro-batches under
        # no_sync sum in bf16. Any process group counts, one rank's too: DDP wraps a single-rank model as well.
        return self.steps is not None and self._sharded is None and not _distributed()

    # ------------------------------------------------------------------ the step
    def master(self, p: nn.Parameter) -> Tensor:
        """The FP32 master of a converted parameter (a new tensor); other parameters as they are."""
        return self.steps.master(p) if self.steps is not None and p in self._names else p.detach()

    def step(self, optimizer: Optimizer, **kwargs: Any) -> None:
        if self.steps is None:
            return optimizer.step(**kwargs)
        guard = self._guard(optimizer)
        if guard is not None:
            guard.snapshot()
        self.steps.step(optimizer, **kwargs)
        if guard is not None:
            self.parity = guard.measure()  # one host read, on guarded runs only
            if self.parity[0] > DRIFT_WARNING and not self._warned:
                self._warned = True
                log.warning(
                    f"parity guard: the lean parameters drifted {self.parity[0]:.3g} (relative) from their FP32 "
                    f"shadows, past one bf16 ulp ({DRIFT_WARNING:.3g}); {self.parity[1]:.1%} of the last step's updates "
                    "were lost. HINT: optimizer_state_dtype=torch.float32, or master_weights=True (FP32 masters)."
                )
        if self._fp32_grads():  # summed or clipped in FP32 for this step: bf16 again until the next window needs FP32
            retype_grads(grads_of(optimizer, self._names, torch.float32), torch.bfloat16)
        return None

    def _guard(self, optimizer: Optimizer) -> ParityGuard | None:
        if not self.parity_fraction:
            return None
        key = id(optimizer)
        if key not in self._guards:
            owned = [p for g in optimizer.param_groups for p in g["params"] if p in self._names]
            if not owned:
                return None
            self._guards[key] = ParityGuard(owned, optimizer, self.steps.master, self.parity_fraction)
        return self._guards[key]

    # ------------------------------------------------------------------ checkpoints
    def _save_masters(self, module: nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
        for p, names in self._names.items():
            master = None
            for name in names:
                if prefix + name in state:
                    master = self.steps.master(p) if master is None else master
                    state[prefix + name] = master

    @torch.no_grad()
    def _load_masters(self, module: nn.Module, state: dict, prefix: str, *args: Any) -> None:
        for p, names in self._names.items():
            value = next((state[prefix + n] for n in names if prefix + n in state), None)
            if not isinstance(value, Tensor) or value.shape != p.shape:
                continue  # missing or mismatched: load_state_dict reports it
            value, remainder, ties = value.to(p.device), self.steps.remainders[p], self.steps.ties[p]
            if local(value).shape != remainder.shape:
                continue  # a full tensor for a sharded parameter: load_state_dict reports it
            if value.dtype == torch.float32:
                hi = like(p, split_(local(value).contiguous(), torch.empty_like(remainder, dtype=torch.bfloat16),
                                    remainder, ties)[0])
            else:
                hi = value.to(torch.bfloat16)
                remainder.zero_()  # a bf16 checkpoint: its values are the masters
                ties.zero_()
            for n in names:
                if prefix + n in state:
                    state[prefix + n] = hi


def lean_bf16(fmt: Any, master_weights: Any, optimizer_state_dtype: Any, parity_guard: Any) -> LeanBf16 | None:
    """The plugin's ``master_weights``, ``optimizer_state_dtype`` and ``parity_guard``, checked: a
    :class:`LeanBf16` for ``master_weights="compensated"``, else ``None``."""
    if master_weights is not None and not isinstance(master_weights, bool) and master_weights != "compensated":
        raise ValueError(
            f"master_weights={master_weights!r} is not allowed: use True, False, None (auto) or 'compensated'."
        )
    compensated = master_weights == "compensated"
    if compensated and fmt.dtype != torch.bfloat16:
        raise ValueError(
            f"master_weights='compensated' with precision={fmt.name!r} is not allowed: its parameters are bf16. "
            "HINT: precision='bf16', or master_weights=True for fp16."
        )
    if optimizer_state_dtype not in (None, torch.float32, torch.bfloat16):
        raise ValueError(
            f"optimizer_state_dtype={optimizer_state_dtype!r} is not allowed: use None (FP32), torch.float32 or "
            "torch.bfloat16."
        )
    if optimizer_state_dtype == torch.bfloat16 and not compensated:
        raise ValueError(
            "optimizer_state_dtype=torch.bfloat16 is not allowed without master_weights='compensated'. HINT: "
            "MixedPrecisionPlugin('bf16', master_weights='compensated', optimizer_state_dtype=torch.bfloat16)."
        )
    if isinstance(parity_guard, bool) or not isinstance(parity_guard, (int, float)) or not 0 <= parity_guard <= 1:
        raise ValueError(
            f"parity_guard={parity_guard!r} is not allowed: use the fraction of parameter tensors to shadow in FP32, "
            "a number in [0, 1] (0: off)."
        )
    if parity_guard and not compensated:
        raise ValueError(
            f"parity_guard={parity_guard!r} is not allowed without master_weights='compensated' (FP32 masters are "
            "exact: there is nothing to guard). HINT: parity_guard=0."
        )
    return LeanBf16(optimizer_state_dtype or torch.float32, float(parity_guard)) if compensated else None


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _upcast(optimizer: Optimizer, state_dict: dict) -> dict:
    """``state_dict`` with its bf16 state tensors as FP32 copies (new entries: torch's hold the live state)."""
    if "state" in state_dict:
        state_dict["state"] = {
            key: {k: v.float() if isinstance(v, Tensor) and v.dtype == torch.bfloat16 and v.dim() else v
                  for k, v in entry.items()}
            for key, entry in state_dict["state"].items()
        }
    return state_dict


def _stash_fp32_state(stash: dict, optimizer: Optimizer, state_dict: dict) -> None:
    """The FP32 state tensors by the position of their parameter, as torch pairs them: the state dict's param groups
    in order (ids from ``Optimizer.state_dict``, names from ``torch.distributed.checkpoint``) with the optimizer's."""
    stash.clear()
    state = state_dict.get("state", {})
    keys = [key for group in state_dict.get("param_groups", []) for key in group.get("params", [])]
    stash.update({
        position: {k: v for k, v in state[key].items() if isinstance(v, Tensor) and v.dtype == torch.float32
                   and v.dim()}
        for position, key in enumerate(keys) if key in state
    })


def _restore_fp32_state(stash: dict, optimizer: Optimizer) -> None:
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for position, entry in stash.items():
        if position < len(params) and params[position] in optimizer.state:
            state = optimizer.state[params[position]]
            for k, v in entry.items():
                if k in state:
                    state[k] = v.to(state[k].device)
    stash.clear()


__all__ = ["DRIFT_WARNING", "LeanBf16"]
