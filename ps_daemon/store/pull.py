"""One pull: which tensor of which shard, from which version, in which dtype.

Built once from the wire (ps_offload.daemon.rpc.conversions.pull_request, which refuses the
enum values it does not know), then checked once against its shard (ShardStore.check_pull:
does the model and shard exist here, does its optimizer hold that tensor, may the tensor travel
in that dtype), which gives a CheckedPull: the pull and its shard, handed on as they are. A data
plane pull asks it whether it must park, and later, after its wait, ShardStore.pull holds that
shard while it is sent; a model dropped meanwhile ends the wait and the pull NOT_FOUND
(Shard.dropped).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Any


@dataclass(slots=True)  # read-only by convention: frozen, its __init__ would cost four times as much, every pull
class PullRequest:
    model: str
    shard_id: int
    _: KW_ONLY
    min_version: int = 0  # the first version that may be sent (pull waits for it)
    tensor: str = "master"  # one of ps_offload.daemon.store.shard.SHARD_TENSORS
    dtype: str = "float32"  # one of ps_offload.daemon.store.pull_rounding.PULL_DTYPES
    snapshot: str = ""  # "": the shard as it is now; else that snapshot's copy (float32, never waits)

    @property
    def where(self) -> str:
        """The pull, as messages name it."""
        return f"pull of shard {self.shard_id} of model {self.model!r}"


@dataclass(frozen=True, slots=True)
class CheckedPull:
    """A pull checked against its shard (ps_offload.daemon.store.shard.Shard), looked up once."""

    pull: PullRequest
    shard: Any

    def must_wait(self) -> bool:
        """True while the version asked for is not there yet (a snapshot's copy never waits)."""
        if self.pull.snapshot:
            return False
        with self.shard.cond:
            return not (self.shard.dropped or self.shard.ready_locked(self.pull.min_version))
