"""The fault proxy's aiohttp application; see :mod:`fastload.testing.proxy`.

Run: ``python -m fastload.testing._proxyapp --port P --upstream URL --flavor s3 --faults JSON``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import socket
import struct
from collections import Counter
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from fastload.testing.proxy import _RATES, CONTROL_PATH, COUNTER_KEYS, OVERLONG, Faults

_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
_CHUNK = 64 * 1024


def provider_error(flavor: str, status: int) -> web.Response:
    """An error response shaped like the provider's own, so clients classify it correctly."""
    if flavor == "s3":
        code, message = (
            ("SlowDown", "Please reduce your request rate.")
            if status == 503
            else ("InternalError", "We encountered an internal error. Please try again.")
        )
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message>"
            "<RequestId>fastload-proxy</RequestId></Error>"
        )
        return web.Response(status=status, text=body, content_type="application/xml")
    if flavor == "gcs":
        reason = "backendError" if status == 503 else "internalError"
        payload = {
            "error": {
                "code": status,
                "message": "Backend Error" if status == 503 else "Internal Error",
                "errors": [{"reason": reason, "message": reason, "domain": "global"}],
            }
        }
        return web.json_response(payload, status=status)
    code = "service_unavailable" if status == 503 else "internal_error"
    return web.json_response(
        {"status": status, "code": code, "message": f"injected {code}"}, status=status
    )


class ProxyApp:
    def __init__(self, upstream: str, flavor: str, faults: Faults) -> None:
        self.upstream = upstream.rstrip("/")
        self.flavor = flavor
        self.counters: Counter[str] = Counter()
        self.in_flight = 0  # requests being served
        self.link_free = 0.0  # when the shared link (total_bandwidth) has sent what it was given
        self.set_faults(faults)
        self._session: aiohttp.ClientSession | None = None

    def set_faults(self, faults: Faults) -> None:
        self.faults = faults
        self.rng = random.Random(faults.seed)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 31)
        app.router.add_get(f"{CONTROL_PATH}/counters", self.get_counters)
        app.router.add_post(f"{CONTROL_PATH}/counters/reset", self.reset_counters)
        app.router.add_get(f"{CONTROL_PATH}/faults", self.get_faults)
        app.router.add_post(f"{CONTROL_PATH}/faults", self.post_faults)
        app.router.add_route("*", "/{tail:.*}", self.forward)
        app.cleanup_ctx.append(self._client)
        return app

    async def _client(self, _app: web.Application) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        self._session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        )
        yield
        await self._session.close()

    # -- control -----------------------------------------------------------------------------
    async def get_counters(self, _request: web.Request) -> web.Response:
        return web.json_response({key: self.counters[key] for key in COUNTER_KEYS})

    async def reset_counters(self, _request: web.Request) -> web.Response:
        self.counters.clear()
        return web.json_response({})

    async def get_faults(self, _request: web.Request) -> web.Response:
        return web.Response(text=self.faults.to_json(), content_type="application/json")

    async def post_faults(self, request: web.Request) -> web.Response:
        self.set_faults(Faults.from_json(await request.text()))
        return web.json_response({})

    # -- data path ---------------------------------------------------------------------------
    def _pick_fault(self, method: str) -> str | None:
        faults = self.faults
        if faults.methods and method not in faults.methods:
            return None
        draw = self.rng.random()
        for name in _RATES:
            rate: float = getattr(faults, name)
            if draw < rate:
                return name
            draw -= rate
        return None

    async def forward(self, request: web.Request) -> web.StreamResponse:
        self.in_flight += 1
        counters = self.counters
        counters["most_in_flight"] = max(counters["most_in_flight"], self.in_flight)
        try:
            return await self._serve(request)
        finally:
            self.in_flight -= 1

    def _over_limit(self, method: str) -> bool:
        """Whether a request arriving now is throttled (``Faults.throttle_above``)."""
        faults = self.faults
        if faults.throttle_above is None or (faults.methods and method not in faults.methods):
            return False
        return self.in_flight > faults.throttle_above  # (in_flight counts this request)

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        faults = self.faults
        self.counters["requests"] += 1
        throttled = self._over_limit(request.method)
        fault = None if throttled else self._pick_fault(request.method)
        delay = faults.latency + (self.rng.random() * faults.jitter if faults.jitter else 0.0)
        body = await request.read()
        if delay:
            await asyncio.sleep(delay)
        if throttled:
            self.counters["throttled"] += 1
            return provider_error(self.flavor, 503)
        if fault is not None:
            self.counters[fault] += 1
        if fault == "error_503":
            return provider_error(self.flavor, 503)
        if fault == "error_500":
            return provider_error(self.flavor, 500)
        if fault == "reset":
            return self._reset(request)
        if fault == "stall":
            await asyncio.sleep(faults.stall_seconds)
        return await self._relay(request, body, fault)

    @staticmethod
    def _reset(request: web.Request) -> web.StreamResponse:
        transport = request.transport
        if transport is not None:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()
        # The connection is gone; aiohttp discards whatever is returned.
        return web.Response(status=499)

    async def _relay(
        self, request: web.Request, body: bytes, fault: str | None
    ) -> web.StreamResponse:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        async with self._session.request(
            request.method,
            self.upstream + str(request.rel_url),
            headers=headers,
            data=body if body else None,
            allow_redirects=False,
            skip_auto_headers=("Content-Type", "User-Agent", "Accept", "Accept-Encoding"),
        ) as upstream:
            payload = await upstream.read()
            out_headers = {
                k: v
                for k, v in upstream.headers.items()
                if k.lower() not in _HOP_BY_HOP and k.lower() != "content-length"
            }
            status = upstream.status
            head_length = upstream.headers.get("Content-Length")
        self.counters["forwarded"] += 1
        response = web.StreamResponse(status=status, headers=out_headers)
        if request.method == "HEAD":
            if head_length is not None:
                response.headers["Content-Length"] = head_length
            await response.prepare(request)
            await response.write_eof()
            return response
        truncate = fault == "truncate"
        if fault == "overlong" and request.method == "GET" and status < 300:
            payload += b"\xee" * OVERLONG
        response.content_length = len(payload)
        await response.prepare(request)
        if truncate and len(payload) > 1:
            payload = payload[: len(payload) // 2]
        await self._write_body(response, payload)
        if truncate and request.transport is not None:
            request.transport.close()
            return response
        await response.write_eof()
        self.counters["bytes_out"] += len(payload)
        return response

    async def _write_body(self, response: web.StreamResponse, payload: bytes) -> None:
        if self.faults.bandwidth is None and self.faults.total_bandwidth is None:
            await response.write(payload)
            return
        for offset in range(0, len(payload), _CHUNK):
            chunk = payload[offset : offset + _CHUNK]
            await asyncio.sleep(self._pace(len(chunk)))  # pace first: the last byte lands on time
            await response.write(chunk)

    def _pace(self, size: int) -> float:
        """Seconds to wait before sending ``size`` bytes of a body: their time at the
        response's own rate, and their turn on the shared link (each chunk books the link
        after those booked before it, so responses in flight split its rate)."""
        faults, now = self.faults, asyncio.get_running_loop().time()
        wait = size / faults.bandwidth if faults.bandwidth else 0.0
        if faults.total_bandwidth:
            self.link_free = max(now, self.link_free) + size / faults.total_bandwidth
            wait = max(wait, self.link_free - now)
        return wait


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="fastload fault-injecting proxy")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--flavor", choices=("s3", "gcs", "b2"), default="s3")
    parser.add_argument("--faults", default="{}")
    args = parser.parse_args(argv)
    proxy = ProxyApp(args.upstream, args.flavor, Faults.from_json(args.faults))
    web.run_app(proxy.app(), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()


__all__ = ["ProxyApp", "main", "provider_error"]
