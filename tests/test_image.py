"""Image decoders keep what the file holds: bit depth, channels, one layout rule (H x W x C)."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from fastload.errors import DecodeError
from fastload.transforms import decode_image, decode_npy, decode_tiff, decoder

RNG = np.random.default_rng(0)
GRAY16 = RNG.integers(0, 65536, (37, 53), dtype=np.uint16)  # full range, odd sizes
RGB16 = RNG.integers(0, 65536, (21, 17, 3), dtype=np.uint16)
RGB8 = RNG.integers(0, 256, (19, 23, 3), dtype=np.uint8)


def pil_bytes(array: np.ndarray, fmt: str, **kwargs: object) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, format=fmt, **kwargs)
    return out.getvalue()


def png16(array: np.ndarray) -> bytes:
    """A 16-bit PNG written by hand (Pillow cannot write 16-bit colour)."""
    height, width = array.shape[:2]
    colour = 0 if array.ndim == 2 else {3: 2, 4: 6}[array.shape[2]]
    rows = b"".join(b"\x00" + array[y].astype(">u2").tobytes() for y in range(height))

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 16, colour, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )


@pytest.mark.parametrize("fmt", ["PNG", "TIFF"])
def test_16_bit_grayscale_keeps_every_value(fmt: str) -> None:
    got = decode_image(pil_bytes(GRAY16, fmt))
    assert got.dtype == np.uint16 and got.shape == (*GRAY16.shape, 1)
    np.testing.assert_array_equal(got[..., 0], GRAY16)


def test_16_bit_colour_png_keeps_every_value() -> None:
    got = decode_image(png16(RGB16))  # Pillow alone would return 8 bits
    assert got.dtype == np.uint16 and got.shape == RGB16.shape
    np.testing.assert_array_equal(got, RGB16)
    gray = decode_image(png16(GRAY16))
    np.testing.assert_array_equal(gray[..., 0], GRAY16)


@pytest.mark.parametrize(
    ("array", "fmt", "shape", "dtype"),
    [
        (RGB8, "PNG", RGB8.shape, np.uint8),
        (RGB8[..., 0], "PNG", (*RGB8.shape[:2], 1), np.uint8),  # grayscale: H x W x 1
        (np.dstack([RGB8, RGB8[..., :1]]), "PNG", (*RGB8.shape[:2], 4), np.uint8),
        (RNG.random((8, 9), dtype=np.float32), "TIFF", (8, 9, 1), np.float32),
    ],
)
def test_one_layout_rule(array: np.ndarray, fmt: str, shape: tuple[int, ...], dtype: type) -> None:
    got = decode_image(pil_bytes(array, fmt))
    assert got.shape == shape and got.dtype == dtype
    np.testing.assert_array_equal(got.reshape(array.shape), array)


def test_palette_becomes_rgb() -> None:
    palette = Image.fromarray(RGB8).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    out = io.BytesIO()
    palette.save(out, format="PNG")
    got = decode_image(out.getvalue())
    assert got.shape == RGB8.shape and got.dtype == np.uint8
    np.testing.assert_array_equal(got, np.asarray(palette.convert("RGB")))


def test_tiff_decoder_reads_every_page_and_sample_layout() -> None:
    tifffile = pytest.importorskip("tifffile")
    stack = RNG.integers(0, 65536, (5, 12, 14), dtype=np.uint16)  # 5 channel pages
    out = io.BytesIO()
    tifffile.imwrite(out, stack)
    got = decode_tiff(out.getvalue())
    assert got.dtype == np.uint16 and got.shape == (5, 12, 14, 1)
    np.testing.assert_array_equal(got[..., 0], stack)
    planar = io.BytesIO()
    tifffile.imwrite(planar, np.moveaxis(RGB16, -1, 0), photometric="rgb", planarconfig="separate")
    np.testing.assert_array_equal(decode_tiff(planar.getvalue()), RGB16)
    assert decoder("tiff") is decode_tiff


@pytest.mark.parametrize("decode", [decode_image, decode_tiff])
def test_not_an_image_is_a_decode_error(decode: object) -> None:
    with pytest.raises(DecodeError):
        decode(b"definitely not an image")  # type: ignore[operator]


def _npy(array: np.ndarray, version: tuple[int, int] | None = None) -> bytes:
    out = io.BytesIO()
    if version is None:
        np.save(out, array, allow_pickle=False)
    else:
        np.lib.format.write_array(out, array, version=version, allow_pickle=False)
    return out.getvalue()


NPY_CASES = [
    np.arange(12, dtype=">u2").reshape(3, 4) * 5000,  # 16-bit, big-endian
    np.asfortranarray(np.random.default_rng(0).random((5, 7), dtype=np.float32)),
    np.array(3.5),  # 0-d
    np.zeros((0, 4), np.int64),
    np.zeros(3, dtype=[("x", "<f4"), ("n", "<i2")]),  # structured, no objects
    np.random.default_rng(1).integers(0, 2**16, (3, 160, 160), dtype=np.uint16),
]


@pytest.mark.parametrize("array", NPY_CASES, ids=lambda a: f"{a.dtype}{a.shape}")
@pytest.mark.parametrize("version", [None, (2, 0), (3, 0)])
def test_npy_decoder_gives_what_np_load_gives(
    array: np.ndarray, version: tuple[int, int] | None
) -> None:
    data = _npy(array, version)
    for body in (data, memoryview(data), data + b"trailing"):  # tar members come as views
        got, expected = decode_npy(body), np.load(io.BytesIO(data), allow_pickle=False)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert got.flags.f_contiguous == expected.flags.f_contiguous
        assert np.array_equal(got, expected) and got.flags.writeable


def test_npy_decoder_refuses_truncated_object_and_foreign_files() -> None:
    data = _npy(np.arange(100, dtype=np.float64))
    with pytest.raises(ValueError, match="truncated"):
        decode_npy(data[:-8])
    pickled = io.BytesIO()
    np.save(pickled, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="objects"):
        decode_npy(pickled.getvalue())
    with pytest.raises(ValueError, match=r"no .x93NUMPY magic"):  # np.load: a .npz
        decode_npy(b"PK\x03\x04 a zip, not an npy file")
