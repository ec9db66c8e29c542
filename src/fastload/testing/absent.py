"""Installed packages made absent for one process, as in an environment that lacks them.

``Absent(modules, distributions).install()`` stands in for the import system's path finder:
a module under one of ``modules`` (top-level import names) is not found, so ``import`` raises
the ``ModuleNotFoundError`` a missing package raises and ``importlib.util.find_spec`` returns
None; ``importlib.metadata`` does not see ``distributions``. With a ``reason``, an import of
one raises ``ModuleNotFoundError`` ending with it instead (``benchmarks/gpu_rehearse.py``).

Only imports after :meth:`Absent.install` are refused, so it refuses to install while one of
``modules`` is imported already. This module imports only the standard library: run it by
path (``runpy.run_path``) to install it before ``fastload`` itself is imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from importlib.metadata import Distribution, DistributionFinder
from types import ModuleType

__all__ = ["Absent", "canonical"]


def canonical(distribution: str) -> str:
    """A distribution's name as packaging compares them (PEP 503: ``Foo_Bar`` = ``foo-bar``)."""
    return re.sub(r"[-_.]+", "-", distribution).lower()


class Absent(importlib.abc.MetaPathFinder):
    """The path finder, less ``modules`` (top-level import names) and ``distributions``."""

    def __init__(
        self,
        modules: Iterable[str],
        distributions: Iterable[str] = (),
        *,
        reason: str | None = None,
    ) -> None:
        self.modules = frozenset(modules)
        self.distributions = frozenset(canonical(name) for name in distributions)
        self.reason = reason

    def install(self) -> None:
        """Take the path finder's place in ``sys.meta_path`` for the rest of the process."""
        imported = sorted(self.modules.intersection(name.partition(".")[0] for name in sys.modules))
        if imported:
            raise RuntimeError(f"cannot make absent what is imported already: {imported}")
        finder = importlib.machinery.PathFinder
        if finder not in sys.meta_path:
            raise RuntimeError(f"no path finder in sys.meta_path to stand in for: {sys.meta_path}")
        sys.meta_path[sys.meta_path.index(finder)] = self

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.partition(".")[0] not in self.modules:
            return importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if self.reason is not None:
            raise ModuleNotFoundError(f"{fullname} {self.reason}", name=fullname)
        return None

    def find_distributions(
        self, context: DistributionFinder.Context | None = None
    ) -> Iterator[Distribution]:
        found = importlib.machinery.PathFinder.find_distributions(
            context or DistributionFinder.Context()
        )
        return (d for d in found if canonical(d.metadata["Name"] or "") not in self.distributions)

    def invalidate_caches(self) -> None:
        importlib.machinery.PathFinder.invalidate_caches()
