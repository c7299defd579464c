"""What this daemon's optimizer kernels compute, as a short digest.

Replicas of a shard (ModelSpec.replicas) each apply the same pushes and must end with the same
bits. They do when the kernels round alike, which depends on the CPU's vector instructions
(AVX2, AVX-512) and torch's build, not on the daemon's release: the digest is of the model's
optimizer plug-in's results on its fixed probe (OptimizerPlugin.probe: a few steps over tensors
whose lengths exercise the vector body and the scalar tail), so two daemons that would drift
apart say so before the first step (the trainer compares its holders' digests at registration,
RegisterModelResponse.kernel_digest). It costs a few milliseconds, once per optimizer and
process, and only for the optimizers the daemon's models run (Adafactor's, torch.optim's step
machinery, costs about 75 MiB of resident memory the first time).
"""

from __future__ import annotations

import functools
import hashlib

from ps_offload.optimizers import TABLE


@functools.cache
def kernel_digest(optimizer: str) -> str:
    """The digest of the plug-in called `optimizer` (a key of the table)."""
    digest = hashlib.sha256()
    digest.update(optimizer.encode())
    digest.update(TABLE[optimizer].probe())
    return digest.hexdigest()[:16]
