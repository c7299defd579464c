"""trainer/offload/loss_scale.py: scaling the loss takes no device sync (the scale reaches the kernel as
a CPU scalar, not through a copy to the device, which waits for the stream), and computes what
GradScaler's spelling computes. The one sync a loss-scaled step keeps is found_inf's."""

from __future__ import annotations

import pytest
import torch

from ps_offload.trainer.config import LossScaling
from ps_offload.trainer.offload.loss_scale import LossScaler, found_inf


def test_the_scaled_loss_and_its_gradients_are_gradscalers():
    scaler = LossScaler(LossScaling())
    # GradScaler: loss * an fp32 scale; a 0-d fp16 times a 0-d fp32 is fp32 (not an fp16 inf).
    half = scaler.scale_loss(torch.tensor(3.0, dtype=torch.float16))
    assert half.dtype == torch.float32 and half.item() == 3.0 * 65536
    w = torch.tensor([2**-8, -(2**-6), 3 * 2**-9], dtype=torch.float16, requires_grad=True)
    loss = (w.float() ** 2).sum()  # an fp32 loss over fp16 parameters, as a model's
    scaled = scaler.scale_loss(loss)
    assert scaled.dtype == torch.float32 and scaled.item() == loss.item() * 65536
    scaled.backward()
    assert torch.equal(w.grad, (2 * w.detach().float() * 65536).half())
    assert not found_inf(w.grad)
    w.grad[1] = float("inf")
    assert found_inf(w.grad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_scaling_a_loss_on_the_gpu_does_not_sync():
    scaler = LossScaler(LossScaling())
    loss = torch.full((), 3.0, dtype=torch.float16, device="cuda")
    torch.cuda.set_sync_debug_mode("error")  # a sync raises
    try:
        scaled = scaler.scale_loss(loss)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert scaled.is_cuda and scaled.item() == 3.0 * 65536
