"""ReplicaHolders: the one owner of which holders of a replicated model are lost, replaced,
fresh or stale; each transition through its methods, no daemon needed (nothing answers at
port 1, and the probe's questions run off this thread)."""

from __future__ import annotations

import pytest

from ps_offload.proto import ps_pb2
from ps_offload.proto.plan import ShardSlice
from ps_offload.trainer.config import ClientConfig
from ps_offload.trainer.wire.holders import ReplicaHolders, id_ranges

DAEMONS = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
PLAN = [ShardSlice(0, 0, 0, 4, (1,)), ShardSlice(1, 1, 4, 4, (2,)), ShardSlice(2, 2, 8, 4, (0,))]


def _spec() -> ps_pb2.ModelSpec:
    return ps_pb2.ModelSpec(model="m", daemons=DAEMONS, replicas=2)


@pytest.fixture
def holders():
    holders = ReplicaHolders(ClientConfig())
    yield holders
    holders.close()


def test_a_lost_holder_is_left_out_and_the_primary_comes_first(holders):
    assert holders.live(PLAN[0], DAEMONS, "m") == [0, 1]
    holders.lose(0, "connection refused", "UNAVAILABLE", spec=_spec(), plan=PLAN)
    holders.lose(0, "said again", "UNAVAILABLE", spec=_spec(), plan=PLAN)  # once: the first reason stays
    assert holders.lost == {0: "connection refused"}
    assert holders.live(PLAN[0], DAEMONS, "m") == [1] and holders.live(PLAN[1], DAEMONS, "m") == [1, 2]
    holders.lose(1, "timed out", "DEADLINE_EXCEEDED", spec=_spec(), plan=PLAN)
    with pytest.raises(RuntimeError, match="every daemon holding shard 0 of model 'm' is lost"):
        holders.live(PLAN[0], DAEMONS, "m")


def test_a_repaired_replacement_is_a_holder_again_with_nothing_left_over(holders):
    holders.lose(2, "gone", "UNAVAILABLE", spec=_spec(), plan=PLAN)
    holders.replaced_by(2, _spec())
    assert holders.stays_stale(2) and not holders.stays_stale(2)  # said once
    assert holders.repaired(2)  # a replacement: the others must learn its address
    assert (holders.lost, holders.replaced, holders.stale_said, holders.fresh_holders) == ({}, set(), set(), set())
    holders.lose(2, "gone again", "UNAVAILABLE", spec=_spec(), plan=PLAN)
    assert not holders.repaired(2)  # back at its own address


def test_fresh_holders_are_left_out_until_repaired_and_a_bare_shard_is_refused(holders):
    holders.adopt_fresh([1], _spec(), PLAN)
    assert holders.fresh_holders == {1} and 1 in holders.lost
    with pytest.raises(RuntimeError, match=r"shards 0 were on no other daemon"):
        holders.adopt_fresh([0], _spec(), PLAN)


def test_id_ranges():
    assert id_ranges([0, 1, 2, 3, 7, 9, 10]) == "0-3, 7, 9-10" and id_ranges([]) == ""
