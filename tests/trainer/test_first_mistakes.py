"""The mistakes a newcomer makes first get a message to act on, at once (issue #27): torch's
optimizer class for ours, one address as a string, an address without a port, a shard size
the daemons refuse, a step after close(), and a script run again under the same model name
(it resumes the old run: said in a WARNING)."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import time

import pytest
import torch

from ps_offload import trainer
from ps_offload.trainer.debug_models import mlp


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(optimizer=torch.optim.AdamW), TypeError, r"takes ps_offload.AdamW\(lr=...\).*got AdamW \(torch.optim's"),
        (dict(optimizer="adamw"), TypeError, r"an instance, got str"),
        (dict(daemons="10.0.0.5:50051"), ValueError, r"not the string '10.0.0.5:50051': write \['10.0.0.5:50051'\]"),
        (dict(daemons=["10.0.0.5"]), ValueError, r"'10.0.0.5' is not host:port"),
        (dict(daemons=["10.0.0.5:0"]), ValueError, r"with a port in 1-65535"),
        (dict(daemons=["a:1", "b:2", "a:1"]), ValueError, r"daemon addresses repeat: \['a:1'\]"),
        (dict(daemons=[]), ValueError, "a non-empty list"),
    ],
)
def test_offload_says_what_to_write_before_calling_any_daemon(kwargs, error, message):
    args = dict(daemons=["127.0.0.1:1"], optimizer=trainer.AdamW(lr=1e-3)) | kwargs
    started = time.monotonic()
    with pytest.raises(error, match=message):
        trainer.offload(mlp((4, 4)), **args)
    assert time.monotonic() - started < 5  # at once: no retries against a daemon


def test_a_shard_size_the_daemons_refuse_is_refused_in_the_config():
    with pytest.raises(ValueError, match="0 \\(the daemon's default\\) or at least 4096, got 100"):
        trainer.OffloadConfig(shard_bytes=100)


def test_a_step_after_close_says_the_optimizer_was_closed(daemon, caplog):
    model = mlp((8, 8))
    opt = trainer.offload(model, daemons=[daemon.address], optimizer=trainer.SGD(lr=0.1))
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.close()
    opt.close()  # twice is fine
    with pytest.raises(RuntimeError, match=r"this optimizer was closed .*make a new one with offload\(\)"):
        opt.step()
    # The same script run again: it resumes the daemons' model, and says so.
    with (
        caplog.at_level(logging.WARNING),
        trainer.offload(mlp((8, 8)), daemons=[daemon.address], optimizer=trainer.SGD(lr=0.1)) as again,
    ):
        assert again.step_count == 1
    assert "resuming model 'model' at step 1 from the daemons' state" in caplog.text
    assert "another OffloadConfig(model_name=...)" in caplog.text


def test_ps_admin_takes_a_negative_shard_id_as_a_bad_id_not_an_option():
    result = subprocess.run(
        [sys.executable, "-m", "ps_offload.admin.cli", "shard", "-1"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2 and "No such option" not in result.stderr
    assert "greater than or equal to 0" in result.stderr


def test_a_daemon_that_does_not_answer_is_said_at_once(caplog):
    """offload() used to wait a register timeout and the retries (about 90 s) before a word."""
    with socket.socket() as closed:  # a free port with nothing listening
        closed.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{closed.getsockname()[1]}"
    client = trainer.ClientConfig(register_timeout_seconds=5.0, retry_seconds=0.0)  # one attempt of 5 s
    with caplog.at_level(logging.WARNING), pytest.raises(Exception, match="RegisterModel"):
        trainer.offload(mlp((4, 4)), daemons=[address], optimizer=trainer.SGD(lr=0.1), client=client)
    messages = [r.getMessage() for r in caplog.records]
    said = next(i for i, m in enumerate(messages) if f"daemon {address} does not answer" in m)
    assert said == 0, messages  # before the first attempt's deadline and its retry


def test_a_daemon_slow_to_register_a_large_model_is_not_called_unanswering(daemon, caplog, monkeypatch):
    """A registration that takes seconds (a large model's state allocated and zeroed on the
    daemon: 6.4 GB in about 2 s here) was reported as "does not answer" (issue 40): a daemon
    that answers its health check meanwhile is said to be registering, at INFO."""
    from ps_offload.trainer.wire import sharded_client

    monkeypatch.setattr(sharded_client, "UNREACHABLE_AFTER", 0.01)  # said before the registration ends
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, bias=False) for _ in range(4)])  # 67M: 1 GiB of state
    with caplog.at_level(logging.INFO):
        opt = trainer.offload(model, daemons=[daemon.address], optimizer=trainer.AdamW(lr=1e-3))
        opt.close()
    assert f"daemon {daemon.address} is still registering model" in caplog.text
    assert "does not answer" not in caplog.text


def test_a_daemon_too_old_for_the_trainer_is_refused_naming_both():
    from ps_offload.proto import ps_pb2
    from ps_offload.trainer.wire.daemon_client import check_protocol

    with pytest.raises(RuntimeError, match=r"daemon a:1 runs ps-offload a release from before 0.1.0 \(protocol 0\)"):
        check_protocol("a:1", ps_pb2.RegisterModelResponse())  # a daemon from before the field
    with pytest.raises(RuntimeError, match=r"runs ps-offload 0.0.9 \(protocol 0\), older than this trainer"):
        check_protocol("a:1", ps_pb2.RegisterModelResponse(daemon_version="0.0.9"))


def test_a_daemon_says_its_release_and_protocol(daemon):
    import grpc

    import ps_offload
    from ps_offload.proto import ps_pb2, ps_pb2_grpc
    from ps_offload.proto.channel import PROTOCOL
    from ps_offload.trainer.wire.daemon_client import DaemonClient

    client = DaemonClient(daemon.address, max_message_bytes=8 << 20)
    spec = ps_pb2.ModelSpec(
        model="m", params=[ps_pb2.ParamSpec(name="w", shape=[8], dtype=ps_pb2.FLOAT32)],
        optimizer=ps_pb2.OptimizerSpec(sgd=ps_pb2.SGDSpec(lr=0.1)), daemons=["d0"],
    )  # fmt: skip
    response = client.register(spec, 0, timeout=30)
    assert (response.daemon_version, response.protocol) == (ps_offload.__version__, PROTOCOL)
    client.close()
    with grpc.insecure_channel(daemon.address) as channel:
        stats = ps_pb2_grpc.AdminStub(channel).Stats(ps_pb2.StatsRequest(), timeout=10)
    assert stats.daemon_version == ps_offload.__version__
