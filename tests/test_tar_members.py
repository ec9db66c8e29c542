"""How a tar sample's members reach ``decode`` (#54): the decoders that copy what they read
(npy, raw) decode each member straight from its chunk, with no copy of its bytes first; every
other decoder, a user's callable and ``decode=None`` get ``bytes``, as documented; and no
decoded sample holds its chunk's memory once the chunk memory has let the chunk go. Against
SeaweedFS."""

from __future__ import annotations

import io
import pickle
import tarfile
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from fastload import ChunkConfig, RemoteDataset, Tar
from fastload.testing import S3Server
from fastload.transforms import versioned
from tests.conftest import BUCKET, write
from tests.test_dataset import npy

SHARDS, PER_SHARD = 2, 12


def array(n: int, side: int = 32) -> np.ndarray:
    return (np.arange(side * side, dtype=np.int32).reshape(side, side) * 3 + n).astype(np.int32)


def raw(n: int) -> bytes:
    return bytes((n * 7 + i) % 256 for i in range(3000))


def picture(n: int) -> np.ndarray:
    return np.full((4, 5, 3), n, np.uint8)


def png(value: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(value).save(out, format="PNG")
    return out.getvalue()


def tar_of(members: dict[str, dict[str, bytes]]) -> bytes:
    """A tar of ``{sample key: {extension: bytes}}``."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for key, bodies in members.items():
            for ext, body in bodies.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
    return out.getvalue()


def sample(n: int, side: int = 32) -> dict[str, bytes]:
    return {
        "npy": npy(array(n, side)),
        "bin": raw(n),
        "png": png(picture(n)),
        "cls": str(n % 7).encode(),
        "txt": f"sample {n}".encode(),
    }


def tar_dataset(server: S3Server, side: int = 32) -> str:
    root = f"s3://{BUCKET}/tar-members-{uuid.uuid4().hex[:8]}"
    shards = {
        f"shard-{s}.tar": tar_of(
            {f"{n:04d}": sample(n, side) for n in range(s * PER_SHARD, (s + 1) * PER_SHARD)}
        )
        for s in range(SHARDS)
    }
    write(root, server.storage_options(), shards)
    return root


@versioned(1)
def member_types(members: dict[str, Any]) -> dict[str, str]:
    """A decoder of the whole sample: the type each member came as."""
    return {ext: type(body).__name__ for ext, body in members.items()}


@versioned(1)
def kept(body: bytes) -> np.ndarray:
    """A user's member decoder that keeps what it is given (no copy), as bytes allow."""
    return np.frombuffer(body, np.uint8)


def test_members_not_decoded_in_place_come_as_bytes(seaweed: S3Server) -> None:
    """``decode=None`` passes members through as ``bytes``; a callable of the whole sample gets
    ``bytes``; by member, npy and raw decode from the chunk and every other decoder (Pillow's
    images: a ``bytes`` method checks the PNG signature; ``int``; ``bytes.decode``) gets
    ``bytes``. Handing every member the chunk's view (#54's prototype) fails each of these.
    The decoders' fingerprints, which name the cache entries, are those of before."""
    root, options = tar_dataset(seaweed), seaweed.storage_options()
    dataset = RemoteDataset(Tar(root), storage_options=options)
    assert dataset.fingerprint.startswith("fastload.dataset._as_read:v1|identity")
    undecoded = dataset[3]
    assert {ext: type(body) for ext, body in undecoded.items()} == dict.fromkeys(sample(3), bytes)
    assert undecoded == sample(3)

    whole = RemoteDataset(Tar(root), decode=member_types, storage_options=options)
    assert whole[3] == dict.fromkeys(sample(3), "bytes")
    assert whole.fingerprint.startswith("tests.test_tar_members.member_types:v1|")

    decode = {"npy": "npy", "bin": "raw", "png": "image", "cls": int, "txt": bytes.decode}
    by_member = RemoteDataset(Tar(root), decode=decode, storage_options=options)
    assert by_member.fingerprint.startswith(
        "members:npy=fastload.transforms.decode_npy:v1,bin=fastload.transforms.decode_raw:v1,"
        "png=fastload.transforms.decode_image:v2,cls=builtins.int,txt=builtins.bytes.decode|"
    )
    got = by_member[15]
    assert got["npy"].dtype == np.int32 and np.array_equal(got["npy"], array(15))
    assert got["bin"].tobytes() == raw(15)
    assert np.array_equal(got["png"], picture(15))
    assert got["cls"] == 15 % 7 and got["txt"] == "sample 15"
    for name in ("npy", "bin"):  # copies of their own, writable, tied to no chunk
        assert got[name].flags.owndata and got[name].flags.writeable


def chunk_files_mapped(root: Path) -> int:
    """How many chunk files of a scratch folder this process maps (dropped ones too)."""
    inodes = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(f"{root}/"):
            inodes.add(fields[4])
    return len(inodes)


def test_decoded_samples_hold_no_chunk_once_memory_lets_it_go(seaweed: S3Server) -> None:
    """With chunk memory for two chunks of the twelve, read through the scratch folder the
    DataLoader workers share (chunks are mappings of its files, dropped past the budget): every
    sample is still right once its chunk is dropped, and none of them maps its chunk, whether
    decoded in place (npy) or by a callable that keeps what it is given. A view handed to that
    callable would keep every chunk mapped for as long as its sample lives."""
    root, options = tar_dataset(seaweed), seaweed.storage_options()
    chunks = ChunkConfig(chunk_bytes=25_000, memory_bytes=50_000)  # 2 samples a chunk
    dataset = RemoteDataset(
        Tar(root, chunks=chunks), decode={"npy": "npy", "bin": kept, "*": bytes},
        storage_options=options,
    )  # fmt: skip
    assert dataset.blocks is not None and len(dataset.blocks) >= 10
    pickle.dumps(dataset)  # handed to workers: this process reads through the scratch folder
    reader = dataset.source.reader  # type: ignore[attr-defined]
    held = [
        item
        for start in range(0, len(dataset), 4)
        for item in dataset.__getitems__(range(start, start + 4))
    ]
    assert reader.reads >= len(dataset.blocks) - reader.seeded  # each chunk was read
    for n, item in enumerate(held):
        assert np.array_equal(item["npy"], array(n)) and item["bin"].tobytes() == raw(n)
    mapped = chunk_files_mapped(reader.shared.root)
    assert 0 < mapped <= len(reader._kept) < len(dataset.blocks)  # the chunks kept, no more


def test_a_batch_of_npy_members_is_decoded_from_its_chunks_without_a_copy_between(
    seaweed: S3Server,
) -> None:
    """Decoding a batch of npy members whose chunks are in memory allocates each array once:
    the members were copied out of the chunk into ``bytes`` first, all of the batch's at once,
    which doubled what a batch allocated (and cost a copy into fresh memory a sample)."""
    root, options = tar_dataset(seaweed, side=128), seaweed.storage_options()  # 64 KB arrays
    dataset = RemoteDataset(Tar(root), decode={"npy": "npy", "*": bytes}, storage_options=options)
    batch = list(range(4, 20))
    dataset.__getitems__(batch)  # its chunks are in memory from here on
    arrays = len(batch) * array(0, 128).nbytes
    tracemalloc.start()
    try:
        items = dataset.__getitems__(batch)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [int(item["npy"][0, 0]) for item in items] == batch
    assert arrays <= peak < 1.5 * arrays
