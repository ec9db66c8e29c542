"""How client-library errors become fastload's own, at each store's edge.

botocore/s3fs, obstore, gcsfs, b2sdk, aiohttp and the builtins each say "not found", "denied"
and "try again" differently. :func:`translate` looks through the exception (and the chain it
was raised from) for the first thing it can classify and returns the matching
:class:`StoreError`, with the URL (never a credential) in the message. Each store wraps the
work of its methods (read, list a page, find, stat) in :class:`boundary`, so that nothing
above the store (fetch, Manifest) ever sees a client's exception. One answer is not an error:
a range that starts at or past an object's end, which servers refuse with a 416 and Python's
slicing and local files read as no bytes; :func:`unsatisfiable` recognises it, for a read's
edge (:func:`fastload.stores._base.read_edge`) to answer ``b""``.
"""

from __future__ import annotations

import asyncio
import enum
import re
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import Any, Literal

from fastload.errors import (
    AccessDeniedError,
    FastloadError,
    ObjectNotFoundError,
    StoreError,
    TransientStoreError,
)

__all__ = [
    "Kind",
    "boundary",
    "classify",
    "redact",
    "secret_values",
    "throttling",
    "translate",
    "unsatisfiable",
]


class Kind(enum.Enum):
    NOT_FOUND = ObjectNotFoundError
    DENIED = AccessDeniedError
    TRANSIENT = TransientStoreError
    OTHER = StoreError


_NOT_FOUND_CODES = {"NoSuchKey", "NoSuchBucket", "NotFound", "404", "no_such_file", "not_found"}
_DENIED_CODES = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AllAccessDisabled",
    "ExpiredToken",
    "InvalidToken",
    "403",
    "401",
    "unauthorized",
    "bad_auth_token",
    "expired_auth_token",
}
_TRANSIENT_CODES = {
    "SlowDown",
    "ServiceUnavailable",
    "InternalError",
    "RequestTimeout",
    "Throttling",
    "ThrottlingException",
    "RequestTimeTooSkewed",
    "500",
    "502",
    "503",
    "504",
    "429",
    "service_unavailable",
    "too_many_requests",
    "internal_error",
}
# of the transient codes, those that ask the client to send fewer requests
_THROTTLING_CODES = {
    "SlowDown",
    "ServiceUnavailable",
    "Throttling",
    "ThrottlingException",
    "503",
    "429",
    "service_unavailable",
    "too_many_requests",
}
_B2_NOT_FOUND = {"FileNotPresent", "NonExistentBucket", "BucketIdNotFound"}
_B2_DENIED = {
    "Unauthorized",
    "AccessDenied",
    "InvalidAuthToken",
    "NotAllowedByAppKeyError",
    "CapabilityNotAllowed",
    "BucketNotAllowed",
    "MissingAccountData",
    "PermissionDeniedError",  # obstore
    "UnauthenticatedError",  # obstore
}
_B2_TRANSIENT = {
    "B2ConnectionError",
    "B2RequestTimeout",
    "ConnectionReset",
    "TruncatedOutput",
    "TooManyRequests",
    "ServiceError",
    "UnknownHost",
}


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _code_kind(code: object) -> Kind | None:
    text = str(code)
    if text in _NOT_FOUND_CODES:
        return Kind.NOT_FOUND
    if text in _DENIED_CODES:
        return Kind.DENIED
    if text in _TRANSIENT_CODES:
        return Kind.TRANSIENT
    return None


def _classify_one(exc: BaseException) -> Kind | None:
    if isinstance(exc, StoreError):
        return Kind(type(exc)) if type(exc) in {k.value for k in Kind} else Kind.OTHER
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & _B2_NOT_FOUND:
        return Kind.NOT_FOUND
    if names & _B2_DENIED:
        return Kind.DENIED
    if names & (_B2_TRANSIENT | {"TransientErrorMixin"}):
        return Kind.TRANSIENT
    if "GenericError" in names:  # obstore: the HTTP status is only in the message
        return _obstore_kind(str(exc))
    for code in _codes(exc):
        if (kind := _code_kind(code)) is not None:
            return kind
    if isinstance(exc, FileNotFoundError):
        return Kind.NOT_FOUND
    if isinstance(exc, PermissionError):
        return Kind.DENIED
    if isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return Kind.TRANSIENT
    if names & {
        "ClientPayloadError",
        "ClientConnectionError",
        "ServerDisconnectedError",
        "ClientOSError",
        "HTTPClientError",
        "IncompleteRead",
        "ResponseParserError",
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "FSTimeoutError",
        "ChecksumMismatch",
        "FileSha1Mismatch",
    }:
        return Kind.TRANSIENT
    return None


def _codes(exc: BaseException) -> tuple[object, ...]:
    """The provider's codes ``exc`` carries: botocore's error code and HTTP status, else a
    ``code`` (gcsfs's HttpError, b2sdk's errors)."""
    response = getattr(exc, "response", None)  # botocore ClientError
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return response.get("Error", {}).get("Code"), status
    code = getattr(exc, "code", None)
    return (code,) if isinstance(code, (int, str)) else ()


def _answer_codes(exc: BaseException, names: set[str]) -> tuple[object, ...]:
    """The codes ``exc`` carries (:func:`_codes`), or for obstore's errors and fastload's own
    (B2's GET), whose HTTP status is only in the message, that status."""
    if "GenericError" in names or isinstance(exc, StoreError):
        status = _STATUS.search(str(exc))
        return (status.group(1),) if status else ()
    return _codes(exc)


def throttling(exc: BaseException) -> bool:
    """Whether ``exc`` is the store asking for fewer requests: a 503 (S3's SlowDown, GCS's
    and B2's service_unavailable) or a 429, from any client, anywhere in its chain."""
    for link in _chain(exc):
        names = {cls.__name__ for cls in type(link).__mro__}
        if "TooManyRequests" in names:  # b2sdk
            return True
        if any(str(code) in _THROTTLING_CODES for code in _answer_codes(link, names)):
            return True
    return False


# an HTTP status in a message: obstore's, and fastload's B2 GET's own (stores/_b2get.py)
_STATUS = re.compile(r"(?:non-2xx status code:|B2 said) (\d{3})")
# "416 Range Not Satisfiable": botocore's code for it, and the status (obstore, gcsfs, B2's GET)
_UNSATISFIABLE_CODES = {"InvalidRange", "416"}


def unsatisfiable(exc: BaseException) -> bool:
    """Whether ``exc`` is the store refusing a byte range because none of it lies in the
    object, i.e. the range starts at or past the object's end (HTTP 416: botocore's
    ``InvalidRange``, obstore's and gcsfs's 416, b2sdk's ``UnsatisfiableRange``, B2's GET's
    416). The first link of its chain that is such an answer, or names another kind of
    failure (not found, denied, transient), decides: a 416 that an error then followed
    is that error."""
    for link in _chain(exc):
        names = {cls.__name__ for cls in type(link).__mro__}
        if "UnsatisfiableRange" in names or any(  # b2sdk
            str(code) in _UNSATISFIABLE_CODES for code in _answer_codes(link, names)
        ):
            return True
        if _classify_one(link) not in (None, Kind.OTHER):
            return False
    return False


def _obstore_kind(message: str) -> Kind | None:
    status = _STATUS.search(message)
    if status:
        return _code_kind(status.group(1))
    if "HTTP error" in message or "timed out" in message:
        return Kind.TRANSIENT  # reset, refused, truncated body, timeout
    return None


def classify(exc: BaseException) -> Kind:
    """What kind of failure ``exc`` is: the first classifiable error in its chain, else OTHER."""
    for link in _chain(exc):
        kind = _classify_one(link)
        if kind is not None:
            return kind
    return Kind.OTHER


_MESSAGES = {
    Kind.NOT_FOUND: "no such object or bucket",
    Kind.DENIED: "access denied (check the credentials and their permissions)",
    Kind.TRANSIENT: "the store failed transiently",
    Kind.OTHER: "the store operation failed",
}


def translate(exc: BaseException, url: str) -> StoreError:
    """The fastload error for ``exc`` raised while working on ``url`` (raise it ``from exc``)."""
    if isinstance(exc, StoreError) and exc.url is not None:
        return exc
    kind = classify(exc)
    detail = type(exc).__name__
    error: StoreError = kind.value(f"{_MESSAGES[kind]} ({detail})", url=url)
    return error


class boundary:  # (lower case: used as a statement, ``with boundary(url):``)
    """A store method's edge: an exception leaving the block is a fastload error naming
    ``url`` (its ``str()`` is taken only then), raised ``from`` the client's own.

    A fastload error passes as it is, except that a :class:`StoreError` naming no object
    (none, or only a scheme, as B2's sign-in does) is named ``url``. With ``silence`` (a
    read's ``Patience.timeout``), a ``TimeoutError`` is a :class:`TransientStoreError` saying
    that nothing came for that long (fetch counts such stalls by that cause); anything else is
    :func:`translate`-d.
    """

    __slots__ = ("silence", "url")

    def __init__(self, url: object, silence: float | None = None) -> None:
        self.url, self.silence = url, silence

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> Literal[False]:
        if not isinstance(exc, Exception):  # none, or a cancellation, an interrupt: as they are
            return False
        error = self._fastload(exc)
        if error is exc:
            return False
        raise error from exc

    def _fastload(self, exc: Exception) -> Exception:
        if isinstance(exc, StoreError) and (exc.url is None or exc.url.endswith("://")):
            message = str(exc).removesuffix(f": {exc.url}") if exc.url else str(exc)
            return type(exc)(message, url=str(self.url))
        if isinstance(exc, FastloadError):
            return exc
        if self.silence is not None and isinstance(exc, TimeoutError):
            return TransientStoreError(
                f"nothing received for {self.silence:g} s", url=str(self.url)
            )
        return translate(exc, str(self.url))


_SENSITIVE = re.compile(r"token|secret|key|password|passwd|credential|signature|sig|auth", re.I)
_QUERY_SECRET = re.compile(
    r"([?&;][^=&\s]*(?:token|secret|key|password|credential|signature|sig)[^=&\s]*=)"
    r"[^&\s'\")\]]+",
    re.I,
)
_USERINFO = re.compile(r"(://)[^/@\s:]+:[^/@\s]+@")
_REDACTED = "***"


def secret_values(options: Mapping[str, Any] | None) -> set[str]:
    """The string values of ``storage_options`` entries that look like credentials (keys,
    secrets, tokens; nested, as in a token given as a JSON document)."""
    found: set[str] = set()

    def walk(value: Any, sensitive: bool) -> None:
        if isinstance(value, Mapping):
            for name, inner in value.items():
                walk(inner, sensitive or bool(_SENSITIVE.search(str(name))))
        elif isinstance(value, (list, tuple)):
            for inner in value:
                walk(inner, sensitive)
        elif isinstance(value, str) and sensitive and len(value) >= 4:
            found.add(value)

    walk(options or {}, False)
    return found


def redact(text: str, secrets: set[str] | frozenset[str] = frozenset()) -> str:
    """``text`` without credentials: the given secret values, ``user:password@`` in URLs and
    query parameters named like tokens, keys or signatures (``?access_token=...``)."""
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, _REDACTED)
    text = _USERINFO.sub(rf"\1{_REDACTED}@", text)
    return _QUERY_SECRET.sub(rf"\1{_REDACTED}", text)
