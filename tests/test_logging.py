"""The skip lines print on a line of their own, not into the middle of Lightning's tqdm progress bar."""

import os
import re
import subprocess
import sys

import pytest

pty = pytest.importorskip("pty")  # a terminal is what tqdm draws its bar on: POSIX only

SCRIPT = """
import logging, os, time
import lightning as L
import torch
from torch import nn
from lightning_mp import MixedPrecisionPlugin

if os.environ.get("WITHOUT_HANDLER"):  # what Python prints with no logging configured: its last-resort handler
    logging.getLogger("lightning_mp").handlers.clear()

class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(8, 1)

    def training_step(self, batch, i):
        time.sleep(0.2)  # slow enough for tqdm to draw the bar before step 3
        loss = self.net(batch[0]).float().pow(2).mean()
        return loss * float("inf") if i == 3 else loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(48, 8)), batch_size=8)
L.Trainer(max_steps=5, plugins=[MixedPrecisionPlugin("bf16")], accelerator="cpu", logger=False,
          enable_checkpointing=False, enable_model_summary=False,
          callbacks=[L.pytorch.callbacks.TQDMProgressBar()]).fit(Model(), data)
"""


def _run_in_terminal(tmp_path, env):
    """Run SCRIPT with stdout and stderr on one 120-column pseudo-terminal (as a user's shell has them)."""
    import fcntl
    import struct
    import termios

    script = tmp_path / "fit.py"
    script.write_text(SCRIPT)
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # tqdm draws nothing at 0 columns
    proc = subprocess.Popen([sys.executable, str(script)], stdout=slave, stderr=slave, env={**os.environ, **env})
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait(timeout=300) == 0, out.decode(errors="replace")[-3000:]
    # what a terminal shows: each carriage return or newline starts the line again
    return [part for part in re.split(r"[\r\n]", out.decode(errors="replace")) if "skipped" in part]


def test_a_skip_line_starts_its_own_line_under_the_tqdm_bar(tmp_path):
    lines = _run_in_terminal(tmp_path, {})
    assert lines and all(line.startswith("step 3 skipped (loss scale 1)") for line in lines), lines
    # without the package's handler the same line lands after the bar's text (the check above can fail)
    lines = _run_in_terminal(tmp_path, {"WITHOUT_HANDLER": "1"})
    assert any(re.search(r"it/s[^\]]*\].*step 3 skipped", line) for line in lines), lines


SWITCH = """
import lightning as L, torch
from torch import nn
from lightning_mp import MixedPrecisionPlugin

class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(8, 1)

    def training_step(self, batch, i):
        return self.net(batch[0]).float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(48, 8)), batch_size=8)
L.Trainer(max_steps=4, plugins=[MixedPrecisionPlugin("fp16", schedule={2: "bf16"})], accelerator="cpu", logger=False,
          enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False).fit(Model(), data)
"""


def test_a_schedules_switch_is_printed_with_no_logging_configured():
    """The fit's log says what changed at which step, as Lightning's own lines are printed: a user who configured no
    logging still sees it (lightning_mp.schedule's infos), once."""
    out = subprocess.run([sys.executable, "-c", SWITCH], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in (out.stdout + out.stderr).splitlines() if "precision schedule" in line]
    assert lines == ["precision schedule: from step 2 on, bf16 (was fp16, loss scale 'dynamic'): precision='bf16'. "
                     "The loss scale retires (1.0 from now on)."]
