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

from bench.common import BenchDaemon, interleaved, median, record
from ps_proto import ps_pb2
from trainer.client import ShardedClient
from trainer.config import ClientConfig

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
        config = ClientConfig()
        client = ShardedClient([daemon.address], config=config)
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

        results = []
        for name, ours, theirs in (("transport_pull", pull_all, peer.pull), ("transport_push", push_all, peer.push)):
            ours_t, peer_t = interleaved(ours, theirs, reps=8, warmup=2)
            results.append(
                record(
                    name,
                    ours=NBYTES / median(ours_t) / 1e9,
                    peer=NBYTES / median(peer_t) / 1e9,
                    unit="GB/s",
                    target=0.85,
                    higher_is_better=True,
                    notes="256 MiB in 4 shards, 1 MiB chunks, 2 streams; peer: raw TCP between two processes; "
                    "median of 8 ABBA-interleaved transfers",
                )
            )
        pool.shutdown()
        client.close()
    peer.close()
    return results


if __name__ == "__main__":
    main()
