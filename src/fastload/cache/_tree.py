"""A sample as a JSON-able spec plus a flat list of array leaves, and back.

Samples may be tensors, NumPy arrays, or (nested) tuples, lists and dicts of them, with
scalars, strings, bytes and None beside them (labels, ids). Anything else is refused with
:class:`UnsupportedSampleError` naming its type and where it sits in the sample.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from fastload.errors import UnsupportedSampleError

__all__ = ["Leaf", "descr", "flatten", "unflatten"]

Leaf = np.ndarray | torch.Tensor
Spec = list[Any]

_SCALARS = (bool, int, float, str, type(None))


@functools.lru_cache(maxsize=256)
def descr(dtype: np.dtype[Any]) -> Any:
    """``np.lib.format.dtype_to_descr(dtype)``, worked out once per dtype (a put's leaves
    asked it twice each, at a few µs a call)."""
    return np.lib.format.dtype_to_descr(dtype)


def flatten(sample: Any) -> tuple[Spec, list[Leaf]]:
    """``(spec, leaves)``: tensors come back as tensors and arrays as arrays."""
    leaves: list[Leaf] = []
    return _flatten(sample, leaves, "sample"), leaves


def _flatten(value: Any, leaves: list[Leaf], where: str) -> Spec:
    if isinstance(value, torch.Tensor):
        if value.layout is not torch.strided:
            raise UnsupportedSampleError(f"{where} is a {value.layout} tensor; only dense ones")
        leaves.append(value.detach().cpu())
        return ["t", len(leaves) - 1]
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject or value.dtype.fields is not None:
            kind = "an object" if value.dtype.hasobject else "a structured"
            raise UnsupportedSampleError(f"{where} is {kind} array; only plain numeric arrays")
        leaves.append(value)
        return ["n", len(leaves) - 1]
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        return ["s", descr(value.dtype), value.item()]
    if isinstance(value, _SCALARS):
        return ["v", value]
    if isinstance(value, bytes):
        return ["b", value.hex()]
    if type(value) in (tuple, list):
        tag = "u" if isinstance(value, tuple) else "l"
        return [tag, [_flatten(v, leaves, f"{where}[{i}]") for i, v in enumerate(value)]]
    if type(value) is dict:
        items = []
        for k, v in value.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise UnsupportedSampleError(f"{where} has a key of type {type(k).__name__}")
            items.append([k, _flatten(v, leaves, f"{where}[{k!r}]")])
        return ["d", items]
    raise UnsupportedSampleError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}; the cache stores "
        "tensors, arrays, scalars, str, bytes, None and tuples/lists/dicts of them"
    )


def unflatten(spec: Spec, leaves: list[Leaf]) -> Any:
    tag = spec[0]
    if tag in ("t", "n"):
        return leaves[spec[1]]
    if tag == "v":
        return spec[1]
    if tag == "s":
        return np.lib.format.descr_to_dtype(spec[1]).type(spec[2])
    if tag == "b":
        return bytes.fromhex(spec[1])
    if tag == "u":
        return tuple(unflatten(s, leaves) for s in spec[1])
    if tag == "l":
        return [unflatten(s, leaves) for s in spec[1]]
    if tag == "d":
        return {k: unflatten(s, leaves) for k, s in spec[1]}
    raise ValueError(f"unknown spec tag {tag!r}")
