"""transport_pull, transport_push: a 256 MiB model (64M fp32 in four 64 MiB shards) pulled
and pushed over loopback by the trainer's client (ShardedClient on the daemon's TCP data
plane, `streams_per_daemon` connections and as many threads, as OffloadOptimizer uses) from/to
a ps-daemon process, against two peers given the same connections and the same bytes:

* iperf3 (C) over as many connections, one iperf3 process per connection (so it gets as many
  threads as ours; see Iperf3), moving the same total bytes (`-n`), pushes client to server
  and pulls reversed (`-R`): what loopback TCP does with no interpreter in the way. The
  headline ratio is ours over it; target >= 0.85.
* raw TCP in Python: a server process with one thread per connection `sendall`s from /
  `recv_into`s a preallocated buffer, and the client moves the same four 64 MiB pieces over
  the same number of persistent connections from a pool of as many threads. This is the
  floor of our own code (framing, the daemon's bookkeeping) over a socket; the ratio to it is
  in the result file.

The three run interleaved, ABC CBA, and each figure is the median of the per-round ratios
(the machine's drift cancels within a round). Pushes are PARAMETERS pushes (a copy into the
master values, no optimizer step), so only transport and the daemon's receive path are
measured. iperf3's figure is its own (bytes received over the seconds of its test), which
leaves out its process start; ours is the wall time of the four transfers.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import queue
import shutil
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from bench.common import BenchDaemon, interleaved_many, median, quick, record, spread
from ps_offload.proto import ps_pb2
from ps_offload.proto.push import Push
from ps_offload.trainer.config import ClientConfig
from ps_offload.trainer.wire.sharded_client import ShardedClient

NBYTES = 256 << 20
NUMEL = NBYTES // 4
PIECE = 64 << 20  # the shard size: each request moves one piece, as each pull/push moves one shard
REPS = quick(10, 3)
REQUEST = struct.Struct("!cQQ")  # command, offset, length


def _tcp_server(listener: socket.socket, connections: int) -> None:
    """The peer's daemon: one process, a thread per connection (the daemon's data plane
    serves each request on a worker thread of its own too), serving pieces of one
    preallocated buffer."""
    view = memoryview(bytearray(NBYTES))

    def serve(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        header = bytearray(REQUEST.size)
        while True:
            got = 0
            while got < REQUEST.size:
                n = conn.recv_into(memoryview(header)[got:])
                if n == 0:
                    return
                got += n
            cmd, offset, length = REQUEST.unpack(header)
            if cmd == b"P":  # client pulls
                conn.sendall(view[offset : offset + length])
            elif cmd == b"U":  # client pushes
                got = 0
                while got < length:
                    got += conn.recv_into(view[offset + got : offset + length], length - got)
                conn.sendall(b"k")
            else:
                return

    threads = [threading.Thread(target=serve, args=(listener.accept()[0],)) for _ in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class TcpPeer:
    """Raw TCP with our resources: `connections` persistent sockets used by as many threads,
    the same four 64 MiB pieces per transfer."""

    def __init__(self, connections: int) -> None:
        listener = socket.create_server(("127.0.0.1", 0))
        self.process = mp.get_context("fork").Process(target=_tcp_server, args=(listener, connections), daemon=True)
        self.process.start()
        self.idle: queue.LifoQueue[socket.socket] = queue.LifoQueue()
        self.socks = []
        for _ in range(connections):
            sock = socket.create_connection(listener.getsockname())
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.socks.append(sock)
            self.idle.put(sock)
        listener.close()
        self.buf = memoryview(bytearray(NBYTES))
        self.pool = ThreadPoolExecutor(max_workers=connections)

    def _pull_piece(self, offset: int) -> None:
        sock = self.idle.get()
        sock.sendall(REQUEST.pack(b"P", offset, PIECE))
        got = 0
        while got < PIECE:
            got += sock.recv_into(self.buf[offset + got : offset + PIECE], PIECE - got)
        self.idle.put(sock)

    def _push_piece(self, offset: int) -> None:
        sock = self.idle.get()
        sock.sendall(REQUEST.pack(b"U", offset, PIECE))
        sock.sendall(self.buf[offset : offset + PIECE])
        assert sock.recv(1) == b"k"
        self.idle.put(sock)

    def pull(self) -> None:
        list(self.pool.map(self._pull_piece, range(0, NBYTES, PIECE)))

    def push(self) -> None:
        list(self.pool.map(self._push_piece, range(0, NBYTES, PIECE)))

    def close(self) -> None:
        for sock in self.socks:
            sock.sendall(REQUEST.pack(b"Q", 0, 0))
            sock.close()
        self.pool.shutdown()
        self.process.join(10)


class Iperf3:
    """iperf3 on loopback moving NBYTES in all over `streams` connections, one iperf3 server
    and one client process per connection, all at once. iperf3 before 3.16 (Debian's is
    3.12) runs every `--parallel` stream of a client in one thread, which would give the peer
    one core against our `streams` threads; separate processes give it as many as ours."""

    def __init__(self, streams: int) -> None:
        self.streams = streams
        self.ports, self.servers = [], []
        for _ in range(streams):
            with socket.create_server(("127.0.0.1", 0)) as s:  # a free port for each server
                port = s.getsockname()[1]
            self.ports.append(port)
            self.servers.append(subprocess.Popen(
                ["iperf3", "--server", "--bind", "127.0.0.1", "--port", str(port)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))  # fmt: skip
        for port in self.ports:
            for _ in range(100):  # wait until it listens
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    time.sleep(0.05)
        time.sleep(0.2)  # the probes above count as clients to iperf3; let the servers reset
        self.seconds = {"transport_pull": [], "transport_push": []}

    def run(self, reverse: bool) -> float:
        """Seconds for all connections to move NBYTES between them: the slowest client's own
        test time (iperf3's figure, not its process start)."""
        share = NBYTES // self.streams
        for attempt in range(5):
            clients = [
                subprocess.Popen(
                    [
                        "iperf3",
                        "--client",
                        "127.0.0.1",
                        "--port",
                        str(port),
                        "--bytes",
                        str(share),
                        "--length",
                        "1M",
                        "--json",
                        *(["--reverse"] if reverse else []),
                    ],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )  # fmt: skip
                for port in self.ports
            ]
            outs = [(client.communicate(), client.returncode) for client in clients]
            reports = [json.loads(out or "{}") for (out, _), _ in outs]
            if all(code == 0 and "error" not in data for (_, code), data in zip(outs, reports, strict=True)):
                return max(
                    d["end"]["sum_received"]["seconds"] * share / d["end"]["sum_received"]["bytes"] for d in reports
                )
            time.sleep(0.2 * (attempt + 1))  # "the server is busy running a test": it was still resetting
        raise RuntimeError(f"iperf3 failed: {[out[-300:] for (out, _), _ in outs]}")

    def close(self) -> None:
        for server in self.servers:
            server.terminate()
            server.wait(10)


def main() -> list[dict]:
    streams = ClientConfig().streams_per_daemon  # connections per daemon, and threads using them
    have_iperf3 = shutil.which("iperf3") is not None
    if not have_iperf3:
        print("transport: iperf3 is not installed (apt-get install iperf3); its figures are recorded as missing")
    tcp = TcpPeer(streams)
    iperf3 = Iperf3(streams) if have_iperf3 else None
    try:
        with BenchDaemon() as daemon:
            grpc_only = _measure(daemon.address, "grpc", reps=quick(4, 1))
            times = _measure(daemon.address, "tcp", reps=REPS, tcp=tcp, iperf3=iperf3)
    finally:
        tcp.close()
        if iperf3 is not None:
            iperf3.close()
    results = []
    for name in ("transport_pull", "transport_push"):
        t = times[name]
        gbps = {who: NBYTES / median(ts) / 1e9 for who, ts in t.items()}
        # Per round, ours over each peer (throughput ratio = their time over ours).
        vs = {who: [p / o for o, p in zip(t["ours"], t[who], strict=True)] for who in t if who != "ours"}
        head = "iperf3" if have_iperf3 else "raw_tcp"
        peer_note = (
            f"iperf3 (C), {streams} processes of one connection each, moving the same bytes on loopback"
            if have_iperf3
            else "raw TCP"
        )
        extra = {
            "connections": streams,
            "ratio_spread": spread(vs[head]),
            "raw_tcp_gbps": round(gbps["raw_tcp"], 3),
            "ratio_vs_raw_tcp": round(median(vs["raw_tcp"]), 3),
            "ratio_vs_raw_tcp_spread": spread(vs["raw_tcp"]),
            "iperf3_gbps": round(gbps["iperf3"], 3) if have_iperf3 else None,
            "ratio_vs_iperf3": round(median(vs["iperf3"]), 3) if have_iperf3 else None,
            "ratio_vs_iperf3_spread": spread(vs["iperf3"]) if have_iperf3 else None,
            "peer_missing": [] if have_iperf3 else ["iperf3"],
            "grpc_gbps": round(NBYTES / median(grpc_only[name]["ours"]) / 1e9, 3),
        }
        results.append(
            record(
                name,
                ours=gbps["ours"],
                peer=gbps[head],
                ratio=median(vs[head]),
                unit="GB/s",
                target=0.85,
                higher_is_better=True,
                notes=f"256 MiB in 4 shards of 64 MiB over the TCP data plane, {streams} connections and threads; "
                f"peer: {peer_note}; "
                f"also raw TCP in Python with {streams} connections and threads moving the same pieces; "
                f"{len(t['ours'])} rounds interleaved ABC CBA, ratio = median of the per-round ratios. "
                "grpc_gbps: the same over the gRPC Pull/Push streams (1 MiB chunks), for comparison",
                extra=extra,
            )
        )
    return results


def shard_movers(
    client: ShardedClient, plan: list, pool: ThreadPoolExecutor, flat: torch.Tensor | None = None
) -> tuple[Callable, Callable]:
    """(push_all, pull_all): every shard of a one-tensor model pushed (PARAMETERS) or pulled at
    once over `pool`, from and into one buffer (`flat`, else a new one); checked once to
    round-trip bit for bit."""
    if flat is None:
        flat = torch.empty(sum(s.numel for s in plan))
    flat.copy_(torch.randn(flat.numel()))
    raw = memoryview(flat.numpy()).cast("B")

    def push_all() -> None:
        pushes = [Push.parameters(client.model, s.shard_id, raw[s.offset * 4 : s.end * 4], step=0) for s in plan]
        for f in [pool.submit(client.push, s, p) for s, p in zip(plan, pushes, strict=True)]:
            f.result()

    def pull_all() -> None:
        futures = [pool.submit(client.pull, s, min_version=0, out=raw[s.offset * 4 : s.end * 4]) for s in plan]
        for f in futures:
            f.result()

    push_all()
    expected = flat.clone()
    flat.zero_()
    pull_all()
    assert torch.equal(flat, expected), "pulled bytes differ from pushed bytes"
    return push_all, pull_all


def _measure(address: str, transport: str, *, reps: int, tcp: TcpPeer | None = None, iperf3: Iperf3 | None = None):
    """Times pull_all and push_all through ShardedClient with the given transport; with
    peers, interleaved with theirs. Returns {name: {contender: [seconds per round]}}."""
    config = ClientConfig(transport=transport)
    client = ShardedClient([address], config=config)
    spec = ps_pb2.ModelSpec(
        model="transport",
        params=[ps_pb2.ParamSpec(name="w", shape=[NUMEL], dtype=ps_pb2.FLOAT32)],
        optimizer=ps_pb2.OptimizerSpec(sgd=ps_pb2.SGDSpec(lr=0.1)),
        shard_bytes=PIECE,
    )
    plan = client.register(spec)
    pool = ThreadPoolExecutor(max_workers=config.streams_per_daemon)
    push_all, pull_all = shard_movers(client, plan, pool)

    times = {}
    for name, ours, reverse in (("transport_pull", pull_all, True), ("transport_push", push_all, False)):
        contenders = {"ours": ours}
        if tcp is not None:
            contenders["raw_tcp"] = tcp.pull if reverse else tcp.push
        if iperf3 is not None:
            contenders["iperf3"] = lambda reverse=reverse: iperf3.run(reverse)
        times[name] = interleaved_many(contenders, reps=reps, warmup=2)
    pool.shutdown()
    client.close()
    return times


if __name__ == "__main__":
    main()
