"""ps_offload.daemon.systemd against a real datagram socket standing in for systemd's: the notify
protocol (path and abstract addresses, no-op outside systemd), $WATCHDOG_USEC/$WATCHDOG_PID,
the watchdog's pings following its check, journald's priority prefixes; and the config diff
a SIGHUP logs."""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ps_offload.daemon import systemd
from ps_offload.daemon.config import DaemonConfig, LogConfig, ServerConfig
from ps_offload.daemon.server import LIVE_KEYS, config_changes


@pytest.fixture(autouse=True)
def _outside_systemd(monkeypatch):
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "JOURNAL_STREAM"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def receiver(monkeypatch) -> Iterator[socket.socket]:
    """A bound AF_UNIX datagram socket, named in $NOTIFY_SOCKET (a short path: at most 107
    bytes fit in sun_path, more than pytest's tmp_path may give)."""
    directory = Path(tempfile.mkdtemp(prefix="psn-"))
    path = directory / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    yield sock
    sock.close()
    path.unlink()
    directory.rmdir()


def _pending(sock: socket.socket) -> list[str]:
    messages = []
    sock.setblocking(False)
    try:
        while True:
            messages.append(sock.recv(4096).decode())
    except BlockingIOError:
        return messages
    finally:
        sock.settimeout(5)


def test_notify_sends_fields_as_one_datagram(receiver):
    assert systemd.notify("READY=1", "STATUS=Serving on :50051")
    assert receiver.recv(4096) == b"READY=1\nSTATUS=Serving on :50051"


def test_notify_keeps_a_newline_in_a_value_from_starting_a_field(receiver):
    systemd.notify("STATUS=cannot read x\nREADY=1")
    assert receiver.recv(4096) == b"STATUS=cannot read x READY=1"


def test_notify_reaches_an_abstract_socket(monkeypatch):
    name = f"ps-daemon-test-{os.getpid()}-{time.monotonic_ns()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert systemd.notify("WATCHDOG=1")
        assert sock.recv(4096) == b"WATCHDOG=1"


def test_notify_outside_systemd_is_a_no_op():
    assert not systemd.notify("READY=1")


def test_notify_to_a_socket_nobody_reads_returns_false_and_does_not_raise(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))
    with caplog.at_level(logging.WARNING):
        assert not systemd.notify("READY=1")
    assert "cannot notify systemd" in caplog.text


def test_watchdog_interval(monkeypatch):
    assert systemd.watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    assert systemd.watchdog_interval() == 30.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert systemd.watchdog_interval() == 30.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))  # meant for another process
    assert systemd.watchdog_interval() is None
    monkeypatch.delenv("WATCHDOG_PID")
    monkeypatch.setenv("WATCHDOG_USEC", "soon")
    assert systemd.watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_USEC", "0")
    assert systemd.watchdog_interval() is None


class _LogSeen(logging.Handler):
    """Sets `event` when a record containing `text` is logged."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()


def test_watchdog_pings_only_while_the_check_passes(receiver, caplog):
    state = {"problem": None, "checks": 0}
    checked = threading.Condition()
    timeouts = []

    def check(timeout: float) -> str | None:
        timeouts.append(timeout)
        with checked:
            state["checks"] += 1
            checked.notify_all()
        return state["problem"]

    def wait_for_checks(n: int) -> None:
        with checked:
            assert checked.wait_for(lambda: state["checks"] >= n, timeout=10), f"only {state['checks']} checks"

    failing_logged = _LogSeen("not pinging systemd")
    systemd.log.addHandler(failing_logged)
    interval = 0.4  # pings every 0.2s
    dog = systemd.Watchdog(interval, check)
    try:
        with caplog.at_level(logging.INFO):
            dog.start()
            assert [receiver.recv(4096) for _ in range(3)] == [b"WATCHDOG=1"] * 3

            state["problem"] = "a health check got no answer"
            assert failing_logged.event.wait(5), "the failing check was not logged"
            _pending(receiver)  # a ping from a check that passed before the switch
            # Three more failing checks: when the third starts, the second's tick is over.
            wait_for_checks(state["checks"] + 3)
            assert _pending(receiver) == []

            state["problem"] = None
            assert receiver.recv(4096) == b"WATCHDOG=1"
            dog.stop()
    finally:
        systemd.log.removeHandler(failing_logged)
    _pending(receiver)  # pings sent before stop() returned
    assert dog.join(5)  # the thread is gone: no ping can follow
    assert _pending(receiver) == []
    assert set(timeouts) == {interval / 4}
    errors = [r.message for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [
        "watchdog: a health check got no answer; not pinging systemd, "
        "which restarts the daemon 0.4s after the last ping"
    ]
    assert any("serving again" in r.message for r in caplog.records)


def test_journal_formatter_prefixes_every_line_with_its_priority():
    formatter = systemd.JournalFormatter()

    def line(level: int, message: str) -> str:
        return formatter.format(logging.LogRecord("ps_offload.daemon.server", level, __file__, 1, message, None, None))

    assert line(logging.ERROR, "reload failed") == "<3>ERROR ps_offload.daemon.server: reload failed"
    assert line(logging.WARNING, "x").startswith("<4>WARNING")
    assert line(logging.INFO, "x").startswith("<6>INFO")
    assert line(logging.DEBUG, "x").startswith("<7>DEBUG")
    assert line(logging.CRITICAL, "a\nb") == "<2>CRITICAL ps_offload.daemon.server: a\n<2>b"


def test_stdout_is_journal_only_when_journal_stream_names_stdout(monkeypatch, tmp_path):
    with open(tmp_path / "stream", "w") as stream, open(tmp_path / "other", "w") as other:
        monkeypatch.setattr("sys.stdout", stream)
        assert not systemd.stdout_is_journal()
        st = os.fstat(stream.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        assert systemd.stdout_is_journal()
        # Inherited by a process whose stdout went elsewhere: not the journal.
        monkeypatch.setattr("sys.stdout", other)
        assert not systemd.stdout_is_journal()


def test_config_changes_name_every_changed_key_in_order():
    old = DaemonConfig()
    new = DaemonConfig(server=ServerConfig(listen="0.0.0.0:1", grace_seconds=5.0), log=LogConfig(level="DEBUG"))
    assert config_changes(old, old) == []
    assert config_changes(old, new) == [
        ("server.listen", "127.0.0.1:50051", "0.0.0.0:1"),
        ("server.grace_seconds", 30.0, 5.0),
        ("log.level", "INFO", "DEBUG"),
    ]
    assert {"log.level", "server.grace_seconds"} == LIVE_KEYS


def test_json_log_lines_are_one_object_each_with_the_traceback_inside():
    import json
    import logging

    from ps_offload.daemon.systemd import JsonFormatter

    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        record = logging.LogRecord("ps.x", logging.ERROR, __file__, 1, "failed: %s", ("why",), sys.exc_info())
    line = JsonFormatter().format(record)
    assert "\n" not in line
    entry = json.loads(line)
    assert (entry["level"], entry["logger"], entry["message"]) == ("ERROR", "ps.x", "failed: why")
    assert entry["time"].endswith("+00:00") and "ValueError: boom" in entry["exception"]
    assert JsonFormatter(journal=True).format(record).startswith('<3>{"time"')
