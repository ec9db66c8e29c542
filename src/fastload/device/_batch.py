"""Walk a batch (nested dicts, lists, tuples and namedtuples of tensors) and map its tensors."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from fastload.errors import UnsupportedSampleError

__all__ = ["map_tensors", "pinned"]

_PLAIN = (str, bytes, int, float, bool, complex, type(None), np.generic)


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``batch`` with ``fn`` applied to each tensor (NumPy arrays become tensors first).

    Scalars, strings and None pass through; any other type raises
    :class:`UnsupportedSampleError` naming where it sits.
    """
    return _map(batch, fn, "batch")


def pinned(batch: Any) -> Any:
    """``batch`` with its tensors in pinned memory; anything else (arrays, custom objects) is
    kept as it is, as torch's own pin-memory thread does."""
    return _map(batch, torch.Tensor.pin_memory, "batch", lenient=True)


def _map(
    value: Any, fn: Callable[[torch.Tensor], torch.Tensor], where: str, *, lenient: bool = False
) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if lenient and not isinstance(value, (Mapping, list, tuple)):
        return value
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject or value.dtype.fields is not None:
            raise UnsupportedSampleError(f"{where} is a NumPy array of dtype {value.dtype}")
        return fn(torch.from_numpy(value))
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, Mapping):
        items = {k: _map(v, fn, f"{where}[{k!r}]", lenient=lenient) for k, v in value.items()}
        return items if type(value) is dict else _rebuild(value, items, where)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(
            *(
                _map(v, fn, f"{where}.{f}", lenient=lenient)
                for f, v in zip(value._fields, value, strict=True)
            )
        )
    if isinstance(value, (list, tuple)):
        return type(value)(
            _map(v, fn, f"{where}[{i}]", lenient=lenient) for i, v in enumerate(value)
        )
    raise UnsupportedSampleError(
        f"DeviceLoader: {where} is a {type(value).__module__}.{type(value).__qualname__}; "
        "batches hold tensors, arrays, scalars, str, None and dicts/lists/tuples of them"
    )


def _rebuild(original: Mapping[Any, Any], items: dict[Any, Any], where: str) -> Any:
    try:
        return type(original)(items)  # type: ignore[call-arg]
    except TypeError as exc:
        raise UnsupportedSampleError(
            f"DeviceLoader: {where} is a {type(original).__qualname__} that cannot be rebuilt "
            "from a dict"
        ) from exc
