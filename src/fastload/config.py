"""Frozen, validated option dataclasses; the only place that reads ``FASTLOAD_*`` variables."""

from __future__ import annotations

import os
import warnings
from collections.abc import Collection, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, TypeVar

from fastload.errors import ConfigError

__all__ = ["ChunkConfig", "DecodeConfig", "ExchangeConfig", "FetchConfig", "s3_fast_path"]


def _check(owner: object, name: str, ok: bool, expected: str) -> None:
    if not ok:
        value = getattr(owner, name)
        raise ConfigError(f"{type(owner).__name__}.{name} must be {expected}, got {value!r}")


@dataclass(frozen=True)
class FetchConfig:
    """How :mod:`fastload.fetcher` reads objects.

    concurrency: the most requests in flight at once, shared by every ``fetch()`` of one
        Fetcher in a process (threads included); the ceiling of the adaptive limit.
    adaptive: tune the requests in flight by what the store answers (the default): start at
        16 (or ``concurrency`` if lower), double while throughput (bytes/s) rises, then probe
        a quarter up and down, keeping a step only where throughput rose with it (a step
        that reads no faster is undone, down as well as up); a throttling answer (503
        SlowDown, 429) cuts the limit to 0.7 of itself, at most once per round of answers,
        never below 4. False: always ``concurrency`` in flight (a fixed setting). The limit
        is counted in FetchStats (``limit``, ``limit_peak``, ``limit_cuts``, ``throttled``).
    timeout: seconds an attempt may go without receiving anything (before the first byte, then
        between chunks of the body) before it counts as a transient failure; a slow body that
        keeps arriving is never cut off.
    retries: further attempts after a transient failure (throttling, 5xx, reset, truncation,
        timeout) while the store answers other requests: an object still failing then is
        quarantined (below). Not-found, access-denied and changed objects are never retried.
    outage_budget: seconds an object keeps being retried past ``retries`` while the store
        answers no request at all (an outage, a restart, a long throttle), counted in
        ``outage_retries`` and logged while it lasts; 0 gives up after ``retries``.
    quarantine: seconds an object given up while the store answered others fails at once,
        without a request, before it is tried again (a stalled or broken object costs its
        retries once, not on every read).
    backoff / max_backoff: full-jitter exponential backoff, base and cap in seconds.
    hedge_after: seconds after which a still-unanswered request is sent a second time and the
        first answer wins; None (the default) hedges by the latencies observed instead: a
        small read (<= 8 MiB) slower than 1.5 times the 90th percentile of the latest 512 is
        sent again (a stalled replica, a slow tail), within ``hedge_budget`` (until 16 were
        timed: after 0.25 s plus its size at 8 MiB/s).
    hedge_budget: the most hedges as a share of requests (0 turns adaptive hedging off; a
        fixed ``hedge_after`` is not budgeted).
    fast_path: deprecated (a DeprecationWarning; removed in the next release): whether the
        S3 store reads through obstore is its own option now,
        ``storage_options={"fastload_fast_path": False}`` (default: :func:`s3_fast_path`).
        Given here, it still applies to the reads of a Fetcher whose options do not say.
    """

    concurrency: int = 64
    adaptive: bool = True
    timeout: float = 60.0
    retries: int = 6
    outage_budget: float = 180.0
    quarantine: float = 600.0
    backoff: float = 0.05
    max_backoff: float = 5.0
    hedge_after: float | None = None
    hedge_budget: float = 0.05
    fast_path: bool | None = None

    def __post_init__(self) -> None:
        _check(self, "concurrency", _is_int(self.concurrency) and self.concurrency >= 1, ">= 1")
        _check(self, "adaptive", isinstance(self.adaptive, bool), "a bool")
        _check(self, "timeout", _is_num(self.timeout) and self.timeout > 0, "> 0")
        _check(self, "retries", _is_int(self.retries) and self.retries >= 0, ">= 0")
        for name in ("outage_budget", "quarantine", "backoff", "max_backoff"):
            _check(self, name, _is_num(getattr(self, name)) and getattr(self, name) >= 0, ">= 0")
        hedge = self.hedge_after
        _check(self, "hedge_after", hedge is None or (_is_num(hedge) and hedge > 0), "None or > 0")
        budget = self.hedge_budget
        _check(self, "hedge_budget", _is_num(budget) and 0 <= budget <= 1, "in [0, 1]")
        if self.fast_path is not None:
            _check(self, "fast_path", isinstance(self.fast_path, bool), "a bool")
            warnings.warn(
                "FetchConfig(fast_path=...) is deprecated and will be removed in the next "
                "release: pass storage_options={'fastload_fast_path': "
                f"{self.fast_path}}} (the S3 store's own option) instead",
                DeprecationWarning,
                stacklevel=3,  # the caller of FetchConfig(...)
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> FetchConfig:
        """Defaults overridden by ``FASTLOAD_FETCH_<FIELD>`` (e.g. FASTLOAD_FETCH_CONCURRENCY,
        FASTLOAD_FETCH_ADAPTIVE=false for a fixed ``concurrency``).
        ``FASTLOAD_FETCH_FAST_PATH`` is the S3 store's default now (:func:`s3_fast_path`)."""
        return _from_env(cls(), "FASTLOAD_FETCH_", environ, skip={"fast_path"})


def s3_fast_path(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the S3 store reads and lists ``s3://`` through obstore (where it is installed
    and the options suit it) when its ``storage_options`` do not say
    (``"fastload_fast_path"``): ``FASTLOAD_FETCH_FAST_PATH`` (true/false), else True."""
    env = os.environ if environ is None else environ
    raw = env.get(_FAST_PATH_ENV)
    if raw is None:
        return True
    try:
        return _parse_bool(raw)
    except ValueError as exc:
        raise ConfigError(f"{_FAST_PATH_ENV}={raw!r}: {exc}") from exc


_FAST_PATH_ENV = "FASTLOAD_FETCH_FAST_PATH"


@dataclass(frozen=True)
class ChunkConfig:
    """How samples inside shards (tar, parquet) are read.

    chunk_bytes: a tar shard is read in chunks of whole samples of about this size (a parquet
        row group is always one chunk); shard-aware shuffling visits chunks.
    memory_bytes: chunks each process keeps in memory (least recently used go first), so the
        batches of a chunk cost one read.
    """

    chunk_bytes: int = 64 << 20
    memory_bytes: int = 512 << 20

    def __post_init__(self) -> None:
        _check(self, "chunk_bytes", _is_int(self.chunk_bytes) and self.chunk_bytes >= 1, ">= 1")
        _check(self, "memory_bytes", _is_int(self.memory_bytes) and self.memory_bytes >= 0, ">= 0")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ChunkConfig:
        """Defaults overridden by ``FASTLOAD_CHUNK_<FIELD>`` (e.g. FASTLOAD_CHUNK_MEMORY_BYTES)."""
        return _from_env(cls(), "FASTLOAD_CHUNK_", environ)


@dataclass(frozen=True)
class DecodeConfig:
    """Bounds on what decoding a sample may allocate.

    max_bytes: the most bytes one compressed container (``.npz``) may declare its arrays
        expand to; a larger one (a 2 MB file of zeros that expands to 2 GB) is refused before
        anything is inflated, as Pillow refuses decompression bombs. A ``.npy`` is bounded by
        its own size (its data is stored as is).
    """

    max_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        _check(self, "max_bytes", _is_int(self.max_bytes) and self.max_bytes >= 1, ">= 1")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> DecodeConfig:
        """Defaults overridden by ``FASTLOAD_DECODE_<FIELD>`` (FASTLOAD_DECODE_MAX_BYTES)."""
        return _from_env(cls(), "FASTLOAD_DECODE_", environ)


@dataclass(frozen=True)
class ExchangeConfig:
    """Where ranks with no process group (torch_xla) meet, and the secret that signs what
    they hand each other (see docs/reliability.md, "Security").

    host: rank 0's address (``MASTER_ADDR``, else localhost); its store listens there alone.
    port: the store's port (``FASTLOAD_STORE_PORT``).
    secret: the job's signing secret (``FASTLOAD_STORE_SECRET``); None: rank 0 makes a key
        file for its host, which ranks on other hosts cannot read.
    """

    host: str = "localhost"
    port: int = 29517
    secret: str | None = None

    def __post_init__(self) -> None:
        _check(self, "port", _is_int(self.port) and 0 < self.port < 65536, "in [1, 65535]")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ExchangeConfig:
        env = os.environ if environ is None else environ
        try:
            port = int(env.get("FASTLOAD_STORE_PORT", cls.port))
        except ValueError as exc:
            raise ConfigError(f"FASTLOAD_STORE_PORT={env['FASTLOAD_STORE_PORT']!r}: {exc}") from exc
        return cls(
            env.get("MASTER_ADDR") or cls.host, port, env.get("FASTLOAD_STORE_SECRET") or None
        )


C = TypeVar("C", FetchConfig, ChunkConfig, DecodeConfig)


def _from_env(
    default: C,
    prefix: str,
    environ: Mapping[str, str] | None,
    skip: Collection[str] = (),
) -> C:
    env = os.environ if environ is None else environ
    changes: dict[str, Any] = {}
    for f in fields(default):
        if f.name in skip:
            continue
        name = prefix + f.name.upper()
        raw = env.get(name)
        if raw is None:
            continue
        try:
            changes[f.name] = _parse(getattr(default, f.name), raw)
        except ValueError as exc:
            raise ConfigError(f"{name}={raw!r}: {exc}") from exc
    return replace(default, **changes)


def _parse(default: object, raw: str) -> int | float | bool | None:
    """``raw`` read as the type of the field's default (a float when the default is None)."""
    if raw.lower() == "none":
        return None
    if isinstance(default, bool):
        return _parse_bool(raw)
    return int(raw) if isinstance(default, int) else float(raw)


def _parse_bool(raw: str) -> bool:
    if raw.lower() not in {"0", "1", "true", "false"}:
        raise ValueError("expected true/false")
    return raw.lower() in {"1", "true"}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
