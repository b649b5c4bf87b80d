"""The Markdown of Fp32Policy.describe(): every default listed, well-formed tables, user additions named."""

from __future__ import annotations

import torch.nn as nn

from lightning_mp.policy.describe import describe_policy
from lightning_mp.policy.policy import DEFAULT_FP32_MODULES, DEFAULT_FP32_OPS, Fp32Policy


def test_describe_mentions_every_default() -> None:
    text = Fp32Policy().describe()
    for name in DEFAULT_FP32_OPS:
        assert f"`{name}`" in text, name
    for cls in DEFAULT_FP32_MODULES:
        assert cls.__name__ in text, cls
    for covered in ("BatchNorm2d", "SyncBatchNorm", "InstanceNorm1d", "LSTM", "GRU"):
        assert covered in text
    table_rows = [line for line in text.splitlines() if line.startswith("|")]
    assert table_rows and all(line.endswith("|") for line in table_rows)
    # every row of a table has the same number of cells as its header (no stray '|')
    assert all(line.count("|") in (4, 3) for line in table_rows)
    custom = Fp32Policy(ops={"tanh"}, modules=()).describe()
    assert "`tanh`" in custom and "user-added" in custom


class MyBlock(nn.Module):
    pass


def test_a_user_class_is_named_by_its_path_and_nothing_listed_says_so() -> None:
    text = describe_policy({}, (MyBlock,))
    assert f"| `{__name__}.MyBlock` | MyBlock | selected by the user |" in text
    assert "#### Ops computed in FP32" in text and "_None._" in text
    empty = Fp32Policy(ops=(), modules=()).describe()  # the whole table left out: 16 bits everywhere, said so
    assert "_None._" in empty and "`softmax`" in empty.split("Left out of `DEFAULT_FP32_OPS`")[1]
    assert "_None: every parameter follows" in describe_policy({}, ())


def test_every_default_op_says_where_it_becomes_fp32() -> None:
    rows = {
        line.split(" | ")[0].strip("| `"): line.split(" | ")[2]
        for line in Fp32Policy().describe().splitlines()
        if line.startswith("| `") and line.count("|") == 4 and "Why FP32" not in line
    }
    rows = {name: where for name, where in rows.items() if name in DEFAULT_FP32_OPS}
    assert set(rows) == set(DEFAULT_FP32_OPS)
    for name, where in rows.items():
        assert where.startswith(("aten `", "pure-Python composite, FP32 through the listed `")), (name, where)
    assert rows["layer_norm"].startswith("aten `layer_norm`, `native_layer_norm`")
    assert "adaptive_avg_pool" in rows["interpolate"]  # what a name does not cover is said too
