"""The collate of a loop without workers: torch's ``default_collate``, with numeric arrays and
tensors stacked by numpy.

``torch.stack`` runs on torch's intra-op thread pool. A DataLoader worker has one thread, but
the loading thread of ``fastload.DataLoader(num_workers=0)`` shares the pool with the training
step: on 2 cores, stacking 256 3x160x160 uint8 samples took 13.9 ms that way and 2.9 ms with
``np.stack`` (one thread, no pool hand-off). The result is the same: a tensor of the same
dtype, shape and values; containers are rebuilt as ``default_collate`` rebuilds them, and
anything else (ragged shapes, strings, tensor subclasses, non-CPU tensors...) goes to
``default_collate`` itself, which also raises its own errors.

Samples that fastload's cache read into the rows of one batch array (``npy`` entries, see
:mod:`fastload.cache._batch`), all of them and in order, are that batch already: it
is handed out without a copy, so the batch shares its memory with those samples, as
``batch[i]`` does. Rows of any other array are copied, as ``default_collate`` copies them: a
training step that changes its batch in place must not change a user's dataset.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from fastload.cache._batch import whole_of
from fastload.errors import ConfigError

__all__ = ["collate", "noted"]

_NUMERIC = frozenset("biufc")  # bool, int, uint, float, complex


def collate(batch: list[Any]) -> Any:
    """``default_collate(batch)``, stacking plain numeric arrays and CPU tensors with numpy."""
    return noted(_collate, batch)


def noted(collate_fn: Callable[[list[Any]], Any], batch: list[Any]) -> Any:
    """``collate_fn(batch)``; what it raises carries a note naming the keys whose values are
    None in some samples (see :func:`_note_nulls`). Where a default collate (fastload's or
    torch's) fails on samples of different shapes, the error is a :class:`ConfigError` that
    says to pass ``collate_fn`` (see :func:`_refuse_ragged`)."""
    try:
        return collate_fn(batch)
    except Exception as exc:
        _note_nulls(batch, exc)
        if collate_fn in (_collate, default_collate) and isinstance(exc, RuntimeError):
            _refuse_ragged(batch, exc)
        raise


def _collate(batch: list[Any]) -> Any:
    first = batch[0] if batch else None
    stacked = _stack(batch, first)
    if stacked is not None:
        return stacked
    if type(first) is tuple and _same_length(batch):  # (sample, label): a list, as torch does
        return [_collate(list(column)) for column in zip(*batch, strict=True)]
    if type(first) is dict and all(type(b) is dict and b.keys() == first.keys() for b in batch):
        return {key: _collate([b[key] for b in batch]) for key in first}
    return default_collate(batch)


def _note_nulls(batch: list[Any], exc: BaseException) -> None:
    """Where collating a batch of dicts failed, add a note naming the keys that some of its
    samples hold None at (a null in a parquet column): torch's own error names neither.
    (Python 3.10 has no notes: its error is torch's alone.)"""
    nulls = Counter(
        key
        for sample in batch
        if type(sample) is dict
        for key, value in sample.items()
        if value is None
    )
    add_note = getattr(exc, "add_note", None)  # Python 3.11 on
    if nulls and add_note is not None:
        shown = ", ".join(f"{key!r} in {n} of {len(batch)}" for key, n in nulls.most_common(3))
        add_note(
            f"fastload: samples of this batch hold None at {shown} (a null in a parquet "
            "column?): fill it in transform=, or pass a collate_fn that keeps it"
        )


def _refuse_ragged(batch: list[Any], exc: RuntimeError) -> None:
    """Raise a :class:`ConfigError` pointing to ``collate_fn`` where the samples of ``batch``
    differ in shape (torch's own error says only "stack expects each tensor to be equal size")."""
    found = _ragged(batch, "")
    if found is None:
        return
    where, shapes = found
    shown = ", ".join(str(list(shape)) for shape in shapes[:4]) + (", ..." * (len(shapes) > 4))
    raise ConfigError(
        "collate_fn: the default collate stacks a batch's samples into one tensor and cannot "
        f"stack these: {'sample' + where if where else 'a sample'} has shapes {shown} in one "
        "batch, as variable-length samples have (parquet rows grouped by row_key=, token lists, "
        "point clouds). Pass DataLoader(collate_fn=...) that pads or packs them; "
        'docs/shapes.md, "Ragged samples", has one'
    ) from exc


Shapes = list[tuple[int, ...]]


def _ragged(batch: list[Any], where: str) -> tuple[str, Shapes] | None:
    """The first place (``where``, then keys and positions under it) at which the samples of
    ``batch`` are arrays, tensors or lists of different shapes, and their shapes; else None."""
    if all(isinstance(s, np.ndarray | torch.Tensor) for s in batch):
        shapes: Shapes = [tuple(s.shape) for s in batch]
        return (where, shapes) if len(set(shapes)) > 1 else None
    if all(isinstance(s, tuple | list) for s in batch):
        lengths: Shapes = [(len(s),) for s in batch]
        if len(set(lengths)) > 1:
            return where, lengths
        columns = zip(*batch, strict=True)
        places = {f"{where}[{i}]": list(column) for i, column in enumerate(columns)}
    elif all(isinstance(s, Mapping) and s.keys() == batch[0].keys() for s in batch):
        places = {f"{where}[{key!r}]": [s[key] for s in batch] for key in batch[0]}
    else:
        return None
    return next(filter(None, (_ragged(column, place) for place, column in places.items())), None)


def _same_length(batch: list[Any]) -> bool:
    return all(type(b) is tuple and len(b) == len(batch[0]) for b in batch)


def _stack(batch: list[Any], first: Any) -> torch.Tensor | None:
    """The samples stacked into one tensor, or None when they are not all alike."""
    if type(first) is np.ndarray:
        arrays = batch
    elif type(first) is torch.Tensor and _plain(first):
        if not all(type(t) is torch.Tensor and _plain(t) for t in batch):
            return None
        try:
            arrays = [t.numpy() for t in batch]
        except TypeError:  # a dtype numpy lacks (bfloat16...)
            return None
    else:
        return None
    head = arrays[0]
    if head.dtype.kind not in _NUMERIC or not head.dtype.isnative:
        return None
    if not all(
        type(a) is np.ndarray and a.shape == head.shape and a.dtype == head.dtype for a in arrays
    ):
        return None
    base = whole_of(batch)  # the batch array the cache read these into, all rows in order
    if base is not None:
        return torch.from_numpy(base.view(head.dtype).reshape(len(arrays), *head.shape))
    return torch.from_numpy(np.stack(arrays))


def _plain(tensor: torch.Tensor) -> bool:
    return (
        tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.requires_grad
        and tensor.is_contiguous()
    )
