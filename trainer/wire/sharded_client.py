"""The trainer's side of the wire: push, pull and wait, ps-lite style.

`DaemonClient` talks to one daemon. `ShardedClient` holds the plan and a client per daemon
and moves one shard at a time, with deadlines and retries. Retrying is safe: a push is
applied at most once per (shard, step) and a pull only reads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

import grpc
import torch

from ps_offload.optimizers import plugin_for_spec
from ps_offload.proto import ps_pb2
from ps_offload.proto.cluster import check_daemon_list
from ps_offload.proto.frames import split_host_port
from ps_offload.proto.plan import ShardSlice, layout_params, plan_model
from ps_offload.proto.pull import Pull
from ps_offload.proto.push import Push
from ps_offload.trainer.config import ClientConfig
from ps_offload.trainer.wire.daemon_client import (
    PULL_RETRYABLE,
    PUSH_RETRYABLE,
    UNREACHABLE_AFTER,
    DaemonClient,
    DaemonError,
    busy,
    check_protocol,
    check_state_dtype_echo,
)
from ps_offload.trainer.wire.dataplane_client import DataPlaneClient, DataPlaneError
from ps_offload.trainer.wire.host_windows import HostWindows, Prepare
from ps_offload.trainer.wire.local_client import LocalClient, slot_bytes_for
from ps_offload.trainer.wire.lost_probe import LostDaemonProbe
from ps_offload.trainer.wire.replicas import adopt_fresh_holders, check_replicas, id_ranges, repair_lost
from ps_offload.trainer.wire.transport import PullInto, Transport

log = logging.getLogger(__name__)

T = TypeVar("T")


class ShardedClient:
    """A model's plan over an ordered daemon list, and shard-level push/pull with retries."""

    def __init__(self, daemons: list[str], *, config: ClientConfig | None = None) -> None:
        check_daemon_list(daemons)
        self.daemons = list(daemons)
        self.config = config or ClientConfig()
        self.clients = [self._daemon_client(a) for a in daemons]
        self.model = ""
        self.plan: list[ShardSlice] = []
        self.created: list[bool] = []
        # The daemons with an NVMe tier: only their Prefetch hints can save a read.
        self.nvme_daemons: set[int] = set()
        # Per daemon, what carries pulls and pushes: its local endpoint when it is reachable
        # (the node's own daemon), else its data plane when it has one (and the config allows
        # them), else the gRPC client.
        self.transports: list[Transport] = list(self.clients)
        # Host memory shared with the node's daemons (their local transports): see shared_host_tensor.
        self.host_windows = HostWindows()
        # Daemons left out for the rest of the run (a replicated model's holders that stopped
        # answering), and why: index -> the error.
        self.lost: dict[int, str] = {}
        self._losing = threading.Lock()  # one thread leaves a holder out, and says so
        self.probe = LostDaemonProbe(self.config)  # whether a lost daemon answers again, asked off the step
        self.stale_said: set[int] = set()  # lost daemons said to be back with stale state
        self.digests: list[str] = []  # each daemon's kernel digest, from its registration
        self.replaced: set[int] = set()  # lost daemons given a new address (replace_daemon), not yet repaired
        # Lost daemons this client registered the model on afresh (they hold none of its values):
        # a repair takes them although their registration now finds the model (adopt_fresh_holders).
        self.fresh_holders: set[int] = set()
        # A replicated push's copies to the other holders run here, beside the caller's own.
        self._fanout = ThreadPoolExecutor(max_workers=4 * len(daemons), thread_name_prefix="ps-replica-push")

    def _daemon_client(self, address: str) -> DaemonClient:
        return DaemonClient(
            address,
            max_message_bytes=self.config.max_message_bytes,
            security=self.config.security,
            dead_peer_seconds=self.config.dead_peer_seconds,
        )

    def register(self, spec: ps_pb2.ModelSpec) -> list[ShardSlice]:
        """Registers on every daemon (the first resolves the shard size when the spec leaves
        it 0), checks each daemon's plan equals the one computed here, and returns it."""
        if spec.replicas > len(self.daemons):
            raise ValueError(
                f"OffloadConfig.replicas={spec.replicas} needs at least as many daemons; the list has "
                f"{len(self.daemons)}: {', '.join(self.daemons)}"
            )
        spec = _copy(spec)
        del spec.daemons[:]
        spec.daemons.extend(self.daemons)
        self.model = spec.model
        self.created = []
        digests: list[str] = []
        for index, client in enumerate(self.clients):
            # Registration waits for a daemon that is down (it may be starting): said after a
            # moment, not only once the first attempt's deadline (30 s) has passed.
            waiting = threading.Timer(UNREACHABLE_AFTER, self._say_unanswered, (index,))
            waiting.daemon = True
            waiting.start()
            try:
                response = self.call(
                    f"RegisterModel {spec.model!r}",
                    index,
                    lambda c=client, i=index: c.register(spec, i, timeout=self.config.register_timeout_seconds),
                )
            finally:
                waiting.cancel()
            if index == 0:
                spec.shard_bytes = response.shard_bytes
                self.plan = expected_plan(spec, response.shard_bytes)
                self.spec = spec
            check_protocol(self.daemons[index], response)
            check_state_dtype_echo(self.daemons[index], spec, response)
            got = [
                ShardSlice(s.shard_id, s.daemon_index, s.offset, s.numel, tuple(s.holders[1:])) for s in response.shards
            ]
            digests.append(response.kernel_digest)
            if got != self.plan:
                raise RuntimeError(
                    f"daemon {self.daemons[index]} computed a different shard plan for {spec.model!r}; "
                    "are all daemons and trainers running the same ps-offload version?"
                )
            self.created.append(response.created)
            if response.nvme_tier:
                self.nvme_daemons.add(index)
            else:
                self.nvme_daemons.discard(index)
            self.use_data_plane(index, response)
        if spec.replicas > 1:
            check_replicas(self.daemons, digests, self.plan)
        self.digests = digests
        return self.plan

    def repair_lost(self, version: int) -> list[str]:
        """Copies a lost daemon's shards back onto it once it answers with none of the model
        (trainer/wire/replicas.py repair_lost); only between steps, every shard at `version`."""
        return repair_lost(self, version) if self.lost else []

    def replace_daemon(self, old: str, new: str) -> None:
        """A lost daemon's replacement at another address: `new` takes `old`'s place in the list
        (the plan depends on the list's count and order only), and is repaired between steps
        like a lost daemon back at its address."""
        if old not in self.daemons:
            raise ValueError(f"{old} is not among this model's daemons ({', '.join(self.daemons)})")
        index = self.daemons.index(old)
        if index not in self.lost:
            raise ValueError(f"daemon {old} is not lost: only a lost daemon is replaced")
        check_daemon_list([*self.daemons[:index], new, *self.daemons[index + 1 :]])
        old_client, current = self.clients[index], self.transports[index]
        self.clients[index] = self.transports[index] = self._daemon_client(new)
        if current is not old_client:  # its data plane or local client
            current.close()
        old_client.close()
        self.daemons[index] = new
        del self.spec.daemons[:]
        self.spec.daemons.extend(self.daemons)
        self.probe.watch(index, new, self.spec, expect=True)
        self.replaced.add(index)
        log.warning("daemon %s replaces lost daemon %s (index %d) for model %r", new, old, index, self.model)

    def _say_unanswered(self, index: int) -> None:
        wait = self.config.register_timeout_seconds + self.config.retry_seconds
        if self.clients[index].serving(timeout=1.0):
            # It answers: the registration itself takes long (a large model's state is allocated
            # and zeroed, a few GB a second), which is not a daemon gone.
            log.info(
                "daemon %s is still registering model %r (allocating its shards' state); waiting up to %.0f s",
                self.daemons[index], self.model, wait,
            )  # fmt: skip
            return
        log.warning(
            "daemon %s does not answer (is it running, and is %s its server.listen?); waiting up to %.0f s for it "
            "(ClientConfig.register_timeout_seconds + retry_seconds)",
            self.daemons[index], self.daemons[index], wait,
        )  # fmt: skip

    def use_data_plane(self, index: int, response: ps_pb2.RegisterModelResponse) -> None:
        current, data_port, endpoint = self.transports[index], response.data_port, response.local_endpoint
        if not data_port or self.config.transport == "grpc":
            return
        if endpoint and self.config.transport in ("auto", "local"):
            # The slot holds any push or pull of this daemon's largest shard.
            slot_bytes = slot_bytes_for(max((s.numel for s in self.plan if index in s.holders), default=1))
            if isinstance(current, LocalClient) and (current.endpoint, current.slot_bytes) == (endpoint, slot_bytes):
                return
            local = self._connect_local(index, endpoint, slot_bytes)
            if local is not None:
                self._replace(index, local)
                return
        if isinstance(current, DataPlaneClient) and current.address[1] == data_port:
            return
        host, _ = split_host_port(self.daemons[index])
        self._replace(
            index,
            DataPlaneClient(
                host,
                data_port,
                max_connections=self.config.streams_per_daemon,
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
                max_connections=self.config.streams_per_daemon,
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

    def _replace(self, index: int, transport: Transport) -> None:
        current = self.transports[index]
        if current not in self.clients:
            current.close()
        self.transports[index] = transport

    @property
    def local(self) -> bool:
        """Whether a daemon of this model is reached through the local transport."""
        return any(isinstance(t, LocalClient) for t in self.transports)

    def shared_host_tensor(self, numel: int, dtype: torch.dtype, prepare: Prepare | None = None) -> torch.Tensor | None:
        """A zeroed host tensor the node's daemon writes pulls into and reads pushes from where
        they lie (ps_offload.trainer.wire.host_windows); None without a local transport, or
        when the node's pool (server.local_pool_bytes) has no room: the caller allocates its
        own, and its bytes go through a copy. `prepare`: as HostWindows.allocate's."""
        if not self.local:
            return None
        return self.host_windows.allocate(numel, dtype, prepare)

    def _rediscover(self, index: int, seconds: float) -> None:
        """After the data plane became unreachable: ask the daemon again (RegisterModel is
        idempotent, and a restarted daemon has recovered the model), for its data port or local
        endpoint may have changed, for at most `seconds` (4 s; for a replicated shard's holder,
        what its window has left, so it is given up on time). Failures are left to the next
        attempt."""
        if seconds < 0.2:
            return
        try:
            # (register may try twice: waiting for the channel, then once more without)
            response = self.clients[index].register(self.spec, index, timeout=min(2.0, seconds / 2))
        except grpc.RpcError:
            return
        self.use_data_plane(index, response)

    def call(
        self,
        what: str,
        daemon_index: int,
        fn: Callable[[], T],
        retryable: frozenset = PUSH_RETRYABLE,
        give_up_seconds: float | None = None,
    ) -> T:
        """Runs fn with retries on transient errors, for `give_up_seconds` (retry_seconds by
        default) after the first; raises DaemonError otherwise."""
        address = self.daemons[daemon_index]
        delay = self.config.backoff_seconds
        # A holder's window (a replicated shard's): its re-registrations fit in what is left of it.
        windowed = give_up_seconds is not None
        give_up_seconds = self.config.retry_seconds if give_up_seconds is None else give_up_seconds
        give_up_at: float | None = None  # give_up_seconds after the first transient error
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn()
            except grpc.RpcError as error:
                now = time.monotonic()
                give_up_at = give_up_at if give_up_at is not None else now + give_up_seconds
                final = error.code() not in retryable and not busy(error)
                # (lost: another call left this holder out meanwhile; its retries would only wait)
                if final or now >= give_up_at or daemon_index in self.lost:
                    raise DaemonError(address, what, error) from None
                log.warning("%s on %s: %s (attempt %d), retrying", what, address, error.code().name, attempt)
                if isinstance(error, DataPlaneError) and error.code() == grpc.StatusCode.UNAVAILABLE and self.plan:
                    self._rediscover(daemon_index, give_up_at - time.monotonic() if windowed else 4.0)
            time.sleep(max(0.0, min(delay, give_up_at - time.monotonic())))
            delay = min(delay * 2, 2.0)

    def push(self, shard: ShardSlice, push: Push, *, pull_into: PullInto | None = None) -> ps_pb2.PushResponse:
        """Sends one shard's push (retried as a whole, the same bytes each attempt) to each live
        holder of the shard; they answer alike, or the replicas have diverged (an error).
        `pull_into`: where the shard's new version should go too, asked of the first live
        holder only (the one a pull would read); the answer's `pulled` says it is there."""
        header = push.header
        if (header.model, header.shard_id) != (self.model, shard.shard_id):
            raise ValueError(
                f"a push for {header.model!r} shard {header.shard_id} sent as shard {shard.shard_id} of {self.model!r}"
            )
        # The holders left out, told to those that answer: their metrics show the shards a
        # replica short (ps_offload.daemon.store.replica_reports); empty again once repaired.
        del header.lost_holders[:]
        header.lost_holders.extend(sorted(self.lost))
        first = self.live_holders(shard)[0]
        answers = self._on_holders(
            shard,
            push.describe(),
            lambda index: self.transports[index].push(
                push, timeout=self.config.rpc_timeout_seconds, pull_into=pull_into if index == first else None
            ),
            PUSH_RETRYABLE,
            every=True,
        )
        versions = {self.daemons[index]: answer.version for index, answer in answers}
        if len(set(versions.values())) > 1:
            raise RuntimeError(
                f"the replicas of shard {shard.shard_id} of model {self.model!r} answered {push.describe()} at "
                f"different versions ({versions}): they have diverged; stop, and restore the model from a snapshot"
            )
        index, answer = answers[0]
        if answer.pulled and index != first:  # (never: only the first was asked)
            answer.pulled = False
        return answer

    def pull(
        self,
        shard: ShardSlice,
        *,
        min_version: int,
        out: memoryview,
        tensor: int = ps_pb2.MASTER,
        dtype: int = ps_pb2.FLOAT32,
    ) -> int:
        """Pulls the shard's `tensor` (master values by default) in `dtype` into `out` from its
        first live holder; returns its version."""
        pull = Pull.of(self.model, shard.shard_id, min_version=min_version, tensor=tensor, dtype=dtype)
        timeout = self.config.rpc_timeout_seconds
        ((_, version),) = self._on_holders(
            shard,
            pull.describe(),
            lambda index: self.transports[index].pull_into(pull, out=out, timeout=timeout),
            PULL_RETRYABLE,
            every=False,
        )
        if version < min_version:  # a daemon's promise broken: never trained on silently
            raise RuntimeError(
                f"a daemon answered the pull of shard {shard.shard_id} of model {self.model!r} at version {version}, "
                f"below the {min_version} it asked for: a daemon fault; stop and report it"
            )
        return version

    def pull_each(self, shard: ShardSlice, *, min_version: int, tensor: int) -> dict[int, tuple[int, torch.Tensor]]:
        """The shard's `tensor` (fp32) from every live holder at once: holder index -> (its
        version, its values). What compares a shard's replicas (the parity audit) reads; a
        holder unreachable for dead_peer_seconds is lost, as for a push."""

        request = Pull.of(self.model, shard.shard_id, min_version=min_version, tensor=tensor)

        def pull(index: int) -> tuple[int, torch.Tensor]:
            values = torch.empty(shard.numel, dtype=torch.float32)
            out = memoryview(values.numpy()).cast("B")
            return self.transports[index].pull_into(request, out=out, timeout=self.config.rpc_timeout_seconds), values

        return dict(self._on_holders(shard, request.describe(), pull, PULL_RETRYABLE, every=True))

    def live_holders(self, shard: ShardSlice) -> list[int]:
        """The shard's holders not lost, the primary first; raises when none is left."""
        live = [index for index in shard.holders if index not in self.lost]
        if not live:
            lost = "; ".join(f"{self.daemons[i]}: {self.lost[i]}" for i in shard.holders)
            raise RuntimeError(
                f"every daemon holding shard {shard.shard_id} of model {self.model!r} is lost ({lost}): its state is "
                "gone from this job; restore the model from a snapshot (ps-admin snapshot restore)"
            )
        return live

    def _on_holders(
        self, shard: ShardSlice, what: str, fn: Callable[[int], T], retryable: frozenset, *, every: bool
    ) -> list[tuple[int, T]]:
        """fn(daemon index) on every live holder of the shard (every=True: a push), or on the
        first that answers (a pull). Unreplicated: the one holder, retried for retry_seconds.
        Replicated: a holder unreachable for dead_peer_seconds is lost (left out from now on),
        and the others go on; a refusal (any other error) is raised as it is."""
        holders = self.live_holders(shard)
        if len(shard.holders) == 1:
            return [(holders[0], self.call(what, holders[0], lambda: fn(holders[0]), retryable))]

        def one(index: int) -> tuple[int, T] | None:
            try:
                window = self.config.dead_peer_seconds
                return index, self.call(what, index, lambda: fn(index), retryable, give_up_seconds=window)
            except DaemonError as error:
                if error.code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                self._lose(index, error)
                return None

        if every:  # a push: to every holder at once, each on its own thread (the first here)
            others = [self._fanout.submit(one, index) for index in holders[1:]]
            try:
                first = one(holders[0])
            finally:
                # Their pushes read the caller's bytes (a staging buffer it gives back on
                # return, a gradient the next backward overwrites): never left running past
                # this call, whatever the first holder answered.
                wait(others)
            results = [first, *(future.result() for future in others)]
            answers = [result for result in results if result is not None]
        else:  # a pull: the first holder that answers
            answers = next(([r] for r in map(one, holders) if r is not None), [])
        if not answers:
            self.live_holders(shard)  # raises: every holder is lost now
        return answers

    def adopt_fresh_holders(self, fresh: list[int]) -> None:
        """Resuming a replicated model that daemons `fresh` did not know: they are left out and
        caught up between two steps (trainer/wire/replicas.py adopt_fresh_holders)."""
        adopt_fresh_holders(self, fresh)

    def _lose(self, index: int, error: DaemonError) -> None:
        """Leaves a holder out for the rest of the run, saying which shards it leaves short."""
        with self._losing:
            if index in self.lost:
                return
            self.lost[index] = str(error)
        self.probe.watch(index, self.daemons[index], self.spec)
        short = [s.shard_id for s in self.plan if index in s.holders]
        log.warning(
            "daemon %s is lost (%s): left out for the rest of this run; %d shards of model %r now have one holder "
            "fewer (%s). Training goes on with their other replicas; replace the daemon to restore them.",
            self.daemons[index], error.code.name, len(short), self.model, id_ranges(short),
        )  # fmt: skip

    def _by_daemon(self, shard_ids: list[int]) -> list[tuple[int, DaemonClient, list[int]]]:
        """(daemon index, client, its shards in the given order) for live daemons with any."""
        groups = [
            (i, c, [s for s in shard_ids if i in self.plan[s].holders])
            for i, c in enumerate(self.clients)
            if i not in self.lost
        ]
        return [group for group in groups if group[2]]

    def prefetch(self, shard_ids: list[int]) -> None:
        """Sends each daemon the hint for its shards, in the given order."""
        for index, client, mine in self._by_daemon(shard_ids):
            self.call("prefetch", index, lambda c=client, m=mine: c.prefetch(self.model, m, timeout=5.0))

    def hint(self, shard_ids: list[int]) -> None:
        """Like prefetch, but once, without raising, and only to daemons with an NVMe tier
        (on a RAM-only one it would be a call on each side for nothing): a lost hint costs
        only its speed-up, and a daemon that is down is for the next push to find (and retry)."""
        for index, client, mine in self._by_daemon(shard_ids):
            if index not in self.nvme_daemons:
                continue
            try:
                client.prefetch(self.model, mine, timeout=5.0)
            except grpc.RpcError as error:
                log.debug("prefetch hint to %s failed: %s", self.daemons[index], error.code().name)

    def close(self) -> None:
        self.probe.close()
        self._fanout.shutdown(wait=True)
        for transport in self.transports:
            if transport not in self.clients:
                transport.close()
        for client in self.clients:
            client.close()


def expected_plan(spec: ps_pb2.ModelSpec, shard_bytes: int) -> list[ShardSlice]:
    """The plan every daemon must answer with (ps_daemon/store/shard_store.py computes the same)."""
    layouts = layout_params([(p.name, tuple(p.shape), None) for p in spec.params])
    return plan_model(
        layouts, [p.starts_shard for p in spec.params], shard_bytes, len(spec.daemons), spec.replicas,
        whole_params=plugin_for_spec(spec.optimizer).whole_params,
    )  # fmt: skip


def _copy(spec: ps_pb2.ModelSpec) -> ps_pb2.ModelSpec:
    out = ps_pb2.ModelSpec()
    out.CopyFrom(spec)
    return out
