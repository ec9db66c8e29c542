"""Each extra, installed alone beside fastload, does what its row in the README says.

No new environments: for each extra, the closure of distributions that fastload and that extra
really pull in (requirements read from pyproject.toml, then from each installed distribution's
metadata, markers evaluated) is computed, and the extra's smoke runs in a child process where
every other installed distribution is absent (tests/_extra_smokes.py, fastload.testing.absent):
its modules are not found and importlib.metadata does not list it. The loopback servers run in
their own processes, with everything installed.

An import name that two distributions share (``google``) is absent only when neither is in
the closure.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import uuid
from collections.abc import Iterable
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from packaging.requirements import Requirement

from fastload._extras import import_extra
from fastload.errors import MissingExtraError
from fastload.testing.absent import canonical
from tests.conftest import BUCKET, write

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
FEATURES = ("s3", "gcs", "b2", "zarr", "cli", "image", "tiff", "dicom", "parquet")
"""The extras that are features; not dev, testing, frameworks, all (collections) or xla
(its own environment)."""


@cache
def project() -> dict[str, Any]:
    with open(ROOT / "pyproject.toml", "rb") as file:
        table: dict[str, Any] = tomllib.load(file)["project"]
    return table


def requirements(extra: str | None) -> list[Requirement]:
    """fastload's requirements (``extra`` None) or its extra's, as pyproject.toml declares."""
    lines = (
        project()["dependencies"] if extra is None else project()["optional-dependencies"][extra]
    )
    return [Requirement(line) for line in lines]


def required(requirement: Requirement, extras: Iterable[str]) -> bool:
    """Whether ``requirement`` (of a distribution installed with ``extras``) applies here."""
    marker = requirement.marker
    return marker is None or any(marker.evaluate({"extra": e}) for e in ("", *extras))


def closure(extra: str | None) -> set[str]:
    """Canonical names of the distributions fastload with ``extra`` installs (and fastload)."""
    found: set[str] = {"fastload"}
    todo: list[tuple[Requirement, frozenset[str]]] = [
        *((r, frozenset()) for r in requirements(None)),
        *((r, frozenset()) for r in (requirements(extra) if extra else [])),
    ]
    asked: set[tuple[str, frozenset[str]]] = set()
    while todo:
        requirement, extras = todo.pop()
        if not required(requirement, extras):
            continue
        name, wanted = canonical(requirement.name), frozenset(requirement.extras)
        if (name, wanted) in asked:
            continue
        asked.add((name, wanted))
        found.add(name)
        if name == "fastload":
            todo += [(r, frozenset()) for e in sorted(wanted) for r in requirements(e)]
            continue
        try:
            declared = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            pytest.fail(f"{name} ({requirement}) is required but not installed: run make env")
        todo += [(Requirement(line), wanted) for line in declared]
    return found


def absent(extra: str | None) -> tuple[list[str], list[str]]:
    """Top-level import names and distributions outside ``extra``'s closure."""
    kept = closure(extra)
    modules = sorted(
        module
        for module, owners in metadata.packages_distributions().items()
        if not any(canonical(owner) in kept for owner in owners)
    )
    installed = {canonical(d.metadata["Name"]) for d in metadata.distributions()}
    return modules, sorted(installed - kept)


def smoke(extra: str | None, name: str, args: dict[str, Any], tmp_path: Path) -> Any:
    """The result of smoke ``name`` in a child that has only fastload and ``extra``'s
    closure; its failure shows the child's stderr."""
    modules, distributions = absent(extra)
    out = tmp_path / f"smoke-{uuid.uuid4().hex[:8]}.json"
    job = {
        "smoke": name,
        "absent": modules,
        "absent_distributions": distributions,
        "args": args,
        "out": str(out),
    }
    spec = tmp_path / f"{out.stem}-job.json"
    spec.write_text(json.dumps(job))
    done = subprocess.run(
        [sys.executable, "-m", "tests._extra_smokes", str(spec)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, f"fastload[{extra}] alone:\n{done.stderr[-4000:]}"
    assert "Traceback" not in done.stderr, done.stderr
    return json.loads(out.read_text())


def npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def as_stored(array: np.ndarray) -> dict[str, Any]:
    return {"dtype": str(array.dtype), "shape": list(array.shape), "values": array.tolist()}


def test_the_closure_follows_extras_and_markers() -> None:
    """The computation the smokes stand on: fastload's own requirements and a requirement's
    extras are followed, and a test-only package is outside every feature's closure."""
    base = closure(None)
    assert {"fastload", "torch", "numpy", "fsspec", "crc32c"} <= base
    assert "aiohttp" not in base and "pytest" not in base
    gcs = closure("gcs")
    assert {"gcsfs", "google-cloud-storage", "aiohttp"} <= gcs and base < gcs
    modules, distributions = absent("s3")
    assert "moto" in modules and "moto" in distributions and "s3fs" not in modules
    assert "pytest" in modules and "torch" not in modules


@pytest.mark.parametrize(
    ("extra", "server", "scheme"),
    [("s3", "seaweed", "s3"), ("gcs", "gcs", "gs"), ("b2", "b2", "b2")],
)
def test_a_store_extra_alone_lists_and_reads(
    extra: str, server: str, scheme: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    options = request.getfixturevalue(server).storage_options()
    root = f"{scheme}://{BUCKET}/extras-{uuid.uuid4().hex[:8]}"
    arrays = {f"a/{i}.npy": np.arange(i, i + 3, dtype=np.int32) for i in range(2)}
    write(root, options, {key: npy(array) for key, array in arrays.items()})
    result = smoke(extra, "read_and_list", {"root": f"{root}/a", "options": options}, tmp_path)
    assert result["urls"] == [f"{root}/{key}" for key in arrays]
    assert result["samples"] == [as_stored(array) for array in arrays.values()]


def test_the_zarr_extra_alone_caches(tmp_path: Path) -> None:
    result = smoke("zarr", "zarr_cache", {"root": str(tmp_path / "cache")}, tmp_path)
    assert result == as_stored(np.arange(12, dtype=np.int16).reshape(3, 4))


def test_the_cli_extra_alone_helps_and_lists(tmp_path: Path) -> None:
    folder = tmp_path / "objects"
    folder.mkdir()
    (folder / "x.bin").write_bytes(b"12345")
    result = smoke("cli", "cli", {"root": f"file://{folder}"}, tmp_path)
    assert result == {"help": 0, "ls": 0}


def png16(array: np.ndarray) -> bytes:
    import png

    height, width, channels = array.shape
    out = io.BytesIO()
    writer = png.Writer(width, height, greyscale=False, alpha=channels == 4, bitdepth=16)
    writer.write(out, array.reshape(height, width * channels).tolist())
    return out.getvalue()


def png8(array: np.ndarray) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG")
    return out.getvalue()


def tiff(array: np.ndarray) -> bytes:
    import tifffile

    out = io.BytesIO()
    tifffile.imwrite(out, array)
    return out.getvalue()


def dicom(array: np.ndarray) -> bytes:
    from fastload.testing.dicom import ct_slice

    return ct_slice(array, z=0.0, instance=1)


def parquet(_: np.ndarray) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = io.BytesIO()
    pq.write_table(pa.table({"id": [7, 8], "energy": [0.5, 1.5]}), out)
    return out.getvalue()


RGB16 = np.arange(2 * 3 * 3, dtype=np.uint16).reshape(2, 3, 3) * 3000
GREY8 = np.arange(6, dtype=np.uint8).reshape(2, 3) * 40
CT = np.arange(12, dtype=np.uint16).reshape(3, 4) * 100
FORMATS = {  # extra: (files, RemoteDataset's arguments and source by name, the samples)
    "image": (
        {"a.png": png16(RGB16), "b.png": png8(GREY8)},
        {"decode": "image"},
        [as_stored(RGB16), as_stored(GREY8[..., np.newaxis])],
    ),
    "tiff": ({"a.tif": tiff(CT)}, {"decode": "tiff"}, [as_stored(CT[..., np.newaxis])]),
    "dicom": (
        {"a.dcm": dicom(CT)},
        {"decode": "dicom"},
        [as_stored(CT.astype(np.float32) - 1024)],
    ),
    "parquet": ({"a.parquet": parquet(CT)}, {"source": "parquet"}, None),
}


@pytest.mark.parametrize("extra", sorted(FORMATS))
def test_a_format_extra_alone_reads_its_files(extra: str, tmp_path: Path) -> None:
    files, arguments, expected = FORMATS[extra]
    folder = tmp_path / "objects"
    folder.mkdir()
    for name, body in files.items():
        (folder / name).write_bytes(body)
    args = {"root": f"file://{folder}", "dataset": arguments}
    result = smoke(extra, "read_decoded", args, tmp_path)
    if expected is None:  # parquet: rows as dicts of their columns
        assert result == [{"id": 7, "energy": 0.5}, {"id": 8, "energy": 1.5}]
    else:
        assert result == expected


def test_every_feature_extra_has_a_smoke() -> None:
    extras = set(project()["optional-dependencies"])
    collections = {"dev", "testing", "frameworks", "all", "xla"}
    assert extras - collections == set(FEATURES)
    assert set(FORMATS) | {"s3", "gcs", "b2", "zarr", "cli"} == set(FEATURES)


def test_the_readme_lists_what_each_extra_installs() -> None:
    """The README's extras table names each feature extra's packages, no more, no fewer."""
    readme = (ROOT / "README.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]*) \|", readme, flags=re.MULTILINE))
    for extra in FEATURES:
        listed = {name.strip() for name in rows[extra].split(",")}
        assert listed == {r.name for r in requirements(extra)}, extra


@pytest.mark.parametrize(
    "body",
    [
        "import fastload_not_installed_anywhere\n",
        "from fastload._extras import import_extra\n"
        "import_extra('fastload_not_installed_anywhere', extra='b2', feature='b2:// URLs')\n",
    ],
    ids=["an import", "an import_extra"],
)
def test_a_missing_extra_names_the_import_that_failed(
    body: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module of the extra's that is there but imports one that is not: the error names
    the one that is not (as fastload.stores.b2 importing aiohttp or b2sdk), and the extra."""
    name = f"fastload_extra_probe_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(MissingExtraError) as caught:
        import_extra(name, extra="b2", feature="b2:// URLs")
    message = str(caught.value)
    assert "'fastload_not_installed_anywhere'" in message and name not in message
    assert "pip install 'fastload[b2]'" in message
    assert caught.value.module == "fastload_not_installed_anywhere"
