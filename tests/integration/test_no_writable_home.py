"""kernels/numba_cache.py: a daemon with nowhere for Numba to cache (its package read-only, no
writable home) still starts and serves, caching in a private directory of its own."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ps_offload.daemon.local import LocalDaemon
from ps_offload.kernels import numba_cache

KERNELS = Path(numba_cache.__file__).parent


def _can_mount_read_only() -> str:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "needs root and unshare (a read-only bind mount in a mount namespace of its own)"
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", "mount --bind / /mnt 2>&1 || true"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return "" if probe.returncode == 0 and not probe.stdout.strip() else f"mount namespaces unavailable: {probe.stdout}"


@pytest.mark.skipif(bool(_can_mount_read_only()), reason=_can_mount_read_only() or "-")
def test_a_daemon_with_nowhere_to_cache_serves(tmp_path):
    read_only = ("unshare", "--mount", "--propagation", "private", "sh", "-c",
                 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"', str(KERNELS))  # fmt: skip
    nowhere = {"HOME": "/proc", "XDG_CACHE_HOME": "/proc/no-cache", "NUMBA_CACHE_DIR": "", "TMPDIR": str(tmp_path)}
    daemon = LocalDaemon(tmp_path / "d", env=nowhere, launcher=read_only, start_timeout=300)
    try:
        with grpc.insecure_channel(daemon.address) as channel:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        assert f"caching in {tmp_path}/ps-offload-numba-{os.getuid()}" in daemon.log()
    finally:
        daemon.stop()
