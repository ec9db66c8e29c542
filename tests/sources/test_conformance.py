"""Every sample source through the conformance suite (tests/sources/conformance.py).

Each source runs on local files and on at least one loopback store, and each store serves at
least two sources: objects on SeaweedFS and fake-gcs-server, groups on B2, tar shards on
SeaweedFS and B2, parquet shards on fake-gcs-server, Zarr arrays on SeaweedFS. The tar and
parquet faults are those tests/test_shard_faults.py had (corrupt headers and footers, shards
cut at three places, a file with other columns), moved here, with one more: a tar cut in the
zeros after a member.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zarr
from zarr.codecs import BytesCodec, Crc32cCodec

import fastload
from fastload import ChunkConfig, RemoteDataset, ShardError
from fastload.testing import B2Server, FakeGcsServer, FaultProxy, S3Server
from tests.sources.conformance import (
    WHOLE_OBJECT_FAULTS,
    Fault,
    SourceConformance,
    decode_id,
    encode,
    flip_middle,
    halve,
)
from tests.stores.conformance import Case
from tests.stores.test_conformance import b2_case, gcs_case, s3_case

PER_SHARD = 4  # samples in each shard; a shard's damage lands in its third sample


def number(body: bytes) -> int:
    return int(body)


def one_id(members: dict[str, int]) -> int:
    """The id all members of a sample (a group's objects, a tar sample's files) decoded to."""
    found = set(members.values())
    if len(found) != 1:
        raise ValueError(f"members of different samples: {members}")
    return found.pop()


def row_id(row: dict[str, Any]) -> int:
    """A parquet row's id, checked against its payload."""
    if decode_id(row["payload"]) != row["n"]:
        raise ValueError(f"row {row['n']} holds another sample's payload")
    return int(row["n"])


# -- one object, one sample ----------------------------------------------------------------------


class Objects(SourceConformance):
    dataset_args: ClassVar[dict[str, Any]] = {"decode": decode_id}

    def layout(self, ids: list[int]) -> dict[str, list[int]]:
        return {f"obj/{n:04d}.bin": [n] for n in ids}

    def body(self, key: str, ids: list[int]) -> bytes:
        (n,) = ids
        return encode(n)


# -- several objects, one sample -----------------------------------------------------------------


class Groups(SourceConformance):
    source = fastload.Groups
    source_args: ClassVar[dict[str, Any]] = {"by": r"(.*)_ch\d\.bin$"}
    dataset_args: ClassVar[dict[str, Any]] = {
        "decode": {"*.bin": decode_id},
        "transform": one_id,
    }

    def layout(self, ids: list[int]) -> dict[str, list[int]]:
        return {f"field/g{n:04d}_ch{c}.bin": [n] for n in ids for c in (1, 2)}

    def body(self, key: str, ids: list[int]) -> bytes:
        (n,) = ids
        return encode(n)

    def named(self, case: Case, key: str) -> str:
        return case.url(key.rsplit("_ch", 1)[0])  # the group's name


# -- tar shards ----------------------------------------------------------------------------------


def tar_bytes(numbers: list[int]) -> bytes:
    """A WebDataset tar: per sample ``{n}.cls`` (the number) and ``{n}.bin`` (its bytes)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for n in numbers:
            for ext, body in (("cls", b"%05d" % n), ("bin", encode(n))):
                info = tarfile.TarInfo(f"{n:05d}.{ext}")
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
    return out.getvalue()


def header_at(body: bytes, member: int) -> int:
    """Where the header of the ``member``-th member (from 0) of the tar ``body`` starts."""
    with tarfile.open(fileobj=io.BytesIO(body), mode="r:") as tar:
        return int(tar.getmembers()[member].offset)


def tar_cut_between_samples(body: bytes) -> bytes:
    """Two whole samples and nothing after them: no end-of-archive blocks."""
    return body[: header_at(body, 4)]


def tar_cut_inside_a_header(body: bytes) -> bytes:
    """Cut 100 bytes into the header of the third sample's second member (its ``bin``): that
    sample would look incomplete, the fourth would be lost."""
    return body[: header_at(body, 5) + 100]


def tar_cut_inside_a_member(body: bytes) -> bytes:
    """Cut 1 byte into the bytes of the third sample's ``cls``."""
    return body[: header_at(body, 4) + 512 + 1]


def tar_cut_inside_a_padding(body: bytes) -> bytes:
    """Cut 100 bytes after the third sample's ``cls`` (5 bytes), in the zeros that fill its
    block: every byte of it is there, the rest of the shard is not."""
    with tarfile.open(fileobj=io.BytesIO(body), mode="r:") as tar:
        member = tar.getmembers()[4]
    return body[: member.offset_data + member.size + 100]


def tar_corrupt_header(body: bytes) -> bytes:
    """Whole, but the header of the third sample's first member has a byte changed (its
    checksum no longer matches): the members after it cannot be found."""
    damaged = bytearray(body)
    damaged[header_at(body, 4) + 10] ^= 0x55
    return bytes(damaged)


class Shards(SourceConformance):
    def layout(self, ids: list[int]) -> dict[str, list[int]]:
        kind = self.source.name
        return {
            f"shard-{s}.{kind}": ids[s * PER_SHARD : (s + 1) * PER_SHARD]
            for s in range(-(-len(ids) // PER_SHARD))
        }


class TarShards(Shards):
    source = fastload.Tar
    # two samples a chunk, two chunks a shard
    source_args: ClassVar[dict[str, Any]] = {"chunks": ChunkConfig(chunk_bytes=4096)}
    dataset_args: ClassVar[dict[str, Any]] = {
        "decode": {"cls": number, "bin": decode_id},
        "transform": one_id,
    }
    faults: ClassVar[dict[str, Fault]] = {
        "header-corrupt": Fault(
            tar_corrupt_header, ShardError, r"neither a header nor the end-of-archive"
        ),
        "cut-between-samples": Fault(
            tar_cut_between_samples, ShardError, r"truncated: it stops at byte \d+"
        ),
        "cut-inside-a-header": Fault(
            tar_cut_inside_a_header, ShardError, r"truncated: it stops 100 bytes into"
        ),
        "cut-inside-a-member": Fault(
            tar_cut_inside_a_member, ShardError, r"truncated: member '\d+\.cls' ends"
        ),
        "cut-inside-a-padding": Fault(
            tar_cut_inside_a_padding, ShardError, r"truncated: it stops at byte \d+, inside"
        ),
        "changed": WHOLE_OBJECT_FAULTS["changed"],
    }

    def body(self, key: str, ids: list[int]) -> bytes:
        return tar_bytes(ids)

    def bound(self, dataset: RemoteDataset) -> int:
        """Indexing reads a small shard whole, once; then a chunk is read once, at most."""
        assert dataset.blocks is not None
        return len(dataset.source.shards) + len(dataset.blocks)  # type: ignore[attr-defined]


# -- parquet shards ------------------------------------------------------------------------------


def parquet_bytes(numbers: list[int], **extra: list[Any]) -> bytes:
    out = io.BytesIO()
    payload = [encode(n) for n in numbers]
    table = pa.table({"n": numbers, "payload": payload, **extra})
    pq.write_table(table, out, row_group_size=2)  # several row groups a file
    return out.getvalue()


def parquet_corrupt_footer(body: bytes) -> bytes:
    return body[:-20] + b"\0" * 16 + b"PAR1"


def parquet_other_columns(body: bytes) -> bytes:
    """Readable, but with a column the other files lack: left out (never mixed in a batch)."""
    numbers = pq.read_table(io.BytesIO(body)).column("n").to_pylist()
    return parquet_bytes(numbers, extra=[0.5] * len(numbers))


class ParquetShards(Shards):
    source = fastload.Parquet
    dataset_args: ClassVar[dict[str, Any]] = {"decode": row_id}
    faults: ClassVar[dict[str, Fault]] = {
        "footer-corrupt": Fault(parquet_corrupt_footer, ShardError, r"corrupt parquet footer"),
        "truncated": Fault(
            WHOLE_OBJECT_FAULTS["truncated"].damage,
            ShardError,
            r"not parquet: the file does not end with PAR1",
        ),
        "other-columns": Fault(parquet_other_columns, ShardError, r"a column 'extra' they lack"),
        "changed": WHOLE_OBJECT_FAULTS["changed"],
    }

    def body(self, key: str, ids: list[int]) -> bytes:
        return parquet_bytes(ids)

    def bound(self, dataset: RemoteDataset) -> int:
        """A footer read (two for a large one) a file; then a chunk (a row group, its columns
        in one range) is read once, at most."""
        assert dataset.blocks is not None
        return 2 * len(dataset.source.shards) + len(dataset.blocks)  # type: ignore[attr-defined]


# -- a Zarr array ---------------------------------------------------------------------------------

ZARR_CHUNK = (PER_SHARD, 128)  # a sample (a row of 256 bytes) reads two chunks, its halves


def zarr_store(rows: np.ndarray) -> dict[str, bytes]:
    """The objects zarr writes for ``rows`` (uint8) in chunks of ``ZARR_CHUNK``, each chunk
    ending with a CRC-32C (zarr's default zstd has no checksum: a flipped byte would decode)."""
    objects: dict[str, Any] = {}
    array = zarr.create_array(
        zarr.storage.MemoryStore(objects),
        shape=rows.shape,
        chunks=ZARR_CHUNK,
        dtype="uint8",
        serializer=BytesCodec(),
        compressors=[Crc32cCodec()],
    )
    array[:] = rows
    return {key: buffer.to_bytes() for key, buffer in objects.items()}


def encoded_rows(ids: list[int]) -> np.ndarray:
    return np.stack([np.frombuffer(encode(n), np.uint8) for n in ids])


def array_id(row: np.ndarray) -> int:
    """A Zarr sample's id: the row holds :func:`encode`'s bytes."""
    return decode_id(row.tobytes())


class ZarrArray(SourceConformance):
    """A (12, 256) uint8 array, a sample per row, in chunks of 4 rows and half a row: the
    chunk objects are the suite's objects (``c/<row>/<half>``); ``zarr.json`` is written beside
    them, never made bad (a bad one is no array: the dataset is not made)."""

    source = fastload.Zarr
    dataset_args: ClassVar[dict[str, Any]] = {"decode": array_id}
    faults: ClassVar[dict[str, Fault]] = {
        "corrupt": Fault(flip_middle, ShardError, r"checksum do not match"),
        "truncated": Fault(halve, ShardError, r"checksum do not match"),
        "changed": WHOLE_OBJECT_FAULTS["changed"],
    }

    def layout(self, ids: list[int]) -> dict[str, list[int]]:
        rows = -(-len(ids) // PER_SHARD)
        return {
            f"c/{r}/{h}": ids[r * PER_SHARD : (r + 1) * PER_SHARD]
            for r in range(rows)
            for h in range(256 // ZARR_CHUNK[1])
        }

    def body(self, key: str, ids: list[int]) -> bytes:
        """Chunk ``c/<r>/<h>`` of rows ``ids`` (chunk ``c/0/<h>`` of an array of those rows:
        its bytes do not depend on the row it starts at)."""
        half = key.rsplit("/", 1)[1]
        return zarr_store(encoded_rows(ids))[f"c/0/{half}"]

    def write(self, case: Case) -> tuple[list[int], dict[str, list[int]]]:
        ids, layout = super().write(case)
        case.write({"zarr.json": zarr_store(encoded_rows(ids))["zarr.json"]})
        return ids, layout


# -- stores --------------------------------------------------------------------------------------


class OnLocalFiles:
    @pytest.fixture
    def case(self, tmp_path: Path) -> Case:
        return Case(root=f"file://{tmp_path}/data", write_options={}, read_options={})

    @pytest.fixture
    def counted(self, case: Case) -> Case:
        return case  # the fetcher counts what it reads


class OnSeaweed:
    @pytest.fixture
    def case(self, seaweed: S3Server) -> Case:
        return s3_case(seaweed)

    @pytest.fixture
    def counted(self, seaweed: S3Server) -> Iterator[Case]:
        with FaultProxy(seaweed.endpoint, flavor="s3") as proxy:
            yield s3_case(seaweed, proxy)


class OnGcs:
    @pytest.fixture
    def case(self, gcs: FakeGcsServer) -> Case:
        return gcs_case(gcs)

    @pytest.fixture
    def counted(self, gcs: FakeGcsServer) -> Iterator[Case]:
        with FaultProxy(gcs.endpoint, flavor="gcs") as proxy:
            yield gcs_case(gcs, proxy)


class OnB2:
    @pytest.fixture
    def case(self, b2: B2Server) -> Case:
        return b2_case(b2)

    @pytest.fixture
    def counted(self, b2: B2Server) -> Iterator[Case]:
        with FaultProxy(b2.endpoint, flavor="b2") as proxy:
            yield b2_case(b2, proxy)


class TestObjectsOnLocalFiles(OnLocalFiles, Objects):
    pass


class TestObjectsOnSeaweed(OnSeaweed, Objects):
    pass


class TestObjectsOnGcs(OnGcs, Objects):
    pass


class TestGroupsOnLocalFiles(OnLocalFiles, Groups):
    pass


class TestGroupsOnB2(OnB2, Groups):
    pass


class TestTarShardsOnLocalFiles(OnLocalFiles, TarShards):
    pass


class TestTarShardsOnSeaweed(OnSeaweed, TarShards):
    pass


class TestTarShardsOnB2(OnB2, TarShards):
    pass


class TestParquetShardsOnLocalFiles(OnLocalFiles, ParquetShards):
    pass


class TestParquetShardsOnGcs(OnGcs, ParquetShards):
    pass


class TestZarrOnLocalFiles(OnLocalFiles, ZarrArray):
    pass


class TestZarrOnSeaweed(OnSeaweed, ZarrArray):
    pass
