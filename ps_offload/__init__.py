"""ps-offload: train models whose fp32 master weights and optimizer state live on node
daemons (RAM and NVMe tiers), not on the trainer.

    import ps_offload
    opt = ps_offload.offload(model, daemons=["127.0.0.1:50051"], optimizer=ps_offload.AdamW(lr=3e-4))

Every import name this project installs lives under ``ps_offload``:
``ps_offload.trainer`` (the library a training script imports), ``ps_offload.daemon``
(the node daemon), ``ps_offload.admin`` (the ps-admin CLI), ``ps_offload.kernels``
(compression and fused optimizer kernels), ``ps_offload.optimizers`` (the optimizer plug-ins
the daemon and the trainer both run) and ``ps_offload.proto`` (the contract, which every
other package shares). The repository keeps them in the folders the design names
(trainer/, ps_daemon/, ps_admin/, kernels/, optimizers/, ps_proto/); pyproject.toml maps them here.

The trainer's public names are re-exported lazily, so importing the daemon or the admin CLI
(which share this namespace) does not load the trainer.
"""

from __future__ import annotations

import importlib
from typing import Any

from ps_offload.version import release

# Kept equal to ps_offload.trainer.__all__ (tests/trainer/test_config.py checks it).
_TRAINER_EXPORTS = frozenset(
    {
        "Adafactor",
        "LAMB",
        "SGD",
        "AdamW",
        "AuditMismatch",
        "ClientConfig",
        "ClientSecurity",
        "CompressionConfig",
        "DaemonError",
        "DeviceConfig",
        "LocalOptimizer",
        "LossScaling",
        "OffloadConfig",
        "OffloadOptimizer",
        "ParallelConfig",
        "ParameterChanged",
        "PipelineTrainer",
        "StepLost",
        "StepTorn",
        "StreamedOptimizer",
        "Streaming",
        "daemon_addresses",
        "init_distributed",
        "offload",
    }
)

__all__ = sorted(_TRAINER_EXPORTS)
__version__ = release()


def __getattr__(name: str) -> Any:
    if name in _TRAINER_EXPORTS:
        return getattr(importlib.import_module("ps_offload.trainer"), name)
    raise AttributeError(f"module 'ps_offload' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _TRAINER_EXPORTS)
