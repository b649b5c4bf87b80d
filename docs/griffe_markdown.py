"""A griffe extension for the API reference: the package's docstrings are written for ``help()`` and Sphinx-style
readers (``:class:`X```, reST simple tables, ``Example::`` blocks); this turns those three into Markdown while
mkdocstrings loads them, so the site renders them as tables, code and code blocks. The source is not changed.

Used by ``mkdocs.yml`` (``extensions: [docs/griffe_markdown.py:SphinxToMarkdown]``).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

# :class:`lightning_mp.X`, :meth:`~OverflowLocator.report`, :data:`gpt.RECIPE` -> `X`, `report`, `gpt.RECIPE`
_ROLE = re.compile(r":(?:class|mod|meth|func|attr|data|exc|obj|const):`(~?)([^`]+)`")
# a border of a reST simple table: runs of '=' separated by spaces
_BORDER = re.compile(r"^( *)(=+)( +=+)+ *$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def _role(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


def _columns(border: str) -> list[tuple[int, int]]:
    return [(m.start(), m.end()) for m in re.finditer(r"=+", border)]


def _cells(line: str, columns: list[tuple[int, int]]) -> list[str]:
    cells = []
    for i, (start, _) in enumerate(columns):
        end = columns[i + 1][0] if i + 1 < len(columns) else len(line)
        cells.append(line[start:end].strip())
    return cells


def _escape_pipes(cell: str) -> str:
    """A ``|`` outside code spans would split the cell; inside them Python-Markdown's tables keep it as it is."""
    out, last = [], 0
    for span in _CODE_SPAN.finditer(cell):
        out += [cell[last : span.start()].replace("|", "\\|"), span.group(0)]
        last = span.end()
    return "".join(out) + cell[last:].replace("|", "\\|")


def _pipe_row(cells: list[str]) -> str:
    return "| " + " | ".join(_escape_pipes(c) for c in cells) + " |"


def _tables(lines: list[str]) -> list[str]:
    """reST simple tables (border, header, border, rows, border) as Markdown pipe tables; a row whose first cell is
    empty continues the row above it."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        if not _BORDER.match(lines[i]):
            out.append(lines[i])
            i += 1
            continue
        indent = _BORDER.match(lines[i]).group(1)
        columns = _columns(lines[i])
        end = i + 1
        borders = [i]
        while end < len(lines) and len(borders) < 3:
            if _BORDER.match(lines[end]):
                borders.append(end)
            end += 1
        if len(borders) < 3:  # not a table after all
            out.append(lines[i])
            i += 1
            continue
        header = [_cells(line, columns) for line in lines[borders[0] + 1 : borders[1]]]
        rows: list[list[str]] = []
        for line in lines[borders[1] + 1 : borders[2]]:
            if not line.strip():
                continue
            cells = _cells(line, columns)
            if rows and not cells[0]:
                rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells)]
            else:
                rows.append(cells)
        head = [" ".join(parts).strip() for parts in zip(*header)] if header else [""] * len(columns)
        if out and out[-1].strip():
            out.append("")
        out.append(indent + _pipe_row(head))
        out.append(indent + "|" + "|".join("---" for _ in columns) + "|")
        out.extend(indent + _pipe_row(row) for row in rows)
        i = borders[2] + 1
    return out


def _literal_blocks(lines: list[str]) -> list[str]:
    """``Some text::`` before an indented block: the block is already Markdown code; drop the reST marker."""
    out = []
    for line in lines:
        if line.rstrip().endswith("::") and not line.strip().startswith(".."):
            stripped = line.rstrip()[:-2].rstrip()
            # "Example::" alone would become a Google "Example:" section; keep it as plain text
            out.append(stripped + ("" if stripped.strip() in {"Example", "Examples"} else ":") if stripped else "")
        else:
            out.append(line)
    return out


def to_markdown(text: str) -> str:
    lines = _literal_blocks(_tables(text.splitlines()))
    return _ROLE.sub(_role, "\n".join(lines))


def _scaler_defaults() -> dict[str, str]:
    """The plugins' signatures read the scaler's defaults as ``_S.init_scale`` (``_S = ScalerSettings``): their
    values, for the signatures the site shows."""
    from dataclasses import fields

    try:
        from lightning_mp.numerics.loss_scaler import ScalerSettings
    except ImportError:  # the package is not importable here: the signatures keep the source text
        return {}
    return {f"_S.{f.name}": repr(f.default) for f in fields(ScalerSettings)}


class SphinxToMarkdown(griffe.Extension):
    """Rewrites each loaded object's docstring (see the module docstring), and the scaler knobs' defaults."""

    def __init__(self) -> None:
        super().__init__()
        self._defaults: dict[str, str] | None = None

    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        docstring = getattr(obj, "docstring", None)
        if docstring is not None and docstring.value:
            docstring.value = to_markdown(docstring.value)
        for parameter in getattr(obj, "parameters", None) or ():
            if str(parameter.default).startswith("_S."):
                if self._defaults is None:
                    self._defaults = _scaler_defaults()
                parameter.default = self._defaults.get(str(parameter.default), parameter.default)
