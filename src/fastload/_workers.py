"""The workers of :class:`fastload.DataLoader`: how they start (``forkserver`` where it is a
drop-in, each one's counters zeroed and its start timed), what each batch carries back (the
counters the worker gathered since its last batch) and how the loop takes it (:class:`Returns`:
a batch a worker only filled is read here)."""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import re
import sys
import time
from collections.abc import Callable, Iterator
from multiprocessing import forkserver
from pathlib import Path
from typing import Any, cast

import torch
import torch.utils.data as tud

from fastload import _collate
from fastload._contract import Filled, LoaderDataset
from fastload.device._batch import pinned
from fastload.stats import StageCounters

__all__ = [
    "PICKLED_LIMIT",
    "Counted",
    "Returns",
    "WorkerCollate",
    "WorkerInit",
    "fork_safe_context",
]

log = logging.getLogger(__name__)


class Counted:
    """A batch from a worker, with the counters the worker gathered since its last batch."""

    __slots__ = ("batch", "counters")

    def __init__(self, batch: Any, counters: StageCounters) -> None:
        self.batch = batch
        self.counters = counters

    def pin_memory(self) -> Counted:  # called by torch's pin-memory thread
        return Counted(pinned(self.batch), self.counters)


def _worker_counters() -> StageCounters:
    """The counters of this worker's copy of the dataset (a :class:`LoaderDataset`: the
    loader checked the one it copied)."""
    info = tud.get_worker_info()
    assert info is not None, "called in a DataLoader worker only"
    return cast(LoaderDataset, info.dataset).counters


class WorkerCollate:
    """Collate, then attach the worker's counters (drained) to the batch, if it counted any
    (``counted``: the dataset keeps counters, :class:`LoaderDataset`).

    A drain, its pickling and the loop's merge cost about 85 µs a batch here (2.7 µs a sample
    at batch 32); a worker's warm batch that it leaves unlooked counts nothing.
    """

    def __init__(self, collate: Callable[[list[Any]], Any], counted: bool) -> None:
        self.collate, self.counted = collate, counted

    def __call__(self, samples: list[Any] | Filled) -> Any:
        batch = samples if isinstance(samples, Filled) else _collate.noted(self.collate, samples)
        if not self.counted:
            return batch
        taken = _worker_counters().drain()
        return batch if taken.empty else Counted(batch, taken)


class WorkerInit:
    """Start each worker's counters at zero (a worker's dataset copy carries the parent's) and
    count how long it took to start (since ``started``, when the loader's pass began), when the
    dataset keeps counters (``counted``); then the user's ``worker_init_fn``."""

    started = 0.0

    def __init__(self, user: Callable[[int], None] | None, counted: bool) -> None:
        self.user, self.counted = user, counted

    def __call__(self, worker_id: int) -> None:
        if self.counted:
            counters = _worker_counters()
            counters.restart()
            if self.started:
                counters.dataset.worker_start.add(max(0.0, time.time() - self.started))
        if self.user is not None:
            self.user(worker_id)


class Returns:
    """The loop's side of what the workers send: the counters each batch carries, merged into
    :attr:`counters`; a batch a worker only made and cached (:class:`Filled`), read here from
    ``dataset``'s cache and pinned with ``pins``, as torch's pinning thread pins the others."""

    def __init__(self, dataset: LoaderDataset | None, pins: bool) -> None:
        self.dataset, self.pins = dataset, pins
        self.counters = StageCounters()  # the workers' counts so far

    def batches(self, items: Iterator[Any], arrived: Callable[[], None]) -> Iterator[Any]:
        """``items`` from the workers as the loop's batches (``arrived`` called as each comes)."""
        for item in items:
            arrived()
            batch = item
            if isinstance(batch, Counted):
                self.counters.merge(batch.counters)
                batch = batch.batch
            if isinstance(batch, Filled):
                assert self.dataset is not None  # only a LoaderDataset's workers fill
                batch = _collate.collate(self.dataset.read_filled(batch))
                batch = pinned(batch) if self.pins else batch
            yield batch


def fork_safe_context(*parts: object) -> Any:
    """forkserver where it works as a drop-in, else None (multiprocessing's default: fork on
    Linux, unless the program chose another with ``multiprocessing.set_start_method``).

    forkserver workers re-import the main script (as ``__mp_main__``), so it must be guarded by
    ``if __name__ == "__main__":``; the dataset and functions must pickle, by reference to
    something the worker can import; and they must be small and hold no tensors: each worker
    gets its own pickled copy, and every tensor storage travels as a file descriptor (more than
    about 250 fail with "too many fds"), where forked workers share the parent's memory.
    The forkserver preloads torch and fastload (Python's own preload of ``__main__`` does not
    happen in 3.11 and 3.12), else every worker imports torch itself: 5 s for 8 workers on a
    16-core GPU machine, at every loader's start. It then freezes its garbage collector
    (``fastload._frozen``), so workers' collections do not copy the pages they share with it.
    The forkserver starts here, so its imports overlap what the script does before its first
    batch (building a model, say).
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return None
    main_path = getattr(sys.modules.get("__main__"), "__file__", None)
    why = None
    if main_path is not None and not _guarded(main_path):
        why = f"the main script {main_path} has no 'if __name__ == \"__main__\":' guard"
    else:
        why = _why_not_pickled(parts, interactive=main_path is None)
    if why is not None:
        log.info("DataLoader: workers start with fork, not forkserver: %s", why)
        return None
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(_PRELOAD))
    forkserver.ensure_running()  # its imports overlap what the script does before iterating
    return context


_PRELOAD = ("__main__", "torch", "numpy", "fastload", "fastload._frozen")
PICKLED_LIMIT = 64 * 2**20
"""Bytes of pickled dataset above which workers fork (sharing it) rather than each unpickle it."""


class _Sizer(pickle.Pickler):
    """Pickles without keeping the bytes: counts them, out-of-band buffers and tensor storages
    (which it does not serialize), and notes a reference to ``__main__``."""

    def __init__(self) -> None:
        self.size = 0
        self.storages = 0
        self.interactive = False
        super().__init__(self, protocol=5, buffer_callback=self._buffer)

    def write(self, data: bytes) -> None:
        self.size += len(data)
        self.interactive = self.interactive or b"__main__" in data

    def _buffer(self, buffer: pickle.PickleBuffer) -> None:
        self.size += buffer.raw().nbytes

    def persistent_id(self, obj: object) -> int | None:
        if isinstance(obj, torch.UntypedStorage | torch.TypedStorage):
            self.storages += 1
            return self.storages
        return None


def _why_not_pickled(parts: tuple[object, ...], interactive: bool) -> str | None:
    sizer = _Sizer()
    try:
        sizer.dump(parts)
    except Exception as exc:  # lambdas, local classes, open handles...
        return f"the dataset or its functions do not pickle ({type(exc).__name__}: {exc})"
    if interactive and sizer.interactive:
        return "the dataset uses classes defined interactively (in __main__)"
    if sizer.storages:
        return f"the dataset holds {sizer.storages} tensors (forked workers share them)"
    if sizer.size > PICKLED_LIMIT:
        return f"the dataset pickles to {sizer.size / 2**20:.0f} MiB (forked workers share it)"
    return None


_MAIN_GUARD = re.compile(rb"""^if\s+__name__\s*==\s*['"]__main__['"]\s*:""", re.MULTILINE)


def _guarded(path: str) -> bool:
    try:
        return _MAIN_GUARD.search(Path(path).read_bytes()) is not None
    except OSError:
        return False
