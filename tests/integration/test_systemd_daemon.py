"""The daemon under a stand-in for systemd: a datagram socket named in $NOTIFY_SOCKET, with
$WATCHDOG_USEC set. A real daemon process each time: STATUS while it recovers, READY=1 once
the port file is there, WATCHDOG=1 while it serves and not while its RPC threads are stuck,
SIGHUP reloads (or keeps the old config when the file is broken), SIGTERM says STOPPING=1
and exits 0."""

from __future__ import annotations

import re
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.stalled_clients import Stalled, register_model
from ps_offload.proto import codec, ps_pb2
from ps_offload.proto.push import Push
from ps_offload.trainer.wire.daemon_client import DaemonClient

NUMEL = 4096
SHARD_BYTES = 8192  # two shards of 2048 floats


@dataclass
class Note:
    at: float  # time.monotonic() when it arrived
    message: str
    port_file_existed: bool


class Notifications:
    """Receives what the daemon tells systemd, on a thread, noting for each message whether
    the daemon's port file existed when it arrived."""

    def __init__(self, port_file: Path) -> None:
        self.port_file = port_file
        self.dir = Path(tempfile.mkdtemp(prefix="psn-"))  # sun_path holds 107 bytes
        self.path = self.dir / "notify"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(self.path))
        self.notes: list[Note] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while True:
            data = self._sock.recv(4096)
            if self._closed:
                return
            note = Note(time.monotonic(), data.decode(), self.port_file.exists())
            with self._cond:
                self.notes.append(note)
                self._cond.notify_all()

    def wait_for(self, predicate: Callable[[Note], bool], *, after: float = 0.0, timeout: float = 20.0) -> Note:
        """The first message since `after` (a time.monotonic()) that `predicate` accepts."""
        with self._cond:
            found = self._cond.wait_for(
                lambda: next((n for n in self.notes if n.at >= after and predicate(n)), None), timeout
            )
        assert found is not None, f"no such message in {timeout}s; got {[n.message for n in self.notes]}"
        return found

    def pings(self, start: float = 0.0, end: float = float("inf")) -> list[float]:
        with self._cond:
            return [n.at for n in self.notes if start <= n.at <= end and n.message == "WATCHDOG=1"]

    def close(self) -> None:
        self._closed = True
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as waker:  # wakes the blocked recv()
            waker.sendto(b"", str(self.path))
        self._thread.join()
        self._sock.close()
        shutil.rmtree(self.dir)


@pytest.fixture
def systemd_env(monkeypatch, tmp_path) -> Iterator[Callable[..., Notifications]]:
    """Call it (watchdog seconds) before starting the daemon that systemd should watch;
    daemons started before it know nothing of systemd."""
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "JOURNAL_STREAM"):
        monkeypatch.delenv(name, raising=False)
    opened: list[Notifications] = []

    def start(watchdog_seconds: float, daemon_name: str) -> Notifications:
        notes = Notifications(tmp_path / daemon_name / "port")
        opened.append(notes)
        monkeypatch.setenv("NOTIFY_SOCKET", str(notes.path))
        monkeypatch.setenv("WATCHDOG_USEC", str(int(watchdog_seconds * 1e6)))
        # The daemon's health-check socket goes to $TMPDIR: here, not in /tmp after a SIGABRT.
        monkeypatch.setenv("TMPDIR", str(notes.dir))
        return notes

    yield start
    for notes in opened:
        notes.close()


def _register(address: str) -> DaemonClient:
    """Registers model "m" (two shards, SGD) and pushes both shards' values once."""
    client = DaemonClient(address, max_message_bytes=8 << 20)
    spec = ps_pb2.ModelSpec(
        model="m",
        params=[ps_pb2.ParamSpec(name="w", shape=[NUMEL], dtype=ps_pb2.FLOAT32)],
        optimizer=ps_pb2.OptimizerSpec(sgd=ps_pb2.SGDSpec(lr=1.0)),
        shard_bytes=SHARD_BYTES,
        daemons=["d0"],
    )
    client.register(spec, 0, timeout=10)
    values = memoryview(torch.ones(SHARD_BYTES // 4).numpy()).cast("B")
    for shard_id in (0, 1):
        client.push(Push.parameters("m", shard_id, values, step=0), timeout=10)
    return client


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_status_while_recovering_ready_after_the_port_file_watchdog_and_stopping(daemon_factory, systemd_env, tmp_path):
    nvme = tmp_path / "nvme"
    first = daemon_factory("--nvme-dir", str(nvme))
    _register(first.address).close()
    assert first.stop() == 0

    notes = systemd_env(2.0, "daemon1")
    daemon = daemon_factory("--nvme-dir", str(nvme))  # returns once the port file exists
    assert daemon.workdir / "port" == notes.port_file
    ready = notes.wait_for(lambda n: "READY=1" in n.message)
    notes.wait_for(lambda n: len(notes.pings(start=ready.at)) >= 3, timeout=10)
    assert len(list(notes.dir.glob("ps-daemon-*/health.sock"))) == 1  # the watchdog's, in $TMPDIR
    sigterm = time.monotonic()
    daemon.process.send_signal(signal.SIGTERM)
    stopping = notes.wait_for(lambda n: "STOPPING=1" in n.message)
    assert daemon.process.wait(timeout=30) == 0
    assert list(notes.dir.glob("ps-daemon-*")) == []

    before_ready = [n.message for n in notes.notes if n.at < ready.at]
    assert before_ready == [
        "STATUS=Starting: loading torch and gRPC",
        f"STATUS=Starting: recovering 1 model from {nvme} (reading slot headers)",
        before_ready[2],
        "STATUS=Starting: opening 127.0.0.1:0",
    ]
    assert before_ready[2].startswith(f"STATUS=Starting: recovered 2 shards of 1 model from {nvme} in ")
    assert not any(n.port_file_existed for n in notes.notes if n.at < ready.at)
    assert ready.port_file_existed
    assert ready.message == (
        f"READY=1\nSTATUS=Serving on 127.0.0.1:{daemon.port}, data plane port "
        f"{daemon.log().split('data plane listening on port ')[1].split()[0]}: 1 model, 2 shards, "
        "0 B of 8.0 GiB RAM"
    )
    pings = notes.pings(start=ready.at, end=sigterm)
    assert len(pings) >= 3
    # Every half interval, well within the interval systemd allows.
    assert max(b - a for a, b in zip([ready.at, *pings[:-1]], pings, strict=True)) < 2.0
    assert stopping.message == "STOPPING=1\nSTATUS=Stopping: draining in-flight calls for up to 30s"
    assert notes.pings(start=stopping.at) == []
    assert "watchdog: pinging systemd every 1.0s" in daemon.log()


def test_sighup_reloads_the_log_level_and_survives_a_broken_file(daemon_factory, systemd_env, tmp_path):
    config = tmp_path / "ps-daemon.toml"
    config.write_text('[server]\nmax_pull_wait_seconds = 600.0\n[log]\nlevel = "INFO"\n')
    notes = systemd_env(2.0, "daemon0")
    daemon = daemon_factory(config=config)
    notes.wait_for(lambda n: "READY=1" in n.message)

    def reload() -> tuple[Note, Note]:
        sent = time.monotonic()
        daemon.process.send_signal(signal.SIGHUP)
        reloading = notes.wait_for(lambda n: "RELOADING=1" in n.message, after=sent)
        ready = notes.wait_for(lambda n: "READY=1" in n.message, after=reloading.at)
        return reloading, ready

    config.write_text('[server]\nmax_pull_wait_seconds = 60.0\n[log]\nlevel = "DEBUG"\n')
    reloading, ready = reload()
    fields = dict(line.split("=", 1) for line in reloading.message.splitlines())
    assert fields["RELOADING"] == "1"
    # CLOCK_MONOTONIC is one clock for every process on the machine.
    assert abs(int(fields["MONOTONIC_USEC"]) - time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000) < 10e6
    assert ready.message.endswith("; config changed, restart to apply server.max_pull_wait_seconds")
    log = daemon.log()
    assert "INFO ps_offload.daemon.server: reload: log.level 'INFO' -> 'DEBUG', applied" in log
    assert "WARNING ps_offload.daemon.server: reload: server.max_pull_wait_seconds 600.0 -> 60.0 needs a restart" in log
    assert "DEBUG ps_offload.daemon.server: reload: running with" in log  # the new level is in force

    for broken in ('[log\nlevel = "INFO"\n', '[log]\nlevel = "LOUD"\n', "[server]\nlisten_port = 1\n"):
        config.write_text(broken)
        _, ready = reload()
        assert "last reload failed (" in ready.message and "running on the previous config" in ready.message
        assert daemon.process.poll() is None
        assert _health(daemon.address) == health_pb2.HealthCheckResponse.SERVING
    assert (
        daemon.log().count("ERROR ps_offload.daemon.server: reload failed, still running with the previous config") == 3
    )

    assert daemon.stop() == 0
    assert notes.wait_for(lambda n: "STOPPING=1" in n.message)


def test_watchdog_stops_pinging_while_rpc_threads_are_stuck(daemon_factory, systemd_env, tmp_path):
    # Two RPC threads, both taken by pushes whose clients stall mid-stream for 2.5 s: a health
    # check cannot get a thread, as in a deadlock, until the streams end. (Pulls waiting for a
    # version can no longer do this: at most server.max_waiting_pulls of the threads wait.)
    config = tmp_path / "ps-daemon.toml"
    config.write_text("[server]\nmax_workers = 2\nmax_calls_per_client = 2\n")  # one client may take both
    notes = systemd_env(1.0, "daemon0")
    daemon = daemon_factory(config=config)
    client = _register(daemon.address)
    notes.wait_for(lambda n: len(notes.pings()) >= 2, timeout=10)

    def stick_both_threads() -> list[threading.Thread]:
        def stalled_push(shard_id: int) -> None:
            header = ps_pb2.PushHeader(
                model="m", shard_id=shard_id, step=0, kind=ps_pb2.GRADIENT, encoding=ps_pb2.RAW,
                dtype=ps_pb2.FLOAT32, nbytes=SHARD_BYTES,
            )  # fmt: skip

            def chunks() -> Iterator[bytes]:
                yield codec.push_chunks.encode(header, bytes(SHARD_BYTES // 2))
                release.wait(timeout=30)  # the stalled client (its bytes never complete the payload)

            with pytest.raises(Exception):  # noqa: B017 - how it fails is not the point
                client._push(chunks(), timeout=10)

        threads = [threading.Thread(target=stalled_push, args=(shard_id,)) for shard_id in (0, 1)]
        for thread in threads:
            thread.start()
        return threads

    release = threading.Event()  # both stalled clients end their streams 2.5s from stuck_at
    stuck_at = time.monotonic()
    threading.Timer(2.5, release.set).start()
    threads = stick_both_threads()
    not_serving = notes.wait_for(lambda n: n.message.startswith("STATUS=Not serving"), after=stuck_at)
    assert not_serving.message == (
        "STATUS=Not serving: a health check got no answer in 0.2s (all 2 RPC threads busy or stuck?)"
    )
    resumed = notes.wait_for(lambda n: n.message == "WATCHDOG=1", after=not_serving.at, timeout=10)
    # No ping while the pushes held both threads (2.5s from stuck_at): a gap longer than the
    # 1s interval, after which systemd would have killed this daemon.
    assert resumed.at > stuck_at + 2.0
    assert resumed.at - max(notes.pings(end=not_serving.at)) > 1.0
    for thread in threads:
        thread.join(timeout=10)
    freed_at = time.monotonic()
    serving = notes.wait_for(lambda n: n.message.startswith("STATUS=Serving on"), after=not_serving.at, timeout=5)
    # The recovery is logged before the first ping that follows it (the STATUS line comes earlier).
    notes.wait_for(lambda n: n.message == "WATCHDOG=1", after=serving.at, timeout=5)
    log = daemon.log()
    assert "ERROR ps_offload.daemon.systemd: watchdog: a health check got no answer in 0.2s" in log
    assert "not pinging systemd, which restarts the daemon 1s after the last ping" in log
    assert "WARNING ps_offload.daemon.systemd: watchdog: serving again after" in log

    # What systemd then does to a hung daemon: SIGABRT. The log shows where the threads were.
    release.clear()
    threads = stick_both_threads()
    notes.wait_for(lambda n: n.message.startswith("STATUS=Not serving"), after=freed_at)
    daemon.process.send_signal(signal.SIGABRT)
    assert daemon.process.wait(timeout=30) == -signal.SIGABRT
    log = daemon.log()
    assert "Fatal Python error: Aborted" in log
    # The stuck pushes, waiting for the rest of their payload.
    assert re.search(r'File ".*ps_daemon/rpc/servicer.py", line \d+ in _receive', log), log
    release.set()
    for thread in threads:
        thread.join(timeout=10)
    client.close()


def test_the_watchdog_keeps_pinging_while_more_clients_stall_than_there_are_threads(daemon_factory, systemd_env):
    """The other side of the test above: with the default per-client bound (half the threads),
    twice as many stalled pushes as RPC threads leave the watchdog's own health checks a
    thread, so systemd is not told the daemon hangs (ps_daemon/rpc/call_bounds.py)."""
    notes = systemd_env(1.0, "daemon0")
    daemon = daemon_factory("--log-level", "WARNING")  # max_workers 32
    register_model(daemon.address)
    notes.wait_for(lambda n: len(notes.pings()) >= 2, timeout=10)
    release, ends = threading.Event(), threading.Semaphore(0)
    clients = [Stalled(daemon.address, "push", release, ends) for _ in range(64)]
    try:
        for _ in range(64 - 16):  # the host's budget (16) holds; the rest are refused at once
            assert ends.acquire(timeout=60)
        stalled_at = time.monotonic()
        notes.wait_for(lambda n: len(notes.pings(start=stalled_at)) >= 4, timeout=20)
        assert not [n for n in notes.notes if n.at >= stalled_at and n.message.startswith("STATUS=Not serving")]
        assert _health(daemon.address) == health_pb2.HealthCheckResponse.SERVING
    finally:
        release.set()
        for client in clients:
            client.close()
