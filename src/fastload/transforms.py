"""Preprocessing with fingerprints: the cache keys on them, so changing a transform invalidates
exactly the entries it produced.

A :class:`Transform` is any callable with a ``fingerprint`` string. :func:`versioned` gives a
plain function one; :func:`fingerprint` falls back to hashing a function's code, constants,
defaults and closure, and what the module-level names it reads hold: constants (numbers,
strings, containers of them, numpy arrays) and functions of its own module, in turn. Edits to
code it imports from elsewhere, or to classes it uses, are not seen: give those a version.

A training script's functions run as ``__main__``; a versioned one is named by the script's
own module name (``train.prep:v1`` in ``python train.py``), as ``fastload warm-cache
--transform train:prep`` imports it, so both name the same cache entries.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import io
import json
import math
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import CodeType, FunctionType, ModuleType
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

import numpy as np
import torch

from fastload._dicom import dicom_array, dicom_series
from fastload._image import image_array, tiff_array
from fastload.config import DecodeConfig
from fastload.errors import ConfigError, DecodeError

__all__ = [
    "Compose",
    "QuantileNormalize",
    "Resize",
    "Transform",
    "channels_first",
    "compose",
    "decode_dicom",
    "decode_dicom_series",
    "decode_image",
    "decode_npy",
    "decode_npz",
    "decode_pt",
    "decode_raw",
    "decode_tiff",
    "decoder",
    "fingerprint",
    "versioned",
]

F = TypeVar("F", bound=Callable[..., Any])
_DEEPEST = 32  # containers nested deeper are not taken for constants


@runtime_checkable
class Transform(Protocol):
    """A callable whose ``fingerprint`` changes whenever its output would."""

    fingerprint: str

    def __call__(self, sample: Any) -> Any: ...


def _digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, default=repr).encode()).hexdigest()[:16]


def versioned(version: str | int) -> Callable[[F], F]:
    """Give a plain function a fingerprint: bump ``version`` when its output changes.

    >>> @versioned("2")
    ... def crop(x): return x[..., 16:-16, 16:-16]
    """
    if callable(version):  # @versioned without its version: crop would become the decorator
        raise ConfigError(f"write @versioned(1) (with a version) above {version!r}, not @versioned")
    if isinstance(version, bool) or not isinstance(version, str | int):
        raise ConfigError(f"versioned needs a str or int version, got {version!r}")

    def mark(function: F) -> F:
        function.fingerprint = _versioned_print(function, version)  # type: ignore[attr-defined]
        return function

    return mark


def _versioned_print(function: Callable[..., Any], version: str | int) -> str:
    """``module.name:vVERSION``, where a training script's module is the script's own name:
    ``python train.py`` runs its functions as ``__main__``, and ``fastload warm-cache
    --transform train:prep`` imports the same function as ``train.prep``; both name the same
    cache entries (``train.prep:v1``). Only functions: a callable object or a partial has
    parameters that a name and a version cannot tell apart (``Resize(224)``, ``Resize(512)``)."""
    if not isinstance(inspect.unwrap(function), FunctionType):
        raise ConfigError(
            f"@versioned marks functions, not {type(function).__name__} objects such as "
            f"{function!r}: give the object a fingerprint attribute that names its parameters"
        )
    return f"{_module_name(function)}.{function.__qualname__}:v{version}"


def _module_name(function: Callable[..., Any]) -> str:
    """``function``'s module, a script run as ``__main__`` named as its file would import."""
    module = str(function.__module__)
    if module != "__main__":
        return module
    namespace = getattr(inspect.unwrap(function), "__globals__", {})
    spec = namespace.get("__spec__")
    if spec is not None and spec.name not in ("__main__", None):  # python -m package.train
        return str(spec.name)
    path = namespace.get("__file__")
    return Path(path).stem if path else module  # a notebook or a REPL stays __main__


def fingerprint(transform: Callable[..., Any] | None) -> str:
    """``transform.fingerprint``, or a hash of a plain function's code, constants and defaults."""
    if transform is None:
        return "identity"
    own = getattr(transform, "fingerprint", None)
    if isinstance(own, str):
        return own
    if isinstance(transform, FunctionType):
        return _function_print(transform, {id(transform)})
    owner = getattr(transform, "__objclass__", transform)  # bytes.decode's is bytes
    if getattr(owner, "__module__", None) == "builtins":  # int, len, bytes.decode: fixed code
        return f"builtins.{getattr(transform, '__qualname__', transform)}"
    raise ConfigError(
        f"cannot fingerprint {transform!r}: give it a 'fingerprint' attribute or use "
        "@fastload.transforms.versioned(...)"
    )


def state_print(obj: Any) -> tuple[str, list[str]]:
    """A digest of what ``obj``'s attributes hold where a fingerprint can follow it (constants,
    functions, transforms, classes), and the names of the attributes it cannot follow."""
    followed: list[tuple[str, str]] = []
    unseen: list[str] = []
    for name, value in sorted(getattr(obj, "__dict__", {}).items()):
        text = _held(value, set())
        if text is None:
            unseen.append(name)
        else:
            followed.append((name, text))
    return _digest(followed), unseen


def _function_print(function: FunctionType, seen: set[int]) -> str:
    """A plain function's fingerprint; ``seen``: the functions already on the way here."""
    code = _code_parts(function.__code__)
    defaults = function.__defaults__, function.__kwdefaults__
    names = function.__code__.co_freevars
    cells = [
        _captured(function, name, cell.cell_contents, seen)
        for name, cell in zip(names, function.__closure__ or (), strict=True)
    ]
    reads = _globals_read(function, seen)
    parts = (code, defaults, cells, reads) if reads else (code, defaults, cells)
    return f"{function.__qualname__}:{_digest(*parts)}"


def _globals_read(function: FunctionType, seen: set[int]) -> list[tuple[str, str]]:
    """What the module-level names ``function`` reads hold, where a change would change its
    output unseen: constants, transforms, and functions of its own module (in turn)."""
    out = []
    for name in sorted(set(_names(function.__code__))):
        if name in function.__globals__:  # not a builtin, nor only an attribute's name
            text = _followed(function.__globals__[name], seen, function.__module__)
            if text is not None:
                out.append((name, text))
    return out


def _captured(function: FunctionType, name: str, value: Any, seen: set[int]) -> str:
    """The text of what ``function``'s closure holds under ``name``; ConfigError for what a
    fingerprint cannot follow."""
    text = _held(value, seen)
    if text is None:
        raise ConfigError(
            f"cannot fingerprint {function.__qualname__}: it holds {name}="
            f"{type(value).__name__} (not a constant; its repr would differ from run to run, "
            "or hide a change): give the function a version with "
            "@fastload.transforms.versioned(...)"
        )
    return text


def _held(value: Any, seen: set[int]) -> str | None:
    """The text of a value held by a closure or an object: what :func:`_followed` gives, a
    builtin's or a class's or module's name; None for anything else."""
    text = _followed(value, seen, None)
    if text is not None:
        return text
    if isinstance(value, ModuleType):
        return f"module {value.__name__}"
    if isinstance(value, type):
        return f"class {value.__module__}.{value.__qualname__}"
    if callable(value):
        try:
            return fingerprint(value)  # a builtin
        except ConfigError:
            return None
    return None


def _followed(value: Any, seen: set[int], home: str | None) -> str | None:
    """The text of a value a function uses: a transform's fingerprint, a function's (one of
    module ``home``, or any when None), or a constant's; None for anything else."""
    own = getattr(value, "fingerprint", None)
    if isinstance(own, str):
        return own
    if isinstance(value, FunctionType):
        if home is not None and value.__module__ != home:
            return None
        return "" if id(value) in seen else _function_print(value, seen | {id(value)})
    return _constant(value)


def _names(code: CodeType) -> list[str]:
    """The global and attribute names ``code`` and the code nested in it use."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, CodeType):
            names += _names(const)
    return names


def _constant(value: Any, depth: int = 0) -> str | None:
    """A stable text of a constant (the same in every process: sets sorted, arrays hashed),
    or None for anything else (modules, classes, objects, a container that holds itself)."""
    if depth > _DEEPEST:
        return None
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return repr(value)
    if isinstance(value, np.ndarray) and not value.dtype.hasobject:
        body = hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()[:16]
        return f"ndarray({value.dtype.str},{value.shape},{body})"
    if isinstance(value, np.generic):
        return f"{value.dtype.str}:{value.item()!r}"
    if isinstance(value, dict):
        elements: list[Any] = list(value.items())  # (key, value) tuples, in their order
    elif isinstance(value, (tuple, list, set, frozenset)):
        elements = list(value)
    else:
        return None
    texts = []
    for element in elements:
        text = _constant(element, depth + 1)
        if text is None:
            return None
        texts.append(text)
    if isinstance(value, (set, frozenset)):
        texts.sort()  # a set's order changes from process to process
    return f"{type(value).__name__}[{','.join(texts)}]"


def _code_parts(code: CodeType) -> list[Any]:
    return [code.co_code.hex(), [_code_constant(c) for c in code.co_consts], code.co_names]


def _code_constant(value: Any) -> Any:
    """A constant of compiled code as the same text in every process: ``x in {"a", "b"}``
    compiles to a frozenset, whose repr's order changed from process to process (so such a
    function missed the cache in every run and every worker)."""
    if isinstance(value, CodeType):
        return _code_parts(value)
    if isinstance(value, frozenset):
        return _constant(value) or repr(sorted(map(repr, value)))
    return value


class Compose:
    """Apply transforms in order; the fingerprint covers each of them and their order."""

    def __init__(self, transforms: Sequence[Callable[[Any], Any]]) -> None:
        self.transforms = list(transforms)
        self.fingerprint = "compose:" + _digest([fingerprint(t) for t in self.transforms])

    def __call__(self, sample: Any) -> Any:
        for transform in self.transforms:
            sample = transform(sample)
        return sample

    def __repr__(self) -> str:
        return f"Compose({self.transforms!r})"


def compose(*transforms: Callable[[Any], Any]) -> Compose:
    return Compose(transforms)


class _Params:
    """Fingerprint = class name + the dataclass fields."""

    @property
    def fingerprint(self) -> str:
        return f"{type(self).__name__}:{_digest(asdict(self))}"  # type: ignore[call-overload]


_STRIDED_POSITIONS = 16  # QuantileNormalize strides an axis only where this many are left


@dataclass(frozen=True)
class QuantileNormalize(_Params):
    """Map the ``low``..``high`` percentiles of an array to 0..1 (clipped when ``clip``).

    The percentiles are estimated on every ``stride``-th element along each axis long enough
    to keep at least 16 positions when strided (stride 4 on a 160x512x512 volume reads 1/64 of
    it), which is what makes this affordable on 200 MB volumes. A shorter axis (channels, the
    slices of a thin volume) is read whole, so every channel and slice is in the estimate.
    NaN and infinite elements are left out of the estimate: NaN (a masked background) stays
    NaN, an infinity goes past the ends (to 0 or 1 when clipped). When the strided elements hold
    no finite value (a small region in a masked volume), the estimate uses every element; a
    constant volume, or one with no finite value, maps its finite elements to 0.
    """

    low: float = 0.5
    high: float = 99.5
    stride: int = 4
    clip: bool = True

    def __post_init__(self) -> None:
        for name in ("low", "high"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float | np.number):
                raise ConfigError(f"QuantileNormalize.{name} must be a number, got {value!r}")
        if type(self.clip) is not bool:  # clip="no" would clip
            raise ConfigError(f"QuantileNormalize.clip must be a bool, got {self.clip!r}")
        if not 0 <= self.low < self.high <= 100:
            raise ConfigError(f"QuantileNormalize needs 0 <= low < high <= 100, got {self!r}")
        if type(self.stride) is not int or self.stride < 1:
            raise ConfigError(f"QuantileNormalize.stride must be an int >= 1, got {self.stride!r}")

    def __call__(self, sample: Any) -> Any:
        array = sample.numpy() if isinstance(sample, torch.Tensor) else np.asarray(sample)
        lo, hi = self._percentiles(array)
        values = array.astype(np.float32, copy=False)
        if hi > lo:
            out = (values - np.float32(lo)) * np.float32(1.0 / (hi - lo))
        else:  # nothing to spread: finite elements to 0, NaN and infinities as they are
            out = np.where(np.isfinite(values), np.float32(0), values)
        if self.clip:
            np.clip(out, 0.0, 1.0, out=out)
        return torch.from_numpy(out) if isinstance(sample, torch.Tensor) else out

    @property
    def fingerprint(self) -> str:
        # /2: short axes are no longer strided (samples cached before are made again)
        return f"{super().fingerprint}/2"

    def _percentiles(self, array: np.ndarray) -> tuple[float, float]:
        """The ``low`` and ``high`` percentiles of the finite strided elements (of all finite
        elements when none of those is); (0, 0) when there is no finite element."""
        probe = array[tuple(slice(None, None, self._step(n)) for n in array.shape)]
        if probe.dtype.kind != "f":  # integers are all finite
            lo, hi = np.percentile(probe, [self.low, self.high])
            return float(lo), float(hi)
        for values in (probe, array):
            finite = values[np.isfinite(values)]
            if finite.size:
                lo, hi = np.percentile(finite, [self.low, self.high])
                return float(lo), float(hi)
        return 0.0, 0.0

    def _step(self, length: int) -> int:
        """The stride along an axis of ``length``: 1 where striding would leave fewer than
        ``_STRIDED_POSITIONS`` (a stride of 4 over 5 channels read channels 0 and 4 alone, and
        scaled the other three by them)."""
        return self.stride if length >= self.stride * _STRIDED_POSITIONS else 1


@dataclass(frozen=True)
class Resize(_Params):
    """Resize the trailing 2 or 3 axes of an array or tensor to ``size``.

    ``mode="linear"`` (bilinear or trilinear) returns ``float32``, whatever the input's type.
    Shrinking an axis averages over the source elements each output element covers when
    ``antialias`` (the default, as torchvision's ``Resize`` and PIL do): without it, an image
    shrunk 4x keeps one pixel in 4 and its fine detail turns into moiré. A volume's depth axis is
    antialiased too (a shrink of 160x512x512 to 48x256x256 took 0.14 s on one thread against
    0.03 s without); growing an axis is plain linear interpolation either way.
    ``mode="nearest"`` picks the nearest input element (as torch's ``nearest-exact`` and PIL's
    ``NEAREST``) and keeps the input's type: use it for label maps and masks, which linear
    interpolation would blend into labels that do not exist (and, past 2**24, round).

    The channels must come first: ``decode="image"`` gives ``H x W x C`` and ``decode="tiff"``
    ``pages x H x W x C``, so compose :func:`channels_first` before. Stretching a trailing axis of
    1 to 4 elements (channels) to more than 4 is refused rather than done.
    """

    size: tuple[int, ...]
    mode: Literal["linear", "nearest"] = "linear"
    antialias: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.size, int):  # torchvision's Resize(224)
            raise ConfigError(
                f"Resize.size is the size of each axis, e.g. ({self.size}, {self.size}); "
                f"Resize({self.size}) (torchvision's: the shorter side to {self.size}, the aspect "
                "kept) would give samples of different shapes, which cannot be batched"
            )
        if isinstance(self.size, list):
            object.__setattr__(self, "size", tuple(self.size))
        ok = len(self.size) in (2, 3) and all(type(n) is int and n > 0 for n in self.size)
        if not ok:
            raise ConfigError(f"Resize.size must be 2 or 3 positive ints, got {self.size!r}")
        if self.mode not in ("linear", "nearest"):
            raise ConfigError(f"Resize.mode must be 'linear' or 'nearest', got {self.mode!r}")
        if type(self.antialias) is not bool:
            raise ConfigError(f"Resize.antialias must be a bool, got {self.antialias!r}")

    def __call__(self, sample: Any) -> Any:
        if isinstance(sample, Mapping):
            raise ConfigError(
                f"Resize{self.size} takes one array, got a dict of {sorted(sample)} (a group's "
                "or a tar sample's members: resize each in your own transform)"
            )
        tensor = (
            sample if isinstance(sample, torch.Tensor) else torch.from_numpy(np.asarray(sample))
        )
        spatial = len(self.size)
        if tensor.ndim < spatial:
            raise ConfigError(
                f"Resize{self.size} needs >= {spatial} axes, got shape {tuple(tensor.shape)}"
            )
        if tensor.ndim > spatial and tensor.shape[-1] <= _CHANNELS < self.size[-1]:
            raise ConfigError(
                f"Resize{self.size} would stretch the last axis of shape {tuple(tensor.shape)}, "
                "which looks like channels (H x W x C, as decode='image' gives): put them first, "
                "compose(fastload.transforms.channels_first, Resize(...))"
            )
        out = self._nearest(tensor) if self.mode == "nearest" else self._linear(tensor)
        return out if isinstance(sample, torch.Tensor) else out.numpy()

    def _linear(self, tensor: torch.Tensor) -> torch.Tensor:
        """A volume that shrinks is antialiased in two steps, bilinearly on its last two axes
        and then on the first (linear interpolation is separable; torch antialiases bilinear
        only); a volume that only grows, or ``antialias=False``, takes one trilinear step."""
        have = tensor.shape[-len(self.size) :]
        if len(self.size) == 3 and self.antialias and any(map(int.__lt__, self.size, have)):
            out = _interpolate(tensor.float(), self.size[-2:], True)
            plane = out.reshape(*out.shape[:-2], -1)  # the depth axis, as rows of depth x H*W
            out = _interpolate(plane, (self.size[0], plane.shape[-1]), True)
            return out.reshape(*tensor.shape[:-3], *self.size)
        return _interpolate(tensor.float(), self.size, self.antialias)

    def _nearest(self, tensor: torch.Tensor) -> torch.Tensor:
        """Index each axis by its nearest source element: any dtype, values kept exactly."""
        for axis, size in zip(range(-len(self.size), 0), self.size, strict=True):
            have = tensor.shape[axis]
            picks = np.floor((np.arange(size) + 0.5) * (have / size)).astype(np.int64)
            tensor = tensor.index_select(axis, torch.from_numpy(np.minimum(picks, have - 1)))
        return tensor


_CHANNELS = 4  # a last axis this short is channels, not an image's width


def _interpolate(tensor: torch.Tensor, size: tuple[int, ...], antialias: bool) -> torch.Tensor:
    """``tensor``'s last 2 or 3 axes resized linearly to ``size`` (antialiased: 2 axes only)."""
    spatial = len(size)
    batch = tensor.reshape(1, -1, *tensor.shape[-spatial:])
    mode = "bilinear" if spatial == 2 else "trilinear"
    out = torch.nn.functional.interpolate(
        batch, size, mode=mode, align_corners=False, antialias=antialias and spatial == 2
    )
    return out.reshape(*tensor.shape[:-spatial], *size)


@versioned(1)
def channels_first(sample: Any) -> Any:
    """``H x W x C`` to ``C x H x W`` (any array or tensor: its last axis moved to the front),
    contiguous; what :class:`Resize` and torch's image models expect."""
    if isinstance(sample, torch.Tensor):
        return sample.movedim(-1, 0).contiguous()
    return np.ascontiguousarray(np.moveaxis(np.asarray(sample), -1, 0))


# --- decoders: object bytes -> sample ---------------------------------------------------------


@versioned(1)
def decode_npy(data: bytes | memoryview) -> np.ndarray:
    """A .npy file's array (pickled object arrays are refused), the same as ``np.load`` gives.

    Each distinct header is parsed once per process and the array copied straight out of
    ``data``: ``np.load`` of a 150 KB array cost 66 µs here, this 5 µs (most of it the copy).
    ``data`` may be a view (:func:`on_views`): the array is a copy, never tied to it.
    """
    if data[:6] != b"\x93NUMPY":  # np.load would take a zip for .npz, or try a pickle
        raise ValueError("not a .npy file (no \\x93NUMPY magic)")
    if data[6:7] not in (b"\x01", b"\x02"):  # version 3 (UTF-8 field names)
        loaded: np.ndarray = np.load(io.BytesIO(data), allow_pickle=False)
        return loaded
    dtype, shape, fortran, start = _npy_header(data)
    if dtype.hasobject:
        raise ValueError("the .npy file holds Python objects (pickles are refused)")
    count = math.prod(shape)
    if len(data) - start < count * dtype.itemsize:
        raise ValueError(
            f"the .npy file is truncated: {len(data) - start} bytes of data for {count} "
            f"items of {dtype}"
        )
    flat = np.frombuffer(data, dtype, count=count, offset=start)
    view = flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)
    array: np.ndarray = view.copy(order="K")  # writable, and not tied to the fetched bytes
    return array


def _npy_header(data: bytes | memoryview) -> tuple[np.dtype[Any], tuple[int, ...], bool, int]:
    """(dtype, shape, Fortran order, where the data starts) of a version 1 or 2 .npy file."""
    if data[6] == 1:
        start = 10 + int.from_bytes(data[8:10], "little")
    else:
        start = 12 + int.from_bytes(data[8:12], "little")
    return (*_parsed_npy_header(bytes(data[:start])), start)


@functools.lru_cache(maxsize=4096)
def _parsed_npy_header(header: bytes) -> tuple[np.dtype[Any], tuple[int, ...], bool]:
    source = io.BytesIO(header)
    if np.lib.format.read_magic(source) == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(source)
    else:
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(source)
    return dtype, tuple(shape), bool(fortran)


@versioned(1)
def decode_npz(data: bytes) -> dict[str, np.ndarray]:
    """A .npz file's arrays, by name; one whose members declare more than
    :attr:`DecodeConfig.max_bytes <fastload.config.DecodeConfig>` in all is refused before
    anything is inflated (a member never yields more than it declares)."""
    limit = DecodeConfig.from_env().max_bytes
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        declared = sum(member.file_size for member in archive.infolist())
    if declared > limit:
        raise DecodeError(
            f"the .npz file's arrays expand to {declared:,} bytes from {len(data):,}, over the "
            f"{limit:,} a sample may take (FASTLOAD_DECODE_MAX_BYTES)"
        )
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        return {name: npz[name] for name in npz.files}


@versioned(1)
def decode_pt(data: bytes) -> Any:
    """A torch.save file, loaded with ``weights_only=True`` (no code runs)."""
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


@versioned(1)
def decode_raw(data: bytes | memoryview) -> np.ndarray:
    """The bytes as a uint8 array (a copy: ``data`` may be a view, :func:`on_views`)."""
    array: np.ndarray = np.frombuffer(data, np.uint8).copy()
    return array


@versioned(2)
def decode_image(data: bytes) -> np.ndarray:
    """An image (any format Pillow reads) as an ``H x W x C`` array in the file's own sample
    type: 16-bit stays ``uint16``, grayscale is ``H x W x 1`` (needs ``fastload[image]``;
    the rules: :mod:`fastload._image`)."""
    return image_array(data)


@versioned(1)
def decode_tiff(data: bytes) -> np.ndarray:
    """Every page of a TIFF as stored (any bit depth): ``H x W x C``, or ``pages x H x W x C``
    for a multi-page file (needs ``fastload[tiff]``)."""
    return tiff_array(data)


@versioned(2)  # 2: an enhanced multi-frame file's rescale (functional groups) is applied
def decode_dicom(data: bytes) -> np.ndarray:
    """One DICOM file's pixels, rescaled to modality units (needs ``fastload[dicom]``; the
    rules: :mod:`fastload._dicom`)."""
    return dicom_array(data)


@versioned(4)  # 2: a group that is not one volume is a DecodeError (it was interleaved);
# 3: an enhanced multi-frame file's rescale is applied; a slice without a position among
# slices with one is a DecodeError (it was put at 0 mm); 4: a multi-frame file's frames are
# slices (a group of one was 1 x frames x H x W)
def decode_dicom_series(members: Mapping[str, bytes]) -> np.ndarray:
    """A group's DICOM files as one ``slices x H x W`` volume sorted by slice position, a
    multi-frame file's frames as slices (``RemoteDataset(Groups(url, by=...),
    decode="dicom-series")``; needs ``fastload[dicom]``)."""
    return dicom_series(members)


GROUP_DECODERS: dict[str, Callable[[Mapping[str, bytes]], Any]] = {
    "dicom-series": decode_dicom_series,
}
"""Decoders of a whole group (``{member key: bytes}``), by name."""

_DECODERS: dict[str, Callable[[bytes], Any]] = {
    "npy": decode_npy,
    "npz": decode_npz,
    "pt": decode_pt,
    "raw": decode_raw,
    "image": decode_image,
    "tiff": decode_tiff,
    "dicom": decode_dicom,
}


_READ_IN_PLACE: tuple[Callable[[bytes | memoryview], Any], ...] = (decode_npy, decode_raw)
"""The decoders that may read a view of memory they do not own: they read it only while they
run and return a copy of what they take from it (``np.frombuffer(...).copy()``). fastload's
others would gain nothing from a view: they read through ``io.BytesIO``, which copies one
(npz, pt, tiff, dicom, Pillow's images), or use ``bytes`` methods (the 16-bit PNG check)."""


def on_views(decode: Callable[[bytes], Any]) -> Callable[[bytes | memoryview], Any]:
    """``decode`` as it is to be called on a member that is a read-only view of memory it does
    not own (a tar member inside its chunk): itself where it reads views in place (npy, raw:
    one copy of the member fewer), else ``decode`` of the member's ``bytes`` (a copy). A user's
    callable is always given ``bytes``, as documented: what it returns may hold what it was
    given (``np.frombuffer``), and a view would hold the whole chunk for as long (chunks are
    dropped under ``ChunkConfig.memory_bytes``)."""
    in_place = next((d for d in _READ_IN_PLACE if d is decode), None)
    return in_place or _OnBytes(decode)


class _OnBytes:
    """A decoder given a view's bytes (:func:`on_views`); its fingerprint is the decoder's."""

    def __init__(self, decode: Callable[[bytes], Any]) -> None:
        self.decode = decode
        self.fingerprint = fingerprint(decode)

    def __call__(self, data: bytes | memoryview) -> Any:
        return self.decode(data if isinstance(data, bytes) else bytes(data))

    def __repr__(self) -> str:
        return repr(self.decode)


def decoder(name: str | Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """A decoder by name (``npy``, ``npz``, ``pt``, ``raw``, ``image``, ``tiff``, ``dicom``) or
    the callable itself."""
    if callable(name):
        return name
    try:
        return _DECODERS[name]
    except (KeyError, TypeError):
        raise ConfigError(
            f"unknown decoder {name!r}; known: {sorted(_DECODERS)} or a callable"
        ) from None
