"""What the trainers of replicated models (ModelSpec.replicas > 1) report of their holders.

A daemon cannot see its model's other holders: it only hears from trainers. A trainer that
has left a holder out (ps_offload.trainer.wire.sharded_client: it stopped answering for
dead_peer_seconds) names it in every push it sends on (PushHeader.lost_holders), and sends an
empty list again once the holder is repaired. Each daemon keeps the last list per model, so
that its metrics say how many of the shards it holds are one holder short
(ps_replica_degraded_shards), and its log says when that changes: an operator sees a
degraded model from any of its live daemons, beside `ps-admin replicas`.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from ps_offload.daemon.errors import InvalidArgument
from ps_offload.proto.plan import ShardSlice

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaHealth:
    """One model as its trainer last reported it."""

    model: str
    lost_holders: tuple[int, ...]  # indices in the spec's daemon list
    degraded_shards: int  # shards held here with a lost holder


class ReplicaReports:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lost: dict[str, tuple[int, ...]] = {}

    @staticmethod
    def check(lost: tuple[int, ...], *, replicas: int, daemons: int, own_index: int, where: str) -> None:
        """Raises InvalidArgument unless `lost` can describe this model: a replicated one, indices
        of its daemon list, each once, and not the daemon receiving it (it is answering)."""
        if not lost:
            return
        if replicas <= 1:
            raise InvalidArgument(f"{where}: lost_holders is for replicated models only (this one has replicas 1)")
        bad = [i for i in lost if not 0 <= i < daemons]
        if bad:
            raise InvalidArgument(f"{where}: lost_holders {bad} are not indices of the model's {daemons} daemons")
        if len(set(lost)) != len(lost):
            raise InvalidArgument(f"{where}: lost_holders names a daemon twice: {list(lost)}")
        if own_index in lost:
            raise InvalidArgument(f"{where}: lost_holders names daemon {own_index}, the one it was sent to")

    def note(
        self, model: str, lost: tuple[int, ...], addresses: tuple[str, ...], plan: list[ShardSlice], own: int
    ) -> None:
        """Keeps the trainer's latest list (checked), logging when it changes."""
        lost = tuple(sorted(lost))
        with self._lock:
            before = self._lost.get(model, ())
            if lost == before:
                return
            self._lost[model] = lost
        short = _degraded(lost, plan, own)
        if lost:
            names = ", ".join(addresses[i] for i in lost)
            log.warning(
                "model %r: its trainer reports daemons %s lost; %d shards held here have a holder fewer "
                "until they are repaired (ps-admin replicas %s)", model, names, short, model,
            )  # fmt: skip
        else:
            log.info("model %r: its trainer reports every holder back; no shard held here is degraded", model)

    def forget(self, model: str) -> None:
        with self._lock:
            self._lost.pop(model, None)

    def health(self, models: dict[str, tuple[list[ShardSlice], int]]) -> list[ReplicaHealth]:
        """Per replicated model held (`models`: name -> its plan and this daemon's index)."""
        with self._lock:
            lost = dict(self._lost)
        return [
            ReplicaHealth(name, lost.get(name, ()), _degraded(lost.get(name, ()), plan, own))
            for name, (plan, own) in sorted(models.items())
        ]


def _degraded(lost: tuple[int, ...], plan: list[ShardSlice], own: int) -> int:
    return sum(1 for s in plan if own in s.holders and any(i in lost for i in s.holders))
