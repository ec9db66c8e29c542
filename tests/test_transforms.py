"""Transform fingerprints: the cache keys on them, so each must change when the output would
(else the cache serves samples made by the old preprocessing) and stay put when it would not
(else every run, or every worker, recomputes everything)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from fastload import ConfigError
from fastload.transforms import (
    QuantileNormalize,
    Resize,
    channels_first,
    compose,
    fingerprint,
    versioned,
)

PREPROCESS = """
import numpy as np

SIZE = {size}
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
KEEP = {{"jpg", "png"}}

def crop(x):
    return x[:SIZE, :SIZE]

def preprocess(x):
    return (crop(x) - MEAN{shift}) if len(KEEP) else x
"""


def user_module(tmp_path: Path, name: str, **values: object) -> ModuleType:
    """A module of a user's preprocessing, as a file, imported."""
    path = tmp_path / f"{name}.py"
    path.write_text(PREPROCESS.format(**{"size": 224, "shift": "", **values}))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_function_s_fingerprint_follows_the_constants_and_helpers_it_reads(
    tmp_path: Path,
) -> None:
    base = fingerprint(user_module(tmp_path, "base").preprocess)
    assert fingerprint(user_module(tmp_path, "same").preprocess) == base
    assert fingerprint(user_module(tmp_path, "size", size=256).preprocess) != base  # a constant
    helper = user_module(tmp_path, "helper")
    before = fingerprint(helper.preprocess)
    helper.MEAN = helper.MEAN + np.float32(0.01)  # an array it reads
    assert fingerprint(helper.preprocess) != before
    helper.MEAN = helper.MEAN - np.float32(0.01)
    exec("def crop(x):\n    return x[:SIZE - 1, :SIZE - 1]\n", helper.__dict__)  # the helper
    assert fingerprint(helper.preprocess) != before
    assert fingerprint(user_module(tmp_path, "own", shift=" * 2").preprocess) != base


def test_a_fingerprint_is_the_same_in_every_process(tmp_path: Path) -> None:
    """A set's order (string hashing) changes from process to process: a fingerprint that
    followed it would make every run, and every worker, miss the cache."""
    user_module(tmp_path, "stable")
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import stable
        from fastload.transforms import fingerprint
        print(fingerprint(stable.preprocess))
        """
    )
    prints = {
        subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
        ).stdout
        for seed in (1, 2, 3)
    }
    assert len(prints) == 1 and next(iter(prints)).strip()


LOOP: list[object] = []
LOOP.append(LOOP)  # a container holding itself is not a constant: left out, no hang


def reads_loop(x: object) -> object:
    return x if LOOP else None


def lookup(table: np.ndarray) -> Callable[[int], object]:
    return lambda i: table[i]


class Model:
    def __call__(self, x: object) -> object:
        return x


def test_a_closure_is_followed_by_value_or_refused() -> None:
    table = np.zeros(10_000, np.float32)
    changed = table.copy()
    changed[5_000] = 1  # inside what the array's repr elides
    assert fingerprint(lookup(table)) == fingerprint(lookup(table.copy()))
    assert fingerprint(lookup(changed)) != fingerprint(lookup(table))
    model = Model()

    def predict(x: object) -> object:
        return model(x)

    with pytest.raises(ConfigError, match=r"holds model=Model .*@fastload\.transforms\.versioned"):
        fingerprint(predict)


def test_what_a_fingerprint_cannot_follow() -> None:
    assert fingerprint(reads_loop) == fingerprint(reads_loop)
    versioned_helper = versioned(3)(lambda x: x)
    assert versioned_helper.fingerprint.endswith(":v3")  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match=r"write @versioned\(1\) .* not @versioned"):

        @versioned  # type: ignore[arg-type]  # the version forgotten: crop became the decorator
        def crop(x: np.ndarray) -> np.ndarray:
            return x[1:]

    with pytest.raises(ConfigError, match="str or int version, got None"):
        versioned(None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cannot fingerprint"):
        fingerprint(np.add.reduce)  # type: ignore[arg-type]


def test_resize_refuses_channels_last_and_channels_first_puts_them_first() -> None:
    """decode="image" gives H x W x C; Resize works on the trailing axes. Together they stretched
    (W, C) into the new size, silently; now that is an error and channels_first is the fix."""
    image = np.stack([np.full((48, 64), 1000 * (c + 1), np.uint16) for c in range(3)], axis=-1)
    with pytest.raises(ConfigError, match=r"last axis of shape \(48, 64, 3\).*channels_first"):
        Resize((32, 32))(image)
    both = compose(channels_first, Resize((32, 32)))
    out = both(image)
    assert out.shape == (3, 32, 32) and [float(out[c].mean()) for c in range(3)] == [
        1000.0,
        2000.0,
        3000.0,
    ]
    tensor = both(torch.from_numpy(image.astype(np.float32)))
    assert isinstance(tensor, torch.Tensor) and tuple(tensor.shape) == (3, 32, 32)
    volume = np.zeros((20, 40, 40), np.float32)  # slices x H x W: no channels, resized as is
    assert Resize((10, 20, 20))(volume).shape == (10, 20, 20)
    assert both.fingerprint != compose(Resize((32, 32))).fingerprint


def test_resize_nearest_keeps_labels_exact_and_their_type() -> None:
    """A segmentation mask resized linearly comes back as float32 with labels blended into
    values no class has (2.5 between classes 2 and 3) and, past 2**24, rounded ids: nearest keeps
    the labels and the dtype, for uint16 and for ids past float32's precision."""
    mask = np.zeros((1, 60, 90), np.uint16)
    mask[:, 20:40, 30:60] = 3
    mask[:, 40:, :] = 2
    linear = Resize((40, 64))(mask)
    assert linear.dtype == np.float32 and not set(np.unique(linear)) <= {0, 2, 3}  # blended
    nearest = Resize((40, 64), mode="nearest")(mask)
    assert nearest.dtype == np.uint16 and nearest.shape == (1, 40, 64)
    assert set(np.unique(nearest).tolist()) == {0, 2, 3}
    assert nearest[0, 20, 32] == 3 and nearest[0, 35, 5] == 2 and nearest[0, 0, 0] == 0
    expected = torch.nn.functional.interpolate(  # torch's nearest-exact, on floats it can take
        torch.from_numpy(mask.astype(np.float32))[None], size=(40, 64), mode="nearest-exact"
    )[0]
    assert np.array_equal(nearest, expected.numpy().astype(np.uint16))
    ids = np.arange(2**24, 2**24 + 27, dtype=np.int64).reshape(3, 3, 3)  # a 3-D id volume
    up = Resize((6, 6, 6), mode="nearest")(torch.from_numpy(ids))
    assert up.dtype == torch.int64 and set(up.unique().tolist()) == set(ids.ravel().tolist())
    assert Resize((4, 4), mode="nearest")(np.ones((8, 8), bool)).dtype == np.bool_
    assert Resize((4, 4)).fingerprint != Resize((4, 4), mode="nearest").fingerprint
    with pytest.raises(ConfigError, match="mode must be"):
        Resize((4, 4), mode="cubic")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"a dict of \['image', 'mask'\]"):
        Resize((4, 4))({"image": mask, "mask": mask})


def test_resize_antialiases_a_shrink_of_images_and_volumes() -> None:
    """A 16-bit image of thin bright lines (one row in 8) shrunk 4x: plain bilinear samples
    between rows that are all dark and returns black, losing the lines and the image's mean;
    the default antialias averages what each output pixel covers, as torchvision and PIL do.
    A volume's depth axis is antialiased too, and growing matches torch's trilinear."""
    image = np.zeros((1, 64, 64), np.uint16)
    image[:, 3::8, :] = 60000
    assert float(Resize((16, 16), antialias=False)(image).max()) == 0.0  # the lines are gone
    shrunk = Resize((16, 16))(image)
    assert float(shrunk.min()) > 5000  # every output row covers some of a line
    assert float(shrunk.mean()) == pytest.approx(float(image.mean()), rel=0.02)  # 7,500
    volume = np.zeros((64, 8, 8), np.float32)
    volume[3::8] = 1.0  # one bright slice in 8
    assert float(Resize((16, 8, 8), antialias=False)(volume).max()) == 0.0
    assert float(Resize((16, 8, 8))(volume).mean()) == pytest.approx(0.125, rel=0.02)
    small = torch.rand(2, 5, 7, 9)
    grown = Resize((10, 14, 18))(small)
    expected = torch.nn.functional.interpolate(small[None], (10, 14, 18), mode="trilinear")[0]
    assert torch.allclose(grown, expected, atol=1e-6)
    assert Resize((4, 4)).fingerprint != Resize((4, 4), antialias=False).fingerprint
    with pytest.raises(ConfigError, match=r"each axis, e\.g\. \(224, 224\).*shorter side"):
        Resize(224)  # type: ignore[arg-type]  # torchvision's meaning, refused with the why
    assert Resize([16, 16]).size == (16, 16)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="antialias must be a bool"):
        Resize((4, 4), antialias="yes")  # type: ignore[arg-type]


def test_quantile_normalize_leaves_a_masked_background_out() -> None:
    """A volume whose background is NaN (skull-stripped, masked): np.percentile gave NaN
    percentiles, so every voxel came out NaN. The NaNs are now left out of the estimate and
    stay NaN; a volume without NaN is normalised exactly as before."""
    volume = np.random.default_rng(0).normal(100, 20, (16, 64, 64)).astype(np.float32)
    low, high = np.percentile(volume[:, ::4, ::4], [0.5, 99.5])  # 16 slices: all of them
    plain = QuantileNormalize()(volume)
    np.testing.assert_allclose(plain, np.clip((volume - low) / (high - low), 0, 1), atol=1e-6)
    masked = volume.copy()
    masked[:, :8] = np.nan
    out = QuantileNormalize()(masked)
    assert np.isnan(out[:, :8]).all() and np.isfinite(out[:, 8:]).all()
    assert float(out[:, 8:].min()) == 0.0 and float(out[:, 8:].max()) == 1.0


def test_quantile_normalize_a_region_the_stride_misses_is_not_turned_to_nan() -> None:
    """A masked volume whose only valid voxels lie between the strided ones (3 of 64 slices,
    none a multiple of 4): the estimate found no finite value and every valid voxel came out
    NaN, with only numpy's warning. It is now taken on every element."""
    rng = np.random.default_rng(1)
    volume = np.full((64, 32, 32), np.nan, np.float32)
    volume[1:4, 5:30, 5:30] = rng.normal(100, 20, (3, 25, 25))
    valid = volume[1:4, 5:30, 5:30]
    low, high = np.percentile(valid, [0.5, 99.5])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "All-NaN slice" either
        out = QuantileNormalize()(volume)
    np.testing.assert_allclose(
        out[1:4, 5:30, 5:30], np.clip((valid - low) / (high - low), 0, 1), atol=1e-6
    )
    assert np.isnan(np.delete(out, np.s_[1:4], axis=0)).all()


def test_quantile_normalize_leaves_infinities_out_of_the_estimate() -> None:
    """Two +inf voxels among the 256 strided ones (0.8%, above the 99.5th percentile) made the
    high percentile infinite and every finite voxel 0.0. Infinities now sit past the ends."""
    volume = np.random.default_rng(2).normal(100, 20, (64, 64, 1)).astype(np.float32)
    volume[0, 0, 0] = volume[0, 4, 0] = np.inf
    volume[0, 8, 0] = -np.inf
    probe = volume[::4, ::4]
    low, high = np.percentile(probe[np.isfinite(probe)], [0.5, 99.5])
    out = QuantileNormalize()(volume)
    finite = np.isfinite(volume)
    np.testing.assert_allclose(
        out[finite], np.clip((volume[finite] - low) / (high - low), 0, 1), atol=1e-6
    )
    assert out[0, 0, 0] == 1.0 and out[0, 8, 0] == 0.0
    unclipped = QuantileNormalize(clip=False)(volume)
    assert unclipped[0, 0, 0] == np.inf and unclipped[0, 8, 0] == -np.inf
    with pytest.raises(ConfigError, match="clip must be a bool, got 'no'"):
        QuantileNormalize(clip="no")  # type: ignore[arg-type]  # it clipped: "no" is truthy
    with pytest.raises(ConfigError, match="low must be a number, got '1'"):
        QuantileNormalize(low="1")  # type: ignore[arg-type]  # a TypeError comparing it
    assert QuantileNormalize(np.float32(1), np.int64(99)).high == 99


def test_quantile_normalize_estimates_on_every_channel_and_thin_slice() -> None:
    """A stride of 4 over a short axis read only every 4th channel: a 5-channel field's
    percentiles came from channels 0 and 4, and the brighter channel 2 was clipped to 1.0 in
    every pixel. A short axis is now read whole (its long axes still strided), and an image's
    trailing channels too. A sample this changes is made again: the fingerprint changed."""
    rng = np.random.default_rng(3)
    field = rng.normal(1_000, 50, (5, 256, 256)).astype(np.float32)
    field[2] += 20_000  # one bright channel
    low, high = np.percentile(field[:, ::4, ::4], [0.5, 99.5])
    out = QuantileNormalize()(field)
    np.testing.assert_allclose(out, np.clip((field - low) / (high - low), 0, 1), atol=1e-6)
    assert float((out[2] == 1.0).mean()) < 0.05  # it was all 1.0
    image = rng.integers(0, 2**16, (128, 128, 3), dtype=np.uint16)
    image[..., 1] //= 64  # a dim channel, the one a stride of 4 left alone in the estimate
    low, high = np.percentile(image[::4, ::4, :], [0.5, 99.5])
    np.testing.assert_allclose(
        QuantileNormalize()(image), np.clip((image - low) / (high - low), 0, 1), atol=1e-6
    )
    small = np.arange(16, dtype=np.int8).reshape(4, 4)  # strided: one element, all came out 0
    assert float(QuantileNormalize()(small).max()) == 1.0
    assert QuantileNormalize().fingerprint.endswith("/2")  # samples cached before: made again


def test_quantile_normalize_with_nothing_to_spread() -> None:
    """No finite element: NaN stays NaN (no warning); a constant volume maps to 0."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        empty = QuantileNormalize()(np.full((8, 8), np.nan, np.float32))
        constant = QuantileNormalize()(torch.full((8, 8), 7, dtype=torch.int16))
    assert np.isnan(empty).all()
    assert isinstance(constant, torch.Tensor) and constant.dtype == torch.float32
    assert not constant.any()
