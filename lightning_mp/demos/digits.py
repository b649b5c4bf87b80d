"""scikit-learn's handwritten digits as a LightningDataModule, upsampled for a small ResNet."""

from __future__ import annotations

from typing import Optional

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp.validation import check_bool, check_int, check_number


def _shift_batch(images: Tensor, max_shift: int) -> Tensor:
    """Translate each image by its own random (dy, dx) in [-max_shift, max_shift], filling with zeros.

    One slice per distinct shift present (at most ``(2 * max_shift + 1) ** 2``), not one per image. The
    shifts draw from torch's global RNG, which ``lightning.seed_everything`` seeds (and, with
    ``workers=True``, seeds differently in every DataLoader worker)."""
    n, _, h, w = images.shape
    padded = F.pad(images, (max_shift,) * 4)
    offsets = torch.randint(0, 2 * max_shift + 1, (n, 2))
    out = torch.empty_like(images)
    keys = offsets[:, 0] * (2 * max_shift + 1) + offsets[:, 1]
    for key in keys.unique().tolist():
        rows = (keys == key).nonzero().squeeze(1)
        dy, dx = divmod(key, 2 * max_shift + 1)
        out[rows] = padded[rows, :, dy : dy + h, dx : dx + w]
    return out


class DigitsDataModule(L.LightningDataModule):
    """scikit-learn's handwritten digits (1,797 real 8x8 grey images, 10 classes), upsampled for a ResNet.

    ``sklearn.datasets.load_digits`` ships inside scikit-learn's wheel, so nothing is downloaded. The images
    are scaled from 0..16 to 0..1, upsampled once with bilinear interpolation to ``image_size`` (16 by default,
    so that a ResNet's three stages have 16x16, 8x8 and 4x4 feature maps to work on; the information is still
    that of 8x8 pixels; 32 gives CIFAR's size at 4x the compute), then standardised with the training split's mean and standard deviation.

    Args:
        batch_size: images per batch, training and validation.
        image_size: side of the upsampled images (>= 8; 8 keeps the originals).
        val_fraction: share of the images held out for validation (the default 0.2 holds out 359 of 1,797).
        augment: shift each training image by up to ``max_shift`` pixels in each direction (zero fill), drawn
            anew every batch. Validation images are never shifted.
        max_shift: largest shift in pixels of the upsampled image (the default 1 is half an original pixel at
            the default size).
        split_seed: seed of the fixed random permutation that splits train from validation; the split does not
            depend on the global RNG, so every run and every precision sees the same validation images.
        seed: if given, the training DataLoader shuffles with its own ``torch.Generator`` seeded with this;
            if ``None`` it draws from the global RNG (seeded by ``lightning.seed_everything``).
        num_workers: DataLoader worker processes. The whole set is one small in-memory tensor; 0 is fastest.

    Needs scikit-learn (``pip install scikit-learn``; it is in this package's ``dev`` extra). It is imported in
    ``setup``, so ``lightning_mp.demos`` imports without it.
    """

    num_classes = 10
    in_channels = 1
    num_images = 1797

    def __init__(
        self,
        batch_size: int = 256,
        image_size: int = 16,
        val_fraction: float = 0.2,
        augment: bool = True,
        max_shift: int = 1,
        split_seed: int = 0,
        seed: Optional[int] = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        check_int("batch_size", batch_size, 1)
        check_int("image_size", image_size, 8)
        check_int("max_shift", max_shift, 0)
        check_int("split_seed", split_seed, 0)
        check_int("num_workers", num_workers, 0)
        if seed is not None:
            check_int("seed", seed, 0)
        check_bool("augment", augment)
        check_number("val_fraction", val_fraction, 0.0, low_open=True, high=1.0)
        self.save_hyperparameters()
        self.batch_size = batch_size
        self.image_size = image_size
        self.val_fraction = float(val_fraction)
        self.augment = augment
        self.max_shift = max_shift
        self.split_seed = split_seed
        self.seed = seed
        self.num_workers = num_workers
        self.train_images: Optional[Tensor] = None  # (N, 1, image_size, image_size) float32, standardised
        self.train_labels: Optional[Tensor] = None  # (N,) int64
        self.val_images: Optional[Tensor] = None
        self.val_labels: Optional[Tensor] = None

    @staticmethod
    def _load_digits() -> tuple[Tensor, Tensor]:
        try:
            from sklearn.datasets import load_digits
        except ImportError as err:
            raise ImportError(
                "DigitsDataModule needs scikit-learn for its data set (sklearn.datasets.load_digits, which ships "
                "inside the wheel, no download). HINT: pip install scikit-learn, or install this package with "
                "its dev extra."
            ) from err
        digits = load_digits()
        images = torch.from_numpy(digits.images).float().div_(16.0).unsqueeze(1)  # 0..16 -> 0..1
        return images, torch.from_numpy(digits.target).long()

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_images is not None:  # setup runs once per stage; the data only needs preparing once
            return
        images, labels = self._load_digits()
        if self.image_size != images.shape[-1]:
            images = F.interpolate(images, size=self.image_size, mode="bilinear", align_corners=False)
        perm = torch.randperm(len(images), generator=torch.Generator().manual_seed(self.split_seed))
        n_val = round(len(images) * self.val_fraction)
        val_idx, train_idx = perm[:n_val].sort().values, perm[n_val:].sort().values
        if n_val == 0 or len(train_idx) == 0:
            raise ValueError(f"val_fraction={self.val_fraction!r} leaves an empty split of {len(images)} images")
        # Statistics of the training images only, so nothing about the validation images leaks into training.
        mean, std = images[train_idx].mean(), images[train_idx].std()
        images = (images - mean) / std
        self.background = float(-mean / std)  # the value of a blank pixel after standardising
        self.train_images, self.train_labels = images[train_idx], labels[train_idx]
        self.val_images, self.val_labels = images[val_idx], labels[val_idx]

    def _collate_train(self, items: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        images = torch.stack([x for x, _ in items])
        labels = torch.stack([y for _, y in items])
        if self.augment and self.max_shift:
            # shift in pixel space (blank = 0) so that the zero fill is the background, not mid-grey
            images = _shift_batch(images - self.background, self.max_shift) + self.background
        return images, labels

    def train_dataloader(self) -> DataLoader:
        self.setup()
        generator = torch.Generator().manual_seed(self.seed) if self.seed is not None else None
        return DataLoader(
            TensorDataset(self.train_images, self.train_labels),
            batch_size=self.batch_size,
            shuffle=True,
            generator=generator,
            collate_fn=self._collate_train,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        self.setup()
        return DataLoader(
            TensorDataset(self.val_images, self.val_labels),
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )
