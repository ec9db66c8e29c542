"""Batches onto the device: CUDA (pinned memory, side stream), XLA (torch_xla), CPU."""

from __future__ import annotations

from fastload.device._batch import map_tensors
from fastload.device._loader import DeviceLoader, counters_of, resolve_device

__all__ = ["DeviceLoader", "counters_of", "map_tensors", "resolve_device"]
