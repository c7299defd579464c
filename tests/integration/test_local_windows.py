"""The local transport's windows against real daemons: a trainer's buffers in memory it shares
with its node's daemon are pulled into and pushed from where they lie (no copy on its side),
training through them is bit-identical to the TCP data plane, the node's pool bounds them
(a refused window trains through the slot), a dead trainer's windows are reclaimed, a
restarted daemon gets them again, bad references change nothing, a request the daemon never
finishes stops the trainer loudly, and Stats says which path each client uses."""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import sys

import grpc
import pytest
import torch

from ps_admin import client as admin_client
from ps_offload import trainer
from ps_offload.daemon.dataplane.local_pool import MAX_WINDOWS_PER_CLIENT
from ps_offload.daemon.local import LocalDaemon
from ps_offload.proto import ps_pb2
from ps_offload.proto.frames import frame, recv_message, send_message
from ps_offload.proto.pull import Pull
from ps_offload.proto.push import Push
from ps_offload.proto.shared_memory import sealed_memfd
from ps_offload.trainer.io.device import byte_view
from ps_offload.trainer.wire import local_client
from ps_offload.trainer.wire.dataplane_client import DataPlaneClient, DataPlaneError
from ps_offload.trainer.wire.local_client import LocalClient, LocalFenceError
from ps_offload.trainer.wire.sharded_client import ShardedClient
from tests.helpers.specs import local_spec
from tests.helpers.training import mlp_case, train_offloaded
from tests.helpers.waiting import until

NUMEL = 1024


def _client(address: str, model: str, **config) -> ShardedClient:
    client = ShardedClient([address], config=trainer.ClientConfig(**({"transport": "local"} | config)))
    client.register(local_spec(model))
    return client


def _local(client: ShardedClient) -> LocalClient:
    local = client.transports[0]
    assert type(local) is LocalClient
    return local


def _grpc_pull(address: str, model: str, shard_id: int, dtype: int = ps_pb2.FLOAT32) -> bytes:
    reader = ShardedClient([address], config=trainer.ClientConfig(transport="grpc"))
    reader.register(local_spec(model))
    out = bytearray(NUMEL * (2 if dtype == ps_pb2.BFLOAT16 else 4))
    reader.pull(reader.plan[shard_id], min_version=0, out=memoryview(out), dtype=dtype)
    reader.close()
    return bytes(out)


def _stats(address: str) -> ps_pb2.StatsResponse:
    return admin_client.stats(address, 30)


def _window_maps(daemon: LocalDaemon) -> int:
    with open(f"/proc/{daemon.process.pid}/maps") as maps:
        return sum("memfd:ps-offload-window" in line for line in maps)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    daemon = LocalDaemon(tmp_path_factory.mktemp("windows"))
    try:
        yield daemon
    finally:
        daemon.kill()


def _pool_config(tmp_path, nbytes: int):
    config = tmp_path / "pool.toml"
    config.write_text(f"[server]\nlocal_pool_bytes = {nbytes}\n")
    return config


# -- training in place ---------------------------------------------------------------------


@pytest.mark.parametrize("pool", ["room", "full"])
def test_training_in_windows_is_bit_identical_to_the_data_plane(pool, daemon_factory, tmp_path):
    """With room in the pool, the flat parameters and gradients live in windows and every
    pull and push moves in place (no byte through the slot); with the pool too small for
    them, the same training goes through the slot. Both equal the TCP data plane's."""
    daemon = daemon_factory(config=_pool_config(tmp_path, 1 << 30 if pool == "room" else 4096))
    model, batches, loss_fn = mlp_case()
    batches = batches[:8]
    results = {}
    for transport, kind in (("local", LocalClient), ("tcp", DataPlaneClient)):
        ours = copy.deepcopy(model)
        with trainer.offload(
            ours,
            daemons=[daemon.address],
            optimizer=trainer.AdamW(lr=3e-3, weight_decay=0.1),
            config=trainer.OffloadConfig(shard_bytes=8192, model_name=f"train-{transport}"),
            client=trainer.ClientConfig(transport=transport),
        ) as opt:
            assert len(opt.plan) >= 2 and [type(t) for t in opt.client.transports] == [kind]
            train_offloaded(ours, batches, loss_fn, opt)
            if transport == "local":
                local, windows = _local(opt.client), opt.client.transports.host_windows
                in_window = windows.find(byte_view(opt.flat.values)) is not None
                used = _stats(daemon.address).local_pool_bytes_used
                if pool == "room":
                    assert in_window and windows.find(byte_view(opt.flat.grads)) is not None
                    assert local.bytes_in_place > 0 and local.bytes_copied == 0
                    assert used == 2 * opt.flat.numel * 4
                    # Every step's pulls came with its pushes, written by the updates (pull_into).
                    assert local.pulls_carried == len(batches) * len(opt.plan)
                else:
                    assert not in_window and local.bytes_in_place == 0 and local.bytes_copied > 0
                    assert used == 0 and local.pulls_carried == 0
        assert not torch.equal(ours[0].weight, model[0].weight)  # trained
        results[transport] = ours
    for (name, local), tcp in zip(results["local"].named_parameters(), results["tcp"].parameters(), strict=True):
        assert torch.equal(local, tcp), f"{name}: max |diff| {(local - tcp).abs().max().item()}"
    until(lambda: _stats(daemon.address).local_pool_bytes_used == 0, "the windows given back at close")


def test_a_push_is_read_in_place_and_leaves_the_gradient_as_it_was(daemon):
    client = _client(daemon.address, "in-place-push")
    shard = client.plan[0]
    grad = client.transports.shared_host_tensor(NUMEL, torch.float32)
    assert grad is not None
    client.push(shard, Push.parameters(client.model, shard.shard_id, byte_view(torch.ones(NUMEL))))
    grad.copy_(torch.linspace(-1, 1, NUMEL))
    kept = grad.clone()
    copied = _local(client).bytes_copied
    assert client.push(shard, Push.gradient(client.model, shard.shard_id, byte_view(grad), step=0)).applied
    assert _local(client).bytes_copied == copied  # read where it lies
    assert torch.equal(grad, kept)
    expected = torch.nn.Parameter(torch.ones(NUMEL))  # the daemon's step: torch's fused SGD
    expected.grad = kept.clone()
    torch.optim.SGD([expected], lr=0.1, fused=True).step()
    expected = expected.detach()
    assert _grpc_pull(daemon.address, "in-place-push", 0) == byte_view(expected).tobytes()
    client.close()


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "odd-element"])
def test_a_bf16_pull_is_rounded_into_place_as_the_data_plane_rounds_it(daemon, offset):
    """Word-aligned, the daemon rounds straight into the window; at an odd bf16 element it
    rounds into its scratch and copies. Either way the bytes equal a gRPC bf16 pull's."""
    model = f"bf16-into-{offset}"
    client = _client(daemon.address, model)
    shard = client.plan[1]
    values = torch.randn(NUMEL, generator=torch.Generator().manual_seed(3))
    client.push(shard, Push.parameters(client.model, shard.shard_id, byte_view(values)))
    window = client.transports.shared_host_tensor(NUMEL + 1, torch.bfloat16)
    assert window is not None
    target = window[offset : offset + NUMEL]
    copied = _local(client).bytes_copied
    assert client.pull(shard, min_version=0, out=byte_view(target), dtype=ps_pb2.BFLOAT16) == 0
    assert _local(client).bytes_copied == copied  # written in place by the daemon
    assert byte_view(target).tobytes() == _grpc_pull(daemon.address, model, 1, ps_pb2.BFLOAT16)
    assert torch.equal(target, values.to(torch.bfloat16))
    client.close()


# -- bad references change nothing -----------------------------------------------------------


@pytest.mark.parametrize(
    "ref, message",
    [
        (dict(window=1, offset=NUMEL * 4 - 8, nbytes=NUMEL * 4), "do not fit window 1"),
        (dict(window=9, offset=0, nbytes=NUMEL * 4), "window 9 is not attached"),
        (dict(window=1, offset=0, nbytes=16), "16 bytes were written for it, its header says"),
    ],
    ids=["past-the-end", "unknown-window", "wrong-length"],
)
def test_a_bad_reference_is_invalid_argument_and_changes_nothing(daemon, ref, message):
    model = f"bad-ref-{ref['window']}-{ref['nbytes']}"
    client = _client(daemon.address, model)
    shard = client.plan[0]
    client.push(shard, Push.parameters(client.model, shard.shard_id, byte_view(torch.ones(NUMEL))))
    assert client.transports.shared_host_tensor(NUMEL, torch.float32) is not None  # window 1
    before = _grpc_pull(daemon.address, model, 0)
    local = _local(client)
    header = Push.gradient(model, 0, byte_view(torch.ones(NUMEL)), step=0).header
    with local._connection(30, fence=False) as conn:
        send_message(conn.sock, ps_pb2.DataRequest(push=header, local=ps_pb2.LocalRef(**ref)))
        answer = recv_message(conn.sock, ps_pb2.DataResponse)
    assert answer.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and message in answer.message, answer.message
    assert _grpc_pull(daemon.address, model, 0) == before
    assert client.push(
        shard, Push.gradient(client.model, shard.shard_id, byte_view(torch.ones(NUMEL)), step=0)
    ).applied  # still serving
    client.close()


@pytest.mark.parametrize(
    "pull_into, kind, message",
    [
        (dict(window=1, offset=0, nbytes=NUMEL * 2), "gradient", f"must be {NUMEL * 4} bytes ({NUMEL} float32)"),
        (dict(window=1, offset=2, nbytes=NUMEL * 4), "gradient", "at an offset aligned for float32"),
        (dict(window=0, offset=0, nbytes=NUMEL * 4), "gradient", "in an attached window"),
        (dict(window=9, offset=0, nbytes=NUMEL * 4), "gradient", "window 9 is not attached"),
        (dict(window=2, offset=0, nbytes=NUMEL * 4), "gradient", "its pull_into overlaps its payload"),
        (dict(window=1, offset=0, nbytes=NUMEL * 4), "parameters", "is for GRADIENT and APPLY pushes"),
    ],
    ids=["wrong-size", "misaligned", "the-slot", "unknown-window", "overlaps-the-payload", "not-a-step"],
)
def test_a_bad_pull_into_is_invalid_argument_and_changes_nothing(daemon, pull_into, kind, message):
    """A push that asks for its new version somewhere it cannot go is refused before anything
    is read: the shard keeps its version and values, and the place is not written."""
    model = f"bad-pull-into-{pull_into['window']}-{pull_into['offset']}-{pull_into['nbytes']}-{kind}"
    client = _client(daemon.address, model)
    shard = client.plan[0]
    client.push(shard, Push.parameters(client.model, shard.shard_id, byte_view(torch.ones(NUMEL))))
    target = client.transports.shared_host_tensor(NUMEL, torch.float32)  # window 1
    grad = client.transports.shared_host_tensor(NUMEL, torch.float32)  # window 2: the payload
    assert target is not None and grad is not None
    target.fill_(5.0)
    grad.copy_(torch.linspace(-1, 1, NUMEL))
    before = _grpc_pull(daemon.address, model, 0)
    local = _local(client)
    kinds = {"gradient": ps_pb2.GRADIENT, "parameters": ps_pb2.PARAMETERS}
    push = Push.unchecked(model, 0, byte_view(grad), step=0, kind=kinds[kind])
    request = ps_pb2.DataRequest(
        push=push.header, local=local._ref(byte_view(grad))._asdict(), pull_dtype=ps_pb2.FLOAT32
    )
    request.pull_into.CopyFrom(ps_pb2.LocalRef(**pull_into))
    with local._connection(30, fence=False) as conn:
        send_message(conn.sock, request)
        answer = recv_message(conn.sock, ps_pb2.DataResponse)
    assert answer.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and message in answer.message, answer.message
    assert _grpc_pull(daemon.address, model, 0) == before and torch.equal(target, torch.full((NUMEL,), 5.0))
    ack = client.push(shard, Push.gradient(client.model, shard.shard_id, byte_view(grad), step=0))  # still serving
    assert ack.applied and not ack.pulled
    client.close()


@pytest.mark.parametrize(
    "number, fds, message",
    [
        (0, 1, "window 0 is the connection's slot"),
        (1, 1, "window 1 is attached already"),
        (7, 0, "exactly one memfd (0 came)"),
        (7, 2, "exactly one memfd (2 came)"),
    ],
    ids=["window-0", "taken-number", "no-fd", "two-fds"],
)
def test_a_bad_attach_is_invalid_argument_and_maps_nothing(daemon, number, fds, message):
    client = _client(daemon.address, f"bad-attach-{number}-{fds}")
    assert client.transports.shared_host_tensor(NUMEL, torch.float32) is not None  # window 1
    local, used = _local(client), _stats(daemon.address).local_pool_bytes_used
    memfds = [sealed_memfd(4096, "ps-offload-window") for _ in range(fds)]
    try:
        with local._connection(30, fence=False) as conn:
            attach = ps_pb2.LocalAttach(client=local.client_id, window=number)
            socket.send_fds(conn.sock, [frame(ps_pb2.DataRequest(attach=attach))], memfds)
            answer = recv_message(conn.sock, ps_pb2.DataResponse)
    finally:
        for fd in memfds:
            os.close(fd)
    assert answer.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and message in answer.message, answer.message
    assert _stats(daemon.address).local_pool_bytes_used == used
    client.close()


def test_a_client_past_its_window_count_is_refused(daemon):
    client = _client(daemon.address, "many-windows")
    granted = [client.transports.shared_host_tensor(16, torch.float32) for _ in range(MAX_WINDOWS_PER_CLIENT + 1)]
    assert all(w is not None for w in granted[:MAX_WINDOWS_PER_CLIENT]) and granted[-1] is None
    assert len(client.transports.host_windows.windows) == MAX_WINDOWS_PER_CLIENT  # the refused one is not kept
    client.close()


# -- lifetimes ---------------------------------------------------------------------------------

_LOOPING_TRAINER = """
import sys, torch
from ps_offload import trainer
from ps_offload.proto import ps_pb2
from ps_offload.proto.push import Push
from ps_offload.trainer.io.device import byte_view
from ps_offload.trainer.wire.sharded_client import ShardedClient
from tests.helpers.specs import local_spec
client = ShardedClient([sys.argv[1]], config=trainer.ClientConfig(transport="local"))
plan = client.register(local_spec(sys.argv[2]))
window = client.transports.shared_host_tensor(plan[0].numel, torch.float32)
assert window is not None
print("attached", flush=True)
while True:  # SIGKILLed in the middle of one of these
    client.pull(plan[0], min_version=0, out=byte_view(window))
    client.push(plan[0], Push.parameters(client.model, plan[0].shard_id, byte_view(window)))
"""


def test_a_trainer_killed_mid_request_has_its_windows_reclaimed(daemon):
    model = "reclaimed"
    client = _client(daemon.address, model)
    client.push(
        client.plan[0], Push.parameters(client.model, client.plan[0].shard_id, byte_view(torch.full((NUMEL,), 2.0)))
    )
    maps, used = _window_maps(daemon), _stats(daemon.address).local_pool_bytes_used
    looping = subprocess.Popen(
        [sys.executable, "-c", _LOOPING_TRAINER, daemon.address, model], stdout=subprocess.PIPE, text=True
    )
    try:
        assert looping.stdout.readline().strip() == "attached"
        stats = _stats(daemon.address)
        assert stats.local_pool_bytes_used == used + NUMEL * 4
        assert any(c.client == f"pid {looping.pid}" and c.shared_bytes == NUMEL * 4 for c in stats.clients)
        assert _window_maps(daemon) == maps + 1
        looping.send_signal(signal.SIGKILL)
        looping.wait(timeout=60)
    finally:
        looping.kill()
    until(lambda: _window_maps(daemon) == maps, "the dead trainer's window unmapped")
    assert _stats(daemon.address).local_pool_bytes_used == used
    assert _grpc_pull(daemon.address, model, 0) == byte_view(torch.full((NUMEL,), 2.0)).tobytes()
    client.close()


def test_a_restarted_daemon_gets_the_windows_again(tmp_path):
    nvme = str(tmp_path / "nvme")
    first = LocalDaemon(tmp_path / "first", "--nvme-dir", nvme)
    second = None
    try:
        client = _client(first.address, "rewindowed", retry_seconds=60.0, backoff_seconds=0.05)
        shard = client.plan[0]
        window = client.transports.shared_host_tensor(NUMEL, torch.float32)
        window.fill_(0.25)
        assert client.push(shard, Push.parameters(client.model, shard.shard_id, byte_view(window))).applied
        first.process.send_signal(signal.SIGKILL)
        first.process.wait()
        second = LocalDaemon(tmp_path / "second", "--nvme-dir", nvme, "--listen", f"127.0.0.1:{first.port}")
        window.zero_()
        assert client.pull(shard, min_version=0, out=byte_view(window)) == 0  # retried until re-attached
        assert torch.equal(window, torch.full((NUMEL,), 0.25))
        local = _local(client)
        assert local.bytes_in_place == NUMEL * 4 and local.bytes_copied == 0  # the new client, in place
        assert _stats(second.address).local_pool_bytes_used == NUMEL * 4
        client.close()
    finally:
        first.kill()
        if second is not None:
            second.kill()


def test_a_request_the_daemon_never_finishes_stops_the_trainer(daemon_factory, monkeypatch):
    """A stopped daemon (SIGSTOP) cannot answer a pull into a window: the client's deadline
    passes, it waits FENCE_SECONDS for the daemon to let go, and then refuses every request,
    for the daemon may still write that memory."""
    monkeypatch.setattr(local_client, "FENCE_SECONDS", 0.5)
    daemon = daemon_factory()
    client = _client(daemon.address, "fenced")
    shard = client.plan[0]
    window = client.transports.shared_host_tensor(NUMEL, torch.float32)
    local = _local(client)
    daemon.process.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(DataPlaneError) as info:
            local.pull_into(Pull.of("fenced", shard.shard_id, min_version=0), out=byte_view(window), timeout=0.5)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        with pytest.raises(LocalFenceError, match="did not finish a failed request"):
            local.pull_into(Pull.of("fenced", shard.shard_id, min_version=0), out=byte_view(window), timeout=10)
    finally:
        daemon.process.send_signal(signal.SIGCONT)
    client.close()


# -- who uses which path -----------------------------------------------------------------------


def test_stats_say_which_path_each_client_uses(daemon, tmp_path):
    local = _client(daemon.address, "paths")
    assert local.transports.shared_host_tensor(NUMEL, torch.float32) is not None
    local.push(local.plan[0], Push.parameters(local.model, local.plan[0].shard_id, byte_view(torch.ones(NUMEL))))
    tcp = _client(daemon.address, "paths", transport="tcp")
    over_grpc = _client(daemon.address, "paths", transport="grpc")
    out = torch.empty(NUMEL)
    for client in (tcp, over_grpc):
        client.pull(client.plan[0], min_version=0, out=byte_view(out))
    paths = {(c.transport, c.client): c for c in _stats(daemon.address).clients}
    mine = paths[("local", f"pid {os.getpid()}")]
    assert mine.connections >= 1 and mine.shared_bytes >= NUMEL * 4
    assert paths[("data", "127.0.0.1")].connections >= 1
    assert paths[("grpc", "ipv4:127.0.0.1")].connections >= 1
    shown = subprocess.run(
        [sys.executable, "-m", "ps_admin", "stats", "--daemon", daemon.address, "--json"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    listed = json.loads(shown)["clients"]
    assert {"client": f"pid {os.getpid()}", "transport": "local"}.items() <= listed[0].items()
    for client in (local, tcp, over_grpc):
        client.close()


def test_a_pool_larger_than_the_host_refuses_to_start(tmp_path):
    config = tmp_path / "huge.toml"
    config.write_text('[server]\nlocal_pool_bytes = "1000TiB"\n')
    with pytest.raises(RuntimeError, match="server.local_pool_bytes = .* is more than the host has available"):
        LocalDaemon(tmp_path / "huge", "--config", str(config))


def test_a_bf16_model_through_staging_windows_is_bit_identical_to_the_data_plane(daemon):
    """The GPU path on the CPU (DeviceConfig(staging="always")): the host buffers are one
    window; each pull is rounded into one and copied up, each push copied down into one and
    read there. Equal, bit for bit, to the same training over the data plane."""
    model, batches, loss_fn = mlp_case()
    model = model.to(torch.bfloat16)
    batches = [(x.to(torch.bfloat16), y) for x, y in batches[:6]]
    results = {}
    for transport in ("local", "tcp"):
        ours = copy.deepcopy(model)
        with trainer.offload(
            ours,
            daemons=[daemon.address],
            optimizer=trainer.AdamW(lr=3e-3, weight_decay=0.1),
            config=trainer.OffloadConfig(shard_bytes=8192, model_name=f"staged-bf16-{transport}"),
            client=trainer.ClientConfig(transport=transport),
            device=trainer.DeviceConfig(staging="always", host_buffers=2),
        ) as opt:
            assert opt.mover.staged and opt.mover.buffers.shared == (transport == "local")
            # The first upload (the model's values, widened to fp32 once) is not in a window.
            copied = _local(opt.client).bytes_copied if transport == "local" else 0
            train_offloaded(ours, batches, loss_fn, opt)
            if transport == "local":  # every step's pulls and pushes: in place
                assert _local(opt.client).bytes_copied == copied and _local(opt.client).bytes_in_place > 0
                # The pulls came with the pushes, written by the updates into spare host buffers
                # (one each, when free: with 2 buffers and one I/O worker per buffer, some wait).
                assert _local(opt.client).pulls_carried > 0
        results[transport] = ours
    for (name, local), tcp in zip(results["local"].named_parameters(), results["tcp"].parameters(), strict=True):
        assert torch.equal(local, tcp), f"{name}: max |diff| {(local - tcp).abs().max().item()}"
