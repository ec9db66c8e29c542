"""The loader's lookahead: the sampler (or a user's batch sampler) passed to torch, as it is,
with each batch made and cached ahead of the loop, and with workers, each batch's head saying
what its worker does beyond reading it (:class:`fastload._contract.BatchHead`).

Without workers this process asks the dataset's ``prefetch`` for the batch ``depth`` batches
ahead of what the loader has taken. With workers, a lookahead here would fetch, decode and
preprocess most of a cold epoch in this one process (2 workers waited on it for 88% of 2,000
samples here), so each batch handed to a worker names the batch ``depth`` beyond those the
workers may hold (``handed``) for that worker to cache, and says whether the worker only
fills the cache (``fill``: the loop's process reads the batch back).
"""

from __future__ import annotations

import itertools
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

import torch.utils.data as tud

from fastload._contract import BatchHead

__all__ = ["Lookahead", "Plan"]

Prefetch = Callable[[Sequence[int]], Future[None]]


@dataclass(frozen=True)
class Plan:
    """What a :class:`Lookahead` does, chosen when the loader is made: ask ``prefetch`` (None:
    no lookahead) for the batches ``depth`` batches ahead of what the loader has taken; with
    workers (``handed``: batches they may hold at once), hand each batch's worker the batch
    ``depth`` beyond those instead, and say whether it only fills the cache (``fill``)."""

    prefetch: Prefetch | None
    depth: int
    handed: int = 0
    fill: bool = False

    def around(self, sampler: Any, batch_sampler: Any, group: int) -> tuple[Any, Any]:
        """The loader's ``sampler`` and ``batch_sampler``, the one the indices come from (the
        batch sampler when there is one) wrapped in a :class:`Lookahead` (``group``: a
        sampler's indices per batch)."""
        if batch_sampler is not None:
            return sampler, self._wrapped(batch_sampler, 0)
        return (None if sampler is None else self._wrapped(sampler, group)), None

    def _wrapped(self, source: Any, group: int) -> Lookahead:
        """A :class:`Lookahead` around ``source``, or around what it wraps if it is one (a
        framework that rebuilds the loader from its sampler); a distributed one around a
        distributed one."""
        if isinstance(source, Lookahead):
            source = source.lookahead_source
        sharded = isinstance(source, tud.DistributedSampler)
        return (_ShardedLookahead if sharded else Lookahead)(source, self, group)


class Lookahead(tud.Sampler[Any]):
    """A sampler (``group``: indices per batch) or batch sampler (``group=0``) as it is, its
    batches made ahead as its :class:`Plan` says during a pass its loader began
    (:meth:`begin`). Iterated otherwise (by a loader a framework built around it: Lightning's
    predict wraps it in its own batch sampler), it passes the indices through as they are.

    Attributes it does not have come from the wrapped ``lookahead_source`` (``set_epoch``,
    ``epoch``, ``rank``...), so ``loader.sampler.set_epoch(e)`` works as with torch's loader.
    """

    def __init__(self, source: Any, plan: Plan, group: int) -> None:
        self.lookahead_source, self.plan, self.group = source, plan, group
        self.passes: weakref.WeakSet[_Pass] = weakref.WeakSet()
        self._begun: Iterator[Any] | None = None  # a pass its head start began (workers)
        self.workers: bool | None = None  # who reads the pass its loader began; None: none

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "lookahead_source" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.lookahead_source, name)

    def __len__(self) -> int:
        return len(self.lookahead_source)

    def __iter__(self) -> Iterator[Any]:
        begun, self._begun = self._begun, None
        if begun is None and self.workers is None:  # not a pass of its loader's
            return iter(self.lookahead_source)
        return begun or self._pass(iter(self.lookahead_source))

    def begin(self, workers: bool) -> None:
        """Its loader begins a pass, read by its ``workers`` or (False) in its process."""
        self.close()
        self.workers = workers

    def _pass(self, items: Iterator[Any], head: Sequence[Any] = ()) -> Iterator[Any]:
        """A pass over ``items``; ``head`` (batches) taken from them already, prefetched now."""
        one = _Pass(self.plan, workers=bool(self.workers))
        self.passes.add(one)
        one.started.extend(map(one.prefetch, head))
        return one.run(items, self.group)

    def head_start(self) -> None:
        """Begin the next pass now, caching its first batches in this process while the
        workers start: ``depth`` beyond those the workers are handed first, where their own
        lookahead begins. Nothing without a lookahead.

        A worker's start waits for the forkserver's imports (about 1 s here), and a cold first
        batch waited for it with this process idle.
        """
        plan = self.plan
        if plan.prefetch is None or not plan.depth:
            return
        items, size = iter(self.lookahead_source), max(self.group, 1)
        taken = list(itertools.islice(items, (plan.depth + plan.handed) * size))
        head = [taken[i : i + size] for i in range(0, len(taken), size)] if self.group else taken
        self._begun = self._pass(itertools.chain(taken, items), head)

    def head_end(self) -> None:
        """The workers have started: leave the head start's batches not begun to them."""
        for one in list(self.passes):
            for future in one.started:
                future.cancel()

    def close(self) -> None:
        """The pass is over (or its head start never taken): its prefetches end."""
        self._begun, self.workers = None, None
        for one in list(self.passes):
            one.close()


class _ShardedLookahead(Lookahead, tud.DistributedSampler[Any]):
    """A lookahead around a sampler that shards over the ranks itself (a
    ``DistributedSampler``: fastload's own), and says so as its source does: frameworks that
    shard a loader's sampler unless it is one (Lightning, Ray Train) leave it alone."""

    def set_epoch(self, epoch: int) -> None:
        self.lookahead_source.set_epoch(epoch)


class _Pass:
    """One pass of a :class:`Lookahead`: the prefetches it started (this process reads the
    batches), or the batch it is to hand a worker next (``workers``)."""

    def __init__(self, plan: Plan, workers: bool) -> None:
        self.depth = plan.depth if plan.prefetch is not None else 0
        self.handed = plan.handed if workers else 0
        self.fill = plan.fill and workers
        self._prefetch = plan.prefetch
        self.started: deque[Future[None]] = deque()
        self.newest: Sequence[Any] | None = None  # entered the window, not handed yet

    def prefetch(self, batch: Sequence[Any]) -> Future[None]:
        assert self._prefetch is not None  # only a pass with a depth prefetches
        return self._prefetch(batch)

    def _start(self, batch: Sequence[Any]) -> None:
        if self.handed:
            self.newest = batch
            return
        self.started.append(self.prefetch(batch))  # as it enters the window
        # each kept until done, not only the last few: a prefetch goes on storing the batch
        # its read took, and close() waits for it
        while self.started and self.started[0].done():
            self.started.popleft()

    def run(self, items: Iterator[Any], group: int) -> Iterator[Any]:
        window = (self.depth + self.handed) * max(group, 1) if self.depth else 0
        ahead: deque[Any] = deque()
        given = 0  # items handed on
        # a batch's indices taken at once (a step per index cost a warm sample 1 µs)
        batches = iter(lambda: list(itertools.islice(items, group)), []) if group else items
        try:
            for batch in batches:
                if self.depth:
                    self._start(batch)
                if group:
                    ahead.extend(batch)
                else:
                    ahead.append(batch)
                while len(ahead) > window:
                    yield self._given(ahead.popleft(), given, group)
                    given += 1
            for item in ahead:
                yield self._given(item, given, group)
                given += 1
        finally:
            self.close()

    def _given(self, item: Any, given: int, group: int) -> Any:
        """``item`` (the ``given``-th index, or a batch if ``group`` is 0), its index a
        :class:`BatchHead` when it starts a batch a worker fills or a batch is waiting to be
        cached (workers only)."""
        inside = given % group if group else not len(item)  # not a batch's first index
        if inside or not (self.fill or self.newest is not None):
            return item
        head = BatchHead(int(item if group else item[0]), self.fill, _indices(self.newest))
        self.newest = None
        return head if group else [head, *item[1:]]

    def close(self) -> None:
        """Cancel the prefetches not started; wait for those running (none outlives a pass)."""
        started = list(self.started)
        self.started.clear()
        for future in started:
            future.cancel()
        wait(started)


def _indices(batch: Sequence[Any] | None) -> tuple[int, ...]:
    return () if batch is None else tuple(int(i) for i in batch)
