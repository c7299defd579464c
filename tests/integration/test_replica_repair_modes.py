"""A replicated model's lost daemon is repaired between steps in the step modes that push
during backward too: OffloadConfig(push_in_backward=True), whose next parts go out before
step(), is caught up at the end of the step before (OffloadOptimizer.step), and a streamed
model (StreamedOptimizer.step) likewise. Either way training ends bit for bit where the
in-process reference ends, with every shard on both its holders again."""

from __future__ import annotations

import logging

import torch

from ps_offload import trainer
from ps_offload.trainer.debug_models import TinyGPT
from tests.helpers.persistence_run import (
    assert_same_parameters,
    classifier_case,
    classifier_loss,
    fused_adamw_reference,
)
from tests.helpers.replication import DEAD_PEER_SECONDS, lose_for_good, nvme_daemons, replicas_report
from tests.helpers.streamed_gpt import CONFIG, copy_init, train_in_process
from tests.helpers.training import no_decay

LOST_AT, REPLACED_AT, STEPS = 2, 4, 8


def _client() -> trainer.ClientConfig:
    return trainer.ClientConfig(dead_peer_seconds=DEAD_PEER_SECONDS)


def _fresh_nvme(tmp_path) -> tuple[str, ...]:
    return ("--nvme-dir", str(tmp_path / "nvme-new"), "--create-nvme-dir")


class LossThenReplacement:
    """Daemon 1 lost for good before step LOST_AT; before step REPLACED_AT, a replacement
    (`start()`) put in its place."""

    def __init__(self, opt, daemons, dirs, start) -> None:
        self.opt, self.daemons, self.dirs, self.start = opt, daemons, dirs, start
        self.replacement = None

    def before(self, step: int) -> None:
        if step == LOST_AT:
            lose_for_good(self.daemons[1], self.dirs[1])
        if step == REPLACED_AT:
            assert set(self.opt.client.holders.lost) == {1}
            self.replacement = self.start()
            self.opt.replace_daemon(self.daemons[1].address, self.replacement.address)


def test_pushes_in_backward_a_replacement_is_caught_up_at_the_end_of_a_step(daemon_factory, tmp_path, caplog):
    model, batches = classifier_case()
    batches = batches[:STEPS]
    reference = fused_adamw_reference(model, batches)
    daemons, dirs = nvme_daemons(daemon_factory, tmp_path)
    config = trainer.OffloadConfig(shard_bytes=4096, replicas=2, push_in_backward=True)
    opt = trainer.offload(
        model, daemons=[d.address for d in daemons], optimizer=trainer.AdamW(lr=1e-2, weight_decay=0.1),
        config=config, client=_client(),
    )  # fmt: skip
    events = LossThenReplacement(opt, daemons, dirs, lambda: daemon_factory(*_fresh_nvme(tmp_path)))
    with opt, caplog.at_level(logging.WARNING):
        for step, batch in enumerate(batches):
            events.before(step)
            opt.zero_grad()
            classifier_loss(model, batch).backward()  # pushes as each gradient is ready
            opt.step()
            if step == REPLACED_AT:
                assert not opt.client.holders.lost  # caught up before the next backward's parts
        opt.synchronize()
    said = [r.getMessage() for r in caplog.records]
    assert any("repaired" in m and events.replacement.address in m for m in said), said
    assert replicas_report(daemons[0].address)["degraded"] == 0
    assert_same_parameters(model, reference)


def test_a_streamed_model_gets_its_replacement_caught_up_between_steps(daemon_factory, tmp_path):
    g = torch.Generator().manual_seed(7)
    batches = [
        [(torch.randint(CONFIG.vocab_size, (2, CONFIG.block_size), generator=g),) * 2 for _ in range(2)]
        for _ in range(STEPS)
    ]  # two micro-batches a step: parts pushed in backward, applied at step()
    initial, expected, _ = train_in_process(torch.float32, batches)
    daemons, dirs = nvme_daemons(daemon_factory, tmp_path)
    with torch.device("meta"):
        model = TinyGPT(CONFIG)
    stream = trainer.Streaming(blocks=list(model.blocks), init=copy_init(initial, model), device="cpu")
    opt = trainer.offload(
        model, daemons=[d.address for d in daemons], optimizer=trainer.AdamW(lr=1e-2, weight_decay=1e-2),
        no_weight_decay=no_decay, config=trainer.OffloadConfig(shard_bytes=4096, replicas=2), stream=stream,
        client=_client(),
    )  # fmt: skip
    events = LossThenReplacement(opt, daemons, dirs, lambda: daemon_factory(*_fresh_nvme(tmp_path)))
    with opt:
        for step, micro_batches in enumerate(batches):
            events.before(step)
            for idx, targets in micro_batches:
                _, loss = model(idx, targets)
                (loss / len(micro_batches)).backward()
            opt.step()
            opt.zero_grad()
            if step == REPLACED_AT:
                assert not opt.client.holders.lost
        final = opt.full_state_dict()
    assert replicas_report(daemons[0].address)["degraded"] == 0
    for key, value in expected.items():
        assert torch.equal(final[key], value), key


def test_a_run_resumed_with_a_replacement_in_the_list_catches_it_up(daemon_factory, tmp_path, caplog):
    """The job restarted after a node was lost for good, its daemon list naming a replacement in
    the lost one's place: the run resumes from the other replicas (not refused as "state lost")
    and the replacement is caught up at the first step."""
    model, batches = classifier_case()
    batches = batches[:STEPS]
    reference = fused_adamw_reference(model, batches)
    daemons, dirs = nvme_daemons(daemon_factory, tmp_path)
    config = trainer.OffloadConfig(shard_bytes=4096, replicas=2)

    def run(addresses):
        optimizer = trainer.AdamW(lr=1e-2, weight_decay=0.1)
        return trainer.offload(model, daemons=addresses, optimizer=optimizer, config=config, client=_client())

    opt = run([d.address for d in daemons])
    with opt:
        for batch in batches[:LOST_AT]:
            opt.zero_grad()
            classifier_loss(model, batch).backward()
            opt.step()
        opt.synchronize()
    lose_for_good(daemons[1], dirs[1])
    replacement = daemon_factory(*_fresh_nvme(tmp_path))
    addresses = [daemons[0].address, replacement.address, daemons[2].address]
    with caplog.at_level(logging.WARNING):
        opt = run(addresses)
        with opt:
            assert opt.step_count == LOST_AT and set(opt.client.holders.lost) == {1}
            for batch in batches[LOST_AT:]:
                opt.zero_grad()
                classifier_loss(model, batch).backward()
                opt.step()
                assert not opt.client.holders.lost  # caught up before the first step's pushes
            opt.synchronize()
    said = [r.getMessage() for r in caplog.records]
    assert any("hold none of model" in m and replacement.address in m for m in said), said
    assert replicas_report(daemons[0].address)["degraded"] == 0
    assert_same_parameters(model, reference)


def test_a_replacement_that_dies_while_it_is_caught_up_stays_out_and_the_next_one_is_taken(
    daemon_factory, tmp_path, caplog
):
    """The replacement is killed at its second commit of the repair's copies (a STATE push):
    the step still completes on the live replicas, the replacement is left out again, and a
    second replacement is caught up; nothing is applied twice or lost."""
    from ps_offload.daemon.local import LocalDaemon

    model, batches = classifier_case()
    batches = batches[:STEPS]
    reference = fused_adamw_reference(model, batches)
    daemons, dirs = nvme_daemons(daemon_factory, tmp_path)
    doomed = LocalDaemon(
        tmp_path / "doomed", "--nvme-dir", str(tmp_path / "nvme-doomed"), "--create-nvme-dir",
        env={"PS_OFFLOAD_CRASH_AT": "header_synced@2"},
    )  # fmt: skip
    try:
        opt = trainer.offload(
            model, daemons=[d.address for d in daemons], optimizer=trainer.AdamW(lr=1e-2, weight_decay=0.1),
            config=trainer.OffloadConfig(shard_bytes=4096, replicas=2), client=_client(),
        )  # fmt: skip
        with opt, caplog.at_level(logging.WARNING):
            for step, batch in enumerate(batches):
                if step == LOST_AT:
                    lose_for_good(daemons[1], dirs[1])
                if step == LOST_AT + 1:
                    opt.replace_daemon(daemons[1].address, doomed.address)
                if step == REPLACED_AT + 1:
                    assert doomed.process.poll() is not None and set(opt.client.holders.lost) == {1}
                    replacement = daemon_factory(*_fresh_nvme(tmp_path))
                    opt.replace_daemon(doomed.address, replacement.address)
                opt.zero_grad()
                classifier_loss(model, batch).backward()
                opt.step()
            assert not opt.client.holders.lost
            opt.synchronize()
    finally:
        doomed.kill()
    said = [r.getMessage() for r in caplog.records]
    assert any(f"repairing daemon {doomed.address} failed" in m for m in said), said
    assert any("repaired" in m and replacement.address in m for m in said), said
    assert replicas_report(daemons[0].address)["degraded"] == 0
    assert_same_parameters(model, reference)
