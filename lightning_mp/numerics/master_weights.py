"""FP32 master weights: the module's Parameters are the FP32 masters at every moment; the forward reads 16-bit copies.

Why masters: an update smaller than half a 16-bit ulp of the weight rounds away. At a weight of 1.0 that is
anything below 2^-8 in bf16 or 2^-11 in fp16, so ``lr * grad`` of 1e-4 never moves a bf16 weight. The optimizer
must update FP32 values, and gradients of several micro-batches must be summed in FP32.

The invariant: a Parameter is never swapped, re-dtyped or re-pointed. It holds its exact FP32 value whenever user
code, a callback, a checkpoint, a signal handler or an optimizer can look. The 16-bit copies are tensors of our
own; only the model's forward sees them:

* a forward pre-hook on the model and on the modules up to two calls below it (the covers,
  :mod:`lightning_mp.numerics.copies`) puts the copies of every converted parameter of its subtree in their modules'
  instance ``__dict__`` under the parameters' names (instance attributes win over ``nn.Module.__getattr__``, which
  reads ``_parameters``), and an always-called forward hook takes them out again. So inside the model's forward
  ``self.weight`` is the 16-bit copy, and ``module.weight``, ``parameters()`` and ``state_dict()`` everywhere else
  are the FP32 Parameters. Activation checkpointing recomputes on the copies (under a cover's hooks) or on the same
  rounding of the FP32 Parameters (under the autocast it replays): the same values either way.
* the copies are autograd leaves; after each backward :meth:`MasterWeights.fold_grads` adds their 16-bit gradients
  into the Parameters' FP32 ``.grad`` and drops them. ``zero_grad``, accumulation, ``retain_graph`` and several
  backwards through one graph therefore act on the FP32 gradients the user means.
* anything that reads a Parameter outside a cover's forward (a module deeper than the covers called on its own from
  ``training_step``, a method other than ``forward``, ``torch.compile``d code, where the hooks step aside) reads the
  FP32 Parameter, which autocast casts per use and autograd differentiates into the FP32 ``.grad``: Lightning's
  ``bf16-mixed`` semantics, also exact.

Refresh (one fused cast-copy, round to nearest): lazily, at the first cover's forward after :meth:`begin` or
:meth:`mark_stale`, so a write in ``training_step`` before the forward (WGAN's ``p.data.clamp_``) is seen.
``begin(force=True)`` refreshes every trainable copy (``.data`` writes do not move a tensor's version counter);
otherwise a copy is refreshed when its master's version counter or storage moved. A frozen parameter's copy is
therefore made once and reused until its value changes through ordinary tensor ops (``load_state_dict``, writes
under ``torch.no_grad()``); a write through ``.data`` to a *frozen* parameter is not seen until the next forced
refresh of that parameter (unfreeze it, or write it under ``torch.no_grad()`` instead).

What is converted: FP32 parameters outside the FP32-kept subtrees (``keep_fp32(module)``: every parameter under a
kept module stays FP32 and gets no copy, children included), and trainable 16-bit parameters, which get an FP32
master once, with a warning (the bits already lost stay lost). Frozen 16-bit parameters stay 16-bit (2 B/param,
as under ``bf16-true``) until unfrozen. float64, complex and integer parameters keep their dtype, as under Lightning's
plugin. ``nn.Embedding(max_norm=...)`` renormalises its weight in ``forward``, so it reads its FP32 Parameter.

Memory per converted parameter: 4 B FP32 parameter + 2 B copy + 4 B FP32 gradient + optimizer state. Copies and FP32
gradients are views of one flat buffer per device each, allocated when the parameter set is built or changes
(materialized, unfrozen, replaced, moved, sent to FP32 by ``fp32_modules="auto"``); a steady step allocates nothing.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from functools import partial
from itertools import repeat as _repeat
from operator import attrgetter, is_not

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from lightning_mp.formats import HALF_DTYPES
from lightning_mp.numerics.copies import Cover, flat_views, fold_grads, select_covers

_DTYPE, _DEVICE, _VERSION = attrgetter("dtype"), attrgetter("device"), attrgetter("_version")
_REQUIRES_GRAD, _DATA_PTR = attrgetter("requires_grad"), Tensor.data_ptr
_IS_NOT_NONE = partial(is_not, None)


class MasterWeights:
    """FP32 Parameters as masters, 16-bit copies that only the forward reads.

    Args:
        dtype: the 16-bit compute format of the copies.
        keep_fp32: ``keep_fp32(module)`` is true for modules that compute in FP32 (norm layers...): no parameter
            in their subtree gets a copy.

    Per step: :meth:`begin` before the step's first forward, :meth:`fold_grads` after each backward,
    :meth:`mark_stale` after an optimizer step that changed parameters; :meth:`remove` at teardown.
    """

    def __init__(self, dtype: torch.dtype, keep_fp32=lambda module: False) -> None:
        self.dtype = dtype
        self._keep_fp32 = keep_fp32
        self._roots: list[nn.Module] = []
        self._handles: list = []
        self._hooked: set[int] = set()
        self._built = False
        # per converted parameter: Parameter, copy, FP32 gradient view, (data_ptr, version) at the last refresh
        self.params: list[nn.Parameter] = []
        self._copies: list[Tensor] = []
        self._grad_views: list[Tensor] = []
        self._seen: list[tuple[int, int] | None] = []
        self._dtypes, self._devices = [], []  # the masters' dtypes and the copies' devices at the build
        self._slot: dict[nn.Parameter, int] = {}
        self._slot_of: dict[int, int] = {}  # the same by id(Parameter)
        self._covers: dict[int, Cover] = {}  # id(module) -> what its forward shows
        self._inside: dict[int, int] = {}  # id(module) -> covers in progress that show it
        self._stack: list[list] = []  # [cover, times re-entered] of the covers in progress, outermost first
        self._pair: dict[int, list] = {}  # id(cover) -> its hook handles
        self._outer: set[int] = set()
        self._inner: set[int] = set()
        self._watch = True
        self._pending, self._force, self._warned = True, True, False

    # ------------------------------------------------------------------ set-up
    def convert(self, module: nn.Module) -> nn.Module:
        """Watch ``module`` (several calls add several roots). The copies are built at the first forward, on the
        device the parameters are on by then."""
        self._roots.append(module)
        self._built = False
        self._pending = True
        return module

    @torch.no_grad()
    def _build(self) -> None:
        """Choose the converted parameters, hook their modules and (re)allocate the flat buffers."""
        kept: set[nn.Parameter] = set()
        for root in self._roots:
            for mod in root.modules():
                if self._keep_fp32(mod) or isinstance(mod, nn.utils.parametrize.ParametrizationList):
                    # the whole subtree computes in FP32; parametrizations compute from FP32 originals
                    kept.update(mod.parameters())
                elif isinstance(mod, nn.Embedding) and mod.max_norm is not None:
                    kept.update(mod.parameters(recurse=False))  # renormalises its weight in place in forward
        params: list[nn.Parameter] = []
        slot: dict[nn.Parameter, int] = {}
        owned: dict[int, list[tuple[nn.Module, str, nn.Parameter, int]]] = {}  # per module, its own parameters
        upcast, upcast_dtype = 0, None
        for root in self._roots:
            for mod in root.modules():
                own = []
                for name, p in mod._parameters.items():
                    if p is None or not (is_lazy(p) or p.is_floating_point()):
                        continue
                    if p in kept:
                        if p.dtype in HALF_DTYPES and p.requires_grad and not is_lazy(p):
                            upcast, upcast_dtype = upcast + 1, p.dtype  # trains on FP32 values, no copy
                            p.data = p.data.float()
                        continue
                    if is_lazy(p) or (p.dtype in HALF_DTYPES and not p.requires_grad):
                        own.append((mod, name, p, -1))  # re-examined when materialized or unfrozen
                        continue
                    if p.dtype in HALF_DTYPES:
                        upcast, upcast_dtype = upcast + 1, p.dtype
                        p.data = p.data.float()
                    if p.dtype != torch.float32:
                        continue  # float64: the user's explicit choice, trained as it is
                    if p not in slot:
                        slot[p] = len(params)
                        params.append(p)
                    own.append((mod, name, p, slot[p]))
                if own:
                    owned[id(mod)] = own
        covers = select_covers(self._roots, owned)
        for cover, _ in covers.values():
            if id(cover) not in self._hooked:
                self._hooked.add(id(cover))
                pair = [cover.register_forward_pre_hook(self._install),
                        cover.register_forward_hook(self._uninstall, always_call=True)]
                self._handles += pair
                self._pair[id(cover)] = pair
        self._outer, self._inner, self._watch = set(), set(), True  # covers seen called outside any cover, inside one
        if upcast and not self._warned:
            self._warned = True
            warnings.warn(
                f"{upcast} trainable parameters were already in {upcast_dtype} before fit: their FP32 masters start from the "
                "16-bit values, so the bits lost in that cast stay lost. HINT: build or load the model in FP32 and "
                "let MixedPrecisionPlugin make the 16-bit copies (frozen 16-bit parameters stay 16-bit).",
                stacklevel=3,
            )
        self.params, self._slot, self._slot_of = params, slot, {id(p): i for p, i in slot.items()}
        self._copies = flat_views(params, self.dtype, leaf=True)
        self._covers = {key: Cover.of(cover, subtree, self._copies, covers) for key, (cover, subtree) in covers.items()}
        self._grad_views = flat_views(params, torch.float32, leaf=False)
        self._seen = [None] * len(params)
        self._dtypes, self._devices = list(map(_DTYPE, params)), [c.device for c in self._copies]
        self._built = True
        self._pending = True

    # ------------------------------------------------------------------ per step
    def begin(self, force: bool = False) -> None:
        """A step starts: refresh the copies at the next hooked forward; ``force`` refreshes every trainable one.
        After the first forwards since the build, the covers seen called only inside another cover lose their hooks
        (a pair costs ~130 bytecodes per call even when it steps aside)."""
        if not self._built:
            self._build()  # hooks the modules; the parameters are on their device by now
        elif self._outer:
            for key in self._inner - self._outer:
                for handle in self._pair.pop(key, ()):
                    handle.remove()
            self._outer, self._inner = set(), set()  # observed once per build: then no bookkeeping
            self._watch = False
        self._pending = True
        self._force = self._force or force

    def rebuild(self) -> None:  # the kept modules changed: choose the converted parameters again at begin()
        self._built = False

    def mark_stale(self, params: Iterable[nn.Parameter]) -> None:
        """These masters changed (an optimizer stepped them): refresh their copies at the next hooked forward."""
        seen = self._seen
        # keyed by id: a Parameter's hash is a Python method (Tensor.__hash__), id() is not
        list(map(seen.__setitem__, filter(_IS_NOT_NONE, map(self._slot_of.get, map(id, params))), _repeat(None)))
        self._pending = True

    def _refresh(self) -> None:
        if not self._built:
            self._build()
        force, self._force, self._pending = self._force, False, False
        params, copies = self.params, self._copies
        # C-level passes over the parameters (a Python loop per parameter costs several times more inside a fit,
        # where the forward and backward have evicted the interpreter's data from the caches)
        if list(map(_DTYPE, params)) != self._dtypes or list(map(_DEVICE, params)) != self._devices:
            self._build()  # moved or re-dtyped: a new parameter set
            self._force = True
            return self._refresh()
        marks = list(zip(map(_DATA_PTR, params), map(_VERSION, params)))
        if force and all(map(_REQUIRES_GRAD, params)):  # the Trainer's training step: every copy
            dst, src = copies, params
        else:
            stale = [i for i, (p, was, now) in enumerate(zip(params, self._seen, marks))
                     if was != now or (force and p.requires_grad)]
            dst, src = [copies[i] for i in stale], [params[i] for i in stale]
        if dst:  # round to nearest, one fused pass; no grad mode (the copies are leaves that require grad) without
            prev = torch.is_grad_enabled()  # torch.no_grad()'s per-call Python objects
            torch._C._set_grad_enabled(False)
            try:
                torch._foreach_copy_(dst, src)
            finally:
                torch._C._set_grad_enabled(prev)
        self._seen = marks

    def _install(self, module: nn.Module, args) -> None:
        if torch.compiler.is_compiling():
            return  # compiled code reads the FP32 Parameters under autocast (bf16-mixed semantics)
        key = id(module)
        if self._inside.get(key):  # inside the forward of a cover that showed this module's subtree already
            if self._stack and self._stack[-1][0] is module:
                self._stack[-1][1] += 1  # a cover called inside its own forward
            elif self._watch:
                self._inner.add(key)
            return
        if self._pending:
            self._refresh()
        cover = self._covers.get(key)
        if cover is None:
            return
        if not cover.show():  # a Parameter materialized, unfrozen, replaced or pruned since the build
            self._build()
            self._force = True
            self._refresh()
            return self._install(module, args)
        self._stack.append([module, 0])
        if self._watch:
            self._outer.add(key)
        inside = self._inside
        for k in cover.nested:
            inside[k] = inside.get(k, 0) + 1

    def _uninstall(self, module: nn.Module, args, output) -> None:
        if torch.compiler.is_compiling():
            return
        stack = self._stack
        if not stack or stack[-1][0] is not module:
            return  # covered by an outer cover's forward, or nothing was installed (compiling, no entries)
        if stack[-1][1]:
            stack[-1][1] -= 1
            return
        stack.pop()
        cover = self._covers[id(module)]
        inside = self._inside
        for k in cover.nested:
            inside[k] -= 1
        cover.hide()

    def fold_grads(self) -> None:
        """Add the copies' 16-bit gradients into the Parameters' FP32 ``.grad`` and drop them (one fused pass each:
        a copy into the persistent FP32 view where ``.grad`` is ``None``, an add where it exists: FP32 sums)."""
        fold_grads(self.params, self._copies, self._grad_views)

    # ------------------------------------------------------------------ teardown
    def remove(self) -> None:
        """Take the hooks out and give the memory back; the Parameters were FP32 all along."""
        self.fold_grads()
        for handle in self._handles:
            handle.remove()
        for cover in self._covers.values():
            cover.hide()
        self.__init__(self.dtype, self._keep_fp32)

    def __deepcopy__(self, memo) -> MasterWeights:
        # a deep copy of a hooked model (SWA's averaged model, an EMA copy) carries hooks bound to a fresh, empty
        # store: they find no entries for the copied modules, which then read their FP32 Parameters under autocast
        return MasterWeights(self.dtype)

    def __reduce__(self):
        return (MasterWeights, (self.dtype,))
