"""Advisory file locks (``flock``) that die with their process: no stale lock outlives a crash.

A lock file may be removed by its exclusive holder; whoever locked the old inode notices that
the path now names another file (or none) and tries again, so two holders never coexist.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

__all__ = ["FileLock", "private_dirs"]


def private_dirs(path: Path) -> None:
    """Create ``path`` and any missing parents, each owner-only (mkdir's ``parents=True`` gives
    the parents the default mode). Safe against other processes creating them at once."""
    if path.is_dir():
        return
    private_dirs(path.parent)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:  # made by another process meanwhile, or a file is in the way
        if not path.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path)) from None


class FileLock:
    """One lock file. Each instance is one holder: threads and processes exclude each other."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self, *, shared: bool = False, blocking: bool = True) -> bool:
        """Take the lock; False only when ``blocking`` is False and someone else holds it."""
        mode = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if blocking else fcntl.LOCK_NB)
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, mode)
            except BlockingIOError:
                os.close(fd)
                return False
            try:
                current = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                current = False
            if current:
                self._fd = fd
                return True
            os.close(fd)  # the holder before us removed this file: lock the new one

    def release(self, *, remove: bool = False) -> None:
        """Let go; ``remove`` (exclusive holders only) deletes the lock file first."""
        if self._fd is None:
            return
        if remove:
            self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None

    def _open(self) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        try:
            return os.open(self.path, flags, 0o600)
        except FileNotFoundError:
            private_dirs(self.path.parent)
            return os.open(self.path, flags, 0o600)
