"""What only an accelerator runs (trainer/io/accelerator.py and the model on a CUDA device): the
side-stream copies through pinned buffers, a bf16 model on the GPU trained through a daemon
equal to fp32 masters in process (and an fp16 one, with loss scaling), and a PipelineTrainer
stage under NCCL. Skipped, with the reason, where there is no CUDA GPU; the same paths run on
the CPU in tests/integration/test_mixed_precision.py (DeviceConfig(staging="always")) and
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
ROOT = Path(__file__).resolve().parents[3]


def test_copies_through_pinned_buffers_follow_the_compute_stream():
    from ps_offload.trainer.io.accelerator import AcceleratorCopies
    from ps_offload.trainer.io.device import HostBuffers

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


@pytest.mark.parametrize("transport", ["tcp", "local"])
def test_bf16_model_on_cuda_through_a_daemon_equals_fp32_masters_in_process(daemon, transport):
    """ "local": the staging buffers are a window of the node's pool, page-locked with
    cudaHostRegister (trainer/io/accelerator.py register_host), pulled into and pushed from in
    place by the daemon."""
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
        client=trainer.ClientConfig(transport=transport),
    ) as ours:  # fmt: skip
        assert ours.mover.staged and ours.mover.buffers.pinned
        assert ours.mover.buffers.shared == (transport == "local")
        with ours.mover.buffers.buffer(1) as host:
            assert host.is_pinned()  # pin_memory's, or registered with CUDA
        for batch in batches:
            ours.zero_grad()
            loss(model, batch).backward()
            ours.step()
        ours.synchronize()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)


def test_fp16_model_on_cuda_through_a_daemon_with_loss_scaling_equals_fp32_masters_in_process(daemon):
    torch.manual_seed(0)
    model = mlp((33, 129, 17, 10)).to("cuda", torch.float16)
    reference = mlp((33, 129, 17, 10))
    reference.load_state_dict(model.state_dict())
    reference.to("cuda", torch.float16)
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(16, 33, generator=g) for _ in range(6)]
    batches = [(x.to("cuda", torch.float16), torch.randint(10, (16,), generator=g).cuda()) for x in inputs]
    scaling = trainer.LossScaling(growth_interval=2)

    def loss(m, batch):
        return torch.nn.functional.cross_entropy(m(batch[0]).float(), batch[1])

    # GradScaler's rules, with the masters on the CPU as the daemon's: the gradients of the scaled
    # loss unscaled in fp32; a step with an inf or a NaN skipped and the scale backed off; the
    # scale grown after growth_interval good steps.
    params = list(reference.parameters())
    masters = [p.detach().float().cpu() for p in params]
    opt = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1, fused=True)
    scale, good = scaling.init_scale, 0
    for batch in batches:
        reference.zero_grad()
        (loss(reference, batch) * torch.tensor(scale, dtype=torch.float32)).backward()
        inv = torch.tensor(scale, dtype=torch.float64).reciprocal().float()
        for m, p in zip(masters, params, strict=True):
            m.grad = p.grad.float().cpu() * inv
        if not all(bool(torch.isfinite(m.grad).all()) for m in masters):
            scale, good = scale * scaling.backoff_factor, 0
            continue
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, params, strict=True):
                p.copy_(m)
        good += 1
        if good == scaling.growth_interval:
            scale, good = scale * scaling.growth_factor, 0

    with trainer.offload(
        model, daemons=[daemon.address], optimizer=trainer.AdamW(lr=1e-2, weight_decay=0.1),
        config=trainer.OffloadConfig(shard_bytes=4096), device=trainer.DeviceConfig(host_buffers=2),
        loss_scaling=scaling,
    ) as ours:  # fmt: skip
        assert ours.mover.staged and ours.mover.buffers.pinned
        for batch in batches:
            ours.zero_grad()
            ours.scale_loss(loss(model, batch)).backward()
            ours.step()
        ours.synchronize()
        assert ours.loss_scaler.scale == scale
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


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


def test_training_on_a_non_default_stream_orders_every_copy_and_compression(daemon):
    """Training under `with torch.cuda.stream(s)`: the optimizer's I/O threads run on the
    default stream, so the first push of the initial values, each compressed push and the
    resume's pulls must each wait for s's event (trainer/io/device.py). A long kernel queued on s
    before the work that writes each source makes a missing wait read stale memory: zeros
    pushed as the initial values, gradients compressed before backward wrote them, a pull
    overwritten by the model's own (late) values. Equal, bit for bit, to the same run on the
    default stream (bf16 compression of bf16 gradients loses nothing)."""
    long = 200_000_000  # clock cycles: about 0.1 s

    def build():
        torch.manual_seed(0)
        return mlp((33, 129, 17, 10)).to("cuda", torch.bfloat16)

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 33, generator=g), torch.randint(10, (16,), generator=g)) for _ in range(4)]
    batches = [(x.to("cuda", torch.bfloat16), y.cuda()) for x, y in batches]

    def offload(model, name):
        return trainer.offload(
            model, daemons=[daemon.address], optimizer=trainer.AdamW(lr=1e-2),
            config=trainer.OffloadConfig(model_name=name, shard_bytes=4096),
            compression=trainer.CompressionConfig(method="bf16"), device=trainer.DeviceConfig(host_buffers=2),
        )  # fmt: skip

    def train(model, opt, *, sleep):
        for x, y in batches:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
            if sleep:
                torch.cuda._sleep(long)  # backward's gradients land late on s
            loss.backward()
            opt.step()
        opt.synchronize()

    reference = build()
    with offload(reference, "default-stream") as opt:
        train(reference, opt, sleep=False)

    side = torch.cuda.Stream()
    ours = build()
    with torch.cuda.stream(side):
        with torch.no_grad():
            torch.cuda._sleep(long)
            for p in ours.parameters():
                p.mul_(1.0)  # the values the first push reads are written late on s
        with offload(ours, "side-stream") as opt:
            train(ours, opt, sleep=True)
        torch.cuda.current_stream().synchronize()
        for a, b in zip(ours.parameters(), reference.parameters(), strict=True):
            assert torch.equal(a, b)

        # Resume: the daemons' values pulled into a model whose own (stale) values are still
        # being copied into the flat buffer on s.
        resumed = mlp((33, 129, 17, 10)).to("cuda", torch.bfloat16)
        torch.cuda._sleep(long)
        with offload(resumed, "side-stream") as opt:
            assert opt.step_count == len(batches)
            opt.synchronize()
            torch.cuda.current_stream().synchronize()
            for a, b in zip(resumed.parameters(), ours.parameters(), strict=True):
                assert torch.equal(a, b)
