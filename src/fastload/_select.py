"""Which listed objects a manifest keeps: a key pattern, with brace lists as WebDataset writes them.

``s3://bucket/train/shard-{000000..001281}.tar`` names 1,282 shards, as in WebDataset and the
shell: ``{a,b}`` is either, ``{000..099}`` a zero-padded range, ``{a..e}`` letters, a third part
(``{0..100..10}``) a step, and braces nest. Braces that are neither (``{x}``, an unmatched
``{``) are literal. In the names they expand to, ``*``, ``?`` and ``[...]`` match as ``fnmatch``
does (``*`` also matches ``/``). A pattern that names objects exactly (no wildcard) is a promise
that each exists: a missing one is an error naming it, as opening it would be in WebDataset.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Sequence

from fastload.errors import ConfigError, ObjectNotFoundError
from fastload.stores import parse_url
from fastload.stores._base import Listed
from fastload.stores._listing import common_prefix

__all__ = [
    "expand_braces",
    "has_wildcard",
    "literal_prefixes",
    "matches",
    "selected",
    "split_pattern",
]

_MOST = 10_000_000  # names one pattern may expand to
_WILDCARD = re.compile(r"[*?\[]")
_RANGE = re.compile(
    r"^(-?\d+)\.\.(-?\d+)(?:\.\.(-?\d+))?$|^([a-zA-Z])\.\.([a-zA-Z])(?:\.\.(-?\d+))?$"
)
_SHOWN = 5
_FOLDERS = 64  # folders a pattern's listing asks for one by one (more: their shared start)


def expand_braces(pattern: str) -> list[str]:
    """Every name ``pattern``'s braces stand for, in order (see the module docstring)."""
    return _expand(pattern, pattern)


def has_wildcard(text: str) -> bool:
    """Whether ``text`` has a character that fnmatch reads as a wildcard."""
    return _WILDCARD.search(text) is not None


def split_pattern(url: str) -> tuple[str, str | None]:
    """``url`` as the folder to list and the pattern of the keys under it to keep, from the
    part with the first brace list on; a URL with none is all folder (pattern None). Only brace
    lists start a pattern: ``*``, ``?`` and ``[`` are a key's own characters until one does."""
    parse_url(url)  # a malformed one is named whole
    at = _first_brace(url)
    if at is None:
        return url, None
    slash = url.rfind("/", 0, at)
    scheme = url.find("://")
    bucket_end = url.find("/", scheme + 3) if scheme >= 0 else 0
    if slash < 0 or bucket_end < 0 or slash < bucket_end:
        raise ConfigError(f"a brace list must come after the bucket, in the keys: {url!r}")
    return url[:slash], url[slash + 1 :]


def matches(pattern: str) -> tuple[set[str], Callable[[str], bool]]:
    """The names ``pattern`` gives exactly, and whether it keeps a key."""
    names: set[str] = set()
    wildcards: list[str] = []
    for name in expand_braces(pattern):
        if _WILDCARD.search(name):
            wildcards.append(name)
        else:
            names.add(name)

    def keeps(key: str) -> bool:
        return key in names or any(fnmatch.fnmatchcase(key, w) for w in wildcards)

    return names, keeps


def literal_prefixes(pattern: str | None) -> list[str]:
    """The starts of the keys ``pattern`` keeps, so that a listing asks the store for those
    keys only, not the whole folder: the start all its names share (``shard-{000000..001281}.
    tar``: ``shard-00``), or, where the names go into 2 to ``_FOLDERS`` folders below that start
    (``{train,val}/shard-*.tar``), the start of each folder's names (``train/shard-``,
    ``val/shard-``; no folder is then listed whole for nothing)."""
    if pattern is None:
        return [""]
    names = expand_braces(pattern)
    shared = _literal(common_prefix(min(names), max(names)))
    folders: dict[str, list[str]] = {}
    for name in names:
        folders.setdefault(name[: name.find("/", len(shared)) + 1], []).append(name)
    if "" in folders or not 2 <= len(folders) <= _FOLDERS or any(map(has_wildcard, folders)):
        return [shared]
    return [_literal(common_prefix(min(group), max(group))) for group in folders.values()]


def _literal(start: str) -> str:
    """``start`` up to its first wildcard."""
    wildcard = _WILDCARD.search(start)
    return start if wildcard is None else start[: wildcard.start()]


def selected(listed: Sequence[Listed], pattern: str | None, root: str) -> list[Listed]:
    """The objects of ``listed`` (keys relative to ``root``) that ``pattern`` keeps;
    :class:`ObjectNotFoundError` naming the objects it names exactly that are missing."""
    if pattern is None:
        return list(listed)
    names, keeps = matches(pattern)
    kept = [entry for entry in listed if keeps(entry.key)]
    missing = sorted(names - {entry.key for entry in kept})
    if missing:
        shown = ", ".join(f"{root}/{name}" for name in missing[:_SHOWN])
        raise ObjectNotFoundError(
            f"{len(missing)} of the {len(names)} objects that {pattern!r} names are missing "
            f"({shown}{', ...' if len(missing) > _SHOWN else ''})",
            url=root,
        )
    return kept


def _first_brace(text: str) -> int | None:
    start = 0
    while (at := text.find("{", start)) >= 0:
        if _closing(text, at) is not None:
            return at
        start = at + 1
    return None


def _closing(text: str, at: int) -> int | None:
    """Where the brace list opened at ``at`` closes, when it is one (a comma at its top level,
    or a range); None for a literal ``{``."""
    depth, comma = 0, False
    for i in range(at, len(text)):
        char = text[i]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return i if comma or _RANGE.match(text[at + 1 : i]) else None
        elif char == "," and depth == 1:
            comma = True
    return None


def _expand(text: str, pattern: str) -> list[str]:
    at = _first_brace(text)
    if at is None:
        return [text]
    end = _closing(text, at)
    assert end is not None
    head, body, rest = text[:at], text[at + 1 : end], _expand(text[end + 1 :], pattern)
    if _RANGE.match(body):
        choices = _range(body)
    else:
        choices = [name for part in _parts(body) for name in _expand(part, pattern)]
    if len(choices) * len(rest) > _MOST:
        raise ConfigError(f"{pattern!r} expands to more than {_MOST:,} names")
    return [head + choice + tail for choice in choices for tail in rest]


def _parts(body: str) -> list[str]:
    """``body`` split at its top-level commas."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(body):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    return [*parts, body[start:]]


def _range(body: str) -> list[str]:
    found = _RANGE.match(body)
    assert found is not None
    first, last, step, letter_first, letter_last, letter_step = found.groups()
    given = step if first is not None else letter_step
    stride = abs(int(given)) if given else 1
    if stride == 0:
        raise ConfigError(f"the brace range {{{body}}} has a step of 0")
    if first is None:
        a, b = ord(letter_first), ord(letter_last)
        return [chr(c) for c in _steps(a, b, stride)]
    a, b = int(first), int(last)
    if abs(b - a) // stride + 1 > _MOST:
        raise ConfigError(f"the brace range {{{body}}} has more than {_MOST:,} names")
    padded = any(len(x.lstrip("-")) > 1 and x.lstrip("-").startswith("0") for x in (first, last))
    width = max(len(first), len(last)) if padded else 0
    return [f"{n:0{width}d}" for n in _steps(a, b, stride)]


def _steps(a: int, b: int, stride: int) -> range:
    return range(a, b + 1, stride) if a <= b else range(a, b - 1, -stride)
