"""Several objects, one sample: the channels of a field, a DICOM series, an image and its mask.

``Groups(where, by)``: ``by`` names each object's group: a regular expression (its first
group, or the whole match, is the group name) or a callable ``key -> name`` (None leaves the
object out). Groups come in sorted order, their members sorted by key with numbers by value
(``_ch2`` before ``_ch10``, ``9.dcm`` before ``10.dcm``: a transform that stacks members in
order stacks them as numbered); ``decode`` receives ``{member key: bytes}``, or decodes each
member by name (``decode="tiff"``) or by pattern (``{"*.tiff": "tiff"}``).

A member's *role* is its key without the group name (``_ch3.tiff`` in ``f02_ch3.tiff``). When
most groups share one set of roles, a group that lacks one (a missing channel) or has an extra
one is *incomplete*: ``incomplete="raise"`` (the default) names them, ``"skip"`` leaves them
out (logged), ``"accept"`` keeps them. ``members=`` states the roles (or their number) instead.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any

import numpy as np

from fastload.errors import ConfigError, DecodeError
from fastload.fetcher import Fetcher
from fastload.manifest import Kept, Manifest, Strings, label_codes
from fastload.sources import (
    DecodeSpec,
    Opening,
    Part,
    Sample,
    Source,
    group_version,
    parts_bytes,
    read_objects,
)
from fastload.sources._complete import Incomplete, check_policy, incomplete_sets
from fastload.sources.labels import Labels, label_table
from fastload.transforms import GROUP_DECODERS, decoder, fingerprint

__all__ = ["GroupRule", "GroupedObjects", "Groups", "Incomplete", "group_decoder"]

log = logging.getLogger(__name__)

GroupRule = str | re.Pattern[str] | Callable[[str], str | None]
_SHOWN = 5  # names listed in a message
_DIGITS = re.compile(r"(\d+)")  # split keeps them: text and numbers alternate, text first


@dataclass(frozen=True, eq=False)
class Groups(Source):
    """Several objects make one sample (see the module docstring and :class:`Source` for
    ``where``, ``pattern``, ``manifest_path`` and ``reuse_listing``).

    by: a regex whose first group names each object's group (or its whole match, when it has
        no group), or a callable ``key -> group name`` (None leaves the object out).
    incomplete: a group that lacks a member most groups have, or has an extra one:
        ``"raise"`` names them, ``"skip"`` leaves them out (named in ``stats()``),
        ``"accept"`` keeps them.
    members: the roles every group has (``["_ch1.tiff", ...]``) or their number, instead of
        what most groups have.

    ``decode`` receives ``{member key: bytes}``, or decodes each member (``decode="tiff"`` or
    ``{"*.tiff": "tiff", "*.json": my_json}``).
    """

    by: GroupRule
    _: KW_ONLY
    incomplete: Incomplete = "raise"
    members: int | Sequence[str] | None = None

    name = "groups"
    by_member = True
    refreshable = True
    takes_labels = True
    default_decode = "npy"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_policy(self.incomplete, self.members)
        _namer(self.by)  # a wrong rule fails before any listing

    def open(self, manifest: Manifest, opening: Opening) -> GroupedObjects:
        return GroupedObjects(manifest, self, opening.labels)

    def decoder(self, decode: DecodeSpec) -> Callable[[Any], Any]:
        return super().decoder(None) if decode is None else group_decoder(decode)


_SLOT = "groups"  # the manifest's slot for a grouping (see _saved_grouping)


class GroupedObjects:
    """The groups of ``manifest``'s objects as samples (see the module docstring)."""

    blocks = None
    reader_version = ""  # a group's version follows its members and their order

    def __init__(self, manifest: Manifest, spec: Groups, labels: Labels | None = None) -> None:
        group_by, incomplete, members = spec.by, spec.incomplete, spec.members
        self.root = manifest.root
        rule = _rule(group_by, incomplete, members)
        saved = _saved_grouping(manifest, rule)
        if saved is not None:
            found, left_out = saved
            log.info("%s: %d groups as saved with the manifest (%s)", self.root, len(found), rule)
        else:
            keys = manifest.keys()
            groups = _group(keys, manifest.root, group_by)
            groups, left_out = _check_complete(groups, keys, manifest.root, incomplete, members)
            found = [(name, _numbered(groups[name], keys)) for name in sorted(groups)]
            if rule is not None:  # saving the manifest keeps it: a restart does not group again
                manifest = manifest.keeping(_SLOT, _grouping(rule, found, left_out))
        self.manifest = manifest
        self.left_out = left_out  # incomplete groups, under incomplete="skip": why each
        self.names = [name for name, _ in found]
        self._members = [idx for _, idx in found]
        self.classes: tuple[str, ...] | None = None
        self._labels: list[int] | None = None
        if labels is not None:
            self._join_labels(labels, incomplete)

    def _leave_out(self, names: set[str], why: str) -> None:
        log.warning("leaving out %d groups under %s: %s", len(names), self.root, why)
        kept = [(n, m) for n, m in zip(self.names, self._members, strict=True) if n not in names]
        self.names, self._members = [n for n, _ in kept], [m for _, m in kept]
        self.left_out = sorted([*self.left_out, *(f"{self.root}/{n}: {why}" for n in names)])

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, index: int) -> Sample:
        name, members = self.names[index], self._members[index]
        entries = [self.manifest[i] for i in members]
        parts = tuple(Part(e.key, e.url, e.size, e.version) for e in entries)
        label = None if self._labels is None else self._labels[index]
        return Sample(name, f"{self.root}/{name}", group_version(parts), parts, label, index)

    def identities(self, indices: Sequence[int]) -> list[tuple[str, str, int | None]]:
        return [(s.url, s.version, s.label) for s in map(self.__getitem__, indices)]

    def read(self, samples: Sequence[Sample], fetcher: Fetcher) -> list[Any]:
        return read_objects(samples, fetcher, _members)

    def nbytes(self, indices: Sequence[int] | np.ndarray) -> int:
        return parts_bytes(self, indices)

    def uncached(self) -> None:
        pass  # nothing it reads is let go for the cache

    def _join_labels(self, labels: Labels, incomplete: Incomplete) -> None:
        table = label_table(labels, self.names, _folder)
        prefix = self.root + "/"
        table = {(k[len(prefix) :] if k.startswith(prefix) else k): v for k, v in table.items()}
        absent = [name for name in self.names if name not in table]
        if len(absent) == len(self.names):
            raise ConfigError(
                f"labels match none of the {len(self.names)} groups under {self.root} "
                f"(groups look like {self.names[:3]}, label keys like {list(table)[:3]})"
            )
        if absent and incomplete != "skip":
            raise ConfigError(
                f"{len(absent)} of {len(self.names)} groups under {self.root} have no label "
                f"(first: {absent[:_SHOWN]}); pass incomplete='skip' to leave them out"
            )
        if absent:
            self._leave_out(set(absent), "incomplete group, no label")
        self._labels, names = label_codes(
            [table[name] for name in self.names], self.root, self.names, labels.classes
        )
        self.classes = None if names is None else tuple(names)


def _grouping(
    rule: str, groups: Sequence[tuple[str, Sequence[int]]], left_out: Sequence[str]
) -> Kept:
    """A grouping as the manifest keeps it: each group's name, the entry indices of its
    members (``members[ends[i-1]:ends[i]]``), and the groups left out, each with why."""
    names, gone = Strings.of([name for name, _ in groups]), Strings.of(left_out)
    arrays = {
        "name_blob": names.blob,
        "name_ends": names.ends,
        "members": np.asarray([i for _, idx in groups for i in idx], dtype=np.int64),
        "ends": np.cumsum([len(idx) for _, idx in groups], dtype=np.int64),
        "left_out_blob": gone.blob,
        "left_out_ends": gone.ends,
    }
    return Kept(rule, arrays)


def _saved_grouping(
    manifest: Manifest, rule: str | None
) -> tuple[list[tuple[str, list[int]]], list[str]] | None:
    """The groups (and those left out) ``manifest`` keeps, when ``rule`` made them and they
    fit its entries; a grouping saved before left-out groups were kept has another rule."""
    kept = manifest.kept.get(_SLOT)
    if kept is None or rule is None or kept.tag != rule:
        return None
    arrays = kept.arrays
    members, ends = arrays["members"], arrays["ends"]
    if len(members) and (int(members.max()) >= len(manifest) or int(members.min()) < 0):
        return None
    names = Strings(arrays["name_blob"], arrays["name_ends"]).tolist()
    left_out = Strings(arrays["left_out_blob"], arrays["left_out_ends"]).tolist()
    starts = [0, *ends[:-1].tolist()]
    listed = members.tolist()
    groups = [(n, listed[a:b]) for n, a, b in zip(names, starts, ends.tolist(), strict=True)]
    return groups, left_out


def _rule(group_by: GroupRule, incomplete: Incomplete, members: object) -> str | None:
    """What identifies a grouping (None: a callable whose code cannot be fingerprinted)."""
    try:
        if isinstance(group_by, (str, re.Pattern)):
            pattern = re.compile(group_by)
            what = f"re:{pattern.pattern}/{int(pattern.flags)}"
        else:
            what = f"fn:{fingerprint(group_by)}"
    except (re.error, ConfigError, TypeError):  # grouping says what is wrong with it
        return None
    return f"{what}|incomplete={incomplete}|members={members!r}|numbered|left-out"


def _numbered(members: list[int], keys: list[str]) -> list[int]:
    """``members`` (entry indices) in the order of their keys, runs of digits by value."""

    def order(i: int) -> list[Any]:
        return [int(part) if part.isdigit() else part for part in _DIGITS.split(keys[i])]

    return sorted(members, key=order)


def _members(sample: Sample, bodies: Sequence[bytes]) -> dict[str, bytes]:
    return {part.key: body for part, body in zip(sample.parts, bodies, strict=True)}


def _group(keys: list[str], root: str, group_by: GroupRule) -> dict[str, list[int]]:
    name_of = _namer(group_by)
    groups: dict[str, list[int]] = {}
    left_out: list[str] = []
    for i, key in enumerate(keys):
        try:
            name = name_of(key)
        except Exception as exc:  # the user's callable
            raise ConfigError(f"Groups by= failed on {key!r}: {type(exc).__name__}: {exc}") from exc
        if name is None:
            left_out.append(key)
        elif not isinstance(name, str) or not name:
            what = "the empty group name" if name == "" else "a group name that is not a str,"
            raise ConfigError(f"Groups by= gave {what} {name!r} for {key!r} (None leaves it out)")
        else:
            groups.setdefault(name, []).append(i)
    if not groups:
        raise ConfigError(
            f"Groups by={_describe(group_by)} matches none of the {len(keys)} objects under "
            f"{root} (keys look like {keys[:3]})"
        )
    if _names_a_suffix(group_by, groups, keys):
        raise ConfigError(
            f"Groups by={_describe(group_by)} has no capture group, so its whole match names "
            f"each group, and here that is the end of every key ({sorted(groups)[:3]}): it names "
            f"what differs within a sample (a channel), not the sample. Put the part that names "
            rf"a sample in a group: e.g. r'^(.*)_ch\d\.tiff$'"
        )
    if len(groups) == 1 and len(keys) > 1:
        (name,) = groups
        raise ConfigError(
            f"Groups by={_describe(group_by)} puts all {len(keys) - len(left_out)} objects "
            f"under {root} in one group, {name!r}: is the group part of the pattern too short?"
        )
    if left_out:
        log.warning(
            "Groups by=%s leaves out %d of %d objects under %s (not samples): %s",
            _describe(group_by),
            len(left_out),
            len(keys),
            root,
            left_out[:_SHOWN],
        )
    return groups


def _names_a_suffix(group_by: GroupRule, groups: dict[str, list[int]], keys: list[str]) -> bool:
    r"""Whether a regex without a capture group named every group by the end of its keys
    (``_ch\d\.tiff$`` made 5 "samples" of 150 fields' channels)."""
    if not isinstance(group_by, (str, re.Pattern)) or re.compile(group_by).groups:
        return False
    return all(
        keys[i].endswith(name) and keys[i] != name for name, idx in groups.items() for i in idx
    )


def _namer(group_by: GroupRule) -> Callable[[str], str | None]:
    if callable(group_by) and not isinstance(group_by, (str, re.Pattern)):
        return group_by
    if not isinstance(group_by, (str, re.Pattern)):
        raise ConfigError(f"Groups by= must be a regex or a callable, got {group_by!r}")
    try:
        pattern = re.compile(group_by)
    except re.error as exc:
        raise ConfigError(f"Groups by= is not a valid regular expression: {exc}") from exc

    def name_of(key: str) -> str | None:
        found = pattern.search(key)
        if found is None:
            return None
        return found.group(1) if pattern.groups else found.group(0)

    return name_of


def _describe(group_by: GroupRule) -> str:
    if isinstance(group_by, re.Pattern):
        return repr(group_by.pattern)
    return repr(group_by) if isinstance(group_by, str) else getattr(group_by, "__name__", "fn")


def _role(key: str, group: str) -> str:
    return key.replace(group, "", 1) if group in key else key.rsplit("/", 1)[-1]


def _check_complete(
    groups: dict[str, list[int]],
    keys: list[str],
    root: str,
    incomplete: Incomplete,
    members: int | Sequence[str] | None,
) -> tuple[dict[str, list[int]], list[str]]:
    """The groups to keep, and those left out under "skip" (URL and why, in name order)."""
    roles = {g: frozenset(_role(keys[i], g) for i in idx) for g, idx in groups.items()}
    why = incomplete_sets(Counter(roles.values()), members)  # none: groups differ by nature
    bad = {g: why[r] for g, r in roles.items() if r in why}
    if not bad or incomplete == "accept":
        return groups, []
    shown = "; ".join(f"{g!r}: {why}" for g, why in sorted(bad.items())[:_SHOWN])
    if incomplete == "raise":
        raise ConfigError(
            f"{len(bad)} of {len(groups)} groups under {root} are incomplete ({shown}); "
            "pass incomplete='skip' to leave them out or 'accept' to keep them"
        )
    log.warning("leaving out %d incomplete groups under %s: %s", len(bad), root, shown)
    left_out = [f"{root}/{g}: incomplete group, {why}" for g, why in sorted(bad.items())]
    return {g: idx for g, idx in groups.items() if g not in bad}, left_out


def _folder(name: str) -> str:
    parent = name.rsplit("/", 1)[0] if "/" in name else ""
    return parent.rsplit("/", 1)[-1]


def group_decoder(
    decode: str | Callable[[Any], Any] | Mapping[str, str | Callable[[bytes], Any]],
) -> Callable[[dict[str, bytes]], Any]:
    """What a group's ``decode`` becomes. A callable receives ``{member key: bytes}``, and
    so does a group decoder named by a string (``"dicom-series"``); another decoder name
    decodes every member, and a mapping ``{pattern: decoder}`` decodes each member by the first
    pattern (fnmatch) its key matches: member decoders give ``{key: value}``."""
    if callable(decode):
        return decode
    if isinstance(decode, str) and decode in GROUP_DECODERS:
        return GROUP_DECODERS[decode]
    if isinstance(decode, str):
        rules = [("*", decoder(decode))]
    elif isinstance(decode, Mapping):
        rules = [(pattern, decoder(d)) for pattern, d in decode.items()]
    else:
        raise ConfigError(f"decode must be a name, a callable or a mapping, got {decode!r}")
    return _MemberDecoder(rules)


class _MemberDecoder:
    def __init__(self, rules: list[tuple[str, Callable[[bytes], Any]]]) -> None:
        self.rules = rules
        self.fingerprint = "members:" + ",".join(f"{p}={fingerprint(d)}" for p, d in rules)

    def __call__(self, members: dict[str, bytes]) -> dict[str, Any]:
        out = {}
        for key, body in members.items():
            decode = next((d for p, d in self.rules if fnmatch.fnmatchcase(key, p)), None)
            if decode is None:
                raise ConfigError(f"no decoder pattern matches the member {key!r}")
            try:
                out[key] = decode(body)
            except Exception as exc:
                raise DecodeError(f"member {key!r}: {type(exc).__name__}: {exc}"[:300]) from exc
        return out
