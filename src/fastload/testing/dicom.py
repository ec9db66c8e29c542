"""DICOM files shaped like a scanner's, for tests and benchmarks (needs ``fastload[dicom]``)."""

from __future__ import annotations

import io

import numpy as np

from fastload._extras import import_extra

__all__ = ["ct_slice"]


def ct_slice(
    value: np.ndarray,
    *,
    z: float,
    instance: int,
    slope: float = 1.0,
    intercept: float = -1024.0,
    series: str | None = None,
    orientation: tuple[float, ...] = (1, 0, 0, 0, 1, 0),
) -> bytes:
    """One CT slice: 16-bit stored ``value`` at height ``z`` (axial orientation), with a
    rescale ``slope`` and ``intercept`` (modality units = stored * slope + intercept), in the
    series whose SeriesInstanceUID is ``series`` (none when None), facing ``orientation``
    (ImageOrientationPatient: axial by default)."""
    dataset = import_extra("pydicom.dataset", extra="dicom", feature="fastload.testing.ct_slice")
    uid = import_extra("pydicom.uid", extra="dicom", feature="fastload.testing.ct_slice")
    meta = dataset.FileMetaDataset()
    meta.MediaStorageSOPClassUID = uid.CTImageStorage
    meta.MediaStorageSOPInstanceUID = uid.generate_uid()
    meta.TransferSyntaxUID = uid.ExplicitVRLittleEndian
    ds = dataset.FileDataset("slice", {}, file_meta=meta, preamble=b"\0" * 128)
    ds.SOPClassUID, ds.SOPInstanceUID = uid.CTImageStorage, meta.MediaStorageSOPInstanceUID
    ds.Modality, ds.InstanceNumber = "CT", instance
    if series is not None:
        ds.SeriesInstanceUID = series
    ds.ImageOrientationPatient = list(orientation)
    ds.ImagePositionPatient = [0.0, 0.0, z]
    ds.Rows, ds.Columns = value.shape
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 0
    ds.RescaleSlope, ds.RescaleIntercept = slope, intercept
    ds.PixelData = value.astype(np.uint16).tobytes()
    out = io.BytesIO()
    ds.save_as(out, enforce_file_format=True)
    return out.getvalue()
