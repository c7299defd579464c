"""transport_pull, transport_push: a 256 MiB model (64M fp32 in four 64 MiB shards) pulled
and pushed over loopback gRPC by the trainer's client (ShardedClient, two streams per
daemon as OffloadOptimizer uses) from/to a ps-daemon process, vs a raw TCP socket moving
the same bytes between two processes (sendall from a preallocated buffer, recv_into a
preallocated buffer: the physical limit of loopback for Python).

Pushes are PARAMETERS pushes (a copy into the master values, no optimizer step), so only
transport and the daemon's receive path are measured. Ratio = our GB/s over TCP's;
target >= 0.85.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
from concurrent.futures import ThreadPoolExecutor

import torch

from bench.common import BenchDaemon, interleaved, median, record, timed
from ps_offload.proto import ps_pb2
from ps_offload.trainer.client import ShardedClient
from ps_offload.trainer.config import ClientConfig

NBYTES = 256 << 20
NUMEL = NBYTES // 4


def _tcp_server(listener: socket.socket) -> None:
    buf = bytearray(NBYTES)
    view = memoryview(buf)
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        cmd = conn.recv(1)
        if cmd == b"P":  # client pulls
            conn.sendall(view)
        elif cmd == b"U":  # client pushes
            got = 0
            while got < NBYTES:
                got += conn.recv_into(view[got:], NBYTES - got)
            conn.sendall(b"k")
        else:
            return


class TcpPeer:
    def __init__(self) -> None:
        listener = socket.create_server(("127.0.0.1", 0))
        self.process = mp.get_context("fork").Process(target=_tcp_server, args=(listener,), daemon=True)
        self.process.start()
        self.sock = socket.create_connection(listener.getsockname())
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        listener.close()
        self.buf = memoryview(bytearray(NBYTES))

    def pull(self) -> None:
        self.sock.sendall(b"P")
        got = 0
        while got < NBYTES:
            got += self.sock.recv_into(self.buf[got:], NBYTES - got)

    def push(self) -> None:
        self.sock.sendall(b"U")
        self.sock.sendall(self.buf)
        assert self.sock.recv(1) == b"k"

    def close(self) -> None:
        self.sock.sendall(b"Q")
        self.sock.close()
        self.process.join(10)


def main() -> list[dict]:
    peer = TcpPeer()
    with BenchDaemon() as daemon:
        grpc_only = _measure(daemon.address, "grpc", reps=4)
        ours_t, peer_t = _measure(daemon.address, "auto", reps=8, peer=peer)
    peer.close()
    results = []
    for name in ("transport_pull", "transport_push"):
        results.append(
            record(
                name,
                ours=NBYTES / median(ours_t[name]) / 1e9,
                peer=NBYTES / median(peer_t[name]) / 1e9,
                unit="GB/s",
                target=0.85,
                higher_is_better=True,
                notes="256 MiB in 4 shards over the TCP data plane, 2 connections; peer: raw TCP between two "
                "processes; median of 8 ABBA-interleaved transfers. grpc_gbps: the same over the gRPC Pull/Push "
                "streams (1 MiB chunks), for comparison",
                extra={"grpc_gbps": round(NBYTES / median(grpc_only[0][name]) / 1e9, 3)},
            )
        )
    return results


def _measure(address: str, transport: str, *, reps: int, peer: TcpPeer | None = None):
    """Times pull_all and push_all through ShardedClient with the given transport; with a
    peer, interleaved with its pull and push."""
    config = ClientConfig(transport=transport)
    client = ShardedClient([address], config=config)
    spec = ps_pb2.ModelSpec(
        model="transport",
        params=[ps_pb2.ParamSpec(name="w", shape=[NUMEL], dtype=ps_pb2.FLOAT32)],
        optimizer=ps_pb2.OptimizerSpec(sgd=ps_pb2.SGDSpec(lr=0.1)),
        shard_bytes=64 << 20,
    )
    plan = client.register(spec)
    flat = torch.randn(NUMEL)
    raw = memoryview(flat.numpy()).cast("B")
    pool = ThreadPoolExecutor(max_workers=config.streams_per_daemon)

    def push_all() -> None:
        futures = [
            pool.submit(client.push, s, step=0, kind=ps_pb2.PARAMETERS, data=raw[s.offset * 4 : s.end * 4], lr=None)
            for s in plan
        ]
        for f in futures:
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

    times: tuple[dict, dict] = ({}, {})
    for name, ours, theirs in (("transport_pull", pull_all, peer and peer.pull),
                               ("transport_push", push_all, peer and peer.push)):  # fmt: skip
        if theirs is None:
            ours()
            times[0][name] = [timed(ours) for _ in range(reps)]
        else:
            times[0][name], times[1][name] = interleaved(ours, theirs, reps=reps, warmup=2)
    pool.shutdown()
    client.close()
    return times


if __name__ == "__main__":
    main()
