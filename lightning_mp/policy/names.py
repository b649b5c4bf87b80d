"""What an ``fp32_ops`` entry stands for: an op name (or a torch callable, normalised to its name) resolved to
every callable that reaches the op mode under that name (``torch.X``, ``F.X``, ``Tensor.X``, ``torch.special.X``,
``torch.linalg.X``, operator dunders), and the clear errors for entries that cannot be intercepted.

Runs once, when a policy is built; nothing here is on the per-call path.
"""

from __future__ import annotations

import difflib
import functools
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_mp.policy.ops import _DUNDER_TO_OP, _EXTRA_ALIASES, DEFAULT_FP32_OPS

# --------------------------------------------------------------------------------------
# Resolution of op names and callables.
# --------------------------------------------------------------------------------------

# Namespaces searched for a plain op name, with the label shown by describe().
_PLAIN_NAMESPACES: tuple[tuple[str, Any], ...] = (
    ("torch", torch),
    ("F", F),
    ("Tensor", torch.Tensor),
    ("torch.special", torch.special),
    ("torch.linalg", torch.linalg),
)
_NAMESPACE_BY_LABEL = dict(_PLAIN_NAMESPACES)


def _is_dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


def _is_inplace(name: str) -> bool:
    if _is_dunder(name):
        # __iadd__, __ipow__, ... (but not __invert__, __index__, __int__, __init__)
        return name[2] == "i" and name[3:-2] in {
            "add", "sub", "mul", "truediv", "floordiv", "div", "mod", "pow", "matmul",
            "and", "or", "xor", "lshift", "rshift",
        }
    return name.endswith("_") and not name.startswith("_")


@functools.lru_cache(maxsize=None)
def _interceptable() -> frozenset[Callable[..., Any]]:
    """Every callable that dispatches through ``__torch_function__`` (and so reaches a mode)."""
    funcs: set[Callable[..., Any]] = set()
    for listed in torch.overrides.get_overridable_functions().values():
        funcs.update(listed)
    return frozenset(funcs)


def _can_intercept(obj: Any) -> bool:
    if not callable(obj) or isinstance(obj, type):
        return False
    try:
        return obj in _interceptable()
    except TypeError:  # unhashable callable
        return False


def _lookup(namespace: Any, name: str) -> Any:
    # Module namespaces are read through vars() so that a lookup never triggers a
    # module-level __getattr__ (torch lazily imports submodules that way).
    if namespace is torch.Tensor:
        if name.startswith("_") and not _is_dunder(name):
            return None
        return getattr(torch.Tensor, name, None)
    if name.startswith("_"):
        return None
    return vars(namespace).get(name)


def _aliases_of_name(name: str) -> tuple[tuple[str, Callable[..., Any]], ...]:
    """All interceptable callables that an op name stands for, with display labels."""
    found: list[tuple[str, Callable[..., Any]]] = []
    seen: set[int] = set()
    candidates = [(label, name) for label, _ in _PLAIN_NAMESPACES] + list(_EXTRA_ALIASES.get(name, ()))
    for label, attr in candidates:
        obj = _lookup(_NAMESPACE_BY_LABEL[label], attr)
        if obj is not None and id(obj) not in seen and _can_intercept(obj):
            seen.add(id(obj))
            found.append((f"{label}.{attr}", obj))
    return tuple(found)


@functools.lru_cache(maxsize=None)
def _reverse_index() -> dict[Callable[..., Any], str]:
    """Callable -> canonical op name, built once on first use (a walk over torch's namespaces)."""
    index: dict[Callable[..., Any], str] = {}
    for _, namespace in _PLAIN_NAMESPACES:
        names = dir(torch.Tensor) if namespace is torch.Tensor else list(vars(namespace))
        for name in names:
            obj = _lookup(namespace, name)
            if obj is not None and _can_intercept(obj):
                index.setdefault(obj, _DUNDER_TO_OP.get(name, name))
    # Interceptable callables outside the plain namespaces (torch.fft, ...) get a
    # dotted canonical name that resolves back to them.
    for namespace, listed in torch.overrides.get_overridable_functions().items():
        if not isinstance(namespace, types.ModuleType):
            continue
        wanted = set(listed)
        for name, obj in vars(namespace).items():
            if not name.startswith("_") and _hashable(obj) and obj in wanted:
                index.setdefault(obj, f"{namespace.__name__}.{name}")
    return index


def _hashable(obj: Any) -> bool:
    try:
        hash(obj)
    except TypeError:
        return False
    return True


def _resolve_dotted(path: str) -> Any:
    parts = path.split(".")
    if parts[0] != "torch" or len(parts) < 2:
        return None
    obj: Any = torch
    for part in parts[1:]:
        if isinstance(obj, types.ModuleType):
            obj = vars(obj).get(part)
        elif obj is torch.Tensor:
            obj = getattr(obj, part, None)
        else:
            return None
        if obj is None:
            return None
    return obj


def _known_names_hint() -> str:
    return (
        "Known names: every default ("
        + ", ".join(sorted(DEFAULT_FP32_OPS))
        + ") and any public op of torch, torch.nn.functional, torch.special, torch.linalg "
        "or a torch.Tensor method (e.g. 'tanh', 'sigmoid', 'var', 'matmul'); other torch "
        "functions by dotted path (e.g. 'torch.fft.rfft')."
    )


def _unknown_name_error(spec: str) -> ValueError:
    pool = set(DEFAULT_FP32_OPS)
    pool.update(_reverse_index().values())
    pool.discard(spec)
    close = difflib.get_close_matches(spec, sorted(pool), n=3, cutoff=0.75)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return ValueError(f"fp32_ops: unknown op name {spec!r}.{hint} {_known_names_hint()}")


def _canonical_name(spec: Any) -> str:
    """Map one fp32_ops entry (name or torch callable) to its canonical op name."""
    if isinstance(spec, str):
        name = spec.strip()
        if "." in name:
            obj = _resolve_dotted(name)
            if obj is None or not _can_intercept(obj):
                raise _unknown_name_error(spec)
            name = _reverse_index().get(obj, name)
        else:
            name = _DUNDER_TO_OP.get(name, name)
    elif isinstance(spec, type):
        hint = " Module classes belong in fp32_modules." if issubclass(spec, nn.Module) else ""
        raise TypeError(f"fp32_ops: expected op names or torch functions, got the class {spec!r}.{hint}")
    elif callable(spec):
        name = _reverse_index().get(spec) if _can_intercept(spec) else None
        if name is None:
            raise ValueError(
                f"fp32_ops: {spec!r} is not a torch function this policy can intercept. Pass a "
                "public function of torch, torch.nn.functional, torch.special, torch.linalg or "
                "torch.fft, or a torch.Tensor method (user-defined functions, lambdas and "
                "torch.ops.aten overloads never reach the interception point)."
            )
    else:
        raise TypeError(f"fp32_ops: entries must be op names (str) or torch functions, got {spec!r}.")

    if _is_inplace(name.rsplit(".", 1)[-1]):
        raise ValueError(
            f"fp32_ops: {spec!r} is an in-place op; it has to write into its (possibly 16-bit) "
            "input, so it cannot produce an FP32 result. List the out-of-place op instead."
        )
    if "." not in name and not _aliases_of_name(name):
        raise _unknown_name_error(spec if isinstance(spec, str) else name)
    return name


def _aliases_of_canonical(name: str) -> tuple[tuple[str, Callable[..., Any]], ...]:
    if "." in name:
        return ((name, _resolve_dotted(name)),)
    return _aliases_of_name(name)


def validate_modules(modules: Any) -> tuple[type[nn.Module], ...]:
    if isinstance(modules, type):
        raise TypeError(
            f"fp32_modules must be a tuple of nn.Module subclasses, got the class {modules!r} "
            f"itself; wrap it: ({modules.__name__},)."
        )
    if isinstance(modules, (str, bytes)) or not isinstance(modules, Iterable):
        raise TypeError(f"fp32_modules must be a tuple of nn.Module subclasses, got {modules!r}.")
    result: list[type[nn.Module]] = []
    for cls in modules:
        if isinstance(cls, nn.Module):
            raise TypeError(
                f"fp32_modules entries must be classes, got the instance {type(cls).__name__}(...); "
                f"pass {type(cls).__name__} instead."
            )
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"fp32_modules entries must be nn.Module subclasses, got {cls!r}.")
        if cls is nn.Module:
            raise ValueError(
                "fp32_modules: nn.Module itself would keep every module, the root included, in "
                "FP32 and switch mixed precision off; list specific classes."
            )
        if cls not in result:
            result.append(cls)
    return tuple(result)


def validate_ops(ops: Any) -> dict[str, tuple[tuple[str, Callable[..., Any]], ...]]:
    if isinstance(ops, (str, bytes)):
        raise TypeError(
            f"fp32_ops must be a collection of op names or torch functions, not the single string "
            f"{ops!r}; did you mean {{{ops!r}}}?"
        )
    if not isinstance(ops, Iterable) or callable(ops):
        raise TypeError(f"fp32_ops must be a collection of op names or torch functions, got {ops!r}.")
    resolved: dict[str, tuple[tuple[str, Callable[..., Any]], ...]] = {}
    for spec in ops:
        name = _canonical_name(spec)
        if name not in resolved:
            resolved[name] = _aliases_of_canonical(name)
    return resolved
