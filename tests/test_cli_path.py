"""One dataset definition from the training script to ``fastload warm-cache`` and back: what the
command warms is what training reads (the same cache names, the same saved listing, every
decoder the API takes), and its failures stop it early or, under ``--on-error skip``, do not
stop the ``warm-cache ... && torchrun train.py`` that follows it."""

from __future__ import annotations

import functools
import importlib
import json
import os
import runpy
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import fastload as package
from fastload import Cache, ConfigError, FetchConfig, Groups, RemoteDataset, TransientStoreError
from fastload.stores import filesystem
from fastload.testing import FaultProxy, Faults, S3Server
from fastload.testing.dicom import ct_slice
from tests.conftest import BUCKET, write
from tests.test_cli import fastload, options_args
from tests.test_dataset import upload

SRC = str(Path(package.__file__).resolve().parents[1])  # the fastload these tests import

PREP = """
import json
import sys

import numpy as np

import fastload


@fastload.versioned(1)
def stack_channels(x):
    return np.stack([x, x + 1])


if __name__ == "__main__":
    root, cache_dir, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    dataset = fastload.RemoteDataset(
        root,
        decode="npy",
        transform=stack_channels,
        cache=fastload.Cache(cache_dir, format="npy"),
        storage_options=options,
    )
    values = [float(dataset[i][1].flat[0]) for i in range(len(dataset))]
    if dataset.listing_check is not None:
        dataset.listing_check.result(timeout=60)
    print(json.dumps({
        "module": stack_channels.__module__,
        "fingerprint": stack_channels.fingerprint,
        "values": values,
        "requests": dataset.counters.fetch.requests,
        "hits": dataset.counters.cache.hits,
    }))
"""

SUBJECTS = 12  # DICOM series, 2 slices each
DICOM_GROUP = r"^(sub-\d+)/"


def test_a_transform_of_the_training_script_names_what_warm_cache_cached(
    seaweed: S3Server,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """#53.1: ``@versioned(1)`` in train.py fingerprinted as ``__main__.stack_channels:v1``
    there and ``train.stack_channels:v1`` when the CLI imported it, so the first epoch after
    ``warm-cache --transform train:stack_channels`` fetched everything again."""
    options = seaweed.storage_options()
    root = upload(f"s3://{BUCKET}/path-{uuid.uuid4().hex[:8]}", options, 12)
    module = f"train_{uuid.uuid4().hex[:8]}"  # a name no other test imported
    script = tmp_path / f"{module}.py"
    script.write_text(PREP)
    monkeypatch.syspath_prepend(str(tmp_path))  # as the CLI finds it beside the user
    cache_dir = str(tmp_path / "c")
    args = [root, "-c", cache_dir, "--transform", f"{module}:stack_channels", "--json"]
    warmed = fastload("warm-cache", *args, *options_args(options))
    assert warmed.returncode == 0, warmed.stderr
    assert json.loads(warmed.stdout)["requests"] == 12
    # `python train.py ...`: the transform is __main__.stack_channels. Run in this process as
    # python runs a script (runpy): a process of its own that read the cache died of SIGBUS
    # at exit in about 1 run in 8, at HEAD too (not what this test is about)
    monkeypatch.setattr(sys, "argv", [str(script), root, cache_dir, json.dumps(options)])
    runpy.run_path(str(script), run_name="__main__")
    read = json.loads(capsys.readouterr().out)
    assert read["module"] == "__main__"
    assert read["values"] == [i + 1.0 for i in range(12)]
    assert (read["requests"], read["hits"]) == (0, 12)  # every sample from the cache
    imported = importlib.import_module(module)
    assert imported.stack_channels.__module__ == module
    assert imported.stack_channels.fingerprint == read["fingerprint"]


def test_a_script_s_versioned_function_is_named_by_the_script_s_module_in_every_process(
    tmp_path: Path,
) -> None:
    """A versioned function of a script run as ``python prep_two.py`` (its functions in
    ``__main__``) is named ``prep_two.prep:v1``, as ``import prep_two`` names it. A set in a
    function's code (``x in {...}``) gave an unversioned function another fingerprint in every
    process (a cache missed every run)."""
    code = textwrap.dedent(
        """
        import fastload

        @fastload.versioned(1)
        def prep(x):
            return x * {factor}

        def picky(name):
            return name in {{"alpha", "beta", "gamma", "delta", "epsilon"}}

        if __name__ == "__main__":
            from fastload.transforms import fingerprint
            print(prep.fingerprint, fingerprint(picky))
        """
    )
    (tmp_path / "prep_two.py").write_text(code.format(factor=2))
    (tmp_path / "prep_three.py").write_text(code.format(factor=3))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, str(tmp_path)])}

    def printed(*args: str, seed: int) -> list[str]:
        done = subprocess.run(
            [sys.executable, *args],
            cwd=tmp_path,
            env={**env, "PYTHONHASHSEED": str(seed)},
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        return done.stdout.split()

    as_script = printed("prep_two.py", seed=1)  # __main__.prep
    as_module = printed(
        "-c",
        "import prep_two; from fastload.transforms import fingerprint; "
        "print(prep_two.prep.fingerprint, fingerprint(prep_two.picky))",
        seed=2,
    )
    assert as_script == as_module
    assert as_script[0] == "prep_two.prep:v1"
    other = printed("prep_three.py", seed=1)  # the same function in another module
    assert other[0] == "prep_three.prep:v1" and other[1] == as_script[1]
    as_package = printed("-m", "prep_two", seed=3)  # python -m: __spec__ names the module
    assert as_package == as_script


def test_versioned_refuses_objects_whose_parameters_a_name_cannot_tell_apart() -> None:
    with pytest.raises(ConfigError, match="marks functions, not partial"):
        package.versioned(1)(functools.partial(np.clip, a_min=0, a_max=1))
    with pytest.raises(ConfigError, match="marks functions, not Resize"):
        package.versioned(1)(package.Resize((8, 8)))


def test_warm_cache_saves_the_listing_training_starts_from(
    seaweed: S3Server, tmp_path: Path
) -> None:
    """#53.2: the training start after ``warm-cache`` listed the bucket again (5.5 minutes at
    every start in the user's B2 bucket). warm-cache saves its listing where
    ``RemoteDataset(url, cache=...)`` looks, so that start lists nothing: here every listing
    stalls past the timeout, and the start still comes up and reads everything from the cache
    (only the listing check in the background meets the stall)."""
    root = upload(f"s3://{BUCKET}/listing-{uuid.uuid4().hex[:8]}", seaweed.storage_options(), 20)
    cache_dir = tmp_path / "c"
    with FaultProxy(seaweed.endpoint, flavor="s3") as proxy:
        options = seaweed.storage_options(proxy.endpoint)
        warmed = fastload("warm-cache", root, "-c", str(cache_dir), *options_args(options))
        assert warmed.returncode == 0, warmed.stderr
        proxy.set_faults(Faults(stall=1.0, stall_seconds=8.0, methods=("GET",)))
        proxy.reset_counters()
        dataset = RemoteDataset(
            root,
            decode="npy",
            cache=Cache(cache_dir, format="npy"),
            storage_options=options,
            fetch_config=FetchConfig(timeout=2.0, retries=0, outage_budget=0),
        )
        assert len(dataset) == 20 and dataset.listing_check is not None  # the saved listing
        assert [int(dataset[i].flat[0]) for i in range(20)] == list(range(20))
        assert dataset.counters.fetch.requests == 0
        with pytest.raises(TransientStoreError):
            dataset.listing_check.result(timeout=60)
        assert proxy.counters()["requests"] == proxy.counters()["stall"] == 1  # that check


def dicom_series(root: str, options: dict[str, Any]) -> None:
    """``SUBJECTS`` series of 2 CT slices each, ``sub-NN/IM000k.dcm``; subject n's stored
    pixels are all n (Hounsfield units n - 1024)."""
    write(
        root,
        options,
        {
            f"sub-{n:02d}/IM{k:04d}.dcm": ct_slice(
                np.full((6, 7), n, np.uint16), z=2.5 * k, instance=k + 1
            )
            for n in range(SUBJECTS)
            for k in range(2)
        },
    )


@pytest.fixture
def dicom_root(seaweed: S3Server) -> tuple[str, dict[str, Any]]:
    options = seaweed.storage_options()
    root = f"s3://{BUCKET}/dicom-{uuid.uuid4().hex[:8]}"
    dicom_series(root, options)
    return root, options


@pytest.mark.parametrize(
    ("cli", "api"),
    [
        ("dicom-series", "dicom-series"),  # a group decoder: "unknown decoder" before
        ("*.dcm=dicom", {"*.dcm": "dicom"}),  # each member by pattern
        ("none", None),  # the members as read
    ],
)
def test_warm_cache_takes_every_decoder_training_takes(
    dicom_root: tuple[str, dict[str, Any]], tmp_path: Path, cli: str, api: Any
) -> None:
    """#53.3: ``--group-by ... --decode dicom-series`` was refused ("unknown decoder"), and a
    mapping or no decoding could not be asked for: whatever ``decode=`` training passes,
    ``--decode`` warms the samples it reads."""
    root, options = dicom_root
    cache_dir = tmp_path / "c"
    args = ["warm-cache", root, "-c", str(cache_dir), "--group-by", DICOM_GROUP, "--json"]
    warmed = fastload(*args, "--decode", cli, *options_args(options))
    assert warmed.returncode == 0, warmed.stderr
    assert json.loads(warmed.stdout)["samples"] == SUBJECTS
    dataset = RemoteDataset(
        Groups(root, DICOM_GROUP),
        decode=api,
        cache=Cache(cache_dir, format="npy"),
        storage_options=options,
    )
    samples = [dataset[i] for i in range(SUBJECTS)]
    assert dataset.counters.fetch.requests == 0 and dataset.counters.cache.hits == SUBJECTS
    if cli == "dicom-series":
        assert [float(s[0, 0, 0]) for s in samples] == [n - 1024.0 for n in range(SUBJECTS)]
        assert samples[0].shape == (2, 6, 7)


def test_a_decoder_that_fits_no_sample_stops_early_with_one_message(
    dicom_root: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    """#53.3: without ``--decode`` (npy) a DICOM dataset was fetched whole, then reported as
    one identical failure per sample. Now its first samples, warmed alone, all fail alike and
    the command stops there, saying so, under ``--on-error skip`` too (no sample is bad: the
    command is). A decoder only a group takes, without ``--group-by``, is a usage error."""
    root, options = dicom_root
    args = ["warm-cache", root, "-c", str(tmp_path / "c"), "--group-by", DICOM_GROUP]
    for policy in ("raise", "skip"):
        done = fastload(*args, "--on-error", policy, "--json", *options_args(options))
        report = json.loads(done.stdout)
        assert done.returncode == 1, done.stderr
        assert report["samples"] == 8 and report["requests"] == 16  # of 12 groups, 24 objects
        assert report["stopped"].startswith("the first 8 samples all failed with DecodeError")
        assert f"{root}/sub-00" in report["stopped"]
    human = fastload(*args, *options_args(options))
    assert human.returncode == 1
    stopped = [line for line in human.stdout.splitlines() if line.startswith("stopped:")]
    assert len(stopped) == 1 and "check --decode (here: npy)" in stopped[0]
    assert "failed:" not in human.stdout  # one message, not one line per sample
    alone = fastload("warm-cache", root, "-c", str(tmp_path / "c"), "--decode", "dicom-series")
    assert alone.returncode == 2
    assert "dicom-series decodes a whole group of objects: it needs --group-by" in alone.stderr


def test_a_corrupt_object_under_skip_is_named_and_the_command_succeeds(
    seaweed: S3Server, tmp_path: Path
) -> None:
    """#53.3: one corrupt object made ``warm-cache --on-error skip`` exit 1, so
    ``fastload warm-cache ... && torchrun train.py`` never trained (training itself skips it).
    Under skip it exits 0 and names the object it skipped; under raise it exits 1."""
    options = seaweed.storage_options()
    root = upload(f"s3://{BUCKET}/skip-{uuid.uuid4().hex[:8]}", options, 12)
    filesystem(root, options).pipe(f"{root.split('://')[1]}/0003.npy", b"not an array")
    args = ["warm-cache", root, "-c", str(tmp_path / "c"), *options_args(options)]
    skipped = fastload(*args, "--on-error", "skip")
    assert skipped.returncode == 0, skipped.stdout + skipped.stderr
    named = [line for line in skipped.stdout.splitlines() if f"{root}/0003.npy" in line]
    assert len(named) == 1 and named[0].startswith("skipped (--on-error skip): ")
    assert "DecodeError" in named[0]
    raised = fastload(*args, "--json")
    assert raised.returncode == 1
    assert list(json.loads(raised.stdout)["failures"]) == [f"{root}/0003.npy"]
