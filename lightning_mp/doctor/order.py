"""Where each module and parameter sits: the order the locator names gradients in (backward order)."""

from __future__ import annotations

import weakref

from torch import nn


class ModuleOrder:
    """The watched modules' names and types, their parameters, and their forward execution order once seen.

    Backward order is the reverse of the forward execution order (``rank``, which the locator's forward hooks fill
    while they are on), else the reverse of registration order (``named_modules()``): the execution order of
    ``nn.Sequential``, ``ModuleList`` stacks and transformer blocks. Within a module, parameters in reverse
    registration order."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self.names: list[str] = []
        self.types: list[str] = []
        self.modules: list[weakref.ref] = []
        # qualified parameter name -> (module index, parameter name, position in registration order)
        self.params: dict[str, tuple[int, str, int]] = {}
        self.rank: dict[int, int] = {}  # module index -> position in forward execution order
        for index, (name, module) in enumerate(model.named_modules()):
            self.names.append(name)
            self.types.append(type(module).__name__)
            self.modules.append(weakref.ref(module))
            for pname, _ in module.named_parameters(recurse=False):
                self.params.setdefault(f"{name}.{pname}" if name else pname, (index, pname, len(self.params)))

    def __getstate__(self) -> dict:
        # the modules by reference: they are ``_model``'s submodules, pickled with it (pickle stores each object once)
        return {**self.__dict__, "modules": [ref() for ref in self.modules]}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.modules[:] = [weakref.ref(m) if m is not None else _gone for m in self.modules]

    def forward_key(self, index: int) -> tuple[int, int]:
        """Where module ``index`` ran in the forward: its execution position once the forward hooks have seen a
        forward (modules they never saw first), else its registration position (see the module docstring)."""
        if index < 0:
            return (-2, index)
        return (self.rank.get(index, -1), index) if self.rank else (index, index)

    def backward_key(self, name: str) -> tuple[int, int, int]:
        index, _, position = self.params.get(name, (-1, name, -1))
        return (*self.forward_key(index), position)

    def where(self, name: str) -> tuple[int, str]:
        index, pname, _ = self.params.get(name, (-1, name.rpartition(".")[2], -1))
        return index, pname

    def module_name(self, index: int, name: str) -> str:
        return self.names[index] if index >= 0 else name.rpartition(".")[0]

    def module_type(self, index: int, name: str) -> str:
        if index >= 0:
            return self.types[index]
        try:  # a parameter registered after the locator was made
            return type(self._model.get_submodule(name.rpartition(".")[0])).__name__
        except AttributeError:
            return "?"


def _gone() -> None:  # a module collected before the pickle, as its dead weak reference answers
    return None
