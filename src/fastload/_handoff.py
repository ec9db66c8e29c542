"""The lookahead's hand-off: samples it made, held in memory for the read of their batch.

The loader's lookahead makes (fetches, decodes, preprocesses and, with a cache, caches) a batch
ahead of the loop. The read of that batch takes what it made from here instead of reading back
from the cache what was just written there (or, with no cache, making it again), and waits for
samples the lookahead is still making.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from fastload.cache._tree import flatten
from fastload.errors import UnsupportedSampleError

__all__ = ["HANDOFF_BYTES", "Handoff"]

HANDOFF_BYTES = 64 * 2**20
"""Bytes of samples the lookahead made that a process holds for the reads of their batches."""


class Handoff:
    """Samples the lookahead made, held for the read of their batch, which takes them instead
    of reading back from the cache what was just written there (a copy and a checksum a
    sample). At most ``HANDOFF_BYTES`` of arrays and tensors, the oldest dropped first (a
    batch the loop read before its lookahead finished leaves its samples to be dropped); one
    per process, empty in a new one (a pickled or forked dataset's is not carried over)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._held: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._making: dict[Hashable, threading.Event] = {}  # names the lookahead is making now
        self._lock = threading.Lock()

    def __reduce__(self) -> tuple[Any, ...]:
        return (Handoff, ())

    def making(self, names: Sequence[Hashable]) -> Callable[[], None]:
        """The lookahead is to make ``names`` (said before a thread takes the work up): a read
        of them waits until the function returned is called (the making ended, however), where
        it would wait for the cache's entry locks or make them a second time."""
        done = threading.Event()
        with self._lock:
            self._making.update(dict.fromkeys(names, done))

        def ended() -> None:
            with self._lock:
                for name in names:
                    if self._making.get(name) is done:
                        del self._making[name]
            done.set()

        return ended

    def keep(self, names: Sequence[Hashable], made: Sequence[Any]) -> int:
        """Hold ``made``; how many samples (failures aside) could not be held, or were dropped
        to make room."""
        lost = 0
        with self._lock:
            for name, sample in zip(names, made, strict=True):
                size = _nbytes(sample)
                if size is None or size > HANDOFF_BYTES:
                    lost += not isinstance(sample, BaseException)
                    continue
                old = self._held.pop(name, None)
                self._bytes += size - (0 if old is None else old[1])
                self._held[name] = (sample, size)
            while self._bytes > HANDOFF_BYTES:
                _, (_, size) = self._held.popitem(last=False)
                self._bytes -= size
                lost += 1
        return lost

    def room(self) -> bool:
        """Whether the lookahead may make more to hold (half of ``HANDOFF_BYTES`` is free)."""
        return self._bytes <= HANDOFF_BYTES // 2

    def take(self, names: Sequence[Hashable]) -> dict[int, Any]:
        """The held samples among ``names``, by position, no longer held."""
        if not self._held and not self._making:
            return {}
        with self._lock:
            making = {self._making[name] for name in names if name in self._making}
        for done in making:
            done.wait()
        out = {}
        with self._lock:
            for position, name in enumerate(names):
                held = self._held.pop(name, None)
                if held is not None:
                    out[position] = held[0]
                    self._bytes -= held[1]
        return out


def _nbytes(sample: Any) -> int | None:
    """The bytes of a sample's arrays, tensors and values, or None for a sample the cache
    could not hold either (an image object...)."""
    try:
        _, values, leaves = flatten(sample)
    except UnsupportedSampleError:
        return None
    return sum(leaf.nbytes for leaf in leaves) + sum(sys.getsizeof(v) for v in values)
