"""OffloadConfig(push_in_backward=True): each shard's gradient leaves during backward as a
GRADIENT_PART and step() applies it, with the same result, bit for bit, as pushing after
backward: when the gradients change after backward (clip_grad_norm_) or a second backward
runs before step(), step() sends them whole instead."""

from __future__ import annotations

import copy

import pytest
import torch

from ps_offload import trainer
from tests.helpers import mixed_precision as mixed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("transport", ["local", "tcp", "grpc"], ids=["local", "data-plane", "grpc"])
def test_pushing_during_backward_trains_exactly_as_pushing_after(dtype, transport, daemon_factory):
    model, batches = mixed.case(dtype)
    reference = copy.deepcopy(model)
    scaling = trainer.LossScaling(growth_interval=3) if dtype == torch.float16 else None
    # fp16: an overflow at step 4 skips a step whose parts were already pushed.
    overflow_at = 4 if scaling else -1
    masters, _, _ = mixed.train_reference(reference, batches, scaler=scaling, overflow_at=overflow_at)
    daemons = daemon_factory.together([(), ()])
    with mixed.offload_pushing_in_backward(
        model, daemons, loss_scaling=scaling, client=trainer.ClientConfig(transport=transport)
    ) as opt:
        early = []
        for step, batch in enumerate(batches):
            opt.zero_grad()
            loss = mixed.loss(model, batch)
            opt.scale_loss(loss).backward()
            # Every shard's gradient left during backward, before step().
            early.append(sorted(opt._backward_pushes.parts) == [s.shard_id for s in opt.plan])
            if scaling is None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # changes them: sent again whole
            if step == overflow_at:
                opt.params[0].grad.view(-1)[3] = float("inf")
            opt.step()
        opt.synchronize()
        assert all(early)
        mixed.assert_same(model, reference, opt, masters)


@pytest.mark.parametrize("transport", ["local", "tcp", "grpc"], ids=["local", "data-plane", "grpc"])
def test_the_optimizers_clip_keeps_the_early_parts_and_equals_torchs_clip(transport, daemon_factory):
    """opt.clip_grad_norm_ leaves the gradients alone and has the daemons multiply by the
    coefficient: the parts pushed during backward stay usable, and for fp32 the result is
    torch's clip_grad_norm_ and fused AdamW, bit for bit."""
    model, batches = mixed.case(torch.float32)
    reference = copy.deepcopy(model)
    masters, _, _ = mixed.train_reference(reference, batches)  # clips with torch's clip_grad_norm_(1.0)
    daemons = daemon_factory.together([(), ()])
    with mixed.offload_pushing_in_backward(model, daemons, client=trainer.ClientConfig(transport=transport)) as opt:
        used = []
        for batch in batches:
            opt.zero_grad()
            mixed.loss(model, batch).backward()
            norm = opt.clip_grad_norm_(1.0)
            assert norm > 0
            # Still the gradients backward left: every early part is used (an APPLY each).
            used.append(set(opt._backward_pushes.usable_parts()) == {s.shard_id for s in opt.plan})
            opt.step()
        opt.synchronize()
        assert all(used)
        mixed.assert_same(model, reference, opt, masters)


def test_parts_are_used_only_while_the_gradients_are_what_backward_left(daemon_factory):
    model, batches = mixed.case(torch.float32)
    daemons = [daemon_factory()]
    with mixed.offload_pushing_in_backward(model, daemons) as opt:
        pushes = opt._backward_pushes

        def backward(batch) -> None:
            mixed.loss(model, batch).backward()

        opt.zero_grad()
        backward(batches[0])
        assert set(pushes.usable_parts()) == {s.shard_id for s in opt.plan}
        assert all(f.result().applied for f in pushes.parts.values())  # held by the daemon, not applied
        opt.step()
        assert opt.step_count == 1

        opt.zero_grad()
        backward(batches[1])
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        assert pushes.usable_parts() == {}  # clipped after its parts left
        opt.step()

        opt.zero_grad()
        backward(batches[2])
        backward(batches[3])  # accumulation: the parts hold only the first backward
        assert pushes.usable_parts() == {}
        opt.step()
        assert opt.step_count == 3


def test_push_in_backward_is_refused_where_it_cannot_work():
    with pytest.raises(ValueError, match="needs staleness=0"):
        trainer.OffloadConfig(push_in_backward=True, staleness=1)
    with pytest.raises(ValueError, match="not with compression"):
        trainer.offload(
            torch.nn.Linear(4, 4), daemons=["127.0.0.1:1"], optimizer=trainer.AdamW(),
            config=trainer.OffloadConfig(push_in_backward=True),
            compression=trainer.CompressionConfig(method="bf16"),
        )  # fmt: skip
