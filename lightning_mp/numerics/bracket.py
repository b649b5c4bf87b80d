"""How a module's ``forward`` reaches the 16-bit copies of :mod:`lightning_mp.numerics.master_weights`: before the call
the store's ``enter(module)`` puts them in the module's instance ``__dict__`` and says which names it put there;
after the call, on every way out (an exception included), those names come out again.

Two ways, chosen per module by :func:`bracket`:

* **A class swap** (the modules inside a model, the common case). The module's class becomes a subclass of it,
  made once per class and named as it, whose ``_call_impl`` brackets ``nn.Module``'s: a forward set on the instance
  (Fabric's marked methods, accelerate's hooks) runs inside the bracket too. ``nn.Module.__call__`` keeps its fast
  path: about 130 bytecodes a call with the store's ``enter``, where a forward pre-hook and an always-called
  forward hook send every call through ``_call_impl``'s hook path, about 390 with the hooks' own (on the Llama 2x64
  of ``benchmarks/zoo.py``, 20 module calls a step: 5.2k bytecodes fewer). ``isinstance``, the class name and
  ``repr`` are unchanged; ``type(module) is cls`` is not, the price torch's parametrizations and FSDP2 pay for the
  same reason. Pickling, ``copy`` and ``deepcopy`` give the original class, which computes on its own FP32
  Parameters under autocast. :func:`unbracket` puts the class back.
* **Hooks** (a forward pre-hook and an always-called forward hook) where a swap would be read or undone by someone
  else: the roots the store watches (the LightningModule, the model given to Fabric: ``torch.export`` reads a
  root's ``forward``, Fabric and wrappers redirect it through an instance attribute, which would shadow a class's
  ``forward``), a lazy module (its own pre-hook materializes it, which inside a swapped ``_call_impl`` would run
  after the store's ``enter``), a parametrized module (``remove_parametrizations`` swaps back to ``__bases__[0]``),
  and a class whose subclasses someone else would see or that pickling would not find (a metaclass, an
  ``__init_subclass__``, its own ``__new__``). Our pre-hook runs after the user's pre-hooks and our forward hook
  before the user's forward hooks.

Either way, hooks that the user puts on a module see its FP32 Parameters, as under ``bf16-mixed`` (a swapped module
with hooks has its copies put in around its ``forward`` only, :func:`_hooked_call`), and so does everything outside
the run's autocast (the store's ``enter`` puts nothing in there).

Compiled code (``torch.compile``, ``torch.export``) runs the plain ``forward``: it reads the FP32 Parameters under
autocast, as with Lightning's ``bf16-mixed``.
"""

from __future__ import annotations

import copyreg
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks
from torch.nn.utils import parametrize

_STORE = "_lightning_mp_store"  # the module's __dict__ entry: the store whose copies its forward reads
_SUBCLASSES: dict[type, type] = {}  # class -> its bracketing subclass (classes live as long as their module anyway)
_BRACKETING: set[type] = set()


Installed = tuple[tuple[str, ...], tuple[None, ...]]  # the names put in the instance __dict__, and as many Nones


class Store(Protocol):
    def enter(self, module: nn.Module) -> Installed | None:
        """Put the module's copies in place; what to take out after the call (``None``: nothing was put in)."""


def _take_out(module: nn.Module, installed: Installed) -> None:
    list(map(module.__dict__.pop, *installed))  # pop(name, None) per name, one C-level pass


def bracket(module: nn.Module, store: Store, hooks: bool) -> list[Any]:
    """Bracket ``module``'s forward with ``store``; the hook handles to remove at teardown (none for a swap).
    ``hooks``: use hooks (a root); a parametrized module and a class that cannot be subclassed use them too."""
    if not hooks and not parametrize.is_parametrized(module):
        sub = _subclass(type(module))
        if sub is not None:
            module.__dict__[_STORE] = store
            if type(module) is not sub:
                module.__class__ = sub
            return []

    # the pre-hook runs after the user's pre-hooks and the forward hook before the user's forward hooks: theirs see the
    # FP32 Parameters, as under bf16-mixed
    hooks = _Hooks(store)
    return [module.register_forward_pre_hook(hooks.enter),
            module.register_forward_hook(hooks.leave, always_call=True, prepend=True)]


class _Hooks:
    """The hook pair of one module (an object, not closures: a model pickled with its hooks, ``torch.save(model)``
    during a fit, pickles them with the store, which pickles as an empty one)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.calls: list[Installed | None] = []  # per call in progress (a module can call itself inside its forward)

    def enter(self, module: nn.Module, args: Any) -> None:
        self.calls.append(None if torch.compiler.is_compiling() else self.store.enter(module))

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.calls and (installed := self.calls.pop()) is not None:
            _take_out(module, installed)

    def __reduce__(self):
        return (_Hooks, (self.store,))


def _hooked_call(module: nn.Module, cls: type, store: Store, args: tuple, kwargs: dict) -> Any:
    """A swapped module that has forward hooks (registered after the swap, or global ones): the copies go in around
    its forward only, so the hooks see the FP32 Parameters as under bf16-mixed (through a forward set on the instance
    for this call; one already there, Fabric's redirection, is wrapped and put back)."""
    d = module.__dict__
    own = d.get("forward")
    inner = own if own is not None else cls.forward.__get__(module)

    def forward(*a: Any, **k: Any) -> Any:
        installed = store.enter(module)
        try:
            return inner(*a, **k)
        finally:
            if installed is not None:
                _take_out(module, installed)

    d["forward"] = forward
    try:
        return cls._call_impl(module, *args, **kwargs)
    finally:
        if own is None:
            d.pop("forward", None)
        else:
            d["forward"] = own


def unbracket(module: nn.Module) -> None:
    """The module's own class again (if no one swapped another on top of ours since) and no store."""
    module.__dict__.pop(_STORE, None)
    cls = type(module)
    if cls in _BRACKETING:
        module.__class__ = cls.__bases__[0]


def _subclass(cls: type) -> type | None:
    if cls in _BRACKETING:
        return cls
    sub = _SUBCLASSES.get(cls)
    if sub is not None:
        return sub
    if type(cls) is not type or any("__init_subclass__" in vars(c) or "__new__" in vars(c) for c in cls.__mro__[:-1]):
        return None  # a metaclass or an __init_subclass__ would see (register) our class; a __new__ defeats pickling

    def _call_impl(self, *args, **kwargs):
        # around nn.Module's _call_impl, not forward: a forward set on the instance (Fabric's redirection of a marked
        # method, accelerate's hooks, a test's wrapper) runs inside the bracket too. The class's own looked up per call.
        if torch.compiler.is_compiling():
            return cls._call_impl(self, *args, **kwargs)
        store = self.__dict__.get(_STORE)
        if store is None:  # a DataParallel replica, say: its own parameters
            return cls._call_impl(self, *args, **kwargs)
        if self._forward_hooks or self._forward_pre_hooks or _global_forward_hooks or _global_forward_pre_hooks:
            return _hooked_call(self, cls, store, args, kwargs)
        installed = store.enter(self)
        try:
            return cls._call_impl(self, *args, **kwargs)
        finally:
            if installed is not None:
                list(map(self.__dict__.pop, *installed))  # _take_out, inline: one call less per module call

    def __reduce_ex__(self, protocol):
        # pickled and copied as the original class, without the store: the copy computes on its own FP32 Parameters.
        # pickle refuses __newobj__ with another class than the object's: object.__new__(cls) through copyreg
        # (protocols 0 and 1 reduce to copyreg._reconstructor already)
        rv = cls.__reduce_ex__(self, protocol)
        if type(rv) is tuple and len(rv) > 2 and type(rv[1]) is tuple and rv[1][:1] == (sub,):
            state = rv[2]
            if isinstance(state, dict) and _STORE in state:
                state = {k: v for k, v in state.items() if k != _STORE}
            args = (cls, object, None) if rv[0] is copyreg.__newobj__ else (cls, *rv[1][1:])
            return (copyreg._reconstructor if rv[0] is copyreg.__newobj__ else rv[0], args, state, *rv[3:])
        return rv

    try:
        sub = type(cls.__name__, (cls,), {
            "_call_impl": _call_impl, "__reduce_ex__": __reduce_ex__, "__module__": cls.__module__,
            "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
        })
    except Exception:  # a metaclass or __init_subclass__ that refuses: hooks instead
        return None
    _SUBCLASSES[cls] = sub
    _BRACKETING.add(sub)
    return sub
