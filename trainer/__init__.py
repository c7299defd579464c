"""ps-offload trainer library: train a model whose optimizer lives on ps-daemons.

    import ps_offload

    opt = ps_offload.offload(
        model,
        daemons=["127.0.0.1:50051"],
        optimizer=ps_offload.AdamW(lr=3e-4),
        config=ps_offload.OffloadConfig(shard_bytes=4 << 20),  # optional, as the two below
        compression=ps_offload.CompressionConfig(method="bf16"),
        client=ps_offload.ClientConfig(rpc_timeout_seconds=120),
    )
    loss.backward(); opt.step(); opt.zero_grad()

Pipeline stages x data-parallel replicas, under torchrun:

    ctx = ps_offload.init_distributed(pp=2, dp=2)
    model = ps_offload.PipelineTrainer(layers, loss_fn, ctx=ctx, optimizer=ps_offload.AdamW(),
                                       config=ps_offload.ParallelConfig(microbatches=4),
                                       daemons=ps_offload.daemon_addresses())
    loss = model.step(inputs, targets)

The same names are in `ps_offload.trainer` (`from ps_offload import trainer`): what a training
script needs. The plumbing stays importable from its module (the clients from
ps_offload.trainer.wire.sharded_client and .daemon_client, StepOptimizer from
ps_offload.trainer.pipeline.local_optimizer).

The package, its folders layered api -> pipeline -> stream -> offload -> io -> wire -> base
(config, debug_models):

    api            offload(): registers the model, returns an OffloadOptimizer or a StreamedOptimizer
    config         what a training script configures, one dataclass per concern (AdamW, SGD, LAMB,
                   OffloadConfig, DeviceConfig, LossScaling, CompressionConfig, ParallelConfig, ClientConfig)
    debug_models   TinyGPT, gpt_layers, mlp, CharDataset: small models that run in seconds on a CPU
    wire/          the trainer's side of the wire: the daemons' clients, transports, replicas
    io/            shards between the trainer's device and the wire: flat buffers, copies, compression
    offload/       OffloadOptimizer: the torch.optim.Optimizer whose state lives on the daemons
    stream/        StreamedOptimizer: a model larger than the trainer, a window of blocks at a time
    pipeline/      PipelineTrainer: pipeline stages x data-parallel replicas under torchrun
"""

from ps_offload.proto.cluster import daemon_addresses
from ps_offload.proto.security import ClientSecurity
from ps_offload.trainer.api import offload
from ps_offload.trainer.config import (
    LAMB,
    SGD,
    Adafactor,
    AdamW,
    ClientConfig,
    CompressionConfig,
    DeviceConfig,
    LossScaling,
    OffloadConfig,
    ParallelConfig,
)
from ps_offload.trainer.offload.audit import AuditMismatch
from ps_offload.trainer.offload.param_binding import ParameterChanged
from ps_offload.trainer.offload.whole_model import OffloadOptimizer
from ps_offload.trainer.pipeline.grid import init_distributed
from ps_offload.trainer.pipeline.local_optimizer import LocalOptimizer
from ps_offload.trainer.pipeline.trainer import PipelineTrainer
from ps_offload.trainer.stream.optimizer import StreamedOptimizer
from ps_offload.trainer.stream.settings import StepLost, StepTorn, Streaming
from ps_offload.trainer.wire.daemon_client import DaemonError

__all__ = [
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
]
