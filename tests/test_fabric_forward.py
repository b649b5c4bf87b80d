"""The Fabric forward's input cast (lightning_mp/fabric/forward.py): what Fabric's own MixedPrecision casts, and how."""

import collections
import dataclasses
import enum

import pytest
import torch
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision

from lightning_mp.fabric import MixedPrecisionPlugin
from lightning_mp.fabric import forward

Pair = collections.namedtuple("Pair", ["x", "y"])


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    n: int


class Pairs(tuple):  # a tuple subclass that is not a named tuple
    pass


class Mode(enum.IntEnum):
    TRAIN = 1


def inputs():
    x, idx, mask = torch.randn(4, 3), torch.arange(4), torch.ones(4, dtype=torch.bool)
    yield ((x,), {})  # Fabric's (args, kwargs) for model(x)
    yield ((x, idx, None, 2.5, "mean"), {"mask": mask, "scale": torch.tensor(0.5, dtype=torch.float64)})
    yield (([x, [x.double(), {"deep": x}]],), {"dims": (1, 2), "dtype": torch.float32, "device": torch.device("cpu")})
    yield ((Pair(x, idx),), {})  # a named tuple: apply_to_collection's path, type kept
    yield ((Batch(x, 3),), {"extra": collections.OrderedDict(a=x)})
    yield ((x.to(torch.float16), x.to(torch.bfloat16)), {})  # already 16-bit: cast to the run's format
    yield (([],), {"empty": {}})
    yield ((torch.nn.Parameter(x), Pairs((x, idx))), {"mode": Mode.TRAIN, "raw": b"\x00", "size": x.shape})
    yield ((x, [x, (x, idx)]), {"pair": Pair(x, x)})  # plain containers beside one the fast path leaves alone


def same(a, b):
    """Same structure, container types, tensor dtypes and values."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for u, v in zip(a, b):
            same(u, v)
    elif dataclasses.is_dataclass(a):
        for field in dataclasses.fields(a):
            same(getattr(a, field.name), getattr(b, field.name))
    else:
        assert a == b


@pytest.mark.parametrize(("precision", "theirs"), [("bf16", "bf16-mixed"), ("fp16", "16-mixed")])
@pytest.mark.parametrize("data", list(inputs()), ids=lambda d: type(d[0][0]).__name__ if d[0] else "empty")
def test_inputs_are_cast_exactly_as_fabrics_own_mixed_precision_casts_them(precision, theirs, data):
    same(MixedPrecisionPlugin(precision).convert_input(data), FabricMixedPrecision(theirs, "cpu").convert_input(data))


def test_each_floating_tensor_is_cast_once_also_beside_a_container_the_fast_path_leaves_alone(monkeypatch):
    x = torch.randn(2, 3)
    calls = []
    to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: calls.append(1) or to(self, *a, **k))
    (args, kwargs) = MixedPrecisionPlugin("bf16").convert_input(((x, [x, x]), {"pair": Pair(x, torch.arange(2))}))
    assert len(calls) == 4 and args[1][1].dtype == kwargs["pair"].x.dtype == torch.bfloat16


def test_fabrics_args_and_kwargs_of_tensors_take_the_fast_path_not_the_general_one(monkeypatch):
    def general(*args, **kwargs):
        raise AssertionError("apply_to_collection's general path was taken")

    monkeypatch.setattr(forward, "apply_to_collection", general)
    x = torch.randn(2, 3)
    (args, kwargs) = MixedPrecisionPlugin("bf16").convert_input(((x, [x, 1]), {"w": x, "flag": True, "k": None}))
    assert args[0].dtype == args[1][0].dtype == kwargs["w"].dtype == torch.bfloat16
    assert args[1][1] == 1 and kwargs["flag"] is True and kwargs["k"] is None


def test_fp32_runs_leave_the_inputs_as_they_are():
    data = ((torch.randn(2),), {})
    assert MixedPrecisionPlugin("fp32").convert_input(data) is data
