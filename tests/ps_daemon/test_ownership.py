"""A daemon owns its ports and its NVMe directory: a second daemon on either refuses to start,
naming the first; a SIGKILLed daemon leaves no lock behind; a missing directory is an error
unless the config asks to create it; bad addresses are config errors naming their key."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ps_offload.daemon.ownership import LOCK_NAME, DirectoryInUse, DirectoryLock, listener_of

SERVE = [sys.executable, "-m", "ps_offload.daemon.cli", "serve"]


def serve(*flags: str) -> subprocess.CompletedProcess:
    """A daemon that must refuse to start: its exit code and what it said."""
    return subprocess.run([*SERVE, *flags], capture_output=True, text=True, timeout=120)


def refused(result: subprocess.CompletedProcess, code: int, *said: str) -> None:
    assert result.returncode == code, result.stderr + result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    for text in said:
        assert text in result.stderr, result.stderr


def test_a_second_daemon_on_the_same_port_refuses_naming_the_first(daemon):
    """gRPC sets SO_REUSEPORT by default: two daemons shared a port and answered each other's
    calls. Now the second one refuses, naming the first's pid."""
    result = serve("--listen", daemon.address, "--data-listen", "off")
    refused(result, 1, f"cannot listen on {daemon.address} (server.listen)", f"pid {daemon.process.pid}")
    assert listener_of(daemon.port).startswith(f"pid {daemon.process.pid}:")


def test_a_fixed_data_port_in_use_refuses_naming_the_key(daemon):
    data_port = int(daemon.log().split("data plane listening on port ")[1].split()[0])
    result = serve("--listen", "127.0.0.1:0", "--data-listen", f"127.0.0.1:{data_port}")
    refused(result, 1, "server.data_listen", f"port is in use by pid {daemon.process.pid}")


def test_a_second_daemon_on_the_same_nvme_dir_refuses_naming_the_first(daemon_factory, tmp_path):
    nvme = tmp_path / "nvme"
    first = daemon_factory("--nvme-dir", str(nvme))
    result = serve("--listen", "127.0.0.1:0", "--nvme-dir", str(nvme))
    holder = f"(pid {first.process.pid}, gRPC port {first.port}"
    refused(result, 1, f"store.nvme_dir {nvme} is in use by another ps-daemon {holder}")
    assert "recovered" not in result.stdout  # refused before reading a file


def test_a_sigkilled_daemon_leaves_no_lock_behind(daemon_factory, tmp_path):
    nvme = tmp_path / "nvme"
    first = daemon_factory("--nvme-dir", str(nvme))
    first.stop(signal.SIGKILL)
    assert (nvme / LOCK_NAME).exists()  # the file stays; the kernel dropped the lock with the process
    second = daemon_factory("--nvme-dir", str(nvme))
    assert f"pid {second.process.pid}" in (nvme / LOCK_NAME).read_text()


def test_a_missing_nvme_dir_is_an_error_unless_asked_to_create_it(daemon_factory, tmp_path):
    missing = tmp_path / "not-mounted" / "nvme"
    result = serve("--listen", "127.0.0.1:0", "--nvme-dir", str(missing))
    refused(result, 1, f"store.nvme_dir {missing} does not exist", "--create-nvme-dir")
    assert not missing.parent.exists()
    daemon_factory("--nvme-dir", str(missing), "--create-nvme-dir")
    assert (missing / LOCK_NAME).exists()


def test_an_nvme_dir_that_is_a_file_is_refused_naming_the_key(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    refused(serve("--listen", "127.0.0.1:0", "--nvme-dir", str(path)), 1, f"store.nvme_dir {path} is not a directory")


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--listen", "127.0.0.1:99999"], "port 99999 is out of range"),
        (["--listen", "nonsense", "--insecure"], "server.listen must be host:port"),
        (["--listen", "127.0.0.1:0", "--data-listen", "127.0.0.1:65536"], "server.data_listen: port 65536"),
    ],
)
def test_bad_addresses_are_config_errors_not_tracebacks(flags, said):
    refused(serve(*flags), 2, said)


def test_a_name_that_does_not_resolve_is_one_line(tmp_path):
    refused(serve("--listen", "no-such-host.invalid:0", "--insecure"), 1, "no-such-host.invalid")


def test_the_lock_is_per_open_file_so_one_process_cannot_take_it_twice(tmp_path):
    first = DirectoryLock(tmp_path, key="store.nvme_dir", note="pid 1, gRPC port 2")
    with pytest.raises(DirectoryInUse, match=r"in use by another ps-daemon \(pid 1, gRPC port 2\)"):
        DirectoryLock(tmp_path, key="store.nvme_dir", note="second")
    first.release()
    DirectoryLock(tmp_path, key="store.nvme_dir", note="third").release()


def test_removed_state_dir_flag_is_accepted_with_a_warning(daemon_factory, tmp_path: Path):
    daemon = daemon_factory("--state-dir", str(tmp_path / "state"))
    assert "--state-dir is no longer read" in daemon.log()
    assert "RAM only, every model is lost when this daemon stops" in daemon.log()
    assert not (tmp_path / "state").exists()


def test_json_logs_are_one_object_per_line(daemon_factory):
    import json

    daemon = daemon_factory("--log-format", "json")
    lines = daemon.log().splitlines()
    entries = [json.loads(line) for line in lines if line.startswith("{")]  # (gRPC's C core writes its own)
    assert not [line for line in lines if " INFO " in line or " WARNING " in line]  # no text records
    assert any(e["message"].startswith("ps-daemon listening on 127.0.0.1:0") for e in entries)
    assert {"time", "level", "logger", "message"} <= entries[0].keys()


def test_a_metrics_port_in_use_leaves_the_daemon_serving_without_metrics(daemon_factory, tmp_path):
    """A node agent on the metrics port (node-exporter's 9100) must not keep the trainers'
    daemon down: it serves, and says at ERROR why it has no metrics."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = tmp_path / "daemon.toml"
        config.write_text(f'[metrics]\nlisten = "127.0.0.1:{taken.getsockname()[1]}"\n')
        daemon = daemon_factory(config=config)
        assert "no metrics:" in daemon.log() and "metrics.listen" in daemon.log()
        with grpc.insecure_channel(daemon.address) as channel:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_a_health_port_in_use_refuses_naming_the_key(daemon):
    """The probes' port is the orchestrator's way to see the daemon: taken, the daemon does
    not start half-visible; it refuses, naming the key and who holds the port."""
    result = serve("--listen", "127.0.0.1:0", "--data-listen", "off", "--config", _health_config(daemon.port))
    refused(result, 1, "server.health_listen", f"port is in use by pid {daemon.process.pid}")


def _health_config(port: int) -> str:
    path = Path(tempfile.mkdtemp()) / "health.toml"
    path.write_text(f'[server]\nhealth_listen = "127.0.0.1:{port}"\n')
    return str(path)
