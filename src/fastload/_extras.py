"""Import optional dependencies with an error that names the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

from fastload.errors import MissingExtraError


def import_extra(module: str, *, extra: str, feature: str) -> ModuleType:
    """Import ``module`` or raise :class:`MissingExtraError` naming ``fastload[extra]`` and the
    import that failed: ``module`` itself, or one it imports (``fastload.stores.b2`` needs
    ``aiohttp`` as well as ``b2sdk``)."""
    try:
        return importlib.import_module(module)
    except MissingExtraError:
        raise  # a module of fastload's own, missing a package it imports: that one is named
    except ImportError as exc:
        raise MissingExtraError(exc.name or module, extra, feature) from exc
