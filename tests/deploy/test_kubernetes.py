"""deploy/kubernetes/: every object valid against the Kubernetes schemas (kubernetes-validate,
strict: no unknown fields), and the DaemonSet agrees with the daemon config it mounts: ports,
gRPC probes, the NVMe directory on the node's disk, the Secrets' paths, a grace period past
the daemon's drain, one node at a time."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import kubernetes_validate
import pytest
import trustme
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ps_offload.daemon.config import load_config
from ps_offload.daemon.local import LocalDaemon
from ps_offload.proto import ps_pb2, ps_pb2_grpc
from ps_offload.proto.cluster import read_cluster_file
from ps_offload.proto.frames import split_host_port

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
KUBERNETES = "1.30"  # the oldest release still maintained upstream when these were written
_GROUP = 'local_group = "ps-daemon"'
OBJECTS = [(path.name, doc) for path in sorted(DEPLOY.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text())]


@pytest.mark.parametrize(("file", "obj"), OBJECTS, ids=[f"{f}:{o['kind']}/{o['metadata']['name']}" for f, o in OBJECTS])
def test_every_object_is_valid_kubernetes(file, obj):
    kubernetes_validate.validate(obj, KUBERNETES, strict=True)


def _one(kind: str, name: str) -> dict:
    (found,) = [o for _, o in OBJECTS if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def test_the_daemonset_agrees_with_the_daemon_config_it_mounts(tmp_path):
    # The daemon's own loader (unknown keys, bad values refused), which also wants the Secrets'
    # files to exist: they are made under tmp_path, and the prefix taken off again below.
    text = _one("ConfigMap", "ps-daemon-config")["data"]["ps-daemon.toml"]
    for secret in ("/etc/ps-offload/tls/tls.crt", "/etc/ps-offload/tls/tls.key", "/etc/ps-offload/token/token"):
        (tmp_path / secret.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / secret.lstrip("/")).write_text("x")
    toml = tmp_path / "ps-daemon.toml"
    # (The group is the image's, made by deploy/docker/Dockerfile; this host has root.)
    text = text.replace('"/etc/ps-offload/', f'"{tmp_path}/etc/ps-offload/').replace(_GROUP, 'local_group = "root"')
    toml.write_text(text)
    config = load_config(toml)
    spec = _one("DaemonSet", "ps-daemon")["spec"]
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["grpc"] == split_host_port(config.server.listen)[1]
    assert ports["data"] == split_host_port(config.server.data_listen)[1]  # fixed: a firewall can name it
    assert ports["metrics"] == split_host_port(config.metrics.listen)[1]
    assert ports["health"] == split_host_port(config.server.health_listen)[1]
    assert ports["metrics"] not in (9100, 9400)  # node-exporter's, dcgm-exporter's
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        # The kubelet's gRPC probes speak plaintext: the health port, never the TLS one.
        assert container[probe]["grpc"]["port"] == ports["health"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "hostPath" in volumes[mounts[config.store.nvme_dir]]  # the node's own disk
    for path in (config.tls.cert_file, config.tls.key_file, config.auth.token_file):
        path = path.removeprefix(str(tmp_path))
        mount = next(m for m in mounts if path.startswith(m + "/"))
        assert "secret" in volumes[mounts[mount]], path
    config_mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    assert container["args"][-1] == config_mount["mountPath"]
    assert pod["terminationGracePeriodSeconds"] > config.server.grace_seconds
    assert spec["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == 1
    assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]
    assert pod["hostNetwork"] and pod["hostIPC"]


def test_the_trainer_pod_gets_the_ca_and_the_daemons_group_never_its_key():
    trainer = _one("Pod", "trainer-0")["spec"]
    secrets = {v["secret"]["secretName"] for v in trainer["volumes"] if "secret" in v}
    assert "ps-daemon-tls" not in secrets and "ps-offload-ca" in secrets
    daemon = _one("DaemonSet", "ps-daemon")["spec"]["template"]["spec"]
    assert daemon["securityContext"]["runAsGroup"] in trainer["securityContext"]["supplementalGroups"]
    assert _GROUP in _one("ConfigMap", "ps-daemon-config")["data"]["ps-daemon.toml"]
    dockerfile = (DEPLOY.parent / "docker" / "Dockerfile").read_text()
    assert "groupadd --system --gid 10001 ps-daemon" in dockerfile and "USER 10001:10001" in dockerfile


def test_the_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint is not installed (make test installs it with the dev extra)")
    done = subprocess.run([hadolint, str(DEPLOY.parent / "docker" / "Dockerfile")], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_configmaps_daemon_answers_the_kubelets_probe(tmp_path):
    """The ConfigMap's own config, TLS and token on (the Secrets' files made here, the paths
    and addresses moved to this machine), probed as the kubelet does: plaintext
    grpc.health.v1 on the health port, SERVING; nothing else answers there."""
    ca = trustme.CA()
    cert = ca.issue_cert("ps-daemon.ps-offload", "127.0.0.1")
    secrets = tmp_path / "etc" / "ps-offload"
    (secrets / "tls").mkdir(parents=True)
    (secrets / "token").mkdir()
    cert.cert_chain_pems[0].write_to_path(str(secrets / "tls" / "tls.crt"))
    cert.private_key_pem.write_to_path(str(secrets / "tls" / "tls.key"))
    (secrets / "token" / "token").write_text("k8s-token\n")
    (secrets / "token" / "token").chmod(0o600)
    text = _one("ConfigMap", "ps-daemon-config")["data"]["ps-daemon.toml"]
    for old, new in (('"/etc/ps-offload/', f'"{tmp_path}/etc/ps-offload/'), ("0.0.0.0:", "127.0.0.1:"),
                     ("/var/lib/ps-offload/nvme", str(tmp_path / "nvme")), ('"64GiB"', '"1GiB"'),
                     (_GROUP, 'local_group = "root"')):  # fmt: skip
        text = text.replace(old, new)
    for port in ("50052", "50053", "9477"):  # any free ones here
        text = text.replace(f"127.0.0.1:{port}", "127.0.0.1:0")
    (tmp_path / "ps-daemon.toml").write_text(text)
    daemon = LocalDaemon(tmp_path / "d", "--config", str(tmp_path / "ps-daemon.toml"))
    try:
        (port,) = re.findall(r"plaintext health checks \(grpc.health.v1 only\) on port (\d+)", daemon.log())
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as other:
                ps_pb2_grpc.AdminStub(channel).Stats(ps_pb2.StatsRequest(), timeout=10)
            assert other.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with grpc.insecure_channel(daemon.address) as channel:  # the TLS port: no plaintext
            with pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    finally:
        daemon.stop()


def test_the_cluster_configmap_is_a_cluster_file_the_trainers_read(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text(_one("ConfigMap", "ps-offload-cluster")["data"]["cluster.toml"])
    assert read_cluster_file(path) == ["gpu-node-0:50051", "gpu-node-1:50051"]
    trainer = _one("Pod", "trainer-0")["spec"]
    env = {e["name"]: e for e in trainer["containers"][0]["env"]}
    assert env["NODE_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    mount = next(m for m in trainer["containers"][0]["volumeMounts"] if m["name"] == "cluster")
    assert env["PS_CLUSTER_FILE"]["value"] == f"{mount['mountPath']}/cluster.toml"
