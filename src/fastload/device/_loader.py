"""DeviceLoader: batches from any loader, on the device, with the stall metrics."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from fastload.device._batch import map_tensors
from fastload.device.cuda import cuda_batches
from fastload.device.xla import check_sharding, xla_batches, xla_device
from fastload.errors import ConfigError
from fastload.stall import (
    DATA_BOUND_ABOVE,
    Hook,
    Listener,
    Meter,
    StallReport,
    Window,
    window_report,
)
from fastload.stats import StageCounters

__all__ = ["DeviceLoader", "resolve_device"]


class DeviceLoader:
    """Iterate ``loader`` (any iterable of batches) and yield each batch on ``device``.

    Args:
        loader: a DataLoader or any iterable of (nested dicts/lists/tuples of) tensors.
        device: "cpu", "cuda[:N]", "xla[:N]" or a ``torch.device``.
        prefetch: batches copied ahead of the one in use (CUDA side stream, XLA device queue).
        non_blocking: asynchronous copies (sources are pinned first when not already).
        channels_last: put 4-d tensors in channels-last memory format on the device.
        dtype: convert floating-point tensors to this dtype on the device (labels keep theirs).
        input_sharding: XLA SPMD sharding spec(s), passed to torch_xla's loader.
        hooks: ``hook(metrics, step)`` callables, called every ``log_every`` steps with
            ``data/wait_ms``, ``data/step_ms``, ``data/wait_share`` and ``data/samples_per_s``
            (e.g. ``lambda m, s: wandb.log(m, step=s)``).
        data_bound_above: wait share above which :meth:`report` says data-bound.

    On CPU the batches pass through (only ``dtype``/``channels_last`` applied) with the same
    metrics. :meth:`report` says whether the loop is data- or compute-bound, and why.
    """

    def __init__(
        self,
        loader: Iterable[Any],
        device: str | torch.device = "cuda",
        *,
        prefetch: int = 2,
        non_blocking: bool = True,
        channels_last: bool = False,
        dtype: torch.dtype | None = None,
        input_sharding: Any = None,
        hooks: Sequence[Hook] = (),
        log_every: int = 50,
        data_bound_above: float = DATA_BOUND_ABOVE,
    ) -> None:
        if not isinstance(loader, Iterable):
            raise ConfigError(f"DeviceLoader needs an iterable of batches, got {loader!r}")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ConfigError(f"DeviceLoader prefetch must be an int >= 0, got {prefetch!r}")
        for name, flag in (("non_blocking", non_blocking), ("channels_last", channels_last)):
            if type(flag) is not bool:
                raise ConfigError(f"DeviceLoader {name} must be a bool, got {flag!r}")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise ConfigError(f"DeviceLoader dtype must be a torch.dtype, got {dtype!r}")
        if not 0 < data_bound_above < 1:
            raise ConfigError(f"data_bound_above must be in (0, 1), got {data_bound_above!r}")
        self.loader = loader
        self.device = resolve_device(device)
        if input_sharding is not None and self.device.type != "xla":
            raise ConfigError("DeviceLoader input_sharding is for XLA devices only")
        if self.device.type == "xla":
            check_sharding(loader)
        self.prefetch, self.non_blocking, self.input_sharding = (
            prefetch,
            non_blocking,
            input_sharding,
        )
        self.channels_last, self.dtype = channels_last, dtype
        self.data_bound_above = data_bound_above
        shared = getattr(loader, "meter", None)
        self._listener: Listener | None = None
        if isinstance(shared, Meter) and callable(getattr(loader, "report", None)):
            self.meter = shared  # one meter per loop: a fastload.DataLoader's own
            self._listener = Listener(hooks, log_every)  # called while this one iterates
        else:
            self.meter = Meter(hooks, log_every, getattr(loader, "batch_size", None))
        self._delivered = 0
        self._passes = 0
        self._pass_start: StageCounters | None = None

    def __repr__(self) -> str:
        return f"DeviceLoader({self.loader!r}, device={str(self.device)!r})"

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        self._delivered = 0
        self._passes += 1
        self._pass_start = copy.deepcopy(self.counters)  # a live view for an in-process dataset
        listening = (
            contextlib.nullcontext()
            if self._listener is None
            else self.meter.listening(self._listener)
        )
        with listening:
            for batch in self.meter.timed(self._batches()):
                self._delivered += 1
                yield batch

    def _batches(self) -> Iterator[Any]:
        kind = self.device.type
        if kind == "cuda":
            return cuda_batches(
                self._source(),
                self.device,
                prefetch=self.prefetch,
                non_blocking=self.non_blocking,
                convert=self._convert,
            )
        if kind == "xla":
            uploads = xla_batches(
                self.loader, self.device, prefetch=self.prefetch, input_sharding=self.input_sharding
            )
            if self.dtype is None and not self.channels_last:
                return uploads
            return (map_tensors(batch, self._convert) for batch in uploads)
        return (map_tensors(batch, self._move) for batch in self._source())

    def _source(self) -> Iterator[Any]:
        """The loader's batches, its ``iter()`` (where workers start) run at the first
        ``next()``: inside the first batch's timed wait."""
        yield from self.loader

    def _move(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._convert(tensor.to(self.device, non_blocking=self.non_blocking))

    def _convert(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(self.dtype)
        if self.channels_last and tensor.ndim == 4:
            tensor = tensor.contiguous(memory_format=torch.channels_last)
        return tensor

    # -- metrics and checkpoints ---------------------------------------------------------------
    @property
    def counters(self) -> StageCounters | None:
        """The loader's dataset/fetch/cache counters (see :func:`counters_of`)."""
        return counters_of(self.loader)

    def stats(self) -> dict[str, Any]:
        """A snapshot of :attr:`counters` (empty when there are none)."""
        counters = self.counters
        return {} if counters is None else counters.snapshot()

    def report(self, window: Window = "epoch") -> StallReport:
        """Wait vs step time, throughput, stage counters and the data/compute verdict, for the
        current (or last) pass (``window="epoch"``) or since the start (``"all"``); over a
        :class:`fastload.DataLoader`, the loader's own report (one meter for the loop)."""
        if self.meter is getattr(self.loader, "meter", None):
            report: StallReport = self.loader.report(  # type: ignore[attr-defined]
                window, data_bound_above=self.data_bound_above
            )
            return report
        return window_report(
            self.meter,
            self.counters,
            self._pass_start,
            window,
            this_pass=f"pass {self._passes}",
            data_bound_above=self.data_bound_above,
        )

    def state_dict(self) -> dict[str, Any]:
        """The loader's state at the next batch the loop has not seen (prefetched ones are not
        counted as seen)."""
        save: Callable[..., dict[str, Any]] | None = getattr(self.loader, "state_dict", None)
        if save is None:
            raise ConfigError(f"DeviceLoader: {self.loader!r} has no state_dict() to resume from")
        try:
            return save(consumed_batches=self._delivered)
        except TypeError:  # a loader that cannot be told how much was used
            raise ConfigError(
                f"DeviceLoader: {type(self.loader).__name__}.state_dict() cannot skip prefetched "
                "batches; use fastload.DataLoader"
            ) from None

    def set_epoch(self, epoch: int) -> None:
        """The loader's ``set_epoch`` (its sampler's order for ``epoch``)."""
        set_epoch = getattr(self.loader, "set_epoch", None)
        if set_epoch is None:
            raise ConfigError(f"DeviceLoader: {self.loader!r} has no set_epoch()")
        set_epoch(epoch)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load = getattr(self.loader, "load_state_dict", None)
        if load is None:
            raise ConfigError(f"DeviceLoader: {self.loader!r} has no load_state_dict()")
        load(state)
        self._delivered = 0


def counters_of(loader: object) -> StageCounters | None:
    """The stage counters behind a loader: a fastload.DataLoader's (workers included), or an
    in-process dataset's (None when they live in worker processes or nowhere)."""
    counters = getattr(loader, "counters", None)
    if counters is None and not getattr(loader, "num_workers", 0):
        counters = getattr(getattr(loader, "dataset", None), "counters", None)
    return counters if isinstance(counters, StageCounters) else None


def resolve_device(device: str | torch.device) -> torch.device:
    """A checked ``torch.device``; "xla" becomes this process's XLA device."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(
            f"DeviceLoader: unknown device {device!r}; expected 'cpu', 'cuda[:N]', 'xla[:N]' "
            "or a torch.device"
        ) from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"DeviceLoader: device {device!r} but CUDA is not available")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ConfigError(
                f"DeviceLoader: device {device!r} but only {torch.cuda.device_count()} GPU(s)"
            )
        index = torch.cuda.current_device() if resolved.index is None else resolved.index
        return torch.device("cuda", index)
    if resolved.type == "xla":
        return xla_device(resolved)
    return resolved
