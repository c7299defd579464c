"""Streaming changes nothing: a GPT built on the meta device and trained through real daemons
with only one block on the trainer at a time equals, bit for bit, the same GPT trained in
process the way torch users spell it (an fp32 master, torch.optim.AdamW(fused=True) on it,
the master cast back into the model's dtype).

With micro-batches the daemons add each block's gradients in fp32 (ps_daemon/store/accumulate.py),
so the reference accumulates as they do: each micro-batch's gradient, in the model's dtype,
widened and added into an fp32 sum in micro-batch order. For an fp32 model that is what
torch's own `.grad` accumulation computes; for bf16 it is more exact than a bf16 `.grad`.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from ps_offload import trainer
from ps_offload.trainer.debug_models import TinyGPT
from tests.helpers.streamed_gpt import CONFIG, LR, copy_init, gpt_batches, train_in_process
from tests.helpers.training import no_decay


class CheckpointedGPT(TinyGPT):
    """TinyGPT with each block's activations recomputed in backward."""

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        logits = self.head(self.ln_f(x))
        return logits, torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _streamed(
    daemons, name, dtype, batches, *, cls=TinyGPT, window_blocks=1, prefetch=True, staging="auto", micro_batches=0,
    clip=None, return_freed=None,
):  # fmt: skip
    initial, _, _ = train_in_process(dtype, batches[:0], cls)
    with torch.device("meta"):
        model = cls(CONFIG).to(dtype)
    block_bytes = sum(p.numel() for p in model.blocks[0].parameters()) * dtype.itemsize
    stream = trainer.Streaming(
        blocks=list(model.blocks), window_bytes=window_blocks * block_bytes, prefetch=prefetch,
        init=copy_init(initial, model), device="cpu", micro_batches=micro_batches, return_freed=return_freed,
    )  # fmt: skip
    opt = trainer.offload(
        model, daemons=daemons, optimizer=trainer.AdamW(lr=LR, weight_decay=1e-2), no_weight_decay=no_decay,
        config=trainer.OffloadConfig(model_name=name, shard_bytes=4096), stream=stream,
        device=trainer.DeviceConfig(staging=staging),
    )  # fmt: skip
    losses, norms = [], []
    with opt:
        for step_batches in batches:
            for idx, targets in step_batches:
                _, loss = model(idx, targets)
                (loss / len(step_batches)).backward()
                losses.append(loss.item())
                assert all(not u.allocated for u in opt.units if u.streamed), "a block stayed after backward"
            if clip is not None:
                norms.append(opt.clip_grad_norm_(clip))
            opt.step()
            opt.zero_grad()
        final = opt.full_state_dict()
        block_bytes = opt.units[1].nbytes
        assert opt.stats["peak_block_bytes"] <= max(window_blocks, 1) * block_bytes
        if prefetch and window_blocks > 1:
            assert opt.stats["prefetched"] > 0
        # step()'s APPLY rounds are timed where there are any (parts applied at step()).
        assert (opt.stats["apply_seconds"] > 0) == (micro_batches == 0)
        # The node's daemon, through windows of its pool by default: the blocks (a CPU model's)
        # and the staging buffers.
        assert opt.shared_blocks
        (region,) = {id(u.region): u.region for u in opt.units if u.streamed}.values()
        # Every fetch found a slot: as many as the window holds blocks, and the running one.
        assert region.stats["slot_fetches"] > 0 and region.stats["reserve_fetches"] == 0
        if staging == "always":
            assert opt.mover.buffers.shared
    return final, losses


@pytest.mark.parametrize(
    "dtype,micro,cls",
    [
        (torch.float32, 1, TinyGPT),
        (torch.float32, 3, TinyGPT),
        (torch.float32, 2, CheckpointedGPT),
        (torch.bfloat16, 1, TinyGPT),
        (torch.bfloat16, 3, CheckpointedGPT),
    ],
    ids=["fp32", "fp32-micro3", "fp32-micro2-checkpointed", "bf16", "bf16-micro3-checkpointed"],
)
def test_streamed_training_equals_in_process_bit_for_bit(daemons, dtype, micro, cls):
    batches = gpt_batches(micro)
    _, expected, expected_losses = train_in_process(dtype, batches, cls)
    name = f"stream-{str(dtype)[6:]}-{micro}-{cls.__name__}"
    final, losses = _streamed(daemons, name, dtype, batches, cls=cls)
    assert losses == expected_losses
    assert final.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(final[key], value), key


def test_prefetch_window_and_staged_copies_change_nothing(daemons):
    """A window of two blocks (so the next block is prefetched), and the accelerator's staged
    path through host buffers, give the same bits as the tests above."""
    batches = gpt_batches(2)
    _, expected, _ = train_in_process(torch.bfloat16, batches)
    final, _ = _streamed(daemons, "stream-window2", torch.bfloat16, batches, window_blocks=2, staging="always")
    for key, value in expected.items():
        assert torch.equal(final[key], value), key


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_backward_per_step_applies_each_block_as_it_is_pushed(daemons, dtype):
    """Streaming(micro_batches=1): GRADIENT pushes applied during backward, the same bits."""
    batches = gpt_batches(1)
    _, expected, _ = train_in_process(dtype, batches, CheckpointedGPT)
    final, _ = _streamed(daemons, f"stream-apply-{dtype}", dtype, batches, cls=CheckpointedGPT, micro_batches=1)
    for key, value in expected.items():
        assert torch.equal(final[key], value), key


def test_a_second_backward_is_refused_when_one_was_declared(daemons):
    initial, _, _ = train_in_process(torch.float32, [])
    with torch.device("meta"):
        model = TinyGPT(CONFIG)
    stream = trainer.Streaming(blocks=list(model.blocks), init=copy_init(initial, model), device="cpu", micro_batches=1)
    opt = trainer.offload(
        model, daemons=daemons, optimizer=trainer.AdamW(lr=LR),
        config=trainer.OffloadConfig(model_name="stream-one-pass", shard_bytes=4096), stream=stream,
    )  # fmt: skip
    with opt:
        ((idx, targets),) = gpt_batches(1)[0]
        model(idx, targets)[1].backward()
        with pytest.raises(RuntimeError, match="second forward for backward before step"):
            model(idx, targets)[1].backward()


@pytest.mark.parametrize(
    "return_freed, available, returned",
    [(True, None, True), (False, None, False), (None, 1 << 40, False), (None, 1 << 10, True), (None, None, True)],
)
def test_a_streamed_trainer_returns_what_it_frees_to_the_kernel_where_memory_is_short(
    daemons, monkeypatch, return_freed, available, returned
):
    """Its blocks sit in slots of a window shared with the daemon, and still a streamed
    trainer has glibc give back what a block's forward and backward free (widened weights,
    gradients, large activations; tests/ps_proto/test_memory.py tests the setting) when the
    host is short of memory: kept in the heap, they made the scale run's trainer grow with the
    model's depth, to 3.78 GiB at 54 blocks. Where memory is ample (the model's bytes within a
    quarter of MemAvailable) they stay in the heap, sparing a page fault per 4 KiB written
    (zero_infinity_large's trainer: 550k faults a step). Streaming.return_freed decides when
    set. Observed by a spy, because the setting is process-wide and this process's heap is
    the whole suite's."""
    from ps_offload.trainer.stream import optimizer

    calls = []
    monkeypatch.setattr(optimizer, "return_freed_blocks", lambda: calls.append(True) or True)
    monkeypatch.setattr(optimizer, "mem_available", lambda: available)
    name = f"stream-returns-freed-{return_freed}-{available}"
    _streamed(daemons, name, torch.float32, gpt_batches(1)[:1], return_freed=return_freed)
    assert bool(calls) == returned


def test_a_streamed_model_resumes_from_the_daemons(daemons):
    """A second trainer of the same name (the first one gone) takes the daemons' version and
    values: 2 steps, a new meta model, 1 more step = 3 steps uninterrupted."""
    batches = gpt_batches(1)
    _, expected, _ = train_in_process(torch.float32, batches)
    first, _ = _streamed(daemons, "stream-resume", torch.float32, batches[:2])
    with torch.device("meta"):
        model = TinyGPT(CONFIG)
    stream = trainer.Streaming(blocks=list(model.blocks), init=None, device="cpu")  # init unused on resume
    opt = trainer.offload(
        model, daemons=daemons, optimizer=trainer.AdamW(lr=LR, weight_decay=1e-2), no_weight_decay=no_decay,
        config=trainer.OffloadConfig(model_name="stream-resume", shard_bytes=4096), stream=stream,
    )  # fmt: skip
    with opt:
        assert opt.step_count == 2
        assert all(torch.equal(v, first[k]) for k, v in opt.full_state_dict().items())
        ((idx, targets),) = batches[2]
        model(idx, targets)[1].backward()
        opt.step()
        final = opt.full_state_dict()
    for key, value in expected.items():
        assert torch.equal(final[key], value), key


def test_the_models_state_dict_holds_the_pulled_blocks(daemons):
    """model.state_dict() (what torch.save and Hugging Face's save_pretrained read) pulls each
    freed block for its copy; a block's own state_dict() too; the blocks are freed again."""
    batches = gpt_batches(1)
    initial, expected, _ = train_in_process(torch.float32, batches)
    with torch.device("meta"):
        model = TinyGPT(CONFIG)
    stream = trainer.Streaming(blocks=list(model.blocks), init=copy_init(initial, model), device="cpu")
    opt = trainer.offload(
        model, daemons=daemons, optimizer=trainer.AdamW(lr=LR, weight_decay=1e-2), no_weight_decay=no_decay,
        config=trainer.OffloadConfig(model_name="stream-state-dict", shard_bytes=4096), stream=stream,
    )  # fmt: skip
    with opt:
        for micro_batches in batches:
            for idx, targets in micro_batches:
                model(idx, targets)[1].backward()
            opt.step()
        opt.synchronize()
        state = model.state_dict()
        block = model.blocks[1].state_dict()
        assert all(not u.allocated for u in opt.units if u.streamed)
    for key, value in expected.items():
        assert torch.equal(state[key], value), key
    assert torch.equal(block["attn.qkv.weight"], expected["blocks.1.attn.qkv.weight"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_clip_grad_norm_is_torchs(daemons, dtype):
    """opt.clip_grad_norm_ on a streamed model: torch's total norm of the per-parameter norms,
    and its coefficient applied in fp32 by the daemons. fp32: torch's clip_grad_norm_ and
    AdamW bit for bit. bf16: the reference clips the fp32 master gradients (the widened bf16
    gradients, as the daemons hold them), where torch on the bf16 model would round the
    product to bf16; the norm is taken from the bf16 gradients either way."""
    batches = gpt_batches(1)
    _, expected, _ = train_in_process(dtype, batches, clip=0.05 if dtype == torch.float32 else None)
    final, _ = _streamed(daemons, f"stream-clip-{dtype}", dtype, batches, clip=0.05)
    if dtype == torch.float32:
        _, unclipped, _ = train_in_process(dtype, batches)
        assert any(not torch.equal(unclipped[k], v) for k, v in expected.items()), "0.05 clipped nothing"
        for key, value in expected.items():
            assert torch.equal(final[key], value), key
    else:  # clipped: not the unclipped result
        assert any(not torch.equal(final[k], v) for k, v in expected.items())


def test_clip_grad_norm_refuses_what_it_cannot_do(daemons):
    initial, _, _ = train_in_process(torch.float32, [])
    with torch.device("meta"):
        model = TinyGPT(CONFIG)
    stream = trainer.Streaming(blocks=list(model.blocks), init=copy_init(initial, model), device="cpu")
    opt = trainer.offload(
        model, daemons=daemons, optimizer=trainer.AdamW(lr=LR),
        config=trainer.OffloadConfig(model_name="stream-clip-refused", shard_bytes=4096), stream=stream,
    )  # fmt: skip
    with opt:
        assert float(opt.clip_grad_norm_(1.0)) == 0.0  # nothing to clip yet, as torch
        ((idx, targets),) = gpt_batches(1)[0]
        for _ in range(2):
            model(idx, targets)[1].backward()
        with pytest.raises(ValueError, match="after 2 backward passes"):
            opt.clip_grad_norm_(1.0)
        with pytest.raises(ValueError, match="2-norm"):
            opt.clip_grad_norm_(1.0, norm_type=1.0)
        opt.step()
