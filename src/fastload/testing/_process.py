"""A local server in a child process: free ports, bounded start-up, stopped by PID."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType

from typing_extensions import Self

from fastload.errors import ServerStartError

logger = logging.getLogger(__name__)

_LIVE: weakref.WeakSet[ServerProcess] = weakref.WeakSet()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def http_answers(url: str, timeout: float = 1.0) -> bool:
    """True when something at ``url`` answers HTTP, whatever the status."""
    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return True
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):
        return False


_PORT_RACE = ("address already in use", "port allocation failed")  # the last: weed mini's
"""What a server's log says when a port chosen free was taken before it bound it."""


def _tree_sum(pid: int, measure: Callable[[int], float]) -> float:
    """``measure(p)`` summed over process ``pid`` and all its live descendants (Linux)."""
    total = 0.0
    try:
        total += measure(pid)
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                total += _tree_sum(int(child), measure)
    except (FileNotFoundError, ProcessLookupError):
        pass  # the process (or a child) ended while being read
    return total


def _pss_kib(pid: int) -> float:
    lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    return sum(int(line.split()[1]) for line in lines if line.startswith("Pss:"))


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_pss_kib(pid: int) -> int:
    """Proportional set size of process ``pid`` and all its descendants, in KiB (Linux)."""
    return int(_tree_sum(pid, _pss_kib))


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and all its live descendants (Linux)."""
    return _tree_sum(pid, _cpu_seconds)


def python_module_command(module: str, *args: str) -> list[str]:
    """Run ``module`` with this interpreter (servers written in Python)."""
    return [sys.executable, "-m", module, *args]


class ServerProcess:
    """Base class: subclasses give the command and a readiness probe.

    The child runs in its own session, so ``stop()`` signals exactly the process group this
    object created (by PID), never anything found by name. Every live server is also stopped
    at interpreter exit, so a crashed test run leaves nothing behind.
    """

    name = "server"
    startup_timeout = 30.0
    start_attempts = 3  # fresh ports after a lost bind race with another process

    def __init__(self) -> None:
        self.port = free_port()
        self._proc: subprocess.Popen[bytes] | None = None
        self._new_workdir()

    def _new_workdir(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix=f"fastload-{self.name}-")
        self.workdir = Path(self._tmp.name)
        self.log_path = self.workdir / "server.log"

    # -- subclass hooks ----------------------------------------------------------------------
    def command(self) -> Sequence[str]:
        raise NotImplementedError

    def environment(self) -> Mapping[str, str]:
        return {}

    def ready(self) -> bool:
        raise NotImplementedError

    def after_start(self) -> None:
        """Called once the server answers (create accounts, warm up)."""

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> Self:
        """Start and wait until ready; a port taken between choosing and binding it (another
        process won the race) is retried on fresh ports."""
        for attempt in range(1, self.start_attempts + 1):
            try:
                return self._start_once()
            except ServerStartError as exc:
                raced = any(sign in str(exc).lower() for sign in _PORT_RACE)
                if attempt == self.start_attempts or not raced:
                    raise
                logger.warning("%s lost a port race (attempt %d); new ports", self.name, attempt)
                self.port = free_port()
                self._new_workdir()
        raise AssertionError("unreachable")

    def _start_once(self) -> Self:
        if self._proc is not None:
            raise RuntimeError(f"{self.name} is already started (pid {self._proc.pid})")
        env = {**os.environ, **self.environment()}
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(
                list(self.command()),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.workdir,
                env=env,
                start_new_session=True,
            )
        _LIVE.add(self)
        try:
            self._wait_ready()
            self.after_start()
        except BaseException:
            self.stop()
            raise
        logger.info("%s started (pid %d)", self.name, self._proc.pid)
        return self

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while not self.ready():
            if self._proc.poll() is not None:
                raise ServerStartError(
                    f"{self.name} exited with code {self._proc.returncode} during start-up; "
                    f"log tail:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"{self.name} did not answer within {self.startup_timeout:.0f} s; "
                    f"log tail:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server's process group (SIGTERM, then SIGKILL) and remove its files."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                self._signal_group(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self._signal_group(proc.pid, signal.SIGKILL)
                    proc.wait(timeout)
            # Children a server may have spawned live in its group: make sure they are gone.
            self._signal_group(proc.pid, signal.SIGKILL)
        _LIVE.discard(self)
        self._tmp.cleanup()

    @staticmethod
    def _signal_group(pid: int, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> Self:
        return self.start() if self._proc is None else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} pid={self.pid}>"


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop()
