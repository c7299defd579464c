"""What this daemon's optimizer kernels compute, as a short digest.

Replicas of a shard (ModelSpec.replicas) each apply the same pushes with torch's fused CPU
kernels and must end with the same bits. They do when the kernels round alike, which depends
on the CPU's vector instructions (AVX2, AVX-512) and torch's build, not on the daemon's
release: the digest is of the kernels' results on a fixed probe, so two daemons that would
drift apart say so before the first step (the trainer compares its holders' digests at
registration, RegisterModelResponse.kernel_digest).

The probe: fused AdamW (a few steps, weight decay on) and fused SGD with momentum over tensors
whose lengths exercise the vector body and the scalar tail (1, 7, 63 and 1031 elements), from
values drawn with a fixed seed. It costs about a millisecond, once per process.
"""

from __future__ import annotations

import functools
import hashlib

import torch

PROBE_LENGTHS = (1, 7, 63, 1031)
PROBE_STEPS = 3


@functools.cache
def kernel_digest() -> str:
    generator = torch.Generator().manual_seed(20261127)

    def draw(scale: float = 1.0) -> list[torch.Tensor]:
        return [torch.randn(n, generator=generator) * scale for n in PROBE_LENGTHS]

    params, m, v = draw(), [torch.zeros(n) for n in PROBE_LENGTHS], [torch.zeros(n) for n in PROBE_LENGTHS]
    sgd_params, momentum = draw(), [torch.zeros(n) for n in PROBE_LENGTHS]
    for step in range(1, PROBE_STEPS + 1):
        grads = draw(1e-2)
        steps = [torch.tensor(float(step))] * len(params)
        torch._fused_adamw_(params, grads, m, v, [], steps, lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.1,
                            eps=1e-8, amsgrad=False, maximize=False)  # fmt: skip
        torch._fused_sgd_(sgd_params, grads, momentum, weight_decay=0.01, momentum=0.9, lr=1e-2, dampening=0.0,
                          nesterov=False, maximize=False, is_first_step=step == 1)  # fmt: skip
    digest = hashlib.sha256()
    for tensor in (*params, *m, *v, *sgd_params, *momentum):
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()[:16]
