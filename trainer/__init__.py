"""ps-offload trainer library: train a model whose optimizer lives on ps-daemons.

from ps_offload import trainer
opt = trainer.offload(model, daemons=["127.0.0.1:50051"], optimizer=trainer.AdamW(lr=3e-4))
loss.backward(); opt.step(); opt.zero_grad()
"""

from ps_offload.proto.security import ClientSecurity
from ps_offload.trainer.client import DaemonError, ShardedClient
from ps_offload.trainer.cluster import daemon_addresses
from ps_offload.trainer.config import SGD, AdamW, ClientConfig
from ps_offload.trainer.offload import OffloadOptimizer, offload

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
