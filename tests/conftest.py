"""Shared fixtures: real daemons as subprocesses on 127.0.0.1, port 0, in temporary dirs."""

from __future__ import annotations

import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import trustme

from ps_offload.daemon.local import LocalDaemon


class DaemonFactory:
    """Starts daemons for one test (extra `ps-daemon serve` flags, an optional config file)
    and kills whatever is still running at its end."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.started: list[LocalDaemon] = []

    def _spawn(self, extra: Sequence[str], config: Path | None) -> LocalDaemon:
        flags = [*extra, *(["--config", str(config)] if config is not None else [])]
        daemon = LocalDaemon(self.tmp_path / f"daemon{len(self.started)}", *flags, wait=False)
        self.started.append(daemon)
        return daemon

    def __call__(self, *extra: str, config: Path | None = None) -> LocalDaemon:
        return self._spawn(extra, config).wait_listening()

    def together(self, flag_lists: Sequence[Sequence[str]], config: Path | None = None) -> list[LocalDaemon]:
        """One daemon per list of flags, started side by side: a test's start-up pays one
        daemon's import time, not one per daemon."""
        spawned = [self._spawn(flags, config) for flags in flag_lists]
        return [daemon.wait_listening() for daemon in spawned]

    def kill_all(self) -> None:
        for daemon in self.started:
            daemon.kill()


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[DaemonFactory]:
    factory = DaemonFactory(tmp_path)
    yield factory
    factory.kill_all()


@pytest.fixture
def daemon(daemon_factory) -> LocalDaemon:
    return daemon_factory()


def write_secured_config(directory: Path, *names: str) -> Path:
    """A daemon config with [tls] (a certificate for `names` from a fresh CA) and [auth] (a
    token file), the files beside it: ca.pem and token are what its clients need. Returns
    the config's path."""
    ca = trustme.CA()
    cert = ca.issue_cert(*names)
    ca.cert_pem.write_to_path(str(directory / "ca.pem"))
    cert.cert_chain_pems[0].write_to_path(str(directory / "cert.pem"))
    cert.private_key_pem.write_to_path(str(directory / "key.pem"))
    (directory / "token").write_text("a-test-token\n")
    (directory / "token").chmod(0o600)
    config = directory / "daemon.toml"
    config.write_text(
        f'[tls]\ncert_file = "{directory}/cert.pem"\nkey_file = "{directory}/key.pem"\n'
        f'[auth]\ntoken_file = "{directory}/token"\n'
    )
    return config


@pytest.fixture(scope="session")
def secured_config() -> Callable[..., Path]:
    """write_secured_config, for tests in any folder."""
    return write_secured_config


class Notifications:
    """An AF_UNIX datagram socket named in $NOTIFY_SOCKET, as systemd's: a daemon started
    after it tells it STATUS=, READY=1 and STOPPING=1, so a test waits for those moments
    instead of sleeping. tests/integration/test_systemd_daemon.py tests the messages."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "notify"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(self.path))

    def wait_for(self, prefix: str, timeout: float = 30.0) -> str:
        """The next message that starts with `prefix` (earlier ones are dropped)."""
        self.sock.settimeout(timeout)
        while not (message := self.sock.recv(4096).decode()).startswith(prefix):
            pass
        return message


@pytest.fixture
def notifications(monkeypatch) -> Iterator[Notifications]:
    for name in ("WATCHDOG_USEC", "WATCHDOG_PID"):
        monkeypatch.delenv(name, raising=False)
    directory = Path(tempfile.mkdtemp(prefix="psn-"))  # sun_path holds 107 bytes, tmp_path may be longer
    notes = Notifications(directory)
    monkeypatch.setenv("NOTIFY_SOCKET", str(notes.path))
    yield notes
    notes.sock.close()
    shutil.rmtree(directory)


@pytest.fixture(scope="module")
def daemons(tmp_path_factory) -> Iterator[list[str]]:
    """Two RAM daemons shared by a whole test file (starting one costs more than the tiny
    models' steps), one OpenMP thread each: tiny tensors on a loaded machine. Their addresses."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        started = [LocalDaemon(tmp_path_factory.mktemp(f"daemon{i}")) for i in range(2)]
    yield [d.address for d in started]
    for daemon in started:
        daemon.kill()
