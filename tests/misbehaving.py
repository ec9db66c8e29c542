"""A misbehaving S3 server on loopback, for the failure modes no real server shows on demand.

It answers ``ListObjectsV2`` with the same page forever (``IsTruncated=true`` and the same
continuation token), or never answers at all (``stall``), and serves no objects. Started and
stopped by the test that uses it (a thread of the test's own process).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal
from urllib.parse import parse_qs, urlparse

Behaviour = Literal["same-page", "stall"]

_PAGE = """<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">
<Name>{bucket}</Name><Prefix>{prefix}</Prefix><KeyCount>2</KeyCount><MaxKeys>1000</MaxKeys>
<IsTruncated>true</IsTruncated><NextContinuationToken>the-same-token</NextContinuationToken>
{contents}</ListBucketResult>"""
_ENTRY = (
    "<Contents><Key>{key}</Key><LastModified>2026-01-01T00:00:00.000Z</LastModified>"
    '<ETag>"0cc175b9c0f1b6a831c399e269772661"</ETag><Size>1</Size>'
    "<StorageClass>STANDARD</StorageClass></Contents>"
)


class MisbehavingS3:
    """``endpoint``, ``requests`` (how many list calls it answered) and ``storage_options``."""

    def __init__(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour
        self.requests = 0
        self.stop = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args: Any) -> None:
                pass

            def do_GET(self) -> None:
                outer.requests += 1
                if outer.behaviour == "stall":
                    outer.stop.wait(120)
                    return
                url = urlparse(self.path)
                bucket = url.path.strip("/").split("/")[0]
                prefix = parse_qs(url.query).get("prefix", [""])[0]
                keys = [f"{prefix}a.bin", f"{prefix}b.bin"]
                body = _PAGE.format(
                    bucket=bucket,
                    prefix=prefix,
                    contents="".join(_ENTRY.format(key=k) for k in keys),
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_HEAD = do_GET

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def storage_options(self) -> dict[str, Any]:
        return {
            "key": "k",
            "secret": "s",
            "endpoint_url": self.endpoint,
            "client_kwargs": {"region_name": "us-east-1"},
            "config_kwargs": {"retries": {"max_attempts": 1}},
        }


@contextmanager
def misbehaving_s3(behaviour: Behaviour) -> Iterator[MisbehavingS3]:
    server = MisbehavingS3(behaviour)
    thread = threading.Thread(target=server.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stop.set()
        server.server.shutdown()
        server.server.server_close()
        thread.join(10)
        time.sleep(0)
