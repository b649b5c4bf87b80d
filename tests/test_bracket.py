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


def fwd(module, x):
    with torch.autocast("cpu", dtype=BF16):
        return module(x)


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


def test_a_call_outside_autocast_reads_the_fp32_parameters_as_under_bf16_mixed():
    # a callback's forward at an epoch's end, torch.jit.trace: outside the run's autocast the model is FP32
    model = nn.Sequential(nn.Linear(3, 2))
    watched(model)
    out = model(torch.ones(1, 3))
    assert out.dtype == torch.float32 and torch.equal(out, nn.functional.linear(torch.ones(1, 3), model[0].weight,
                                                                                model[0].bias))
    assert weight_dtype_inside(model[0], model, torch.ones(1, 3)) == BF16  # under autocast: the copy


def test_functional_call_computes_with_the_tensors_it_is_given():
    # torch.func.functional_call puts plain tensors in the Parameters' places for one call (SAM, MAML, per-sample
    # gradients): the module reads those, under autocast, and its next ordinary call reads its copies again
    from torch.func import functional_call

    model = nn.Sequential(nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 1))
    masters = watched(model)
    zeros = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    x = torch.ones(4, 3)
    for _ in range(2):  # before and after an ordinary forward, in one step
        with torch.autocast("cpu", dtype=BF16):
            assert functional_call(model, zeros, (x,)).abs().max() == 0
        assert weight_dtype_inside(model[2], model, x) == BF16
        masters.begin(force=True)
    assert all(type(p) is nn.Parameter and p.dtype == torch.float32 for p in model.parameters())


def test_hooks_on_a_module_see_its_fp32_parameters_as_under_bf16_mixed():
    # a weight constraint in a pre-hook must reach the FP32 Parameter, not the copy; hooks registered before the fit
    # (the module keeps hooks of ours then) and during it (it was swapped) alike
    seen = []

    def clamp(mod, args):
        seen.append(mod.weight.dtype)
        with torch.no_grad():
            mod.weight.clamp_(-0.05, 0.05)

    early, late = nn.Linear(3, 3), nn.Linear(3, 1)
    early.register_forward_pre_hook(clamp)
    early.register_forward_hook(lambda mod, args, out: seen.append(mod.weight.dtype))
    model = nn.Sequential(early, late)
    masters = watched(model)
    fwd(model, torch.ones(1, 3))
    late.register_forward_pre_hook(clamp)
    late.register_forward_hook(lambda mod, args, out: seen.append(mod.weight.dtype))
    masters.begin(force=True)
    fwd(model, torch.ones(1, 3))
    assert seen == [torch.float32] * 6
    assert early.weight.abs().max() <= 0.05 and late.weight.abs().max() <= 0.05
    assert weight_dtype_inside(late, model, torch.ones(1, 3)) == BF16  # the forward itself reads the copy


class Registered(nn.Linear):
    registry: dict = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        Registered.registry[cls.__name__] = cls


class Layer(Registered):
    pass


class New(nn.Linear):
    def __new__(cls, *args, **kwargs):
        return super().__new__(cls)


def test_a_class_with_a_subclass_registry_or_its_own_new_is_not_subclassed():
    model = nn.Sequential(Layer(3, 3), New(3, 1))
    watched(model)
    assert weight_dtype_inside(model[0], model, torch.ones(1, 3)) == BF16
    assert weight_dtype_inside(model[1], model, torch.ones(1, 3)) == BF16
    assert type(model[0]) is Layer and type(model[1]) is New and Registered.registry == {"Layer": Layer}
    assert type(pickle.loads(pickle.dumps(model))[1]).__name__ == "New"


def test_pickle_protocols_below_2_give_the_original_class():
    model = nn.Sequential(nn.Linear(3, 2))
    watched(model)
    for protocol in (0, 1):
        twin = pickle.loads(pickle.dumps(model, protocol=protocol))
        assert type(twin[0]) is nn.Linear and "_lightning_mp_store" not in vars(twin[0])
