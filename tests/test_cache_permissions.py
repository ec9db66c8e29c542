"""Caches between users: a folder or file a process may not use is a CacheError naming it and
the permission missing, from ``Cache()`` and from every later call; a cache made with
``shared=True`` is one cache for every member of its folder's group, whatever their umask; a
full disk names the file that could not be written.

Mode bits do not bind root, so the other users here are processes of other uids and gids (no
account needs to exist for them): each starts as root, imports what it needs, becomes the other
user (``setgroups``, ``setgid``, ``setuid``, ``umask``), runs a job of this module and prints
what it returns as JSON. Run by a user other than root, the tests that need two users are
skipped (no process can become another user), and the others run as that user, whom mode bits
do bind.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import fastload
from fastload import Cache, CacheError, CacheFullError, ConfigError, RemoteDataset
from fastload._cli import main
from tests.cache_helpers import entry_path, segments_of
from tests.conftest import small_tmpfs

REPO = Path(__file__).resolve().parents[1]
SRC = Path(fastload.__file__).resolve().parents[1]  # the jobs use the fastload this test does
ROOT = os.geteuid() == 0
TEAM, ALICE, BOB = 61000, 61001, 61002  # uids and gids of no account: none needs to exist
as_root = pytest.mark.skipif(
    not ROOT, reason="runs processes as other users (uid/gid), which only root can start"
)


# --- processes of other users -------------------------------------------------------------------


def run_job(
    job: str, *args: str, uid: int | None, groups: tuple[int, ...] = (), umask: int = 0o022
) -> Any:
    """``JOBS[job](*args)`` in a fresh process, as ``uid`` with ``groups`` (the first its own)
    when given (root only: the process starts as root, imports what the jobs use, then
    becomes that user, as the interpreter may be where only root can read it), else as this
    user; what it returned."""
    code = (
        "import json, sys\n"
        "from tests.test_cache_permissions import JOBS, become\n"
        "job, uid, groups, umask, *args = sys.argv[1:]\n"
        "become(int(uid), [int(g) for g in groups.split(',') if g], int(umask, 8))\n"
        "print(json.dumps(JOBS[job](*args)))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(REPO)])}
    who = [str(-1 if uid is None else uid), ",".join(map(str, groups)), f"{umask:o}"]
    done = subprocess.run(
        [sys.executable, "-B", "-c", code, job, *who, *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def become(uid: int, groups: list[int], umask: int) -> None:
    """Become ``uid`` (-1: stay) with ``groups`` and ``umask``, once what the jobs import
    lazily is imported (the interpreter's own files may be where only root can read them)."""
    import fsspec.implementations.local  # noqa: F401

    import fastload._cli.app  # noqa: F401
    from fastload.cache.formats import _blosc

    _blosc()
    os.umask(umask)
    if uid >= 0:
        os.setgroups(groups)
        os.setgid(groups[0])
        os.setuid(uid)


def outcome(call: Callable[[], Any]) -> list[str]:
    """``["ok", repr]`` of what ``call`` returned, or the names of its error's classes and its
    message."""
    try:
        return ["ok", repr(call())]
    except Exception as exc:  # each case's error is what the test looks at
        return [",".join(kind.__name__ for kind in type(exc).__mro__), str(exc)]


@pytest.fixture
def open_folder() -> Iterator[Path]:
    """A folder that every user may traverse (pytest's tmp_path is its owner's alone)."""
    folder = Path(tempfile.mkdtemp(prefix="fastload-perms-"))
    folder.chmod(0o755)
    for above in folder.parents:
        if not stat.S_IMODE(above.stat().st_mode) & 0o001:
            pytest.skip(f"{above} is not traversable by other users")
    try:
        yield folder
    finally:
        shutil.rmtree(folder)


# --- jobs (run in the other process) ------------------------------------------------------------


def open_each(*roots: str) -> dict[str, list[str]]:
    """Open each cache ``root`` (``root:read_only``) and read its entry "a"."""
    found = {}
    for spec in roots:
        root, _, read_only = spec.partition(":")
        flag = {"none": None, "false": False}[read_only]

        def use(root: str = root, flag: bool | None = flag) -> Any:
            cache = Cache(root, read_only=flag)
            value = cache.get("a")
            return [cache.read_only, None if value is None else value.tolist()]

        found[spec] = outcome(use)
    return found


def ops(fmt: str) -> dict[str, Callable[[Cache], Any]]:
    """Every call of a Cache that touches its folder."""

    def compute(positions: list[int]) -> list[Any]:
        return [np.zeros(3) for _ in positions]

    def read_lazily(cache: Cache) -> Any:
        with cache.open("a") as sample:
            return np.asarray(sample).sum()

    return {
        "get": lambda cache: cache.get("a"),
        "get_many": lambda cache: cache.get_many(["a", "new"], compute),
        "get_or_compute": lambda cache: cache.get_or_compute("new", lambda: np.zeros(3)),
        "in": lambda cache: "a" in cache,
        "contains_many": lambda cache: cache.contains_many(["a", "b"]),
        "len": len,
        "stats": lambda cache: cache.stats(),
        "put": lambda cache: cache.put("c", np.ones(3)),
        "delete": lambda cache: cache.delete("a"),
        "verify": lambda cache: cache.verify(),
        "prune": lambda cache: cache.prune(max_bytes=0),
        "clear": lambda cache: cache.clear(),
        **({"open": read_lazily} if fmt == "zarr" else {}),
    }


def later_calls(fmt: str, folder: str) -> dict[str, list[str]]:
    """Each call of a Cache opened before its folder became untraversable (mode 000), and
    calls meeting one subfolder or file this user may not use."""
    root = Path(folder) / fmt
    made = Cache(root, format=fmt)  # type: ignore[arg-type]
    made.put("a", np.arange(3))
    made.put("b", np.arange(4))
    made.put("c", np.arange(5))  # its index shard is there when "put" puts it again
    found = {}
    for name, call in ops(fmt).items():
        cache = Cache(root, format=fmt)  # type: ignore[arg-type]
        root.chmod(0o000)
        try:
            found[name] = outcome(lambda call=call, cache=cache: call(cache))
        finally:
            root.chmod(0o700)

    def cut(path: Path, mode: int, call: Callable[[Cache], Any]) -> list[str]:
        cache = Cache(root, format=fmt)  # type: ignore[arg-type]
        before = stat.S_IMODE(path.stat().st_mode)
        path.chmod(mode)
        try:
            return outcome(lambda: call(cache))
        finally:
            path.chmod(before)

    get = ops(fmt)["get"]
    found["open, tmp/ not writable"] = cut(
        root / "tmp",
        0o500,
        lambda _: Cache(root, format=fmt, read_only=False),  # type: ignore[arg-type]
    )
    if fmt == "npy":
        (segment,) = (root / "segments").iterdir()
        found["get, segments/ 000"] = cut(root / "segments", 0o000, get)
        found["get, segment 000"] = cut(segment, 0o000, get)
        shard = root / "index" / f"{made._digest('c')[: segments_of(made).width]}.flnpy"
        found["put, index shard 400"] = cut(shard, 0o400, ops(fmt)["put"])
        found["shard"] = ["", str(shard)]
        found["segment"] = ["", str(segment)]
    else:
        chunk = entry_path(made, "a") / "0" / "c" / "0"  # its one chunk
        found["open, chunk 000"] = cut(chunk, 0o000, ops(fmt)["open"])
        found["chunk"] = ["", str(chunk)]
    return found


def fill_shared(root: str, objects: str) -> dict[str, Any]:
    """Make a shared cache and use every kind of its files: segments, index shards, lock files,
    usage files, zarr entries (written as temporary files), a saved manifest."""
    cache = Cache(root, shared=True, max_bytes=10**9)
    for i in range(10):
        cache.put(f"a{i}", np.full(100, i))
    cache.get_many([f"m{i}" for i in range(5)], lambda p: [np.full(3, i) for i in p])
    Cache(root, format="zarr").put("z0", {"x": np.arange(3000.0).reshape(30, 100)})
    dataset = RemoteDataset(f"file://{objects}", decode="npy", cache=Cache(root))
    return {"repr": repr(cache), "first": dataset[0].tolist()}


def use_shared(root: str, objects: str) -> dict[str, Any]:
    """Another member of the group: every call, on the other's entries too."""
    cache = Cache(root)
    zarr = Cache(root, format="zarr")
    dataset = RemoteDataset(f"file://{objects}", decode="npy", cache=Cache(root))
    found: dict[str, Any] = {"repr": repr(cache), "first": dataset[0].tolist()}
    found["theirs"] = [cache.get(f"a{i}").tolist() for i in (0, 9)]
    found["zarr"] = float(np.asarray(zarr.get("z0")["x"]).sum())
    cache.put("b2", np.full(4, 2))
    zarr.put("z1", {"x": np.ones((10, 10))})
    found["mine"] = cache.get("b2").tolist()
    found["in"] = ["a3" in cache, "nope" in cache]
    found["delete"] = cache.delete("a1")
    found["verify"] = [len(cache.verify().corrupt), len(zarr.verify().corrupt)]
    found["budget"] = cache.stats()["max_bytes"]
    found["evicted"] = cache.prune(max_bytes=0)  # the other's segments too: it is done
    cache.put("b9", np.full(4, 9))
    found["private"] = outcome(lambda: Cache(root, shared=False))
    return found


def read_shared(root: str) -> dict[str, Any]:
    """The first member again, on what the second left."""
    cache = Cache(root)
    cache.put("a-late", np.arange(2))
    return {
        "theirs": cache.get("b9").tolist(),
        "zarr": float(np.asarray(Cache(root, format="zarr").get("z1")["x"]).sum()),
    }


def verify_under_a_file_size_limit(root: str, limit: str) -> dict[str, Any]:
    """``fastload cache verify`` where no file may grow past ``limit`` bytes (EFBIG, as a full
    disk's ENOSPC); its exit code and what it printed."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), int(limit)))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["cache", "verify", root])
    return {"code": code, "stderr": err.getvalue()}


JOBS: dict[str, Callable[..., Any]] = {
    "open_each": open_each,
    "later_calls": later_calls,
    "fill_shared": fill_shared,
    "use_shared": use_shared,
    "read_shared": read_shared,
    "verify_under_a_file_size_limit": verify_under_a_file_size_limit,
}


def is_cache_error(found: list[str]) -> bool:
    return "CacheError" in found[0].split(",")


# --- tests --------------------------------------------------------------------------------------


@as_root
def test_another_users_cache_is_a_cache_error_naming_the_folder_and_the_permission(
    open_folder: Path,
) -> None:
    """Opening another user's cache raised a bare PermissionError (or 'is not a fastload
    cache'); now a CacheError names the folder or file and the permission missing. A cache
    it may read but not write still opens read only."""
    private, listed, readable, team = (open_folder / name for name in ("p", "l", "r", "t"))
    for root in (private, listed, readable):
        Cache(root).put("a", np.arange(3))
    listed.chmod(0o755)  # the folder can be listed, the files are still 0600
    for path in [readable, *readable.rglob("*")]:
        path.chmod(stat.S_IMODE(path.stat().st_mode) | (0o055 if path.is_dir() else 0o044))
    team.mkdir()
    os.chown(team, -1, TEAM)
    Cache(team, shared=True).put("a", np.arange(3))

    found = run_job(
        "open_each",
        *(f"{root}:none" for root in (private, listed, readable, team)),
        f"{readable}:false",
        uid=ALICE,
        groups=(ALICE,),  # not in TEAM
    )

    def says(spec: str, pattern: str) -> None:
        assert is_cache_error(found[spec]), found[spec]
        assert re.search(pattern, found[spec][1]), found[spec][1]

    says(f"{private}:none", rf"no permission to traverse {private} \(owner uid 0, .*mode 0700")
    says(f"{listed}:none", rf"no permission to read {listed}/fastload-cache.json \(.*mode 0600")
    # a shared cache made in a folder of mode 0755: the cache gave it g+rwxs, kept o+rx
    assert stat.S_IMODE(team.stat().st_mode) == 0o2775
    says(
        f"{team}:none",
        rf"no permission to read {team}/fastload-cache.json \(.* gid {TEAM}, mode 0660",
    )
    says(f"{readable}:false", rf"not writable: no permission to write {readable} ")
    assert "shared=True" in found[f"{private}:none"][1]  # how to share one
    assert found[f"{readable}:none"] == ["ok", "[True, [0, 1, 2]]"]  # read only, served


@pytest.mark.parametrize("fmt", ["npy", "zarr"])
def test_every_later_call_on_a_folder_it_may_not_use_is_a_cache_error_naming_it(
    open_folder: Path, fmt: str
) -> None:
    """A cache whose folder (or one of its files) became unusable raised bare PermissionErrors
    from len, stats, put, delete, verify, prune, clear, `in` and open, and from get a
    CacheError that named neither the path nor the permission. (As root, another uid runs the
    calls: mode bits do not bind root.)"""
    folder = open_folder / "theirs"
    folder.mkdir()
    if ROOT:
        os.chown(folder, ALICE, ALICE)
    found = run_job("later_calls", fmt, str(folder), uid=ALICE if ROOT else None, groups=(ALICE,))
    root = folder / fmt
    untraversable = rf"cannot .* in {root}: no permission to traverse {root} \("
    for name in ops(fmt):
        assert is_cache_error(found[name]), (name, found[name])
        assert re.search(untraversable, found[name][1]), (name, found[name][1])
    assert is_cache_error(found["open, tmp/ not writable"])
    assert (
        f"not writable: no permission to write {root}/tmp (" in found["open, tmp/ not writable"][1]
    )
    if fmt == "npy":
        segments, shard, segment = root / "segments", found["shard"][1], found["segment"][1]
        checks = {
            "get, segments/ 000": f"no permission to traverse {segments} (",
            "get, segment 000": f"no permission to read {segment} (",
            "put, index shard 400": f"no permission to write {shard} (",
        }
    else:
        checks = {"open, chunk 000": f"no permission to read {found['chunk'][1]} ("}
    for case, text in checks.items():
        assert is_cache_error(found[case]) and text in found[case][1], (case, found[case])


@as_root
def test_a_shared_cache_is_one_cache_for_every_member_of_its_group(open_folder: Path) -> None:
    """Cache(shared=True) in a group's setgid folder: a second member, with another umask and
    no shared=, reads, writes, evicts, verifies the first's entries and loads its saved
    manifest; the first reads the second's. Every folder is 2770 and every file 0660, in the
    group, whatever the umask (077 here); the marker says so for every later process."""
    team = open_folder / "team"
    team.mkdir()
    os.chown(team, -1, TEAM)
    team.chmod(0o2770)  # what an admin does once
    objects = open_folder / "objects"
    objects.mkdir()
    for i in range(3):
        np.save(objects / f"{i}.npy", np.full(5, i))
    root = team / "cache"

    first = run_job(
        "fill_shared", str(root), str(objects), uid=ALICE, groups=(ALICE, TEAM), umask=0o077
    )
    assert "shared=True" in first["repr"] and first["first"] == [0] * 5
    second = run_job(
        "use_shared", str(root), str(objects), uid=BOB, groups=(BOB, TEAM), umask=0o022
    )
    assert "shared=True" in second["repr"] and second["first"] == [0] * 5
    assert second["theirs"] == [[0] * 100, [9] * 100] and second["zarr"] == sum(range(3000))
    assert second["mine"] == [2] * 4 and second["in"] == [True, False] and second["delete"]
    assert second["verify"] == [0, 0] and second["budget"] == 10**9 and second["evicted"] > 0
    assert second["private"][0].startswith("ConfigError")
    assert "holds a cache shared with its group" in second["private"][1]
    again = run_job("read_shared", str(root), uid=ALICE, groups=(ALICE, TEAM), umask=0o077)
    assert again == {"theirs": [9] * 4, "zarr": 100.0}

    assert json.loads((root / "fastload-cache.json").read_text())["shared"] is True
    made_by: dict[str, set[int]] = {}  # uids that made each kind of file
    for path in [root, *root.rglob("*")]:
        found = path.lstat()
        mode = stat.S_IMODE(found.st_mode)
        assert found.st_gid == TEAM, f"{path} is in group {found.st_gid}"
        assert mode == (0o2770 if path.is_dir() else 0o660), f"{path} has mode {mode:o}"
        if path.is_file():
            kind = path.parent.name if path.parent != root else path.name.split("-")[0]
            made_by.setdefault(kind, set()).add(found.st_uid)
    assert made_by["segments"] == {ALICE, BOB}
    for kind in ("index", "locks", "usage", "manifests"):
        assert made_by.get(kind), f"no {kind} files: {sorted(made_by)}"


# --- what a member of a shared cache's group may put in its folders ------------------------------
#
# A shared cache's folders are its group's to write, so a member can put a symlink (or a FIFO)
# where a file of the cache is. One user plays both members here: the swap needs no rights the
# group lacks, and what a victim's process does through it is the same.

REFUSED = "is a symlink or not a regular file: refused"


def plant(path: Path, target: Path) -> None:
    """Put a symlink to ``target`` where the cache's file ``path`` is (or would be)."""
    path.unlink(missing_ok=True)
    path.symlink_to(target)


def another_members_file(tmp_path: Path) -> Path:
    """A file of another member, outside the cache, with an old mtime (a touch would show)."""
    victim = tmp_path / "home" / "victim.bin"
    victim.parent.mkdir(exist_ok=True)
    victim.write_bytes(b"another member's own bytes\n" * 4)
    os.utime(victim, (1e9, 1e9))
    return victim


def snapshot(path: Path) -> tuple[bytes, int, int]:
    """What a write, a touch or a chmod through a link would change."""
    found = path.stat()
    return path.read_bytes(), found.st_mtime_ns, found.st_mode


@pytest.mark.parametrize("call", ["put", "clear"])
def test_a_usage_file_swapped_for_a_link_is_refused_and_its_target_left_alone(
    tmp_path: Path, call: str
) -> None:
    """usage-npy replaced by a link: the next process to record usage wrote
    b"%020d %020d\\n" at offset 0 of the linked file (the lock's inode check followed the
    link too), and ``clear`` zeros there."""
    root = tmp_path / "cache"
    cache = Cache(root, shared=True)
    cache.put("a", np.arange(3))
    victim = another_members_file(tmp_path)
    before = snapshot(victim)
    plant(root / "usage-npy", victim)
    with pytest.raises(CacheError, match=REFUSED) as refused:
        if call == "clear":
            cache.clear()
        else:
            Cache(root).put("b", np.arange(4))
    assert str(root / "usage-npy") in str(refused.value)
    assert snapshot(victim) == before


@pytest.mark.parametrize("call", ["put", "get"])
def test_an_index_shard_swapped_for_a_link_is_refused_and_its_target_left_alone(
    tmp_path: Path, call: str
) -> None:
    """index/<a>.flnpy replaced by a link: the next process to store an entry appended its
    48-byte records to the linked file (O_APPEND); a reader parsed that file as records."""
    root = tmp_path / "cache"
    Cache(root, shared=True).put("a", np.arange(3))
    victim = another_members_file(tmp_path)
    before = snapshot(victim)
    for digit in "0123456789abcdef":  # every shard: whichever "a" and "b" fall in
        plant(root / "index" / f"{digit}.flnpy", victim)
    cache = Cache(root)
    with pytest.raises(CacheError, match=REFUSED) as refused:
        if call == "get":
            cache.get("a")
        else:
            cache.put("b", np.arange(4))
    assert re.search(rf"{re.escape(str(root))}/index/[0-9a-f]\.flnpy {REFUSED}", str(refused.value))
    assert snapshot(victim) == before


def test_a_segment_swapped_for_a_link_is_refused_not_served(tmp_path: Path) -> None:
    """A segment replaced by a link to another member's private cache's segment, whose entry
    for the same name passes every check (magic, CRC32C, digest bytes): the reader served
    the other file's bytes as the sample, and touched its mtime (the budget orders by it)."""
    private = Cache(tmp_path / "home" / "private")
    private.put("a", np.full(3, 7))
    (theirs,) = (private.root / "segments").iterdir()
    os.utime(theirs, (1e9, 1e9))
    before = snapshot(theirs)
    root = tmp_path / "cache"
    Cache(root, shared=True, max_bytes=10**9).put("a", np.arange(3))
    (segment,) = (root / "segments").iterdir()
    plant(segment, theirs)
    with pytest.raises(CacheError, match=f"{re.escape(str(segment))} {REFUSED}"):
        Cache(root).get("a")
    assert snapshot(theirs) == before


def test_a_fifo_where_a_segment_was_is_refused_at_once(tmp_path: Path) -> None:
    """A FIFO needs no link: opening it to read waited for a writer, for ever."""
    root = tmp_path / "cache"
    Cache(root, shared=True).put("a", np.arange(3))
    (segment,) = (root / "segments").iterdir()
    segment.unlink()
    os.mkfifo(segment, 0o660)
    found: list[list[str]] = []
    reader = threading.Thread(
        target=lambda: found.append(outcome(lambda: Cache(root).get("a"))), daemon=True
    )
    reader.start()
    reader.join(timeout=30)
    if reader.is_alive():  # stuck in open(): a writer's open lets it go (the test fails)
        os.close(os.open(segment, os.O_WRONLY | os.O_NONBLOCK))
        reader.join()
    (kinds, message), *_ = found
    assert "CacheError" in kinds.split(",") and f"{segment} {REFUSED}" in message, found


def test_a_folder_swapped_for_a_link_before_its_mode_is_set_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shared cache's new folder was chmod-ed 2770 by its path after the mkdir: a member
    who swapped a link in for it in between had the maker chmod the link's target (another
    member's ~/.ssh, say). The swap is made right after the mkdir (a link put there before
    fails the mkdir itself, and ``make_dirs`` takes a link to a folder for one made)."""
    victim = tmp_path / "home" / ".ssh"
    victim.mkdir(parents=True)
    victim.chmod(0o700)
    root = tmp_path / "cache"
    mkdir = Path.mkdir

    def mkdir_then_swap(path: Path, mode: int = 0o777, *args: Any, **kwargs: Any) -> None:
        mkdir(path, mode, *args, **kwargs)
        if path == root / "segments":
            path.rmdir()
            path.symlink_to(victim)

    monkeypatch.setattr(Path, "mkdir", mkdir_then_swap)
    folder = re.escape(str(root / "segments"))
    with pytest.raises(CacheError, match=f"{folder} is a symlink or not a folder: refused"):
        Cache(root, shared=True)
    assert stat.S_IMODE(victim.stat().st_mode) == 0o700
    assert list(victim.iterdir()) == []


def test_cache_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"Cache\.shared must be None, True or False, got 'yes'"):
        Cache(tmp_path / "c", shared="yes")  # type: ignore[arg-type]
    Cache(tmp_path / "c").put("a", np.arange(3))
    with pytest.raises(ConfigError, match="holds a cache private to its maker"):
        Cache(tmp_path / "c", shared=True)
    assert json.loads((tmp_path / "c" / "fastload-cache.json").read_text())["shared"] is False


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        yield disk


def test_cache_verify_on_a_full_disk_names_the_file_it_could_not_write(
    small_disk: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`fastload cache verify` on a full disk said only '[Errno 28] No space left on device'."""
    root = small_disk / "c"
    cache = Cache(root)
    rng = np.random.default_rng(0)
    with pytest.raises(CacheFullError, match=rf"ENOSPC.*: {root}/segments/\w+\.flnpy"):
        for i in range(1000):
            cache.put(f"k{i}", rng.random(2000))
    code = main(["cache", "verify", str(root)])
    err = capsys.readouterr().err
    assert code == 1
    assert re.search(rf"ENOSPC: No space left on device\): {root}/usage-\w+\n", err), err


def test_repairs_that_cannot_be_written_name_the_file(tmp_path: Path) -> None:
    """verify's repair of a corrupt entry appends a removal record to an index shard: when
    that cannot be written (here a file-size limit, EFBIG; a full disk is ENOSPC) the error
    named no file."""
    root = tmp_path / "c"
    cache = Cache(root)
    for i in range(8):
        cache.put(f"k{i}", np.full(50, i))
    digest = cache._digest("k3")
    where = segments_of(cache).find(digest)
    assert where is not None
    segment = Path(segments_of(cache)._segment_path(where.segment))
    with open(segment, "r+b") as f:  # flip a byte of k3's arrays
        f.seek(where.offset + where.length - 20)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    shard = root / "index" / f"{digest[: segments_of(cache).width]}.flnpy"
    found = run_job(
        "verify_under_a_file_size_limit", str(root), str(shard.stat().st_size), uid=None
    )
    assert found["code"] == 1
    assert f"(EFBIG: File too large): {shard}\n" in found["stderr"], found["stderr"]
