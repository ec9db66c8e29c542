"""The public surface: exports, typing marker, the exception tree, missing extras."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

import fastload
from fastload import errors
from fastload._extras import import_extra


def test_all_is_sorted_and_complete() -> None:
    public = {
        name
        for name, value in vars(fastload).items()
        if not name.startswith("_") and not isinstance(value, type(fastload))
    } - {"annotations"}
    assert fastload.__all__ == sorted(fastload.__all__)
    assert public | {"__version__"} == set(fastload.__all__)


def test_py_typed_marker_ships() -> None:
    assert (Path(fastload.__file__).parent / "py.typed").is_file()


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [
        (errors.ObjectNotFoundError, FileNotFoundError),
        (errors.AccessDeniedError, PermissionError),
        (errors.TransientStoreError, ConnectionError),
        (errors.ConfigError, ValueError),
        (errors.MissingExtraError, ImportError),
        (errors.StoreError, OSError),
        (errors.ServerStartError, RuntimeError),
    ],
)
def test_each_error_is_also_the_matching_builtin(cls: type, builtin: type) -> None:
    assert issubclass(cls, errors.FastloadError)
    assert issubclass(cls, builtin)


def test_store_error_names_the_url_and_survives_pickling() -> None:
    error = errors.ObjectNotFoundError("no such object", url="s3://bucket/key.npy")
    assert "s3://bucket/key.npy" in str(error)
    clone = pickle.loads(pickle.dumps(error))
    assert type(clone) is errors.ObjectNotFoundError
    assert clone.url == "s3://bucket/key.npy"
    assert str(clone) == str(error)


def test_missing_extra_names_the_extra_to_install() -> None:
    with pytest.raises(errors.MissingExtraError, match=r"pip install 'fastload\[s3\]'") as info:
        import_extra("fastload_no_such_module", extra="s3", feature="s3:// URLs")
    assert info.value.extra == "s3"
    assert isinstance(info.value.__cause__, ImportError)
