"""Model specs the daemon tests register by hand: one fp32 parameter "w" under SGD or AdamW,
cut into a few small shards, so that each test knows its plan without asking; and such a model
registered in a ShardStore directly, its initial values pushed (register_in_store)."""

from __future__ import annotations

from ps_offload.proto import ps_pb2

SGD_SHARD_BYTES = 4096  # sgd_spec's default shape of 3000 fp32 -> shards 0 (1024), 1 (1024), 2 (952)
ADAMW_SHARD_BYTES = 8192  # adamw_spec's 3000 fp32 -> shards 0 (2048), 1 (952)


def sgd_spec(model="m", shape=(3000,), lr=0.1, daemons=("d0",)):
    return ps_pb2.ModelSpec(
        model=model,
        params=[ps_pb2.ParamSpec(name="w", shape=list(shape), dtype=ps_pb2.FLOAT32)],
        optimizer=ps_pb2.OptimizerSpec(sgd=ps_pb2.SGDSpec(lr=lr)),
        shard_bytes=SGD_SHARD_BYTES,
        daemons=list(daemons),
    )


def local_spec(model: str, numel: int = 3 * 1024) -> ps_pb2.ModelSpec:
    """sgd_spec without daemon names, `numel` elements (3 whole shards by default): what the
    local transport's tests register, here and in the trainer processes they start."""
    return sgd_spec(model, shape=(numel,), daemons=())


def adamw_spec():
    return ps_pb2.ModelSpec(
        model="m",
        params=[ps_pb2.ParamSpec(name="w", shape=[3000], dtype=ps_pb2.FLOAT32)],
        optimizer=ps_pb2.OptimizerSpec(adamw=ps_pb2.AdamWSpec(lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8)),
        shard_bytes=ADAMW_SHARD_BYTES,
        daemons=["d0"],
    )


def register_in_store(store, *, shards: int, numel: int, model: str = "m") -> None:
    """An AdamW (lr 0.01) model of `shards` shards of `numel` fp32 each, registered in the
    ShardStore `store` as daemon 0 of one, its initial values (seeded) pushed."""
    import torch

    from ps_offload.daemon.model.spec import ModelSpec, ParamSpec
    from ps_offload.daemon.store.push import PushRequest
    from ps_offload.optimizers import AdamW

    spec = ModelSpec(model, (ParamSpec("w", (shards * numel,)),), AdamW(lr=0.01), numel * 4, ("d",))
    store.registry.register(spec, 0)
    values = torch.randn(shards * numel, generator=torch.Generator().manual_seed(0))
    for shard_id in range(shards):
        data = values[shard_id * numel : (shard_id + 1) * numel].clone()
        store.push(PushRequest(model, shard_id, step=0, kind="parameters", data=data, lr=None))
