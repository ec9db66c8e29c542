"""XLA prefetch through torch_xla's own MpDeviceLoader (background host-to-device upload)."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterable, Iterator
from types import ModuleType
from typing import Any

import torch

from fastload.device._batch import map_tensors
from fastload.errors import ConfigError, MissingExtraError
from fastload.ranks import xla_rank_world
from fastload.sampler import PermutationSampler

__all__ = ["check_sharding", "torch_xla_module", "xla_batches", "xla_device"]

log = logging.getLogger(__name__)


def torch_xla_module(name: str = "torch_xla") -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise MissingExtraError("torch_xla", "xla", "DeviceLoader on an XLA device") from exc


def xla_device(device: torch.device) -> torch.device:
    """``xla`` becomes this process's XLA device; ``xla:N`` stays as given."""
    torch_xla = torch_xla_module()
    return torch.device(torch_xla.device()) if device.index is None else device


def check_sharding(loader: Iterable[Any]) -> None:
    """Each ordinal must read its own shard: refuse a PermutationSampler sharded otherwise."""
    torch_xla_module("torch_xla.runtime")
    ordinal, world = xla_rank_world() or (0, 1)
    sampler = getattr(loader, "sampler", None)
    sampler = getattr(sampler, "lookahead_source", sampler)  # fastload.DataLoader's lookahead
    if isinstance(sampler, PermutationSampler):
        if (sampler.rank, sampler.world_size) != (ordinal, world):
            raise ConfigError(
                f"DeviceLoader: the sampler reads shard {sampler.rank}/{sampler.world_size} but "
                f"this is XLA ordinal {ordinal} of {world}; build the sampler in each process "
                "(rank and world size default to torch_xla's runtime)"
            )
    elif world > 1 and sampler is not None and type(sampler).__name__ in _UNSHARDED:
        log.warning(
            "DeviceLoader: %s is not sharded over the %d XLA ordinals: every ordinal reads "
            "the whole dataset (use fastload.PermutationSampler)",
            type(sampler).__name__,
            world,
        )


_UNSHARDED = {"RandomSampler", "SequentialSampler"}


class _Guarded:
    """The loader as torch_xla sees it: validated batches, and failures kept for the consumer.

    torch_xla's loader thread dies silently on an exception and the epoch just ends early; here
    the exception is kept and re-raised by :func:`xla_batches` once the device queue drains.
    """

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader
        self.error: BaseException | None = None

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        try:
            for batch in self.loader:
                yield map_tensors(batch, lambda t: t)
        except Exception as exc:
            self.error = exc


def xla_batches(
    loader: Iterable[Any], device: torch.device, *, prefetch: int, input_sharding: Any
) -> Iterator[Any]:
    parallel_loader = torch_xla_module("torch_xla.distributed.parallel_loader")
    guarded = _Guarded(loader)
    uploads = parallel_loader.MpDeviceLoader(
        guarded,
        device,
        loader_prefetch_size=max(2, prefetch * 2),
        device_prefetch_size=max(1, prefetch),
        input_sharding=input_sharding,
    )
    yield from uploads
    if guarded.error is not None:
        raise guarded.error
