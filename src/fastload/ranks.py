"""Who this process is among a job's training processes, and work done once for all of them.

One place for the ways a job's processes know each other: ``torch.distributed`` (when its
process group is initialised), torch_xla's runtime (under ``torch_xla.launch``, which needs
no process group) and, for processes outside any group (the CLI), the launcher's variables.
The sampler shards by :func:`sharding_rank_world` (the launcher's variables until a
process group is up); :func:`on_rank_zero` lets rank 0 list a bucket while
the others wait and receive its result, and :func:`on_every_rank` splits work (indexing shards)
between the ranks and hands every rank all of it. Without a process group, the values cross
through a store rank 0 serves (``fastload._rankstore``: signed, never pickled); there an error
of another rank comes back as the same fastload error, and any other as a ``FastloadError``
that names its type.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import torch.distributed as dist

from fastload._rankstore import RankStore

__all__ = [
    "launcher_rank_world",
    "on_every_rank",
    "on_rank_zero",
    "rank_world",
    "sharding_rank_world",
    "this_rank_alone",
    "this_rank_only",
    "xla_rank_world",
]

T = TypeVar("T")
log = logging.getLogger(__name__)
_calls: dict[int, itertools.count[int]] = {}  # per rank: every rank counts its own calls
_alone: contextvars.ContextVar[bool] = contextvars.ContextVar("fastload_alone", default=False)


def _torch_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _xla_runtime() -> Any | None:
    """torch_xla's runtime when a job runs under it (imported only if torch_xla already is)."""
    if "torch_xla" not in sys.modules:
        return None
    try:
        import torch_xla.runtime as xr  # noqa: PLC0415  (optional, only when in use)

        xr.world_size()
    except (ImportError, RuntimeError):
        return None
    return xr


def xla_rank_world() -> tuple[int, int] | None:
    """``(ordinal, world size)`` of torch_xla's runtime, or None when no XLA job runs."""
    xr = _xla_runtime()
    return None if xr is None else (int(xr.global_ordinal()), int(xr.world_size()))


def launcher_rank_world(environ: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """The rank and world size a launcher exported (torchrun and most: ``RANK``,
    ``WORLD_SIZE``), for processes that join no process group (the CLI); else ``(0, 1)``."""
    rank, world = environ.get("RANK"), environ.get("WORLD_SIZE")
    return (int(rank), int(world)) if rank and world else (0, 1)


def sharding_rank_world() -> tuple[int, int]:
    """The ranks a sampler splits an epoch over: :func:`rank_world` once a process group (or
    torch_xla's runtime) is up; before it is, or in a launched job that never makes one
    (torchrun without ``init_process_group``), the launcher's ``RANK`` and ``WORLD_SIZE``, so
    that its processes still split the data instead of each reading all of it. ``(0, 1)``
    inside :func:`this_rank_only`."""
    if _alone.get() or _torch_distributed() or _xla_runtime() is not None:
        return rank_world()
    rank, world = launcher_rank_world()
    if world > 1 and not _said_env_sharding:
        _said_env_sharding.append(True)
        log.warning(
            "no process group: splitting the data by the launcher's RANK=%d and WORLD_SIZE=%d "
            "(a process that is not one of the job's ranks but inherited them reads only its "
            "share: run it inside fastload.this_rank_only(), or unset them)",
            rank,
            world,
        )
    return rank, world


_said_env_sharding: list[bool] = []  # the warning above, once per process


def this_rank_alone() -> bool:
    """Whether this code runs inside :func:`this_rank_only` (a sampler made there keeps
    ``(0, 1)`` wherever it is iterated)."""
    return _alone.get()


@contextlib.contextmanager
def this_rank_only() -> Iterator[None]:
    """Make things for this rank alone: inside, fastload acts as in a job of one process.

    Under torch.distributed or torch_xla, a dataset lists on rank 0 and shares the listing,
    indexes shards a share per rank, and a loader gives each rank its share of the samples:
    all ranks must make the same datasets and loaders. A dataset made on one rank only (an
    evaluation on rank 0) would wait forever for the others, and its loader would give rank 0
    only its share. Made inside ``with fastload.this_rank_only():``, it lists and indexes by
    itself, and its loader takes every sample (iterate it anywhere).
    """
    token = _alone.set(True)
    try:
        yield
    finally:
        _alone.reset(token)


def rank_world() -> tuple[int, int]:
    """``(rank, world size)``: torch.distributed's, else torch_xla's, else ``(0, 1)``; ``(0,
    1)`` inside :func:`this_rank_only`."""
    if _alone.get():
        return 0, 1
    if _torch_distributed():
        return dist.get_rank(), dist.get_world_size()
    return xla_rank_world() or (0, 1)


def on_rank_zero(build: Callable[[], T], tag: str = "fastload") -> T:
    """``build()`` on rank 0 only; every rank gets its result (or raises its error)."""
    rank, world = rank_world()
    if world == 1:
        return build()
    outcome: tuple[bool, Any] | None = None
    if rank == 0:
        try:
            outcome = (True, build())
        except Exception as exc:  # raised on every rank, so no rank waits forever
            outcome = (False, exc)
    ok, value = _broadcast(outcome, tag)
    if not ok:
        raise value
    result: T = value
    return result


def on_every_rank(build: Callable[[int, int], T], tag: str = "fastload") -> list[T]:
    """``build(rank, world)`` on every rank, each its own part of some work; every rank gets
    all the parts in rank order (or the first error of any rank, so no rank waits forever)."""
    rank, world = rank_world()
    if world == 1:
        return [build(0, 1)]
    outcome: tuple[bool, Any]
    try:
        outcome = (True, build(rank, world))
    except Exception as exc:
        outcome = (False, exc)
    outcomes = _gather(outcome, tag)
    for ok, value in outcomes:
        if not ok:
            raise value
    return [value for _, value in outcomes]


def _gather(outcome: tuple[bool, Any], tag: str) -> list[tuple[bool, Any]]:
    """Every rank's ``outcome``, in rank order, on every rank."""
    if _torch_distributed():
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, outcome, group=_object_group())
        return gathered
    return _exchange(outcome, tag)


def _broadcast(outcome: tuple[bool, Any] | None, tag: str) -> tuple[bool, Any]:
    """Rank 0's ``outcome`` on every rank."""
    if _torch_distributed():
        payload: list[Any] = [outcome]
        dist.broadcast_object_list(payload, src=0, group=_object_group())
        received: tuple[bool, Any] = payload[0]
        return received
    sent: tuple[bool, Any] = _exchange(outcome, tag)[0]
    return sent


_gloo: list[Any] = []  # [the default group, a gloo group of its ranks] once made


def _object_group() -> Any:
    """The group fastload's object collectives use: the default group, unless its backend is
    NCCL alone. NCCL would carry the pickled objects on ``torch.cuda.current_device()``, the same
    GPU on every rank unless the program called ``torch.cuda.set_device`` before making the
    dataset, and fail or hang; a gloo group of the same ranks (made once per default group, by
    every rank at the same call) carries them on the CPU."""
    if dist.get_backend() != "nccl":
        return None
    world = dist.group.WORLD
    if not _gloo or _gloo[0] is not world:
        _gloo[:] = [world, dist.new_group(backend="gloo")]
    return _gloo[1]


def _exchange(outcome: tuple[bool, Any] | None, tag: str) -> list[Any]:
    """Every rank's ``outcome`` on every rank, under torch_xla with no process group: through
    a key-value store that rank 0 serves (XLA collectives would do on TPUs, but XLA:CPU has none
    across processes). Rank 0 stays until every rank has read, then clears the keys."""
    rank, world = rank_world()
    store = _store(rank)
    calls = _calls.setdefault(rank, itertools.count())
    key = f"fastload/{tag}/{next(calls)}"  # every rank makes the same calls in the same order
    keys = [f"{key}/{r}" for r in range(world)]
    try:
        store.put(keys[rank], outcome)
    except TypeError as exc:  # sent as this rank's error instead, so no rank waits for it
        outcome = (False, exc)
        store.put(keys[rank], outcome)
    store.wait(keys)
    try:
        outcomes = [outcome if r == rank else store.take(k) for r, k in enumerate(keys)]
    finally:  # also after a refused value, so that rank 0 clears the keys
        store.add(f"{key}/read", 1)
    if rank == 0:
        while store.add(f"{key}/read", 0) < world:
            time.sleep(0.01)
        for k in keys:
            store.delete(k)
    return outcomes


_stores: dict[tuple[int, int], RankStore] = {}


def _store(rank: int) -> RankStore:
    """This rank's client of the store rank 0 serves; one per rank, as ranks may be threads of
    one process (XLA:CPU, TPU v2/v3)."""
    where = (os.getpid(), rank)
    if where not in _stores:
        _stores[where] = RankStore(rank)
    return _stores[where]
