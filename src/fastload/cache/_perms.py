"""Who may use a cache folder: the modes of what the cache makes, which permission is missing
when the system refuses, and errors that say which file they are about.

A cache is its maker's alone (folders 0700, files 0600) unless it was made shared: then
folders are 2770 (the setgid bit hands the folder's group down to everything made in it) and
files 0660, so every member of that group reads, writes, evicts and repairs it alike. The
marker records which (``"shared"``), so every later process makes its files the same way. A
shared cache's files are given their mode outright (``fchmod``/``chmod`` once, when made): the
umask (022 by default) would take the group's write bit.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "PRIVATE",
    "SHARED",
    "Modes",
    "denied",
    "exists",
    "make_dir",
    "make_dirs",
    "naming",
    "open_file",
]


@dataclass(frozen=True)
class Modes:
    """The mode of the folders and files a cache makes."""

    shared: bool

    @property
    def folder(self) -> int:
        return 0o2770 if self.shared else 0o700

    @property
    def file(self) -> int:
        return 0o660 if self.shared else 0o600


PRIVATE, SHARED = Modes(shared=False), Modes(shared=True)


def make_dir(path: Path, modes: Modes) -> None:
    """``mkdir`` of ``modes.folder`` (FileExistsError when something is there)."""
    path.mkdir(mode=modes.folder)
    if modes.shared:
        os.chmod(path, modes.folder)


def make_dirs(path: Path, modes: Modes = PRIVATE) -> None:
    """Create ``path`` and any missing parents, each of ``modes.folder`` (mkdir's
    ``parents=True`` gives the parents the default mode). Safe against other processes
    creating them at once."""
    if path.is_dir():
        return
    make_dirs(path.parent, modes)
    try:
        make_dir(path, modes)
    except FileExistsError:  # made by another process meanwhile, or a file is in the way
        if not path.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path)) from None


def open_file(path: str | Path, flags: int, modes: Modes = PRIVATE) -> int:
    """``os.open(path, flags | O_CREAT | O_CLOEXEC)``; a file this creates is ``modes.file``
    whatever the umask. A shared cache opens a file that is there without creating it (one
    call, as a private one), and gives the mode to one it creates."""
    if not modes.shared:
        return os.open(path, flags | os.O_CREAT | os.O_CLOEXEC, modes.file)
    exclusive = flags & os.O_EXCL
    while True:
        if not exclusive:
            with contextlib.suppress(FileNotFoundError):
                return os.open(path, flags | os.O_CLOEXEC)
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, modes.file)
        except FileExistsError:
            if exclusive:
                raise
            continue  # made by another process between the two calls: open that one
        try:
            os.fchmod(fd, modes.file)
        except BaseException:
            os.close(fd)
            raise
        return fd


def exists(path: str | Path) -> bool:
    """Whether ``path`` is there. Anything but its absence (EACCES: a folder on the way this
    process may not traverse) is raised, never taken for a no as ``os.path.exists`` takes it:
    a cache that cannot look must not answer that an entry is missing."""
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return True


@contextlib.contextmanager
def naming(path: str | Path) -> Iterator[None]:
    """An OSError inside that names no file (a write to an open descriptor: a full disk)
    names ``path``, so the message says which file could not be written."""
    try:
        yield
    except OSError as exc:
        exc.filename = exc.filename or str(path)
        raise


def denied(path: str | Path, *, writing: bool) -> str:
    """Why this process was refused ``path`` (a file or folder of a cache): the first folder
    on the way that it may not traverse, else the permission it lacks on ``path`` itself
    (traverse, read, or write when ``writing``; for a file not there yet, write on its
    folder), with the owner, group and mode that refuse it."""
    target = Path(os.path.abspath(path))
    for folder in reversed(target.parents):  # from "/" down
        if not _may(folder, os.X_OK):
            return _refusal(folder, "traverse")
    try:
        found = os.stat(target)
    except FileNotFoundError:
        if not _may(target.parent, os.W_OK):
            return _refusal(target.parent, "write")
        return f"permission denied: {target}"
    except OSError as exc:
        return f"permission denied: {target} ({os.strerror(exc.errno or errno.EACCES)})"
    needs = [("traverse", os.X_OK)] if stat.S_ISDIR(found.st_mode) else []
    needs += [("read", os.R_OK), *([("write", os.W_OK)] if writing else [])]
    for what, bit in needs:
        if not _may(target, bit):
            return _refusal(target, what)
    return (
        f"permission denied: {target}, although its mode {_mode(found)} allows this process "
        "(an ACL, an immutable attribute or a security policy refuses)"
    )


def _may(path: Path, bit: int) -> bool:
    return os.access(path, bit, effective_ids=os.access in os.supports_effective_ids)


def _refusal(path: Path, what: str) -> str:
    """``path`` and the permission ``what`` this process lacks on it, with who owns it."""
    try:
        found = os.stat(path)
    except OSError:
        return f"no permission to {what} {path}"
    groups = sorted({os.getegid(), *os.getgroups()})
    said = (
        f"no permission to {what} {path} (owner uid {found.st_uid}, group gid {found.st_gid}, "
        f"mode {_mode(found)}; this process: uid {os.geteuid()}, groups {groups})"
    )
    if found.st_uid != os.geteuid():
        said += (
            "; a cache is its maker's alone unless it was made with Cache(..., shared=True) "
            "(docs/cache.md, 'Sharing a cache between users or jobs')"
        )
    return said


def _mode(found: os.stat_result) -> str:
    return f"{stat.S_IMODE(found.st_mode):04o}"
