"""Argument checks with one wording: the argument, its value (``!r``), what is allowed, and why where it helps.

``ValueError`` for every bad value (never ``assert``): ``name=value is not allowed: use ...``.
"""

from __future__ import annotations

import math
from typing import Any


def check_int(name: str, value: Any, low: int, why: str = "", allow_none: str = "") -> None:
    """An ``int`` >= ``low`` (``bool`` is refused: ``True`` is a mistake, not the number 1); ``None`` too when
    ``allow_none`` says what it means."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        extra = f" ({why})" if why else ""
        alternative = f" or None ({allow_none})" if allow_none else ""
        raise ValueError(f"{name}={value!r} is not allowed: use an integer >= {low}{extra}{alternative}.")


def check_number(name: str, value: Any, low: float, low_open: bool = False, high: float | None = None) -> None:
    """A finite real number >= ``low`` (> with ``low_open``), and < ``high`` when given."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (high is None or value < high)
    if not ok:
        bound = f"> {low:g}" if low_open else f">= {low:g}"
        if high is not None:
            bound = f"in ({low:g}, {high:g})"
        raise ValueError(f"{name}={value!r} is not allowed: use a finite number {bound}.")


def check_bool(name: str, value: Any, also: tuple[str, str] | None = None) -> None:
    """A bool, or where ``also`` is (value, what it means) that one string too."""
    if isinstance(value, bool) or (also is not None and isinstance(value, str) and value == also[0]):
        return
    extra = f" or {also[0]!r} ({also[1]})" if also is not None else " or False"
    raise ValueError(f"{name}={value!r} is not allowed: use True{', False' if also else ''}{extra}.")
