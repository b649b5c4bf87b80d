"""A small CIFAR-style ResNet with BatchNorm (He et al., 2016) for 1-channel images."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from lightning_mp.validation import check_int, check_number


class BasicBlock(nn.Module):
    """ResNet's basic block: conv3x3-BN-ReLU-conv3x3-BN plus the shortcut, then ReLU (He et al., 2016).

    The shortcut is the identity, or a strided 1x1 convolution with BN where the shape changes. ReLUs are in
    place, as in torchvision: BatchNorm's backward needs its input, not its output, so the output can be
    overwritten and one activation per ReLU is not kept."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)), inplace=True)
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x), inplace=True)


class ResNet(L.LightningModule):
    """A small CIFAR-style ResNet (He et al., 2016, section 4.2) for 1-channel images, with BatchNorm.

    A 3x3 stem, three stages of ``blocks_per_stage`` basic blocks at ``width``, ``2 * width`` and ``4 * width``
    channels (stride 1, 2, 2), global average pooling and one linear layer. The defaults (width 16, two blocks
    per stage: 13 convolutions plus two 1x1 shortcuts, ResNet-14, 175k parameters) reach about 98.5% validation
    accuracy on the digits at 16x16 in 60 steps of 512 images (``examples/train_resnet.py``). ``forward`` maps ``(B, 1, H, W)`` images
    to ``(B, num_classes)`` logits and follows the dtype of the parameters and what autocast decides.

    Trained with SGD (Nesterov momentum 0.9, weight decay on the convolution and linear weights only) and a
    one-cycle learning-rate schedule over ``trainer.estimated_stepping_batches``.
    """

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 1,
        width: int = 16,
        blocks_per_stage: int = 2,
        lr: float = 0.1,
        weight_decay: float = 5e-4,
    ) -> None:
        super().__init__()
        for name, value in (("num_classes", num_classes), ("in_channels", in_channels), ("width", width),
                            ("blocks_per_stage", blocks_per_stage)):
            check_int(name, value, 1)
        check_number("lr", lr, 0.0, low_open=True)
        self.save_hyperparameters()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)
        )
        blocks: list[nn.Module] = []
        channels = width
        for stage, out_channels in enumerate((width, 2 * width, 4 * width)):
            for i in range(blocks_per_stage):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(BasicBlock(channels, out_channels, stride))
                channels = out_channels
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(channels, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def forward(self, images: Tensor) -> Tensor:
        x = self.blocks(self.stem(images))
        # The mean over the feature map; lightning_mp's FP32 policy lists mean, so the pooled features are FP32.
        return self.head(x.mean(dim=(2, 3)))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        self.log("val_loss", F.cross_entropy(logits, labels), prog_bar=True, batch_size=len(labels), sync_dist=True)
        self.val_acc.update(logits.float(), labels)
        self.log("val_acc", self.val_acc, prog_bar=True, batch_size=len(labels))

    def configure_optimizers(self) -> Any:
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() > 1]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.dim() <= 1]  # BN and biases
        optimizer = torch.optim.SGD(
            [{"params": decay, "weight_decay": self.hparams.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.hparams.lr,
            momentum=0.9,
            nesterov=True,
        )
        total = self.trainer.estimated_stepping_batches if self._trainer is not None else 1000
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.hparams.lr, total_steps=int(total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
