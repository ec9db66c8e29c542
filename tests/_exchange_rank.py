"""One rank of a job with no process group, as under torch_xla, for test_ranks_exchange: run as
``python _exchange_rank.py RANK WORLD JOB OUT DATA TARS``. The rank and world size stand in for
torch_xla's runtime (``ranks.xla_rank_world``); the exchange, its store and its key are real.
The rank writes what it got (or the error it raised) to ``OUT/rank-RANK.json``.

Jobs: ``exchange`` lists and fails to list on rank 0, gathers parts and errors from every rank
and indexes tar shards a share per rank, with unpickling forbidden; ``slow`` exchanges a greeting,
then lists, rank 0 only after the file ``OUT/go`` exists (a test writes into the store
meanwhile).
"""

from __future__ import annotations

import json
import pickle
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from fastload import (
    ConfigError,
    Manifest,
    ObjectNotFoundError,
    RemoteDataset,
    ShardError,
    Tar,
    ranks,
)

_list = Manifest._list.__func__  # type: ignore[attr-defined]


def _unpickling(*args: Any, **kwargs: Any) -> NoReturn:
    raise AssertionError("the rank exchange unpickled a value")


def _failing(failure: BaseException | set[int]) -> list[Any]:
    """What every rank gets when rank 1 raises ``failure`` (or returns a value that cannot
    cross): ``[name of the error type, its message]``, or the parts."""

    def part(rank: int, world: int) -> Any:
        if rank != 1:
            return rank
        if isinstance(failure, BaseException):
            raise failure
        return failure

    try:
        return ranks.on_every_rank(part)
    except Exception as exc:
        return [type(exc).__name__, str(exc)]


def exchange(data: str, tars: str, out: Path) -> dict[str, Any]:
    pickle.loads = pickle.load = _unpickling  # type: ignore[assignment]
    manifest = Manifest.build(data)
    try:
        Manifest.build(data + "/no-such-prefix")
        missing: Any = "no error"
    except ObjectNotFoundError as exc:
        missing = [type(exc).__name__, exc.url]
    parts = ranks.on_every_rank(
        lambda rank, world: [
            {"offsets": np.arange(rank + 2, dtype=np.int64)},
            ShardError("truncated tar", url=f"file:///shard-{rank}.tar"),
        ]
    )
    shards = RemoteDataset(Tar(f"file://{tars}"))
    return {
        "keys": manifest.keys(),
        "fingerprint": manifest.fingerprint,
        "missing": missing,
        "offsets": [part[0]["offsets"].tolist() for part in parts],
        "dtypes": [str(part[0]["offsets"].dtype) for part in parts],
        "shard_errors": [[type(part[1]).__name__, part[1].url, str(part[1])] for part in parts],
        "failures": [_failing(f) for f in (ConfigError("bad option x"), KeyError("k"), {1})],
        "samples": [shards.source.identities([i])[0][0] for i in range(len(shards))],
    }


def slow(data: str, tars: str, out: Path) -> dict[str, Any]:
    def listing(cls: type[Manifest], url: str, **kwargs: Any) -> Manifest:
        while not (out / "go").exists():
            time.sleep(0.05)
        return _list(cls, url, **kwargs)  # type: ignore[no-any-return]

    Manifest._list = classmethod(listing)  # type: ignore[method-assign,assignment]
    ranks.on_rank_zero(lambda: "hello")  # rank 0 serves the store from its first exchange on
    manifest = Manifest.build(data)
    return {"keys": manifest.keys()}


if __name__ == "__main__":
    rank, world, job, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    ranks.xla_rank_world = lambda: (rank, world)  # type: ignore[assignment]
    try:
        record = {"exchange": exchange, "slow": slow}[job](sys.argv[5], sys.argv[6], out)
    except Exception as exc:
        record = {"error": [type(exc).__name__, str(exc)]}
    (out / f"rank-{rank}.json").write_text(json.dumps(record))
