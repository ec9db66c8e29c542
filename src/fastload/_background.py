"""Batches made in a daemon thread while the training step runs (``DataLoader(background=True)``,
in the loop's process: without workers, or when they only fill the cache)."""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any, ClassVar

__all__ = ["Background"]

log = logging.getLogger(__name__)

_END = object()
_HANDED_BACK = object()  # the loading thread is done: the loop's thread goes on with the batches
_QUICK_STEP = 1e-4  # a loop step shorter than a thread's hand-off of a batch (s)
_QUICK_STEPS = 8  # ... so many times in a row: the loading thread hands the iterator back


class Background:
    """Batches made in a daemon thread, ``depth`` ahead; errors re-raise in the consumer.

    A thread only helps while the loop's steps leave it time to work in (a training step that
    lets go of the GIL); each hand-off costs a few thread switches (0.1-0.3 ms a batch on 2
    cores). When ``_QUICK_STEPS`` steps in a row each take under ``_QUICK_STEP`` s, nothing is
    left to overlap: the thread finishes the batch in hand and hands the iterator back, and
    the pass goes on in the loop's thread (the next pass starts with a thread again).

    :meth:`close` stops the thread and waits for it (it finishes the batch in hand): the loop's
    end, a ``break`` or an exception closes it before control returns, and so does interpreter
    exit for one left open, so no thread is inside a dataset's ``__getitem__`` (a pyarrow read,
    say) while the interpreter shuts down; that aborted or hung the process.
    """

    running: ClassVar[set[Background]] = set()

    def __init__(self, batches: Iterator[Any], depth: int) -> None:
        self.batches = batches
        # made batches, and a token for each one more the thread may hand over (C queues:
        # Queue(maxsize)'s conditions cost each hand-off a fifth more here)
        self.ready: queue.SimpleQueue[tuple[Any, BaseException | None]] = queue.SimpleQueue()
        self.room: queue.SimpleQueue[None] = queue.SimpleQueue()
        for _ in range(depth):
            self.room.put(None)
        self.stop = threading.Event()
        self.hand_back = threading.Event()  # the loop's steps are too short to overlap
        self.thread = threading.Thread(target=self._produce, name="fastload-loader", daemon=True)
        Background.running.add(self)
        self.thread.start()

    def _put(self, item: Any, error: BaseException | None = None) -> bool:
        while not self.stop.is_set():
            try:
                self.room.get(timeout=0.1)
            except queue.Empty:
                continue
            self.ready.put((item, error))
            return True
        return False

    def _produce(self) -> None:
        try:
            for batch in self.batches:
                if not self._put(batch):
                    return
                if self.hand_back.is_set():
                    self._put(_HANDED_BACK)
                    return
            self._put(_END)
        except BaseException as exc:
            self._put(_END, exc)

    def __iter__(self) -> Iterator[Any]:
        quick = 0  # steps in a row under _QUICK_STEP
        try:
            while True:
                item, error = self.ready.get()
                self.room.put(None)
                if error is not None:
                    raise error
                if item is _END:
                    return
                if item is _HANDED_BACK:
                    self.close()  # the thread has returned
                    yield from self.batches
                    return
                handed = time.perf_counter()
                yield item
                quick = quick + 1 if time.perf_counter() - handed < _QUICK_STEP else 0
                if quick == _QUICK_STEPS:
                    self.hand_back.set()
        finally:
            self.close()

    def close(self) -> None:
        self.stop.set()
        if self.thread is not threading.current_thread():
            self.thread.join()
        Background.running.discard(self)

    @classmethod
    def close_all(cls, timeout: float = 60.0) -> None:
        """At interpreter exit: stop every producer and give each ``timeout`` s to finish."""
        for background in list(cls.running):
            background.stop.set()
            background.thread.join(timeout)
            if background.thread.is_alive():
                log.warning("fastload-loader thread still busy after %.0f s at exit", timeout)


atexit.register(Background.close_all)
