"""fastload's exception tree.

Every error fastload raises is a :class:`FastloadError`. Each class also subclasses the builtin
that code written against plain Python would catch (``FileNotFoundError``, ``PermissionError``,
``ValueError``, ...), so ``except FileNotFoundError`` keeps working around fastload.

Low-level errors (botocore, gcsfs, b2sdk, aiohttp) are translated into this tree at one
boundary (``fastload.stores``) with ``raise ... from exc``, so the original stays attached.
"""

from __future__ import annotations

__all__ = [
    "AccessDeniedError",
    "CacheError",
    "CacheFullError",
    "ConfigError",
    "CorruptEntryError",
    "DecodeError",
    "FastloadError",
    "MissingExtraError",
    "ObjectChangedError",
    "ObjectExistsError",
    "ObjectNotFoundError",
    "RankExchangeError",
    "ServerStartError",
    "ShardError",
    "StoreError",
    "TransientStoreError",
    "UnsupportedSampleError",
]


class FastloadError(Exception):
    """Base class of every error raised by fastload."""


class ConfigError(FastloadError, ValueError):
    """An option or argument has a bad value; the message names the field."""


class MissingExtraError(FastloadError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""

    def __init__(self, module: str, extra: str, feature: str) -> None:
        self.module = module
        self.extra = extra
        super().__init__(
            f"{feature} needs the optional package {module!r}; "
            f"install it with: pip install 'fastload[{extra}]'"
        )


class StoreError(FastloadError, OSError):
    """An object-store operation failed. ``url`` names the object or bucket (never a secret)."""

    def __init__(self, message: str, *, url: str | None = None) -> None:
        self.url = url
        super().__init__(f"{message}: {url}" if url else message)

    def __reduce__(self) -> tuple[object, ...]:
        # OSError pickles through its args; keep our keyword so errors cross worker processes.
        return (_rebuild, (type(self), self.args[0], self.url))


def _rebuild(cls: type[StoreError | DecodeError], text: str, url: str | None) -> Exception:
    """Unpickle an error that carries ``url`` (they cross DataLoader worker processes)."""
    error = cls.__new__(cls)
    Exception.__init__(error, text)
    error.url = url
    return error


class ObjectNotFoundError(StoreError, FileNotFoundError):
    """The object, prefix or bucket does not exist."""


class ObjectChangedError(ObjectNotFoundError):
    """The object is no longer the version the manifest indexed: it was replaced (or deleted)
    since. Its bytes are never used under the old version; see ``on_change`` of
    :class:`fastload.RemoteDataset` for the choices (raise, skip, refresh)."""


class ObjectExistsError(StoreError, FileExistsError):
    """An exclusive create (``open(path, "xb")``, ``pipe_file(path, data, mode="create")``)
    found an object already at that name; nothing was written over it."""


class AccessDeniedError(StoreError, PermissionError):
    """The credentials are missing, wrong, or lack the permission."""


class TransientStoreError(StoreError, ConnectionError):
    """Throttling, a 5xx, a reset or a truncated body that outlasted the retries."""


class UnsupportedSampleError(FastloadError, TypeError):
    """A sample holds a value the cache cannot store; the message names its type and place."""


class DecodeError(FastloadError, ValueError):
    """An object's bytes could not be decoded or transformed; ``url`` names the object.

    (``url`` is optional so torch's DataLoader can re-raise it from a worker as itself.)
    """

    def __init__(self, message: str, *, url: str | None = None) -> None:
        self.url = url
        super().__init__(f"{message}: {url}" if url else message)

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (type(self), self.args[0], self.url))


class ShardError(DecodeError):
    """A shard (tar, parquet) that cannot be indexed or read as it was indexed: truncated,
    corrupt, or changed since; the message names the shard and the member or row group."""


class CacheError(FastloadError, OSError):
    """The cache directory cannot be used: not writable, disk full, not a fastload cache."""


class CacheFullError(CacheError):
    """The cache's disk or quota is full (ENOSPC, EDQUOT). A sample being read is still
    returned, uncached (counted in ``unstored``, with a warning); ``Cache.put`` raises it."""


class CorruptEntryError(CacheError):
    """A cache entry failed its checksum or could not be parsed (it is deleted and recomputed)."""


class RankExchangeError(FastloadError, RuntimeError):
    """Ranks with no process group (under torch_xla) could not hand each other a value through
    the store rank 0 serves: a value that another process wrote or that is signed with another
    key, a store that cannot be served or reached, a wait that timed out. The message names the
    store's address and port; no rank uses a value it refused."""


class ServerStartError(FastloadError, RuntimeError):
    """A loopback test server did not come up; the message carries the tail of its log."""
