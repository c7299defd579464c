"""ps-admin's gRPC client: one channel per call, through the ClientSecurity the command line
set, and every gRPC failure turned into one AdminError line that names the daemon.

Calls answer protobuf messages (views.py turns them into dicts); the streaming ones are read
inside the call, so a failure midway is an AdminError too. Nothing is retried: an operator's
command reports what it found, and running it again is the operator's choice.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ps_offload.proto import codec, ps_pb2, ps_pb2_grpc
from ps_offload.proto.channel import method_path
from ps_offload.proto.frames import split_host_port
from ps_offload.proto.plan import ShardSlice
from ps_offload.proto.pull import PullStreamError, read_pull_stream
from ps_offload.proto.push import Push
from ps_offload.proto.security import ClientSecurity

T = TypeVar("T")


class AdminError(Exception):
    """A failure worth one line on stderr (without the "ps-admin: " prefix)."""


def admin_error(daemon: str, what: str, exc: grpc.RpcError) -> AdminError:
    """The line for a failed RPC: unreachable, too slow, or refused (with the daemon's reason)."""
    code, details = exc.code(), exc.details()  # type: ignore[attr-defined]  # a grpc.Call too
    if code == grpc.StatusCode.UNAVAILABLE:
        return AdminError(f"daemon {daemon} is unreachable ({code.name}: {details}){_tls_hint(details or '')}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:  # a busy daemon and a blackholed address look alike
        return AdminError(f"daemon {daemon} did not answer in time, {what} ({code.name}: {details})")
    return AdminError(f"{what} on daemon {daemon}: {code.name}: {details}")


def _tls_hint(details: str) -> str:
    """What gRPC does not say when a plaintext client meets a TLS port ("Socket closed")."""
    if not _security.tls and ("Socket closed" in details or "handshake" in details.lower()):
        return "; if it has [tls], give its CA: --ca-file or $PS_TLS_CA_FILE"
    return ""


# How ps-admin connects (TLS, client certificate, token); set once by the main callback.
_security = ClientSecurity()


def use_security(security: ClientSecurity) -> None:
    """Every later call connects with `security`."""
    global _security
    _security = security


@contextlib.contextmanager
def channel(daemon: str) -> Iterator[grpc.Channel]:
    """A channel to `daemon`: every call of ps-admin goes through here."""
    try:
        split_host_port(daemon)
    except ValueError:  # gRPC would dial port 443 for a bare host
        raise AdminError(f"--daemon {daemon}: give host:port (its server.listen, e.g. {daemon}:50051)") from None
    # No receive limit: a daemon with many shards answers ListShards with one big message.
    options = [("grpc.max_receive_message_length", -1)]
    with _security.channel(daemon, options) as ch:
        yield ch


def rpc(daemon: str, what: str, call: Callable[[ps_pb2_grpc.AdminStub], T]) -> T:
    """Runs `call` on a fresh channel to `daemon`; turns gRPC errors into AdminError. A
    streaming call must be consumed inside `call`."""
    try:
        with channel(daemon) as ch:
            return call(ps_pb2_grpc.AdminStub(ch))
    except grpc.RpcError as exc:
        raise admin_error(daemon, what, exc) from None


def list_shards(daemon: str, model: str, timeout: float) -> list[ps_pb2.ShardInfo]:
    what = f"listing shards of model {model!r}" if model else "listing shards"
    request = ps_pb2.ListShardsRequest(model=model)
    return list(rpc(daemon, what, lambda stub: stub.ListShards(request, timeout=timeout)).shards)


def list_models(daemon: str, timeout: float) -> list[ps_pb2.ModelInfo]:
    return list(list_models_answer(daemon, timeout).models)


def list_models_answer(daemon: str, timeout: float) -> ps_pb2.ListModelsResponse:
    """The models and the daemon's release and protocol."""
    request = ps_pb2.ListModelsRequest()
    return rpc(daemon, "listing models", lambda stub: stub.ListModels(request, timeout=timeout))


def get_model(daemon: str, model: str, timeout: float) -> ps_pb2.ModelInfo:
    request = ps_pb2.GetModelRequest(model=model)
    return rpc(daemon, f"model {model!r}", lambda stub: stub.GetModel(request, timeout=timeout))


def owners(model: str, daemons: list[str], timeout: float) -> tuple[ps_pb2.ModelInfo, list[str]]:
    """The model's info and the address of every daemon of its plan: each daemon named
    answers which index it is; the others are taken from the spec's daemon list. Of a
    replicated model (ModelSpec.replicas), a named daemon that does not answer is passed
    over (another holder of its shards may); one daemon at least must answer."""
    infos, errors = [], []
    for d in daemons:
        try:
            infos.append((d, get_model(d, model, timeout)))
        except AdminError as exc:
            errors.append(exc)
    if errors and (not infos or infos[0][1].spec.replicas <= 1):
        raise errors[0]
    first_address, first = infos[0]
    addresses = list(first.spec.daemons)
    for address, info in infos:
        mine, theirs = _model_identity(first), _model_identity(info)
        if mine != theirs:
            raise AdminError(
                f"daemons {first_address} and {address} hold different models named {model!r}; "
                "name the daemons of one job with --daemon"
            )
        addresses[info.daemon_index] = address
    return first, addresses


def _model_identity(info: ps_pb2.ModelInfo) -> tuple:
    return (list(info.params), info.spec.shard_bytes, len(info.spec.daemons), list(info.shards))


def get_shard(daemon: str, model: str, shard_id: int, bins: int, timeout: float) -> ps_pb2.ShardInfo:
    """One shard's metadata, value statistics and a histogram of `bins` bins."""
    request = ps_pb2.GetShardRequest(model=model, shard_id=shard_id, histogram_bins=bins)
    what = f"shard {shard_id} of model {model!r}"
    return rpc(daemon, what, lambda stub: stub.GetShard(request, timeout=timeout))


def stats(daemon: str, timeout: float) -> ps_pb2.StatsResponse:
    return rpc(daemon, "stats", lambda stub: stub.Stats(ps_pb2.StatsRequest(), timeout=timeout))


def move(daemon: str, verb: str, model: str, shard_id: int, timeout: float) -> ps_pb2.TierResponse:
    """`verb` "evict" drops the shard from RAM (Admin.Evict); "prefetch" reads it in (Admin.Load)."""
    method = "Evict" if verb == "evict" else "Load"
    request = ps_pb2.GetShardRequest(model=model, shard_id=shard_id)
    what = f"{verb} of shard {shard_id} of model {model!r}"
    return rpc(daemon, what, lambda stub: getattr(stub, method)(request, timeout=timeout))


def drop_model(daemon: str, model: str, timeout: float) -> ps_pb2.DropModelResponse:
    request = ps_pb2.DropModelRequest(model=model)
    return rpc(daemon, f"drop of model {model!r}", lambda stub: stub.DropModel(request, timeout=timeout))


def verify(daemon: str, model: str, timeout: float, on_answer: Callable[[ps_pb2.VerifyResponse], None]) -> None:
    """Streams one daemon's Verify ("": every model), handing each answer (the plan first,
    then one verdict per shard) to `on_answer` as it comes."""
    what = f"verify of model {model!r}" if model else "verify"

    def call(stub: ps_pb2_grpc.AdminStub) -> None:
        for answer in stub.Verify(ps_pb2.VerifyRequest(model=model), timeout=timeout):
            on_answer(answer)

    rpc(daemon, what, call)


def resolve_model(daemon: str, model: str | None, timeout: float) -> str:
    """The model named, or the only one the daemon holds."""
    if model:
        return model
    names = [info.spec.model for info in list_models(daemon, timeout)]
    if len(names) != 1:
        held = f"several models ({', '.join(names)})" if names else "no model"
        raise AdminError(f"daemon {daemon} holds {held}; name one with --model")
    return names[0]


def pull_shard(daemon: str, model: str, s: ShardSlice, min_version: int, timeout: float) -> tuple[bytearray, int]:
    """A shard's master values (fp32 bytes), over ParameterServer.Pull, and the version read."""
    request = ps_pb2.PullRequest(model=model, shard_id=s.shard_id, min_version=min_version, tensor=ps_pb2.MASTER)
    return pull(daemon, request, s.numel, timeout)


def pull(daemon: str, request: ps_pb2.PullRequest, numel: int, timeout: float) -> tuple[bytearray, int]:
    """One fp32 tensor of a shard (`numel` values) as `request` asks, and the version read."""
    what = f"shard {request.shard_id}" + (f" of snapshot {request.snapshot!r}" if request.snapshot else "")
    try:
        with channel(daemon) as ch:
            stream = ch.unary_stream(
                method_path("ParameterServer", "Pull"),
                request_serializer=ps_pb2.PullRequest.SerializeToString,
                response_deserializer=codec.pull_chunks.decode,
            )
            out = bytearray(numel * 4)
            version = read_pull_stream(stream(request, timeout=timeout), out, what=what)
    except grpc.RpcError as exc:
        raise admin_error(daemon, f"pull of {what} of model {request.model!r}", exc) from None
    except PullStreamError as exc:
        raise AdminError(str(exc)) from None
    return out, version


def register(daemon: str, spec: ps_pb2.ModelSpec, index: int, timeout: float) -> ps_pb2.RegisterModelResponse:
    request = ps_pb2.RegisterModelRequest(spec=spec, daemon_index=index)
    try:
        with channel(daemon) as ch:
            return ps_pb2_grpc.ParameterServerStub(ch).RegisterModel(request, timeout=timeout)
    except grpc.RpcError as exc:
        raise admin_error(daemon, f"registration of model {spec.model!r}", exc) from None


def push_state(daemon: str, model: str, shard_id: int, step: int, data: memoryview, timeout: float) -> bool:
    """A STATE push (a shard's master and optimizer state at `step`); whether it was applied
    (False: the shard held that state already)."""
    state = Push.state(model, shard_id, data, step=step)
    try:
        with channel(daemon) as ch:
            push = ch.stream_unary(
                method_path("ParameterServer", "Push"),
                request_serializer=_identity,
                response_deserializer=ps_pb2.PushResponse.FromString,
            )
            return push(state.chunks(), timeout=timeout).applied
    except grpc.RpcError as exc:
        raise admin_error(daemon, f"restore of shard {shard_id} of model {model!r}", exc) from None


def _identity(data: bytes) -> bytes:
    return data


def create_snapshot(daemon: str, model: str, name: str, step: int, timeout: float) -> ps_pb2.SnapshotInfo:
    request = ps_pb2.CreateSnapshotRequest(model=model, name=name, step=step, wait_seconds=max(timeout - 2.0, 1.0))
    return rpc(
        daemon, f"snapshot {name!r} of model {model!r}", lambda stub: stub.CreateSnapshot(request, timeout=timeout)
    )


def list_snapshots(daemon: str, model: str, timeout: float) -> list[ps_pb2.SnapshotInfo]:
    request = ps_pb2.ListSnapshotsRequest(model=model)
    what = f"snapshots of model {model!r}"
    return list(rpc(daemon, what, lambda stub: stub.ListSnapshots(request, timeout=timeout)).snapshots)


def delete_snapshot(daemon: str, model: str, name: str, timeout: float) -> ps_pb2.SnapshotInfo:
    request = ps_pb2.DeleteSnapshotRequest(model=model, name=name)
    what = f"deleting snapshot {name!r} of model {model!r}"
    return rpc(daemon, what, lambda stub: stub.DeleteSnapshot(request, timeout=timeout))


def check_health(address: str, service: str, timeout: float) -> dict[str, Any]:
    """grpc.health.v1 Check on one daemon: status name (or UNREACHABLE, ...) and latency."""
    started = time.perf_counter()
    try:
        with channel(address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        status, error = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status), ""
    except grpc.RpcError as exc:
        code = exc.code()  # type: ignore[attr-defined]
        status = {
            grpc.StatusCode.UNAVAILABLE: "UNREACHABLE",
            grpc.StatusCode.DEADLINE_EXCEEDED: "NO_ANSWER",
            grpc.StatusCode.NOT_FOUND: "SERVICE_UNKNOWN",
            grpc.StatusCode.UNIMPLEMENTED: "NO_HEALTH_SERVICE",
        }.get(code, code.name)
        error = f"{code.name}: {exc.details()}{_tls_hint(exc.details() or '')}"  # type: ignore[attr-defined]
    latency = time.perf_counter() - started
    return {"daemon": address, "status": status, "latency_ms": round(latency * 1000, 3), "error": error}
