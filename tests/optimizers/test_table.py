"""The plug-in table: every optimizer's config survives the wire and the spec file, its probe
is deterministic, and a daemon refuses an optimizer or a setting it does not have, saying
which it has."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from ps_offload.daemon.model.spec import ModelSpec, ParamSpec, spec_from_dict, spec_to_dict
from ps_offload.optimizers import TABLE, plugin_for_spec, plugin_named, plugin_of
from ps_offload.proto import ps_pb2, ps_pb2_grpc

EXAMPLES = {
    "adamw": TABLE["adamw"].config_type(lr=3e-4, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.05),
    "sgd": TABLE["sgd"].config_type(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=1e-4, nesterov=True),
    "lamb": TABLE["lamb"].config_type(lr=2e-3, betas=(0.85, 0.98), eps=1e-5, weight_decay=0.02),
    "adafactor": TABLE["adafactor"].config_type(lr=1e-3, beta2_decay=-0.7, eps=(None, 1e-4), d=1.5, weight_decay=0.01),
}


def test_every_plugin_has_an_example_here():
    assert sorted(EXAMPLES) == sorted(TABLE)


@pytest.mark.parametrize("name", sorted(TABLE))
def test_a_config_survives_the_wire_and_the_spec_file(name):
    config = EXAMPLES[name]
    plugin = plugin_of(config)
    assert plugin is plugin_named(name)
    wire = ps_pb2.OptimizerSpec.FromString(config.to_proto().SerializeToString())
    assert plugin_for_spec(wire) is plugin and plugin.from_proto(wire) == config
    spec = ModelSpec("m", (ParamSpec("w", (3, 5)),), config, 4096, ("d",))
    assert spec_from_dict(spec_to_dict(spec)) == spec
    assert all(getattr(config, f) == getattr(plugin.from_dict(plugin.to_dict(config)), f)
               for f in (f.name for f in dataclasses.fields(config)))  # fmt: skip


@pytest.mark.parametrize("name", sorted(TABLE))
def test_a_probe_is_the_same_bits_every_time(name):
    assert TABLE[name].probe() == TABLE[name].probe() != b""


def _register(address: str, optimizer: ps_pb2.OptimizerSpec) -> grpc.RpcError:
    spec = ps_pb2.ModelSpec(model="m", params=[ps_pb2.ParamSpec(name="w", shape=[8], dtype=ps_pb2.FLOAT32)],
                            optimizer=optimizer, shard_bytes=4096, daemons=[address])  # fmt: skip
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as info:
        ps_pb2_grpc.ParameterServerStub(channel).RegisterModel(ps_pb2.RegisterModelRequest(spec=spec), timeout=30)
    return info.value


def test_the_daemon_names_the_optimizers_it_has_and_their_settings(daemon):
    unknown = _register(daemon.address, ps_pb2.OptimizerSpec(plugin=ps_pb2.PluginOptimizerSpec(name="adafactorr")))
    assert unknown.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no optimizer 'adafactorr' (this build runs adafactor, adamw, lamb, sgd)" in unknown.details()
    typo = ps_pb2.PluginOptimizerSpec(name="lamb", settings={"lr": 1e-3, "beta3": 0.5})
    bad = _register(daemon.address, ps_pb2.OptimizerSpec(plugin=typo))
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "lamb has no setting 'beta3'" in bad.details()
    none = _register(daemon.address, ps_pb2.OptimizerSpec())
    assert none.code() == grpc.StatusCode.INVALID_ARGUMENT and "no optimizer given" in none.details()
    eps = ps_pb2.PluginOptimizerSpec(name="lamb", settings={"eps": 0.0})
    zero = _register(daemon.address, ps_pb2.OptimizerSpec(plugin=eps))
    assert zero.code() == grpc.StatusCode.INVALID_ARGUMENT and "LAMB eps must be > 0" in zero.details()
