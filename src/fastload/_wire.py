"""The values ranks hand each other without a process group (``fastload.ranks``), as bytes
that decode without running any code.

Only the few kinds that cross are encoded: ``None``, bools, numbers, strings, lists, tuples,
dicts with string keys, numpy arrays (not of objects), manifests (as the bytes
:meth:`Manifest.save` writes) and exceptions. One ``.npz`` holds the arrays and a JSON tree of
the value that refers to them; it is read with ``allow_pickle=False``. A fastload error crosses
as its class name, message and string attributes (``url``) and comes back as that class of
:mod:`fastload.errors`, looked up in its ``__all__`` only; any other exception comes back as a
:class:`FastloadError` whose message starts with its type's name. Anything else in the bytes is
a ``ValueError``.
"""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np

from fastload import errors

__all__ = ["decode", "encode"]


def encode(value: Any) -> bytes:
    """``value`` as bytes for :func:`decode`; a ``TypeError`` names a kind that cannot cross."""
    arrays: dict[str, np.ndarray] = {}
    tree = json.dumps(_tree(value, arrays)).encode()
    out = io.BytesIO()
    np.savez(out, tree=np.frombuffer(tree, dtype=np.uint8), **arrays)  # type: ignore[arg-type]
    return out.getvalue()


def decode(data: bytes) -> Any:
    """The value :func:`encode` made ``data`` of; a ``ValueError`` for any other bytes."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            if not isinstance(npz, np.lib.npyio.NpzFile):
                raise ValueError("a bare array, not an exchanged value")
            arrays = {name: npz[name] for name in npz.files}
        tree = json.loads(arrays.pop("tree").tobytes())
    except ValueError:
        raise
    except Exception as exc:  # zip, numpy and JSON each fail in their own way
        raise ValueError(f"not an exchanged value ({type(exc).__name__}: {exc})") from exc
    return _value(tree, arrays)


def _tree(value: Any, arrays: dict[str, np.ndarray]) -> Any:
    from fastload.manifest import Manifest  # noqa: PLC0415  (manifest imports ranks, which imports this)

    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list):
        return [_tree(item, arrays) for item in value]
    if isinstance(value, tuple):
        return {"tuple": [_tree(item, arrays) for item in value]}
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {"dict": {key: _tree(item, arrays) for key, item in value.items()}}
    if isinstance(value, np.ndarray) and not value.dtype.hasobject:
        return {"array": _beside(value, arrays)}
    if isinstance(value, Manifest):
        return {"manifest": _beside(np.frombuffer(value.to_bytes(), dtype=np.uint8), arrays)}
    if isinstance(value, BaseException):
        return {"error": _error_fields(value)}
    raise TypeError(f"a {type(value).__qualname__} cannot be handed to other ranks")


def _beside(array: np.ndarray, arrays: dict[str, np.ndarray]) -> str:
    name = f"a{len(arrays)}"
    arrays[name] = array
    return name


def _error_fields(error: BaseException) -> list[Any]:
    if not isinstance(error, errors.FastloadError):
        return ["FastloadError", f"{type(error).__qualname__}: {error}", {}]
    fields = {k: v for k, v in vars(error).items() if isinstance(v, str) or v is None}
    return [type(error).__name__, str(error), fields]


def _value(node: Any, arrays: dict[str, np.ndarray]) -> Any:
    from fastload.manifest import Manifest  # noqa: PLC0415  (manifest imports ranks, which imports this)

    match node:
        case None | bool() | int() | float() | str():
            return node
        case list():
            return [_value(item, arrays) for item in node]
        case {"tuple": list(items)}:
            return tuple(_value(item, arrays) for item in items)
        case {"dict": dict(items)}:
            return {str(key): _value(item, arrays) for key, item in items.items()}
        case {"array": str(name)} if name in arrays:
            return arrays[name]
        case {"manifest": str(name)} if name in arrays:
            return Manifest.from_bytes(arrays[name].tobytes(), name="a manifest another rank sent")
        case {"error": [str(kind), str(message), dict(fields)]}:
            return _error(kind, message, fields)
    raise ValueError(f"not an exchanged value: {str(node)[:100]}")


def _error(kind: str, message: str, fields: dict[str, Any]) -> errors.FastloadError:
    """The fastload error ``kind`` names (never any other class), made without its
    ``__init__`` (as unpickling would), with ``message`` and its string attributes."""
    cls = getattr(errors, kind) if kind in errors.__all__ else None
    if not (isinstance(cls, type) and issubclass(cls, errors.FastloadError)):
        raise ValueError(f"not a fastload error: {kind[:100]!r}")
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    for name, value in fields.items():
        if not name.isidentifier() or name.startswith("_") or not isinstance(value, str | None):
            raise ValueError(f"not an attribute a fastload error sends: {name[:100]!r}")
        setattr(error, name, value)
    return error
