"""Which Linears compute in FP8: ``fp8_modules``, the default rule or the user's list.

The default (``fp8_modules="default"``) keeps in high precision what every FP8 recipe in use keeps there
(torchtitan, torchao's README, Transformer Engine's recipes, NVIDIA's FP8 primer):

==========================================  ===========================================================================
kept in bf16                                why
==========================================  ===========================================================================
the output head: the model's last Linear,   its logits feed a softmax over the vocabulary: FP8's 3 mantissa bits
and a Linear tied to an embedding           (e4m3) cost accuracy there, and it is one GEMM of many (torchtitan
                                            filters ``output``); embeddings are no GEMM and stay FP32 already
                                            (``fp32_modules``)
dimensions not multiples of 16 (32: MXFP8)  ``torch._scaled_mm`` refuses them; MX scales blocks of 32
GEMMs too small to gain                     torchao's measured rule (below), per recipe
Linears in FP32-kept subtrees               ``fp32_modules`` wins
a subclass of ``nn.Linear`` with its own    its ``forward`` is the user's; torchao's swap would replace it
``forward``
==========================================  ===========================================================================

The shape rule is torchao's own (``torchao/float8/float8_linear_utils.py``, ``_auto_filter_for_tensorwise`` and
``_auto_filter_for_rowwise``), whose thresholds come from the speed-up tables of ``torchao/float8/README.md``,
measured on H100 GPUs: an ``nn.Linear(K, N)`` (weight ``N x K``) stays in bf16 when

* ``tensorwise``: ``K <= 4096`` and ``N <= 1024``;
* ``rowwise``: ``N <= 2048``, or ``K <= 1024``, or ``N <= 4096`` and ``K <= 2048``;
* ``rowwise_with_gw_hp`` and ``mxfp8``: torchao measured no rule for them (its filter refuses
  ``rowwise_with_gw_hp``); rowwise's is used, the nearest measured one.

Below those sizes the casts cost more than the faster GEMM saves. So the default leaves every Linear of a small
model (the demo GPT, 256 wide) in bf16, on every device alike. A list chooses instead: ``fp8_modules=[nn.Linear]``
(every Linear outside FP32-kept subtrees), ``["mlp", "attn.qkv"]`` (names), ``[MyBlock]`` (classes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from torch import nn

DEFAULT_FP8_MODULES = "default"
AUTO = "auto"  # the FP8 autopilot (lightning_mp.fp8.autopilot): measured, on top of the default or of a list


def check_fp8_modules(value: object) -> str | tuple:
    """``"default"``, ``"auto"``, or a non-empty list of module names (str) and ``nn.Module`` classes (``"auto"``
    among them: that list, measured)."""
    if isinstance(value, str) and value in (DEFAULT_FP8_MODULES, AUTO):
        return value
    ok = isinstance(value, (list, tuple, set, frozenset)) and len(value) > 0
    bad = [] if not ok else [v for v in value if not _is_entry(v)]
    if not ok or bad:
        what = f" ({bad[0]!r} is neither)" if bad else ""
        raise ValueError(
            f"fp8_modules={value!r} is not allowed{what}: use 'default' (torchao's shape rule, the output head kept in "
            "bf16), 'auto' (the default, measured: Linears FP8 hurts stay in bf16) or a non-empty list of module "
            "names (qualified, or a dotted suffix such as 'mlp') and nn.Module classes whose Linears compute in FP8, "
            "with 'auto' in it to measure them."
        )
    if all(isinstance(v, str) and v == AUTO for v in value):
        return AUTO
    return tuple(value)


def split_auto(modules: str | tuple) -> tuple[str | tuple, bool]:
    """(what is chosen before measuring, whether the autopilot measures): ``"auto"`` is the default, measured."""
    if isinstance(modules, str):
        return (DEFAULT_FP8_MODULES, True) if modules == AUTO else (modules, False)
    rest = tuple(m for m in modules if not (isinstance(m, str) and m == AUTO))
    return rest, len(rest) < len(modules)


def _is_entry(v: object) -> bool:
    return (isinstance(v, str) and v.strip() != "") or (isinstance(v, type) and issubclass(v, nn.Module))


def too_small(recipe: str, n: int, k: int) -> bool:
    """torchao's measured rule (H100): an ``N x K`` weight's GEMMs gain nothing from FP8 under ``recipe``."""
    if recipe == "tensorwise":
        return k <= 4096 and n <= 1024
    return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)


def choose(root: nn.Module, recipe: str, modules: str | tuple, keeps_fp32: Callable[[nn.Module], bool],
           multiple: int) -> tuple[list[tuple[str, nn.Linear]], dict[str, list[str]]]:
    """The Linears that compute in FP8 as (name, module), and the ones kept in bf16 by reason."""
    kept: dict[str, list[str]] = {}
    linears = dict(_linears(root, keeps_fp32))
    if modules == DEFAULT_FP8_MODULES:
        candidates = dict(linears)
        for name in _heads(root, linears):
            kept.setdefault("the output head", []).append(name)
            candidates.pop(name)
        for name, m in list(candidates.items()):
            if too_small(recipe, m.out_features, m.in_features):
                kept.setdefault(f"below torchao's {recipe} size rule", []).append(name)
                candidates.pop(name)
    else:
        candidates = {name: linears[name] for name in _listed(root, modules, linears, multiple)}
    for name, m in list(candidates.items()):
        if m.in_features % multiple or m.out_features % multiple:
            kept.setdefault(f"dimensions not multiples of {multiple}", []).append(name)
            candidates.pop(name)
        elif type(m).forward is not nn.Linear.forward:
            kept.setdefault("a Linear subclass with its own forward", []).append(name)
            candidates.pop(name)
    return list(candidates.items()), kept


def _linears(root: nn.Module, keeps_fp32: Callable[[nn.Module], bool]) -> Iterator[tuple[str, nn.Linear]]:
    """Every ``nn.Linear`` under ``root`` outside FP32-kept subtrees, in module order, each module once."""
    seen: set[int] = set()

    def walk(module: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Linear]]:
        if id(module) in seen or keeps_fp32(module):
            return
        seen.add(id(module))
        if isinstance(module, nn.Linear):
            yield prefix, module
        for child_name, child in module.named_children():
            yield from walk(child, f"{prefix}.{child_name}" if prefix else child_name)

    yield from walk(root, "")


def _heads(root: nn.Module, linears: dict[str, nn.Linear]) -> list[str]:
    """The last Linear in module order (models define their head last: GPT-2, Llama's ``lm_head``, torchtitan's
    ``output``) and every Linear whose weight is an embedding's (a tied head)."""
    tied = {id(m.weight) for m in root.modules() if isinstance(m, nn.Embedding)}
    heads = [name for name, m in linears.items() if id(m.weight) in tied]
    if linears:
        last = list(linears)[-1]
        heads += [last] if last not in heads else []
    return heads


def _listed(root: nn.Module, entries: tuple, linears: dict[str, nn.Linear], multiple: int) -> list[str]:
    """The Linears the user's list selects: a name or class selects its module's Linears (itself if a Linear)."""
    named = dict(root.named_modules())
    chosen: dict[str, None] = {}
    for entry in entries:
        if isinstance(entry, str):
            hits = [n for n in named if n == entry or n.endswith("." + entry)]
        else:
            hits = [n for n, m in named.items() if isinstance(m, entry)]
        if not hits:
            sample = ", ".join(repr(n) for n in list(linears)[:4])
            label = entry if isinstance(entry, str) else entry.__name__
            raise ValueError(
                f"fp8_modules entry {label!r} matches no module of {type(root).__name__}: use qualified names or "
                f"dotted suffixes of its modules, or classes it holds (its Linears include {sample or 'none'})."
            )
        if not any(isinstance(m, nn.Linear) for hit in hits for m in named[hit].modules()):
            _refuse_without_linears(entry, hits, named, linears)
        for hit in hits:
            prefix = "" if hit == "" else hit + "."
            inside = [n for n in linears if n == hit or n.startswith(prefix) or hit == ""]
            direct = named[hit]  # a Linear named by itself: the user meant it, so it is an error, not a choice
            odd = isinstance(direct, nn.Linear) and (direct.in_features % multiple or direct.out_features % multiple)
            if isinstance(entry, str) and odd:
                raise ValueError(
                    f"fp8_modules entry {entry!r} names {hit!r}, an nn.Linear({direct.in_features}, "
                    f"{direct.out_features}): FP8 GEMMs need both dimensions multiples of {multiple}. HINT: leave it "
                    "out of the list; it computes in bf16."
                )
            chosen.update(dict.fromkeys(inside))
    return list(chosen)


def _refuse_without_linears(entry: str | type, hits: list[str], named: dict[str, nn.Module],
                            linears: dict[str, nn.Linear]) -> None:
    """An entry whose modules hold no ``nn.Linear`` (a ``LayerNorm`` by name) would put nothing in FP8, silently."""
    label = repr(entry) if isinstance(entry, str) else entry.__name__
    more = f" and {len(hits) - 1} more" if len(hits) > 1 else ""
    sample = ", ".join(repr(n) for n in list(linears)[:4])
    raise ValueError(
        f"fp8_modules entry {label} names {hits[0]!r}{more}, a {type(named[hits[0]]).__name__}, which holds no "
        "nn.Linear: nothing of it would compute in FP8 (FP8 here is a Linear's matrix product; other layers stay as "
        f"the precision computes them). HINT: name Linears or the blocks that hold them (the model's Linears include "
        f"{sample or 'none'}), or leave it out."
    )
