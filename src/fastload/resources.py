"""Process-wide state in one place: the thread pools and clients fastload keeps per process.

Every pool and client cache is a :class:`PerProcess` registry (one per kind, named), created
lazily, forgotten in a forked child (clients and pools must never cross a fork), and stopped by
:func:`shutdown`, after which the next use creates them afresh.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Hashable
from concurrent.futures import Executor
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

__all__ = ["PerProcess", "shutdown"]

log = logging.getLogger(__name__)

_registries: weakref.WeakSet[PerProcess[object, object]] = weakref.WeakSet()


class PerProcess(Generic[K, V]):
    """``name``'s objects of this process, by key: created on first :meth:`get`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._items: dict[K, V] = {}
        self._pid = os.getpid()
        self._inherited: list[dict[K, V]] = []
        _registries.add(self)  # type: ignore[arg-type]

    def get(self, key: K, create: Callable[[], V]) -> V:
        with self._lock:
            if self._pid != os.getpid():
                # Keep the parent's objects alive but unused: collecting them here would run
                # their finalizers (s3fs closes its session) on connections the parent still uses.
                self._inherited.append(self._items)
                self._items = {}
                self._pid = os.getpid()
            if key not in self._items:
                self._items[key] = create()
            return self._items[key]

    def clear(self, *, wait: bool = True) -> int:
        """Forget this process's objects, stopping the executors among them; how many."""
        with self._lock:
            items = self._items if self._pid == os.getpid() else {}
            self._items = {}
            self._pid = os.getpid()
        for item in items.values():
            if isinstance(item, Executor):
                item.shutdown(wait=wait, cancel_futures=True)
        return len(items)

    def __repr__(self) -> str:
        return f"PerProcess({self.name!r}, {len(self._items)} items)"


def shutdown(*, wait: bool = True) -> None:
    """Stop fastload's thread pools and drop its clients in this process.

    For a notebook or a service that is done loading: the threads end (``wait``: after the
    work in hand; queued work is cancelled) and connections close as their clients are
    collected. Anything used afterwards is created again.
    """
    for registry in sorted(_registries, key=lambda r: r.name):
        count = registry.clear(wait=wait)
        if count:
            log.debug("fastload.shutdown: %s: %d stopped", registry.name, count)
