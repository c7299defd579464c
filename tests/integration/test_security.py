"""TLS, mutual TLS and bearer tokens against real daemons, with certificates made in the test
(trustme): the trainer trains over TLS on both transports; a client without a certificate,
or with one from another CA, is refused; no token is UNAUTHENTICATED and a wrong one
PERMISSION_DENIED, on gRPC and on the data plane; health checks need neither; SIGHUP
re-reads the token; ps-admin takes the same settings."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ps_offload import trainer
from ps_offload.proto import ps_pb2, ps_pb2_grpc
from ps_offload.proto.pull import Pull
from ps_offload.proto.security import ClientSecurity
from ps_offload.trainer.debug_models import mlp
from ps_offload.trainer.wire.daemon_client import DaemonClient, DaemonError
from ps_offload.trainer.wire.dataplane_client import DataPlaneClient
from ps_offload.trainer.wire.local_client import LocalClient

TOKEN = "s3cret-token-0123456789"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    """PEM files: the daemons' CA and server certificate (for 127.0.0.1 and localhost), a
    client certificate from that CA, and a client certificate from another CA."""
    out = tmp_path_factory.mktemp("pki")
    ca, other_ca = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client, stranger = ca.issue_cert("trainer@example"), other_ca.issue_cert("trainer@example")
    files = {
        "ca": ca.cert_pem,
        "other_ca": other_ca.cert_pem,
        "server_cert": server.cert_chain_pems[0],
        "server_key": server.private_key_pem,
        "client_cert": client.cert_chain_pems[0],
        "client_key": client.private_key_pem,
        "stranger_cert": stranger.cert_chain_pems[0],
        "stranger_key": stranger.private_key_pem,
    }
    paths = {}
    for name, blob in files.items():
        blob.write_to_path(str(out / f"{name}.pem"))
        paths[name] = str(out / f"{name}.pem")
    return paths


def _token_file(path: Path, token: str = TOKEN) -> str:
    path.write_text(token + "\n")
    path.chmod(0o600)
    return str(path)


def _daemon(daemon_factory, tmp_path: Path, *, tls: dict | None = None, auth: dict | None = None,
            server: dict | None = None, name="d"):  # fmt: skip
    lines = []
    for section, table in (("tls", tls), ("auth", auth), ("server", server)):
        if table:
            lines.append(f"[{section}]")
            lines += [f"{key} = {value!r}" if isinstance(value, int) else f'{key} = "{value}"'
                      for key, value in table.items()]  # fmt: skip
    config = tmp_path / f"{name}.toml"
    config.write_text("\n".join(lines) + "\n")
    return daemon_factory(config=config)


def _train(address: str, security: ClientSecurity, *, transport: str = "auto", steps: int = 3, name: str = "m"):
    torch.manual_seed(0)
    model = mlp((16, 32, 4))
    config = trainer.ClientConfig(
        security=security, transport=transport, retry_seconds=0.05, backoff_seconds=0.05, register_timeout_seconds=2.0
    )
    offload = trainer.OffloadConfig(shard_bytes=4096, model_name=name)
    with trainer.offload(model, daemons=[address], optimizer=trainer.AdamW(lr=0.01), config=offload,
                         client=config) as opt:  # fmt: skip
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
        opt.synchronize()
        return opt.step_count, opt.client.transports


def _health(address: str, security: ClientSecurity) -> int:
    with security.channel(address, []) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def _admin(address: str, security: ClientSecurity, method: str, request, timeout: float = 10):
    with security.channel(address, []) as channel:
        return getattr(ps_pb2_grpc.AdminStub(channel), method)(request, timeout=timeout)


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def test_training_over_tls_on_both_transports_and_plaintext_refused(daemon_factory, tmp_path, pki):
    daemon = _daemon(daemon_factory, tmp_path, tls={"cert_file": pki["server_cert"], "key_file": pki["server_key"]})
    secure = ClientSecurity(ca_file=pki["ca"])
    for transport, kind in (("local", LocalClient), ("tcp", DataPlaneClient), ("grpc", DaemonClient)):
        steps, transports = _train(daemon.address, secure, transport=transport, name=f"m-{transport}")
        assert steps == 3 and type(transports[0]) is kind  # the same host: "local" is the local transport
    assert _health(daemon.address, secure) == health_pb2.HealthCheckResponse.SERVING
    # A plaintext client gets nowhere, on gRPC or on the data plane.
    code, _ = _code(lambda: _health(daemon.address, ClientSecurity()))
    assert code == grpc.StatusCode.UNAVAILABLE
    port = _admin(daemon.address, secure, "ListModels", ps_pb2.ListModelsRequest()).models
    assert len(port) == 3
    data_port = _register_port(daemon.address, secure)
    plain = DataPlaneClient("127.0.0.1", data_port, max_connections=1)
    code, _ = _code(
        lambda: plain.pull_into(Pull.of("m-tcp", 0, min_version=0), out=memoryview(bytearray(4096)), timeout=5)
    )
    assert code == grpc.StatusCode.UNAVAILABLE
    assert daemon.process.poll() is None


def test_tls_handshakes_stalled_midway_hold_no_data_plane_worker(daemon_factory, tmp_path, pki):
    """One data plane worker, and clients that connect and never finish (or never start) the
    TLS handshake, with data_stall_seconds long enough to outlast the test: a handshake run on
    a worker would hold it, and the training below could not pull or push."""
    tls = {"cert_file": pki["server_cert"], "key_file": pki["server_key"]}
    daemon = _daemon(daemon_factory, tmp_path, tls=tls, server={"data_workers": 1, "data_stall_seconds": 600})
    secure = ClientSecurity(ca_file=pki["ca"])
    data_port = _register_port(daemon.address, secure)
    stalled = [socket.create_connection(("127.0.0.1", data_port), timeout=30) for _ in range(3)]
    stalled[0].sendall(b"\x16\x03\x01\x02\x00")  # the first bytes of a ClientHello, and no more
    steps, transports = _train(daemon.address, secure, transport="tcp")
    assert steps == 3 and isinstance(transports[0], DataPlaneClient)
    for sock in stalled:
        sock.close()


def _register_port(address: str, security: ClientSecurity) -> int:
    client = DaemonClient(address, max_message_bytes=8 << 20, security=security)
    spec = ps_pb2.ModelSpec(
        model="port-probe", params=[ps_pb2.ParamSpec(name="w", shape=[8], dtype=ps_pb2.FLOAT32)],
        optimizer=ps_pb2.OptimizerSpec(sgd=ps_pb2.SGDSpec(lr=0.1)), shard_bytes=4096, daemons=["d"],
    )  # fmt: skip
    port = client.register(spec, 0, timeout=10).data_port
    client.close()
    return port


def test_mutual_tls_refuses_clients_without_a_certificate_or_with_another_cas(daemon_factory, tmp_path, pki):
    tls = {"cert_file": pki["server_cert"], "key_file": pki["server_key"], "client_ca_file": pki["ca"]}
    daemon = _daemon(daemon_factory, tmp_path, tls=tls)
    good = ClientSecurity(ca_file=pki["ca"], cert_file=pki["client_cert"], key_file=pki["client_key"])
    no_cert = ClientSecurity(ca_file=pki["ca"])
    stranger = ClientSecurity(ca_file=pki["ca"], cert_file=pki["stranger_cert"], key_file=pki["stranger_key"])
    assert _train(daemon.address, good)[0] == 3  # over the data plane, with the client certificate
    data_port = _register_port(daemon.address, good)
    for refused in (no_cert, stranger):
        code, _ = _code(lambda s=refused: _health(daemon.address, s))
        assert code == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(DaemonError) as info:
            _train(daemon.address, refused)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE and "If it uses TLS" in str(info.value)
        plane = DataPlaneClient("127.0.0.1", data_port, max_connections=1, security=refused)
        out = memoryview(bytearray(512))
        code, details = _code(lambda p=plane, o=out: p.pull_into(Pull.of("m", 0, min_version=0), out=o, timeout=5))
        assert code == grpc.StatusCode.UNAVAILABLE, details
    # A client that trusts another CA refuses the daemon.
    code, _ = _code(lambda: _health(daemon.address, ClientSecurity(ca_file=pki["other_ca"])))
    assert code == grpc.StatusCode.UNAVAILABLE
    assert daemon.process.poll() is None


def test_admin_token_guards_state_changes_only(daemon_factory, tmp_path):
    daemon = _daemon(daemon_factory, tmp_path, auth={"token_file": _token_file(tmp_path / "token")})
    plain, wrong = ClientSecurity(), ClientSecurity(token_file=_token_file(tmp_path / "wrong", "not-the-token"))
    right = ClientSecurity(token_file=str(tmp_path / "token"))
    assert _train(daemon.address, plain)[0] == 3  # the data path stays open under "admin"
    assert _admin(daemon.address, plain, "ListShards", ps_pb2.ListShardsRequest()).shards  # so do the views
    load = ps_pb2.GetShardRequest(model="m", shard_id=0)
    code, details = _code(lambda: _admin(daemon.address, plain, "Load", load))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "Load needs this daemon's bearer token" in details
    code, details = _code(lambda: _admin(daemon.address, wrong, "Load", load))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "not this daemon's" in details
    assert _admin(daemon.address, right, "Load", load).tier == "ram"
    drop = ps_pb2.DropModelRequest(model="m")
    code, details = _code(lambda: _admin(daemon.address, plain, "DropModel", drop))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "DropModel needs this daemon's bearer token" in details
    assert _admin(daemon.address, plain, "ListShards", ps_pb2.ListShardsRequest()).shards  # not dropped
    assert _admin(daemon.address, right, "DropModel", drop).shards >= 1
    # Each refusal is a WARNING naming the caller (at most one per 10 s per method and code).
    log = daemon.log()
    assert "WARNING ps_offload.daemon.rpc.status: Load -> UNAUTHENTICATED: from 127.0.0.1: Load needs" in log
    assert "Load -> PERMISSION_DENIED: from 127.0.0.1: Load: the token presented is not this daemon's" in log


def test_token_on_every_call_covers_the_data_plane_and_spares_health(daemon_factory, tmp_path):
    token = _token_file(tmp_path / "token")
    daemon = _daemon(daemon_factory, tmp_path, auth={"token_file": token, "require_token": "all"})
    right, plain = ClientSecurity(token_file=token), ClientSecurity()
    wrong = ClientSecurity(token_file=_token_file(tmp_path / "wrong", "nope"))
    assert _train(daemon.address, right)[0] == 3
    assert _health(daemon.address, plain) == health_pb2.HealthCheckResponse.SERVING
    for security, code in ((plain, grpc.StatusCode.UNAUTHENTICATED), (wrong, grpc.StatusCode.PERMISSION_DENIED)):
        with pytest.raises(DaemonError) as info:
            _train(daemon.address, security)
        assert info.value.code == code
        assert _code(lambda s=security: _admin(daemon.address, s, "Stats", ps_pb2.StatsRequest()))[0] == code
    data_port = _register_port(daemon.address, right)
    for security, expected in ((plain, grpc.StatusCode.UNAUTHENTICATED), (wrong, grpc.StatusCode.PERMISSION_DENIED)):
        plane = DataPlaneClient("127.0.0.1", data_port, max_connections=1, security=security)
        out = memoryview(bytearray(2048))
        code, details = _code(lambda p=plane, o=out: p.pull_into(Pull.of("m", 0, min_version=0), out=o, timeout=5))
        assert code == expected, details
    assert daemon.process.poll() is None


def test_sighup_rereads_the_token(daemon_factory, notifications, tmp_path):
    token = tmp_path / "token"
    daemon = _daemon(daemon_factory, tmp_path, auth={"token_file": _token_file(token, "first")})
    old = ClientSecurity(token_file=_token_file(tmp_path / "old", "first"))
    new = ClientSecurity(token_file=_token_file(tmp_path / "new", "second"))
    load = ps_pb2.GetShardRequest(model="m", shard_id=0)
    _train(daemon.address, ClientSecurity())
    assert _admin(daemon.address, old, "Load", load).tier == "ram"
    _token_file(token, "second")
    daemon.process.send_signal(signal.SIGHUP)
    notifications.wait_for("RELOADING=1")
    notifications.wait_for("READY=1")  # the reload is done
    assert "re-read the token" in daemon.log()
    assert _code(lambda: _admin(daemon.address, old, "Load", load))[0] == grpc.StatusCode.PERMISSION_DENIED
    assert _admin(daemon.address, new, "Load", load).tier == "ram"


def test_ps_admin_takes_tls_and_the_token_from_options_or_the_environment(daemon_factory, tmp_path, pki):
    token = _token_file(tmp_path / "token")
    daemon = _daemon(
        daemon_factory, tmp_path, tls={"cert_file": pki["server_cert"], "key_file": pki["server_key"]},
        auth={"token_file": token},
    )  # fmt: skip
    _train(daemon.address, ClientSecurity(ca_file=pki["ca"]))

    def admin(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
        environment = {k: v for k, v in os.environ.items() if not k.startswith("PS_")}
        return subprocess.run([sys.executable, "-m", "ps_offload.admin", *args], capture_output=True, text=True,
                              timeout=60, env={**environment, **(env or {})})  # fmt: skip

    ok = admin("--ca-file", pki["ca"], "--token-file", token, "prefetch", "0", "--daemon", daemon.address)
    assert ok.returncode == 0, ok.stderr
    ok = admin("prefetch", "0", "--daemon", daemon.address, env={"PS_TLS_CA_FILE": pki["ca"], "PS_TOKEN_FILE": token})
    assert ok.returncode == 0, ok.stderr
    refused = admin("--ca-file", pki["ca"], "prefetch", "0", "--daemon", daemon.address)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr and "Traceback" not in refused.stderr
    plaintext = admin("shards", "--daemon", daemon.address)
    assert plaintext.returncode == 1 and "Traceback" not in plaintext.stderr
    assert "if it has [tls], give its CA: --ca-file or $PS_TLS_CA_FILE" in plaintext.stderr
    missing = admin("--token-file", str(tmp_path / "nope"), "shards", "--daemon", daemon.address)
    assert missing.returncode == 1 and "cannot read token file" in missing.stderr and "Traceback" not in missing.stderr
    half = admin("--cert-file", pki["client_cert"], "shards", "--daemon", daemon.address)
    assert half.returncode == 1 and "cert_file and key_file go together" in half.stderr


def test_bad_tls_settings_stop_the_daemon_with_one_line(tmp_path, pki):
    config = tmp_path / "bad.toml"
    config.write_text(f'[tls]\ncert_file = "{pki["server_key"]}"\nkey_file = "{pki["server_cert"]}"\n')  # swapped
    result = subprocess.run(
        [sys.executable, "-m", "ps_offload.daemon.cli", "serve", "--config", str(config), "--listen", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "cannot load the TLS certificate" in result.stderr and "Traceback" not in result.stderr


def test_plaintext_beyond_loopback_starts_only_with_insecure_and_says_so(daemon_factory, tmp_path, pki):
    """Secure by default: listening on every interface without [tls] (gradients, parameters
    and a token in clear) is refused with one line saying what to do; --insecure starts it
    and it warns at every start; with TLS it starts without a word."""
    flags = ["--listen", "0.0.0.0:0"]
    refused = subprocess.run(
        [sys.executable, "-m", "ps_offload.daemon.cli", "serve", *flags],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert refused.returncode == 2, refused.stderr
    assert "server.listen 0.0.0.0:0 is not a loopback address and [tls] is not set" in refused.stderr
    assert "--insecure" in refused.stderr and "Traceback" not in refused.stderr
    insecure = daemon_factory("--listen", "0.0.0.0:0", "--insecure")
    assert "WARNING" in insecure.log() and "INSECURE: server.listen 0.0.0.0:0 serves plaintext" in insecure.log()
    with grpc.insecure_channel(f"127.0.0.1:{insecure.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    config = tmp_path / "tls.toml"
    config.write_text(f'[tls]\ncert_file = "{pki["server_cert"]}"\nkey_file = "{pki["server_key"]}"\n')
    secure = daemon_factory("--listen", "0.0.0.0:0", config=config)
    assert "INSECURE" not in secure.log()
