"""The key-value store through which ranks with no process group (under torch_xla) hand each
other values (``fastload.ranks``), made safe to run beside other processes.

Rank 0 serves a torch ``TCPStore`` on the interface of ``MASTER_ADDR`` only (else localhost),
at ``FASTLOAD_STORE_PORT`` (else 29517). Every value is signed with HMAC-SHA256 under the job's
key, over its name and its bytes, and encoded by :mod:`fastload._wire` (never pickled). The key
is ``FASTLOAD_STORE_SECRET`` where it is set (the same on every host), else 32 random bytes
that rank 0 writes, before it serves, to a file only its user can read; the other ranks on its
host read that file once they reach the store. A value that is unsigned, signed with another
key or under another name, or not one fastload encodes, is a :class:`RankExchangeError` naming
the store, as is a store that cannot be served or reached. The trust model is in
docs/reliability.md ("Security: ranks without a process group").
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import socket
import stat
import tempfile
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from fastload._wire import decode, encode
from fastload.config import ExchangeConfig
from fastload.errors import ConfigError, RankExchangeError

__all__ = ["RankStore", "sign"]

log = logging.getLogger(__name__)

_WAIT = timedelta(hours=6)  # rank 0 may list a large bucket for a long time
_KEY_BYTES = 32
_DIGEST_BYTES = hashlib.sha256().digest_size
_SECRET_CHARS = 32  # the fewest FASTLOAD_STORE_SECRET may have


def sign(key: bytes, name: str, payload: bytes) -> bytes:
    """``payload`` as stored under ``name``: its digest first."""
    return _digest(key, name, payload) + payload


def _digest(key: bytes, name: str, payload: bytes) -> bytes:
    """HMAC-SHA256 of ``payload`` and the ``name`` it is stored under."""
    mac = hmac.new(key, name.encode() + b"\0", hashlib.sha256)
    mac.update(payload)
    return mac.digest()


class RankStore:
    """One rank's client of the store rank 0 serves (rank 0's serves it, too)."""

    def __init__(self, rank: int) -> None:
        config = ExchangeConfig.from_env()
        self.host, self.port, secret = config.host, config.port, config.secret
        self.where = f"the rank store at {self.host}:{self.port}"
        with self._talking("serve" if rank == 0 else "reach"):
            if rank == 0:
                self._key = _given(secret) if secret else _made(self._key_file())
                self._store = dist.TCPStore(  # type: ignore[attr-defined]
                    self.host, self.port, is_master=True, wait_for_workers=False,
                    timeout=_WAIT, master_listen_fd=self._listening(),
                )  # fmt: skip
            else:  # connected first: rank 0 wrote its key file before it served
                self._store = dist.TCPStore(self.host, self.port, timeout=_WAIT)  # type: ignore[attr-defined]
                self._key = _given(secret) if secret else self._read_key()

    def put(self, name: str, value: Any) -> None:
        """Store ``value`` under ``name``, signed (a ``TypeError`` if it cannot cross)."""
        signed = sign(self._key, name, encode(value))
        with self._talking(f"write {name} to"):
            self._store.set(name, signed)  # type: ignore[arg-type]  # bytes, as torch takes

    def wait(self, names: list[str]) -> None:
        with self._talking(f"wait for {names[0]} and the rest on"):
            self._store.wait(names, _WAIT)

    def take(self, name: str) -> Any:
        """The value under ``name``, if this job's key signed it under that name."""
        with self._talking(f"read {name} from"):
            data: bytes = self._store.get(name)
        digest, payload = data[:_DIGEST_BYTES], data[_DIGEST_BYTES:]
        if not hmac.compare_digest(digest, _digest(self._key, name, payload)):
            raise RankExchangeError(
                f"refused {name} from {self.where}: it is not signed with this job's key "
                "(another process wrote it, or the ranks were given different "
                "FASTLOAD_STORE_SECRET values)"
            )
        try:
            return decode(payload)
        except ValueError as exc:
            raise RankExchangeError(f"refused {name} from {self.where}: {exc}") from exc

    def add(self, name: str, amount: int) -> int:
        with self._talking(f"count {name} on"):
            total: int = self._store.add(name, amount)
        return total

    def delete(self, name: str) -> None:
        with self._talking(f"delete {name} from"):
            self._store.delete_key(name)

    @contextlib.contextmanager
    def _talking(self, doing: str) -> Iterator[None]:
        try:
            yield
        except (dist.DistError, OSError) as exc:
            reason = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise RankExchangeError(f"could not {doing} {self.where}: {reason}") from exc

    def _listening(self) -> int:
        """A socket listening on ``MASTER_ADDR``'s address alone (torch's own store listens
        on every interface), handed to the store to serve on. A host name that resolves here
        only to a loopback address (``127.0.1.1 host`` in /etc/hosts) names another address
        on the other hosts, which could never reach it: then on every interface, as torch's."""
        found = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        outward = [info for info in found if not ipaddress.ip_address(info[4][0]).is_loopback]
        family, kind, proto, _, address = (outward or found)[0]
        if not outward and not _loopback_name(self.host):
            log.warning(
                "MASTER_ADDR %r resolves here only to the loopback address %s, which the "
                "ranks on other hosts cannot reach: %s listens on every interface (as torch's "
                "own store does); give MASTER_ADDR this host's address to serve on it alone",
                self.host,
                address[0],
                self.where,
            )
            address = ("::" if family == socket.AF_INET6 else "0.0.0.0", self.port)
        with socket.socket(family, kind, proto) as listening:
            # as torch's own: a new job on the port need not wait out the last one's TIME_WAIT
            listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listening.bind(address)
            listening.listen()
            return listening.detach()  # the store closes it

    def _key_file(self) -> Path:
        """Where rank 0 leaves the key for the ranks on its host: a directory only this user
        can use, in ``$XDG_RUNTIME_DIR`` (else the temporary directory)."""
        folder = Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir())
        folder /= f"fastload-{os.getuid()}"
        folder.mkdir(mode=0o700, exist_ok=True)
        found = folder.lstat()
        if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid() or found.st_mode & 0o077:
            raise RankExchangeError(
                f"{folder} would hold the key of {self.where}, but other users can use it "
                "(or it is not this user's directory)"
            )
        return folder / f"rank-store-{self.host}-{self.port}.key"

    def _read_key(self) -> bytes:
        path = self._key_file()
        try:
            key = path.read_bytes()
        except FileNotFoundError:
            raise RankExchangeError(
                f"{self.where} is served, but this host has no key for it ({path}): rank 0 "
                "runs on another host? Set FASTLOAD_STORE_SECRET to the same secret for every "
                "rank on every host"
            ) from None
        if len(key) != _KEY_BYTES:
            raise RankExchangeError(f"the key of {self.where} at {path} is damaged")
        return key


def _loopback_name(host: str) -> bool:
    """Whether ``host`` says loopback itself (``localhost``, ``127.0.0.1``, ``::1``)."""
    if host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name
        return False


def _given(secret: str) -> bytes:
    if len(secret) < _SECRET_CHARS:
        raise ConfigError(
            f"FASTLOAD_STORE_SECRET has {len(secret)} characters, fewer than "
            f"{_SECRET_CHARS}: use a random one, e.g. the output of 'openssl rand -hex 32'"
        )
    return secret.encode()


def _made(path: Path) -> bytes:
    """A new random key, written atomically to ``path`` (readable by this user alone)."""
    key = secrets.token_bytes(_KEY_BYTES)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mode 0600
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(key)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return key
