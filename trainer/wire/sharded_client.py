"""The trainer's side of the wire: push, pull and wait, ps-lite style.

`ShardedClient` registers a model on its daemons, holds the plan, and moves one shard at a
time, with deadlines and retries; retrying is safe: a push is applied at most once per (shard,
step) and a pull only reads. It owns two objects, each with its own state: `transports`
(ps_offload.trainer.wire.transports: which transport reaches each daemon) and `holders`
(ps_offload.trainer.wire.holders: which holders of a replicated model are lost, replaced,
fresh, stale), changed only through their methods.
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
from ps_offload.trainer.wire.dataplane_client import DataPlaneError
from ps_offload.trainer.wire.holders import ReplicaHolders
from ps_offload.trainer.wire.replicas import check_replicas, repair_lost
from ps_offload.trainer.wire.transport import PullInto
from ps_offload.trainer.wire.transports import Transports

log = logging.getLogger(__name__)

T = TypeVar("T")


class ShardedClient:
    """A model's plan over an ordered daemon list, and shard-level push/pull with retries."""

    def __init__(self, daemons: list[str], *, config: ClientConfig | None = None) -> None:
        check_daemon_list(daemons)
        self.daemons = list(daemons)
        self.config = config or ClientConfig()
        self.transports = Transports(self.daemons, self.config)
        self.holders = ReplicaHolders(self.config)
        self.model = ""
        self.plan: list[ShardSlice] = []
        self.created: list[bool] = []
        # The daemons with an NVMe tier: only their Prefetch hints can save a read.
        self.nvme_daemons: set[int] = set()
        self.digests: list[str] = []  # each daemon's kernel digest, from its registration
        # A replicated push's copies to the other holders run here, beside the caller's own.
        self._fanout = ThreadPoolExecutor(max_workers=4 * len(daemons), thread_name_prefix="ps-replica-push")

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
        for index, client in enumerate(self.transports.clients):
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
            self.transports.use_data_plane(index, response, self.plan)
        if spec.replicas > 1:
            check_replicas(self.daemons, digests, self.plan)
        self.digests = digests
        return self.plan

    def repair_lost(self, version: int) -> list[str]:
        """Copies a lost daemon's shards back onto it once it answers with none of the model
        (trainer/wire/replicas.py repair_lost); only between steps, every shard at `version`."""
        return repair_lost(self, version) if self.holders.lost else []

    def replace_daemon(self, old: str, new: str) -> None:
        """A lost daemon's replacement at another address: `new` takes `old`'s place in the list
        (the plan depends on the list's count and order only), and is repaired between steps
        like a lost daemon back at its address."""
        if old not in self.daemons:
            raise ValueError(f"{old} is not among this model's daemons ({', '.join(self.daemons)})")
        index = self.daemons.index(old)
        if index not in self.holders.lost:
            raise ValueError(f"daemon {old} is not lost: only a lost daemon is replaced")
        check_daemon_list([*self.daemons[:index], new, *self.daemons[index + 1 :]])
        self.daemons[index] = new
        self.transports.readdress(index, new)
        del self.spec.daemons[:]
        self.spec.daemons.extend(self.daemons)
        self.holders.replaced_by(index, self.spec)
        log.warning("daemon %s replaces lost daemon %s (index %d) for model %r", new, old, index, self.model)

    def _say_unanswered(self, index: int) -> None:
        wait = self.config.register_timeout_seconds + self.config.retry_seconds
        if self.transports.clients[index].serving(timeout=1.0):
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
            response = self.transports.clients[index].register(self.spec, index, timeout=min(2.0, seconds / 2))
        except grpc.RpcError:
            return
        self.transports.use_data_plane(index, response, self.plan)

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
                if final or now >= give_up_at or daemon_index in self.holders.lost:
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
        self._check_push(shard, push)
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

    def _check_push(self, shard: ShardSlice, push: Push) -> None:
        header = push.header
        if (header.model, header.shard_id) != (self.model, shard.shard_id):
            raise ValueError(
                f"a push for {header.model!r} shard {header.shard_id} sent as shard {shard.shard_id} of {self.model!r}"
            )
        # The holders left out, told to those that answer: their metrics show the shards a
        # replica short (ps_offload.daemon.store.replica_reports); empty again once repaired.
        del header.lost_holders[:]
        header.lost_holders.extend(sorted(self.holders.lost))

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
        return self._at_least(shard, version, min_version)

    def batches(self, shards: list[ShardSlice]) -> list[list[int]]:
        """`shards`' indices grouped as pull_batch and push_batch send them: those of one
        unreplicated daemon whose transport takes batches together, every other shard alone."""
        groups: dict[int, list[int]] = {}
        alone = []
        for i, shard in enumerate(shards):
            index = shard.daemon_index
            if len(shard.holders) == 1 and index not in self.holders.lost and _batches(self.transports[index]):
                groups.setdefault(index, []).append(i)
            else:
                alone.append([i])
        return [*groups.values(), *alone]

    def pull_batch(
        self, shards: list[ShardSlice], outs: list[memoryview], *, min_version: int, dtype: int = ps_pb2.FLOAT32
    ) -> list[int | BaseException]:
        """pull() of each shard's master values into its `out`; per shard, its version or what
        its pull raised. A daemon's shards in one round trip where its transport takes batches
        (`batches`); a shard the batch did not bring (an error in its answer, or the batch
        failing) is pulled alone, with pull()'s retries."""
        pulls = [Pull.of(self.model, s.shard_id, min_version=min_version, dtype=dtype) for s in shards]
        timeout = self.config.rpc_timeout_seconds
        got = self._batched(shards, lambda t, idx: t.pull_batch([(pulls[i], outs[i]) for i in idx], timeout=timeout))
        results: list[int | BaseException] = []
        for i, shard in enumerate(shards):
            try:
                if isinstance(got.get(i), int):
                    results.append(self._at_least(shard, got[i], min_version))
                else:
                    results.append(self.pull(shard, min_version=min_version, out=outs[i], dtype=dtype))
            except Exception as error:  # noqa: BLE001 - the caller's, per shard
                results.append(error)
        return results

    def push_batch(self, shards: list[ShardSlice], pushes: list[Push]) -> list[ps_pb2.PushResponse | BaseException]:
        """push() of each shard's push; per shard, the daemon's acknowledgement or what its push
        raised. A daemon's shards in one round trip where its transport takes batches
        (`batches`), applied in the given order; a push the batch did not carry through (an
        error in its answer, or the batch failing) is sent alone, with push()'s retries (a push
        is applied at most once per (shard, step), so a repeat is answered, not applied)."""
        for shard, push in zip(shards, pushes, strict=True):
            self._check_push(shard, push)
        timeout = self.config.rpc_timeout_seconds
        got = self._batched(shards, lambda t, idx: t.push_batch([pushes[i] for i in idx], timeout=timeout))
        results: list[ps_pb2.PushResponse | BaseException] = []
        for i, (shard, push) in enumerate(zip(shards, pushes, strict=True)):
            if isinstance(got.get(i), ps_pb2.PushResponse):
                results.append(got[i])
                continue
            try:
                results.append(self.push(shard, push))
            except Exception as error:  # noqa: BLE001 - the caller's, per shard
                results.append(error)
        return results

    def _batched(self, shards: list[ShardSlice], send: Callable[[object, list[int]], list | None]) -> dict[int, object]:
        """send(transport, indices) for each group of two or more of `batches`; shard index ->
        what its answer brought (a result, or the error in it). A group whose batch failed as
        a whole, or that its transport would not send (None), brings nothing."""
        got: dict[int, object] = {}
        for group in self.batches(shards):
            if len(group) < 2:
                continue
            index = shards[group[0]].daemon_index
            try:
                answers = send(self.transports[index], group)
            except grpc.RpcError as error:  # each is sent again alone, with the retries
                log.info("a batch of %d to %s failed (%s); sending them one by one", len(group), self.daemons[index],
                         error.code().name)  # fmt: skip
                continue
            if answers is not None:
                got.update(zip(group, answers, strict=True))
        return got

    def _at_least(self, shard: ShardSlice, version: int, min_version: int) -> int:
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
        return self.holders.live(shard, self.daemons, self.model)

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
                self.holders.lose(index, str(error), error.code.name, spec=self.spec, plan=self.plan)
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
        caught up between two steps (ReplicaHolders.adopt_fresh)."""
        self.holders.adopt_fresh(fresh, self.spec, self.plan)

    def _by_daemon(self, shard_ids: list[int]) -> list[tuple[int, DaemonClient, list[int]]]:
        """(daemon index, client, its shards in the given order) for live daemons with any."""
        groups = [
            (i, c, [s for s in shard_ids if i in self.plan[s].holders])
            for i, c in enumerate(self.transports.clients)
            if i not in self.holders.lost
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
        self.holders.close()
        self._fanout.shutdown(wait=True)
        self.transports.close()


def _batches(transport: object) -> bool:
    """Whether a transport sends batches (the local one, to a daemon that takes them:
    ps_offload.trainer.wire.transport)."""
    return bool(getattr(transport, "takes_batches", False))


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
