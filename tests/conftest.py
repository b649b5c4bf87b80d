import functools
import os
import time

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

os.environ.setdefault("PL_DISABLE_FORK", "1")

_NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@functools.cache
def has_torchao() -> bool:
    try:
        import torchao  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture
def fp8_needs_torchao(request):
    """A test whose name or parameters say fp8 skips where torchao is missing (the GPU machine's image has none):
    ``precision="fp8"`` refuses to start without it. Used with ``pytest.mark.usefixtures``."""
    if "fp8" in request.node.name and not has_torchao():
        pytest.skip("precision='fp8' needs torchao: pip install 'lightning_mp[fp8]'")


def cuda(test):
    """A CUDA-only test: marked `cuda` (so `-m "on_device or cuda"`, the CUDA suite, selects it) and skipped cleanly
    without a CUDA device."""
    return pytest.mark.cuda(_NO_CUDA(test))

# The CUDA suite. `pytest --device cuda` (or LIGHTNING_MP_TEST_DEVICE=cuda) runs every test marked `on_device` (the
# Trainer- and Fabric-level tests that make sense on a GPU) on the first CUDA device, with the same assertions;
# `-m "on_device or cuda"` selects just those and the CUDA-only tests. Without a CUDA device they collect and skip
# with the reason. Unmarked tests, and every test under the default `--device cpu`, run on the CPU.
_DEVICE = {"name": "cpu"}


def pytest_addoption(parser):
    parser.addoption(
        "--device",
        choices=("cpu", "cuda"),
        default=os.environ.get("LIGHTNING_MP_TEST_DEVICE", "cpu"),
        help="where tests marked on_device run (default: $LIGHTNING_MP_TEST_DEVICE or cpu)",
    )
    parser.addoption(
        "--deadline",
        type=float,
        default=os.environ.get("LIGHTNING_MP_TEST_DEADLINE") or None,
        help="a time (seconds since the epoch) after which no test starts: the later ones skip, saying so, and the "
        "run ends with its counts and its --junitxml file (default: $LIGHTNING_MP_TEST_DEADLINE, or none)",
    )


# The deadline (the GPU check's suite: scripts/gpu_check.sh). A signal cannot stop a run and keep its results: Lightning
# catches KeyboardInterrupt inside `fit`, ignores SIGINT from then on and exits, so pytest never prints its counts.
# Instead every test that would start after the deadline skips before its fixtures are set up (tryfirst: a
# module-scoped fixture's Trainer run is not paid either), and the session ends normally.
@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    deadline = item.config.getoption("--deadline")
    if deadline is not None and time.time() > float(deadline):
        late = time.time() - float(deadline)
        pytest.skip(f"--deadline: the run's deadline passed {late:.0f} s before this test would start")


@pytest.fixture(autouse=True)
def _test_device(request):
    wanted = request.config.getoption("--device")
    if wanted == "cuda" and request.node.get_closest_marker("on_device") is not None:
        reason = request.node.get_closest_marker("cpu_only")
        if reason is not None:
            pytest.skip(f"--device cuda: {reason.args[0]}")
        if not torch.cuda.is_available():
            pytest.skip("--device cuda: needs a CUDA device")
        # deterministic=True (trainer_kwargs) makes cuBLAS refuse to run without a fixed workspace
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        _DEVICE["name"] = "cuda"
    # deterministic=True leaves torch's deterministic mode on for the rest of the process, where on CUDA ops such as
    # a floating cumsum then raise: each test starts from the mode it found
    deterministic = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
    _DEVICE["name"] = "cpu"


def device() -> str:
    """The accelerator this test runs on: "cuda" for an `on_device` test under `--device cuda`, else "cpu"."""
    return _DEVICE["name"]


def cpu_only(reason):
    """Keep an `on_device` test on the CPU (skipped under `--device cuda`), saying why."""
    return pytest.mark.cpu_only(reason)


def module_device(request) -> str:
    """:func:`device` for a module-scoped fixture whose tests are all `on_device`. Such a fixture is set up before the
    per-test switch above, so it reads `--device` itself and passes what this returns on (``accelerator=``); without a
    CUDA device it skips, and with it every test that shares the fixture."""
    if request.config.getoption("--device") != "cuda":
        return "cpu"
    if not torch.cuda.is_available():
        pytest.skip("--device cuda: needs a CUDA device")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    return "cuda"


def fabric(**kwargs):
    """A one-device Fabric on :func:`device`."""
    return L.Fabric(accelerator=device(), devices=1, **kwargs)


def trainer_kwargs(**overrides):
    """A quiet trainer on :func:`device`: no logger, no checkpoints, no progress bar unless a test asks for them."""
    kwargs = dict(
        accelerator=device(),
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        deterministic=True,
    )
    kwargs.update(overrides)
    return kwargs


class TinyRegressor(L.LightningModule):
    """A 2-layer MLP on fixed random data; ``fault_at`` injects a non-finite loss at those batch indices."""

    def __init__(self, optimizer="adamw", lr=1e-2, fault_at=(), fault=float("inf"), width=16, norm=False):
        super().__init__()
        layers = [nn.Linear(8, width), nn.ReLU()]
        if norm:
            layers.append(nn.LayerNorm(width))
        layers.append(nn.Linear(width, 1))
        self.net = nn.Sequential(*layers)
        self.optimizer, self.lr, self.fault_at, self.fault = optimizer, lr, set(fault_at), fault
        self.seen_batches = 0

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x).float(), y)
        if self.seen_batches in self.fault_at:
            loss = loss * self.fault
        self.seen_batches += 1
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x).float(), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        if self.optimizer == "adam_fused":
            return torch.optim.Adam(self.parameters(), lr=self.lr, fused=True)
        if self.optimizer == "adam_foreach":
            return torch.optim.Adam(self.parameters(), lr=self.lr, foreach=True)
        if self.optimizer == "lbfgs":
            return torch.optim.LBFGS(self.parameters(), lr=self.lr, max_iter=3)
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class TwoOptimizers(L.LightningModule):
    """GAN-style manual optimization: two sub-nets, two optimizers, both step every batch."""

    def __init__(self, fault_at=()):
        super().__init__()
        self.automatic_optimization = False
        self.g = nn.Linear(8, 8)
        self.d = nn.Linear(8, 1)
        self.fault_at = set(fault_at)
        self.steps_taken = 0

    def training_step(self, batch, batch_idx):
        opt_g, opt_d = self.optimizers()
        x, y = batch
        loss_d = nn.functional.mse_loss(self.d(self.g(x).detach()).float(), y)
        opt_d.zero_grad()
        self.manual_backward(loss_d * (float("inf") if batch_idx in self.fault_at else 1.0))
        opt_d.step()
        loss_g = self.d(self.g(x)).float().pow(2).mean()
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()

    def configure_optimizers(self):
        return torch.optim.Adam(self.g.parameters(), lr=1e-3), torch.optim.Adam(self.d.parameters(), lr=1e-3)


class inside_forward:
    """Call ``record(module, args, output)`` from inside ``module``'s own forward, where ``self.weight`` is what the
    forward computes with (a forward hook sees the 16-bit copy or the FP32 Parameter depending on whether it runs
    before or after the plugin's own hook). Wraps the instance's forward; ``remove()`` undoes it."""

    def __init__(self, module, record):
        forward = module.forward

        def recording(*args, **kwargs):
            out = forward(*args, **kwargs)
            record(module, args, out)
            return out

        self.module, module.forward = module, recording

    def remove(self):
        del self.module.forward


def regression_data(n=64, batch_size=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :1] * 0.5 - x[:, 1:2] * 0.25).clone()
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


@pytest.fixture
def data():
    return regression_data()


@pytest.fixture
def fresh_gemm_detection(monkeypatch):
    """Forget the per-process 16-bit GEMM verdicts and warnings before and after a test that mocks or probes them."""
    import lightning_mp.gemm.support as gs

    gs.gemm_support.cache_clear()
    monkeypatch.setattr(gs, "_warned", set())
    yield
    gs.gemm_support.cache_clear()
