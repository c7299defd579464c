"""The trainer's checks of a replicated model at registration (sharded_client.check_replicas),
with the daemons' answers given: kernels that round differently are refused, naming each
daemon's digest; replicas that share a host are warned about."""

from __future__ import annotations

import logging

import pytest

from ps_offload.proto.plan import place_replicas, plan_shards
from ps_offload.trainer.wire.replicas import check_replicas


def _plan(daemons: int, replicas: int):
    return place_replicas(plan_shards(12 * 1024, 1024, daemons), daemons, replicas)


def test_daemons_whose_kernels_round_differently_are_refused():
    daemons = ["a:1", "b:1", "c:1"]
    with pytest.raises(RuntimeError, match=r"a:1: 1111, b:1: 2222, c:1: 1111.*drift apart"):
        check_replicas(daemons, ["1111", "2222", "1111"], _plan(3, 2))
    with pytest.raises(RuntimeError, match="none \\(an older daemon\\)"):
        check_replicas(daemons, ["1111", "", "1111"], _plan(3, 2))


def test_replicas_sharing_a_host_are_warned_about(caplog):
    daemons = ["n0:1", "n0:2", "n1:1", "n1:2"]
    with caplog.at_level(logging.WARNING):
        check_replicas(daemons, ["x"] * 4, _plan(4, 2))  # step 2: n0:1 with n1:1, n0:2 with n1:2
    assert not caplog.records
    with caplog.at_level(logging.WARNING):
        check_replicas(["n0:1", "n1:1", "n0:2", "n1:2"], ["x"] * 4, _plan(4, 2))  # interleaved: 0 with 2 on n0
    shared = [r.getMessage() for r in caplog.records]
    assert shared and "replicas on the same host" in shared[0], shared


def test_more_replicas_than_daemons_is_said_before_any_call():
    import torch

    from ps_offload import trainer

    with pytest.raises(ValueError, match="replicas=3 needs at least as many daemons; the list has 2"):
        trainer.offload(
            torch.nn.Linear(4, 4),
            daemons=["127.0.0.1:1", "127.0.0.1:2"],  # nothing listens there: nothing is asked
            optimizer=trainer.AdamW(),
            config=trainer.OffloadConfig(replicas=3),
        )


def test_only_a_lost_daemon_of_the_list_is_replaced():
    from ps_offload.trainer.wire.sharded_client import ShardedClient

    client = ShardedClient(["127.0.0.1:1", "127.0.0.1:2"])  # nothing is asked of them
    try:
        with pytest.raises(ValueError, match="127.0.0.1:9 is not among this model's daemons"):
            client.replace_daemon("127.0.0.1:9", "127.0.0.1:3")
        with pytest.raises(ValueError, match="daemon 127.0.0.1:1 is not lost: only a lost daemon is replaced"):
            client.replace_daemon("127.0.0.1:1", "127.0.0.1:3")
        client.holders.lost[0] = "gone"
        with pytest.raises(ValueError, match="repeat"):  # the new list would name 127.0.0.1:2 twice
            client.replace_daemon("127.0.0.1:1", "127.0.0.1:2")
        assert client.daemons == ["127.0.0.1:1", "127.0.0.1:2"]  # nothing changed
    finally:
        client.close()
