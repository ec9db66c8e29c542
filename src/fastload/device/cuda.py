"""CUDA prefetch: pinned host memory, copies on a side stream, event-ordered hand-over.

Batch k+1 (and up to ``prefetch`` batches) is copied on a side stream while the loop computes
on batch k. Before a batch is handed out, the compute stream waits on the copy's event (so it
never reads a batch early) and each tensor is ``record_stream``-ed onto the compute stream (so
the caching allocator does not reuse its memory while compute still reads it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

import torch

from fastload.device._batch import map_tensors

__all__ = ["cuda_batches"]

Convert = Callable[[torch.Tensor], torch.Tensor]


def cuda_batches(
    batches: Iterator[Any],
    device: torch.device,
    *,
    prefetch: int,
    non_blocking: bool,
    convert: Convert,
) -> Iterator[Any]:
    """Yield ``batches`` on ``device``, ``prefetch`` copies ahead of the consumer."""
    side = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
    pending: deque[tuple[Any, list[torch.Tensor], torch.cuda.Event]] = deque()

    def issue(batch: Any) -> None:
        moved: list[torch.Tensor] = []

        def copy(tensor: torch.Tensor) -> torch.Tensor:
            if non_blocking and not tensor.is_pinned():
                tensor = tensor.pin_memory()  # a pageable source makes the copy synchronous
            out = convert(tensor.to(device, non_blocking=non_blocking))
            moved.append(out)
            return out

        with torch.cuda.stream(side):
            on_device = map_tensors(batch, copy)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(side)
        pending.append((on_device, moved, event))

    for batch in islice(batches, max(1, prefetch)):
        issue(batch)
    while pending:
        on_device, moved, event = pending.popleft()
        compute = torch.cuda.current_stream(device)
        compute.wait_event(event)
        for tensor in moved:
            tensor.record_stream(compute)
        following = next(batches, _END)
        if following is not _END:
            issue(following)
        yield on_device


_END = object()
