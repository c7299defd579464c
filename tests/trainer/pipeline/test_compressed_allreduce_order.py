"""trainer/pipeline/compressed_allreduce.py issues every collective from the calling thread, in one fixed
order (A2A 0, AG 0, A2A 1, AG 1, ...), asynchronously: collectives on one communicator issued
from two threads could be interleaved differently on two ranks and hang (NCCL; gloo's tags
would mismatch). A stand-in for torch.distributed (a group of 2 seen from rank 0, each rank
sending the same bytes) records what was issued, from which thread, in which order; the real
collectives over gloo are in test_compressed_allreduce.py."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from ps_offload.trainer.pipeline import compressed_allreduce
from ps_offload.trainer.pipeline.compressed_allreduce import CompressedAllReduce

SIZES = (3000, 1000, 5000)


class _Work:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def wait(self) -> None:
        self.log.append(("wait", self.name, threading.current_thread().name))


@pytest.fixture
def issued(monkeypatch) -> list:
    log: list = []
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)

    def all_to_all_single(recv, send, group=None, async_op=False):
        assert async_op, "the all-to-all blocked the calling thread"
        room = send.numel() // 2
        recv.copy_(send[:room].repeat(2))  # rank 1 sent what rank 0 did
        name = f"A2A {len(log)}"
        log.append(("issue", name, threading.current_thread().name))
        return _Work(log, name)

    def all_gather(gathered, mine, group=None, async_op=False):
        assert async_op, "the all-gather blocked the calling thread"
        gathered.copy_(mine.repeat(2))
        name = f"AG {len(log)}"
        log.append(("issue", name, threading.current_thread().name))
        return _Work(log, name)

    monkeypatch.setattr(dist, "all_to_all_single", all_to_all_single)
    monkeypatch.setattr(compressed_allreduce, "_all_gather", all_gather)
    return log


def _buckets() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=g) for n in SIZES]


@pytest.mark.parametrize("overlap", [True, False])
def test_collectives_come_from_the_calling_thread_in_a_fixed_order(issued, overlap):
    hook = CompressedAllReduce("bf16", backend="torch", overlap=overlap)
    buckets = _buckets()
    handles = [hook(bucket, None) for bucket in buckets]
    if overlap:
        # Phase 1 of each bucket at its hook, phase 2 of the one before it at the next hook.
        kinds = [name.split()[0] for what, name, _ in issued if what == "issue"]
        assert kinds == ["A2A", "AG", "A2A", "AG", "A2A"]
        for handle in handles:
            handle.wait()
        handles[0].wait()  # twice: nothing more
    else:
        assert handles == [None, None, None]
    collectives = [name.split()[0] for what, name, _ in issued if what == "issue"]
    assert collectives == ["A2A", "AG"] * len(SIZES)
    # Every work is waited for once; each all-gather is issued after its all-to-all's wait.
    events = [(what, name) for what, name, _ in issued]
    names = [name for what, name in events if what == "issue"]
    assert sorted(name for what, name in events if what == "wait") == sorted(names)
    for to_all, gather in zip(names[::2], names[1::2], strict=True):
        assert events.index(("wait", to_all)) < events.index(("issue", gather)), events
    assert {thread for _, _, thread in issued} == {threading.current_thread().name}
    hook.close()


def test_the_result_is_the_same_with_and_without_overlap(issued):
    """Only the moments the phases are issued at differ. Rank 0's own chunk (the first) is the
    sum of two ranks that sent the same bf16 values: twice them, exactly."""
    results = []
    for overlap in (True, False):
        hook = CompressedAllReduce("bf16", backend="torch", overlap=overlap)
        buckets = _buckets()
        for handle in [hook(bucket, None) for bucket in buckets]:
            if handle is not None:
                handle.wait()
        results.append(buckets)
    for ours, inline, original in zip(*results, _buckets(), strict=True):
        assert torch.equal(ours, inline)
        chunk = -(-original.numel() // 2048) * 1024  # ceil(n / (W x BLOCK)) x BLOCK
        assert torch.equal(ours[:chunk], 2 * original[:chunk].to(torch.bfloat16).float())
