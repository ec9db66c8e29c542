"""DICOM decoding (pydicom): one file, or a series of files as one volume.

Pixel values come out in their modality's units: ``RescaleSlope`` and ``RescaleIntercept``
are applied (CT in Hounsfield units), giving ``float32`` when they change anything and the
stored integer type otherwise; an enhanced multi-frame file (Enhanced CT, MR, PET) gives them
in its functional groups, shared or for each frame, and each frame is rescaled by its own.

A multi-frame file is ``frames x H x W``; a series is sorted by slice position along the slice
normal (``ImagePositionPatient`` on the cross product of ``ImageOrientationPatient``), else by
``InstanceNumber``, and stacked to ``slices x H x W``. A volume has that one shape however it is
stored: a multi-frame file in a group gives its frames as slices (a group of one Enhanced CT
file is ``frames x H x W``, as a folder of its slices is), so a bucket that mixes both batches.
Files of several series in one group (a T1 and a T2 in one folder), a slice facing another way
(a localizer), two slices at one position (echoes, time points: several volumes in one series),
or a slice without a position among slices with one, are a DecodeError: sorted by position they
would interleave into one volume that is none of them.
"""

from __future__ import annotations

import io
import itertools
from collections.abc import Mapping
from typing import Any

import numpy as np

from fastload._extras import import_extra
from fastload.errors import DecodeError

__all__ = ["dicom_array", "dicom_series"]


def _read(data: bytes, where: str) -> Any:
    pydicom = import_extra("pydicom", extra="dicom", feature="decode_dicom")
    try:
        return pydicom.dcmread(io.BytesIO(data), force=True)
    except Exception as exc:  # pydicom's InvalidDicomError and friends
        raise DecodeError(f"{where}not a DICOM file pydicom can read ({exc})") from exc


def _pixels(ds: Any, where: str) -> np.ndarray:
    try:
        array = np.asarray(ds.pixel_array)
    except Exception as exc:  # no pixel data, an unsupported transfer syntax...
        raise DecodeError(f"{where}DICOM pixel data cannot be read ({exc})") from exc
    slope, intercept = _rescale(ds, where)
    if (slope == 1).all() and (intercept == 0).all():
        return array
    if slope.size > 1:  # one per frame: over the frame axis
        if array.ndim < 3 or array.shape[0] != slope.size:
            raise DecodeError(
                f"{where}the file names a rescale for each of {slope.size} frames but its "
                f"pixel data is {array.shape}"
            )
        slope, intercept = (v.reshape(-1, *[1] * (array.ndim - 1)) for v in (slope, intercept))
    rescaled: np.ndarray = array.astype(np.float32) * slope + intercept
    return rescaled


def _rescale(ds: Any, where: str) -> tuple[np.ndarray, np.ndarray]:
    """``RescaleSlope`` and ``RescaleIntercept`` as float32 arrays: the file's own (one value),
    or an enhanced multi-frame file's (Enhanced CT, MR, PET), which keeps them per frame in its
    functional groups (Pixel Value Transformation), not at the top level."""
    frames = ds.get("PerFrameFunctionalGroupsSequence") or []
    shared = ds.get("SharedFunctionalGroupsSequence") or []
    try:
        default = _transformation(shared[0]) if shared else None
        default = default or _transformation(ds) or (1.0, 0.0)
        pairs = [_transformation(frame) or default for frame in frames] or [default]
    except (TypeError, ValueError) as exc:  # pydicom reads a malformed DS as a string
        raise DecodeError(f"{where}RescaleSlope or RescaleIntercept is not a number") from exc
    values = np.asarray(pairs[:1] if len(set(pairs)) == 1 else pairs, dtype=np.float32)
    return values[:, 0], values[:, 1]


def _transformation(item: Any) -> tuple[float, float] | None:
    """(slope, intercept) of a dataset or functional group item that gives them, else None."""
    inner = item.get("PixelValueTransformationSequence")
    if inner:
        item = inner[0]
    if "RescaleSlope" not in item and "RescaleIntercept" not in item:
        return None
    return (float(item.get("RescaleSlope", 1) or 1), float(item.get("RescaleIntercept", 0) or 0))


def dicom_array(data: bytes) -> np.ndarray:
    """One DICOM file: ``H x W`` (``H x W x 3`` for colour), ``frames x H x W`` multi-frame."""
    return _pixels(_read(data, ""), "")


def dicom_series(members: Mapping[str, bytes]) -> np.ndarray:
    """The files of one series (a group) as a ``slices x H x W`` volume, in slice order."""
    if not members:
        raise DecodeError("a DICOM series with no files")
    slices = [(key, _read(body, f"{key}: ")) for key, body in members.items()]
    slices.sort(key=lambda item: _position(item[1], item[0]))
    _one_volume(slices)
    volume = [_frames(_pixels(ds, f"{key}: "), ds) for key, ds in slices]
    first = volume[0].shape[1:]
    odd = next(
        (key for (key, _), v in zip(slices, volume, strict=True) if v.shape[1:] != first), None
    )
    if odd is not None:
        raise DecodeError(f"{odd}: slice shape differs from the series' {first}")
    return np.concatenate(volume)


def _frames(pixels: np.ndarray, ds: Any) -> np.ndarray:
    """A file's pixels as ``frames x H x W`` (x 3 for colour): a single frame gets an axis."""
    multi = int(ds.get("NumberOfFrames", 1) or 1) > 1
    return pixels if multi else pixels[np.newaxis]


def _one_volume(slices: list[tuple[str, Any]]) -> None:
    """Refuse what would stack into a volume that is none of the series' (see the module)."""
    series = {str(ds.SeriesInstanceUID) for _, ds in slices if "SeriesInstanceUID" in ds}
    if len(series) > 1:
        raise DecodeError(
            f"the group holds {len(series)} DICOM series (SeriesInstanceUID differs between "
            f"its files, e.g. {slices[0][0]} and {slices[-1][0]}): group the files by series"
        )
    facing = [(key, _orientation(ds)) for key, ds in slices]
    known = [(key, o) for key, o in facing if o is not None]
    odd = next((key for key, o in known if not np.allclose(o, known[0][1], atol=1e-4)), None)
    if odd is not None:
        raise DecodeError(
            f"{odd} faces another way than {known[0][0]} (ImageOrientationPatient differs: a "
            "localizer or a reformat in the series?): it is not a slice of the same volume"
        )
    placed = [(key, at) for key, ds in slices if (at := _along_normal(ds)) is not None]
    if 0 < len(placed) < len(slices):
        unplaced = next(key for key, ds in slices if _along_normal(ds) is None)
        raise DecodeError(
            f"{unplaced} gives no slice position (ImagePositionPatient, ImageOrientationPatient) "
            f"where {placed[0][0]} does: it cannot be put in its place in the volume"
        )
    for (key, here), (other, there) in itertools.pairwise(placed):
        if abs(here - there) < _SAME_MM:
            raise DecodeError(
                f"{key} and {other} are at one position ({here:g} mm along the slice normal): "
                "a series of several volumes (echoes, time points) does not stack as one; "
                "decode it with your own function"
            )


_SAME_MM = 1e-4  # slice positions closer than this are one position


def _position(ds: Any, key: str) -> tuple[float, float, str]:
    """Sort key of a slice: distance along the slice normal, instance number, then its key."""
    instance = float(getattr(ds, "InstanceNumber", 0) or 0)
    return (_along_normal(ds) or 0.0, instance, key)


def _along_normal(ds: Any) -> float | None:
    """The slice's distance along its normal, or None when its position is not given."""
    orientation = _orientation(ds)
    try:
        origin = np.asarray(ds.ImagePositionPatient, dtype=np.float64)
    except (AttributeError, ValueError, TypeError):
        return None
    if orientation is None or origin.shape != (3,):
        return None
    return float(origin @ np.cross(orientation[:3], orientation[3:]))


def _orientation(ds: Any) -> np.ndarray | None:
    """The slice's row and column directions (6 numbers), or None when not given."""
    try:
        orientation = np.asarray(ds.ImageOrientationPatient, dtype=np.float64)
    except (AttributeError, ValueError, TypeError):
        return None
    return orientation if orientation.shape == (6,) else None
