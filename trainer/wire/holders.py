"""ReplicaHolders: which daemons a replicated model's shards are missing from in this run, and
why. One object owns every set that says so, and only its methods change them: a holder lost
(left out for the rest of the run), a replacement named in its place, a daemon found empty at
resume (a fresh holder), a lost daemon back with stale state of its own (said once), and a
holder repaired (ps_offload.trainer.wire.replicas.repair_lost). Whether a lost daemon answers
again is asked off the step's path (ps_offload.trainer.wire.lost_probe).

The client (ps_offload.trainer.wire.sharded_client) asks it which holders of a shard are live
before each push and pull, and tells it when one stops answering.
"""

from __future__ import annotations

import logging
import threading

from ps_offload.proto import ps_pb2
from ps_offload.proto.plan import ShardSlice
from ps_offload.trainer.config import ClientConfig
from ps_offload.trainer.wire.lost_probe import LostDaemonProbe

log = logging.getLogger(__name__)


def id_ranges(ids: list[int]) -> str:
    """'0-3, 7, 9-10' for [0, 1, 2, 3, 7, 9, 10]."""
    parts, start = [], None
    for i, n in enumerate(ids):
        if start is None:
            start = n
        if i + 1 == len(ids) or ids[i + 1] != n + 1:
            parts.append(f"{start}-{n}" if n != start else f"{n}")
            start = None
    return ", ".join(parts)


class ReplicaHolders:
    def __init__(self, config: ClientConfig) -> None:
        # Daemons left out for the rest of the run (a replicated model's holders that stopped
        # answering), and why: index -> the error.
        self.lost: dict[int, str] = {}
        self._losing = threading.Lock()  # one thread leaves a holder out, and says so
        self.probe = LostDaemonProbe(config)  # whether a lost daemon answers again, asked off the step
        self.stale_said: set[int] = set()  # lost daemons said to be back with stale state
        self.replaced: set[int] = set()  # lost daemons given a new address (replace_daemon), not yet repaired
        # Lost daemons registered afresh (they hold none of the model's values): a repair takes
        # them although their registration now finds the model (adopt_fresh).
        self.fresh_holders: set[int] = set()

    def live(self, shard: ShardSlice, daemons: list[str], model: str) -> list[int]:
        """The shard's holders not lost, the primary first; raises when none is left."""
        live = [index for index in shard.holders if index not in self.lost]
        if not live:
            lost = "; ".join(f"{daemons[i]}: {self.lost[i]}" for i in shard.holders)
            raise RuntimeError(
                f"every daemon holding shard {shard.shard_id} of model {model!r} is lost ({lost}): its state is "
                "gone from this job; restore the model from a snapshot (ps-admin snapshot restore)"
            )
        return live

    def lose(self, index: int, why: str, code: str, *, spec: ps_pb2.ModelSpec, plan: list[ShardSlice]) -> None:
        """Leaves a holder out for the rest of the run, saying which shards it leaves short."""
        with self._losing:
            if index in self.lost:
                return
            self.lost[index] = why
        address = spec.daemons[index]
        self.probe.watch(index, address, spec)
        short = [s.shard_id for s in plan if index in s.holders]
        log.warning(
            "daemon %s is lost (%s): left out for the rest of this run; %d shards of model %r now have one holder "
            "fewer (%s). Training goes on with their other replicas; replace the daemon to restore them.",
            address, code, len(short), spec.model, id_ranges(short),
        )  # fmt: skip

    def adopt_fresh(self, fresh: list[int], spec: ps_pb2.ModelSpec, plan: list[ShardSlice]) -> None:
        """A replicated model resumed where daemons `fresh` did not know it (a replacement in a
        lost node's place in the daemon list, a node whose disk was wiped): they are left out
        for now, and caught up between two steps like a lost daemon back (repair_lost). Raises
        when a shard has no other holder."""
        for index in fresh:
            self.lost[index] = "it held none of the model's values when the run resumed"
            self.fresh_holders.add(index)
            self.probe.watch(index, spec.daemons[index], spec, expect=True)
        bare = [s.shard_id for s in plan if all(i in self.lost for i in s.holders)]
        if bare:
            names = [spec.daemons[i] for i in fresh]
            raise RuntimeError(
                f"daemons {names} did not know model {spec.model!r} while the others did, and shards "
                f"{id_ranges(bare)} were on no other daemon: their state is lost. Restore the model from a snapshot "
                "(ps-admin snapshot restore) or an export, or re-register it under a new name"
            )
        log.warning(
            "daemons %s hold none of model %r (replacements, or nodes that lost their disk): the run resumes from "
            "the other replicas, and they are caught up from them between two steps",
            ", ".join(spec.daemons[i] for i in fresh), spec.model,
        )  # fmt: skip

    def replaced_by(self, index: int, spec: ps_pb2.ModelSpec) -> None:
        """Lost holder `index` has a new address (already in `spec.daemons`): asked whether it
        answers, and repaired between steps like a lost daemon back."""
        self.probe.watch(index, spec.daemons[index], spec, expect=True)
        self.replaced.add(index)

    def stays_stale(self, index: int) -> bool:
        """A lost daemon answers again with a copy of its own, some steps behind: it stays out.
        True the first time (the caller says so), False after."""
        if index in self.stale_said:
            return False
        self.stale_said.add(index)
        return True

    def repaired(self, index: int) -> bool:
        """Holder `index` holds every shard again: a holder from the next push on. Returns
        whether it was a replacement (whose address the other daemons' spec must learn)."""
        was_replaced = index in self.replaced
        del self.lost[index]
        self.probe.forget(index)
        self.replaced.discard(index)
        self.stale_said.discard(index)
        self.fresh_holders.discard(index)
        return was_replaced

    def close(self) -> None:
        self.probe.close()
