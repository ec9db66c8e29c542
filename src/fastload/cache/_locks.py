"""Advisory locks that die with their holder: no stale lock outlives a crash.

:class:`FileLock` is a whole file (``flock``). A lock file may be removed by its exclusive
holder; whoever locked the old inode notices that the path now names another file (or none)
and tries again, so two holders never coexist. It must be a regular file (a symlink or a FIFO
put there is refused): the usage files are written through their lock's descriptor.

:class:`RangeLock` is one byte of a file that many keys share (Linux open-file-description
locks): no file is created or removed per key. On this project's development machine (ext4)
creating a lock file per cache entry cost about 0.9 ms, as much as the rest of writing a 150 KB
entry (docs/benchmarks.md).
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
from pathlib import Path
from typing import Union

from fastload.cache._perms import PRIVATE, Modes, make_dirs, open_file, regular_file

__all__ = [
    "OFD_LOCKS",
    "EntryLock",
    "EntryLocks",
    "FileLock",
    "RangeLock",
    "lock_whole",
    "private_dirs",
    "range_held",
]

OFD_LOCKS = hasattr(fcntl, "F_OFD_SETLK")  # Linux >= 3.15; elsewhere a file per key
_FLOCK = struct.Struct("hhqqi4x")  # struct flock: type, whence, start, length, pid


private_dirs = make_dirs  # its earlier name (owner-only folders, unless given shared modes)


class FileLock:
    """One lock file. Each instance is one holder: threads and processes exclude each other."""

    def __init__(self, path: Path, *, modes: Modes = PRIVATE) -> None:
        self.path, self.modes = path, modes
        self._fd: int | None = None

    def acquire(self, *, shared: bool = False, blocking: bool = True) -> bool:
        """Take the lock; False only when ``blocking`` is False and someone else holds it."""
        mode = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if blocking else fcntl.LOCK_NB)
        while True:
            fd = self._open()
            inode = regular_file(fd, self.path).st_ino
            try:
                fcntl.flock(fd, mode)
            except BlockingIOError:
                os.close(fd)
                return False
            try:
                current = os.lstat(self.path).st_ino == inode
            except FileNotFoundError:
                current = False
            if current:
                self._fd = fd
                return True
            os.close(fd)  # the holder before us removed this file: lock the new one

    @property
    def fd(self) -> int:
        """The locked file, open for reading and writing (while the lock is held)."""
        if self._fd is None:
            raise RuntimeError(f"{self.path} is not locked by this holder")
        return self._fd

    def release(self, *, remove: bool = False) -> None:
        """Let go; ``remove`` (exclusive holders only) deletes the lock file first."""
        if self._fd is None:
            return
        if remove:
            self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None

    def _open(self) -> int:
        return _open(self.path, self.modes)


class RangeLock:
    """Byte ``offset`` of the lock file ``path``; each instance is one holder (its own open file
    description), so threads and processes exclude each other, and the kernel lets go when the
    holder closes it or dies. Same interface as :class:`FileLock`; the file stays."""

    def __init__(self, path: str | Path, offset: int, *, modes: Modes = PRIVATE) -> None:
        self.path, self.offset, self.modes = path, offset, modes
        self._fd: int | None = None

    def acquire(self, *, shared: bool = False, blocking: bool = True) -> bool:
        """Take the lock; False only when ``blocking`` is False and someone else holds it."""
        fd = _open(self.path, self.modes)
        kind = fcntl.F_RDLCK if shared else fcntl.F_WRLCK
        command = fcntl.F_OFD_SETLKW if blocking else fcntl.F_OFD_SETLK
        try:
            fcntl.fcntl(fd, command, _FLOCK.pack(kind, os.SEEK_SET, self.offset, 1, 0))
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES) and not blocking:
                return False
            raise
        self._fd = fd
        return True

    def release(self, *, remove: bool = False) -> None:
        """Let go (closing the file drops the lock); ``remove`` is FileLock's and means nothing
        here: the file is shared."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def lock_whole(fd: int, *, shared: bool) -> bool:
    """Lock the whole open file ``fd`` (opened for reading and writing) without waiting; False
    when someone else holds it. Held until ``fd`` is closed."""
    try:
        if OFD_LOCKS:
            kind = fcntl.F_RDLCK if shared else fcntl.F_WRLCK
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, 0, 0, 0))
        else:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return False
        raise
    return True


def range_held(path: Path) -> bool:
    """Whether anyone holds a byte of the lock file ``path`` (a test's and ``verify``'s check)."""
    fd = _open(path)
    try:
        query = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)  # length 0: to the end
        kind = _FLOCK.unpack(fcntl.fcntl(fd, fcntl.F_OFD_GETLK, query))[0]
    finally:
        os.close(fd)
    return bool(kind != fcntl.F_UNLCK)


def _open(path: str | Path, modes: Modes = PRIVATE) -> int:
    try:
        return open_file(path, os.O_RDWR, modes)
    except FileNotFoundError:
        make_dirs(Path(path).parent, modes)
        return open_file(path, os.O_RDWR, modes)


EntryLock = Union[FileLock, RangeLock]  # noqa: UP007 (a runtime alias on Python 3.10)


class EntryLocks:
    """The entry locks of the cache folder ``locks`` (a digest's, by calling this): a byte of
    one of 16 shared files (256 in a cache made before 2026-11-28: index and lock files are
    named by ``width`` hex digits of a digest), or, without OFD locks, a file of its own,
    removed by its last exclusive holder. The files are made of ``modes``."""

    def __init__(self, locks: str, width: int, modes: Modes) -> None:
        self.locks, self.width, self.modes = locks, width, modes

    def __call__(self, digest: str) -> EntryLock:
        if OFD_LOCKS:
            width = self.width
            offset = int(digest[width : width + 8], 16)
            return RangeLock(f"{self.locks}/{digest[:width]}.lock", offset, modes=self.modes)
        return FileLock(Path(self.locks, digest[:2], f"{digest}.lock"), modes=self.modes)
