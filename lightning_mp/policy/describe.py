"""The Markdown of :meth:`lightning_mp.Fp32Policy.describe`: which ops and module classes run in FP32, and why.

The reasons come from :mod:`lightning_mp.policy.ops`, what each op name covers from the policy's resolved aliases.
Text only: nothing here runs during training.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch.nn as nn

from lightning_mp.policy.aten import OpReach

from lightning_mp.policy.ops import (
    _GROUP_NOTES,
    _OP_GROUP_OF,
    _OP_GROUPS,
    _WHY_NORM_LAYER,
    EMBEDDING_MODULES,
    NORM_MODULES,
)


def describe_policy(
    aliases: dict[str, tuple[tuple[str, Callable[..., Any]], ...]],
    modules: tuple[type[nn.Module], ...],
    reach: Mapping[str, OpReach] | None = None,
    python_only: frozenset[str] = frozenset(),
    unlisted: frozenset[str] = frozenset(),
) -> str:
    """Markdown tables of the FP32 ops (canonical name -> its ``(label, callable)`` pairs, and where each becomes
    FP32: the aten ops its kernels sit on, or how a pure-Python composite is handled) and of the FP32 module
    classes."""
    lines = [
        "#### Ops computed in FP32",
        "",
        "Under `torch.autocast`, while the policy is active: 16-bit floating inputs are upcast, autocast is off "
        "for the call, the result is FP32 (batch norm with FP32 weight and statistics takes a 16-bit input as it "
        "is and computes its statistics in FP32 inside the kernel). Kernels sit at the autocast dispatch keys on "
        "the aten ops listed (only where autocast does not already compute them in FP32), so unlisted ops cost "
        "nothing. `F` is `torch.nn.functional`.",
        "",
    ]
    if aliases:
        groups: dict[str, list[str]] = {}
        for name in sorted(aliases):
            groups.setdefault(_OP_GROUP_OF.get(name, "user-added"), []).append(name)
        ordered = [g for g, _, _ in _OP_GROUPS if g in groups] + (["user-added"] if "user-added" in groups else [])
        lines += ["| Group | Ops | Why FP32 |", "|---|---|---|"]
        for group in ordered:
            names = ", ".join(f"`{n}`" for n in groups[group])
            lines.append(f"| {group} | {names} | {_GROUP_NOTES.get(group, 'selected by the user')} |")
        lines += ["", "| Op | Callables | Where it becomes FP32 |", "|---|---|---|"]
        for group in ordered:
            for name in groups[group]:
                callables = ", ".join(f"`{label}`" for label, _ in aliases[name])
                lines.append(f"| `{name}` | {callables} | {_where(name, reach, python_only)} |")
    else:
        lines.append("_None._")
    if unlisted:
        lines += [
            "",
            "Left out of `DEFAULT_FP32_OPS`, so computed in the 16-bit format on every device (where autocast's own "
            "list would run one in FP32, a kernel keeps it in 16 bits): " + ", ".join(f"`{n}`" for n in sorted(unlisted)),
        ]
    lines += ["", "#### Modules kept in FP32 (parameters and forward)", ""]
    if modules:
        lines += ["| Module class | Covers | Why FP32 |", "|---|---|---|"]
        for cls in modules:
            covers = ", ".join(_public_subclasses(cls)) or cls.__name__
            lines.append(f"| `{_class_path(cls)}` | {covers} | {_module_reason(cls)} |")
    else:
        lines.append("_None: every parameter follows the precision setting._")
    return "\n".join(lines)


def _where(name: str, reach: Mapping[str, OpReach] | None, python_only: frozenset[str]) -> str:
    if reach is None or name not in reach:
        return "?"
    found = reach[name]
    if found.packets:
        where = "aten " + ", ".join(f"`{packet}`" for packet in found.packets)
    elif name in python_only:
        via = f" (FP32 through {', '.join(f'`{n}`' for n in found.via_names)} when listed)" if found.via_names else ""
        where = (
            "pure-Python composite intercepted in Python by `op_context()`: ~1 us on every torch call in it, "
            f"not replayed by activation checkpointing{via}"
        )
    else:
        where = "pure-Python composite, FP32 through the listed " + ", ".join(f"`{n}`" for n in found.via_names)
    return f"{where}; {found.note}" if found.note else where


def _class_path(cls: type) -> str:
    if getattr(nn, cls.__name__, None) is cls:
        return f"torch.nn.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _public_subclasses(cls: type) -> list[str]:
    """Public torch.nn classes covered by an isinstance check against ``cls``."""
    return [
        name
        for name, obj in vars(nn).items()
        if isinstance(obj, type) and issubclass(obj, cls) and not name.startswith("_")
        and not (name.endswith("Base") and obj is not cls)
    ]


def _module_reason(cls: type) -> str:
    if issubclass(cls, (nn.RNNBase, nn.RNNCellBase)):
        return (
            "state fed back every step compounds 16-bit rounding; under fp16 autocast on CPU "
            "oneDNN's LSTM fails on FP32 inputs; costs the 16-bit speed-up of the recurrence"
        )
    if cls in NORM_MODULES or any(issubclass(cls, norm) for norm in NORM_MODULES):
        return _WHY_NORM_LAYER + "; few or no parameters, so FP32 weights are nearly free"
    if issubclass(cls, EMBEDDING_MODULES):
        return (
            "a lookup, no arithmetic to speed up; an FP32 table keeps the residual stream it starts in FP32 "
            "(a 16-bit one rounds every residual add)"
        )
    return "selected by the user"
