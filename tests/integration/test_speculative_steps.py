"""Steps computed while backward still runs (push_in_backward, PushHeader.speculate): each
shard's part 0 carries the settings step() is expected to send, the daemon steps a spare copy
of the shard with them at once, and the APPLY adopts it or, when it names other settings (a
clip that fired, an lr changed after backward), computes the step again from the held part.
Either way the result is torch's, bit for bit; the daemons' counters say which way each step
went, so these tests fail if the speculation stops running or stops being redone."""

from __future__ import annotations

import copy

import grpc
import pytest
import torch

from ps_offload import trainer
from ps_offload.proto import ps_pb2, ps_pb2_grpc
from tests.helpers import mixed_precision as mixed


def _reference(model, batches, max_norm: float, lr_after_backward: dict[int, float]):
    """In process: fp32 masters and fused AdamW; the clip as opt.clip_grad_norm_ takes it
    (torch's norm and coefficient over the model's gradients, the product in fp32)."""
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    by_id = {id(p): m for p, m in zip(params, masters, strict=True)}
    groups = [
        {**g, "params": [by_id[id(p)] for p in g["params"]]} for g in mixed.param_groups(model.named_parameters())
    ]
    opt = torch.optim.AdamW(groups, lr=mixed.LR, fused=True)
    for step, batch in enumerate(batches):
        model.zero_grad()
        mixed.loss(model, batch).backward()
        total = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0).float()
        for p, m in zip(params, masters, strict=True):
            m.grad = p.grad.float() * coefficient
        for group in opt.param_groups:
            group["lr"] = lr_after_backward.get(step, group["lr"])
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters, strict=True):
                p.copy_(m)
    return masters


def _speculative(daemons) -> tuple[int, int]:
    """(adopted, redone), over the daemons."""
    adopted = redone = 0
    for daemon in daemons:
        with grpc.insecure_channel(daemon.address) as channel:
            stats = ps_pb2_grpc.AdminStub(channel).Stats(ps_pb2.StatsRequest(), timeout=10)
        adopted, redone = adopted + stats.speculative_steps, redone + stats.speculative_redone
    return adopted, redone


def _train_unclipped(model, reference, batches, masters, daemons) -> int:
    """Trains with opt.clip_grad_norm_ at a norm never reached, checks the result is the
    reference's, and returns the number of shards."""
    with mixed.offload_pushing_in_backward(model, daemons) as opt:
        for batch in batches:
            opt.zero_grad()
            mixed.loss(model, batch).backward()
            opt.clip_grad_norm_(1e9)
            opt.step()
        opt.synchronize()
        mixed.assert_same(model, reference, opt, masters)
        return len(opt.plan)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("max_norm", "lr_moves", "outcome"),
    [(1e9, False, "adopted"), (1e-3, False, "redone"), (1e9, True, "mixed")],
    ids=["clip-idle", "clip-fires", "lr-set-after-backward"],
)
def test_steps_computed_during_backward_are_torchs_whether_adopted_or_redone(
    dtype, max_norm, lr_moves, outcome, daemon_factory
):
    model, batches = mixed.case(dtype)
    reference = copy.deepcopy(model)
    # On odd steps the user sets the lr between backward and step(): those parts were
    # computed with the old one, and must be redone.
    lr_after_backward = {s: mixed.LR * (1 + s) for s in range(1, len(batches), 2)} if lr_moves else {}
    masters = _reference(reference, batches, max_norm, lr_after_backward)
    daemons = daemon_factory.together([(), ()])
    with mixed.offload_pushing_in_backward(model, daemons) as opt:
        for step, batch in enumerate(batches):
            opt.zero_grad()
            mixed.loss(model, batch).backward()
            opt.clip_grad_norm_(max_norm)
            for group in opt.param_groups:
                group["lr"] = lr_after_backward.get(step, group["lr"])
            opt.step()
        opt.synchronize()
        mixed.assert_same(model, reference, opt, masters)
        steps = len(batches) * len(opt.plan)
    adopted, redone = _speculative(daemons)
    moved = len(lr_after_backward) * len(opt.plan)
    expected = {"adopted": (steps, 0), "redone": (0, steps), "mixed": (steps - moved, moved)}[outcome]
    assert (adopted, redone) == expected


def test_a_daemon_without_room_for_spares_applies_at_the_apply_with_the_same_result(daemon_factory, tmp_path):
    config = tmp_path / "no-spares.toml"
    config.write_text("[store]\nspeculation_bytes = 0\n")
    model, batches = mixed.case(torch.float32)
    reference = copy.deepcopy(model)
    masters = _reference(reference, batches, 1e9, {})
    daemons = [daemon_factory(config=config)]
    _train_unclipped(model, reference, batches, masters, daemons)
    assert _speculative(daemons) == (0, 0)


def test_on_nvme_a_shard_evicted_between_its_speculation_and_its_apply_adopts_it(daemon_factory, tmp_path):
    """A RAM tier of 16 KiB holds about one shard: each is evicted after its part is stepped
    ahead and read back from disk for the APPLY; its committed version is the pre-step state
    the speculation started from, so adopting it is still exact."""
    model, batches = mixed.case(torch.bfloat16)
    reference = copy.deepcopy(model)
    masters = _reference(reference, batches, 1e9, {})
    daemons = [daemon_factory("--nvme-dir", str(tmp_path / "nvme"), "--create-nvme-dir", "--ram-bytes", "16KiB")]
    shards = _train_unclipped(model, reference, batches, masters, daemons)
    assert _speculative(daemons) == (len(batches) * shards, 0)


def test_a_loss_scale_overflow_redoes_nothing_and_skips_the_step(daemon_factory):
    """fp16: the parts are computed ahead with 1/scale; an overflow skips the step (no APPLY),
    the next step is pushed whole, and that discards what was computed ahead."""
    model, batches = mixed.case(torch.float16)
    reference = copy.deepcopy(model)
    scaling = trainer.LossScaling(growth_interval=3)
    masters, _, _ = mixed.train_reference(reference, batches, scaler=scaling, overflow_at=4)
    daemons = [daemon_factory()]
    with mixed.offload_pushing_in_backward(model, daemons, loss_scaling=scaling) as opt:
        for step, batch in enumerate(batches):
            opt.zero_grad()
            opt.scale_loss(mixed.loss(model, batch)).backward()
            if step == 4:
                opt.params[0].grad.view(-1)[3] = float("inf")
            opt.step()
        opt.synchronize()
        mixed.assert_same(model, reference, opt, masters)
        shards = len(opt.plan)
    adopted, redone = _speculative(daemons)
    # Step 4's parts were computed ahead and never applied; step 5 went whole (discarding
    # them); every other step was adopted.
    assert (adopted, redone) == ((len(batches) - 2) * shards, shards)
