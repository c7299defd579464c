"""deploy/kubernetes/: every object valid against the Kubernetes schemas (kubernetes-validate,
strict: no unknown fields), and the DaemonSet agrees with the daemon config it mounts: ports,
gRPC probes, the NVMe directory on the node's disk, the Secrets' paths, a grace period past
the daemon's drain, one node at a time."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from ps_offload.daemon.config import load_config
from ps_offload.proto.cluster import read_cluster_file
from ps_offload.proto.frames import split_host_port

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
KUBERNETES = "1.30"  # the oldest release still maintained upstream when these were written
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
    toml.write_text(text.replace('"/etc/ps-offload/', f'"{tmp_path}/etc/ps-offload/'))
    config = load_config(toml)
    spec = _one("DaemonSet", "ps-daemon")["spec"]
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["grpc"] == split_host_port(config.server.listen)[1]
    assert ports["data"] == split_host_port(config.server.data_listen)[1]  # fixed: a firewall can name it
    assert ports["metrics"] == split_host_port(config.metrics.listen)[1]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == ports["grpc"]  # grpc.health.v1 (ready = recovered)
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


def test_the_cluster_configmap_is_a_cluster_file_the_trainers_read(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text(_one("ConfigMap", "ps-offload-cluster")["data"]["cluster.toml"])
    assert read_cluster_file(path) == ["gpu-node-0:50051", "gpu-node-1:50051"]
    trainer = _one("Pod", "trainer-0")["spec"]
    env = {e["name"]: e for e in trainer["containers"][0]["env"]}
    assert env["NODE_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    mount = next(m for m in trainer["containers"][0]["volumeMounts"] if m["name"] == "cluster")
    assert env["PS_CLUSTER_FILE"]["value"] == f"{mount['mountPath']}/cluster.toml"
