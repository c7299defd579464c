"""Transports: which transport reaches each daemon of a model. Every daemon has its gRPC client
(registration, hints, admin-like calls, a repair's STATE pushes); its pulls and pushes go
through its local endpoint when this process can reach it (the node's own daemon: shared
memory), else its data plane when it has one and ClientConfig.transport allows it, else gRPC.
What each daemon offers comes with its RegisterModelResponse (`use_data_plane`); a daemon given
a new address (a lost daemon's replacement) gets a fresh gRPC client (`readdress`).

Host memory shared with the node's daemons (their local transports) is allocated here too
(`shared_host_tensor`; ps_offload.trainer.wire.host_windows).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import grpc
import torch

from ps_offload.proto import ps_pb2
from ps_offload.proto.channel import BATCHES_PROTOCOL
from ps_offload.proto.frames import split_host_port
from ps_offload.proto.plan import ShardSlice
from ps_offload.trainer.config import ClientConfig
from ps_offload.trainer.wire.daemon_client import DaemonClient
from ps_offload.trainer.wire.dataplane_client import DataPlaneClient, DataPlaneError
from ps_offload.trainer.wire.host_windows import HostWindows, Prepare
from ps_offload.trainer.wire.local_client import LocalClient, slot_bytes_for
from ps_offload.trainer.wire.transport import Transport

log = logging.getLogger(__name__)


class Transports:
    def __init__(self, daemons: list[str], config: ClientConfig) -> None:
        self.daemons = daemons  # the client's list, shared: a replacement changes it in place
        self.config = config
        self.clients = [self._grpc_client(address) for address in daemons]  # per daemon, its gRPC client
        self._carriers: list[Transport] = list(self.clients)  # per daemon, what carries pulls and pushes
        self.host_windows = HostWindows()

    def __getitem__(self, index: int) -> Transport:
        return self._carriers[index]

    def __iter__(self) -> Iterator[Transport]:
        return iter(self._carriers)

    def __len__(self) -> int:
        return len(self._carriers)

    def _grpc_client(self, address: str) -> DaemonClient:
        return DaemonClient(
            address,
            max_message_bytes=self.config.max_message_bytes,
            security=self.config.security,
            dead_peer_seconds=self.config.dead_peer_seconds,
        )

    def use_data_plane(self, index: int, response: ps_pb2.RegisterModelResponse, plan: list[ShardSlice]) -> None:
        """Carries daemon `index`'s pulls and pushes over what its registration answer offers."""
        current, data_port, endpoint = self._carriers[index], response.data_port, response.local_endpoint
        if not data_port or self.config.transport == "grpc":
            return
        if endpoint and self.config.transport in ("auto", "local"):
            # The slot holds any push or pull of this daemon's largest shard.
            slot_bytes = slot_bytes_for(max((s.numel for s in plan if index in s.holders), default=1))
            if isinstance(current, LocalClient) and (current.endpoint, current.slot_bytes) == (endpoint, slot_bytes):
                current.takes_batches = response.protocol >= BATCHES_PROTOCOL
                return
            local = self._connect_local(index, endpoint, slot_bytes)
            if local is not None:
                local.takes_batches = response.protocol >= BATCHES_PROTOCOL  # (an older daemon's: one by one)
                self._carry(index, local)
                return
        if isinstance(current, DataPlaneClient) and current.address[1] == data_port:
            return
        host, _ = split_host_port(self.daemons[index])
        self._carry(
            index,
            DataPlaneClient(
                host,
                data_port,
                max_connections=self.config.connections_per_daemon,
                security=self.config.security,
                dead_peer_seconds=self.config.dead_peer_seconds,
            ),
        )

    def _connect_local(self, index: int, endpoint: str, slot_bytes: int) -> LocalClient | None:
        """A client of the daemon's local endpoint if this process can reach it (the same host,
        network namespace and uid), else None: the data plane carries the bytes."""
        try:
            return LocalClient(
                endpoint,
                slot_bytes=slot_bytes,
                max_connections=self.config.connections_per_daemon,
                security=self.config.security,
                windows=self.host_windows,
            )
        except DataPlaneError as error:
            # Another host or network namespace is the normal case; a refusal is a setting.
            refused = error.code() == grpc.StatusCode.PERMISSION_DENIED
            log.log(
                logging.WARNING if refused else logging.INFO,
                "daemon %s: local shared-memory transport not usable, using its data plane (one more copy each "
                "way): %s",
                self.daemons[index],
                error,
            )
            return None

    def _carry(self, index: int, transport: Transport) -> None:
        current = self._carriers[index]
        if current not in self.clients:
            current.close()
        self._carriers[index] = transport

    def readdress(self, index: int, address: str) -> None:
        """Daemon `index` is now at `address` (already in the daemon list): a fresh gRPC client
        carries everything until its registration offers more."""
        old_client, current = self.clients[index], self._carriers[index]
        self.clients[index] = self._carriers[index] = self._grpc_client(address)
        if current is not old_client:  # its data plane or local client
            current.close()
        old_client.close()

    @property
    def local(self) -> bool:
        """Whether a daemon of this model is reached through the local transport."""
        return any(isinstance(t, LocalClient) for t in self._carriers)

    def shared_host_tensor(self, numel: int, dtype: torch.dtype, prepare: Prepare | None = None) -> torch.Tensor | None:
        """A zeroed host tensor the node's daemon writes pulls into and reads pushes from where
        they lie (ps_offload.trainer.wire.host_windows); None without a local transport, or
        when the node's pool (server.local_pool_bytes) has no room: the caller allocates its
        own, and its bytes go through a copy. `prepare`: as HostWindows.allocate's."""
        if not self.local:
            return None
        return self.host_windows.allocate(numel, dtype, prepare)

    def close(self) -> None:
        for transport in self._carriers:
            if transport not in self.clients:
                transport.close()
        for client in self.clients:
            client.close()
