"""One pull: which tensor of which shard, from which version, in which dtype.

Built once from the wire (ps_offload.daemon.rpc.conversions.pull_request, which refuses the
enum values it does not know) and taken as it is by every store call the pull makes: a data
plane pull asks ShardStore.pull_waits_on whether it must park, and later, after its wait,
ShardStore.pull holds the shard while it is sent. What depends on the shard (does the model
and shard exist here, does its optimizer hold that tensor, may the tensor travel in that
dtype) is checked by those calls, against the shard as it is then.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass


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
