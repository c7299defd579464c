"""BlockGradients' pushes, with stand-ins for the wire: the time the caller waits for pushes
(the window of gradients full, or the step draining them) is counted, and only that."""

from __future__ import annotations

import threading

import torch
from torch import nn

from ps_offload.proto.plan import ShardSlice
from ps_offload.trainer.io import shard_io
from ps_offload.trainer.stream.grads import BlockGradients
from ps_offload.trainer.stream.units import stream_units


class GatedDaemon:
    """Pushes wait until `gate` is set."""

    model = "stand-in"

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.pushed: list[int] = []

    def batches(self, shards):
        return [list(range(len(shards)))]

    def push_batch(self, shards, pushes):
        assert self.gate.wait(timeout=60)
        self.pushed.extend(shard.shard_id for shard in shards)
        return [None] * len(shards)


class HostMover:
    gradient_encoding = 0

    def mark_compute(self) -> None:
        return None

    def in_place(self, buffer, shard):
        return memoryview(buffer[shard.offset : shard.end].numpy()).cast("B")


class Io:
    workers = 2

    def __init__(self, pushes: set[int]) -> None:
        self.pushes = pushes

    def counted(self, result, nbytes):
        return result


def _gradients(window_units: int):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    units, _ = stream_units(model, list(model), torch.device("cpu"))
    for unit in units:
        unit.shards = [ShardSlice(unit.index, 0, unit.start, unit.numel)]
    daemon = GatedDaemon()
    grads = BlockGradients(
        units, client=daemon, mover=HostMover(), io=Io({u.index for u in units}),
        window_bytes=window_units * units[0].nbytes,
    )  # fmt: skip
    return units, daemon, grads


def _push(grads: BlockGradients, unit) -> None:
    for i, p in enumerate(unit.params):
        grads.add(unit, i, torch.ones_like(p), norm_index=None)
    grads.push(unit, step=0, part=0, groups=None)


def test_a_full_window_of_gradients_waits_for_the_oldest_pushes_and_counts_the_wait(monkeypatch):
    units, daemon, grads = _gradients(window_units=1)
    real_wait = shard_io.wait

    def wait_then_open(futures):  # the pushes may finish only once the caller is waiting
        daemon.gate.set()
        return real_wait(futures)

    monkeypatch.setattr(shard_io, "wait", wait_then_open)
    _push(grads, units[0])
    assert grads.wait_seconds == 0  # one unit's gradient fits the window: no wait
    _push(grads, units[1])  # two do not: the first unit's pushes are waited for
    assert units[0].index in daemon.pushed  # (the second's may land first: the pool runs both)
    assert len(grads._pushes) == 1
    waited = grads.wait_seconds
    assert waited > 0
    for future in grads._pushes[0][0]:
        future.result(timeout=60)  # the second unit's push is done before the drain
    assert grads.drain() == []
    assert grads.wait_seconds == waited  # nothing left to wait for: nothing counted
    assert sorted(daemon.pushed) == [units[0].index, units[1].index]
    grads.close()
