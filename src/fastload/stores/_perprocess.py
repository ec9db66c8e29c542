"""A cache whose entries belong to one process: emptied in a forked child before first use."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

__all__ = ["PerProcessCache"]


class PerProcessCache(Generic[K, V]):
    """Clients, connection pools and stores must never cross a fork; this forgets them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[K, V] = {}
        self._pid = os.getpid()
        self._inherited: list[dict[K, V]] = []

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
