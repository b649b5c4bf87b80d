"""FP32 master weights: the module's Parameters are the FP32 masters at every moment; the forward reads 16-bit copies.

Why masters: an update below half a 16-bit ulp of the weight rounds away (at 1.0: 2^-8 in bf16, 2^-11 in fp16), so
the optimizer must update FP32 values, and gradients of several micro-batches must be summed in FP32.

The invariant: a Parameter is never swapped, re-dtyped or re-pointed. It holds its exact FP32 value whenever user
code, a callback, a checkpoint, a signal handler or an optimizer can look. The 16-bit copies are tensors of our
own; only a module's own forward sees them:

* before each forward of a module that owns converted parameters, the copies go into its instance ``__dict__`` under
  the parameters' names (instance attributes win over ``nn.Module.__getattr__``, which reads ``_parameters``); after
  it, however it ends, they come out (:mod:`.bracket`). So ``self.weight`` inside ``forward`` is the 16-bit copy, and
  ``module.weight``, ``parameters()`` and ``state_dict()`` everywhere else are the FP32 Parameters. Activation
  checkpointing re-runs the forward and reads the same copies (refreshed only when their master changed). Which
  parameters each module owns is checked once per step, at the refresh: a parameter
  replaced, pruned, frozen or unfrozen between steps is seen at the next step's first forward.
* the copies are autograd leaves; after each backward :meth:`MasterWeights.fold_grads` adds their 16-bit gradients
  into the Parameters' FP32 ``.grad`` and drops them. ``zero_grad``, accumulation, ``retain_graph`` and several
  backwards through one graph therefore act on the FP32 gradients the user means.
* anything that reads a Parameter outside its module's forward (a tied output head written as
  ``x @ self.embed.weight.T``, a method other than ``forward``, ``torch.compile``d code, where the hooks step
  aside) reads the FP32 Parameter, which autocast casts per use and autograd differentiates into the FP32 ``.grad``:
  Lightning's ``bf16-mixed`` semantics, also exact.

Refresh (one fused cast-copy, round to nearest): lazily, at the first hooked forward after :meth:`begin` or
:meth:`mark_stale`, so a write in ``training_step`` before the forward (WGAN's ``p.data.clamp_``) is seen. A copy
that a graph not yet back-propagated still holds (a GAN's ``fake = G(z)`` across the discriminator's step) is
refreshed into another tensor instead of in place, and its gradient still folds into the FP32 ``.grad`` when that
graph's backward comes (:mod:`.copies`): that graph back-propagates through the values it was built with, as under
``bf16-mixed``. The copy goes back into the flat buffer at its first refresh after the graph let it go.
``begin(force=True)`` refreshes every trainable copy (``.data`` writes do not move a version counter); otherwise a
copy is refreshed when its master's version counter or storage moved (a frozen parameter's copy is made once).

What is converted (``docs/behaviour.md``, "Where the 16-bit copies live"): FP32 parameters outside the FP32-kept
subtrees, and trainable 16-bit ones (an FP32 master once, with a warning); frozen 16-bit, float64, complex and integer
parameters and ``nn.Embedding(max_norm=...)`` keep theirs.

Memory per converted parameter: 4 B FP32 parameter + 2 B copy + 4 B FP32 gradient + optimizer state; a frozen one
has no gradient (4 B + 2 B: its copy, so that it computes as a trainable one does). Copies and FP32 gradients are
views of one flat buffer per device each, allocated when the parameter set changes (the gradients of parameters
unfrozen since share another); a steady step allocates nothing (a step that refreshes a copy a live graph holds
allocates that copy once more).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from itertools import repeat as _repeat
from operator import attrgetter, is_, is_not

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from lightning_mp.numerics import without_grad
from lightning_mp.numerics.bracket import bracket, unbracket
from lightning_mp.numerics.conversion import choose, warn_upcast
from lightning_mp.numerics.copies import (flat_views, fold_grads, fold_retired, grad_views, in_a_graph, none_held,
                                         refresh_apart)

_DTYPE, _DEVICE, _VERSION = attrgetter("dtype"), attrgetter("device"), attrgetter("_version")
_REQUIRES_GRAD, _DATA_PTR = attrgetter("requires_grad"), Tensor.data_ptr
_IS_NOT_NONE = partial(is_not, None)
_copy_ = without_grad(torch._foreach_copy_)
_autocast_on = torch.is_autocast_enabled


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
        self._hooked: set[int] = set()  # modules whose forward enters and leaves through hooks (bracket.py)
        self._swapped: dict[int, nn.Module] = {}  # ... through a class swap
        self._built = False
        # per converted parameter: Parameter, copy, FP32 gradient view, (data_ptr, version) at the last refresh
        self.params: list[nn.Parameter] = []
        self._copies: list[Tensor] = []  # what the forwards read: its home, or another tensor while a graph holds that
        self._homes: list[Tensor] = []  # each copy's place in the flat buffer
        self._uses: list[list[tuple[dict, str]]] = []  # per copy, the install dicts (and names) that hold it
        self._away = False  # a copy is not in its home
        self._retired: list[tuple[nn.Parameter, Tensor]] = []  # copies replaced while a graph held them (.copies)
        self._grad_views: list[Tensor] = []
        self._seen: list[tuple[int, int] | None] = []
        self._dtypes, self._devices = [], []  # the masters' dtypes and the copies' devices at the build
        self._device_type = "cpu"  # whose autocast a forward must be under to read the copies
        self._slot_of: dict[int, int] = {}  # id(Parameter) -> its index in params
        # what a module's forward installs, by id(module) (a module class may define __eq__, and so have no hash):
        # ({name: copy}, first name, (names, Nones), its _parameters, the Parameters the copies stand for)
        self._installs: dict[int, tuple] = {}
        self._recheck: set[int] = set()  # the modules that also own a lazy or frozen 16-bit parameter
        # checked at each refresh: per entry its module's _parameters, the name, the Parameter found there at the build
        self._owners, self._names, self._owned = [], [], []
        self._waiting: list[nn.Parameter] = []  # lazy, or frozen 16-bit: a copy once materialized or unfrozen
        self._requires_grad: list[bool] = []
        self._pending = True
        self._force = True
        self._warned = False

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
        params, slot, owners, upcast = choose(self._roots, self._keep_fp32)
        roots = {id(root) for root in self._roots}
        for mod, own in owners:
            if id(mod) not in self._hooked:
                # hooks for a lazy module: its own pre-hook materializes it, inside a swapped _call_impl
                handles = bracket(mod, self, hooks=id(mod) in roots or any(i < 0 for _, _, i in own))
                self._handles.extend(handles)
                if handles:
                    self._hooked.add(id(mod))
                else:
                    self._swapped[id(mod)] = mod
        if upcast and not self._warned:
            self._warned = True
            warn_upcast(*upcast)
        # copies that a graph not yet back-propagated holds (the forward that materialized a lazy module, say) keep
        # their gradients: they fold into their Parameters' .grad when that backward comes
        self._retired += [(p, c) for p, c in zip(self.params, self._copies) if in_a_graph(c)]
        self.params = params
        self._slot_of = {id(p): i for p, i in slot.items()}
        self._homes = flat_views(params, self.dtype, leaf=True)
        self._copies, self._away = list(self._homes), False
        self._uses = [[] for _ in params]
        self._grad_views = grad_views(params)  # trainable ones only: a frozen parameter gets no gradient
        # what each forward installs, and what the refresh checks once per step
        self._installs, self._recheck = {}, set()
        self._owners, self._names, self._owned, self._waiting = [], [], [], []
        for mod, own in owners:
            install = {name: self._copies[i] for name, _, i in own if i >= 0}
            for name, _, i in own:
                if i >= 0:
                    self._uses[i].append((install, name))
            if install:
                owned = tuple(p for _, p, i in own if i >= 0)
                installed = (tuple(install), (None,) * len(install))
                self._installs[id(mod)] = (install, next(iter(install)), installed, mod._parameters, owned)
            if len(install) < len(own):
                self._recheck.add(id(mod))
                self._waiting.extend(p for _, p, i in own if i < 0)
            self._owners += [mod._parameters] * len(own)
            self._names += [name for name, _, _ in own]
            self._owned += [p for _, p, _ in own]
        self._requires_grad = list(map(_REQUIRES_GRAD, self._copies))  # the copies follow at the next refresh
        self._seen = [None] * len(params)
        self._dtypes, self._devices = list(map(_DTYPE, params)), [c.device for c in self._copies]
        self._device_type = self._devices[0].type if self._devices else "cpu"
        self._built = True
        self._pending = True

    # ------------------------------------------------------------------ per step
    def begin(self, force: bool = False) -> None:
        """A step starts: refresh the copies at the next hooked forward; ``force`` refreshes every trainable one."""
        if not self._built:
            self._build()  # hooks the modules; the parameters are on their device by now
        self._pending = True
        self._force = self._force or force

    def rebuild(self) -> None:
        self._built = False  # the kept modules changed: choose the converted parameters again at begin()

    def mark_stale(self, params: Iterable[nn.Parameter]) -> None:
        """These masters changed (an optimizer stepped them): refresh their copies at the next hooked forward."""
        seen = self._seen
        # keyed by id: a Parameter's hash is a Python method (Tensor.__hash__), id() is not
        list(map(seen.__setitem__, filter(_IS_NOT_NONE, map(self._slot_of.get, map(id, params))), _repeat(None)))
        self._pending = True

    def _moved(self) -> bool:
        """Whether the parameters were moved, re-dtyped, replaced, pruned, materialized or unfrozen since the build."""
        params = self.params
        if list(map(_DTYPE, params)) != self._dtypes or list(map(_DEVICE, params)) != self._devices:
            return True
        if not all(map(is_, map(dict.get, self._owners, self._names), self._owned)):
            # replaced or pruned, unless by a plain tensor (functional_call's, for one call)
            now = map(dict.get, self._owners, self._names)
            return any(n is not p and isinstance(n, nn.Parameter | None) for n, p in zip(now, self._owned))
        return any(p.requires_grad and not is_lazy(p) for p in self._waiting)

    def _refresh(self) -> None:
        if not self._built:
            self._build()
        force, self._force, self._pending = self._force, False, False
        # C-level passes: a Python loop per parameter costs several times more inside a fit (cold caches)
        if self._moved():
            self._build()  # a new parameter set
            self._force = True
            return self._refresh()
        params, copies = self.params, self._copies
        requires_grad = list(map(_REQUIRES_GRAD, params))
        if requires_grad != self._requires_grad:  # frozen or unfrozen since (BaseFinetuning): the copies follow
            list(map(Tensor.requires_grad_, copies, requires_grad))
            self._requires_grad = requires_grad
            self._grad_views = grad_views(params, self._grad_views)  # the unfrozen ones' FP32 gradients
        marks = list(zip(map(_DATA_PTR, params), map(_VERSION, params)))
        every = force and all(requires_grad)
        if every:  # the Trainer's training step: every copy
            dst, src = copies, params
        else:
            stale = [i for i, (p, was, now) in enumerate(zip(params, self._seen, marks))
                     if was != now or (force and p.requires_grad)]
            dst, src = [copies[i] for i in stale], [params[i] for i in stale]
        if dst and not self._away and none_held(dst, every):
            # the steady step: in place, round to nearest, one fused pass, outside grad mode (the copies are leaves
            # that require grad)
            _copy_(dst, src)
        elif dst:  # a graph still holds a copy, or held one at the last refresh: a Python pass
            which = range(len(params)) if dst is copies else stale
            self._retired = refresh_apart(which, params, copies, self._homes, self._uses, self._retired)
            self._away = any(map(is_not, copies, self._homes))
        self._seen = marks

    def enter(self, module: nn.Module) -> tuple[tuple[str, ...], tuple[None, ...]] | None:
        """Before ``module``'s call: its copies in its instance ``__dict__``; the names to take out after the call
        (:mod:`.bracket`), ``None`` if none were put in. The parameter set is checked at the refresh, once per step;
        a call only checks that its module still holds the Parameters its copies stand for."""
        if not _autocast_on(self._device_type):
            return None  # outside the run's autocast (a callback's forward, jit.trace): FP32, as under bf16-mixed
        if self._pending:
            self._refresh()
        key = id(module)
        if self._recheck and key in self._recheck and self._moved():  # a lazy module materialized just now
            self._build()
            self._force = True
            self._refresh()
        install = self._installs.get(key)
        d = module.__dict__
        if install is None or install[1] in d:  # none, or a module called inside its own forward: in place already
            return None
        if not all(map(is_, map(install[3].get, install[2][0]), install[4])):
            return None  # another tensor in a Parameter's place for this call (functional_call): it reads that one
        d.update(install[0])
        return install[2]

    def fold_grads(self) -> None:
        """Add the copies' 16-bit gradients into the Parameters' FP32 ``.grad`` and drop them (:func:`.fold_grads`)."""
        fold_grads(self.params, self._copies, self._grad_views)
        if self._retired:
            self._retired = fold_retired(self._retired, self._slot_of, self._grad_views)

    def held_copies(self) -> list[tuple[nn.Parameter, Tensor]]:
        """(Parameter, copy) for each copy that a graph not yet back-propagated may still write a gradient into (a
        GAN's ``fake = G(z)`` across the discriminator's step): a precision switch folds those once this store is gone
        (:mod:`lightning_mp.core.ladder`)."""
        return [(p, c) for p, c in [*zip(self.params, self._copies), *self._retired] if in_a_graph(c)]

    # ------------------------------------------------------------------ teardown
    def remove(self) -> None:
        """Take the hooks and swapped classes out and give the memory back; the Parameters were FP32 all along."""
        self.fold_grads()
        for handle in self._handles:
            handle.remove()
        for mod in self._swapped.values():
            unbracket(mod)
        for root in self._roots:  # copies left in a forward that a BaseException (KeyboardInterrupt) cut short
            for mod in root.modules():
                if (install := self._installs.get(id(mod))) is not None:
                    list(map(mod.__dict__.pop, *install[2]))
        self.__init__(self.dtype, self._keep_fp32)

    def __deepcopy__(self, memo) -> MasterWeights:
        # a deep copy of a watched model (SWA, EMA) gets a fresh, empty store: it reads its FP32 Parameters
        return MasterWeights(self.dtype)

    def __reduce__(self):
        return (MasterWeights, (self.dtype,))
