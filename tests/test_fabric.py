"""lightning_mp.fabric in Fabric loops: the Trainer plugin's core tests (master weights, loss scaling, skipping,
clipping, checkpoints, resume, logged tags) written the way a Fabric user writes the loop."""

import copy

import lightning as L
import pytest
from lightning.fabric.utilities.exceptions import MisconfigurationException
import torch
from lightning.fabric.loggers import TensorBoardLogger
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from torch import nn

from lightning_mp.fabric import MixedPrecisionPlugin, PrecisionMonitor
from tests.conftest import device, inside_forward, module_device, trainer_kwargs
from tests.test_callbacks_integration import events, left_edges, scalars

FP16_SAFE = dict(init_scale=2.0**8)  # a start scale at which the tiny net does not overflow


def fabric_for(plugin=None, accelerator=None, **kwargs):
    if plugin is not None:
        kwargs["plugins"] = [plugin]
    return L.Fabric(accelerator=accelerator or device(), devices=1, **kwargs)


def tiny_net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)
    return [(x[i % 8 * 8 : i % 8 * 8 + 8], y[i % 8 * 8 : i % 8 * 8 + 8]) for i in range(n)]


def train(fabric, model, optimizer, data, fault_at=(), fault=float("inf"), start=0, clip=None, after_step=None):
    """The plain Fabric loop: forward, loss, fabric.backward, (clip), step, zero_grad. ``fault_at`` multiplies the
    loss of those iterations by ``fault``."""
    for i, (x, y) in enumerate(data, start=start):
        x, y = x.to(fabric.device), y.to(fabric.device)  # Fabric moves a set-up loader's batches, not a list's
        loss = nn.functional.mse_loss(model(x), y)
        if i in fault_at:
            loss = loss * fault
        fabric.backward(loss)
        if clip is not None:
            fabric.clip_gradients(model, optimizer, **clip)
        optimizer.step()
        optimizer.zero_grad()
        if after_step is not None:
            after_step(i)


def same_tree(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_tree(a[k], b[k]) for k in a)
    # Fabric leaves the model on its device: compare values wherever each side lives
    return torch.equal(a.cpu(), b.cpu()) if isinstance(a, torch.Tensor) else a == b


class OneWeight(nn.Module):
    """forward returns ``w * c``: every step's gradient is exactly ``c`` and SGD moves w by lr * c."""

    def __init__(self, w0=1.0):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([w0]))

    def forward(self, c):
        return (self.w * c).sum()


def one_weight_run(fabric, steps, lr=1e-4):
    model = OneWeight()
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=lr))
    for _ in range(steps):
        fabric.backward(model(torch.ones(1, device=fabric.device)))
        opt.step()
        opt.zero_grad()
    return model, opt


# ---------------------------------------------------------------------------------------------- master weights
@pytest.mark.on_device
@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_forward_and_backward_run_in_16_bits_while_parameters_and_optimizer_hold_fp32(precision, dtype):
    fabric = fabric_for(MixedPrecisionPlugin(precision, **FP16_SAFE))
    net = tiny_net()
    seen = {}
    inside_forward(net[0], lambda m, args, out: seen.update(weight=m.weight.dtype, out=out.dtype))
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # masters in place from setup on
    x, y = (t.to(fabric.device) for t in batches(1)[0])
    out = model(x)
    assert seen == {"weight": dtype, "out": dtype}
    assert out.dtype == torch.float32  # the loop's loss is an FP32 loss
    fabric.backward(nn.functional.mse_loss(out, y))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {p.grad.dtype for p in model.parameters()} == {torch.float32}
    opt.step()
    state = [t for s in opt.state.values() for t in s.values() if t.dim()]
    assert state and {t.dtype for t in state} == {torch.float32}


@pytest.mark.on_device
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_update_far_below_a_16_bit_ulp_lands_exactly_and_the_checkpoint_holds_it_in_fp32(tmp_path, precision):
    steps, reference = 10, torch.tensor([1.0])
    for _ in range(steps):
        reference -= 1e-4  # FP32 SGD, the arithmetic the optimizer does on the master

    fabric = fabric_for(MixedPrecisionPlugin(precision, **FP16_SAFE))
    model, opt = one_weight_run(fabric, steps)
    assert torch.equal(model.w.detach().cpu(), reference)
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": opt})
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True, map_location="cpu")["model"]
    assert saved["w"].dtype == torch.float32 and torch.equal(saved["w"], reference)
    plain = OneWeight()
    plain.load_state_dict(saved)  # a plain FP32 model, no plugin
    assert torch.equal(plain.w.detach(), reference)

    # Fabric's own pure 16-bit: 1.0 - 1e-4 rounds back to 1.0 (half an ulp at 1.0 is 2^-8 in bf16, 2^-11 in fp16)
    native, _ = one_weight_run(fabric_for(precision=f"{'bf16' if precision == 'bf16' else '16'}-true"), steps)
    assert native.w.item() == 1.0


@pytest.mark.on_device
def test_gradient_accumulation_sums_micro_batches_in_fp32():
    def accumulate(fabric):
        model = OneWeight(w0=0.0)
        model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=1.0))
        with fabric.no_backward_sync(model):
            fabric.backward(model(torch.ones(1, device=fabric.device)))
        fabric.backward(model(torch.full((1,), 2.0**-9, device=fabric.device)))  # 1 + 2^-9 is not representable in bf16
        opt.step()
        return model.w.float().item()

    assert accumulate(fabric_for(MixedPrecisionPlugin("bf16"))) == -(1.0 + 2.0**-9)
    assert accumulate(fabric_for(precision="bf16-true")) == -1.0  # the small micro-batch vanished in the bf16 sum


@pytest.mark.on_device
def test_evaluation_forward_runs_in_16_bits_and_leaves_the_model_fp32():
    fabric = fabric_for(MixedPrecisionPlugin("bf16"))
    net = tiny_net()
    seen = []
    inside_forward(net[0], lambda m, args, out: seen.append(m.weight.dtype))
    model = fabric.setup(net)
    x = batches(1)[0][0].to(fabric.device)
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            model(x)
        assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert seen == [torch.bfloat16, torch.bfloat16]


@pytest.mark.on_device
def test_state_dict_between_forward_and_backward_holds_the_fp32_values(tmp_path):
    fabric = fabric_for(MixedPrecisionPlugin("bf16"))
    net = tiny_net()
    exact = copy.deepcopy(net.state_dict())
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = (t.to(fabric.device) for t in batches(1)[0])
    loss = nn.functional.mse_loss(model(x), y)
    assert model.module[0].weight.dtype == torch.float32  # the Parameters never hold the copies
    fabric.save(tmp_path / "mid.pt", {"model": model})
    assert same_tree(torch.load(tmp_path / "mid.pt", weights_only=True, map_location="cpu")["model"], exact)
    with torch.no_grad():
        model(x)  # an evaluation forward in between leaves the training forward's copies alone
    fabric.backward(loss)  # and the backward still works on the copies
    opt.step()
    assert not same_tree(model.state_dict(), exact)


@pytest.mark.on_device
def test_two_models_set_up_separately_both_train_on_fp32_masters():
    fabric = fabric_for(MixedPrecisionPlugin("bf16"))
    g_net, d_net = nn.Linear(8, 8), nn.Linear(8, 1)
    g, opt_g = fabric.setup(g_net, torch.optim.SGD(g_net.parameters(), lr=0.1))
    d, opt_d = fabric.setup(d_net, torch.optim.SGD(d_net.parameters(), lr=0.1))
    before = [copy.deepcopy(m.state_dict()) for m in (g_net, d_net)]
    x = batches(1)[0][0].to(fabric.device)
    seen = []
    for net in (g_net, d_net):
        inside_forward(net, lambda m, args, out: seen.append(m.weight.dtype))
    out = d(g(x))
    assert seen == [torch.bfloat16, torch.bfloat16]  # each forward reads its copy
    assert g_net.weight.dtype == d_net.weight.dtype == torch.float32
    fabric.backward(out.mean())
    opt_d.step()
    opt_g.step()
    for net, old in zip((g_net, d_net), before):
        assert net.weight.dtype == torch.float32 and not same_tree(net.state_dict(), old)


def gan_run(fabric, steps=30):
    """The GAN loop of issue 37: ``fake = G(z)`` once; D steps on real data and ``fake.detach()``; then G steps through
    ``D(fake)``, back-propagating into the graph of ``fake`` built before D's step. Per step (D loss, G loss), and how
    far G's mean output is from the real data's mean (2.0) before and after."""
    torch.manual_seed(0)
    g_net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
    d_net = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    g, opt_g = fabric.setup(g_net, torch.optim.Adam(g_net.parameters(), lr=1e-3, betas=(0.5, 0.999)))
    d, opt_d = fabric.setup(d_net, torch.optim.Adam(d_net.parameters(), lr=1e-3, betas=(0.5, 0.999)))
    gen = torch.Generator().manual_seed(1)
    z, real = torch.randn(steps, 32, 8, generator=gen), torch.randn(steps, 32, 16, generator=gen) * 0.5 + 2.0
    probe = torch.randn(256, 8, generator=gen)
    ones, zeros = torch.ones(32, 1), torch.zeros(32, 1)
    z, real, probe, ones, zeros = (t.to(fabric.device) for t in (z, real, probe, ones, zeros))
    bce = nn.functional.binary_cross_entropy_with_logits

    def gap():
        with torch.no_grad():
            return (g(probe).float().mean(0) - 2.0).abs().mean().item()

    start, losses = gap(), []
    for i in range(steps):
        fake = g(z[i])
        loss_d = bce(d(real[i]), ones) + bce(d(fake.detach()), zeros)
        opt_d.zero_grad()
        fabric.backward(loss_d)
        opt_d.step()
        loss_g = bce(d(fake), ones)
        opt_g.zero_grad()
        fabric.backward(loss_g)  # raised "modified by an inplace operation": D's step refreshed G's copies in place
        opt_g.step()
        losses.append((loss_d.item(), loss_g.item()))
    return torch.tensor(losses), start, gap()


@pytest.mark.on_device
@pytest.mark.parametrize("precision, dtype, reference", [("bf16", torch.bfloat16, "bf16-mixed"),
                                                         ("fp16", torch.float16, "32-true")])
def test_a_gan_whose_generator_graph_outlives_the_discriminator_step_trains_as_fabrics_own_mixed_precision(
    precision, dtype, reference
):
    plugin = MixedPrecisionPlugin(precision, **FP16_SAFE)
    ours, ours_start, ours_end = gan_run(fabric_for(plugin))
    ref, ref_start, ref_end = gan_run(fabric_for(precision=reference))  # fp16: Fabric's 16-mixed needs CUDA; FP32
    unit = torch.finfo(dtype).eps / 2  # unit roundoff: 2^-8 in bf16, 2^-11 in fp16
    assert plugin.skipped_steps == 0  # every step of both optimizers taken, as in the reference
    # measured on 30 steps: at most 0.11 unit (bf16 against bf16-mixed) and 0.18 unit (fp16 against FP32); a generator
    # whose gradients are lost ends 20 units away
    assert ((ours - ref).abs() / ref.abs()).max() <= unit
    assert ref_end < 0.95 * ref_start  # the generator moves towards the data...
    assert abs(ours_end - ref_end) <= unit * ref_end  # ...as far as in the reference


# ---------------------------------------------------------------------------------------------- loss scaling
def snapshot_run(precision, fault, steps=6, fault_at=3):
    plugin = MixedPrecisionPlugin(precision, **FP16_SAFE)
    fabric = fabric_for(plugin)
    net = tiny_net()
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    rows = []

    def snap(i):
        state = {k: {n: t.clone() for n, t in v.items()} for k, v in opt.state_dict()["state"].items()}
        rows.append(dict(weights=copy.deepcopy(net.state_dict()), opt_state=state, scale=plugin.loss_scale,
                         skipped=plugin.skipped_steps, last=plugin.last_step_skipped))  # fmt: skip

    train(fabric, model, opt, batches(steps), fault_at={fault_at}, fault=fault, after_step=snap)
    return plugin, rows


@pytest.mark.on_device
@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("fault", [float("inf"), float("nan")])
def test_overflow_step_is_skipped_weights_and_optimizer_state_unchanged_scale_backs_off(precision, fault):
    plugin, rows = snapshot_run(precision, fault)
    before, at = rows[2], rows[3]
    assert at["last"] and at["skipped"] == 1 and not before["last"]
    assert same_tree(before["weights"], at["weights"])
    assert same_tree(before["opt_state"], at["opt_state"])
    assert at["scale"] == (before["scale"] / 2 if precision == "fp16" else 1.0)
    assert not same_tree(at["weights"], rows[4]["weights"])  # training goes on
    assert plugin.skipped_steps == 1 and not plugin.last_step_skipped and plugin.optimizer_steps == 6


@pytest.mark.on_device
def test_nan_at_every_step_stops_with_step_scale_and_hint():
    plugin = MixedPrecisionPlugin("bf16", max_consecutive_skips=5)
    fabric = fabric_for(plugin)
    net = tiny_net()
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters()))
    with pytest.raises(FloatingPointError, match=r"step 4 with loss scale 1.*5 optimizer steps in a row.*HINT"):
        train(fabric, model, opt, batches(50), fault_at=set(range(50)), fault=float("nan"))


@pytest.mark.on_device
def test_fp16_persistent_overflow_stops_at_min_scale():
    plugin = MixedPrecisionPlugin("fp16", init_scale=8.0, min_scale=1.0)
    fabric = fabric_for(plugin)
    net = tiny_net()
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters()))
    with pytest.raises(FloatingPointError, match="below min_scale=1"):
        train(fabric, model, opt, batches(50), fault_at=set(range(50)))
    assert plugin.skipped_steps == 4  # 8 -> 4 -> 2 -> 1 -> (0.5 refused)


@pytest.mark.on_device
def test_skipped_step_holds_a_guarded_scheduler_still():
    plugin = MixedPrecisionPlugin("fp16", **FP16_SAFE)
    fabric = fabric_for(plugin)
    net = tiny_net()
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=1.0))
    scheduler = torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=1, gamma=0.5)
    plugin.guard_schedulers(scheduler)
    train(fabric, model, opt, batches(4), fault_at={1}, after_step=lambda i: scheduler.step())
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR)
    assert opt.param_groups[0]["lr"] == 0.5**3  # 4 steps, one skipped


# ---------------------------------------------------------------------------------------------- clipping
def clipped_update(plugin, clip):
    fabric = fabric_for(plugin)
    net = tiny_net()
    before = copy.deepcopy(net.state_dict())
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=1.0))
    x, y = (t.to(fabric.device) for t in batches(1)[0])
    fabric.backward(nn.functional.mse_loss(model(x), y))
    norm = fabric.clip_gradients(model, opt, **clip)
    opt.step()
    return {k: before[k] - v.cpu() for k, v in net.state_dict().items()}, norm


@pytest.mark.on_device
@pytest.mark.parametrize("clip", [dict(max_norm=0.05), dict(clip_val=0.01)])
def test_clipping_acts_on_the_true_fp32_gradients(clip):
    ours, norm = clipped_update(MixedPrecisionPlugin("fp16", init_scale=2.0**10), clip)
    ref, ref_norm = clipped_update(None, clip)
    if "max_norm" in clip:
        total = torch.linalg.vector_norm(torch.cat([u.flatten() for u in ours.values()]))
        assert total.item() == pytest.approx(0.05, rel=1e-3)
        assert norm.item() == pytest.approx(ref_norm.item(), rel=2**-8)  # unscaled: not 1024x the true norm
    else:
        assert max(u.abs().max().item() for u in ours.values()) == pytest.approx(0.01, rel=1e-6)
    for k in ref:  # the same update as FP32 training, to FP16 forward/backward accuracy
        torch.testing.assert_close(ours[k], ref[k], rtol=2**-6, atol=0.05 * 2**-6)


@pytest.mark.on_device
def test_clipping_an_overflow_step_does_not_raise_and_the_step_is_skipped():
    plugin = MixedPrecisionPlugin("fp16", **FP16_SAFE)
    fabric = fabric_for(plugin)
    net = tiny_net()
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=1.0))
    before = copy.deepcopy(net.state_dict())
    x, y = (t.to(fabric.device) for t in batches(1)[0])
    fabric.backward(nn.functional.mse_loss(model(x), y) * float("inf"))
    norm = fabric.clip_gradients(model, opt, max_norm=1.0)  # Fabric's default error_if_nonfinite=True
    opt.step()
    assert norm.item() == 0.0  # nothing clipped: the step is skipped
    assert plugin.last_step_skipped and plugin.loss_scale == 128.0
    assert same_tree(net.state_dict(), before)

    # Fabric's own 16-mixed leaves the inf in the unscaled gradients, and the same call raises
    native = FabricMixedPrecision("16-mixed", device(), scaler=torch.amp.GradScaler(device(), init_scale=2.0**8))
    fabric = fabric_for(native)
    net = tiny_net()
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=1.0))
    fabric.backward(nn.functional.mse_loss(model(x), y) * float("inf"))
    with pytest.raises(RuntimeError, match="non-finite"):
        fabric.clip_gradients(model, opt, max_norm=1.0)


# ---------------------------------------------------------------------------------------------- checkpoints
def scaler_plugin(precision):
    # a short growth interval and hysteresis, so the scaler's trackers matter for the resumed steps
    return MixedPrecisionPlugin(precision, init_scale=2.0**6, growth_interval=3, hysteresis=2)


@pytest.mark.on_device
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_save_and_load_resume_bit_for_bit(tmp_path, precision):
    faults, data = {2, 9}, batches(14)

    straight_plugin = scaler_plugin(precision)
    fabric = fabric_for(straight_plugin)
    straight = tiny_net()
    model, straight_opt = fabric.setup(straight, torch.optim.AdamW(straight.parameters(), lr=1e-2))
    train(fabric, model, straight_opt, data, fault_at=faults)

    first_plugin = scaler_plugin(precision)
    fabric = fabric_for(first_plugin)
    net = tiny_net()
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    train(fabric, model, opt, data[:7], fault_at=faults)
    fabric.save(tmp_path / "mid.pt", {"model": model, "optimizer": opt, "precision": first_plugin, "iteration": 7})
    saved = torch.load(tmp_path / "mid.pt", weights_only=True, map_location="cpu")
    assert saved["precision"]["scaler"]["skipped_steps"] == 1

    resumed_plugin = scaler_plugin(precision)
    fabric = fabric_for(resumed_plugin)
    net2 = tiny_net(seed=123)  # different initial weights: everything must come from the checkpoint
    model2, opt2 = fabric.setup(net2, torch.optim.AdamW(net2.parameters(), lr=1e-2))
    state = {"model": model2, "optimizer": opt2, "precision": resumed_plugin, "iteration": 0}
    fabric.load(tmp_path / "mid.pt", state)
    assert state["iteration"] == 7
    train(fabric, model2, opt2, data[7:], fault_at=faults, start=7)

    assert same_tree(net2.state_dict(), straight.state_dict())
    assert same_tree(opt2.state_dict(), straight_opt.state_dict())
    assert resumed_plugin.skipped_steps == 2
    assert resumed_plugin.core.scaler.state_dict() == straight_plugin.core.scaler.state_dict()  # scale, trackers, counts


@pytest.mark.on_device
def test_a_checkpoint_of_fabrics_own_16_mixed_hands_over_its_scale(tmp_path):
    native = FabricMixedPrecision("16-mixed", device(), scaler=torch.amp.GradScaler(device(), init_scale=2.0**11))
    torch.save({"precision": native.state_dict()}, tmp_path / "native.pt")
    plugin = MixedPrecisionPlugin("fp16")
    fabric = fabric_for(plugin)
    fabric.load(tmp_path / "native.pt", {"precision": plugin})
    assert plugin.loss_scale == 2.0**11


# ---------------------------------------------------------------------------------------------- logged tags
@pytest.fixture(scope="module")
def fp16_logged_run(request, tmp_path_factory):
    """fp16, scale 2^8 growing every 3 clean steps, an overflow at step 5, gradient range every 2nd step."""
    accelerator = module_device(request)  # set up before the per-test device switch
    logger = TensorBoardLogger(tmp_path_factory.mktemp("tb"), name="fabric")
    plugin = MixedPrecisionPlugin("fp16", init_scale=2.0**8, growth_interval=3)
    fabric = fabric_for(plugin, accelerator=accelerator, loggers=logger)
    PrecisionMonitor(fabric, grad_range_every_n_steps=2, per_param=True)
    net = tiny_net()
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    train(fabric, model, opt, batches(10), fault_at={5})
    logger.finalize("success")
    return events(logger.log_dir)


@pytest.mark.on_device
def test_tensorboard_scale_curve_grows_drops_after_the_overflow_and_counts_one_skip(fp16_logged_run):
    # the same curve as the Trainer's LossScaleMonitor test: growth after 3 clean steps, step 5 overflows at 512
    assert scalars(fp16_logged_run, "precision/loss_scale") == [
        (0, 256.0), (1, 256.0), (2, 256.0), (3, 512.0), (4, 512.0), (5, 512.0),
        (6, 256.0), (7, 256.0), (8, 256.0), (9, 512.0),
    ]  # fmt: skip
    assert scalars(fp16_logged_run, "precision/skipped_steps") == [(s, float(s >= 5)) for s in range(10)]


@pytest.mark.on_device
def test_tensorboard_gradient_range_on_the_sampled_steps_shows_the_overflow(fp16_logged_run):
    acc = fp16_logged_run
    for tag in ("underflow", "overflow", "zero"):
        assert [s for s, _ in scalars(acc, f"precision/grad_{tag}_fraction")] == [1, 3, 5, 7, 9]
    overflow = dict(scalars(acc, "precision/grad_overflow_fraction"))
    assert overflow[5] > 0 and all(overflow[s] == 0 for s in (1, 3, 7, 9))
    histograms = acc.Tags()["histograms"]
    assert "precision/grad_log2_magnitude" in histograms
    assert {"precision/grad_log2_magnitude/0.weight", "precision/grad_log2_magnitude/2.bias"} <= set(histograms)
    clean = acc.Histograms("precision/grad_log2_magnitude")[0]
    assert clean.step == 1
    assert sum(left_edges(clean.histogram_value).values()) == 8 * 16 + 16 + 16 + 1  # every element, one bucket each


# ---------------------------------------------------------------------------------------------- refused clearly
def test_fabrics_fsdp1_strategy_refuses_the_plugin_by_name():
    # FSDP1 keeps its own flat FP32 parameters and casts them itself: Fabric takes only its FSDPPrecision there
    # (on a CPU, Fabric(strategy="fsdp") stops earlier: FSDP1 is for GPUs)
    from lightning.fabric.strategies import FSDPStrategy

    with pytest.raises(TypeError, match=r"FSDPPrecision.*lightning_mp\.fabric\.MixedPrecisionPlugin\('bf16'\)"):
        FSDPStrategy().precision = MixedPrecisionPlugin("bf16")  # what Fabric(strategy=..., plugins=[...]) does


def test_the_fabric_plugin_refuses_to_drive_a_trainer():
    with pytest.raises(MisconfigurationException, match=r"invalid type for plugin lightning_mp\.fabric\.Mixed"):
        L.Trainer(plugins=[MixedPrecisionPlugin("bf16")], **trainer_kwargs(max_steps=1))


def test_unknown_knob_names_the_argument():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'init_scael'"):
        MixedPrecisionPlugin("fp16", init_scael=1.0)


def test_monitor_needs_this_plugin_and_a_logger(tmp_path):
    with pytest.raises(ValueError, match=r"fabric=.*MixedPrecision\b.*HINT"):
        PrecisionMonitor(fabric_for(precision="bf16-mixed", loggers=TensorBoardLogger(tmp_path)))
    with pytest.raises(ValueError, match=r"no logger.*HINT"):
        PrecisionMonitor(fabric_for(MixedPrecisionPlugin("fp16")))
    fabric = fabric_for(MixedPrecisionPlugin("fp16"), loggers=TensorBoardLogger(tmp_path))
    with pytest.raises(ValueError, match=r"grad_range_every_n_steps=0 is not allowed"):
        PrecisionMonitor(fabric, grad_range_every_n_steps=0)


# ---------------------------------------------------------------------------------------------- the example
def test_fabric_gpt_example_trains_logs_the_tags_and_saves_an_fp32_checkpoint(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "fabric_gpt.py"
    args = ["--precision", "fp16", "--max-steps", "3", "--n-layer", "1", "--n-embd", "32", "--block-size", "16",
            "--batch-size", "2", "--log-dir", str(tmp_path / "logs"),
            "--checkpoint", str(tmp_path / "ckpt.pt")]  # fmt: skip
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "0 of 3 steps skipped" in done.stdout
    acc = events(tmp_path / "logs" / "fp16" / "version_0")
    assert {"precision/loss_scale", "precision/skipped_steps", "train_loss", "val_loss"} <= set(acc.Tags()["scalars"])
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert {v.dtype for v in ckpt["model"].values() if v.is_floating_point()} == {torch.float32}
    assert ckpt["precision"]["scaler"]["steps"] == 3


@pytest.mark.on_device
def test_lean_bf16_optimizer_state_stays_fp32_through_a_load_under_fabric():
    # before: the plugin never saw Fabric's optimizers, so torch's load_state_dict cast Adam's FP32 moments to the
    # bf16 Parameters' dtype (a resume rounded them to 8 bits)
    def run(setup_first):
        plugin = MixedPrecisionPlugin("bf16", master_weights="compensated")
        fabric = fabric_for(plugin)
        model = fabric.setup(tiny_net())
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
        if setup_first:
            plugin.setup_optimizers(optimizer)  # before fabric.load: the documented resume order
            return optimizer
        train(fabric, model, optimizer, batches(2))  # the first optimizer.step() sets it up
        return optimizer

    source = run(setup_first=False)
    state = source.state_dict()
    assert {v.dtype for s in state["state"].values() for k, v in s.items() if k != "step"} == {torch.float32}
    saved = [v for s in state["state"].values() for k, v in s.items() if k != "step"]
    for target in (source, run(setup_first=True)):  # a rollback in the run, a resume in a new one
        target.load_state_dict(copy.deepcopy(state))
        moments = [v for s in target.state.values() for k, v in s.items() if k != "step"]
        assert len(moments) == len(saved) and all(torch.equal(a, b) and a.dtype == b.dtype
                                                  for a, b in zip(moments, saved))


def test_bf16_optimizer_state_with_a_torchao_optimizer_is_refused_under_fabric_too():
    torchao_optim = pytest.importorskip("torchao.optim")
    plugin = MixedPrecisionPlugin("bf16", master_weights="compensated", optimizer_state_dtype=torch.bfloat16)
    fabric = fabric_for(plugin)
    model = fabric.setup(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1)))
    optimizer = fabric.setup_optimizers(torchao_optim.AdamW8bit(model.parameters(), lr=1e-3))
    with pytest.raises(ValueError, match=r"optimizer_state_dtype=torch.bfloat16 with AdamW8bit .*HINT"):
        train(fabric, model, optimizer, [(torch.randn(8, 64), torch.randn(8, 1))])
