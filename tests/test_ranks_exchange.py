"""The exchange of ranks with no process group (as under torch_xla): rank 0's listing, the parts
of ``on_every_rank`` and errors cross a store rank 0 serves on ``MASTER_ADDR`` alone, signed with
the job's key and never unpickled. Ranks are real processes (tests/_exchange_rank.py); a test
plays the other process on the host, which can reach the store and write into it."""

from __future__ import annotations

import io
import ipaddress
import json
import os
import pickle
import secrets
import shlex
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.distributed as dist

from fastload import (
    ConfigError,
    FastloadError,
    Manifest,
    MissingExtraError,
    RankExchangeError,
    ShardError,
)
from fastload._rankstore import RankStore, sign
from fastload._wire import decode, encode
from fastload.testing import free_port

_RANK = Path(__file__).with_name("_exchange_rank.py")
# where the listing of the ``slow`` job crosses: tag "fastload", the second call, per rank
_LISTING = ["fastload/fastload/1/0", "fastload/fastload/1/1"]
_GREETING = "fastload/fastload/0/0"  # where rank 0's greeting (the first call) crosses


class _RunsCommand:
    """Pickles as a call of ``os.system(command)``: what unpickling it does."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (self.command,))


def _pickled_outcome_that_touches(marker: Path) -> bytes:
    """What the store used to carry (a pickled outcome), made to create ``marker`` when read."""
    return pickle.dumps((True, _RunsCommand(f"touch {shlex.quote(str(marker))}")))


class _Job:
    """Two rank processes of one job, their folders, and the store's port."""

    def __init__(self, tmp_path: Path) -> None:
        self.data, self.tars, self.out = tmp_path / "data", tmp_path / "tars", tmp_path / "out"
        for folder in (self.data / "day 1", self.tars, self.out, tmp_path / "run"):
            folder.mkdir(parents=True)
        for i in range(6):
            (self.data / "day 1" / f"{i:02d}.bin").write_bytes(b"x" * i)
        for shard in range(2):
            with tarfile.open(self.tars / f"shard-{shard}.tar", "w") as tar:
                for n in range(shard * 3, shard * 3 + 3):
                    info = tarfile.TarInfo(f"s/{n:04d}.bin")
                    info.size = 100
                    tar.addfile(info, io.BytesIO(bytes([n]) * 100))
        self.port = free_port()
        self.env = {
            **{k: v for k, v in os.environ.items() if k != "FASTLOAD_STORE_SECRET"},
            "MASTER_ADDR": "127.0.0.1",
            "FASTLOAD_STORE_PORT": str(self.port),
            "XDG_RUNTIME_DIR": str(tmp_path / "run"),  # where rank 0 leaves the job's key
        }
        self.ranks: list[subprocess.Popen[bytes]] = []

    def start(self, job: str) -> None:
        for rank in range(2):
            command = [sys.executable, str(_RANK), str(rank), "2", job, str(self.out)]
            command += [str(self.data), str(self.tars)]
            self.ranks.append(subprocess.Popen(command, env=self.env))

    def results(self) -> list[dict[str, Any]]:
        """What each rank recorded, once both have ended."""
        (self.out / "go").touch()
        for rank in self.ranks:
            rank.wait(timeout=120)
        return [json.loads((self.out / f"rank-{r}.json").read_text()) for r in range(2)]

    def client(self) -> Any:
        """A client of the store on 127.0.0.1 that waits until rank 1 has written its value:
        what any process on the host can be."""
        store = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1", self.port, is_master=False, timeout=timedelta(seconds=60)
        )
        deadline = time.monotonic() + 60
        while not store.check([_LISTING[1]]):
            assert time.monotonic() < deadline, "rank 1 never wrote its value"
            time.sleep(0.05)
        return store


@pytest.fixture
def job(tmp_path: Path) -> Iterator[_Job]:
    job = _Job(tmp_path)
    yield job
    for rank in job.ranks:  # only ours, by PID
        if rank.poll() is None:
            rank.kill()
            rank.wait()


def test_ranks_hand_each_other_listings_parts_and_errors_without_unpickling(job: _Job) -> None:
    job.start("exchange")
    results = job.results()
    assert all("error" not in r for r in results), results
    assert len(results[0]["keys"]) == 6
    assert results[1]["keys"] == results[0]["keys"]
    assert results[1]["fingerprint"] == results[0]["fingerprint"]
    assert results[1]["missing"] == ["ObjectNotFoundError", f"file://{job.data}/no-such-prefix"]
    for r in results:
        assert r["offsets"] == [[0, 1], [0, 1, 2]]
        assert r["dtypes"] == ["int64", "int64"]
        assert r["shard_errors"] == [
            ["ShardError", f"file:///shard-{n}.tar", f"truncated tar: file:///shard-{n}.tar"]
            for n in range(2)
        ]
        assert r["samples"] == results[0]["samples"]
    assert len(set(results[0]["samples"])) == 6
    # rank 1 raised them: rank 0 gets the fastload error as itself, any other as a
    # FastloadError naming its type, and a value that cannot cross as the sender's error
    assert results[0]["failures"] == [
        ["ConfigError", "bad option x"],
        ["FastloadError", "KeyError: 'k'"],
        ["FastloadError", "TypeError: a set cannot be handed to other ranks"],
    ]
    assert results[1]["failures"] == [
        ["ConfigError", "bad option x"],
        ["KeyError", "'k'"],
        ["TypeError", "a set cannot be handed to other ranks"],
    ]


def _forged(kind: str, store: Any, marker: Path, data: Path) -> bytes:
    """A value for rank 0's key that rank 0 did not write."""
    if kind == "pickle":
        return _pickled_outcome_that_touches(marker)
    if kind == "another key":  # a well-formed listing of no keys
        empty = Manifest.build(f"file://{data}")[:0]
        return sign(secrets.token_bytes(32), _LISTING[0], encode((True, empty)))
    return bytes(store.get(_LISTING[1]))  # rank 1's own value, signed for its own name


@pytest.mark.parametrize("kind", ["pickle", "another key", "rank 1's value"])
def test_a_value_another_process_writes_while_rank_0_lists_is_refused(
    job: _Job, tmp_path: Path, kind: str
) -> None:
    marker = tmp_path / "the-payload-ran"
    job.start("slow")
    store = job.client()
    store.set(_LISTING[0], _forged(kind, store, marker, job.data))
    results = job.results()
    assert not marker.exists()
    assert results[1]["error"][0] == "RankExchangeError", results[1]
    where = f"the rank store at 127.0.0.1:{job.port}"
    assert results[1]["error"][1].startswith(f"refused {_LISTING[0]} from {where}: ")
    assert len(results[0]["keys"]) == 6  # rank 0 lists, and is not held up


def test_the_store_listens_on_master_addr_alone(job: _Job) -> None:
    job.start("slow")
    job.client()  # served on 127.0.0.1, MASTER_ADDR
    with pytest.raises(ConnectionRefusedError):  # not on another address of the host
        socket.create_connection(("127.0.0.2", job.port), timeout=10).close()
    results = job.results()
    assert results[1]["keys"] == results[0]["keys"]
    assert len(results[0]["keys"]) == 6


def test_a_process_that_takes_the_port_first_feeds_no_rank(job: _Job, tmp_path: Path) -> None:
    marker = tmp_path / "the-payload-ran"
    taken = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", job.port, is_master=True, wait_for_workers=False
    )
    taken.set(_GREETING, _pickled_outcome_that_touches(marker))
    job.env["FASTLOAD_STORE_SECRET"] = secrets.token_hex(32)  # the job's, not the squatter's
    job.start("slow")
    results = job.results()
    assert not marker.exists()
    assert [r["error"][0] for r in results] == ["RankExchangeError"] * 2, results
    where = f"the rank store at 127.0.0.1:{job.port}"
    assert results[0]["error"][1].startswith(f"could not serve {where}: ")
    assert results[1]["error"][1].startswith(f"refused {_GREETING} from {where}: ")


# -- the encoding on its own ---------------------------------------------------------------


def test_every_kind_that_crosses_comes_back_as_itself(tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(b"abc")
    manifest = Manifest.build(f"file://{tmp_path}").with_labels({"a.bin": "cat"})
    arrays = {"u8": np.frombuffer(b"footer", dtype=np.uint8), "i8": np.arange(3)}
    value = (True, [manifest, arrays, None, 1.5, "x", (2, False)])
    ok, (back, got, *rest) = decode(encode(value))
    assert ok is True and rest == [None, 1.5, "x", (2, False)]
    assert back.fingerprint == manifest.fingerprint and back.classes == ("cat",)
    assert {k: (v.dtype, v.tolist()) for k, v in got.items()} == {
        k: (v.dtype, v.tolist()) for k, v in arrays.items()
    }
    sent = [
        ShardError("torn", url="s3://b/x.tar"),
        MissingExtraError("pyarrow", "parquet", "parquet shards"),
        KeyError("k"),
    ]
    shard, extra, other = decode(encode(sent))
    assert type(shard) is ShardError
    assert (str(shard), shard.url) == ("torn: s3://b/x.tar", "s3://b/x.tar")
    assert type(extra) is MissingExtraError
    assert (str(extra), extra.module, extra.extra) == (str(sent[1]), "pyarrow", "parquet")
    assert type(other) is FastloadError and str(other) == "KeyError: 'k'"


def _with_tree(tree: Any) -> bytes:
    out = io.BytesIO()
    np.savez(out, tree=np.frombuffer(json.dumps(tree).encode(), dtype=np.uint8))
    return out.getvalue()


@pytest.mark.parametrize(
    "data",
    [
        _with_tree({"error": ["Popen", "x", {}]}),  # a class by name, not a fastload error
        _with_tree({"error": ["ConfigError", "x", {"__class__": None}]}),
        _with_tree({"array": "a0"}),  # an array that is not there
        _with_tree({"set": [1]}),
        b"",
    ],
)
def test_anything_else_is_refused(data: bytes) -> None:
    with pytest.raises(ValueError):
        decode(data)


def test_a_pickle_is_refused_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "the-payload-ran"
    with pytest.raises(ValueError, match="pickled"):
        decode(_pickled_outcome_that_touches(marker))
    assert not marker.exists()


def test_a_value_that_cannot_cross_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="a ndarray cannot be handed to other ranks"):
        encode([np.array([{}], dtype=object)])  # would need pickle
    with pytest.raises(TypeError, match="a set cannot be handed to other ranks"):
        encode({1})


def test_bytes_that_are_not_a_manifest_are_a_config_error_naming_them() -> None:
    with pytest.raises(ConfigError, match="bytes from rank 3"):
        Manifest.from_bytes(b"PK\x03\x04 not a zip", name="bytes from rank 3")


# -- the job's key -------------------------------------------------------------------------


@pytest.fixture
def store_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A job's variables with its key folder under ``tmp_path``; that folder."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("FASTLOAD_STORE_PORT", str(free_port()))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("FASTLOAD_STORE_SECRET", raising=False)
    return tmp_path / f"fastload-{os.getuid()}"


def test_a_key_folder_that_other_users_can_use_is_refused(store_env: Path) -> None:
    store_env.mkdir()
    store_env.chmod(0o777)  # another user could swap the key rank 0 leaves there
    with pytest.raises(RankExchangeError, match="other users can use it"):
        RankStore(0)


def test_a_short_secret_is_a_config_error(store_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTLOAD_STORE_SECRET", "job42")
    with pytest.raises(ConfigError, match="FASTLOAD_STORE_SECRET has 5 characters"):
        RankStore(0)


def test_a_host_name_that_resolves_here_to_loopback_alone_is_served_on_every_interface(
    store_env: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``MASTER_ADDR=$(hostname)`` where /etc/hosts maps the name to 127.0.x.1: the other
    hosts resolve it to the host's real address, which a store bound to loopback never
    answers on (they would wait out the store's timeout); so it listens on every interface,
    as torch's own store does, and says so."""
    host = socket.gethostname()
    found = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    if not all(ipaddress.ip_address(a).is_loopback for a in found):
        pytest.skip(f"{host} resolves to {sorted(found)} here, not to loopback alone")
    monkeypatch.setenv("MASTER_ADDR", host)
    port = int(os.environ["FASTLOAD_STORE_PORT"])
    store = RankStore(0)
    try:
        socket.create_connection(("127.0.0.2", port), timeout=10).close()  # another address
    finally:
        del store
    assert any("resolves here only to the loopback" in r.getMessage() for r in caplog.records)


def test_the_exchange_settings_come_from_the_launcher_s_variables() -> None:
    from fastload.config import ExchangeConfig

    assert ExchangeConfig.from_env({}) == ExchangeConfig("localhost", 29517, None)
    env = {"MASTER_ADDR": "10.0.0.2", "FASTLOAD_STORE_PORT": "4000", "FASTLOAD_STORE_SECRET": "s"}
    assert ExchangeConfig.from_env(env) == ExchangeConfig("10.0.0.2", 4000, "s")
    with pytest.raises(ConfigError, match="FASTLOAD_STORE_PORT='x'"):
        ExchangeConfig.from_env({"FASTLOAD_STORE_PORT": "x"})
    with pytest.raises(ConfigError, match=r"ExchangeConfig\.port"):
        ExchangeConfig.from_env({"FASTLOAD_STORE_PORT": "70000"})
