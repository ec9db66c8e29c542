"""The sample source conformance suite: every source runs the same tests, on every store.

A source's test class subclasses :class:`SourceConformance` and says how its samples are laid
out in objects (:meth:`~SourceConformance.layout`, :meth:`~SourceConformance.body`), how
:class:`fastload.RemoteDataset` reads them (``dataset_args``: each sample must come out as its
own id, an int, so that an epoch says which samples it held), how an object goes bad
(``faults``), how a bad sample is named (:meth:`~SourceConformance.named`) and how many
requests an epoch may take (:meth:`~SourceConformance.bound`). A store's mixin supplies the
``case`` fixture (a fresh root, see :class:`tests.stores.conformance.Case`) and the
``counted`` fixture (the same store through a :class:`fastload.testing.FaultProxy` that
counts requests, or the store itself where requests are counted by the fetcher: local files).
test_conformance.py pairs each source with stores.

The suite checks, through :class:`fastload.DataLoader` with 0 and 2 workers:

- every sample exactly once per epoch, in a new order each epoch;
- a corrupt, a truncated and a changed object (rewritten after the listing), first, in the
  middle and last: under ``on_error="raise"`` a typed fastload error naming it; under
  ``"skip"`` no bad sample, every good one exactly once but for the stand-ins (one another
  sample of its batch for each bad sample, as many as ``skipped`` counts), and nothing named
  in ``skipped_keys`` (samples replaced in their batch) or ``left_out`` (shards left out
  when the dataset was made) but the bad object;
- resume mid-epoch: the rest of the epoch is exactly the samples not yet seen;
- the requests of a cold epoch within the source's bound, and none for a warm one.

Faults, places, policies and worker counts are combined pairwise (:func:`pairwise`), not as
their whole product.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import pytest

import fastload
from fastload import (
    Cache,
    DecodeError,
    Manifest,
    ObjectChangedError,
    Objects,
    RemoteDataset,
    Source,
)
from tests.stores.conformance import Case

Policy = Literal["raise", "skip"]
PLACES = ("first", "middle", "last")
OTHER_IDS = 10_000  # a changed object holds other samples: their ids, moved by this much


# -- samples that say who they are ---------------------------------------------------------------


def encode(n: int, size: int = 256) -> bytes:
    """Sample ``n``'s bytes: its id, filler, and a SHA-256 of both (any damage shows)."""
    head = b"sample %08d\n" % n
    body = head + bytes((n + i) % 251 for i in range(size - len(head) - 32))
    return body + hashlib.sha256(body).digest()


def decode_id(body: bytes) -> int:
    """The id :func:`encode` wrote, or a ValueError where the bytes were damaged."""
    data, digest = bytes(body[:-32]), bytes(body[-32:])
    if len(body) < 48 or hashlib.sha256(data).digest() != digest:
        raise ValueError(f"{len(body)} bytes that are not a whole sample (checksum mismatch)")
    return int(data[7:15])


def flip_middle(body: bytes) -> bytes:
    """``body`` with one byte in its middle changed (same size)."""
    damaged = bytearray(body)
    damaged[len(body) // 2] ^= 0x55
    return bytes(damaged)


def halve(body: bytes) -> bytes:
    return body[: len(body) // 2]


@dataclass(frozen=True)
class Fault:
    """How the object holding some samples goes bad, and the error that must name it."""

    damage: Callable[[bytes], bytes] | None
    """The object's bytes made bad before the listing; None: the object is rewritten after
    the listing (a valid object holding other samples, see ``OTHER_IDS``)."""
    error: type[Exception]
    reason: str  # a regex the error's message matches


WHOLE_OBJECT_FAULTS = {
    "corrupt": Fault(flip_middle, DecodeError, "checksum mismatch"),
    "truncated": Fault(halve, DecodeError, "checksum mismatch"),
    "changed": Fault(None, ObjectChangedError, "since the manifest was built"),
}


def pairwise(faults: Sequence[str]) -> list[tuple[str, str, Policy, int]]:
    """Every fault at every place; the policy and the worker count vary so that every pair
    of (fault, place, policy, workers) values meets in some case (with two faults or more)."""
    cases: list[tuple[str, str, Policy, int]] = []
    for f, fault in enumerate(faults):
        for p, place in enumerate(PLACES):
            policy: Policy = ("raise", "skip")[(f + p) % 2]
            cases.append((fault, place, policy, (0, 2)[(f + p // 2) % 2]))
    return cases


# -- the suite -----------------------------------------------------------------------------------


class SourceConformance:
    """The contract of a sample source (see the module docstring)."""

    samples: ClassVar[int] = 12
    source: ClassVar[type[Source]] = Objects
    source_args: ClassVar[dict[str, Any]] = {}  # the source object's own options
    dataset_args: ClassVar[dict[str, Any]] = {}
    faults: ClassVar[dict[str, Fault]] = WHOLE_OBJECT_FAULTS

    # -- what a source says ----------------------------------------------------------------
    def layout(self, ids: list[int]) -> dict[str, list[int]]:
        """Each object's key and the ids of the samples it holds (or is part of)."""
        raise NotImplementedError

    def body(self, key: str, ids: list[int]) -> bytes:
        """The bytes of the object ``key`` holding (its part of) the samples ``ids``."""
        raise NotImplementedError

    def named(self, case: Case, key: str) -> str:
        """What names the samples of the object ``key`` when it is bad: in the error, in
        ``skipped_keys`` or ``left_out``."""
        return case.url(key)

    def bound(self, dataset: RemoteDataset) -> int:
        """The requests a cold epoch may send, beyond the listing's (default: one per
        object)."""
        return len(dataset.manifest)

    # -- what the stores supply ------------------------------------------------------------
    @pytest.fixture
    def case(self) -> Iterator[Case]:
        raise NotImplementedError

    @pytest.fixture
    def counted(self) -> Iterator[Case]:
        raise NotImplementedError

    # -- helpers ---------------------------------------------------------------------------
    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "fault_case" in metafunc.fixturenames:
            cases = pairwise(list(self.faults))
            ids = [
                f"{fault}-{place}-{policy}-{workers}-workers"
                for fault, place, policy, workers in cases
            ]
            metafunc.parametrize("fault_case", cases, ids=ids)

    def write(self, case: Case) -> tuple[list[int], dict[str, list[int]]]:
        """The samples written under ``case.root``: their ids and the layout."""
        ids = list(range(self.samples))
        layout = self.layout(ids)
        case.write({key: self.body(key, held) for key, held in layout.items()})
        return ids, layout

    def dataset(self, where: str | Manifest, case: Case, **kwargs: Any) -> RemoteDataset:
        return RemoteDataset(
            self.source(where, **self.source_args),
            storage_options=case.read_options,
            **self.dataset_args,
            **kwargs,
        )

    # -- the tests -------------------------------------------------------------------------
    @pytest.mark.parametrize("workers", [0, 2])
    def test_every_sample_once_per_epoch_in_a_new_order(self, case: Case, workers: int) -> None:
        ids, _ = self.write(case)
        dataset = self.dataset(case.root, case)
        assert len(dataset) == len(ids)
        loader = shuffled(dataset, workers)
        first, second = epoch(loader), epoch(loader)
        assert sorted(first) == ids and sorted(second) == ids
        assert first != second

    def test_a_bad_object_is_named_and_moves_no_other_sample(
        self, case: Case, fault_case: tuple[str, str, Policy, int]
    ) -> None:
        name, place, policy, workers = fault_case
        fault = self.faults[name]
        ids, layout = self.write(case)
        keys = sorted(layout)
        key = keys[{"first": 0, "middle": len(keys) // 2, "last": -1}[place]]
        if fault.damage is not None:
            case.write({key: fault.damage(self.body(key, layout[key]))})
        manifest = Manifest.build(case.root, storage_options=case.read_options)
        if fault.damage is None:
            rewrite(case, key, self.body(key, [n + OTHER_IDS for n in layout[key]]))
        named = self.named(case, key)
        if policy == "raise":
            with pytest.raises(fault.error) as raised:
                epoch(shuffled(self.dataset(manifest, case, on_error="raise"), workers))
            end_workers(raised.value)
            message = str(raised.value)
            assert re.search(fault.reason, message), message
            assert named in message and key in message, message
            return
        dataset = self.dataset(manifest, case, on_error="skip")
        loader = shuffled(dataset, workers)
        seen = Counter(epoch(loader))
        good = set(ids) - set(layout[key])
        assert set(seen) == good  # no bad sample, none of the changed object's new ones
        stats = loader.stats()["dataset"]
        assert sum(seen.values()) - len(good) == stats["skipped"]  # once, but for stand-ins
        if stats["left_out"]:  # left out when the dataset was made: no stand-ins
            assert len(dataset) == len(good) and stats["skipped"] == 0
        records = stats["skipped_keys"] + stats["left_out"]  # the bad object's, and no other
        assert records and all(named in record for record in records), (named, records)
        assert all(re.search(fault.reason, record) for record in stats["left_out"]), records

    @pytest.mark.parametrize("workers", [0, 2])
    def test_resume_mid_epoch_gives_exactly_the_samples_not_yet_seen(
        self, case: Case, workers: int
    ) -> None:
        ids, _ = self.write(case)

        def loader() -> fastload.DataLoader:  # a fresh dataset too, as a restarted job has
            return shuffled(self.dataset(case.root, case), workers, batch_size=3)

        first = loader()
        first.set_epoch(1)
        seen: list[int] = []
        for step, batch in enumerate(first):
            seen += [int(n) for n in batch]
            if step == 1:  # workers and the background thread have read further by now
                state = first.state_dict()
                break
        resumed = loader()
        resumed.load_state_dict(state)
        rest = epoch(resumed)
        assert len(seen) == 6 and sorted(seen + rest) == ids  # each sample exactly once
        whole = loader()
        whole.set_epoch(1)
        assert seen + rest == epoch(whole)  # and in the epoch's own order

    @pytest.mark.parametrize("workers", [0, 2])
    def test_requests_per_epoch_within_the_sources_bound(
        self, counted: Case, tmp_path: Path, workers: int
    ) -> None:
        case = counted
        ids, _ = self.write(case)
        requests = Requests(case)
        Manifest.build(case.root, storage_options=case.read_options)
        listing = requests.since()
        dataset = self.dataset(case.root, case, cache=Cache(tmp_path / "cache"))
        loader = shuffled(dataset, workers)
        assert sorted(epoch(loader)) == ids
        cold = requests.since(loader)
        assert cold <= listing + self.bound(dataset), (cold, listing, self.bound(dataset))
        misses = cache_misses(loader)
        assert sorted(epoch(loader)) == ids
        assert requests.since(loader) == 0  # a warm epoch reads the cache alone
        assert cache_misses(loader) == misses


# -- what the tests share ------------------------------------------------------------------------


def shuffled(dataset: RemoteDataset, workers: int, batch_size: int = 4) -> fastload.DataLoader:
    return fastload.DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        persistent_workers=False,  # ended with the epoch, not when collected in a later test
    )


def epoch(loader: fastload.DataLoader) -> list[int]:
    """The ids of one epoch's samples, in order."""
    return [int(n) for batch in loader for n in batch]


def cache_misses(loader: fastload.DataLoader) -> int:
    counters = loader.counters
    assert counters is not None
    return counters.cache.misses


def end_workers(error: BaseException) -> None:
    """End the workers of the pass that raised ``error`` now. torch leaves a pass that raised
    to the garbage collector, and a shutdown from there waited 5 s for each worker (its join
    timeout: the workers had not been told to stop); called here, it takes milliseconds."""
    trace = error.__traceback__
    while trace is not None:
        shutdown = getattr(trace.tb_frame.f_locals.get("self"), "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        trace = trace.tb_next


def rewrite(case: Case, key: str, body: bytes) -> None:
    """Replace the object ``key`` (after its listing). A local file's version is its mtime,
    which a rewrite within the same clock tick would keep: it is moved on a second."""
    case.write({key: body})
    if case.root.startswith("file://"):
        path = case.url(key).removeprefix("file://")
        written = os.stat(path).st_mtime
        os.utime(path, (written + 1, written + 1))


class Requests:
    """Requests sent to the store since the last look: counted by the FaultProxy in front of
    it, or (local files) by the loader's fetchers."""

    def __init__(self, case: Case) -> None:
        self.proxy = case.proxy
        self.last = 0
        if self.proxy is not None:
            self.proxy.reset_counters()

    def since(self, loader: fastload.DataLoader | None = None) -> int:
        if self.proxy is not None:
            now = self.proxy.counters()["requests"]
        else:
            counters = None if loader is None else loader.counters
            now = 0 if counters is None else counters.fetch.requests
        sent, self.last = now - self.last, now
        return sent
