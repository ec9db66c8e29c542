"""A tar shard index saved before truncation was checked, on SeaweedFS: refused, naming it.

The faults of a shard among good ones (corrupt headers and footers, shards cut at three
places, a file with other columns; first, in the middle and last; raise and skip; 0 and 2
workers) are the tar and parquet sources' faults in the conformance suite
(tests/sources/test_conformance.py), which runs them on every store those sources run on.
"""

from __future__ import annotations

import re
import uuid

import pytest

from fastload import Manifest, RemoteDataset, ShardError, Tar
from fastload.sources._indexes import SLOT, ShardIndexes
from fastload.sources.tar import TarShards
from fastload.testing import S3Server
from tests.conftest import BUCKET, write
from tests.sources.test_conformance import tar_bytes, tar_cut_between_samples

BAD = [40, 41, 42, 43]


def test_a_tar_index_saved_before_truncation_was_checked_is_refused(seaweed: S3Server) -> None:
    """A shard cut between two samples indexed by an earlier fastload (which took it for a
    shard of two samples) and saved with the listing: the saved index is refused too."""
    root = f"s3://{BUCKET}/shard-faults-{uuid.uuid4().hex[:8]}"
    options = seaweed.storage_options()
    cut = tar_cut_between_samples(tar_bytes(BAD))
    write(root, options, {"a.tar": tar_bytes(BAD[:2])})
    made = ShardIndexes.kept_by(RemoteDataset(Tar(root), storage_options=options).manifest)
    assert made is not None
    (index,) = made.lookup(TarShards.index_version).values()

    write(root, options, {"a.tar": cut})  # the same two samples, cut
    listed = Manifest.build(root, storage_options=options)
    old = ShardIndexes.of(TarShards.index_version, [(listed[0], index)])
    saved = listed.keeping(SLOT, old.kept())
    with pytest.raises(ShardError, match=rf"truncated: .*'00041.bin'.*{re.escape(root)}/a\.tar"):
        RemoteDataset(Tar(saved), storage_options=options)
