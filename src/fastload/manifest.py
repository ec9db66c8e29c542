"""Manifest: the list of a dataset's objects, listed once (in parallel) and reloaded in no time.

Each entry is a key (relative to the manifest's root URL), a size, a version (ETag, GCS
generation, B2 file id, or mtime for local files) and an optional label. Columns are numpy
arrays (strings packed into one UTF-8 buffer), so a million entries save and load in a fraction
of a second and take tens of MB, not a list of a million Python objects.
"""

from __future__ import annotations

import asyncio
import csv
import hashlib
import io
import json
import logging
import os
import stat
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO, Any, TypeVar, overload

import fsspec.asyn
import numpy as np

from fastload._select import has_wildcard, literal_prefixes, matches, selected, split_pattern
from fastload.config import FetchConfig
from fastload.errors import ConfigError, ObjectNotFoundError
from fastload.fetcher import Request
from fastload.ranks import on_rank_zero, rank_world
from fastload.stores import open_store, parse_url
from fastload.stores._base import Listed, PageLister
from fastload.stores._listing import list_parallel
from fastload.stores._retry import retrying

__all__ = ["Entry", "Kept", "Manifest", "ManifestChanges"]

FORMAT = "fastload-manifest/1"
T = TypeVar("T")
log = logging.getLogger(__name__)


class Strings:
    """An immutable array of strings: one UTF-8 buffer plus end offsets."""

    def __init__(self, blob: np.ndarray, ends: np.ndarray) -> None:
        self.blob, self.ends = blob, ends

    @classmethod
    def of(cls, items: Sequence[str]) -> Strings:
        encoded = [s.encode("utf-8", "surrogatepass") for s in items]
        ends = np.cumsum([len(b) for b in encoded], dtype=np.int64)
        return cls(np.frombuffer(b"".join(encoded), dtype=np.uint8), ends)

    def __len__(self) -> int:
        return len(self.ends)

    def __getitem__(self, i: int) -> str:
        start = int(self.ends[i - 1]) if i > 0 else 0
        return self.blob[start : int(self.ends[i])].tobytes().decode("utf-8", "surrogatepass")

    def pick(self, indices: Sequence[int]) -> list[str]:
        """``[self[i] for i in indices]`` (each in [0, len)), worked out for all at once."""
        at = np.asarray(indices, dtype=np.int64)
        ends = self.ends[at]
        starts = np.where(at > 0, self.ends[at - 1], 0)
        view = self.blob.data
        return [
            str(view[a:b], "utf-8", "surrogatepass")
            for a, b in zip(starts.tolist(), ends.tolist(), strict=True)
        ]

    def tolist(self) -> list[str]:
        data = self.blob.tobytes()
        ends = self.ends.tolist()
        return [
            data[a:b].decode("utf-8", "surrogatepass")
            for a, b in zip([0, *ends][:-1], ends, strict=True)
        ]

    def take(self, indices: np.ndarray) -> Strings:
        """The strings at ``indices``, copied as bytes (nothing is decoded)."""
        ends = self.ends[indices]
        starts = np.where(indices > 0, self.ends[np.maximum(indices - 1, 0)], 0)
        data = self.blob.data
        blob = b"".join(data[a:b] for a, b in zip(starts.tolist(), ends.tolist(), strict=True))
        return Strings(np.frombuffer(blob, dtype=np.uint8), np.cumsum(ends - starts))


@dataclass(frozen=True)
class Entry:
    """One object of a :class:`Manifest`."""

    key: str
    size: int
    version: str
    url: str
    label: int | None = None

    def request(self, start: int | None = None, end: int | None = None) -> Request:
        """A read of this object (or of its bytes ``[start, end)``) as it was listed: bytes of
        another version raise :class:`fastload.ObjectChangedError`."""
        return Request(self.url, start, end, size=self.size, version=self.version or None)


@dataclass(frozen=True)
class Kept:
    """What a sample source keeps with a manifest, in the slot of its name (see
    :meth:`Manifest.keeping`): saved and loaded with it, so that a restart (or another host)
    does not compute it again. The manifest never looks inside.

    ``tag`` is the source's to check (the rule that made a grouping, an index's version);
    ``arrays`` its named numpy arrays (no objects: nothing is unpickled); ``by_key``: it names
    entries by key and version, not by position, so a new listing of the same root keeps it
    (each part applies only to the objects it names)."""

    tag: str
    arrays: Mapping[str, np.ndarray]
    by_key: bool = False


@dataclass(frozen=True)
class ManifestChanges:
    """What :meth:`Manifest.refresh` found: counts of keys added, removed and changed."""

    added: int
    removed: int
    changed: int
    manifest: Manifest

    @property
    def any(self) -> bool:
        return bool(self.added or self.removed or self.changed)


class Manifest(Sequence[Entry]):
    """The objects under one root URL, sorted by key; see :meth:`build` and :meth:`load`.

    ``pattern``: the key pattern it was listed with (see :meth:`build`), which :meth:`refresh`
    lists with again.
    """

    def __init__(
        self,
        root: str,
        keys: Sequence[str] | Strings,
        sizes: Sequence[int] | np.ndarray,
        versions: Sequence[str] | Strings,
        *,
        labels: Sequence[int] | np.ndarray | None = None,
        classes: Sequence[str] | None = None,
        kept: Mapping[str, Kept] | None = None,
        pattern: str | None = None,
    ) -> None:
        self.root = str(parse_url(root)).rstrip("/")
        self.pattern = pattern
        self.kept: Mapping[str, Kept] = dict(kept or {})
        """What sample sources keep with this manifest, by slot (see :meth:`keeping`)."""
        self._keys = keys if isinstance(keys, Strings) else Strings.of(list(keys))
        self._versions = versions if isinstance(versions, Strings) else Strings.of(versions)
        self._sizes = np.asarray(sizes, dtype=np.int64)
        self._labels = None if labels is None else np.asarray(labels, dtype=np.int64)
        self.classes = None if classes is None else tuple(classes)
        _check_keys(self._keys, self.root)
        lengths = {len(self._keys), len(self._sizes), len(self._versions)}
        if self._labels is not None:
            lengths.add(len(self._labels))
        if len(lengths) != 1:
            raise ConfigError(f"Manifest columns differ in length: {sorted(lengths)}")
        for column in (self._sizes, self._labels):
            if column is not None:
                column.setflags(write=False)

    # -- building ------------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        url: str,
        *,
        pattern: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        parallel: bool = True,
        concurrency: int = 32,
        fetch_config: FetchConfig | None = None,
    ) -> Manifest:
        """List every object under ``url`` (once; in parallel where the store allows).

        ``pattern`` keeps the keys (relative to ``url``) it matches: brace lists as WebDataset
        writes them (``shard-{000..099}.tar``, ``{train,val}/*``), then fnmatch (``*`` also
        matches ``/``); a name it gives exactly that is missing is an ObjectNotFoundError. A
        brace list in ``url`` itself starts the pattern: ``s3://b/train/shard-{000..099}.tar``
        lists ``s3://b/train`` with the pattern ``shard-{000..099}.tar``.
        Under torch.distributed, rank 0 lists and broadcasts; other ranks never list.
        Each listing request is timed out and retried as fetches are (``fetch_config``,
        default :meth:`FetchConfig.from_env`).
        """
        config = fetch_config or FetchConfig.from_env()
        return on_rank_zero(
            lambda: cls._list(
                url,
                pattern=pattern,
                storage_options=storage_options,
                parallel=parallel,
                concurrency=concurrency,
                config=config,
            )
        )

    @classmethod
    def _list(
        cls,
        url: str,
        *,
        pattern: str | None,
        storage_options: Mapping[str, Any] | None,
        parallel: bool,
        concurrency: int,
        config: FetchConfig,
    ) -> Manifest:
        url, pattern = _with_pattern(url, pattern)
        root = parse_url(url)
        store = open_store(root, storage_options)
        lister = store.lister(root.bucket)  # (stores raise fastload's errors only)
        if lister is not None:
            prefix = root.key.rstrip("/") + "/" if root.key.strip("/") else ""
            scopes = [prefix + start for start in literal_prefixes(pattern)]  # not all
            loop = fsspec.asyn.get_loop()
            found = fsspec.asyn.sync(
                loop,
                _list_scopes,
                lister,
                scopes,
                concurrency=concurrency if parallel else 1,
                config=config,
                split=parallel,
            )
            listed = [Listed(e.key[len(prefix) :], e.size, e.version) for e in found]
        else:  # the store's find in one call, retried whole as a page would be
            listed = fsspec.asyn.sync(
                fsspec.asyn.get_loop(),
                retrying,
                partial(asyncio.to_thread, store.find, root),
                give_up=lambda failures, _: failures > config.retries,
                backoff=config.backoff,
                max_backoff=config.max_backoff,
            )
        listed = selected([e for e in listed if not _is_marker(e)], pattern, str(root))
        if not listed:
            raise ObjectNotFoundError(
                "no objects under this prefix"
                + (f" matching {pattern!r}" if pattern else _glob_hint(str(root))),
                url=str(root),
            )
        return cls(
            str(root),
            [e.key for e in listed],
            [e.size for e in listed],
            [e.version for e in listed],
            pattern=pattern,
        )

    # -- access --------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._sizes)

    @overload
    def __getitem__(self, index: int) -> Entry: ...

    @overload
    def __getitem__(self, index: slice) -> Manifest: ...

    def __getitem__(self, index: int | slice) -> Entry | Manifest:
        if isinstance(index, slice):
            return self._take(np.arange(*index.indices(len(self))))  # the slice's alone
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"Manifest index {index} out of range for {n} entries")
        i = index % n
        key = self._keys[i]
        label = None if self._labels is None else int(self._labels[i])
        return Entry(key, int(self._sizes[i]), self._versions[i], self.url(key), label)

    def identities(self, indices: Sequence[int]) -> list[tuple[str, str, int | None]]:
        """The URL, version and label of the entries at ``indices`` (each in range), as
        ``self[i]`` gives them, without an :class:`Entry` each (a warm batch's cache names)."""
        keys, versions = self._keys.pick(indices), self._versions.pick(indices)
        labels = [None] * len(keys) if self._labels is None else self._labels[indices].tolist()
        return [
            (self.url(key), version, label)
            for key, version, label in zip(keys, versions, labels, strict=True)
        ]

    def __iter__(self) -> Iterator[Entry]:
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        return f"Manifest({self.root!r}, {len(self)} entries, fingerprint={self.fingerprint})"

    def url(self, key: str) -> str:
        return f"{self.root}/{key}"

    def keys(self) -> list[str]:
        return self._keys.tolist()

    def urls(self) -> list[str]:
        return [self.url(k) for k in self.keys()]

    @property
    def sizes(self) -> np.ndarray:
        return self._sizes

    @property
    def labels(self) -> np.ndarray | None:
        return self._labels

    @property
    def total_bytes(self) -> int:
        return int(self._sizes.sum())

    @property
    def fingerprint(self) -> str:
        """Changes whenever a key, size or version (or the root) changes."""
        digest = hashlib.sha256(self.root.encode("utf-8", "surrogatepass"))
        for array in (self._keys.blob, self._keys.ends, self._sizes):
            digest.update(array.tobytes())
        digest.update(self._versions.blob.tobytes())
        digest.update(self._versions.ends.tobytes())
        return digest.hexdigest()[:32]

    # -- deriving ------------------------------------------------------------------------

    def _take(self, indices: np.ndarray) -> Manifest:
        indices = np.asarray(indices, dtype=np.int64)
        labels = None if self._labels is None else self._labels[indices]
        return Manifest(
            self.root,
            self._keys.take(indices),
            self._sizes[indices],
            self._versions.take(indices),
            labels=labels,
            classes=self.classes,
            pattern=self.pattern,
        )

    def filter(
        self, predicate: Callable[[Entry], bool] | None = None, *, pattern: str | None = None
    ) -> Manifest:
        """The entries whose key ``pattern`` keeps (as :meth:`build`'s, but a name it gives
        that is absent is no error) and for which ``predicate`` holds."""
        keeps = None if pattern is None else matches(pattern)[1]
        keep = [
            i
            for i, entry in enumerate(self)
            if (keeps is None or keeps(entry.key)) and (predicate is None or predicate(entry))
        ]
        return self._take(np.asarray(keep, dtype=np.int64))

    def subset(self, n: int, seed: int = 0) -> Manifest:
        """``n`` entries chosen by ``seed`` (same seed, same subset), kept in key order."""
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= len(self):
            raise ConfigError(f"Manifest.subset n must be an int in [0, {len(self)}], got {n!r}")
        chosen = np.random.default_rng(seed).choice(len(self), size=n, replace=False)
        return self._take(np.sort(chosen))

    def with_labels(
        self,
        labels: Mapping[str, int | str] | str | os.PathLike[str],
        *,
        key_field: str = "key",
        label_field: str = "label",
        missing: str = "error",
        classes: Sequence[str] | None = None,
    ) -> Manifest:
        """Join labels by key from a mapping or a CSV/JSON file.

        Keys may be relative to the root or full URLs. Integer labels are kept as they are;
        string labels become codes into :attr:`classes` (sorted, unless ``classes`` gives the
        names and their order). ``missing="drop"`` drops unlabelled entries instead of raising.
        """
        if missing not in {"error", "drop"}:
            raise ConfigError(f"with_labels missing must be 'error' or 'drop', got {missing!r}")
        table = (
            dict(labels)
            if isinstance(labels, Mapping)
            else read_labels(Path(labels), key_field, label_field)
        )
        prefix = self.root + "/"
        table = {(k[len(prefix) :] if k.startswith(prefix) else k): v for k, v in table.items()}
        keys = self.keys()
        keep = [i for i, k in enumerate(keys) if k in table]
        if len(keep) < len(keys) and missing == "error":
            absent = [k for k in keys if k not in table]
            raise ConfigError(
                f"{len(absent)} of {len(keys)} objects under {self.root} have no label "
                f"(first: {absent[:3]}); pass missing='drop' to leave them out"
            )
        named = [keys[i] for i in keep]
        codes, names = label_codes([table[key] for key in named], self.root, named, classes)
        chosen = self._take(np.asarray(keep, dtype=np.int64))
        return Manifest(
            self.root,
            chosen._keys,
            chosen._sizes,
            chosen._versions,
            labels=codes,
            classes=names,
            pattern=self.pattern,
        )

    def keeping(self, slot: str, kept: Kept) -> Manifest:
        """This manifest carrying ``kept`` in ``slot`` (a sample source's name for what it
        keeps: its grouping, its shards' indexes), saved with it and dropped by any derived
        manifest (whose entries differ)."""
        return Manifest(
            self.root,
            self._keys,
            self._sizes,
            self._versions,
            labels=self._labels,
            classes=self.classes,
            kept={**self.kept, slot: kept},
            pattern=self.pattern,
        )

    def _identities(self) -> dict[str, tuple[int, str]]:
        identity = zip(self._sizes.tolist(), self._versions.tolist(), strict=True)
        return dict(zip(self.keys(), identity, strict=True))

    # -- persistence ---------------------------------------------------------------------

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write atomically (a reader never sees half a file) in fastload's .npz layout."""
        target = Path(path)
        if target.is_dir():
            raise ConfigError(f"Manifest.save needs a file path, got a folder: {target}")
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as out:
                _share_as(fd, target.parent)
                self._write(out)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def to_bytes(self) -> bytes:
        """The manifest as :meth:`save` writes it (the .npz file's bytes); :meth:`from_bytes`
        reads it back."""
        out = io.BytesIO()
        self._write(out)
        return out.getvalue()

    def _write(self, out: IO[bytes]) -> None:
        meta = {
            "format": FORMAT,
            "root": self.root,
            "pattern": self.pattern,
            "count": len(self),
            "fingerprint": self.fingerprint,
            "classes": self.classes,
            "kept": {slot: [k.tag, k.by_key] for slot, k in self.kept.items()},
        }
        arrays = {
            "key_blob": self._keys.blob,
            "key_ends": self._keys.ends,
            "sizes": self._sizes,
            "version_blob": self._versions.blob,
            "version_ends": self._versions.ends,
        }
        if self._labels is not None:
            arrays["labels"] = self._labels
        for slot, k in self.kept.items():
            arrays.update({f"{_KEPT}{slot}.{name}": values for name, values in k.arrays.items()})
        meta["checksum"] = _checksum(meta, arrays)
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        np.savez(out, **arrays)  # type: ignore[arg-type]  # numpy's stub

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, url: str | None = None) -> Manifest:
        """Read a saved manifest; with ``url``, refuse one listed from a different root (or
        with another pattern than a brace list in ``url`` gives).

        A file that is missing raises ``FileNotFoundError``; one that is empty, truncated,
        foreign or damaged raises :class:`ConfigError` naming it.
        """
        manifest = cls._parsed(Path(path), path)
        if url is not None:
            root, pattern = split_pattern(url)
            other = pattern is not None and pattern != manifest.pattern
            if str(parse_url(root)).rstrip("/") != manifest.root or other:
                listed = manifest.root + (
                    "" if manifest.pattern is None else f"/{manifest.pattern}"
                )
                raise ConfigError(f"manifest {path} lists {listed}, not {url}")
        return manifest

    @classmethod
    def from_bytes(cls, data: bytes, *, name: str = "manifest bytes") -> Manifest:
        """A manifest from :meth:`to_bytes`; bytes that are truncated, foreign or damaged raise
        :class:`ConfigError` naming ``name`` (nothing in them is unpickled)."""
        return cls._parsed(data, name)

    @classmethod
    def _parsed(cls, source: Path | bytes, name: str | os.PathLike[str]) -> Manifest:
        try:
            manifest, meta = cls._read(source, name)
        except (ConfigError, FileNotFoundError):
            raise
        except Exception as exc:  # zip, numpy and JSON each fail in their own way
            reason = f"{type(exc).__name__}: {exc}"[:200]
            raise ConfigError(f"not a readable fastload manifest: {name} ({reason})") from exc
        if manifest.fingerprint != meta.get("fingerprint"):
            raise ConfigError(f"manifest is corrupt (fingerprint mismatch): {name}")
        return manifest

    @classmethod
    def _read(
        cls, source: Path | bytes, name: str | os.PathLike[str]
    ) -> tuple[Manifest, dict[str, Any]]:
        # numpy leaves its own handle open when a zip is damaged: open the file here
        opened = source.open("rb") if isinstance(source, Path) else io.BytesIO(source)
        with opened as file, np.load(file, allow_pickle=False) as data:
            if not isinstance(data, np.lib.npyio.NpzFile):
                raise ConfigError(f"not a {FORMAT} file (a bare array): {name}")
            meta = json.loads(data["meta"].tobytes())
            if not isinstance(meta, dict) or meta.get("format") != FORMAT:
                raise ConfigError(f"not a {FORMAT} file: {name}")
            arrays = {field: data[field] for field in data.files if field != "meta"}
            if meta.get("checksum") != _checksum(meta, arrays):
                raise ConfigError(
                    f"manifest is corrupt or was edited (its checksum does not match its "
                    f"content; one saved before checksums is listed again): {name}"
                )
            manifest = cls(
                meta["root"],
                Strings(data["key_blob"], data["key_ends"]),
                data["sizes"],
                Strings(data["version_blob"], data["version_ends"]),
                labels=data.get("labels"),
                classes=meta.get("classes"),
                kept=_kept(meta, arrays),
                pattern=meta.get("pattern"),
            )
        return manifest, meta

    def refresh(
        self, *, storage_options: Mapping[str, Any] | None = None, parallel: bool = True
    ) -> ManifestChanges:
        """List the root again (with its :attr:`pattern`) and count what was added, removed or
        changed."""
        return self._changes(
            Manifest.build(
                self.root, pattern=self.pattern, storage_options=storage_options, parallel=parallel
            )
        )

    def _changes(self, new: Manifest) -> ManifestChanges:
        if new.fingerprint == self.fingerprint:
            return ManifestChanges(0, 0, 0, self)
        before = self._identities()
        after = new._identities()
        added = len(after.keys() - before.keys())
        removed = len(before.keys() - after.keys())
        changed = sum(1 for k in after.keys() & before.keys() if after[k] != before[k])
        return ManifestChanges(added, removed, changed, new)


def _check_keys(keys: Strings, root: str) -> None:
    """Refuse a key that would read outside ``root``: an absolute key (``/etc/x``) or one
    with a ``..`` segment (``../secret.npy``, ``a/../../b``), which a local filesystem or an
    HTTP client that tidies paths resolves above the root. Found by one scan of the keys'
    bytes (only keys holding ``..`` or starting with ``/`` are decoded)."""
    if not len(keys) or not len(keys.blob):
        return
    starts = np.concatenate(([0], keys.ends[:-1]))
    filled = keys.ends > starts
    first = keys.blob[np.minimum(starts, len(keys.blob) - 1)]
    suspects = set(np.flatnonzero(filled & (first == ord("/"))).tolist())
    blob = keys.blob
    dots = np.flatnonzero((blob[:-1] == ord(".")) & (blob[1:] == ord(".")))  # overlapping too
    suspects.update(np.searchsorted(keys.ends, dots, side="right").tolist())
    for index in sorted(suspects):
        key = keys[index]
        if key.startswith("/") or ".." in key.split("/"):
            raise ConfigError(
                f"manifest key {key!r} leads outside the dataset root {root} (an absolute key "
                f"or a '..' segment): refused; leave it out with pattern=, or rename the object"
            )


def _checksum(meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> str:
    """A digest of a saved manifest's whole content: its metadata (but the checksum itself)
    and every array, with its name, type and shape. A flipped bit or an edited label no longer
    loads (the fingerprint covers keys, sizes and versions only). Not a signature: whoever can
    write the file can write a matching checksum; keys are checked on their own
    (:func:`_check_key`)."""
    digest = hashlib.sha256(
        json.dumps({k: v for k, v in meta.items() if k != "checksum"}, sort_keys=True).encode()
    )
    for field in sorted(arrays):
        array = np.ascontiguousarray(arrays[field])
        digest.update(f"{field}:{array.dtype.str}:{array.shape}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def _with_pattern(url: str, pattern: str | None) -> tuple[str, str | None]:
    """``url``'s folder and the key pattern, from ``pattern`` or a brace list in ``url``."""
    root, in_url = split_pattern(url)
    if in_url is not None and pattern is not None:
        raise ConfigError(f"give the key pattern in the URL or as pattern=, not both: {url!r}")
    return root, in_url if pattern is None else pattern


async def _list_scopes(
    lister: PageLister, scopes: list[str], *, concurrency: int, config: FetchConfig, split: bool
) -> list[Listed]:
    """Every key under each of ``scopes`` (none a prefix of another), sorted; the listings run
    at once and share ``concurrency``."""
    share = max(1, concurrency // len(scopes))
    parts = await asyncio.gather(
        *(
            list_parallel(lister, scope, concurrency=share, config=config, split=split)
            for scope in scopes
        )
    )
    return sorted((entry for part in parts for entry in part), key=lambda entry: entry.key)


def _glob_hint(url: str) -> str:
    """What to write instead, when a URL that listed nothing looks like a glob: without a brace
    list, ``*``, ``?`` and ``[`` are a key's own characters (a key may hold them)."""
    folder, _, last = url.rpartition("/")
    if not has_wildcard(last):
        return ""
    return (
        f" ('*', '?' and '[' in a URL without a brace list are a key's own characters; for the "
        f"keys a glob matches, RemoteDataset(Objects({folder!r}, pattern={last!r})) or "
        f"Manifest.build({folder!r}, pattern={last!r}); on the command line, "
        f"{folder} --pattern {last!r})"
    )


def saved_or_listed(
    url: str,
    path: Path,
    *,
    pattern: str | None = None,
    storage_options: Mapping[str, Any] | None,
    fetch_config: FetchConfig | None,
) -> tuple[Manifest, Future[ManifestChanges] | None]:
    """The manifest of ``url`` (keys matching ``pattern``) saved at ``path``, else a new
    listing (saved there).

    A saved manifest is used at once, and listed again in the background: when the store's
    listing differs, a warning says how, and the new listing is saved for the next start (this
    run keeps the one it started with, so its indices stay put). The returned future holds what
    that check found (None when nothing was saved). Under torch.distributed or XLA, rank 0
    decides and the others receive its manifest; only rank 0 checks.
    """
    config = fetch_config or FetchConfig.from_env()
    wanted = _with_pattern(url, pattern)[1]  # (not both)

    def listed() -> Manifest:
        return Manifest._list(
            url, pattern=pattern, storage_options=storage_options, parallel=True,
            concurrency=32, config=config,
        )  # fmt: skip

    def on_zero() -> tuple[Manifest, bool]:
        try:
            saved = Manifest.load(path, url=url)
            if saved.pattern == wanted:
                return saved, True
            raise ConfigError(f"it keeps only the keys matching {saved.pattern!r}")
        except FileNotFoundError:
            pass
        except ConfigError as exc:
            log.warning("listing %s again: its saved manifest is unusable (%s)", url, exc)
        manifest = listed()
        save_listing(manifest, path)
        return manifest, False

    manifest, saved = on_rank_zero(on_zero)
    if not saved or rank_world()[0] != 0:
        return manifest, None
    return manifest, _in_background(lambda: _check(manifest, listed(), path))


def _check(saved: Manifest, new: Manifest, path: Path) -> ManifestChanges:
    changes = saved._changes(new)
    if changes.any:
        log.warning(
            "the listing of %s changed since its manifest was saved (%d added, %d removed, "
            "%d changed): this run uses the saved one; the next start uses the new listing",
            saved.root,
            changes.added,
            changes.removed,
            changes.changed,
        )
        for slot, kept in saved.kept.items():  # each part applies to its own key and version
            new = new.keeping(slot, kept) if kept.by_key else new
        save_listing(new, path)
    return changes


def _share_as(fd: int, folder: Path) -> None:
    """A manifest saved in a folder that its group shares (group rwx and setgid: a shared
    cache's ``manifests/``, see docs/cache.md) is its group's to read and replace too
    (``mkstemp`` makes it 0600, which no one else could load)."""
    mode = os.stat(folder).st_mode
    if mode & stat.S_ISGID and mode & stat.S_IRWXG == stat.S_IRWXG:
        os.fchmod(fd, 0o660)


def save_listing(manifest: Manifest, path: Path) -> None:
    """``manifest.save(path)``, or a note in the log where it cannot be saved."""
    try:
        manifest.save(path)
    except OSError as exc:  # a read-only cache, say: the listing still serves this run
        log.info("could not save the manifest of %s at %s (%s)", manifest.root, path, exc)


def _in_background(work: Callable[[], T]) -> Future[T]:
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(work())
        except BaseException as exc:
            log.warning("could not check a saved listing against the store: %s", exc)
            future.set_exception(exc)

    threading.Thread(target=run, name="fastload-listing-check", daemon=True).start()
    return future


_MARKER_NAMES = (".bzEmpty",)  # what B2's web console writes to make a "folder"

_KEPT = "kept."  # prefix of the saved arrays of a slot: kept.<slot>.<name>
_BEFORE_SLOTS = {  # manifests saved before slots: their fields, slots and array prefixes
    "grouping": ("groups", "group_", False),
    "shard_index": ("shards", "shard_index.", True),
}


def _kept(meta: dict[str, Any], arrays: Mapping[str, np.ndarray]) -> dict[str, Kept]:
    """The slots of a saved manifest (those of one saved before slots too, by prefix)."""
    named = {
        slot: (tag, by_key, f"{_KEPT}{slot}.")
        for slot, (tag, by_key) in meta.get("kept", {}).items()
    }
    for field, (slot, prefix, by_key) in _BEFORE_SLOTS.items():
        if meta.get(field) is not None:
            named[slot] = (meta[field], by_key, prefix)
    return {
        slot: Kept(
            str(tag),
            {k.removeprefix(prefix): v for k, v in arrays.items() if k.startswith(prefix)},
            bool(by_key),
        )
        for slot, (tag, by_key, prefix) in named.items()
    }


def _is_marker(entry: Listed) -> bool:
    """A folder marker, not a sample: ``sub/`` (S3/GCS consoles) or an empty ``.bzEmpty``."""
    if not entry.key or entry.key.endswith("/"):
        return True
    return entry.size == 0 and entry.key.rsplit("/", 1)[-1] in _MARKER_NAMES


def current(url: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``size`` and ``version`` the object at ``url`` has now (one stat), named as a
    listing names them."""
    parsed = parse_url(url)
    now = open_store(parsed, storage_options).stat(parsed)  # fastload's errors, naming it
    return {"size": now.size, "version": now.version}


def label_codes(
    values: Sequence[Any], root: str, keys: Sequence[str], classes: Sequence[str] | None = None
) -> tuple[list[int], list[str] | None]:
    """Each label's code, and the class names when the labels are names (codes index them,
    names sorted); integer labels are their own codes. A mix of the two is refused: sorted as
    text, 10 would come before 2 and every code past it would move, silently. ``classes``
    fixes the names and their order (another split's, which may hold a class this one lacks):
    a name is its place there, an integer must be one of its places."""
    values = [_as_label(v, f"{root}/{key}") for v, key in zip(values, keys, strict=True)]
    if classes is not None:
        fixed = check_classes(classes)
        return _placed(values, root, keys, fixed), list(fixed)
    numbers = [isinstance(v, int) for v in values]
    if all(numbers):
        return [int(v) for v in values], None
    if any(numbers):
        names = sorted({str(v) for v, n in zip(values, numbers, strict=True) if not n})
        raise ConfigError(
            f"labels under {root} mix {sum(numbers)} integers and {len(values) - sum(numbers)} "
            f"names (such as {names[:3]}): give every label as an integer or every one as a name"
        )
    classes = sorted({str(v) for v in values})
    index = {c: i for i, c in enumerate(classes)}
    return [index[str(v)] for v in values], classes


def check_classes(classes: object) -> tuple[str, ...]:
    """``classes=`` as a tuple of distinct non-empty names, or a ConfigError. Any ordered
    sequence of names will do (a list, a tuple, a numpy array, a pandas Index); a set has no
    order to code classes by."""
    unordered = isinstance(classes, str | bytes | Mapping | set | frozenset)
    names = () if unordered or not isinstance(classes, Iterable) else tuple(classes)
    if not names or not all(isinstance(c, str) and c for c in names):
        raise ConfigError(
            f"classes must be a non-empty list of class names in code order (such as another "
            f"split's dataset.classes), got {classes!r}"
        )
    names = tuple(map(str, names))  # numpy's str_ as plain str
    if len(set(names)) < len(names):
        twice = sorted({c for c in names if names.count(c) > 1})
        raise ConfigError(f"classes names {twice[:3]} twice: each class needs one code")
    return names


def _placed(
    values: list[int | str], root: str, keys: Sequence[str], classes: tuple[str, ...]
) -> list[int]:
    """Each label's place in ``classes`` (an integer label is one already); a ConfigError
    naming the labels that have none."""
    index = {c: i for i, c in enumerate(classes)}
    codes = [v if isinstance(v, int) else index.get(v, -1) for v in values]
    unknown = {
        str(v): k for v, k, c in zip(values, keys, codes, strict=True) if not 0 <= c < len(classes)
    }
    if unknown:
        shown = [f"{v!r} ({root}/{k})" for v, k in list(unknown.items())[:3]]
        raise ConfigError(
            f"labels under {root} not among the {len(classes)} classes given: "
            f"{', '.join(shown)}; classes= must name every label (an integer one: a place "
            f"below {len(classes)})"
        )
    return codes


def read_labels(path: Path, key_field: str, label_field: str) -> dict[str, int | str]:
    try:
        text = path.read_text(encoding="utf-8-sig")  # a spreadsheet's CSV starts with a BOM
    except OSError as exc:
        raise ConfigError(f"cannot read labels file {path}: {exc}") from exc
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
            rows: Iterable[Mapping[str, Any]] = (
                data
                if isinstance(data, list)
                else [{key_field: k, label_field: v} for k, v in data.items()]
            )
        else:
            reader = csv.DictReader(io.StringIO(text))
            columns = list(reader.fieldnames or [])
            absent = [f for f in (key_field, label_field) if f not in columns]
            if absent:
                raise ConfigError(
                    f"labels file {path} has no column {absent[0]!r}; its columns are "
                    f"{columns}: say which holds the key and which the label (e.g. "
                    f"fastload.Labels(..., key={columns[0]!r}, field={columns[-1]!r}))"
                    if columns
                    else f"labels file {path} is empty"
                )
            rows = reader
        pairs = [(str(row[key_field]), _maybe_int(row[label_field])) for row in rows]
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(
            f"labels file {path} needs {key_field!r} and {label_field!r} fields ({exc})"
        ) from exc
    table = dict(pairs)
    clashes = sorted({key for key, label in pairs if table[key] != label})
    if clashes:  # which one is the sample's? (the same label twice is harmless)
        raise ConfigError(
            f"labels file {path} gives {len(clashes)} keys two different labels, e.g. {clashes[:5]}"
        )
    return table


def _as_label(value: Any, url: str) -> int | str:
    """A label as an int (any integer, a bool, an integral float) or a name (a str); a missing
    one (None, NaN, an empty or "nan" text) or any other value is a ConfigError. (numpy
    integers were taken as names and sorted as text: 10 before 2, every code moved.)"""
    if isinstance(value, bool | np.bool_ | int | np.integer):
        return int(value)
    if isinstance(value, float | np.floating) and np.isfinite(value) and value == int(value):
        return int(value)
    if isinstance(value, str) and value.strip() and value.strip().lower() != "nan":
        return value
    nan = isinstance(value, float | np.floating) and not np.isfinite(value)
    missing = value is None or isinstance(value, str) or nan  # None, NaN, "", "nan"
    what = "a missing label" if missing else "a label that is neither an integer nor a class name:"
    raise ConfigError(
        f"{url}: {what} {value!r}; give every sample an integer or a class "
        "name, or leave the unlabelled ones out of the table"
    )


def _maybe_int(value: Any) -> Any:
    """A label as an integer when it is one: ``3``, ``"3"``, and ``3.0`` or ``"3.0"`` (pandas
    writes an integer column holding a missing value as floats); else as it is (a name, or a
    JSON value that :func:`_as_label` judges)."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    try:
        return int(text)
    except ValueError:
        pass
    try:
        number = float(text)
    except ValueError:
        return text
    return int(number) if number.is_integer() else text
