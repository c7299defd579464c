"""Streaming under faults, through real daemons: a streamed TinyGPT (3 blocks, fp32, 3 steps of
3 micro-batches) ends bit-identical to the uninterrupted in-process run of
tests/helpers/streamed_gpt.py when

* a daemon is SIGKILLed between micro-batches and restarted on its port and NVMe files: the
  step's parts it held are gone, `step()` raises StepLost, and the training loop, written as a
  user writes it, runs the step's micro-batches again on the same data;
* a push is delivered but its answer lost, so the client sends it again: the daemon says the
  resent part (or APPLY) was not applied, and nothing is added twice;
* the user calls zero_grad() between micro-batches (refused, changing nothing) or step() with
  no backward since the last one (nothing is stepped).
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import grpc
import pytest
import torch

from ps_offload import trainer
from ps_offload.daemon.local import LocalDaemon
from ps_offload.proto import ps_pb2
from ps_offload.trainer.debug_models import TinyGPT
from tests.helpers.streamed_gpt import CONFIG, LR, copy_init, gpt_batches, train_in_process
from tests.helpers.training import no_decay

MICRO = 3
CLIENT = trainer.ClientConfig(retry_seconds=30.0, backoff_seconds=0.05)


def _streamed(daemons: list[str], name: str) -> tuple[TinyGPT, trainer.StreamedOptimizer]:
    """A meta TinyGPT streamed one block at a time, initialised as the reference is."""
    initial, _, _ = train_in_process(torch.float32, [])
    with torch.device("meta"):
        model = TinyGPT(CONFIG)
    block_bytes = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    stream = trainer.Streaming(
        blocks=list(model.blocks), window_bytes=block_bytes, init=copy_init(initial, model), device="cpu"
    )
    opt = trainer.offload(
        model, daemons=daemons, optimizer=trainer.AdamW(lr=LR, weight_decay=1e-2), no_weight_decay=no_decay,
        config=trainer.OffloadConfig(model_name=name, shard_bytes=4096), stream=stream, client=CLIENT,
    )  # fmt: skip
    return model, opt


def _assert_equal(final: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert final.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(final[key], value), f"{key}: max |diff| {(final[key] - value).abs().max().item()}"


def _versions(opt: trainer.StreamedOptimizer) -> list[int]:
    """Every shard's version as its daemon reports it."""
    out = torch.empty(max(s.numel for s in opt.plan))
    return [opt.client.pull(s, min_version=0, out=memoryview(out[: s.numel].numpy()).cast("B")) for s in opt.plan]


class Acks:
    """The answers to the optimizer's pushes (kind, step, part, shard id -> PushResponse), as
    its ShardedClient returns them, and a condition to wait on them."""

    def __init__(self, opt: trainer.StreamedOptimizer) -> None:
        self.seen: dict[tuple[int, int, int, int], ps_pb2.PushResponse] = {}
        self.cond = threading.Condition()
        push, push_batch = opt.client.push, opt.client.push_batch

        def recorded(shard, sent, **carried):
            ack = push(shard, sent, **carried)
            self._seen([(shard, sent, ack)])
            return ack

        def recorded_batch(shards, pushes):  # a daemon's pushes in one batch (the local transport)
            acks = push_batch(shards, pushes)
            self._seen([x for x in zip(shards, pushes, acks, strict=True) if isinstance(x[2], ps_pb2.PushResponse)])
            return acks

        opt.client.push = recorded
        opt.client.push_batch = recorded_batch

    def _seen(self, answered: list) -> None:
        with self.cond:
            for shard, sent, ack in answered:
                header = sent.header
                self.seen[header.kind, header.step, header.part, shard.shard_id] = ack
            self.cond.notify_all()

    def wait_parts(self, step: int, part: int, shards: int) -> None:
        """Until every shard's part `part` of `step` is acknowledged."""
        key = (ps_pb2.GRADIENT_PART, step, part)
        with self.cond:
            done = self.cond.wait_for(lambda: sum(k[:3] == key for k in self.seen) == shards, timeout=30)
        assert done, f"part {part} of step {step} not acknowledged by every shard"


def _train(model, opt, batches, between=lambda step, micro: None) -> tuple[list[float], list[str]]:
    """The loop a user writes: each step's micro-batches, then step(); StepLost: the same
    micro-batches again. `between(step, micro)` runs after each backward. Returns the losses of
    the attempts that stepped, and each StepLost's message."""
    losses, lost = [], []
    for step, micro_batches in enumerate(batches):
        while True:
            attempt = []
            try:
                for micro, (idx, targets) in enumerate(micro_batches):
                    _, loss = model(idx, targets)
                    (loss / len(micro_batches)).backward()
                    attempt.append(loss.item())
                    between(step, micro)
                opt.step()
                break
            except trainer.StepLost as error:
                lost.append(str(error))
        opt.zero_grad()
        losses += attempt
    return losses, lost


@pytest.mark.parametrize(
    "after,lost_at,why",
    [
        (1, "a part's push", "part 2 of step 1 is out of order"),
        (MICRO - 1, "the check before APPLY", "the daemon holds 0 parts of that step"),
    ],
    ids=["between-micro-batches", "before-apply"],
)  # fmt: skip
def test_daemon_killed_mid_step_the_step_is_run_again(tmp_path: Path, monkeypatch, after, lost_at, why):
    """Two daemons, the second with an NVMe tier. In step 1, once micro-batch `after`'s parts
    are acknowledged, the second is SIGKILLed and restarted on its port and files: it recovers
    version 1 and has lost step 1's parts. Killed after micro-batch 1, micro-batch 2's part is
    out of order there, so step() raises StepLost for the part's push, before any APPLY; the
    loop runs step 1 again, the first daemon acknowledging the parts it holds without adding
    them again. Killed after the last micro-batch, the check every daemon answers before any
    applies (APPLY check_only) finds the loss, so no daemon has applied step 1 either."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nvme = tmp_path / "nvme"
    kept = LocalDaemon(tmp_path / "kept")
    killed = [LocalDaemon(tmp_path / "killed", "--nvme-dir", str(nvme))]
    try:
        batches = gpt_batches(MICRO)
        _, expected, expected_losses = train_in_process(torch.float32, batches)
        model, opt = _streamed([kept.address, killed[0].address], "faults-kill")
        acks = Acks(opt)
        assert {s.daemon_index for s in opt.plan} == {0, 1}

        def kill_once(step: int, micro: int) -> None:
            if (step, micro) != (1, after) or len(killed) > 1:
                return
            acks.wait_parts(1, after, len(opt.plan))  # the parts it holds, then loses
            killed[-1].process.send_signal(signal.SIGKILL)
            killed[-1].process.wait()
            port = killed[-1].port
            killed.append(LocalDaemon(tmp_path / "restarted", "--nvme-dir", str(nvme), "--listen", f"127.0.0.1:{port}"))
            assert "recovered" in killed[-1].log()

        with opt:
            losses, lost = _train(model, opt, batches, kill_once)
            assert opt.step_count == len(batches)
            final = opt.full_state_dict()
        assert len(killed) == 2
        assert len(lost) == 1 and lost[0].startswith(f"step 1 of 'faults-kill': {lost_at} failed"), lost
        assert why in lost[0]
        # The re-run step's forward saw the same weights: the same losses, the same final bits.
        assert losses == expected_losses
        _assert_equal(final, expected)
    finally:
        kept.kill()
        for daemon in killed:
            daemon.kill()


class LostAnswer(grpc.RpcError):
    """What the client sees when a push arrived but its answer did not."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return "the answer was lost (injected by the test)"


def _lose_answers(opt: trainer.StreamedOptimizer, chosen: set[tuple[int, int, int, int]]) -> list:
    """For each chosen push (kind, step, part, shard id), the first attempt reaches the daemon
    and is applied, but the client is told it timed out (alone, or in its batch's answer); the
    client then sends the same push again, alone. Returns the (key, first answer, resent
    answer) of each, filled as they happen."""
    resent, pending = [], set(chosen)

    def lost(sent, ack) -> bool:
        header = sent.header
        if header.check_only:  # the check before the APPLYs: not one of the chosen
            return False
        key = (header.kind, header.step, header.part, header.shard_id)
        if key in pending:
            pending.discard(key)
            resent.append([key, ack])
            return True
        if key in chosen:
            resent[[k for k, *_ in resent].index(key)].append(ack)
        return False

    for transport in opt.client.transports:
        push, push_batch = transport.push, getattr(transport, "push_batch", None)

        def losing(sent, *, timeout, pull_into=None, _push=push):
            ack = _push(sent, timeout=timeout, pull_into=pull_into)
            if lost(sent, ack):
                raise LostAnswer()
            return ack

        def losing_batch(pushes, *, timeout, _push_batch=push_batch):
            acks = _push_batch(pushes, timeout=timeout)
            if acks is None:
                return None
            return [LostAnswer() if lost(sent, ack) else ack for sent, ack in zip(pushes, acks, strict=True)]

        transport.push = losing
        if push_batch is not None:
            transport.push_batch = losing_batch
    return resent


def test_a_push_whose_answer_was_lost_is_resent_and_not_added_twice(daemons):
    """On real daemons, with the answer lost to: part 0 of one shard (the part that starts a
    step's sum), the last part of another, and an APPLY of a third, in step 1. Each is sent
    again by the client's retry; the daemon answers `applied == False`, and the run equals
    the reference bit for bit."""
    batches = gpt_batches(MICRO)
    _, expected, expected_losses = train_in_process(torch.float32, batches)
    model, opt = _streamed(daemons, "faults-lost-answer")
    shards = [s.shard_id for s in opt.plan]
    chosen = {
        (ps_pb2.GRADIENT_PART, 1, 0, shards[0]),
        (ps_pb2.GRADIENT_PART, 1, MICRO - 1, shards[len(shards) // 2]),
        (ps_pb2.APPLY, 1, 0, shards[-1]),
    }
    resent = _lose_answers(opt, chosen)
    with opt:
        losses, lost = _train(model, opt, batches)
        final = opt.full_state_dict()
    assert lost == []
    assert {key for key, *_ in resent} == chosen
    for (kind, step, part, shard_id), first, again in resent:
        where = f"{ps_pb2.PushKind.Name(kind)} {part} of step {step}, shard {shard_id}"
        assert first.applied and not again.applied, where
        assert again.version == first.version == (step + 1 if kind == ps_pb2.APPLY else step), where
    assert losses == expected_losses
    _assert_equal(final, expected)


def test_zero_grad_between_micro_batches_is_refused_and_a_step_without_backward_steps_nothing(daemons):
    """zero_grad() after a micro-batch is refused (its parts are on the daemons already) and
    changes nothing; step() right after a step moves no version; the run still equals the
    reference."""
    batches = gpt_batches(MICRO)
    _, expected, _ = train_in_process(torch.float32, batches)
    model, opt = _streamed(daemons, "faults-zero-grad")

    def refuse_zero_grad(step: int, micro: int) -> None:
        with pytest.raises(RuntimeError, match=rf"zero_grad\(\) after {micro + 1} backward passes without step\(\)"):
            opt.zero_grad()

    with opt:
        opt.zero_grad()  # before any backward: nothing to refuse
        _train(model, opt, batches[:1], refuse_zero_grad)
        before = opt.full_state_dict()
        assert opt.step_count == 1 and set(_versions(opt)) == {1}
        assert opt.step() is None  # no backward since the last step
        assert opt.step_count == 1 and set(_versions(opt)) == {1}
        _assert_equal(opt.full_state_dict(), before)
        _train(model, opt, batches[1:], refuse_zero_grad)
        final = opt.full_state_dict()
    _assert_equal(final, expected)
