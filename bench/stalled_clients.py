"""Health-check latency while gRPC clients stall (issue #26; ps_daemon/rpc/call_bounds.py).

Twice as many stalled clients as the daemon has RPC threads (64 against the default 32), of
each kind: a Push that sends its header and 1 MiB of a 64 MiB payload and stops; a Pull of a
64 MiB shard whose client reads one chunk and stops reading; a call whose request message never
comes. Meanwhile: how long a health check from the same host takes to answer (capped at its
5 s deadline: "no answer"). Two daemons in the same run, kinds interleaved:

* bounded: the defaults (max_calls_per_client half of max_workers, data_stall_seconds 30);
* unbounded: what the daemon was before the bounds, by config: max_calls_per_client =
  max_workers (one host may take every thread) and data_stall_seconds 1e6 (nothing is cut off).

Writes bench/results/reliability/stalled_clients.json; docs/reliability.md quotes it.
`.venv/bin/python -m bench.stalled_clients` (about a minute). The test of the same bounds,
with fewer threads, is tests/integration/test_stalled_clients.py; both use the clients here.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.common import REPO, RESULTS, machine
from ps_offload.daemon.local import LocalDaemon
from ps_offload.proto import codec, ps_pb2
from ps_offload.proto.channel import method_path
from ps_offload.proto.push import Push
from ps_offload.trainer.wire.daemon_client import DaemonClient

SHARD_BYTES = 64 << 20  # the default shard size: far past HTTP/2's flow-control windows
# A connection of its own for each client, as separate processes would have (channels to one
# target otherwise share one connection).
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", 16 << 20)]
# A client that stops reading takes no more than its stream's window: a fixed 64 KiB one. With
# BDP probing on, a loaded machine's inflated round trips grew the window until the whole
# shard fitted, and the "stalled" pull ended at once (seen once in CI).
STALLED_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 64 << 10)]
KINDS = ("push", "pull", "request")


def register_model(address: str) -> None:
    """Model "m": one 64 MiB shard (SGD), its values pushed once."""
    client = DaemonClient(address, max_message_bytes=8 << 20)
    numel = SHARD_BYTES // 4
    spec = ps_pb2.ModelSpec(
        model="m",
        params=[ps_pb2.ParamSpec(name="w", shape=[numel], dtype=ps_pb2.FLOAT32)],
        optimizer=ps_pb2.OptimizerSpec(sgd=ps_pb2.SGDSpec(lr=1.0)),
        shard_bytes=SHARD_BYTES,
        daemons=["d0"],
    )
    try:
        client.register(spec, 0, timeout=30)
        values = memoryview(torch.ones(numel).numpy()).cast("B")
        client.push(Push.parameters("m", 0, values, step=0), timeout=60)
    finally:
        client.close()


class Stalled:
    """One stalled client of `kind` on a channel of its own; `release` ends its stall. When
    its call ends: `code` and `metadata` (trailing), `ended` set and `ends` released."""

    def __init__(self, address: str, kind: str, release: threading.Event, ends: threading.Semaphore) -> None:
        self.channel = grpc.insecure_channel(address, options=OWN_CONNECTION + STALLED_WINDOW)
        self.kind, self.release, self._ends = kind, release, ends
        self.code: grpc.StatusCode | None = None
        self.metadata: tuple = ()
        self.ended = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            getattr(self, f"_{self.kind}")()
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as error:
            self.code, self.metadata = error.code(), tuple(tuple(m) for m in error.trailing_metadata() or ())
        finally:
            self.ended.set()
            self._ends.release()

    def _push(self) -> None:
        header = ps_pb2.PushHeader(
            model="m", shard_id=0, step=0, kind=ps_pb2.GRADIENT, encoding=ps_pb2.RAW, dtype=ps_pb2.FLOAT32,
            nbytes=SHARD_BYTES,
        )  # fmt: skip

        def chunks() -> Iterator[bytes]:
            yield codec.push_chunks.encode(header, bytes(1 << 20))
            self.release.wait(120)  # the rest of the payload never comes

        self.channel.stream_unary(method_path("ParameterServer", "Push"))(chunks(), timeout=120)

    def _pull(self) -> None:
        pull = self.channel.unary_stream(
            method_path("ParameterServer", "Pull"), request_serializer=ps_pb2.PullRequest.SerializeToString
        )
        replies = pull(ps_pb2.PullRequest(model="m", shard_id=0), timeout=120)
        next(replies)  # one chunk, and then it stops reading until the daemon ends the call
        while not replies.done() and not self.release.wait(0.05):
            pass
        if not replies.done():
            replies.cancel()
        for _ in replies:  # what it had buffered, then the call's status
            pass

    def _request(self) -> None:
        # A unary method called with a request stream that never sends its message.
        stats = self.channel.stream_unary(
            method_path("Admin", "Stats"), request_serializer=ps_pb2.StatsRequest.SerializeToString
        )

        def never() -> Iterator[ps_pb2.StatsRequest]:
            self.release.wait(120)
            return
            yield

        stats(never(), timeout=120)

    def close(self) -> None:
        self.channel.close()


def health_seconds(address: str, deadline: float = 5.0) -> float:
    """How long a health check from this host takes to answer SERVING; `deadline` if it does not."""
    with grpc.insecure_channel(address, options=OWN_CONNECTION) as channel:
        started = time.monotonic()
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=deadline)
        except grpc.RpcError:
            return deadline
        took = time.monotonic() - started
        return took if response.status == health_pb2.HealthCheckResponse.SERVING else deadline


def _under_stall(address: str, kind: str, clients: int) -> float:
    release, ends = threading.Event(), threading.Semaphore(0)
    stalled = [Stalled(address, kind, release, ends) for _ in range(clients)]
    try:
        time.sleep(2.0)  # the calls reach the daemon and take (or are refused) their threads
        return max(health_seconds(address) for _ in range(3))
    finally:
        release.set()
        for client in stalled:
            client.ended.wait(30)
            client.close()


def main() -> dict:
    workers = 32
    configs = {
        "bounded": "",
        "unbounded": f"max_calls_per_client = {workers}\ndata_stall_seconds = 1000000.0\n",
    }
    seconds: dict[str, dict[str, float]] = {name: {} for name in configs}
    with tempfile.TemporaryDirectory(prefix="ps-bench-stall-", dir=REPO) as tmp:
        daemons = {}
        for name, extra in configs.items():
            config = Path(tmp) / f"{name}.toml"
            config.write_text(f"[server]\nmax_workers = {workers}\n{extra}")
            daemons[name] = LocalDaemon(Path(tmp) / name, "--config", str(config), "--log-level", "WARNING")
            register_model(daemons[name].address)
        try:
            for kind in KINDS:
                for name, daemon in daemons.items():
                    seconds[name][kind] = round(_under_stall(daemon.address, kind, 2 * workers), 3)
                    print(f"{kind}, {name}: health answered in {seconds[name][kind]} s with {2 * workers} stalled")
        finally:
            for daemon in daemons.values():
                daemon.kill()
    result = {
        "name": "stalled_clients",
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "max_workers": workers,
        "stalled_clients": 2 * workers,
        "health_deadline_seconds": 5.0,
        "health_seconds": seconds,
        "notes": "max of 3 health checks from the stalled clients' host, 2 s after they started; 5.0 = no answer",
    }
    out = RESULTS / "reliability" / "stalled_clients.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
