"""The Fabric plugin's hold on its kernels (lightning_mp/fabric/kernels.py): the FP32 policy's registered once per
plugin, not once per iteration, and switched on from a forward to the end of its backward, as the emulated GEMMs' are
held; all of them out with ``release_kernels()``, ``teardown()`` or the collected plugin."""

import copy
import gc
import weakref
from unittest import mock

import torch
from torch import nn

from lightning_mp.compile_key import current_parts
from lightning_mp.fabric import MixedPrecisionPlugin
from lightning_mp.fabric import kernels as fabric_kernels
from lightning_mp.policy import dispatch
from lightning_mp.policy.dispatch import active_kernels
from tests.test_fabric import batches, fabric_for, tiny_net, train


def ours():
    """The emulated GEMMs' kernel at ADInplaceOrView (every matrix product passes it), the FP32 policy's at AutocastCPU,
    and their parts of torch.compile's cache key."""
    mm = torch._C._dispatch_has_kernel_for_dispatch_key("aten::mm", "ADInplaceOrView")
    return mm, bool(active_kernels("AutocastCPU")), bool(current_parts())


def autocast_softmax_dtype(x):
    with torch.autocast("cpu", dtype=torch.bfloat16):  # CPU autocast's own softmax is bf16; the policy's is FP32
        return torch.softmax(x.bfloat16(), -1).dtype


def setup(**kwargs):
    plugin = MixedPrecisionPlugin("bf16", gemm="emulated", **kwargs)
    fabric = fabric_for(plugin, accelerator="cpu")
    net = tiny_net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    return plugin, fabric, model, optimizer


def test_the_policy_is_registered_once_not_per_iteration():
    # before: every iteration registered the policy's ~100 overloads and took them out again (about 1 ms a step,
    # 1-2% of the demo GPT's CPU step; benchmarks/fabric_benchmark.py)
    gc.collect()
    plugin, fabric, model, optimizer = setup()
    train(fabric, model, optimizer, batches(1))
    with mock.patch.object(dispatch, "_register", wraps=dispatch._register) as register:
        train(fabric, model, optimizer, batches(3))
        with torch.no_grad():
            model(batches(1)[0][0])
    assert register.call_count == 0


def test_between_iterations_the_policy_is_switched_off_and_the_gemms_kernels_are_out():
    gc.collect()  # plugins that earlier tests dropped release their kernels when collected
    assert ours() == (False, False, False)
    plugin, fabric, model, optimizer = setup()
    ((x, y),) = batches(1)
    seen = []
    model.module[1].register_forward_hook(lambda m, i, o: seen.append(autocast_softmax_dtype(x)))
    loss = nn.functional.mse_loss(model(x), y)
    assert seen == [torch.float32]  # inside the forward: the policy's FP32 softmax
    assert ours() == (True, True, True)  # GEMMs' kernels from the forward to the end of its backward
    fabric.backward(loss)
    optimizer.step()
    # between iterations: the policy's kernels registered but off (autocast's own dtypes), no GEMM kernel in the path
    # of other code's matrix products
    assert ours() == (False, True, True)
    assert autocast_softmax_dtype(x) == torch.bfloat16
    train(fabric, model, optimizer, batches(3))
    assert ours() == (False, True, True)
    with torch.no_grad():  # no backward follows: the GEMMs' kernels out with the forward
        model(x)
    assert ours() == (False, True, True)
    model(x)  # a loss never back-propagated: the GEMMs' kernels out at the next optimizer.step()
    assert ours()[0]
    optimizer.step()
    assert ours() == (False, True, True)
    plugin.release_kernels()  # other torch code runs as in a fresh process
    assert ours() == (False, False, False)
    train(fabric, model, optimizer, batches(2))  # the next forward registers them again, and training goes on
    assert ours() == (False, True, True)
    assert seen[-1] == torch.float32


def test_the_policy_is_switched_on_once_per_iteration_from_the_forward_to_the_end_of_its_backward():
    # before: switched on and off around the forward and again around the backward, 4 switches an iteration (each then
    # a counter per kernel and a write of torch.compile's cache tag: 85 us of a tiny MLP's ~1.3 ms CPU step)
    gc.collect()
    plugin, fabric, model, optimizer = setup()
    train(fabric, model, optimizer, batches(1))
    ((x, y),) = batches(1)
    with mock.patch.object(fabric_kernels, "switch", wraps=dispatch.switch) as switch:
        loss = nn.functional.mse_loss(model(x), y)
        assert autocast_softmax_dtype(x) == torch.float32  # between the forward and its backward: on
        loss = loss + nn.functional.mse_loss(model(x), y)  # a second forward (a GAN's): already on
        fabric.backward(loss)
        assert autocast_softmax_dtype(x) == torch.bfloat16  # after the backward: off
        optimizer.step()
        optimizer.zero_grad()
    assert [c.args[1] for c in switch.call_args_list] == [1, -1]
    with torch.no_grad():
        model(x)  # evaluation: no backward follows, off when the forward ends
    assert autocast_softmax_dtype(x) == torch.bfloat16 and ours() == (False, True, True)


def test_teardown_a_collected_plugin_and_a_copy_leave_nothing_registered():
    gc.collect()
    plugin, fabric, model, optimizer = setup()
    train(fabric, model, optimizer, batches(1))
    twin = copy.deepcopy(plugin)  # holds nothing: a copy registers its own at its first forward
    plugin.teardown()
    assert ours() == (False, False, False)
    del twin
    plugin, fabric, model, optimizer = setup()
    train(fabric, model, optimizer, batches(1))
    assert ours() == (False, True, True)
    del plugin, fabric, model, optimizer
    gc.collect()
    assert ours() == (False, False, False)


def test_a_dropped_plugin_whose_scheduler_is_guarded_is_collected_and_its_kernels_go():
    # a Fabric scheduler is built on Fabric's optimizer wrapper, which holds the strategy and so the plugin: held
    # strongly by the guard (in the core, which the plugin's teardown finalizer holds), it kept the plugin alive for
    # the rest of the process, and the policy's kernels registered (a Python call per listed op under any autocast)
    gc.collect()
    plugin, fabric, model, optimizer = setup()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    plugin.guard_schedulers(scheduler)
    train(fabric, model, optimizer, batches(2))
    scheduler.step()
    assert ours() == (False, True, True) and type(scheduler).__name__ == "StepLR"
    gone = weakref.ref(plugin)
    del plugin, fabric, model, optimizer, scheduler
    gc.collect()
    assert gone() is None and ours() == (False, False, False)
