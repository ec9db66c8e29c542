"""Image decoding that keeps what the file holds: bit depth, channels, sample type.

One layout rule for every image: an ``H x W x C`` array (``C`` = 1 for grayscale), in the
file's own sample type: 8-bit images are ``uint8``, 16-bit ones ``uint16``, 32-bit integer
ones ``int32``, floating-point ones ``float32``, 1-bit ones ``bool``. Palette images become
RGB (RGBA with transparency); CMYK, YCbCr, LAB and HSV become RGB. Multi-frame files (GIF,
multi-page TIFF through Pillow) give their first frame; :func:`decode_tiff` reads every page.

Pillow reduces 16-bit colour PNGs to 8 bits without a word, so those are decoded by pypng.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from fastload._extras import import_extra
from fastload.errors import DecodeError

__all__ = ["image_array", "tiff_array"]

_AS_STORED = {"1", "L", "LA", "RGB", "RGBA", "I", "F", "I;16", "I;16L", "I;16B", "I;16N"}
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_DEEP_COLOUR = {2: 3, 4: 2, 6: 4}  # 16-bit colour types Pillow cannot hold: channels


def image_array(data: bytes) -> np.ndarray:
    """An ``H x W x C`` array of the image in ``data`` (any format Pillow reads)."""
    channels = _deep_colour_png(data)
    if channels:
        return _png16(data, channels)
    pil = import_extra("PIL.Image", extra="image", feature="decode_image")
    try:
        with pil.open(io.BytesIO(data)) as img:
            if img.mode not in _AS_STORED:
                has_alpha = img.mode in ("PA", "RGBa", "La") or "transparency" in img.info
                img = img.convert("RGBA" if has_alpha else "RGB")  # noqa: PLW2901
            array = np.asarray(img)
    except (OSError, ValueError, SyntaxError) as exc:  # Pillow's ways of saying "not an image"
        raise DecodeError(f"not an image Pillow can read ({exc})") from exc
    return _channels_last(array.astype(array.dtype.newbyteorder("="), copy=False))


def tiff_array(data: bytes) -> np.ndarray:
    """Every page of a TIFF as stored: ``H x W x C``, or ``pages x H x W x C`` (tifffile)."""
    tifffile = import_extra("tifffile", extra="tiff", feature="decode_tiff")
    try:
        with tifffile.TiffFile(io.BytesIO(data)) as tif:
            series = tif.series[0]
            array = series.asarray()
            axes = series.axes
    except Exception as exc:  # tifffile fails on damaged files in many ways (IndexError...)
        raise DecodeError(f"not a TIFF tifffile can read ({type(exc).__name__}: {exc})") from exc
    # samples (channels) last, wherever the file keeps them
    array = np.moveaxis(array, axes.index("S"), -1) if "S" in axes else array[..., np.newaxis]
    return np.ascontiguousarray(array.astype(array.dtype.newbyteorder("="), copy=False))


def _channels_last(array: np.ndarray) -> np.ndarray:
    return array[..., np.newaxis] if array.ndim == 2 else array


def _deep_colour_png(data: bytes) -> int:
    """Channels of a 16-bit colour PNG (IHDR bit depth 16, colour type 2/4/6), else 0."""
    if not data.startswith(_PNG_SIGNATURE) or len(data) < 26 or data[12:16] != b"IHDR":
        return 0
    return _PNG_DEEP_COLOUR.get(data[25], 0) if data[24] == 16 else 0


def _png16(data: bytes, channels: int) -> np.ndarray:
    png: Any = import_extra("png", extra="image", feature="decode_image (16-bit colour PNG)")
    try:
        width, height, rows, _ = png.Reader(bytes=data).read_flat()
    except png.Error as exc:
        raise DecodeError(f"not a PNG pypng can read ({exc})") from exc
    flat = np.asarray(rows, dtype=np.uint16)
    return flat.reshape(height, width, channels)
