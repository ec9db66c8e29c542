"""Which samples lack a member: the rule groups of objects and tar samples share.

A sample made of members (a group's objects, a tar sample's files) has a set of member *roles*
(a group's keys without the group name, a tar sample's extensions). When most samples share one
set, a sample with another set (a missing channel, a tar sample without its ``cls``) is
*incomplete*; ``members=`` states the set (or the number of members) instead. What happens to
incomplete samples is the ``incomplete`` policy: ``"raise"`` names them, ``"skip"`` leaves them
out (logged), ``"accept"`` keeps them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Literal

from fastload.errors import ConfigError

__all__ = ["Incomplete", "Members", "check_policy", "incomplete_sets"]

Incomplete = Literal["raise", "skip", "accept"]
Members = int | Sequence[str] | None


def check_policy(incomplete: object, members: object) -> None:
    """``incomplete`` is a policy; ``members`` a count >= 1, a list of roles, or None."""
    if incomplete not in ("raise", "skip", "accept"):
        raise ConfigError(f"incomplete must be 'raise', 'skip' or 'accept', got {incomplete!r}")
    if not (members is None or _count(members) or _roles(members)):
        raise ConfigError(
            f"members must be a count >= 1 or a list of member names, got {members!r}"
        )


def _count(members: object) -> bool:
    return isinstance(members, int) and not isinstance(members, bool) and members >= 1


def _roles(members: object) -> bool:
    if not isinstance(members, Sequence) or isinstance(members, str):
        return False  # a string would be taken letter by letter
    return all(isinstance(role, str) and role for role in members)


def incomplete_sets(counts: Counter[frozenset[str]], members: Members) -> dict[frozenset[str], str]:
    """Each set of roles (of ``counts``: how many samples have it) that makes a sample
    incomplete, with what is wrong with it; none when the samples differ by nature (no set is
    most samples' and ``members`` is None)."""
    if isinstance(members, int):
        return {
            roles: f"{len(roles)} members, not {members}"
            for roles in counts
            if len(roles) != members
        }
    expected = frozenset(members) if members is not None else _usual(counts)
    if expected is None:
        return {}
    return {roles: _difference(roles, expected) for roles in counts if roles != expected}


def _usual(counts: Counter[frozenset[str]]) -> frozenset[str] | None:
    """The set of roles most samples have, when most do (else None: no rule to check)."""
    if not counts:
        return None
    ((common, count),) = counts.most_common(1)
    return common if count * 2 > sum(counts.values()) else None


def _difference(have: frozenset[str], expected: frozenset[str]) -> str:
    missing, extra = sorted(expected - have), sorted(have - expected)
    parts = ([f"missing {missing}"] if missing else []) + ([f"extra {extra}"] if extra else [])
    return ", ".join(parts)
