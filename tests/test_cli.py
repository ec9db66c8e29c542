"""The ``fastload`` command against the loopback stores: in this process, and as the installed
console script in a fresh process where signals, the environment or imports are tested."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fastload import Cache
from fastload._cli import main
from fastload.stores import filesystem
from fastload.testing import B2Server, FakeGcsServer, FaultProxy, Faults, S3Server
from tests.cache_helpers import segments_of
from tests.conftest import BUCKET
from tests.test_dataset import upload

REPO = Path(__file__).resolve().parents[1]
SCRIPT = shutil.which("fastload", path=str(Path(sys.executable).parent)) or "fastload"


def options_args(options: dict[str, Any]) -> list[str]:
    return [arg for key, value in options.items() for arg in ("-o", f"{key}={json.dumps(value)}")]


def fastload(*args: str, real: bool = False) -> subprocess.CompletedProcess[str]:
    """The command's exit code, stdout and stderr: run in this process (what the console
    script runs: ``fastload._cli.main``), or with ``real`` as the installed script in a fresh
    process (where imports, the environment or the process itself are what is tested)."""
    if real:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
        return subprocess.run(
            [SCRIPT, *args], capture_output=True, text=True, timeout=180, env=env, cwd=REPO,
            check=False,
        )  # fmt: skip
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess([SCRIPT, *args], code, out.getvalue(), err.getvalue())


def entries(cache_dir: Path) -> int:
    """Entries in an npy cache another process may be filling."""
    if not (cache_dir / "fastload-cache.json").exists():
        return 0
    return len(Cache(cache_dir, format="npy", read_only=True))


def warm_json(*args: str) -> tuple[int, dict[str, Any]]:
    done = fastload("warm-cache", *args, "--json")
    return done.returncode, json.loads(done.stdout)


@pytest.fixture
def s3_objects(seaweed: S3Server) -> tuple[str, dict[str, Any]]:
    options = seaweed.storage_options()
    return upload(f"s3://{BUCKET}/cli-{uuid.uuid4().hex[:8]}", options, 40), options


@pytest.fixture
def slow_proxy(seaweed: S3Server) -> Iterator[FaultProxy]:
    with FaultProxy(seaweed.endpoint, flavor="s3", faults=Faults(latency=0.15)) as proxy:
        yield proxy


def test_warm_then_rerun_skips_everything(
    s3_objects: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    root, options = s3_objects
    args = [root, "--cache-dir", str(tmp_path / "c"), "--format", "npy", *options_args(options)]
    code, first = warm_json(*args, "--cost-per-1k-requests", "0.4", "--cost-per-gb", "0.01")
    assert code == 0 and first["samples"] == 40 and first["failures"] == {}
    assert first["requests"] == 40 and first["bytes_fetched"] > 40 * 80
    expected = 40 / 1000 * 0.4 + first["bytes_fetched"] / 1e9 * 0.01
    assert first["estimated_cost"] == pytest.approx(expected, abs=1e-6)
    code, second = warm_json(*args)
    assert code == 0 and second["hits"] == 40 and second["requests"] == 0
    human = fastload("warm-cache", *args)
    assert human.returncode == 0 and "40 samples (40 already cached)" in human.stdout


def test_a_budget_smaller_than_the_dataset_says_what_it_evicted(
    seaweed: S3Server, tmp_path: Path
) -> None:
    """`--max-bytes` below the dataset: the warm succeeds (exit 0) and its summary counts the
    samples warmed but evicted by the budget (all that the cache does not hold at the end),
    warning that training fetches them again (it said nothing: 600 samples warmed, 88 KB
    kept). A budget that holds them all counts none and warns of nothing."""
    options = seaweed.storage_options()
    n = 120  # 120 samples of 4 KB: 480 KB under a budget of 64 KB
    root = upload(f"s3://{BUCKET}/budget-{uuid.uuid4().hex[:8]}", options, n, shape=(32, 32))
    args = [root, "--format", "npy", "--max-bytes", "64KB", *options_args(options)]
    done = fastload("warm-cache", *args, "--cache-dir", str(tmp_path / "j"), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    kept = len(Cache(tmp_path / "j", format="npy", read_only=True))
    assert report["samples"] == n and report["failures"] == {} and 0 < kept < n // 4
    assert report["evicted"] == n - kept
    said = f"{n - kept:,} of the samples warmed are not in the cache"
    assert said in done.stderr and "Training will fetch and make them again" in done.stderr
    human = fastload("warm-cache", *args, "--cache-dir", str(tmp_path / "h"))
    assert human.returncode == 0, human.stderr
    kept = len(Cache(tmp_path / "h", format="npy", read_only=True))
    assert f"warning: {n - kept:,} of the samples warmed are not in the cache" in human.stdout
    roomy = [root, "--format", "npy", "--max-bytes", "10MB", *options_args(options), "--json"]
    done = fastload("warm-cache", *roomy, "--cache-dir", str(tmp_path / "r"))
    assert done.returncode == 0 and json.loads(done.stdout)["evicted"] == 0
    assert "not in the cache" not in done.stderr


def test_a_budget_evicting_earlier_groups_of_tar_shards_counts_them(
    seaweed: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tar shards warmed a group at a time under a small budget: a later group's writes evict
    an earlier group's samples, and the summary counts those too (each group's count at its
    own end would miss them)."""
    from tests.test_shards import PER_SHARD, SHARDS, tar_dataset

    options = seaweed.storage_options()
    root = f"s3://{BUCKET}/budget-tar-{uuid.uuid4().hex[:8]}"
    shards = [len(b) for k, b in tar_dataset(root, options).items() if k.endswith(".tar")]
    monkeypatch.setenv("FASTLOAD_CHUNK_MEMORY_BYTES", str(int(2.5 * max(shards))))  # 1 a group
    args = [f"{root}/train", "--shards", "tar", "--format", "npy", "--max-bytes", "64KB"]
    code, report = warm_json(*args, "--cache-dir", str(tmp_path), *options_args(options))
    assert code == 0 and report["failures"] == {}
    assert report["requests"] == SHARDS  # warmed in groups: each shard read once
    kept = len(Cache(tmp_path, format="npy", read_only=True))
    assert 0 < kept < PER_SHARD
    assert report["evicted"] == SHARDS * PER_SHARD - kept


def test_transform_and_seed_order(s3_objects: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    root, options = s3_objects
    args = [
        root,
        "--cache-dir",
        str(tmp_path),
        "--format",
        "pt",
        "--transform",
        "tests.cli_helpers:double",
    ]
    code, report = warm_json(*args, "--seed", "7", "--limit", "10", *options_args(options))
    assert code == 0 and report["samples"] == 10
    cache = Cache(tmp_path, format="pt")
    assert len(cache) == 10


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL])
def test_an_interrupted_warm_is_finished_by_a_rerun(
    seaweed: S3Server, slow_proxy: FaultProxy, tmp_path: Path, how: signal.Signals
) -> None:
    # enough samples that the rest outlasts the poll below on a loaded machine (60 were warmed
    # whole before the signal landed: warm-cache warms its first 8 alone, then the rest at once)
    n = 200
    root = upload(f"s3://{BUCKET}/int-{uuid.uuid4().hex[:8]}", seaweed.storage_options(), n)
    options = seaweed.storage_options(slow_proxy.endpoint)
    args = [
        root,
        "--cache-dir",
        str(tmp_path / "c"),
        "--format",
        "npy",
        "--batch-size",
        "4",
        "--workers",
        "1",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    proc = subprocess.Popen(
        [SCRIPT, "warm-cache", *args, *options_args(options), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        # Ctrl-C as a terminal delivers it: an inherited "ignore SIGINT" (a test runner's
        # worker may have one) would keep Python from installing its KeyboardInterrupt
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # noqa: PLW1509
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and entries(tmp_path / "c") < 8:
        time.sleep(0.05)
    assert proc.poll() is None, "warm-cache finished before it could be interrupted"
    proc.send_signal(how)
    stdout, stderr = proc.communicate(timeout=60)
    if how == signal.SIGINT:
        assert proc.returncode == 130, stderr
        assert json.loads(stdout)["interrupted"] is True
        assert "Traceback" not in stderr
    cached = entries(tmp_path / "c")
    assert 8 <= cached < n
    verify = fastload("cache", "verify", str(tmp_path / "c"), "--json")
    assert verify.returncode == 0 and json.loads(verify.stdout)["npy"]["corrupt"] == []
    code, rerun = warm_json(*args, *options_args(options))
    assert code == 0 and rerun["hits"] == cached and rerun["requests"] == n - cached
    assert entries(tmp_path / "c") == n


def test_two_shards_cover_everything_exactly_once(
    s3_objects: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    root, options = s3_objects
    args = [root, "--cache-dir", str(tmp_path), "--format", "npy", *options_args(options), "--json"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    procs = [
        subprocess.Popen(
            [SCRIPT, "warm-cache", *args, "--shard", f"{i}/2", "--seed", "3"],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    reports = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert sum(r["samples"] for r in reports) == 40 and sum(r["requests"] for r in reports) == 40
    assert len(Cache(tmp_path, format="npy")) == 40
    env_shard = subprocess.run(
        [SCRIPT, "warm-cache", *args],
        capture_output=True,
        text=True,
        check=False,
        env={**env, "RANK": "1", "WORLD_SIZE": "4"},
    )
    assert json.loads(env_shard.stdout)["samples"] == 10  # torchrun's variables pick the shard


def test_verify_repairs_planted_corruption(
    s3_objects: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    root, options = s3_objects
    assert (
        warm_json(root, "--cache-dir", str(tmp_path), "--format", "npy", *options_args(options))[0]
        == 0
    )
    cache = Cache(tmp_path, format="npy")
    planted = sorted(segments_of(cache).live(), key=lambda e: e[2])[:3]
    for _, where, label in planted:
        segment = label.rsplit("@", 1)[0]
        with open(segment, "r+b") as f:  # in the array, just before the footer
            f.seek(where.offset + where.length - 12)
            byte = f.read(1)[0]
            f.seek(where.offset + where.length - 12)
            f.write(bytes([byte ^ 0xFF]))
    first = fastload("cache", "verify", str(tmp_path), "--json")
    assert first.returncode == 1
    corrupt = json.loads(first.stdout)["npy"]["corrupt"]  # entries keep no name: their place
    assert sorted(corrupt) == [label for _, _, label in planted]
    assert fastload("cache", "verify", str(tmp_path)).returncode == 0
    stats = json.loads(fastload("cache", "stats", str(tmp_path), "--json").stdout)
    assert stats["npy"]["entries"] == 37
    code, rerun = warm_json(
        root, "--cache-dir", str(tmp_path), "--format", "npy", *options_args(options)
    )
    assert code == 0 and rerun["requests"] == 3


def test_failed_objects_are_listed_and_the_exit_code_says_so(
    seaweed: S3Server, tmp_path: Path
) -> None:
    options = seaweed.storage_options()
    root = upload(f"s3://{BUCKET}/fail-{uuid.uuid4().hex[:8]}", options, 5)
    filesystem(root, options).pipe(f"{root.split('://')[1]}/0002.npy", b"not an array")
    code, report = warm_json(root, "--cache-dir", str(tmp_path), *options_args(options))
    assert code == 1 and report["samples"] == 5
    assert list(report["failures"]) == [f"{root}/0002.npy"]
    assert "DecodeError" in report["failures"][f"{root}/0002.npy"]


def test_ls_and_manifest_commands(s3_objects: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    root, options = s3_objects
    listing = json.loads(fastload("ls", root, *options_args(options), "--json").stdout)
    assert listing["objects"] == 40 and listing["first_keys"][0] == "0000.npy"
    some = json.loads(
        fastload("ls", f"{root}/00{{05..14}}.npy", *options_args(options), "--json").stdout
    )
    assert some["objects"] == 10 and some["url"] == root and some["pattern"] == "00{05..14}.npy"
    missing = fastload("ls", f"{root}/{{0039,0040}}.npy", *options_args(options))
    assert missing.returncode != 0 and f"{root}/0040.npy" in missing.stderr
    saved = tmp_path / "m.npz"
    assert (
        fastload("manifest", "build", root, "-O", str(saved), *options_args(options)).returncode
        == 0
    )
    shown = json.loads(fastload("manifest", "show", str(saved), "--json").stdout)
    assert shown["objects"] == 40 and shown["url"] == root
    saved_some = str(tmp_path / "some.npz")
    some_url = f"{root}/00{{05..14}}.npy"
    built = fastload("manifest", "build", some_url, "-O", saved_some, *options_args(options))
    assert built.returncode == 0, built.stderr
    for listed in (
        fastload("manifest", "show", saved_some),
        fastload("ls", some_url, *options_args(options)),
    ):
        assert listed.returncode == 0, listed.stderr
        assert listed.stdout.startswith(f"{root} matching 00{{05..14}}.npy: 10 objects")
    code, report = warm_json(
        root, "--cache-dir", str(tmp_path / "c"), "--manifest", str(saved), *options_args(options)
    )
    assert code == 0 and report["samples"] == 40
    # --pattern: a glob over SOURCE's keys (in a URL, '*' would be a key's own character)
    globbed = json.loads(
        fastload("ls", root, "--pattern", "003?.npy", *options_args(options), "--json").stdout
    )
    assert globbed["objects"] == 10 and globbed["pattern"] == "003?.npy"
    for extra in ([], ["--manifest", str(saved)]):
        code, report = warm_json(
            root, "--cache-dir", str(tmp_path / "p"), "--pattern", "*[05].npy", *extra,
            *options_args(options),
        )  # fmt: skip
        assert code == 0 and report["samples"] == 8


@pytest.mark.parametrize("store", ["gcs", "b2"])
def test_warm_from_gcs_and_b2(store: str, gcs: FakeGcsServer, b2: B2Server, tmp_path: Path) -> None:
    server = gcs if store == "gcs" else b2
    options = server.storage_options()
    root = upload(
        f"{'gs' if store == 'gcs' else 'b2'}://{BUCKET}/cli-{uuid.uuid4().hex[:8]}", options, 8
    )
    code, report = warm_json(
        root, "--cache-dir", str(tmp_path), "--format", "zarr", *options_args(options)
    )
    assert code == 0 and report["samples"] == 8 and report["failures"] == {}


def test_cache_clear_without_a_terminal_asks_for_yes_and_removes_nothing(tmp_path: Path) -> None:
    cache = Cache(tmp_path / "c", format="npy")
    cache.put("s3://b/k.npy", np.zeros(3, np.float32))
    done = fastload("cache", "clear", str(tmp_path / "c"))  # stdin: pytest's, no terminal
    assert done.returncode == 2, done
    assert "no terminal to answer on: pass --yes" in done.stderr, done.stderr
    assert len(Cache(tmp_path / "c", format="npy", read_only=True)) == 1
    done = fastload("cache", "clear", "--yes", str(tmp_path / "c"))
    assert done.returncode == 0 and len(Cache(tmp_path / "c", format="npy")) == 0


def test_bad_input_is_one_line_with_the_right_exit_code(seaweed: S3Server, tmp_path: Path) -> None:
    cdir = tmp_path / "c"
    secret = seaweed.secret_key
    wrong = {**seaweed.storage_options(), "secret": "wrong-" + secret}
    cases = [
        (["warm-cache", "ftp://host/x", "--cache-dir", str(cdir)], 2, "scheme"),
        (
            ["warm-cache", f"s3://{BUCKET}/x", "--cache-dir", str(cdir), "--shard", "2/2"],
            2,
            "--shard",
        ),
        (
            [
                "warm-cache",
                f"s3://{BUCKET}/x",
                "--cache-dir",
                str(cdir),
                "--transform",
                "no.such:thing",
            ],
            2,
            "does not import",
        ),
        (
            [
                "warm-cache",
                f"s3://{BUCKET}/x",
                "--cache-dir",
                str(tmp_path / "f" / "c"),
                "--format",
                "hdf5",
            ],
            2,
            "--format",
        ),
        (
            ["warm-cache", f"s3://{BUCKET}/x", "--cache-dir", str(cdir), *options_args(wrong)],
            1,
            "s3://",
        ),
        (
            [
                "warm-cache",
                f"s3://no-such-bucket-{uuid.uuid4().hex[:6]}/x",
                "--cache-dir",
                str(cdir),
                *options_args(seaweed.storage_options()),
            ],
            1,
            "no-such-bucket",
        ),
        (["cache", "stats", str(REPO)], 2, "not a fastload cache"),
        (["manifest", "show", str(tmp_path / "empty.npz")], 2, "empty.npz"),
        (["manifest", "show", str(tmp_path / "f")], 2, "not a readable fastload manifest"),
        (["warm-cache", "--cache-dir", str(cdir)], 2, "needs SOURCE"),
        (  # options --dataset's own dataset would not use are refused, not ignored
            ["warm-cache", "--dataset", "tests.cli_helpers:double", "--transform", "a:b"],
            2,
            "so --transform would be ignored",
        ),
        (
            ["warm-cache", "--dataset", "a:b", "--shards", "tar", "--limit", "5", "--format", "pt"],
            2,
            "so --shards, --format, --limit would be ignored",
        ),
    ]
    (tmp_path / "f").write_text("a file, not a folder")
    (tmp_path / "empty.npz").write_bytes(b"")
    for args, code, words in cases:
        done = fastload(*args)
        assert done.returncode == code, (args, done.stderr)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and words in lines[0], (args, done.stderr)
        assert "Traceback" not in done.stderr
        assert secret not in done.stdout + done.stderr
    debug = fastload("--debug", "warm-cache", "ftp://host/x", "--cache-dir", str(cdir), real=True)
    assert debug.returncode == 1 and "Traceback" in debug.stderr


@pytest.mark.parametrize(
    "token",
    [
        "ya29.never-print-me-0a1b",
        json.dumps(
            {
                "type": "authorized_user",
                "client_id": "id",
                "client_secret": "never-print-me-client",
                "refresh_token": "never-print-me-refresh",
            }
        ),
    ],
)
def test_credentials_never_reach_the_terminal(token: str) -> None:
    # the token endpoint cannot be reached: google-auth's error names it with the token in
    # its query string; fastload prints the error line without it
    done = fastload("ls", "gs://some-bucket/x", "-o", f"token={token}", real=True)  # logs too
    assert done.returncode == 1, done.stderr
    assert "never-print-me" not in done.stdout + done.stderr, done.stderr


def test_bench_is_the_diagnosis_only_and_never_imports_the_repository() -> None:
    """#20: `fastload bench` ran whatever package named `benchmarks` came first on sys.path."""
    done = fastload("bench", real=True)
    assert done.returncode == 2 and "--diagnose" in done.stderr
    source = (REPO / "src" / "fastload" / "_cli" / "app.py").read_text()
    assert "benchmarks" not in source


def test_version_and_help() -> None:
    from fastload import __version__

    assert fastload("--version", real=True).stdout.strip() == f"fastload {__version__}"
    for command in (
        ["--help"],
        ["warm-cache", "--help"],
        ["cache", "--help"],
        ["manifest", "build", "--help"],
    ):
        done = fastload(*command)
        assert done.returncode == 0 and "Usage" in done.stdout


def test_a_cache_dir_that_cannot_be_created_is_a_runtime_error(
    s3_objects: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    root, options = s3_objects
    (tmp_path / "file").write_text("x")
    done = fastload(
        "warm-cache", root, "--cache-dir", str(tmp_path / "file" / "c"), *options_args(options)
    )
    assert done.returncode == 1 and "cannot use" in done.stderr and "ENOTDIR" in done.stderr


def test_bench_diagnose_flips_with_the_step(
    s3_objects: tuple[str, dict[str, Any]], slow_proxy: FaultProxy, tmp_path: Path
) -> None:
    root, options = s3_objects
    # 20 batches of 2: more than the loader's lookahead makes while the first batch waits, so
    # the later batches wait on fetches too (batches of 8 were all made in the first's 0.15 s)
    args = ["bench", "--diagnose", root, "--batch-size", "2", "--steps", "10", "--workers", "0"]
    slow = {**options, "endpoint_url": slow_proxy.endpoint}
    done = fastload(*args, "--step-ms", "1", *options_args(slow), "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["bound"] == "data" and "fetch latency" in data["cause"], data
    done = fastload(*args, "--step-ms", "300", *options_args(options), "-c", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("compute-bound"), done.stdout
    done = fastload("bench", "--diagnose", root, "--step", "nowhere:step")
    assert done.returncode == 2 and "--step 'nowhere:step' does not import" in done.stderr
