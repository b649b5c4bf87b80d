"""How a module's ``forward`` reaches the 16-bit copies of :mod:`lightning_mp.numerics.master_weights`: before the call
the store's ``enter(module)`` puts them in the module's instance ``__dict__`` and says which names it put there;
after the call, on every way out (an exception included), those names come out again.

Two ways, chosen per module by :func:`bracket`:

* **A class swap** (the modules inside a model, the common case). The module's class becomes a subclass of it,
  made once per class and named as it, whose ``_call_impl`` brackets ``nn.Module``'s: a forward set on the instance
  (Fabric's marked methods, accelerate's hooks) runs inside the bracket too. ``nn.Module.__call__`` keeps its fast
  path: about 100 bytecodes a call with the store's ``enter``, where a forward pre-hook and an always-called
  forward hook send every call through ``_call_impl``'s hook path, about 390 with the hooks' own (on the Llama 2x64
  of ``benchmarks/zoo.py``, 20 module calls a step: 5.8k bytecodes fewer). ``isinstance``, the class name and
  ``repr`` are unchanged; ``type(module) is cls`` is not, the price torch's parametrizations and FSDP2 pay for the
  same reason. Pickling, ``copy`` and ``deepcopy`` give the original class, which computes on its own FP32
  Parameters under autocast. :func:`unbracket` puts the class back.
* **Hooks** (a forward pre-hook and an always-called forward hook) where a swap would be read or undone by someone
  else: the roots the store watches (the LightningModule, the model given to Fabric: ``torch.export`` reads a
  root's ``forward``, Fabric and wrappers redirect it through an instance attribute, which would shadow a class's
  ``forward``), a lazy module (its own pre-hook materializes it, which inside a swapped ``_call_impl`` would run
  after the store's ``enter``), a parametrized module (``remove_parametrizations`` swaps back to ``__bases__[0]``),
  and a class that cannot be subclassed.

Compiled code (``torch.compile``, ``torch.export``) runs the plain ``forward``: it reads the FP32 Parameters under
autocast, as with Lightning's ``bf16-mixed``.
"""

from __future__ import annotations

import copyreg
from typing import Any, Protocol

import torch
from torch import nn
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

    calls: list[Installed | None] = []  # per call in progress (a module can call itself inside its forward)

    def enter(mod: nn.Module, args: Any) -> None:
        calls.append(None if torch.compiler.is_compiling() else store.enter(mod))

    def leave(mod: nn.Module, args: Any, output: Any) -> None:
        if calls and (installed := calls.pop()) is not None:
            _take_out(mod, installed)

    return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave, always_call=True)]


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

    def _call_impl(self, *args, **kwargs):
        # around nn.Module's _call_impl, not forward: a forward set on the instance (Fabric's redirection of a marked
        # method, accelerate's hooks, a test's wrapper) runs inside the bracket too. The class's own looked up per call.
        if torch.compiler.is_compiling():
            return cls._call_impl(self, *args, **kwargs)
        store = self.__dict__.get(_STORE)
        if store is None:  # a DataParallel replica, say: its own parameters
            return cls._call_impl(self, *args, **kwargs)
        installed = store.enter(self)
        try:
            return cls._call_impl(self, *args, **kwargs)
        finally:
            if installed is not None:
                list(map(self.__dict__.pop, *installed))  # _take_out, inline: one call less per module call

    def __reduce_ex__(self, protocol):
        # pickled and copied as the original class, without the store: the copy computes on its own FP32 Parameters.
        # pickle refuses __newobj__ with another class than the object's: object.__new__(cls) through copyreg
        rv = cls.__reduce_ex__(self, protocol)
        if type(rv) is tuple and len(rv) > 2 and rv[0] is copyreg.__newobj__ and rv[1] == (sub,) and (
            cls.__new__ is object.__new__
        ):
            state = rv[2]
            if isinstance(state, dict) and _STORE in state:
                state = {k: v for k, v in state.items() if k != _STORE}
            return (copyreg._reconstructor, (cls, object, None), state, *rv[3:])
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
