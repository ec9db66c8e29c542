"""A fault-injecting reverse proxy for the loopback object stores.

It sits in front of any of the servers (or a real endpoint) and adds, per request: latency and
jitter, a bandwidth cap (per response, or shared by all: a store's link), provider-shaped 503
(throttling: at random, or above a number of requests in flight) and 500 errors, connection resets,
truncated bodies (full Content-Length, half the bytes), overlong bodies (64 bytes more than
the range asked for, Content-Length to match) and stalls. Rates and the seed are set at
start and can be changed while it runs; counters are readable. The Host header is forwarded
unchanged, so request signatures still verify. (``tc netem`` is not available on these machines.)
"""

from __future__ import annotations

import dataclasses
import json
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from fastload.errors import ConfigError
from fastload.testing._process import (
    ServerProcess,
    http_answers,
    python_module_command,
)

Flavor = Literal["s3", "gcs", "b2"]
CONTROL_PATH = "/__fastload_proxy__"
OVERLONG = 64  # bytes an overlong answer adds
_RATES = ("error_503", "error_500", "reset", "truncate", "overlong", "stall")
# throttled: 503s for ``throttle_above``; most_in_flight: the most requests served at once
COUNTER_KEYS = ("requests", "forwarded", "bytes_out", *_RATES, "throttled", "most_in_flight")


@dataclass(frozen=True)
class Faults:
    """What the proxy does to each request. Rates are probabilities in [0, 1] per request."""

    latency: float = 0.0
    """Seconds added before each request is forwarded."""
    jitter: float = 0.0
    """Extra seconds, uniform in [0, jitter), added to ``latency``."""
    bandwidth: float | None = None
    """Response body rate cap in bytes/s per response (None: uncapped)."""
    total_bandwidth: float | None = None
    """Response body rate cap in bytes/s shared by every response at once, as a store's link
    is: more requests in flight split it, none is faster (None: uncapped)."""
    throttle_above: int | None = None
    """Answer 503 (the provider's throttling answer: S3's SlowDown) to a request that arrives
    while this many are being served already: a store throttling a client that sends too much
    at once (None: never). Counted in ``throttled``, not ``error_503``."""
    error_503: float = 0.0
    error_500: float = 0.0
    reset: float = 0.0
    """Close the connection with a TCP reset before any response."""
    truncate: float = 0.0
    """Send the headers with the full Content-Length, half the body, then close."""
    overlong: float = 0.0
    """Answer a successful GET with ``OVERLONG`` bytes more than the store sent (Content-Length
    to match, Content-Range as the store sent it): a server that ignores a range's end."""
    stall: float = 0.0
    """Send nothing for ``stall_seconds``, then answer normally."""
    stall_seconds: float = 30.0
    methods: tuple[str, ...] = ()
    """Only requests with these methods get faults (latency applies to all); empty: all."""
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("latency", "jitter", "stall_seconds"):
            if getattr(self, name) < 0:
                raise ConfigError(f"Faults.{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("bandwidth", "total_bandwidth", "throttle_above"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"Faults.{name} must be > 0 or None, got {value!r}")
        for name in _RATES:
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"Faults.{name} is a probability in [0, 1], got {value!r}")
        if sum(getattr(self, name) for name in _RATES) > 1.0:
            raise ConfigError(f"Faults: the fault rates {_RATES} add up to more than 1")
        object.__setattr__(self, "methods", tuple(m.upper() for m in self.methods))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Faults:
        data = json.loads(text)
        data["methods"] = tuple(data.get("methods", ()))
        return cls(**data)


class FaultProxy(ServerProcess):
    """The proxy in a child process; ``endpoint`` is what clients should use."""

    name = "fault-proxy"

    def __init__(self, upstream: str, *, flavor: Flavor = "s3", faults: Faults | None = None):
        super().__init__()
        if flavor not in ("s3", "gcs", "b2"):
            raise ConfigError(f"FaultProxy flavor must be 's3', 'gcs' or 'b2', got {flavor!r}")
        self.upstream = upstream.rstrip("/")
        self.flavor = flavor
        self.initial_faults = faults or Faults()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> Sequence[str]:
        return python_module_command(
            "fastload.testing._proxyapp",
            "--port",
            str(self.port),
            "--upstream",
            self.upstream,
            "--flavor",
            self.flavor,
            "--faults",
            self.initial_faults.to_json(),
        )

    def ready(self) -> bool:
        return http_answers(f"{self.endpoint}{CONTROL_PATH}/counters")

    def _control(self, path: str, body: str | None = None) -> Any:
        request = urllib.request.Request(
            f"{self.endpoint}{CONTROL_PATH}/{path}",
            data=body.encode() if body is not None else None,
            method="POST" if body is not None else "GET",
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def set_faults(self, faults: Faults) -> None:
        """Replace the faults (and reseed) while the proxy runs."""
        self._control("faults", faults.to_json())

    def faults(self) -> Faults:
        return Faults.from_json(json.dumps(self._control("faults")))

    def counters(self) -> dict[str, int]:
        """requests, forwarded, bytes_out, one count per injected fault kind, and the most
        requests served at once (``most_in_flight``)."""
        counters: dict[str, int] = self._control("counters")
        return counters

    def reset_counters(self) -> None:
        self._control("counters/reset", "")
