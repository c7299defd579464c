"""Which shards ShardedClient sends as one batch (`batches`): those of one unreplicated,
reachable daemon whose transport takes batches; every other shard alone. No daemon needed
(nothing answers at port 1, and nothing is sent)."""

from __future__ import annotations

from ps_offload.proto.plan import ShardSlice
from ps_offload.trainer.wire.sharded_client import ShardedClient


class Batching:
    """A transport that takes batches (as the local one does, to a daemon of protocol 3)."""

    takes_batches = True

    def pull_batch(self, pulls, *, timeout):
        raise AssertionError("not sent")

    def push_batch(self, pushes, *, timeout):
        raise AssertionError("not sent")

    def close(self) -> None:
        pass


def test_a_daemons_unreplicated_shards_go_together_and_the_rest_alone():
    client = ShardedClient(["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"])
    try:
        client.transports._carriers[0] = client.transports._carriers[2] = Batching()
        shards = [
            ShardSlice(0, 0, 0, 4),
            ShardSlice(1, 1, 4, 4),  # daemon 1 speaks gRPC: alone
            ShardSlice(2, 0, 8, 4),
            ShardSlice(3, 0, 12, 4, (2,)),  # replicated: alone (each holder answers for itself)
            ShardSlice(4, 2, 16, 4),
            ShardSlice(5, 2, 20, 4),
            ShardSlice(6, 0, 24, 4),
        ]
        assert client.batches(shards) == [[0, 2, 6], [4, 5], [1], [3]]
        client.holders.lost[2] = "gone (as a replicated model's holder would be)"
        assert client.batches(shards) == [[0, 2, 6], [1], [3], [4], [5]]
    finally:
        client.holders.lost.clear()
        client.close()
