"""What a docs example may use without defining it (tests/test_docs.py).

The examples leave out the reader's own code: the model and its step, the preprocessing they
want cached, the number of epochs. Each such name is defined here once, as small as it can be
while doing what the example's words say it does, and a block sees only the names it does not
define itself. fastload and torch are imported for every block, as every page assumes.
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import fastload
from fastload.testing import SeaweedS3Server

# the dataset the examples call `dataset` when its origin does not matter: 300 labelled samples
FEATURES, CLASSES, SAMPLES = 8, 4, 300


def preprocess(x: np.ndarray) -> np.ndarray:
    """Deterministic preprocessing (cached): standardised float32."""
    x = x.astype(np.float32)
    return np.asarray((x - x.mean()) / (x.std() + 1e-6), np.float32)


def random_crop(x: np.ndarray) -> np.ndarray:
    """A random 7/8 crop of the last two axes (augmentation: never cached)."""
    h, w = x.shape[-2:]
    top, left = np.random.randint(0, h // 8 + 1), np.random.randint(0, w // 8 + 1)
    return x[..., top : top + h * 7 // 8, left : left + w * 7 // 8]


def random_crop_and_flip(image: np.ndarray) -> np.ndarray:
    """An H x W x C image cropped to 7/8 at random and flipped half the time."""
    h, w = image.shape[:2]
    top, left = np.random.randint(0, h // 8 + 1), np.random.randint(0, w // 8 + 1)
    crop = image[top : top + h * 7 // 8, left : left + w * 7 // 8]
    return np.ascontiguousarray(crop[:, ::-1] if np.random.rand() < 0.5 else crop)


@fastload.versioned(1)
def stack_channels(channels: dict[str, np.ndarray]) -> np.ndarray:
    """A group's H x W x 1 channel images, in member order, as one C x H x W float32 array."""
    field = np.concatenate(list(channels.values()), axis=-1).transpose(2, 0, 1)
    return np.ascontiguousarray(field, dtype=np.float32)


@fastload.versioned(1)
def to_tuple_jpg_cls(sample: dict[str, Any]) -> tuple[np.ndarray, int]:
    """A tar sample's decoded members as (image, class), WebDataset's to_tuple("jpg", "cls")."""
    return sample["jpg"], sample["cls"]


def _tensors(batch: Any) -> Iterable[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for value in batch.values():
            yield from _tensors(value)
    elif isinstance(batch, list | tuple):
        for value in batch:
            yield from _tensors(value)


def train_step(*batch: Any) -> float:
    """The model's step: it reads every tensor of the batch (and needs at least one)."""
    tensors = list(_tensors(batch))
    assert tensors, f"a training step got no tensors: {batch!r}"
    return float(sum(t.float().sum() for t in tensors))


class MyDicomDataset(torch.utils.data.Dataset[np.ndarray]):
    """The reader's own map-style dataset (its __getitem__ would download and preprocess)."""

    def __init__(self, *args: Any) -> None:
        self.files = [f"scan-{i}.dcm" for i in range(4)]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full((4, 8, 8), i, np.float32)


MyExpensiveDataset = MyDicomDataset


class _Log:
    """Where a training script sends its metrics (wandb, a TensorBoard writer)."""

    def __init__(self) -> None:
        self.logged: list[tuple[Any, ...]] = []

    def log(self, *args: Any, **kwargs: Any) -> None:
        self.logged.append(args)

    def add_scalar(self, *args: Any) -> None:
        self.logged.append(args)


def names(tmp: Path, seaweed: SeaweedS3Server) -> dict[str, Any]:
    """A fresh set of the names above, for one block run in ``tmp``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, CLASSES)
    dataset = torch.utils.data.TensorDataset(
        torch.randn(SAMPLES, FEATURES), torch.randint(0, CLASSES, (SAMPLES,))
    )
    volume = np.arange(32 * 256 * 256, dtype=np.uint16).reshape(32, 256, 256)
    samples = [f"s3://bucket/train/{i:05d}.npy|v1" for i in range(8)]

    def expensive(name: str) -> np.ndarray:
        return np.full((4, 4), samples.index(name), np.float32)

    def evaluate(model: torch.nn.Module, loader: Iterable[Any]) -> int:
        return sum(1 for _ in loader)

    return {
        "fastload": fastload,
        "torch": torch,
        "dist": dist,
        "epochs": 2,
        "start_epoch": 0,
        "preprocess": preprocess,
        "random_crop": random_crop,
        "random_crop_and_flip": random_crop_and_flip,
        "stack_channels": stack_channels,
        "to_tuple_jpg_cls": to_tuple_jpg_cls,
        "train_step": train_step,
        "step": train_step,
        "time_to_checkpoint": lambda: True,
        "save": lambda state: torch.save(state, io.BytesIO()),
        "evaluate": evaluate,
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "criterion": torch.nn.CrossEntropyLoss(),
        "dataset": dataset,
        "resuming": False,
        "checkpoint": {},
        "checkpoint_dir": str(tmp / "checkpoints"),
        "path": str(tmp / "checkpoint.pt"),
        "opts": seaweed.storage_options(),
        "endpoint": seaweed.endpoint,
        "name": samples[0],
        "names": samples,
        "expensive": expensive,
        "compute_missing": lambda positions: [expensive(samples[p]) for p in positions],
        "volume": volume,
        "MyDicomDataset": MyDicomDataset,
        "MyExpensiveDataset": MyExpensiveDataset,
        "my_files": [f"scan-{i}.dcm" for i in range(4)],
        "wandb": _Log(),
        "writer": _Log(),
    }
