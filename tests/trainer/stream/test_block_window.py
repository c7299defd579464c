"""BlockWindow's pulls, with a stand-in for the wire: what autograd sees of a block pulled
again (its version counter), the window's bound on prefetch, and the time the caller waited
for pulls."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from ps_offload.proto.plan import ShardSlice
from ps_offload.trainer.io import shard_io
from ps_offload.trainer.stream.units import stream_units
from ps_offload.trainer.stream.window import BlockWindow


class ConcurrentWrites:
    """A mover whose pulls of one unit's shards write at the same moment (a barrier), each
    bumping the unit's version counter as a staged copy does."""

    wire_dtype = 0

    def __init__(self, parties: int) -> None:
        self.barrier = threading.Barrier(parties)

    def mark_compute(self) -> None:
        return None

    def in_place(self, buffer, shard) -> None:
        return None  # staged: a task per shard, each copying up

    def pull(self, buffer, shard, after, fill) -> int:
        version = fill(memoryview(b""))
        self.barrier.wait(timeout=30)
        with torch.no_grad():
            buffer[shard.offset : shard.end].fill_(1.0)  # an in-place write: the counter moves
        self.barrier.wait(timeout=30)
        return version


class Daemon:
    model = "stand-in"

    def __init__(self) -> None:
        self.hinted: list[list[int]] = []

    def pull(self, shard, *, min_version, out, dtype) -> int:
        return min_version

    def hint(self, shard_ids: list[int]) -> None:
        self.hinted.append(shard_ids)


def _window(shards_per_unit: int, window_bytes: int = 1 << 20):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    units, _ = stream_units(model, list(model), torch.device("cpu"))
    for unit in units:
        size = unit.numel // shards_per_unit
        cuts = [unit.start + i * size for i in range(shards_per_unit)] + [unit.end]
        first = unit.index * shards_per_unit  # shard ids unique across units
        unit.shards = [ShardSlice(first + i, 0, a, b - a) for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False))]
    pool = ThreadPoolExecutor(max_workers=shards_per_unit)
    window = BlockWindow(
        units, client=Daemon(), mover=ConcurrentWrites(shards_per_unit), pool=pool, window_bytes=window_bytes,
        prefetch=True,
    )  # fmt: skip
    return model, units, window, pool


def test_a_pulled_block_keeps_the_version_autograd_saved():
    """A block's shards pulled at once, each write bumping the counter: once the block is
    ready, its counter (shared by the views autograd saved) is what it was before the pulls,
    so backward through the pulled-again block raises no in-place error."""
    model, units, window, pool = _window(shards_per_unit=3)
    unit = units[1]
    x = torch.randn(2, 8, requires_grad=True)
    window.ready(unit)
    before = unit.values._version
    y = model[1](x).square().sum()  # saves the weight for backward
    window.release(unit)
    window.ready(unit)  # pulled again, three writes at once
    assert unit.values._version == before
    y.backward()  # would raise "modified by an inplace operation" if the counter had moved
    assert torch.equal(unit.values, torch.ones_like(unit.values))
    window.release(unit)
    pool.shutdown()


def test_prefetch_stays_within_the_window():
    _, units, window, pool = _window(shards_per_unit=1, window_bytes=2 * units_bytes())
    window.record(units[0])
    window.ready(units[0])
    window.prefetch(units[0], forward=True)
    assert window.stats["peak_block_bytes"] <= 2 * units[0].nbytes
    assert window.stats["prefetched"] == 1  # the next block; the one after does not fit
    for unit in units:
        window.release(unit)
    pool.shutdown()


def units_bytes() -> int:
    return (8 * 8 + 8) * 4  # one nn.Linear(8, 8) in fp32


def test_backward_hints_the_block_past_the_window_once_a_backward():
    """In backward, the window (one block here) holds the next block; the one past it is
    hinted to the daemons, so they load its arenas from disk before its pull, once until the
    step ends."""
    _, units, window, pool = _window(shards_per_unit=1, window_bytes=2 * units_bytes())
    for unit in units:
        window.record(unit)
    window.fix_order()
    window.ready(units[2])
    window.prefetch(units[2], forward=False)  # fetches units[1]; units[0] does not fit: hinted
    window.prefetch(units[2], forward=False)  # said once
    window.release(units[1])
    pool.submit(lambda: None).result()  # the pool (one thread) has run the hint before this
    assert window.client.hinted == [[s.shard_id for s in units[0].shards]]
    window.prefetch_first()  # a step ended: the next backward hints again
    assert not window._hinted
    for unit in units:
        window.release(unit)
    pool.shutdown()


class GatedPulls:
    """A mover whose pulls wait until `gate` is set."""

    wire_dtype = 0

    def __init__(self) -> None:
        self.gate = threading.Event()

    def mark_compute(self) -> None:
        return None

    def in_place(self, buffer, shard) -> None:
        return None  # staged: a task per shard, each copying up

    def pull(self, buffer, shard, after, fill) -> int:
        assert self.gate.wait(timeout=60)
        return fill(memoryview(b""))


def test_the_wait_for_a_pull_not_done_is_counted_and_a_done_one_costs_nothing(monkeypatch):
    """ready() on a block whose pull is still on the wire counts the wait in
    stats["pull_wait_seconds"]; on one whose pull finished first, it counts nothing."""
    _, units, window, pool = _window(shards_per_unit=1)
    window.mover = mover = GatedPulls()
    real_wait = shard_io.wait

    def wait_then_open(futures):  # the pull may finish only once the caller is waiting for it
        mover.gate.set()
        return real_wait(futures)

    monkeypatch.setattr(shard_io, "wait", wait_then_open)
    window.ready(units[0])
    waited = window.stats["pull_wait_seconds"]
    assert waited > 0
    for future in window.fetch(units[1]):  # the gate is open: this pull finishes before ready()
        future.result(timeout=60)
    window.ready(units[1])
    assert window.stats["pull_wait_seconds"] == waited
    for unit in units:
        window.release(unit)
    pool.shutdown()
