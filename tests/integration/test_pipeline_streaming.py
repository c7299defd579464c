"""Pipeline stages that stream their blocks: 2 stages x 2 data-parallel replicas (4 gloo
processes under torchrun) over 2 daemons, each stage holding one Linear layer at a time,
end where single-process training ends when it sums as the streamed job does, bit for bit.

The streamed job sums differently from the unstreamed one (tests/integration/
test_pipeline_dp.py): each micro-batch's gradient of a block is summed over the replicas (the
all-reduce, in the model's dtype) and pushed as a part at once, the daemons add the parts in
fp32 in micro-batch order and the APPLY multiplies the sum by 1 / (dp x micro-batches). The
reference below spells out exactly that; 1/8 is a power of two, so its product is exact."""

from __future__ import annotations

import contextlib
import json
import os
import signal

import pytest
import torch

from ps_offload.daemon.local import LocalDaemon
from tests.helpers import pipeline_mlp
from tests.helpers.pipeline_mlp import DP, MICROBATCHES, STEPS, torchrun


def _reference_streamed(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    model = torch.nn.Sequential(*(layer.to(dtype) for layer in pipeline_mlp.layers()))
    params = list(model.parameters())
    masters = [p.detach().float().clone() for p in params]
    opt = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1, fused=True)
    for x, y in pipeline_mlp.batches(STEPS):
        replicas = [
            list(zip(rx.chunk(MICROBATCHES), ry.chunk(MICROBATCHES), strict=True))
            for rx, ry in zip(x.chunk(DP), y.chunk(DP), strict=True)
        ]
        sums: list[torch.Tensor | None] = [None] * len(params)
        for k in range(MICROBATCHES):
            reduced = None  # this micro-batch's gradients summed over the replicas, in `dtype`
            for micro_batches in replicas:
                mx, my = micro_batches[k]
                model.zero_grad(set_to_none=True)
                pipeline_mlp.loss_fn(model(mx.to(dtype)), my).backward()
                grads = [p.grad.clone() for p in params]
                reduced = grads if reduced is None else [a + b for a, b in zip(reduced, grads, strict=True)]
            for i, g in enumerate(reduced):
                sums[i] = g.float() if sums[i] is None else sums[i].add_(g.float())
        multiplier = torch.tensor(1.0 / (DP * MICROBATCHES), dtype=torch.float32)
        for master, total in zip(masters, sums, strict=True):
            master.grad = total * multiplier
        opt.step()
        with torch.no_grad():
            for p, master in zip(params, masters, strict=True):
                p.copy_(master)
    return model.state_dict()


@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "schedule"), [("float32", "1f1b"), ("bfloat16", "gpipe")])
def test_streamed_stages_with_replicas_match_single_process_bit_for_bit(tmp_path, dtype, schedule):
    daemons = [LocalDaemon(tmp_path / f"d{i}") for i in range(2)]
    try:
        addresses = ",".join(d.address for d in daemons)
        result = torchrun(
            tmp_path, "--daemons", addresses, "--stream", "--dtype", dtype, "--schedule", schedule, "--save-replicas"
        )
        assert result.returncode == 0, result.stderr[-4000:]
        reference = _reference_streamed(getattr(torch, dtype))
        largest = 64 * 64 + 64  # elements of the largest Linear layer: the window
        for rank in range(4):
            stats = json.loads((tmp_path / f"stream{rank}.json").read_text())
            assert stats["version"] == STEPS
            # Each micro-batch's forward and backward pulls the stage's blocks: they streamed.
            assert stats["prefetched"] + stats["on_demand"] >= STEPS * MICROBATCHES * 2, stats
            assert 0 < stats["peak_block_bytes"] <= largest * getattr(torch, dtype).itemsize, stats
        for replica in range(DP):
            got = {**torch.load(tmp_path / f"stage0.replica{replica}.pt"),
                   **torch.load(tmp_path / f"stage1.replica{replica}.pt")}  # fmt: skip
            assert sorted(got) == sorted(reference)
            for name, expected in reference.items():
                assert got[name].dtype == expected.dtype
                assert torch.equal(got[name], expected), (replica, name)
    finally:
        for daemon in daemons:
            daemon.kill()


@pytest.mark.slow
def test_a_daemon_killed_before_the_apply_fails_the_step_on_every_rank_and_the_rerun_ends_bit_identical(tmp_path):
    """At step 2, once every rank's micro-batches are pushed, the NVMe daemon is SIGKILLed and
    restarted on its port: it recovers version 2 and has lost step 2's parts. The ranks whose
    shards live there find that in the check before APPLY, and the others are told by the
    job-wide agreement, so no rank applies step 2 and every rank raises StepLost; the loop runs
    the step again (the parts the other daemon holds are not added twice) and the run ends
    where the uninterrupted reference ends."""
    nvme = tmp_path / "nvme"
    kept = LocalDaemon(tmp_path / "d0")
    killed = LocalDaemon(tmp_path / "d1", "--nvme-dir", str(nvme))
    out = tmp_path / "out"
    out.mkdir()
    try:
        spec = f"2@{killed.process.pid}@{killed.port}@{nvme}"
        result = torchrun(
            out, "--daemons", f"{kept.address},{killed.address}", "--stream", "--kill-daemon", spec, "--save-replicas"
        )
        assert result.returncode == 0, result.stderr[-4000:]
        assert killed.process.wait(timeout=30) == -9
        lost = [(out / f"lost{rank}.txt").read_text() for rank in range(4)]
        assert all(message.startswith("step 2 of ") for message in lost), lost
        assert any("another rank's daemon" in message for message in lost), lost  # told by the agreement
        assert any("no longer holds" in message and "another rank" not in message for message in lost), lost
        reference = _reference_streamed(torch.float32)
        for replica in range(DP):
            got = {**torch.load(out / f"stage0.replica{replica}.pt"), **torch.load(out / f"stage1.replica{replica}.pt")}
            for name, expected in reference.items():
                assert torch.equal(got[name], expected), (replica, name)
    finally:
        kept.kill()
        killed.kill()
        restarted = out / "restarted.pid"
        if restarted.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(restarted.read_text()), signal.SIGKILL)
