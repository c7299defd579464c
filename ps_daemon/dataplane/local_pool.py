"""The node's pool of host memory shared with its ranks (`server.local_pool_bytes`).

A rank on the daemon's host attaches windows of its own memory (memfds: its parameter and
gradient buffers, its staging buffers; ps_offload.trainer.wire.host_windows) so that a pull
is written by the daemon straight where the rank wants it and a push is read where the
gradient was written, with no copy on the rank's side. Those windows are the node's staging
memory, and on a GPU host they are page-locked (each rank registers its windows with CUDA),
so one budget bounds them all: per-process pinned pools that together outgrow the host's RAM
are among the most reported offload failures (DeepSpeed #7693, Megatron #7232). A window
past the budget is refused (RESOURCE_EXHAUSTED naming the key), and the rank carries its
bytes through its connection's slot instead: slower, never wrong.

A client is the set of connections that share its random id (LocalAttach.client): a window
attached on one serves all, and stays mapped until the last of them has closed, so a window
is never unmapped while a connection's thread may still read or write it. Its memory goes
back to the kernel then (the rank's mapping aside), which is how a dead rank's is reclaimed.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import torch

from ps_offload.daemon.errors import InvalidArgument, ResourceExhausted
from ps_offload.proto.memory import mem_available
from ps_offload.proto.shared_memory import SharedMapping

POOL_SHARE = 4
"""Without server.local_pool_bytes, the pool is 1/POOL_SHARE of the host's MemAvailable at
start: the RAM tier and the ranks' own memory share the rest."""

MAX_WINDOWS_PER_CLIENT = 64
"""A rank attaches a few windows (its flat buffers, its staging buffers); a bound keeps a
confused one from mapping thousands."""


def pool_bytes(configured: int, available: int | None) -> int:
    """The pool's size: `configured` (server.local_pool_bytes), refused where it is more than
    the host's `available` memory (OSError, said at start); 0: 1/POOL_SHARE of it (0 where
    the host does not say: no windows, every local byte goes through the slots)."""
    if configured and available is not None and configured > available:
        raise OSError(
            f"server.local_pool_bytes = {configured} is more than the host has available ({available} bytes "
            "MemAvailable): lower server.local_pool_bytes, or free memory on the host"
        )
    if configured:
        return configured
    return (available or 0) // POOL_SHARE


@dataclass
class _Client:
    pid: int
    connections: int = 0
    windows: dict[int, SharedMapping] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(w.size for w in self.windows.values())


class LocalPool:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._clients: dict[str, _Client] = {}
        self._lock = threading.Lock()

    @classmethod
    def at_start(cls, configured: int) -> LocalPool:
        return cls(pool_bytes(configured, mem_available()))

    @property
    def used(self) -> int:
        with self._lock:
            return sum(c.nbytes for c in self._clients.values())

    def clients(self) -> list[tuple[int, int, int]]:
        """(pid, connections, window bytes) of each client now."""
        with self._lock:
            return [(c.pid, c.connections, c.nbytes) for c in self._clients.values()]

    def join(self, client: str, pid: int) -> bool:
        """A connection of `client` opened (its windows stay until every join has its leave);
        False (not joined) when another process holds that id."""
        with self._lock:
            entry = self._clients.setdefault(client, _Client(pid))
            if entry.pid != pid:
                return False
            entry.connections += 1
            return True

    def leave(self, client: str) -> None:
        with self._lock:
            entry = self._clients[client]
            entry.connections -= 1
            if entry.connections:
                return
            del self._clients[client]
        for window in entry.windows.values():
            window.close()

    def attach(self, client: str, number: int, fd: int) -> int:
        """Maps `fd` (consumed) as window `number` of `client`; returns its size. Refused
        (nothing mapped) when the number is taken or 0, when it is not a sealed memfd, or
        when the pool has no room for it."""
        try:
            if number == 0:
                raise InvalidArgument("window 0 is the connection's slot: attach windows as 1, 2, ...")
            window = SharedMapping(fd)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        finally:
            os.close(fd)
        with self._lock:
            entry = self._clients[client]
            refusal = None
            if number in entry.windows:
                refusal = InvalidArgument(f"window {number} is attached already")
            elif len(entry.windows) >= MAX_WINDOWS_PER_CLIENT:
                refusal = ResourceExhausted(f"a client may attach at most {MAX_WINDOWS_PER_CLIENT} windows")
            else:
                used = sum(c.nbytes for c in self._clients.values())
                if used + window.size > self.capacity:
                    refusal = ResourceExhausted(
                        f"a window of {window.size} bytes does not fit the node's shared pool: {used} of "
                        f"server.local_pool_bytes = {self.capacity} are attached by {len(self._clients)} "
                        "client(s); raise server.local_pool_bytes (the rank moves its bytes through its "
                        "slot meanwhile)"
                    )
            if refusal is None:
                entry.windows[number] = window
                return window.size
        window.close()
        raise refusal

    def view(self, client: str, ref_window: int, offset: int, nbytes: int, what: str) -> torch.Tensor:
        """The `nbytes` at `offset` of window `ref_window` of `client`, as a uint8 tensor;
        InvalidArgument (naming `what`) for an unknown window or a range outside it."""
        with self._lock:
            window = self._clients[client].windows.get(ref_window)
        if window is None:
            raise InvalidArgument(f"{what}: window {ref_window} is not attached on this connection's client")
        if offset + nbytes > window.size:
            raise InvalidArgument(
                f"{what}: {nbytes} bytes at offset {offset} do not fit window {ref_window} of {window.size} bytes"
            )
        return window.bytes[offset : offset + nbytes]
