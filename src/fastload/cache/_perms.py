"""Who may use a cache folder: the modes of what the cache makes, which permission is missing
when the system refuses, and errors that say which file they are about.

A cache is its maker's alone (folders 0700, files 0600) unless it was made shared: then
folders are 2770 (the setgid bit hands the folder's group down to everything made in it) and
files 0660, so every member of that group reads, writes, evicts and repairs it alike. The
marker records which (``"shared"``), so every later process makes its files the same way. A
shared cache's files are given their mode outright (``fchmod`` once, when made): the
umask (022 by default) would take the group's write bit.

Every member of a shared cache's group may put anything in its folders, a symlink to another
member's file or a FIFO included, so every open of a cache file is ``O_NOFOLLOW`` (a link is
never followed), ``O_NONBLOCK`` (a FIFO cannot stall the open; for a regular file it changes
nothing) and ``O_CLOEXEC``; and a file written in place or read (the usage files, index
shards, segments, entries, the marker) is checked to be a regular file by the ``fstat`` its
reader makes anyway, or once per open where it is opened once and used many times: else a
:class:`~fastload.errors.CacheError` names it. (The shared lock files of entries, a byte each,
opened per lock and never read or written, get the flags alone: no call more per entry.) A
folder the cache makes is given its mode through a descriptor of that folder, never by its
path, which a member could swap for a link between the ``mkdir`` and the ``chmod``.

Only the last part of a path is guarded so: a subfolder of the cache swapped for a link after
a ``Cache`` checked it at open is followed (docs/cache.md says what that allows).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from fastload.errors import CacheError

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
    "open_regular",
    "read_regular",
    "regular_file",
]

_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
"""Added to every open of a cache file (see the module's docstring)."""
_NOT_FOLLOWED = (errno.ELOOP, errno.ENXIO, errno.EISDIR)
"""An open with ``_FLAGS`` met a symlink, a FIFO no one reads (or a socket), or a folder."""
_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


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
    """``mkdir`` of ``modes.folder`` (FileExistsError when something is there); a shared
    cache's is given its mode through a descriptor of the folder made (a link swapped in for
    it meanwhile is refused, never ``chmod``-ed: it may point at another member's folder)."""
    path.mkdir(mode=modes.folder)
    if not modes.shared:
        return
    try:
        fd = os.open(path, _FOLDER)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise refused(path, "folder") from exc
        raise
    try:
        os.fchmod(fd, modes.folder)
    finally:
        os.close(fd)


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
    """``os.open(path, flags | O_CREAT)``, never through a symlink (see ``_open``); a file
    this creates is ``modes.file`` whatever the umask. A shared cache opens a file that is
    there without creating it (one call, as a private one), and gives the mode to one it
    creates. What is opened is not checked to be a regular file: see :func:`regular_file`."""
    if not modes.shared:
        return _open(path, flags | os.O_CREAT, modes.file)
    exclusive = flags & os.O_EXCL
    while True:
        if not exclusive:
            with contextlib.suppress(FileNotFoundError):
                return _open(path, flags)
        try:
            fd = _open(path, flags | os.O_CREAT | os.O_EXCL, modes.file)
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


def open_regular(path: str | Path, flags: int = os.O_RDONLY) -> tuple[int, os.stat_result]:
    """Open the regular file that is at ``path`` (never made, never through a symlink): its
    descriptor and status; anything else there is :func:`refused`."""
    fd = _open(path, flags)
    return fd, regular_file(fd, path)


def regular_file(fd: int, path: str | Path) -> os.stat_result:
    """The status of ``fd``, opened from ``path``, which must be a regular file: else ``fd``
    is closed and :func:`refused` raised. (A FIFO, a folder or a device would hang or fail a
    read, or be written in place as if it were the cache's.)"""
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            raise refused(path)
    except BaseException:
        os.close(fd)
        raise
    return found


def read_regular(path: str | Path) -> bytes:
    """The whole regular file at ``path`` (a small one: a marker, a usage file, metadata),
    never read through a symlink."""
    fd, found = open_regular(path)
    try:
        chunks = []
        while chunk := os.read(fd, found.st_size + 1):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def refused(path: str | Path, kind: str = "regular file") -> CacheError:
    """The error for a symlink, or something not a ``kind``, where the cache keeps one of its
    own: a member of a shared cache's group may have put it there to make this process
    write, change or read what it points to (docs/cache.md, "Sharing a cache between users
    or jobs")."""
    return CacheError(
        f"{path} is a symlink or not a {kind}: refused (a cache never follows a link or uses "
        "anything but its own files and folders in its folder; remove it)"
    )


def _open(path: str | Path, flags: int, mode: int = 0o600) -> int:
    """``os.open`` with ``_FLAGS``: a symlink, a FIFO that would block, a socket or a folder
    where a file of the cache belongs is :func:`refused`."""
    try:
        return os.open(path, flags | _FLAGS, mode)
    except OSError as exc:
        if exc.errno in _NOT_FOLLOWED:
            raise refused(path) from exc
        raise


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
    names ``path``, so the message says which file could not be written. (A CacheError
    names its file in its message: a filename would replace that.)"""
    try:
        yield
    except OSError as exc:
        if not isinstance(exc, CacheError):
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
