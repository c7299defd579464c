"""What only an accelerator runs (trainer/accelerator.py and the model on a CUDA device): the
side-stream copies through pinned buffers, a bf16 model on the GPU trained through a daemon
equal to fp32 masters in process, and a PipelineTrainer stage under NCCL. Skipped, with the
reason, where there is no CUDA GPU; the same paths run on the CPU in
tests/integration/test_mixed_precision.py (DeviceConfig(staging="always")) and
test_pipeline_dp.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ps_offload import trainer
from ps_offload.trainer.debug_models import mlp

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
ROOT = Path(__file__).resolve().parents[2]


def test_copies_through_pinned_buffers_follow_the_compute_stream():
    from ps_offload.trainer.accelerator import AcceleratorCopies
    from ps_offload.trainer.device import HostBuffers

    device = torch.device("cuda")
    copies = AcceleratorCopies(device)
    buffers = HostBuffers(2, 1 << 20, torch.bfloat16, pin=True)
    source = torch.zeros(1 << 20, dtype=torch.bfloat16, device=device)
    # Queued on the compute stream behind a long kernel: the copy must wait for it.
    torch.cuda._sleep(50_000_000)
    source.fill_(3.0)
    with buffers.buffer(1 << 20) as host:
        assert host.is_pinned()
        copies.to_host(source, host, copies.mark_compute(device))
        assert bool((host == 3.0).all())
        host.fill_(5.0)
        target = torch.empty_like(source)
        copies.to_device(host, target, copies.mark_compute(device))
    assert bool((target == 5.0).all())


def test_bf16_model_on_cuda_through_a_daemon_equals_fp32_masters_in_process(daemon):
    torch.manual_seed(0)
    model = mlp((33, 129, 17, 10)).to("cuda", torch.bfloat16)
    reference = mlp((33, 129, 17, 10))
    reference.load_state_dict(model.state_dict())
    reference.to("cuda", torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(16, 33, generator=g) for _ in range(6)]
    batches = [(x.to("cuda", torch.bfloat16), torch.randint(10, (16,), generator=g).cuda()) for x in inputs]

    def loss(m, batch):
        return torch.nn.functional.cross_entropy(m(batch[0]).float(), batch[1])

    # The daemon's AdamW runs on its CPU: so do the reference's masters.
    params = list(reference.parameters())
    masters = [p.detach().float().cpu() for p in params]
    opt = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1, fused=True)
    for batch in batches:
        reference.zero_grad()
        loss(reference, batch).backward()
        for m, p in zip(masters, params, strict=True):
            m.grad = p.grad.float().cpu()
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, params, strict=True):
                p.copy_(m)

    with trainer.offload(
        model, daemons=[daemon.address], optimizer=trainer.AdamW(lr=1e-2, weight_decay=0.1),
        config=trainer.OffloadConfig(shard_bytes=4096), device=trainer.DeviceConfig(host_buffers=2),
    ) as ours:  # fmt: skip
        assert ours.mover.staged and ours.mover.buffers.pinned
        for batch in batches:
            ours.zero_grad()
            loss(model, batch).backward()
            ours.step()
        ours.synchronize()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_pipeline_stage_on_cuda_over_nccl_with_daemons(tmp_path, daemon):
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
         "-m", "tests.integration.pp_dp_worker", "--pp", "1", "--dp", "1", "--steps", "3", "--microbatches", "2",
         "--schedule", "gpipe", "--dtype", "bfloat16", "--daemons", daemon.address, "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    state = torch.load(tmp_path / "stage0.pt")
    assert all(v.dtype == torch.bfloat16 and v.is_cuda for v in state.values())
