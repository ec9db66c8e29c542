"""A corrupt or truncated shard among good ones, on SeaweedFS: named, never other samples.

Each fault sits first, in the middle and last of three shards. Under ``on_error="raise"`` it is
a :class:`fastload.ShardError` naming the shard; under ``"skip"`` it is named in ``left_out``
and an epoch (with 0 and 2 DataLoader workers) holds every sample of the good shards exactly
once: a shard left out moves no other shard's samples, and none is lost without a word.
The cases are pairwise (every fault at every place; workers alternate so that each fault and
each place meets both worker counts), not the whole cross product.
"""

from __future__ import annotations

import io
import re
import tarfile
import uuid
from collections.abc import Callable
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import fastload
from fastload import Manifest, RemoteDataset, ShardError
from fastload.manifest import ShardIndexes
from fastload.sources.tar import TarShards
from fastload.testing import S3Server
from tests.conftest import BUCKET, write

GOOD = ([1, 2, 3], [20, 21, 22, 23, 24, 25])  # the good shards' sample numbers
BAD = [40, 41, 42, 43]  # what the bad shard held before it was damaged


def tar_bytes(numbers: list[int]) -> bytes:
    """A WebDataset tar: per sample ``{n}.cls`` (the number) and ``{n}.txt``."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for n in numbers:
            for ext, body in (("cls", str(n).encode()), ("txt", b"sample %d" % n)):
                info = tarfile.TarInfo(f"{n:05d}.{ext}")
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
    return out.getvalue()


def header_at(body: bytes, member: int) -> int:
    """Where the header of the ``member``-th member (from 0) of the tar ``body`` starts."""
    with tarfile.open(fileobj=io.BytesIO(body), mode="r:") as tar:
        return int(tar.getmembers()[member].offset)


def tar_cut_between_samples() -> bytes:
    """Two whole samples and nothing after them: no end-of-archive blocks."""
    body = tar_bytes(BAD)
    return body[: header_at(body, 4)]


def tar_cut_inside_a_header() -> bytes:
    """Cut 100 bytes into the header of sample 42's second member (its ``txt``): sample 42
    would look incomplete, 43 would be lost."""
    body = tar_bytes(BAD)
    return body[: header_at(body, 5) + 100]


def tar_cut_inside_a_member() -> bytes:
    """Cut 1 byte into the bytes of sample 42's ``cls``."""
    body = tar_bytes(BAD)
    return body[: header_at(body, 4) + 512 + 1]


def tar_corrupt_header() -> bytes:
    """Whole, but the header of sample 42's first member has a byte changed (its checksum
    no longer matches): the members after it cannot be found."""
    body = bytearray(tar_bytes(BAD))
    body[header_at(bytes(body), 4) + 10] ^= 0x55
    return bytes(body)


def parquet_bytes(numbers: list[int], **extra: list[Any]) -> bytes:
    out = io.BytesIO()
    table = pa.table({"n": numbers, "name": [f"row {n}" for n in numbers], **extra})
    pq.write_table(table, out, row_group_size=2)  # several row groups a file
    return out.getvalue()


def parquet_corrupt_footer() -> bytes:
    body = parquet_bytes(BAD)
    return body[:-20] + b"\0" * 16 + b"PAR1"


def parquet_truncated() -> bytes:
    body = parquet_bytes(BAD)
    return body[: len(body) // 2]


def parquet_other_columns() -> bytes:
    """Readable, but with a column the other files lack: left out (never mixed in a batch)."""
    return parquet_bytes(BAD, extra=[0.5] * len(BAD))


TAR_FAULTS: dict[str, tuple[Callable[[], bytes], str]] = {  # how it is made, what names it
    "tar-cut-between-samples": (tar_cut_between_samples, r"truncated: it stops at byte \d+"),
    "tar-cut-inside-a-header": (tar_cut_inside_a_header, r"truncated: it stops 100 bytes into"),
    "tar-cut-inside-a-member": (tar_cut_inside_a_member, r"truncated: member '00042.cls' ends"),
    "tar-header-corrupt": (tar_corrupt_header, r"neither a header nor the end-of-archive"),
}
PARQUET_FAULTS: dict[str, tuple[Callable[[], bytes], str]] = {
    "parquet-footer-corrupt": (parquet_corrupt_footer, r"corrupt parquet footer"),
    "parquet-truncated": (parquet_truncated, r"not parquet: the file does not end with PAR1"),
    "parquet-other-columns": (parquet_other_columns, r"a column 'extra' they lack"),
}
FAULTS = {**TAR_FAULTS, **PARQUET_FAULTS}
PLACES = ("first", "middle", "last")
CASES = [  # every fault at every place; 0 and 2 workers in turn meet every fault and place
    pytest.param(fault, place, workers, id=f"{fault}-{place}-{workers}-workers")
    for f, fault in enumerate(FAULTS)
    for p, place in enumerate(PLACES)
    for workers in [2 * ((f + p) % 2)]
]


def shards(fault: str, place: str) -> tuple[Literal["tar", "parquet"], dict[str, bytes], str]:
    """The fault's format, three shards of it with the bad one at ``place``, and its key."""
    kind: Literal["tar", "parquet"] = "tar" if fault in TAR_FAULTS else "parquet"
    make = tar_bytes if kind == "tar" else parquet_bytes
    bodies = [make(GOOD[0]), make(GOOD[1])]
    bodies.insert(PLACES.index(place), FAULTS[fault][0]())
    objects = {f"shard-{i}.{kind}": body for i, body in enumerate(bodies)}
    return kind, objects, f"shard-{PLACES.index(place)}.{kind}"


def number(sample: dict[str, Any]) -> int:
    return int(sample["cls"] if "cls" in sample else sample["n"])


@pytest.mark.parametrize(("fault", "place", "workers"), CASES)
def test_a_bad_shard_is_named_and_moves_no_other_sample(
    seaweed: S3Server, fault: str, place: str, workers: int
) -> None:
    root = f"s3://{BUCKET}/shard-faults-{uuid.uuid4().hex[:8]}"
    options = seaweed.storage_options()
    kind, objects, bad = shards(fault, place)
    write(root, options, objects)
    reason = FAULTS[fault][1]

    with pytest.raises(ShardError, match=rf"(?s){reason}.*{re.escape(f'{root}/{bad}')}"):
        RemoteDataset(root, shards=kind, storage_options=options)

    dataset = RemoteDataset(root, shards=kind, on_error="skip", storage_options=options)
    (left_out,) = dataset.stats()["dataset"]["left_out"]
    assert re.search(reason, left_out) and f"{root}/{bad}" in left_out
    good = sorted(GOOD[0] + GOOD[1])
    assert len(dataset) == len(good)
    loader = fastload.DataLoader(
        dataset,
        batch_size=4,
        shuffle=True,
        num_workers=workers,
        collate_fn=list,
        persistent_workers=False,  # ended with the epoch, not when collected in a later test
    )
    assert sorted(number(s) for batch in loader for s in batch) == good  # each once
    assert loader.stats()["dataset"]["skipped"] == 0  # none failed on reading: none stood in


def test_a_tar_index_saved_before_truncation_was_checked_is_refused(seaweed: S3Server) -> None:
    """A shard cut between two samples indexed by an earlier fastload (which took it for a
    shard of two samples) and saved with the listing: the saved index is refused too."""
    root = f"s3://{BUCKET}/shard-faults-{uuid.uuid4().hex[:8]}"
    options = seaweed.storage_options()
    write(root, options, {"a.tar": tar_bytes(BAD[:2])})
    made = RemoteDataset(root, shards="tar", storage_options=options).manifest
    assert made.shard_indexes is not None
    (index,) = made.shard_indexes.lookup(TarShards.index_version).values()

    write(root, options, {"a.tar": tar_cut_between_samples()})  # the same two samples, cut
    listed = Manifest.build(root, storage_options=options)
    old = ShardIndexes.of(TarShards.index_version, [(listed[0], index)])
    saved = listed.with_shard_indexes(old)
    with pytest.raises(ShardError, match=rf"truncated: .*'00041.txt'.*{re.escape(root)}/a\.tar"):
        RemoteDataset(saved, shards="tar", storage_options=options)
