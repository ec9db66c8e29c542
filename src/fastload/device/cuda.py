"""CUDA prefetch: pinned host memory, copies on a side stream, event-ordered hand-over.

Batches k+1 to k+``prefetch`` are copied on a side stream while the loop computes on batch k.
The first batch goes out as soon as its copy is queued (not after ``prefetch`` more arrive);
later ones are fetched when the loop asks for its next batch, after it has queued its step on
the last. Before a batch is handed out, the compute stream waits on the copy's event (so it
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

    ahead = max(1, prefetch)
    for batch in islice(batches, 1):  # the first batch goes out without waiting for more
        issue(batch)
    while pending:
        on_device, moved, event = pending.popleft()
        compute = torch.cuda.current_stream(device)
        compute.wait_event(event)
        for tensor in moved:
            tensor.record_stream(compute)
        yield on_device
        # the loop has queued its step on this batch: fetch and copy while that runs
        for batch in islice(batches, ahead + 1 - len(pending)):
            issue(batch)
