"""ps-offload trainer library: train a model whose optimizer lives on ps-daemons.

import trainer
opt = trainer.offload(model, daemons=["127.0.0.1:50051"], optimizer=trainer.AdamW(lr=3e-4))
loss.backward(); opt.step(); opt.zero_grad()
"""

from ps_daemon.security import ClientSecurity
from trainer.client import DaemonError, ShardedClient
from trainer.cluster import daemon_addresses
from trainer.config import SGD, AdamW, ClientConfig
from trainer.offload import OffloadOptimizer, offload

__all__ = [
    "SGD",
    "AdamW",
    "ClientConfig",
    "ClientSecurity",
    "DaemonError",
    "OffloadOptimizer",
    "ShardedClient",
    "daemon_addresses",
    "offload",
]
