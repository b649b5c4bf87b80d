"""How a module's forward reaches its 16-bit copies (lightning_mp.numerics.bracket), through MasterWeights: a class
swap inside the model, hooks on roots, lazy and parametrized modules, and what pickling, copies and replicas see."""

import copy
import pickle

import torch
from torch import nn
from torch.nn.utils import parametrize

from lightning_mp.numerics.master_weights import MasterWeights
from tests.conftest import inside_forward

BF16 = torch.bfloat16


def watched(model):
    masters = MasterWeights(BF16)
    masters.convert(model)
    masters.begin(force=True)
    return masters


def weight_dtype_inside(module, model, x):
    seen = []
    hook = inside_forward(module, lambda mod, args, out: seen.append(mod.weight.dtype))
    with torch.autocast("cpu", dtype=BF16):
        model(x)
    hook.remove()
    return seen[0]


def test_a_module_inside_the_model_keeps_its_class_name_and_isinstance_and_gets_its_class_back_at_teardown():
    model = nn.Sequential(nn.Linear(3, 2))
    masters = watched(model)
    with torch.autocast("cpu", dtype=BF16):
        model(torch.ones(1, 3))
    lin = model[0]
    assert isinstance(lin, nn.Linear) and type(lin) is not nn.Linear  # a subclass, made once per class
    assert type(lin).__name__ == type(lin).__qualname__ == "Linear" and "Linear(in_features=3" in repr(model)
    assert not lin._forward_pre_hooks and not lin._forward_hooks  # nn.Module.__call__ keeps its fast path
    assert type(model) is nn.Sequential  # a root: hooks, its own class (torch.export and Fabric read its forward)
    masters.remove()
    assert type(lin) is nn.Linear and "_lightning_mp_store" not in vars(lin)


def test_a_forward_set_on_the_instance_runs_inside_the_bracket():
    # Fabric's redirection of a marked method, accelerate's hooks and test wrappers set `module.forward` on the
    # instance: the bracket sits around nn.Module._call_impl, so such a forward reads the copies too
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    watched(model)
    assert weight_dtype_inside(model[1], model, torch.ones(1, 3)) == BF16
    assert model[1].weight.dtype == torch.float32  # outside the forward: the FP32 Parameter


def test_pickled_and_copied_modules_are_of_the_original_class_without_the_store():
    model = nn.Sequential(nn.Linear(3, 2))
    watched(model)
    for twin in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model), copy.copy(model[0])):
        lin = twin if isinstance(twin, nn.Linear) else twin[0]
        assert type(lin) is nn.Linear and "_lightning_mp_store" not in vars(lin)
    assert type(model[0]) is not nn.Linear  # the original stays swapped until teardown


def test_a_replica_computes_on_its_own_parameters():
    # nn.DataParallel's replicas share the module's __dict__ entries but are other modules: nothing is installed
    model = nn.Sequential(nn.Linear(3, 2))
    watched(model)
    replica = model[0]._replicate_for_data_parallel()
    replica._parameters = {"weight": nn.Parameter(torch.ones(2, 3)), "bias": None}
    with torch.autocast("cpu", dtype=BF16):
        out = replica(torch.ones(1, 3))
    assert out.tolist() == [[3.0, 3.0]] and replica.weight.dtype == torch.float32


class Refuses(nn.Linear):
    def __init_subclass__(cls, **kwargs):
        raise TypeError("no subclasses")


def test_lazy_parametrized_and_unsubclassable_modules_read_their_copies_through_hooks():
    class Positive(nn.Module):
        def forward(self, w):
            return w.abs()

    para = nn.Linear(2, 2)
    parametrize.register_parametrization(para, "weight", Positive())
    model = nn.Sequential(nn.LazyLinear(3), Refuses(3, 2), para)
    masters = watched(model)
    x = torch.ones(1, 3)
    assert weight_dtype_inside(model[0], model, x) == BF16  # materialized by its own pre-hook, then installed
    assert weight_dtype_inside(model[1], model, x) == BF16
    assert type(model[0]) is nn.Linear and type(model[1]) is Refuses and model[1]._forward_pre_hooks
    with torch.autocast("cpu", dtype=BF16):
        model(x)
    assert model[2].bias.dtype == torch.float32 and model[2]._forward_pre_hooks  # hooks: the bias has a copy
    masters.remove()
    parametrize.remove_parametrizations(para, "weight")
    assert type(para) is nn.Linear  # parametrize swaps back to __bases__[0]: ours never sat in between


def test_a_module_called_inside_its_own_forward_keeps_its_copies_until_the_outer_call_ends():
    class Twice(nn.Linear):
        def forward(self, x, again=True):
            inner = super().forward(x) if not again else self(x, again=False)
            return inner, self.weight.dtype

    model = nn.Sequential(Twice(2, 2))
    watched(model)
    with torch.autocast("cpu", dtype=BF16):
        (_, dtype) = model[0](torch.ones(1, 2))
    assert dtype == BF16 and model[0].weight.dtype == torch.float32


def test_two_fits_one_after_the_other_swap_and_restore_the_same_module():
    model = nn.Sequential(nn.Linear(3, 2))
    for _ in range(2):
        masters = watched(model)
        assert weight_dtype_inside(model[0], model, torch.ones(1, 3)) == BF16
        masters.remove()
        assert type(model[0]) is nn.Linear
        with torch.autocast("cpu", dtype=BF16):
            assert model[0](torch.ones(1, 3)).dtype == BF16  # plain autocast after teardown
