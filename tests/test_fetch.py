"""fastload.fetch: retries, timeouts, hedging and counters against a real server and proxy."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fastload import fetcher as fetcher_module
from fastload.config import FetchConfig, s3_fast_path
from fastload.errors import ConfigError, ObjectNotFoundError, TransientStoreError
from fastload.fetcher import Fetcher, Request, fetch
from fastload.stores import filesystem
from fastload.stores._base import Body
from fastload.stores.s3 import FAST_PATH
from fastload.testing import FaultProxy, Faults, S3Server
from tests.conftest import BUCKET


@pytest.fixture
def objects(seaweed: S3Server) -> dict[str, bytes]:
    prefix = f"{BUCKET}/fetch-{uuid.uuid4().hex[:8]}"
    data = {f"s3://{prefix}/{i:03d}": os.urandom(1000 + i) for i in range(16)}
    filesystem("s3://x", seaweed.storage_options()).pipe(
        {url.removeprefix("s3://"): body for url, body in data.items()}
    )
    return data


@pytest.fixture
def proxy(seaweed: S3Server) -> Iterator[FaultProxy]:
    with FaultProxy(seaweed.endpoint, flavor="s3") as running:
        yield running


@pytest.mark.parametrize("fast_path", [True, False])
def test_retries_run_out_into_a_named_transient_error(
    seaweed: S3Server, proxy: FaultProxy, objects: dict[str, bytes], fast_path: bool
) -> None:
    proxy.set_faults(Faults(error_503=1.0))
    url = next(iter(objects))
    fetcher = Fetcher(
        {**seaweed.storage_options(proxy.endpoint), FAST_PATH: fast_path},
        FetchConfig(hedge_budget=0, retries=2, outage_budget=0),
    )
    with pytest.raises(TransientStoreError) as info:
        fetcher.fetch([url])
    assert info.value.url == url
    assert fetcher.counters.retries == 2
    assert fetcher.counters.failures == 1
    assert proxy.counters()["error_503"] >= 3  # s3fs adds its own retries under ours


def test_a_stalled_request_times_out_and_is_retried(
    seaweed: S3Server, proxy: FaultProxy, objects: dict[str, bytes]
) -> None:
    proxy.set_faults(Faults(stall=1.0, stall_seconds=3.0))
    url = next(iter(objects))
    fetcher = Fetcher(
        seaweed.storage_options(proxy.endpoint),
        FetchConfig(hedge_budget=0, timeout=0.3, retries=1, outage_budget=0),
    )
    with pytest.raises(TransientStoreError, match=r"nothing received for 0\.3 s"):
        fetcher.fetch([url])
    assert fetcher.counters.requests == 2


def test_hedged_requests_beat_the_slow_tail(
    seaweed: S3Server, proxy: FaultProxy, objects: dict[str, bytes]
) -> None:
    proxy.set_faults(Faults(stall=0.3, stall_seconds=2.0, seed=3))
    config = FetchConfig(hedge_after=0.25, timeout=30)
    fetcher = Fetcher(seaweed.storage_options(proxy.endpoint), config)
    assert fetcher.fetch(list(objects)) == list(objects.values())
    stats = fetcher.counters
    assert stats.hedges >= 1
    assert stats.hedge_wins >= 1
    assert stats.retries == 0
    assert stats.requests == len(objects) + stats.hedges


def test_a_hedge_held_too_is_hedged_again(
    seaweed: S3Server, proxy: FaultProxy, objects: dict[str, bytes]
) -> None:
    """A hedge can land on the slow replica too: a read whose first request and first hedge
    are both held gets a second hedge a delay later (before, it waited for the held ones)."""
    proxy.set_faults(Faults(stall=1.0, stall_seconds=8.0, methods=("GET",)))
    fetcher = Fetcher(seaweed.storage_options(proxy.endpoint), FetchConfig(hedge_after=0.2))
    url = next(iter(objects))
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.extend(fetcher.fetch([url])))
    reader.start()
    for _ in range(2000):  # the read and its first hedge have reached the proxy, held
        if proxy.counters()["requests"] >= 2:
            break
        time.sleep(0.005)
    proxy.set_faults(Faults())
    reader.join(60)
    assert got == [objects[url]]
    stats = fetcher.counters
    assert (stats.hedges, stats.retries) == (2, 0), stats  # (the second hedge won, unless
    # this thread took longer than the hedge delay to clear the fault)


@pytest.mark.parametrize("route", ["s3-obstore", "s3-s3fs", "gs", "b2"])
def test_a_slow_body_that_keeps_arriving_is_never_cut_off(
    route: str, request: pytest.FixtureRequest
) -> None:
    """#19: the timeout is on silence, not on total time (a 4.5 MB body at 1 MB/s, 3 s: 1.5x
    the timeout in all, with room for pauses between chunks at a load of 10)."""
    store = {"b2": "b2", "gs": "gcs"}.get(route, "seaweed")
    server = request.getfixturevalue(store)
    body = os.urandom(4_500_000)
    url = f"{route[:2]}://{BUCKET}/slow-{uuid.uuid4().hex[:8]}.bin"
    filesystem(url, server.storage_options()).pipe_file(url.split("://")[1], body)
    config = FetchConfig(hedge_budget=0, timeout=3.0, retries=0, outage_budget=0)
    with FaultProxy(server.endpoint, flavor={"b2": "b2", "gs": "gcs"}.get(route, "s3")) as proxy:
        options = {**server.storage_options(proxy.endpoint), FAST_PATH: route != "s3-s3fs"}
        fetcher = Fetcher(options, config)
        fetcher.fetch([Request(url, 0, 10)])  # clients made and signed in: not what is timed
        proxy.set_faults(Faults(bandwidth=1_000_000, methods=("GET",)))
        assert fetcher.fetch([Request(url, size=len(body))]) == [body]
        assert fetcher.counters.retries == 0
        proxy.set_faults(Faults(stall=1.0, stall_seconds=8.0, methods=("GET",)))
        with pytest.raises(TransientStoreError, match=r"nothing received for 3 s"):
            fetcher.fetch([Request(url, size=len(body))])


@pytest.mark.parametrize("fast_path", [True, False])
def test_the_first_byte_and_a_whole_body_each_get_the_timeout(
    seaweed: S3Server, fast_path: bool
) -> None:
    """A body read in one piece waits the timeout for its headers, then the timeout again for
    its bytes: 1.2 s to the first byte, then 1.2 s of body, within a 2 s timeout."""
    body = os.urandom(480_000)  # whole: under 2 s at the floor rate
    url = f"s3://{BUCKET}/two-waits-{uuid.uuid4().hex[:8]}.bin"
    filesystem(url, seaweed.storage_options()).pipe_file(url.split("://")[1], body)
    config = FetchConfig(hedge_budget=0, timeout=2.0, retries=0, outage_budget=0)
    with FaultProxy(seaweed.endpoint, flavor="s3") as proxy:
        fetcher = Fetcher({**seaweed.storage_options(proxy.endpoint), FAST_PATH: fast_path}, config)
        fetcher.fetch([Request(url, 0, 10)])  # the client made and signed in: not what is timed
        proxy.set_faults(Faults(latency=1.2, bandwidth=400_000, methods=("GET",)))
        assert fetcher.fetch([Request(url, size=len(body))]) == [body]
        assert fetcher.counters.retries == 0


@pytest.mark.parametrize("fast_path", [True, False])
def test_bodies_are_bytes_unless_buffers_are_asked_for(
    seaweed: S3Server, objects: dict[str, bytes], fast_path: bool
) -> None:
    """Users get ``bytes``; the shard readers ask for obstore's own buffer (no copy of a
    15 MB chunk), which stays valid after the fetcher is gone."""
    urls = sorted(objects)[:4]
    options = {**seaweed.storage_options(), FAST_PATH: fast_path}
    fetcher = Fetcher(options, FetchConfig(hedge_budget=0))
    sized = [Request(u, size=len(objects[u])) for u in urls]  # known length: read whole
    bodies = fetcher.fetch([*urls, *sized, Request(urls[0], 10, 20, size=len(objects[urls[0]]))])
    assert [type(b) for b in bodies] == [bytes] * 9
    assert bodies == [*(objects[u] for u in urls * 2), objects[urls[0]][10:20]]
    views = fetcher.fetch(sized, buffers=True)
    del fetcher
    assert [bytes(v) for v in views] == [objects[u] for u in urls]
    if fast_path:  # obstore's buffers, read-only (a body of known length comes whole)
        assert all(isinstance(v, memoryview) and v.readonly for v in views)


def test_reads_obstore_serves_never_import_s3fs(
    seaweed: S3Server, objects: dict[str, bytes]
) -> None:
    """s3fs comes in only for what obstore cannot serve (0.14 s of CPU at every process's,
    every DataLoader worker's, first fetch); a suffix read needs it."""
    url = sorted(objects)[0]
    script = (
        "import json, sys, fastload\n"
        "from fastload.fetcher import Request\n"
        "options = json.loads(sys.argv[1])\n"
        "body, = fastload.fetch([sys.argv[2]], storage_options=options)\n"
        "before = 's3fs' in sys.modules\n"
        "tail, = fastload.fetch([Request(sys.argv[2], -10)], storage_options=options)\n"
        "print(json.dumps([len(body), before, len(tail), 's3fs' in sys.modules]))\n"
    )
    options = json.dumps(seaweed.storage_options())
    done = subprocess.run(
        [sys.executable, "-c", script, options, url], capture_output=True, text=True, check=True
    )
    assert json.loads(done.stdout) == [len(objects[url]), False, 10, True]


def test_short_bodies_are_caught_by_the_expected_size(tmp_path: Path) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(b"12345")
    fetcher = Fetcher(config=FetchConfig(hedge_budget=0, retries=1, outage_budget=0, backoff=0.001))
    with pytest.raises(TransientStoreError, match=r"truncated body \(5 of 9 bytes\)"):
        fetcher.fetch([Request(str(path), size=9)])
    assert fetcher.counters.retries == 1
    assert fetcher.fetch([Request(str(path), 1, 3, size=5)]) == [b"23"]


def test_an_object_failing_while_the_store_answers_others_is_quarantined(tmp_path: Path) -> None:
    """A broken object costs its retries once; an outage (nothing answers) is waited out."""
    for i in range(6):
        (tmp_path / f"{i}.bin").write_bytes(b"12345")
    bad = Request(str(tmp_path / "3.bin"), size=9)  # always short: the object, not the store
    good = [Request(str(tmp_path / f"{i}.bin"), size=5) for i in range(6) if i != 3]
    config = FetchConfig(hedge_budget=0, retries=2, backoff=0.05, quarantine=60.0)
    fetcher = Fetcher(config=config)
    out = fetcher.fetch([*good, bad], return_exceptions=True)
    assert out[:5] == [b"12345"] * 5
    assert isinstance(out[5], TransientStoreError)
    assert "quarantined for 60 s" in str(out[5]) and "truncated body" in str(out[5])
    assert fetcher.counters.quarantined == 1 and fetcher.counters.outage_retries == 0
    requests = fetcher.counters.requests
    with pytest.raises(TransientStoreError, match=r"quarantined.*3\.bin"):
        fetcher.fetch([bad])
    assert fetcher.counters.requests == requests  # no request while it is in quarantine
    alone = Fetcher(config=FetchConfig(hedge_budget=0, retries=2, outage_budget=0.5, backoff=0.05))
    with pytest.raises(TransientStoreError, match=r"truncated body"):
        alone.fetch([bad])  # the store never answered: no outage to wait out
    assert alone.counters.outage_retries == 0 and alone.counters.retries == 2
    alone.fetch(good)
    with pytest.raises(TransientStoreError, match=r"quarantined.*truncated body"):
        alone.fetch([bad])  # nothing else is read meanwhile: the store is asked, and answers
    assert alone.counters.outage_retries == 0 and alone.counters.quarantined == 1


class _OutageAtOnset:
    """A store (a unit detail of the fetcher's patience, hence no server): ``slow`` is sent
    with the others, answered after they succeeded, and meets an outage that fails every
    read for ``outage`` seconds."""

    def __init__(self, outage: float) -> None:
        self.outage, self.until, self.answered = outage, 0.0, 0

    async def read(self, url: Any, span: Any, version: Any, patience: Any) -> Body:
        if str(url).endswith("slow") and not self.until:
            while self.answered < 4:
                await asyncio.sleep(0.005)
            self.until = time.monotonic() + self.outage
        await asyncio.sleep(0.01)  # every request is sent before any is answered
        if time.monotonic() < self.until:
            raise TransientStoreError("503 Service Unavailable (outage)", url=str(url))
        self.answered += 1
        return Body(b"abcde")


def test_a_straggler_an_outage_meets_at_its_onset_is_waited_for_not_quarantined(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """R8's outage test failed once (2026-11-25): the last request of a batch, sent before the
    outage, failed; the others, sent with it, had succeeded after it was sent, and nothing
    else was read meanwhile, so the store looked healthy and the object broken: quarantined,
    and the epoch failed. Now only a request sent after the failure counts, and one is sent
    to ask."""
    store = _OutageAtOnset(outage=0.5)
    monkeypatch.setattr(fetcher_module, "open_store", lambda *args, **kwargs: store)
    config = FetchConfig(hedge_budget=0, retries=2, backoff=0.01, max_backoff=0.05, quarantine=60.0)
    fetcher = Fetcher(config=config)
    urls = [f"s3://b/ok{i}" for i in range(4)] + ["s3://b/slow"]
    assert fetcher.fetch(urls) == [b"abcde"] * 5
    assert fetcher.counters.quarantined == 0 and fetcher.counters.outage_retries > 0


def test_an_object_that_stalls_beside_a_working_store_is_given_up_after_three_stalls(
    tmp_path: Path,
) -> None:
    """#19: a stalled object cost 7 timeouts; now 3 (a FIFO with no writer never answers)."""
    good = []
    for i in range(4):
        (tmp_path / f"{i}.bin").write_bytes(b"12345")
        good.append(Request(str(tmp_path / f"{i}.bin"), size=5))
    stuck = tmp_path / "stuck.bin"
    os.mkfifo(stuck)
    fetcher = Fetcher(
        config=FetchConfig(hedge_budget=0, timeout=0.3, retries=6, backoff=0.01, quarantine=60)
    )
    try:
        out = fetcher.fetch([*good, Request(str(stuck), size=5)], return_exceptions=True)
    finally:  # let the abandoned readers' open() return
        with contextlib.suppress(OSError):  # ENXIO: no reader left waiting
            os.close(os.open(stuck, os.O_WRONLY | os.O_NONBLOCK))
    assert out[:4] == [b"12345"] * 4
    assert isinstance(out[4], TransientStoreError) and "quarantined" in str(out[4])
    assert "nothing received for 0.3 s" in str(out[4])
    # 3 stalls, and one byte of another object read to ask whether the store answers
    assert fetcher.counters.requests == 4 + 3 + 1 and fetcher.counters.quarantined == 1


def test_results_keep_request_order_and_errors_stay_in_their_slot(tmp_path: Path) -> None:
    for i in range(50):
        (tmp_path / f"{i}.bin").write_bytes(str(i).encode())
    urls = [str(tmp_path / f"{i}.bin") for i in range(50)]
    urls.insert(7, str(tmp_path / "missing.bin"))
    results = fetch(urls, config=FetchConfig(hedge_budget=0, concurrency=4), return_exceptions=True)
    assert isinstance(results.pop(7), ObjectNotFoundError)
    assert results == [str(i).encode() for i in range(50)]


def test_stats_snapshot_reports_latency_percentiles(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"a")
    fetcher = Fetcher()
    fetcher.fetch([str(tmp_path / "a")] * 10)
    snap = fetcher.stats()
    assert snap["objects"] == 10
    assert snap["bytes"] == 10
    assert 0 < snap["latency_p50_ms"] <= snap["latency_p99_ms"]


def test_bad_items_and_config_are_typed_errors() -> None:
    with pytest.raises(ConfigError, match="fetch expects URLs"):
        Fetcher().fetch([42])  # type: ignore[list-item]
    with pytest.raises(
        ConfigError, match=r"a list of URLs or Requests, got one: pass \['s3://b/k'\]"
    ):
        fetch("s3://b/k")  # type: ignore[arg-type]  # it was read as one URL per character
    with pytest.raises(ConfigError, match=r"FetchConfig\.concurrency must be >= 1, got 0"):
        FetchConfig(concurrency=0)
    with pytest.raises(ConfigError, match=r"FetchConfig\.hedge_after"):
        FetchConfig(hedge_after=-1)
    with pytest.raises(ConfigError, match=r"FetchConfig\.retries"):
        FetchConfig(retries=True)


def test_config_from_environment() -> None:
    env = {"FASTLOAD_FETCH_CONCURRENCY": "8", "FASTLOAD_FETCH_HEDGE_AFTER": "0.5"}
    assert FetchConfig.from_env(env) == FetchConfig(concurrency=8, hedge_after=0.5)
    fast_path_off = {"FASTLOAD_FETCH_FAST_PATH": "false"}  # the S3 store's default now
    assert FetchConfig.from_env(fast_path_off).fast_path is None  # (no deprecated field set)
    assert s3_fast_path(fast_path_off) is False and s3_fast_path({}) is True
    with pytest.raises(ConfigError, match="FASTLOAD_FETCH_FAST_PATH='maybe'"):
        s3_fast_path({"FASTLOAD_FETCH_FAST_PATH": "maybe"})
    with pytest.raises(ConfigError, match="FASTLOAD_FETCH_TIMEOUT='soon'"):
        FetchConfig.from_env({"FASTLOAD_FETCH_TIMEOUT": "soon"})
    with pytest.raises(ConfigError, match=r"FetchConfig\.timeout"):
        FetchConfig.from_env({"FASTLOAD_FETCH_TIMEOUT": "-1"})


def test_shutdown_stops_the_pools_and_the_next_use_starts_afresh(
    seaweed: S3Server, objects: dict[str, bytes], tmp_path: Path
) -> None:
    import threading

    import fastload
    from fastload.resources import _registries

    (tmp_path / "local.bin").write_bytes(b"local")  # a sync filesystem: read in the pool
    urls = [*objects, str(tmp_path / "local.bin")]
    bodies = [*objects.values(), b"local"]
    fetcher = Fetcher(storage_options=seaweed.storage_options())
    assert fetcher.fetch(urls) == bodies
    assert any(t.name.startswith("fastload-fetch") for t in threading.enumerate())
    fastload.shutdown()
    assert not any(t.name.startswith("fastload-fetch") for t in threading.enumerate())
    assert all("0 items" in repr(registry) for registry in _registries)
    assert fetcher.fetch(urls[-3:]) == bodies[-3:]  # created again on the next use


# S3 (obstore, then s3fs), GCS and B2: a server that answers more bytes than a range asked for
@pytest.mark.parametrize(
    ("server_name", "flavor", "scheme", "fast_path"),
    [
        ("seaweed", "s3", "s3", True),
        ("seaweed", "s3", "s3", False),
        ("gcs", "gcs", "gs", True),
        ("b2", "b2", "b2", True),
    ],
)
def test_a_range_answered_with_more_bytes_than_asked_is_retried_never_used(
    request: pytest.FixtureRequest, server_name: str, flavor: str, scheme: str, fast_path: bool
) -> None:
    server = request.getfixturevalue(server_name)
    url = f"{scheme}://{BUCKET}/overlong-{uuid.uuid4().hex[:8]}/a.bin"
    body = os.urandom(300)
    filesystem(url, server.storage_options()).pipe_file(url.split("://")[1], body)
    with FaultProxy(server.endpoint, flavor=flavor) as proxy:
        options = {**server.storage_options(proxy.endpoint), FAST_PATH: fast_path}
        fetcher = Fetcher(
            options, FetchConfig(hedge_budget=0, retries=2, outage_budget=0, backoff=0.01)
        )
        proxy.set_faults(Faults(overlong=1.0, methods=("GET",)))
        with pytest.raises(TransientStoreError) as info:
            fetcher.fetch([Request(url, start=0, end=100)])
        assert info.value.url == url
        assert "164 bytes" in str(info.value)
        # some answers overlong: the retried read gives exactly the bytes asked for
        fetcher = Fetcher(
            options, FetchConfig(hedge_budget=0, retries=12, outage_budget=0, backoff=0.01)
        )
        proxy.set_faults(Faults(overlong=0.3, methods=("GET",), seed=3))
        got = fetcher.fetch([Request(url, start=s, end=s + 100) for s in (0, 50, 200)] * 4)
        assert got == [body[s : s + 100] for s in (0, 50, 200)] * 4
        assert proxy.counters()["overlong"] > 0
        tail = fetcher.fetch([Request(url, start=-40)] * 4)
        assert tail == [body[-40:]] * 4


def test_the_slow_tail_is_hedged_by_observed_latency_within_its_budget(
    seaweed: S3Server, proxy: FaultProxy
) -> None:
    """No hedge_after set (the default): after 64 reads the fetcher hedges a read slower than
    twice their p90, at most hedge_budget (5%) of requests (+ a burst of 8)."""
    prefix = f"{BUCKET}/tail-{uuid.uuid4().hex[:8]}"
    data = {f"s3://{prefix}/{i:04d}": os.urandom(5000 + i) for i in range(400)}
    filesystem("s3://x", seaweed.storage_options()).pipe(
        {url.removeprefix("s3://"): body for url, body in data.items()}
    )
    requests = [Request(url, size=len(body)) for url, body in data.items()]
    proxy.set_faults(Faults(latency=0.01))
    fetcher = Fetcher(seaweed.storage_options(proxy.endpoint), FetchConfig(timeout=30))
    assert fetcher.config.hedge_budget == 0.05  # the default (conftest turns it off by env)
    assert fetcher.fetch(requests[:100]) == list(data.values())[:100]  # learns the latencies
    proxy.set_faults(Faults(latency=0.01, stall=0.03, stall_seconds=3.0, seed=5))
    assert fetcher.fetch(requests[100:]) == list(data.values())[100:]
    stats = fetcher.counters
    assert stats.hedge_wins >= 1 and stats.hedges >= stats.hedge_wins
    assert stats.hedges <= 0.05 * stats.requests + 8, (stats.hedges, stats.requests)
    assert stats.retries == 0
    off = Fetcher(seaweed.storage_options(proxy.endpoint), FetchConfig(hedge_budget=0))
    assert off.fetch(requests[:150]) == list(data.values())[:150]
    assert off.counters.hedges == 0


def test_the_hedge_delay_follows_latencies_that_rose_after_the_first_answers(
    seaweed: S3Server, proxy: FaultProxy, objects: dict[str, bytes]
) -> None:
    """16 reads at +20 ms set the delay (about 40 ms); then every read takes 250 ms. The 16
    read at 250 ms are hedged, and their answers put the delay above 250 ms at once, so the
    next 16 are not. Before, the delay was worked out again only every 64 reads: the first
    answers' (the fastest, at 16 in flight) hedged every read of the next 64 that a hedge was
    saved for, each one wasted (8 of the next 16 here)."""
    requests = [Request(url, size=len(body)) for url, body in objects.items()]
    config = FetchConfig(hedge_budget=1.0, timeout=30)  # a hedge earned by every read
    fetcher = Fetcher(seaweed.storage_options(proxy.endpoint), config)
    proxy.set_faults(Faults(latency=0.02))
    assert fetcher.fetch(requests) == list(objects.values())
    proxy.set_faults(Faults(latency=0.25))
    assert fetcher.fetch(requests) == list(objects.values())
    hedged = fetcher.counters.hedges
    assert hedged >= 1  # (latencies that rise are hedged until they are seen)
    assert fetcher.fetch(requests) == list(objects.values())
    assert fetcher.counters.hedges == hedged, (hedged, fetcher.counters.hedges)


def test_the_last_hedges_saved_are_kept_for_a_held_read_when_nothing_else_is_read(
    seaweed: S3Server, proxy: FaultProxy, objects: dict[str, bytes]
) -> None:
    """Hedges are earned by reads sent (5% of one each), and a loop waiting for a held read
    sends none. 16 reads at +200 ms set the delay (about 0.3 s); 8 reads at +400 ms, each past
    its delay, spend the hedges saved but the last 2; then one read is held 3 s and nothing
    else is read: at twice its delay it takes one of those 2, and that hedge answers. Before,
    the 8 slow reads spent all 8 saved, and the held read, finding none, waited its 3 s (at
    the end of a cold epoch of 0.8 s, one such read doubled it)."""
    requests = [Request(url, size=len(body)) for url, body in objects.items()]
    fetcher = Fetcher(seaweed.storage_options(proxy.endpoint), FetchConfig(timeout=30))
    proxy.set_faults(Faults(latency=0.2))
    assert fetcher.fetch(requests) == list(objects.values())
    proxy.set_faults(Faults(latency=0.4))
    assert fetcher.fetch(requests[:8]) == list(objects.values())[:8]
    wins, sent = fetcher.counters.hedge_wins, proxy.counters()["requests"]
    proxy.set_faults(Faults(latency=0.2, stall=1.0, stall_seconds=3.0))
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.extend(fetcher.fetch(requests[8:9])))
    reader.start()
    for _ in range(2000):  # the read has reached the proxy, held
        if proxy.counters()["requests"] > sent:
            break
        time.sleep(0.005)
    proxy.set_faults(Faults(latency=0.2))
    reader.join(60)
    assert got == [list(objects.values())[8]]
    assert fetcher.counters.hedge_wins == wins + 1, fetcher.counters


def test_a_hedge_timer_that_ran_late_because_this_process_was_held_does_not_hedge() -> None:
    """A read's answer comes in at 0.15 s and its hedge is due at 0.1 s, but this process is
    held from 0.05 s to 0.35 s (as a garbage collection of a large heap holds the GIL, 0.16 s
    in the tails benchmark): when it runs again the hedge's timer comes first, before the
    answer is read. It looks again 20 ms later instead, by when the answer is read: one
    request. Before, it hedged, and in a cold epoch so did every read in flight through the
    collection, 6-8 at once, all wasted. (The race alone, on a loop of its own: the store's
    answer is a timer here, since a real one would be read by another thread.)"""
    fetcher = Fetcher(config=FetchConfig(hedge_after=0.1))
    loop = asyncio.new_event_loop()
    calls = 0

    async def call() -> tuple[bytes, float]:
        nonlocal calls
        calls += 1
        answered = loop.create_future()
        loop.call_later(0.15, answered.set_result, None)
        await answered
        return b"body", 0.15

    async def read() -> Any:
        loop.call_later(0.05, time.sleep, 0.3)  # the process held
        return await fetcher_module._Race(call, fetcher, Request("memory://held/x")).run()

    try:
        assert loop.run_until_complete(read()) == (b"body", 0.15)
    finally:
        loop.close()
    assert (calls, fetcher.counters.hedges) == (1, 0)


def test_an_endpoint_given_by_the_environment_is_the_fast_path_s_too(
    seaweed: S3Server, objects: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """AWS_ENDPOINT_URL with the keys and region in the environment (a MinIO or SeaweedFS
    setup): s3fs honoured it, the obstore fast path assumed AWS's address and failed after
    8 s of retries (a 'builder error')."""
    options = seaweed.storage_options()
    monkeypatch.setenv("AWS_ENDPOINT_URL", options["endpoint_url"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", options["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", options["secret"])
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    fetcher = Fetcher(config=FetchConfig(hedge_budget=0, retries=1, outage_budget=0))
    assert fetcher.fetch(list(objects)) == list(objects.values())
