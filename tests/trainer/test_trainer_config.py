"""trainer/config.py: the set of options is frozen, every field is documented, bad values
fail where they are written, and the public names agree between ps_offload and its trainer."""

from __future__ import annotations

import ast
import dataclasses
import inspect

import pytest

import ps_offload
from ps_offload import trainer
from ps_offload.optimizers import TABLE
from ps_offload.trainer import config

# Adding, renaming or removing an option is a change users see: make it here on purpose.
FIELDS = {
    "AdamW": ["lr", "betas", "eps", "weight_decay"],
    "SGD": ["lr", "momentum", "dampening", "weight_decay", "nesterov"],
    "LAMB": ["lr", "betas", "eps", "weight_decay"],
    "Adafactor": ["lr", "beta2_decay", "eps", "d", "weight_decay"],
    "OffloadConfig": [
        "model_name",
        "shard_bytes",
        "staleness",
        "push_share",
        "push_in_backward",
        "audit_every",
        "audit_tolerance",
        "replicas",
        "state_dtype",
    ],
    "DeviceConfig": ["host_buffers", "staging", "max_pinned_bytes"],
    "LossScaling": ["init_scale", "growth_factor", "backoff_factor", "growth_interval"],
    "CompressionConfig": ["method", "warmup_steps", "topk_ratio"],
    "ParallelConfig": [
        "microbatches",
        "schedule",
        "split",
        "bucket_bytes",
        "first_bucket_bytes",
        "max_grad_norm",
        "dp_compression",
    ],  # fmt: skip
    "ClientConfig": [
        "rpc_timeout_seconds",
        "register_timeout_seconds",
        "retry_seconds",
        "dead_peer_seconds",
        "backoff_seconds",
        "transport",
        "streams_per_daemon",
        "prefetch_hints",
        "max_message_bytes",
        "security",
    ],  # fmt: skip
}


def test_the_set_of_options_is_frozen():
    found = {
        name: [f.name for f in dataclasses.fields(cls)]
        for name, cls in vars(config).items()
        if dataclasses.is_dataclass(cls) and cls.__module__ == config.__name__
    } | {
        plugin.config_type.__name__: [f.name for f in dataclasses.fields(plugin.config_type)]
        for plugin in TABLE.values()
    }
    assert found == FIELDS


def test_every_field_has_a_docstring():
    tree = ast.parse(inspect.getsource(config))
    missing = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in FIELDS:
            body = node.body
            for i, statement in enumerate(body):
                if isinstance(statement, ast.AnnAssign):
                    after = body[i + 1] if i + 1 < len(body) else None
                    documented = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    if not documented or not str(after.value.value).strip():
                        missing.append(f"{node.name}.{statement.target.id}")
    assert missing == []


def test_configs_are_frozen_and_keyword_friendly():
    with pytest.raises(dataclasses.FrozenInstanceError):
        trainer.OffloadConfig().staleness = 1
    assert trainer.ParallelConfig().dp_compression == trainer.CompressionConfig()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: trainer.OffloadConfig(staleness=2), r"OffloadConfig.staleness must be 0 \(exact update\) or 1"),
        (lambda: trainer.OffloadConfig(push_share=(2, 2)), r"push_share must be \(i, n\) with 0 <= i < n"),
        (lambda: trainer.OffloadConfig(shard_bytes=-1), "shard_bytes must be an int, 0 .* or at least 4096"),
        (lambda: trainer.OffloadConfig(shard_bytes=100), r"at least 4096, got 100"),
        (lambda: trainer.OffloadConfig(model_name=""), "model_name must be a non-empty string"),
        (lambda: trainer.OffloadConfig(state_dtype="float16"), "state_dtype must be one of 'float32', 'bfloat16'"),
        (lambda: trainer.OffloadConfig(audit_every=-1), r"audit_every must be an int >= 0 \(0: off\)"),
        (lambda: trainer.OffloadConfig(audit_tolerance=float("nan")), "audit_tolerance must be a finite number"),
        (lambda: trainer.OffloadConfig(audit_every=10, staleness=1), "audit_every needs staleness=0"),
        (lambda: trainer.OffloadConfig(replicas=0), "OffloadConfig.replicas must be an int >= 1"),
        (lambda: trainer.CompressionConfig(method="int8"), "CompressionConfig.method must be one of 'none'"),
        (lambda: trainer.CompressionConfig(warmup_steps=-1), "warmup_steps must be an int >= 0"),
        (lambda: trainer.CompressionConfig(topk_ratio=0.0), r"topk_ratio must be in \(0, 1\]"),
        (lambda: trainer.ParallelConfig(microbatches=0), "microbatches must be an int >= 1"),
        (lambda: trainer.ParallelConfig(schedule="zb"), r"schedule must be one of \['gpipe', '1f1b'\]"),
        (lambda: trainer.ParallelConfig(split="memory"), "split must be one of"),
        (lambda: trainer.ParallelConfig(max_grad_norm=0.0), "max_grad_norm must be > 0 or None"),
        (lambda: trainer.AdamW(betas=(0.9, 1.0)), r"betas must be two numbers in \[0, 1\)"),
        (lambda: trainer.DeviceConfig(host_buffers=0), "host_buffers must be an int >= 1"),
        (lambda: trainer.DeviceConfig(staging="never"), 'staging must be "auto" or "always"'),
        (lambda: trainer.DeviceConfig(max_pinned_bytes=0), "max_pinned_bytes must be None or an int >= 1"),
        (lambda: trainer.LossScaling(init_scale=float("inf")), "init_scale must be finite and > 0"),
        (lambda: trainer.LossScaling(backoff_factor=1.0), "0 < backoff_factor < 1"),
        (lambda: trainer.LossScaling(growth_interval=0), "growth_interval must be an int >= 1"),
        (lambda: trainer.SGD(nesterov=True), "needs momentum > 0 and dampening = 0"),
    ],
)
def test_bad_values_fail_where_they_are_written(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_config_in_the_wrong_place_is_named():
    with pytest.raises(TypeError, match="dp_compression takes a CompressionConfig"):
        trainer.ParallelConfig(dp_compression="onebit")
    model = __import__("torch").nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"config= takes OffloadConfig\(...\), got ClientConfig"):
        trainer.offload(model, daemons=["127.0.0.1:1"], optimizer=trainer.AdamW(), config=trainer.ClientConfig())
    with pytest.raises(TypeError, match=r"compression= takes CompressionConfig\(...\), got str"):
        trainer.offload(model, daemons=["127.0.0.1:1"], optimizer=trainer.AdamW(), compression="bf16")


def test_the_public_names_agree():
    assert sorted(ps_offload.__all__) == sorted(trainer.__all__)
    for name in trainer.__all__:
        assert getattr(ps_offload, name) is getattr(trainer, name)
