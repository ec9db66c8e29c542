"""Many samples in one tar shard, read in place (the WebDataset layout).

A sample is the run of members that share a basename (``n01/000123.jpg``, ``n01/000123.cls``:
key ``n01/000123``); ``decode`` receives ``{extension: bytes}`` (``{"jpg": ..., "cls": ...}``,
extensions lowercased as WebDataset does),
or decodes each member by pattern as for groups (``decode={"jpg": "image", "cls": int}``).

A sample whose extensions are not most samples' (or ``members=``) is incomplete, as a group of
objects is (:mod:`fastload.sources._complete`): ``incomplete`` says whether it is named (the
default), left out or kept.

Indexing a shard reads its headers with ranged reads that hop over large members and take small
ones in stride (a few requests per shard of small samples); the index is kept in the dataset's
cache by the shard's version, so a restart reads none of it again. Reading a sample checks its
first header against the index: a shard rewritten since it was indexed is an error, never a
wrong sample. A shard cut short (inside a member, inside a header or between two samples: a tar
ends with its end-of-archive marker) or with a damaged header is an error too, never a shard of
fewer samples.
"""

from __future__ import annotations

import logging
import re
import tarfile
import zlib
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass
from itertools import pairwise
from typing import Any

import numpy as np

from fastload.config import ChunkConfig
from fastload.errors import ConfigError, ShardError
from fastload.fetcher import Fetcher
from fastload.manifest import Entry, Manifest, Strings
from fastload.sources import DecodeSpec, Opening, Source
from fastload.sources._complete import Incomplete, Members, check_policy, incomplete_sets
from fastload.sources._indexes import SLOT
from fastload.sources._shards import Shards, check_chunks
from fastload.sources.groups import group_decoder
from fastload.transforms import GROUP_DECODERS, decoder, fingerprint, on_views

__all__ = ["Tar", "TarShards"]

log = logging.getLogger(__name__)

INDEX_VERSION = "tar-index/2"  # 2: links kept (size -1), not dropped; extensions lowercased
_BLOCK = tarfile.BLOCKSIZE
_BASENAME = re.compile(r"^((?:.*/)?[^./][^/]*?)\.([^/]*)$")  # key: up to the first dot of the name
# not sample data, left out as WebDataset leaves them out: hidden files, such as the AppleDouble
# companions macOS tar writes (``._000123.jpg``: the extended attributes of ``000123.jpg``) and
# ``.DS_Store``, and WebDataset's own ``__name__`` metadata members
_NOT_SAMPLES = re.compile(r"^(?:.*/)?(?:\.[^/]*|__[^/]*__)$")
_MIN_WINDOW, _MAX_WINDOW = 64 << 10, 16 << 20
_SHOWN = 5  # samples named in a message
_GAP = 256 << 10  # a window starting at most this far past the last starts at its end


@dataclass(frozen=True, eq=False)
class Tar(Source):
    """Many samples in each ``.tar`` object, read in place (see the module docstring and
    :class:`Source` for ``where``, ``pattern``, ``manifest_path`` and ``reuse_listing``).

    members: the extensions every sample has (``["jpg", "cls"]``) or their number, instead
        of what most samples have.
    incomplete: a sample that lacks an extension most have, or has an extra one: ``"raise"``
        names it, ``"skip"`` leaves it out (named in ``stats()``), ``"accept"`` keeps it.
    chunks: how runs of samples are read whole and kept in memory (a
        :class:`fastload.ChunkConfig`; default :meth:`ChunkConfig.from_env`).

    ``decode`` receives ``{extension: bytes}``, or decodes each member by pattern
    (``decode={"jpg": "image", "cls": int}``). ``on_error="skip"`` also leaves out a shard
    that cannot be indexed, naming it.
    """

    _: KW_ONLY
    members: Members = None
    incomplete: Incomplete = "raise"
    chunks: ChunkConfig | None = None

    name = "tar"
    by_member = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_policy(self.incomplete, self.members)
        check_chunks(self.chunks)

    def open(self, manifest: Manifest, opening: Opening) -> TarShards:
        return TarShards(
            manifest,
            opening.fetcher,
            cache=opening.cache,
            config=self.chunks,
            on_error=opening.on_error,
            incomplete=self.incomplete,
            members=self.members,
        )

    def decoder(self, decode: DecodeSpec) -> Callable[[Any], Any]:
        """What ``decode`` becomes over a sample's members, which :class:`TarShards` gives as
        views of their chunk: a member decoder that reads views in place (npy, raw) decodes
        its member from the chunk; any other member decoder, a callable or group decoder given
        the whole sample, and ``decode=None`` get ``bytes``, as documented
        (:func:`fastload.transforms.on_views`)."""
        if isinstance(decode, str) and decode not in GROUP_DECODERS:
            decode = {"*": decode}  # as group_decoder reads a name: every member by it
        if isinstance(decode, Mapping):
            return group_decoder({pattern: on_views(decoder(d)) for pattern, d in decode.items()})
        return _MembersAsBytes(super().decoder(None) if decode is None else group_decoder(decode))

    def warm_part(self, manifest: Manifest, part: tuple[int, int]) -> Manifest | None:
        """Whole shards: every count-th tar shard from i, and every object that is not one
        (the reader names or leaves those out on each host as for the whole). None where
        splitting by chunk is better: fewer shards than parts, or a manifest that keeps the
        shards' indexes (indexing reads nothing).

        Indexing a tar shard of small members reads it whole, so each host that indexed every
        shard to warm its own chunks read the whole dataset; by shard, each reads its shards
        once."""
        index, count = part
        if count == 1 or SLOT in manifest.kept:
            return None
        keys: list[str] = manifest.keys()
        tars = [key for key in keys if key.lower().endswith(TarShards.suffixes)]
        if len(tars) < count:
            return None
        others = set(tars) - set(tars[index::count])
        return manifest.filter(lambda entry: entry.key not in others)

    def warm_rounds(self, manifest: Manifest, memory_bytes: int) -> list[Manifest]:
        """Runs of the manifest whose shards are small enough for the reader to keep whole
        what indexing read of them (at most ``memory_bytes`` over a run's shards, each its
        equal share): warming a run then reads none of its shards again. The objects that are
        not tar shards go with the shards beside them; a manifest that keeps the shards'
        indexes (indexing reads nothing) is one run.

        Indexing every shard before warming any keeps only ``memory_bytes`` of what it read,
        so a dataset of small members larger than that was read twice: to index it, and to
        warm it."""
        if SLOT in manifest.kept:
            return [manifest]
        keys: list[str] = manifest.keys()
        sizes = manifest.sizes.tolist()
        starts: list[int] = []  # where each run's first shard is, from the last run back
        count = largest = 0
        # from the last shard back: the run that comes out short is the first, not the last
        # (a last shard of a few samples, or none, would be a dataset of no samples on its own)
        for at in range(len(keys) - 1, -1, -1):
            if not keys[at].lower().endswith(TarShards.suffixes):
                continue
            if count and (count + 1) * max(largest, sizes[at]) > memory_bytes:
                count = largest = 0
            if count:
                starts[-1] = at
            else:
                starts.append(at)
            count += 1
            largest = max(largest, sizes[at])
        bounds = [0, *reversed(starts[:-1]), len(keys)]
        return [manifest[a:b] for a, b in pairwise(bounds)]


class TarShards(Shards):
    """The samples in the ``.tar`` objects of a manifest (see the module docstring)."""

    suffixes = (".tar",)
    unreadable = (".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.zst", ".tzst")
    kind = "tar"
    index_version = INDEX_VERSION

    def __init__(
        self, *args: Any, incomplete: Incomplete = "raise", members: Members = None, **kwargs: Any
    ) -> None:
        check_policy(incomplete, members)
        if members is not None and not isinstance(members, int):  # extensions are lowercased
            members = [str(ext).lower().lstrip(".") for ext in members]
        self.incomplete, self.members = incomplete, members
        self._left_out: dict[frozenset[str], str] = {}  # incomplete sets, skipped: why
        self._reporting = True  # what is wrong with a member is reported (the first pass)
        super().__init__(*args, **kwargs)

    def _index(self, shard: Entry, fetcher: Fetcher) -> dict[str, np.ndarray]:
        index, prefix = _read_headers(shard, fetcher, self._seed_limit)
        if prefix:
            self._seeds[shard.url] = prefix
        return index

    def _fault(self, shard: Entry, index: dict[str, np.ndarray]) -> ShardError | None:
        """A shard with no room for the end-of-archive marker after its last member: cut short.
        Indexing checks more (:func:`_check_end`); this is what an index made before it did (and
        kept in a cache or a saved manifest) still shows of a shard cut between two samples or
        inside a header."""
        names = Strings(index["name_blob"], index["name_ends"])
        if not len(names):
            return None
        end = int(index["data"][-1]) + max(0, int(index["size"][-1]))
        end = -(-end // _BLOCK) * _BLOCK  # a member's bytes fill whole blocks
        if end + _BLOCK <= shard.size:
            return None
        return ShardError(
            f"truncated: it stops at byte {shard.size}, with no end-of-archive marker after "
            f"member {names[len(names) - 1]!r} (which ends at byte {end}): its samples from "
            "there on are lost",
            url=shard.url,
        )

    def _add_all(self, indexes: list[tuple[Entry, dict[str, np.ndarray]]]) -> None:
        """Every shard's samples, counting each set of extensions; under incomplete="skip",
        made again without the incomplete ones when there are any (see ``incomplete``)."""
        self._start_samples()
        super()._add_all(indexes)
        left_out = self._incomplete()
        if left_out:
            self._left_out, self._reporting = left_out, False
            self._start_samples()
            super()._add_all(indexes)

    def _start_samples(self) -> None:
        self._keys: list[str] = []
        self._starts: list[int] = []
        self._crcs: list[int] = []
        self._exts: list[str] = []
        self._offsets: list[int] = []
        self._sizes: list[int] = []
        self._first_member: list[int] = [0]
        self._roles: Counter[frozenset[str]] = Counter()  # samples by their extensions
        self._examples: dict[frozenset[str], list[str]] = {}

    def _incomplete(self) -> dict[frozenset[str], str]:
        """The sets of extensions that make a sample incomplete, with what is wrong with each,
        to leave out (``"skip"``); ``"raise"`` names them instead, ``"accept"`` keeps them."""
        why = incomplete_sets(self._roles, self.members)
        if not why or self.incomplete == "accept":
            return {}
        bad = sum(self._roles[roles] for roles in why)
        named = [f"{name!r}: {why[roles]}" for roles in why for name in self._examples[roles]]
        shown = "; ".join(named[:_SHOWN])
        if self.incomplete == "raise":
            raise ConfigError(
                f"{bad} of {self._roles.total()} tar samples under {self.root} are incomplete "
                f"({shown}); pass incomplete='skip' to leave them out or 'accept' to keep them"
            )
        log.warning("leaving out %d incomplete tar samples under %s: %s", bad, self.root, shown)
        return why

    def _add(self, shard: int, entry: Entry, index: dict[str, np.ndarray]) -> None:
        names = Strings(index["name_blob"], index["name_ends"]).tolist()
        header, data, size, crc = (index[k].tolist() for k in ("header", "data", "size", "crc"))
        chunk = (-1, 0, 0)  # first sample, start, end
        for key, members in self._samples_of(entry, names, size):
            roles = frozenset(ext for ext, _ in members)
            self._roles[roles] += 1
            if len(named := self._examples.setdefault(roles, [])) < _SHOWN:
                named.append(f"{entry.url}#{key}")
            start = header[members[0][1]]
            end = max(data[i] + size[i] for _, i in members)
            first, chunk_start, chunk_end = chunk
            if first < 0 or max(end, chunk_end) - chunk_start > self.config.chunk_bytes:
                if first >= 0:
                    self._chunk(shard, first, chunk_start, chunk_end)
                chunk = (self._count, start, end)
            else:
                chunk = (first, chunk_start, max(end, chunk_end))
            self._keys.append(key)
            self._starts.append(start)
            self._crcs.append(crc[members[0][1]])
            for ext, i in members:
                self._exts.append(ext)
                self._offsets.append(data[i] - start)
                self._sizes.append(size[i])
            self._first_member.append(len(self._exts))
            self._count += 1
        if chunk[0] >= 0:
            self._chunk(shard, *chunk)

    def _samples_of(
        self, entry: Entry, names: list[str], sizes: list[int]
    ) -> list[tuple[str, list[tuple[str, int]]]]:
        """The shard's samples: runs of members sharing a key, as (key, [(extension, member)]).
        What is wrong with a member is reported (``_bad``) in the first pass only."""
        report = self._reporting
        bad = self._bad if report else _unreported
        runs: list[tuple[str, list[tuple[str, int]]]] = []
        left_out = [name for name in names if _NOT_SAMPLES.match(name)]
        if left_out and report:
            log.info(
                "%s: leaving out %d members that are not sample data (hidden files such as "
                "macOS's '._' and '.DS_Store', WebDataset's '__name__' metadata), e.g. %r",
                entry.url,
                len(left_out),
                left_out[0],
            )
        for i, name in enumerate(names):
            if _NOT_SAMPLES.match(name):
                continue
            found = _BASENAME.match(name)
            if found is None:
                bad(entry, f"member {name!r} has no basename.extension to group it by")
                continue
            key, ext = found.groups()
            ext = ext.lower()  # as WebDataset: .JPG and .jpg are "jpg"
            if runs and runs[-1][0] == key:
                runs[-1][1].append((ext, i))
            else:
                runs.append((key, [(ext, i)]))
        good, seen = [], set()
        for key, members in runs:
            exts = [ext for ext, _ in members]
            links = [names[i] for _, i in members if sizes[i] < 0]
            if links:
                bad(
                    entry,
                    f"sample {key!r}: member {links[0]!r} is a link, which holds no bytes of "
                    "its own to read in place (write the shard with links resolved: "
                    "tar --hard-dereference, or -h for symbolic links)",
                )
            elif len(set(exts)) < len(exts):
                bad(entry, f"sample {key!r} has two members named alike: {exts}")
            elif key in seen:  # one name, two samples: they would share a cache entry
                bad(entry, f"sample {key!r} comes twice (its members are not adjacent)")
            else:
                seen.add(key)
                why = self._left_out.get(frozenset(exts))  # incomplete, under "skip"
                if why is None:
                    good.append((key, members))
                else:
                    self.left_out.append(f"{entry.url}#{key}: incomplete sample, {why}")
        return good

    def _name(self, index: int) -> str:
        return self._keys[index]

    def _payload(self, index: int, chunk: int, loaded: Any) -> dict[str, memoryview]:
        """The sample's members as views of its chunk (no copy): only :meth:`Tar.decoder`'s
        decoders see them, and what they return holds none of them (a copy where needed)."""
        base = self._chunks[chunk].start
        at = self._starts[index] - base
        view = memoryview(loaded)
        if zlib.crc32(view[at : at + _BLOCK]) != self._crcs[index]:
            raise ShardError(
                f"it is not at byte {self._starts[index]}, where the index says: the shard "
                "changed since it was indexed (build the dataset again)"
            )
        members = range(self._first_member[index], self._first_member[index + 1])
        out = {}
        for m in members:
            begin = at + self._offsets[m]
            out[self._exts[m]] = view[begin : begin + self._sizes[m]]
        return out


class _MembersAsBytes:
    """A decoder of whole tar samples, given each member's ``bytes`` (a copy of its view of the
    chunk, see :meth:`Tar.decoder`); its fingerprint is the decoder's."""

    def __init__(self, decode: Callable[[dict[str, bytes]], Any]) -> None:
        self.decode = decode

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.decode)  # when asked, as for the decoder itself

    def __call__(self, members: Mapping[str, memoryview]) -> Any:
        return self.decode({ext: bytes(body) for ext, body in members.items()})

    def __repr__(self) -> str:
        return repr(self.decode)


def _unreported(shard: Entry, message: str) -> None:
    """What ``_samples_of`` does with a member's problem when not reporting: nothing."""


def _read_headers(
    shard: Entry, fetcher: Fetcher, keep: int
) -> tuple[dict[str, np.ndarray], bytes | memoryview]:
    """The regular members of one tar shard (name, header and data offsets, size, header crc)
    and its links (size -1), and the bytes read from its start on, up to ``keep`` of them."""
    file = _RangedFile(shard, fetcher, keep)
    names: list[str] = []
    header: list[int] = []
    data: list[int] = []
    size: list[int] = []
    crc: list[int] = []
    try:
        with tarfile.open(fileobj=file, mode="r:") as tar:  # type: ignore[call-overload]
            while (member := tar.next()) is not None:
                link = member.islnk() or member.issym()  # a sample's member without its bytes
                if not (link or member.isfile()):
                    continue
                if not link:
                    _check_regular(member, shard)
                names.append(member.name)
                header.append(member.offset)
                data.append(member.offset_data)
                size.append(-1 if link else member.size)
                crc.append(0 if link else zlib.crc32(file.peek(member.offset, _BLOCK)))
            _check_end(shard, tar.offset, file.peek(tar.offset, _BLOCK), names)
    except tarfile.TarError as exc:
        at = f" after member {names[-1]!r}" if names else ""
        raise ShardError(f"not a readable tar{at} ({exc})", url=shard.url) from exc
    blob = Strings.of(names)
    index = {
        "name_blob": blob.blob,
        "name_ends": blob.ends,
        "header": np.asarray(header, np.int64),
        "data": np.asarray(data, np.int64),
        "size": np.asarray(size, np.int64),
        "crc": np.asarray(crc, np.int64),
    }
    return index, file.pieces[0] if len(file.pieces) == 1 else b"".join(file.pieces)


def _check_end(shard: Entry, offset: int, block: bytes, names: list[str]) -> None:
    """Where tarfile stopped (``offset``, the next header's place, whose first bytes are
    ``block``) must be the end-of-archive marker, a block of zeros: tarfile stops without a word
    at a header cut short, at the end of the bytes and at a corrupt header, so a shard cut
    between two samples or inside a header, or with a damaged header, would lose the samples
    after that point without an error."""
    if block == bytes(_BLOCK):
        return
    after = f" after member {names[-1]!r}" if names else ""
    if not block:
        why = f"it stops at byte {offset}{after}, with no end-of-archive marker"
    elif len(block) < _BLOCK:
        why = (
            f"it stops {len(block)} bytes into the block at byte {offset}{after}, where the next "
            "header or the end-of-archive marker belongs"
        )
    else:
        raise ShardError(
            f"not a readable tar: the block at byte {offset}{after} is neither a header nor the "
            f"end-of-archive marker (the {shard.size - offset} bytes from there on cannot be read)",
            url=shard.url,
        )
    raise ShardError(f"truncated: {why} (its samples from there on are lost)", url=shard.url)


def _check_regular(member: tarfile.TarInfo, shard: Entry) -> None:
    """A regular member whose bytes can be read in place: not sparse, not cut off, nor the
    block its bytes fill (a shard cut there lost the members after it: tarfile's own error,
    "unexpected end of data", would not say so)."""
    if member.issparse():  # its bytes in the shard are not the file's
        raise ShardError(
            f"member {member.name!r} is a sparse file, which cannot be read in place",
            url=shard.url,
        )
    end = member.offset_data + member.size
    if end > shard.size:
        raise ShardError(
            f"truncated: member {member.name!r} ends at byte {end} but the shard has {shard.size}",
            url=shard.url,
        )
    filled = -(-end // _BLOCK) * _BLOCK
    if filled > shard.size:
        raise ShardError(
            f"truncated: it stops at byte {shard.size}, inside the block that member "
            f"{member.name!r} fills up to byte {filled} (its samples from there on are lost)",
            url=shard.url,
        )


class _RangedFile:
    """A read-only file over one shard that reads ahead in windows: a window grows while
    headers keep landing in it (small members) and shrinks when a seek jumps past it (large
    members are hopped over, not read); a shard of at most ``_MAX_WINDOW`` is one window. A
    window that would start just past the last one starts at its end instead, so a shard of
    small members is read in one contiguous run, whose first ``keep`` bytes are kept
    (``pieces``)."""

    def __init__(self, shard: Entry, fetcher: Fetcher, keep: int = 0) -> None:
        self.shard, self.fetcher = shard, fetcher
        self.keep = keep
        self.pieces: list[bytes | memoryview] = []  # the windows read from byte 0 on, in turn
        self.kept = 0
        self.position = 0
        # a shard no larger than the largest window is read whole at once: its windows would
        # grow to it one round trip at a time (4 of them for 15 MB), and hops over large
        # members would take as many
        self.window = shard.size if shard.size <= _MAX_WINDOW else 1 << 20
        self.buffer: bytes | memoryview = b""
        self.buffer_start = 0
        self.requests = 0

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.position, 2: self.shard.size}[whence]
        self.position = base + offset
        return self.position

    def read(self, n: int = -1) -> bytes:
        n = self.shard.size - self.position if n < 0 else n
        out = self.peek(self.position, n)
        self.position += len(out)
        return out

    def peek(self, offset: int, n: int) -> bytes:
        end = min(offset + n, self.shard.size)
        if offset >= end:
            return b""
        buffer_end = self.buffer_start + len(self.buffer)
        if not self.buffer_start <= offset or end > buffer_end:
            if self.requests:  # learn from the last window: members were large, or small
                jumped = offset >= buffer_end + self.window
                self.window = max(_MIN_WINDOW, self.window // 4) if jumped else self.window * 2
                self.window = min(self.window, _MAX_WINDOW)
            start = buffer_end if buffer_end <= offset <= buffer_end + _GAP else offset
            stop = min(max(end, start + self.window), self.shard.size)
            (self.buffer,) = self.fetcher.fetch([self.shard.request(start, stop)], buffers=True)
            self.buffer_start = start
            self.requests += 1
            if start == self.kept and self.kept + len(self.buffer) <= self.keep:
                self.pieces.append(self.buffer)
                self.kept += len(self.buffer)
            else:
                self.keep = 0  # a hop: what follows is not contiguous
        at = offset - self.buffer_start
        return bytes(self.buffer[at : at + end - offset])  # headers: small
