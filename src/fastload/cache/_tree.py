"""A sample as a JSON-able spec plus a flat list of array leaves, and back.

Samples may be tensors, NumPy arrays, or (nested) tuples, lists and dicts of them, with
scalars, strings, bytes and None beside them (labels, ids). Object arrays of those (what a
parquet column of integers with nulls becomes: numpy integers and None) are kept element by
element. Anything else is refused with :class:`UnsupportedSampleError` naming its type and
where it sits in the sample.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from fastload.errors import UnsupportedSampleError

__all__ = ["Leaf", "Spec", "descr", "flatten", "unflatten"]

Leaf = np.ndarray | torch.Tensor
Spec = Any  # nested tuples as built (hashable), nested lists as read back from JSON

_SCALARS = (bool, int, float, str, type(None))


@functools.lru_cache(maxsize=256)
def descr(dtype: np.dtype[Any]) -> Any:
    """``np.lib.format.dtype_to_descr(dtype)``, worked out once per dtype (a put's leaves
    asked it twice each, at a few µs a call)."""
    return np.lib.format.dtype_to_descr(dtype)


def flatten(sample: Any) -> tuple[Spec, list[Any], list[Leaf]]:
    """``(spec, values, leaves)``: the sample's containers and keys, its scalars, strings and
    bytes in order (so samples differing only in those, an id or a label, share one spec), and
    its arrays and tensors (tensors come back as tensors and arrays as arrays)."""
    leaves: list[Leaf] = []
    values: list[Any] = []
    return _flatten(sample, leaves, values, ()), values, leaves


def _flatten(value: Any, leaves: list[Leaf], values: list[Any], path: tuple[Any, ...]) -> Spec:
    kind = type(value)
    if kind is dict:
        items = []
        for k, v in value.items():
            if type(k) is not str and type(k) is not int:  # bool is refused too
                raise UnsupportedSampleError(f"{_where(path)} has a key of type {type(k).__name__}")
            items.append((k, _flatten(v, leaves, values, (*path, k))))
        return ("d", tuple(items))
    if kind is tuple or kind is list:
        tag = "u" if kind is tuple else "l"
        return (tag, tuple(_flatten(v, leaves, values, (*path, i)) for i, v in enumerate(value)))
    if isinstance(value, np.ndarray):
        if value.dtype.fields is not None:
            raise UnsupportedSampleError(
                f"{_where(path)} is a structured array; only plain numeric and object arrays"
            )
        if value.dtype.hasobject:  # element by element: few, as a row's or a run's
            flat = value.reshape(-1)
            elements = tuple(_flatten(v, leaves, values, (*path, i)) for i, v in enumerate(flat))
            return ("o", value.shape, elements)
        leaves.append(value)
        return ("n", len(leaves) - 1)
    if isinstance(value, torch.Tensor):
        if value.layout is not torch.strided:
            raise UnsupportedSampleError(
                f"{_where(path)} is a {value.layout} tensor; only dense ones"
            )
        leaves.append(value.detach().cpu())
        return ("t", len(leaves) - 1)
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        values.append(value.item())
        return ("s", descr(value.dtype))
    if isinstance(value, _SCALARS):
        values.append(value)
        return ("v",)
    if isinstance(value, bytes):
        values.append(value.hex())
        return ("b",)
    raise UnsupportedSampleError(
        f"{_where(path)} is a {kind.__module__}.{kind.__qualname__}; the cache stores "
        "tensors, arrays, scalars, str, bytes, None and tuples/lists/dicts of them"
    )


@functools.lru_cache(maxsize=64)
def _scalar_type(descr: Any) -> Any:
    return np.lib.format.descr_to_dtype(descr).type


def _where(path: tuple[Any, ...]) -> str:
    return "sample" + "".join(f"[{key!r}]" for key in path)


def unflatten(spec: Spec, leaves: list[Leaf], values: list[Any] | None = None) -> Any:
    """The sample; ``values``: those :func:`flatten` took out of ``spec`` (None: in it, as
    earlier versions wrote it)."""
    return _unflatten(spec, leaves, iter(values or ()))


def _unflatten(spec: Spec, leaves: list[Leaf], values: Iterator[Any]) -> Any:
    tag = spec[0]
    if tag in ("t", "n"):
        return leaves[spec[1]]
    if tag == "v":
        return spec[1] if len(spec) > 1 else next(values)
    if tag == "s":
        return _scalar_type(spec[1])(spec[2] if len(spec) > 2 else next(values))
    if tag == "b":
        return bytes.fromhex(spec[1] if len(spec) > 1 else next(values))
    if tag == "u":
        return tuple(_unflatten(s, leaves, values) for s in spec[1])
    if tag == "l":
        return [_unflatten(s, leaves, values) for s in spec[1]]
    if tag == "d":
        return {k: _unflatten(s, leaves, values) for k, s in spec[1]}
    if tag == "o":
        out = np.empty(len(spec[2]), dtype=object)
        for i, s in enumerate(spec[2]):
            out[i] = _unflatten(s, leaves, values)
        return out.reshape(tuple(spec[1]))
    raise ValueError(f"unknown spec tag {tag!r}")
