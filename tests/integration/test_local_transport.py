"""The local shared-memory transport against real daemons, through the connections' slots: it is
picked on the daemon's own host (training through it, bit-identical to the TCP data plane, is
in test_local_windows.py), whoever cannot use it (another uid, another network namespace) is
refused and falls back to TCP, a trainer killed mid-write applies nothing, and bad input is
answered without harm."""

from __future__ import annotations

import contextlib
import fcntl
import grp
import itertools
import mmap
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import uuid

import grpc
import pytest
import torch

from bench import netns
from ps_offload import trainer
from ps_offload.daemon.local import LocalDaemon
from ps_offload.proto import ps_pb2
from ps_offload.proto.frames import frame, recv_message, send_message
from ps_offload.proto.pull import Pull
from ps_offload.proto.push import Push
from ps_offload.proto.security import ClientSecurity
from ps_offload.trainer.wire.daemon_client import DaemonClient
from ps_offload.trainer.wire.dataplane_client import DataPlaneClient, DataPlaneError
from ps_offload.trainer.wire.local_client import LocalClient
from ps_offload.trainer.wire.sharded_client import ShardedClient
from tests.helpers.payloads import tensor_bytes
from tests.helpers.specs import local_spec
from tests.helpers.waiting import until

NUMEL = 1024
_models = itertools.count()
SLOT = NUMEL * 4


def _register(address: str, model: str, **config) -> ShardedClient:
    """A model of 3 shards, each set to 1.0 (version 0)."""
    client = ShardedClient([address], config=trainer.ClientConfig(**({"transport": "local"} | config)))
    for shard in client.register(local_spec(model)):
        ones = torch.ones(shard.numel)
        client.push(shard, Push.parameters(model, shard.shard_id, tensor_bytes(ones), step=0))
    return client


def _endpoint(address: str) -> str:
    client = DaemonClient(address, max_message_bytes=8 << 20)
    try:
        spec = local_spec("endpoint-probe")
        spec.daemons.append(address)
        return client.register(spec, 0, timeout=30).local_endpoint
    finally:
        client.close()


def _grpc_pull(address: str, model: str, shard_id: int = 0, dtype: int = ps_pb2.FLOAT32) -> tuple[int, bytes]:
    client = DaemonClient(address, max_message_bytes=8 << 20)
    try:
        out = bytearray(NUMEL * (2 if dtype == ps_pb2.BFLOAT16 else 4))
        version = client.pull_into(
            Pull.of(model, shard_id, min_version=0, dtype=dtype), out=memoryview(out), timeout=30
        )
        return version, bytes(out)
    finally:
        client.close()


def _slot_maps(daemon: LocalDaemon) -> int:
    """How many local slots the daemon has mapped."""
    with open(f"/proc/{daemon.process.pid}/maps") as maps:
        return sum("memfd:ps-offload-slot" in line for line in maps)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    daemon = LocalDaemon(tmp_path_factory.mktemp("local"))
    try:
        yield daemon
    finally:
        daemon.kill()


# -- the path taken, and its results -----------------------------------------------------------


def test_a_bf16_pull_through_the_slot_equals_the_data_plane_one(daemon):
    model = "bf16"
    client = _register(daemon.address, model)
    tcp = _register(daemon.address, model, transport="tcp")
    try:
        assert type(client.transports[0]) is LocalClient and type(tcp.transports[0]) is DataPlaneClient
        shard = client.plan[0]
        grad = torch.linspace(-3, 3, NUMEL) * 1e-3
        client.push(shard, Push.gradient(model, 0, tensor_bytes(grad), step=0))
        local_out, tcp_out = torch.empty(NUMEL, dtype=torch.bfloat16), torch.empty(NUMEL, dtype=torch.bfloat16)
        for client_, out in ((client, local_out), (tcp, tcp_out)):
            view = memoryview(out.view(torch.int16).numpy()).cast("B")
            assert client_.pull(shard, min_version=1, out=view, dtype=ps_pb2.BFLOAT16) == 1
        assert torch.equal(local_out.view(torch.int16), tcp_out.view(torch.int16))
        version, fp32 = _grpc_pull(daemon.address, model)
        expected = torch.frombuffer(bytearray(fp32), dtype=torch.float32).to(torch.bfloat16)
        assert version == 1 and torch.equal(local_out.view(torch.int16), expected.view(torch.int16))
    finally:
        client.close()
        tcp.close()


def test_a_pull_waits_for_its_version_up_to_its_deadline(daemon):
    model = "waiting"
    client = _register(daemon.address, model)
    local = client.transports[0]
    assert type(local) is LocalClient
    out = torch.empty(NUMEL)
    with pytest.raises(DataPlaneError) as info:
        local.pull_into(Pull.of(model, 0, min_version=1), out=tensor_bytes(out), timeout=0.5)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    pulled = {}
    waiter = threading.Thread(
        target=lambda: pulled.update(
            version=local.pull_into(Pull.of(model, 0, min_version=1), out=tensor_bytes(out), timeout=120)
        )
    )
    waiter.start()
    # The push takes another connection of the pool while the pull waits on its own.
    client.push(client.plan[0], Push.gradient(model, 0, tensor_bytes(torch.ones(NUMEL)), step=0))
    waiter.join(180)
    assert pulled == {"version": 1} and torch.equal(out, torch.full((NUMEL,), 1 - 0.1, dtype=torch.float32))
    client.close()


def test_the_pool_keeps_the_connections_its_pulls_and_pushes_use_at_once(daemon):
    """Pulls and pushes run on pools of their own, each up to streams_per_daemon calls: the
    client keeps twice that many connections between bursts instead of closing some at release
    and opening them again for the next burst (a daemon thread, a session and a slot each)."""
    model = "bursts"
    client = _register(daemon.address, model, streams_per_daemon=2)
    local = client.transports[0]
    assert type(local) is LocalClient
    opened = []  # connections opened by each burst
    for version in (1, 2):  # pulls that each hold a connection until a push lands, and the push
        before = local.connections_opened
        outs = [torch.empty(NUMEL) for _ in range(2 * client.config.streams_per_daemon - 1)]  # pulls, then a push
        pull = Pull.of(model, 0, min_version=version)
        versions: list[int] = []
        waiters = [
            threading.Thread(
                target=lambda o=o, pull=pull, versions=versions: versions.append(
                    local.pull_into(pull, out=tensor_bytes(o), timeout=120)
                )
            )
            for o in outs
        ]
        for waiter in waiters:
            waiter.start()
        count = len(waiters)
        until(lambda count=count: local.connections_in_use == count, what=f"{count} pulls waiting")
        client.push(client.plan[0], Push.gradient(model, 0, tensor_bytes(torch.ones(NUMEL)), step=version - 1))
        for waiter in waiters:
            waiter.join(180)
        assert versions == [version] * len(outs) and all(torch.equal(o, outs[0]) for o in outs)
        opened.append(local.connections_opened - before)
    assert opened[0] >= 1 and opened[1] == 0, opened  # the first burst grew the pool; the second found it
    client.close()


# -- who cannot use it --------------------------------------------------------------------------

# Started as root, for the interpreter lives where only root may read; it becomes uid 65534
# (nobody) once everything it needs is imported, before it connects.
_OTHER_UID_CLIENT = """
import os, sys, torch
from ps_offload.proto import ps_pb2
from ps_offload.trainer.wire.dataplane_client import DataPlaneError
from ps_offload.trainer.wire.local_client import LocalClient
from ps_offload.trainer.config import ClientConfig
from ps_offload.trainer.wire.sharded_client import ShardedClient
address, model, endpoint, spec, gid, groups = sys.argv[1:]
import encodings.idna  # imported lazily by the first connect, from where nobody may read
import logging
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
os.setgroups([int(g) for g in groups.split(",") if g])
os.setgid(int(gid))
os.setuid(65534)
try:
    LocalClient(endpoint, slot_bytes=4096, max_connections=1)
    print("local: accepted")
except DataPlaneError as error:
    print("local:", error.code().name)
client = ShardedClient([address], config=ClientConfig(transport="local"))
plan = client.register(ps_pb2.ModelSpec.FromString(bytes.fromhex(spec)))
out = torch.empty(plan[0].numel)
version = client.pull(plan[0], min_version=0, out=memoryview(out.numpy()).cast("B"))
print("transport:", type(client.transports[0]).__name__, "version:", version, "sum:", int(out.sum()))
client.close()
"""


def _as_nobody(daemon: LocalDaemon, model: str, gid: int, groups: tuple[int, ...] = ()) -> subprocess.CompletedProcess:
    """_OTHER_UID_CLIENT as uid 65534 with group `gid` and supplementary `groups`."""
    _register(daemon.address, model).close()
    return subprocess.run(
        [sys.executable, "-c", _OTHER_UID_CLIENT, daemon.address, model, _endpoint(daemon.address),
         local_spec(model).SerializeToString().hex(), str(gid), ",".join(map(str, groups))],
        env={**os.environ, "HOME": "/tmp"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.skipif(os.geteuid() != 0, reason="running a client as another uid needs root")
def test_another_uid_is_refused_and_uses_the_data_plane_saying_why(daemon):
    done = _as_nobody(daemon, "other-uid", 65534)
    assert done.returncode == 0, done.stderr
    assert "local: PERMISSION_DENIED" in done.stdout
    assert f"transport: DataPlaneClient version: 0 sum: {NUMEL}" in done.stdout
    assert "WARNING" in done.stderr and "uid 65534 is neither (server.local_group" in done.stderr
    assert "uid 65534 is neither" in daemon.log()


def _nogroup() -> str:
    if os.geteuid() != 0:
        return "running a client as another uid needs root"
    try:
        return "" if grp.getgrnam("nogroup").gr_gid == 65534 else "nogroup is not gid 65534 here"
    except KeyError:
        return "no group nogroup on this host"


@pytest.fixture(scope="module")
def grouped(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("grouped")
    (workdir / "daemon.toml").write_text('[server]\nlocal_group = "nogroup"\n')
    daemon = LocalDaemon(workdir / "d", "--config", str(workdir / "daemon.toml"))
    try:
        yield daemon
    finally:
        daemon.kill()


@pytest.mark.skipif(bool(_nogroup()), reason=_nogroup() or "-")
@pytest.mark.parametrize(("gid", "groups"), [(65534, ()), (1, (65534,))], ids=["its-group", "a-supplementary-group"])
def test_another_uid_in_the_local_group_shares_memory(grouped, gid, groups):
    done = _as_nobody(grouped, f"grouped-{gid}", gid, groups)
    assert done.returncode == 0, done.stderr
    assert "local: accepted" in done.stdout
    assert f"transport: LocalClient version: 0 sum: {NUMEL}" in done.stdout
    assert "WARNING" not in done.stderr


@pytest.mark.skipif(bool(_nogroup()), reason=_nogroup() or "-")
def test_another_uid_outside_the_local_group_is_refused(grouped):
    done = _as_nobody(grouped, "ungrouped", 1)
    assert done.returncode == 0, done.stderr
    assert "local: PERMISSION_DENIED" in done.stdout and "transport: DataPlaneClient" in done.stdout
    assert "shares memory with processes of its own uid and of group 'nogroup'; uid 65534 is neither" in done.stderr


def _namespace_unavailable() -> str:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    return ""


@pytest.mark.skipif(bool(_namespace_unavailable()), reason=_namespace_unavailable() or "")
def test_a_client_in_another_network_namespace_cannot_reach_it_and_uses_tcp(tmp_path):
    name = f"psl-{uuid.uuid4().hex[:6]}"  # not test_network_faults' fixed names
    try:
        namespace = netns.namespace(name, subnet=f"10.213.{random.randrange(1, 250)}")
        ns = namespace.__enter__()
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot make a network namespace: {exc.stderr}")
    try:
        daemon = LocalDaemon(tmp_path / "d", "--insecure", host=ns.ns_ip, launcher=ns.launcher)
        try:
            endpoint = _endpoint(daemon.address)
            assert endpoint.startswith("ps-offload-")  # offered, and not reachable from here:
            with pytest.raises(DataPlaneError) as info:
                LocalClient(endpoint, slot_bytes=SLOT, max_connections=1)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            client = _register(daemon.address, "netns")
            assert type(client.transports[0]) is DataPlaneClient
            out = torch.empty(NUMEL)
            assert client.pull(client.plan[0], min_version=0, out=tensor_bytes(out)) == 0
            assert torch.equal(out, torch.ones(NUMEL))
            client.close()
        finally:
            daemon.kill()
    finally:
        namespace.__exit__(None, None, None)


# -- crashes and bad input ------------------------------------------------------------------

_HALF_WRITER = """
import sys, torch
from ps_offload.trainer.wire.local_client import LocalClient
endpoint, numel = sys.argv[1], int(sys.argv[2])
client = LocalClient(endpoint, slot_bytes=numel * 4, max_connections=1)
conn = client._idle.get_nowait()
conn.slot.bytes[: numel * 2].copy_(torch.full((numel // 2,), 7.0).view(torch.uint8))  # half a gradient
print("half written", flush=True)
sys.stdin.read()  # SIGKILLed here, before any header
"""


def test_a_trainer_killed_mid_write_leaves_the_shard_unchanged(daemon):
    model = "killed"
    client = _register(daemon.address, model)
    shard = client.plan[0]
    client.push(shard, Push.gradient(model, 0, tensor_bytes(torch.ones(NUMEL)), step=0))
    before = _grpc_pull(daemon.address, model)
    assert before[0] == 1
    mapped = _slot_maps(daemon)
    writer = subprocess.Popen(
        [sys.executable, "-c", _HALF_WRITER, _endpoint(daemon.address), str(NUMEL)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert writer.stdout.readline().strip() == "half written"
        assert _slot_maps(daemon) == mapped + 1  # its slot, mapped in the daemon
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=60)
    finally:
        writer.kill()
    until(lambda: _slot_maps(daemon) == mapped, "the dead trainer's slot unmapped")
    assert _grpc_pull(daemon.address, model) == before
    # Still serving: the next step goes through the slot and applies once.
    ack = client.push(shard, Push.gradient(model, 0, tensor_bytes(torch.ones(NUMEL)), step=1))
    assert ack.applied and ack.version == 2
    after = _grpc_pull(daemon.address, model)
    # A resent step (other bytes in the slot now): acknowledged, nothing applied.
    ack = client.push(shard, Push.gradient(model, 0, tensor_bytes(torch.full((NUMEL,), 9.0)), step=1))
    assert not ack.applied and ack.version == 2
    assert _grpc_pull(daemon.address, model) == after
    client.close()


@contextlib.contextmanager
def _raw(endpoint: str, *, slot_bytes: int = 64, seal: bool = True, fds: int = 1):
    """A hand-made local connection; its first frame carries `fds` memfds of `slot_bytes`."""
    memfds = []
    for _ in range(fds):
        fd = os.memfd_create("ps-offload-slot", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, slot_bytes)
        if seal:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        memfds.append(fd)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(60)
    try:
        sock.connect("\0" + endpoint)
        socket.send_fds(sock, [frame(ps_pb2.DataRequest())], memfds)
        yield sock, (mmap.mmap(memfds[0], slot_bytes) if memfds else None)
    finally:
        sock.close()
        for fd in memfds:
            os.close(fd)


@pytest.mark.parametrize(
    "how, message",
    [
        (dict(fds=0), "with exactly one fd"),
        (dict(fds=2), "with exactly one fd"),
        (dict(seal=False), "sealed with F_SEAL_SHRINK"),
    ],
    ids=["no-fd", "two-fds", "unsealed"],
)
def test_a_bad_first_frame_is_refused_with_a_reason(daemon, how, message):
    model = f"first-{next(_models)}"
    client = _register(daemon.address, model)
    with _raw(_endpoint(daemon.address), **how) as (sock, _):
        answer = recv_message(sock, ps_pb2.DataResponse)
        assert answer.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and message in answer.message
        assert sock.recv(1) == b""  # and closed
    out = torch.empty(NUMEL)
    assert client.pull(client.plan[0], min_version=0, out=tensor_bytes(out)) == 0  # still serving
    client.close()


def test_a_push_larger_than_the_slot_is_invalid_argument_and_changes_nothing(daemon):
    model = "oversized"
    _register(daemon.address, model).close()
    with _raw(_endpoint(daemon.address), slot_bytes=SLOT // 2) as (sock, slot):
        assert recv_message(sock, ps_pb2.DataResponse).code == 0  # the slot is taken
        header = Push.gradient(model, 0, tensor_bytes(torch.ones(NUMEL)), step=0).header
        in_slot = ps_pb2.LocalRef(window=0, offset=0, nbytes=SLOT)
        send_message(sock, ps_pb2.DataRequest(push=header, local=in_slot))
        answer = recv_message(sock, ps_pb2.DataResponse)
        assert answer.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert f"{SLOT} bytes at offset 0 do not fit the local slot of {SLOT // 2} bytes" in answer.message
        # The connection is still in step: a pull that does not fit is refused the same way.
        send_message(sock, ps_pb2.DataRequest(pull=ps_pb2.PullRequest(model=model, shard_id=0)))
        answer = recv_message(sock, ps_pb2.DataResponse)
        assert answer.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "do not fit" in answer.message
        # A bf16 pull does fit, and lands in the slot.
        request = ps_pb2.PullRequest(model=model, shard_id=0, dtype=ps_pb2.BFLOAT16)
        send_message(sock, ps_pb2.DataRequest(pull=request))
        assert recv_message(sock, ps_pb2.DataResponse).shard.numel == NUMEL
        assert (
            bytes(slot[: NUMEL * 2])
            == tensor_bytes(torch.ones(NUMEL, dtype=torch.bfloat16).view(torch.int16)).tobytes()
        )
        slot.close()
    assert _grpc_pull(daemon.address, model) == (0, tensor_bytes(torch.ones(NUMEL)).tobytes())


def test_the_token_is_checked_on_every_local_request(daemon_factory, tmp_path):
    token = tmp_path / "token"
    token.write_text("local-token-0123456789\n")
    config = tmp_path / "auth.toml"
    config.write_text(f'[auth]\ntoken_file = "{token}"\nrequire_token = "all"\n')
    daemon = daemon_factory(config=config)
    right = ClientSecurity(token_file=str(token))
    client = _register(daemon.address, "tokens", security=right)
    assert type(client.transports[0]) is LocalClient
    out = torch.empty(NUMEL)
    assert client.pull(client.plan[0], min_version=0, out=tensor_bytes(out)) == 0
    client.close()
    endpoint = client.transports[0].endpoint
    plain = LocalClient(endpoint, slot_bytes=SLOT, max_connections=1)
    with pytest.raises(DataPlaneError) as info:
        plain.pull_into(Pull.of("tokens", 0, min_version=0), out=tensor_bytes(out), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    plain.close()


def test_stopping_the_daemon_closes_its_local_connections(daemon_factory):
    daemon = daemon_factory()
    client = _register(daemon.address, "stopping")
    local = client.transports[0]
    assert type(local) is LocalClient
    assert daemon.stop() == 0
    with pytest.raises(DataPlaneError) as info:
        local.pull_into(Pull.of("stopping", 0, min_version=0), out=tensor_bytes(torch.empty(NUMEL)), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    client.close()


def test_a_restarted_daemon_is_reattached_through_its_new_endpoint(tmp_path):
    """The endpoint's name is new at every start: a trainer whose daemon was SIGKILLed and
    restarted (same port, NVMe state recovered) finds its slot's connection gone, asks the
    daemon again, and goes on over the local transport at the new endpoint, with every
    committed update there."""
    nvme = str(tmp_path / "nvme")
    first = LocalDaemon(tmp_path / "first", "--nvme-dir", nvme)
    second = None
    try:
        client = _register(first.address, "restarted", retry_seconds=60.0, backoff_seconds=0.05)
        before = client.transports[0]
        assert type(before) is LocalClient
        shard = client.plan[0]
        push = Push.gradient(client.model, shard.shard_id, tensor_bytes(torch.full((shard.numel,), 0.5)), step=0)
        assert client.push(shard, push).applied
        committed = torch.empty(shard.numel)
        assert client.pull(shard, min_version=1, out=tensor_bytes(committed)) == 1
        first.process.send_signal(signal.SIGKILL)
        first.process.wait()
        second = LocalDaemon(tmp_path / "second", "--nvme-dir", nvme, "--listen", f"127.0.0.1:{first.port}")
        out = torch.empty(shard.numel)
        assert client.pull(shard, min_version=1, out=tensor_bytes(out)) == 1  # retried until re-attached
        after = client.transports[0]
        assert type(after) is LocalClient and after.endpoint != before.endpoint
        assert torch.equal(out, committed) and not torch.equal(out, torch.ones(shard.numel))
        client.close()
    finally:
        first.kill()
        if second is not None:
            second.kill()
