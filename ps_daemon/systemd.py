"""systemd's side of the daemon: sd_notify(3) messages, the watchdog, journald log lines.

The notify protocol is one datagram of newline-separated KEY=VALUE fields sent to the
AF_UNIX socket named in $NOTIFY_SOCKET ('@name' is the abstract namespace). It is written
out here rather than imported: systemd-python needs libsystemd's headers and a compiler to
install, and sdnotify is unmaintained, for about twenty lines of socket code. Everything is
a no-op outside systemd (no $NOTIFY_SOCKET, no $WATCHDOG_USEC), so the same daemon runs by
hand, in tests and under systemd.

Messages sent (docs/configuration.md, "Lifecycle"): STATUS= at each step of the start and
while serving, READY=1 once every shard is recovered and the ports listen, WATCHDOG=1 while
the serving path answers, RELOADING=1 / READY=1 around a SIGHUP, STOPPING=1 at SIGTERM.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

_warned: set[str] = set()


def notify(*fields: str) -> bool:
    """Sends `fields` ("READY=1", "STATUS=...") to systemd in one datagram. Returns whether
    it was sent: False outside systemd, and False (with one warning per kind of failure)
    when the socket cannot be reached, because a lost status line must not stop a daemon."""
    address = os.environ.get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    elif not address.startswith("/"):
        _warn_once("address", "NOTIFY_SOCKET=%r is neither a path nor @name; systemd will not hear from us", address)
        return False
    # A newline inside a value would start a new field (a STATUS text could forge READY=1).
    message = "\n".join(field.replace("\n", " ") for field in fields).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(message, address)
    except OSError as exc:
        _warn_once(type(exc).__name__, "cannot notify systemd at %s: %s", os.environ["NOTIFY_SOCKET"], exc)
        return False
    return True


def _warn_once(kind: str, message: str, *args: object) -> None:
    if kind not in _warned:
        _warned.add(kind)
        log.warning(message, *args)


def monotonic_usec() -> int:
    """CLOCK_MONOTONIC in microseconds: what systemd expects in MONOTONIC_USEC= with
    RELOADING=1, to tell this reload from an earlier one."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


def watchdog_interval() -> float | None:
    """Seconds within which systemd wants WATCHDOG=1 ($WATCHDOG_USEC, from WatchdogSec=),
    or None when there is no watchdog, or it watches another process ($WATCHDOG_PID)."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    if not usec:
        return None
    pid = os.environ.get("WATCHDOG_PID", "")
    if pid and pid != str(os.getpid()):
        return None
    try:
        interval = int(usec) / 1e6
    except ValueError:
        log.warning("WATCHDOG_USEC=%r is not a number of microseconds; no watchdog pings", usec)
        return None
    return interval if interval > 0 else None


class Watchdog:
    """Pings systemd (WATCHDOG=1) every interval/2, each time only after `check` said the
    daemon is serving. `check(timeout)` returns None when healthy, else what is wrong; it
    gets a quarter of the interval, so a healthy ping is never later than 3/4 of it.

    A check that fails or hangs means no ping: systemd then kills the daemon (SIGABRT) once
    the interval has passed since the last one, and Restart=on-failure starts a new one.
    The first failure and the recovery are logged, not every tick."""

    def __init__(self, interval: float, check: Callable[[float], str | None]) -> None:
        self.interval = interval
        self.check = check
        self._stopping = threading.Event()
        self._ping_lock = threading.Lock()  # held from the last look at _stopping to the ping
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """No ping after this returns. Does not wait for a check in progress: a hung one
        must not delay the drain."""
        with self._ping_lock:
            self._stopping.set()

    def join(self, timeout: float | None = None) -> bool:
        """Waits for the pinging thread to end after stop(); returns whether it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        period = self.interval / 2
        failing_since: float | None = None
        while not self._stopping.is_set():
            started = time.monotonic()
            problem = self.check(period / 2)
            if problem is None and failing_since is not None:
                # Logged before the ping, so whoever sees the ping can already read the line.
                log.warning("watchdog: serving again after %.1fs; pinging systemd again", started - failing_since)
                failing_since = None
            with self._ping_lock:
                if self._stopping.is_set():
                    break  # the drain makes the check fail; that is not a hang
                if problem is None:
                    notify("WATCHDOG=1")
            if problem is not None and failing_since is None:
                failing_since = started
                log.error(
                    "watchdog: %s; not pinging systemd, which restarts the daemon %.3gs after the last ping",
                    problem,
                    self.interval,
                )
            self._stopping.wait(max(0.0, started + period - time.monotonic()))


def stdout_is_journal() -> bool:
    """Whether stdout is connected to journald: systemd then sets $JOURNAL_STREAM to the
    device and inode of that stream (a child with stdout redirected keeps the variable but
    not the stream, hence the comparison)."""
    stream = os.environ.get("JOURNAL_STREAM", "")
    try:
        device, inode = (int(part) for part in stream.split(":"))
        stat = os.fstat(sys.stdout.fileno())
    except (ValueError, OSError, AttributeError):
        return False
    return (stat.st_dev, stat.st_ino) == (device, inode)


_PRIORITIES = ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4), (logging.INFO, 6))


class JournalFormatter(logging.Formatter):
    """Starts each line with its syslog priority, "<3>" for an error, which journald reads
    off the stream (and drops), so that `journalctl -p warning` works. Every line of a
    traceback gets it, as journald stores each line as an entry. No timestamp: the journal
    keeps its own."""

    def __init__(self) -> None:
        super().__init__("%(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        priority = next((p for level, p in _PRIORITIES if record.levelno >= level), 7)
        return "\n".join(f"<{priority}>{line}" for line in super().format(record).split("\n"))


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (log.format = "json"), for log shippers: time
    (UTC, ISO 8601), level, logger, message, and the traceback as one string when there is
    one. Under journald (`journal`), with the priority in front, which journald reads off."""

    def __init__(self, *, journal: bool = False) -> None:
        super().__init__()
        self.journal = journal

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        line = json.dumps(entry)
        if not self.journal:
            return line
        priority = next((p for level, p in _PRIORITIES if record.levelno >= level), 7)
        return f"<{priority}>{line}"
