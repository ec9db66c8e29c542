"""Test servers start within a bounded time or fail with their log, and leave no process."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import pytest

from fastload.testing import B2Server, FaultProxy, ServerProcess, ServerStartError


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie would still answer; the parent reaped it in stop(), so a live pid is a leak.
    return False


class Crashing(ServerProcess):
    name = "crashing"

    def command(self) -> Sequence[str]:
        return [sys.executable, "-c", "print('config is broken: port taken'); raise SystemExit(3)"]

    def ready(self) -> bool:
        return False


class Silent(ServerProcess):
    name = "silent"
    startup_timeout = 1.0

    def command(self) -> Sequence[str]:
        return [sys.executable, "-c", "import time; print('still booting'); time.sleep(60)"]

    def ready(self) -> bool:
        return False


def test_server_that_exits_raises_with_its_log_tail() -> None:
    server = Crashing()
    with pytest.raises(ServerStartError, match=r"exited with code 3(.|\n)*port taken"):
        server.start()
    assert not server.running


def test_server_that_never_answers_is_bounded_and_killed() -> None:
    server = Silent()
    with pytest.raises(ServerStartError, match=r"did not answer within 1 s(.|\n)*still booting"):
        server.start()
    assert server.pid is None and not server.running


def test_stop_leaves_no_process_and_no_files() -> None:
    b2 = B2Server().start()
    proxy = FaultProxy(b2.endpoint, flavor="b2").start()
    pids = [b2.pid, proxy.pid]
    workdirs = [b2.workdir, proxy.workdir]
    proxy.stop()
    b2.stop()
    assert all(pid is not None and gone(pid) for pid in pids)
    assert not any(path.exists() for path in workdirs)
    b2.stop()  # idempotent


def test_missing_weed_binary_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from fastload.testing import s3

    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ServerStartError, match=r"fastload\[testing\]"):
        s3._weed_binary()


def test_a_port_taken_before_binding_is_retried_on_a_fresh_one() -> None:
    import socket

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        proxy = FaultProxy("http://127.0.0.1:9", flavor="s3")
        proxy.port = squatter.getsockname()[1]  # lost the race: someone bound it first
        with proxy:
            assert proxy.running and proxy.port != squatter.getsockname()[1]
