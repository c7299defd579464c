"""gRPC servicers: translate between protobuf and the store, nothing more.

The bulk methods (Pull, Push) are registered with the hand-written chunk codec instead of
protobuf's (de)serializers; the bytes on the wire are the same messages (ps_proto/codec.py
says why). Every other method uses the generated message classes.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Iterable, Iterator

import grpc

from ps_offload.daemon.errors import InvalidArgument, ResourceExhausted
from ps_offload.daemon.rpc import conversions, data_path
from ps_offload.daemon.rpc.fronts import Fronts, RecentPeers
from ps_offload.daemon.rpc.staging import StagingPool
from ps_offload.daemon.rpc.status import Undecodable, grpc_errors, grpc_errors_stream
from ps_offload.daemon.store import inspection, snapshot_admin, tier_admin
from ps_offload.daemon.store.pull_wait import PullWaits
from ps_offload.daemon.store.shard_store import ShardStore
from ps_offload.proto import codec, ps_pb2
from ps_offload.proto.channel import PROTOCOL
from ps_offload.version import release


class ParameterServerServicer:
    def __init__(
        self,
        store: ShardStore,
        *,
        max_pull_wait: float,
        chunk_bytes: int,
        staging: StagingPool,
        data_port: int = 0,
        local_endpoint: str = "",
        nvme_tier: bool = False,
        max_waiting_pulls: int = 16,
        max_waiting_pulls_per_client: int = 0,
        peers: RecentPeers | None = None,
    ) -> None:
        """max_waiting_pulls_per_client: 0, half of max_waiting_pulls (ps_offload.daemon.store.pull_wait);
        peers: told who calls Pull and Push (Admin.Stats' clients)."""
        self.store = store
        self.peers = peers or RecentPeers()
        self.pull_waits = PullWaits(max_waiting_pulls, max_waiting_pulls_per_client)
        self.staging = staging
        self.data_port = data_port  # advertised in RegisterModel; 0: no TCP data plane
        self.local_endpoint = local_endpoint  # advertised too; "": no local transport
        self.nvme_tier = nvme_tier  # advertised too: only then are prefetch hints worth sending
        self.max_pull_wait = max_pull_wait
        self.chunk_bytes = chunk_bytes

    @grpc_errors
    def RegisterModel(self, request: ps_pb2.RegisterModelRequest, context: grpc.ServicerContext):
        model, created = self.store.registry.register(conversions.spec_from_proto(request.spec), request.daemon_index)
        return conversions.plan_to_proto(
            model, created, data_port=self.data_port, local_endpoint=self.local_endpoint, nvme_tier=self.nvme_tier
        )

    @grpc_errors_stream
    def Pull(self, request: ps_pb2.PullRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        remaining = context.time_remaining()
        timeout = self.max_pull_wait if remaining is None else min(remaining, self.max_pull_wait)
        waiting = self.pull_waits.for_call(context)
        self.peers.saw(context.peer())
        pull = conversions.pull_request(request)
        # Held while chunks are encoded (an fp32 pull under the shard's read hold), so a pull
        # never sees half an update.
        with data_path.serve_pull(self.store, pull, timeout=timeout, scratch=self.staging.borrow, waiting=waiting) as (
            header,
            raw,
        ):
            for start in range(0, len(raw), self.chunk_bytes):
                yield codec.pull_chunks.encode(header if start == 0 else None, raw[start : start + self.chunk_bytes])

    @grpc_errors
    def Push(self, chunks: Iterable[codec.Chunk], context: grpc.ServicerContext) -> ps_pb2.PushResponse:
        chunks = map(_check_chunk, chunks)
        first = next(chunks, None)
        if first is None or first.header is None:
            raise InvalidArgument("a push stream must start with a chunk that carries the PushHeader")
        self.peers.saw(context.peer())
        read_payload = functools.partial(self._receive, first.header, first, chunks)
        return data_path.receive_push(self.store, first.header, self.staging, read_payload)

    @staticmethod
    def _receive(header: ps_pb2.PushHeader, first: codec.Chunk, rest: Iterator[codec.Chunk], view: memoryview) -> None:
        """Copies the payload of every chunk into `view` (header.nbytes bytes), checking sizes
        and headers."""
        received = 0
        for chunk in _chain_first(first, rest):
            if chunk.header is not None and chunk is not first:
                raise InvalidArgument("only the first chunk of a push may carry a header")
            n = len(chunk.data)
            if received + n > header.nbytes:
                raise InvalidArgument(
                    f"push to shard {header.shard_id} sent more than the {header.nbytes} bytes its header announced"
                )
            view[received : received + n] = chunk.data
            received += n
        if received != header.nbytes:
            raise InvalidArgument(f"push to shard {header.shard_id} ended after {received} of {header.nbytes} bytes")

    @grpc_errors
    def Prefetch(self, request: ps_pb2.PrefetchRequest, context: grpc.ServicerContext):
        return ps_pb2.PrefetchResponse(accepted=self.store.prefetch(request.model, list(request.shard_ids)))


def _snapshot_info(model: str, info) -> ps_pb2.SnapshotInfo:
    return ps_pb2.SnapshotInfo(
        model=model, name=info.name, step=info.step, created_unix=info.created, shards=info.shards,
        bytes=info.bytes, complete=info.complete, damaged=info.damaged,
    )  # fmt: skip


def _check_chunk(chunk: codec.Chunk | codec.CodecError) -> codec.Chunk:
    if isinstance(chunk, codec.CodecError):
        raise InvalidArgument(f"malformed PushChunk: {chunk}")
    return chunk


def _chain_first(first: codec.Chunk, rest: Iterator[codec.Chunk]) -> Iterator[codec.Chunk]:
    yield first
    yield from rest


# CreateSnapshot calls waiting for their step at once: each holds an RPC thread meanwhile.
SNAPSHOTS_AT_ONCE = 2


class AdminServicer:
    def __init__(self, store: ShardStore, pull_waits: PullWaits | None = None, fronts: Fronts | None = None) -> None:
        self.store = store
        self._snapshot_waits = threading.BoundedSemaphore(SNAPSHOTS_AT_ONCE)
        self.pull_waits = pull_waits  # the ParameterServer's, for Stats
        self.fronts = fronts or Fronts(RecentPeers())  # for Stats

    @grpc_errors
    def ListShards(self, request: ps_pb2.ListShardsRequest, context: grpc.ServicerContext):
        models = [self.store.registry.model(request.model)] if request.model else self.store.registry.models()
        infos = [_shard_info(shard) for model in models for shard in model.shards.values()]
        return ps_pb2.ListShardsResponse(shards=infos)

    @grpc_errors
    def GetShard(self, request: ps_pb2.GetShardRequest, context: grpc.ServicerContext):
        bins = conversions.histogram_bins(request)
        shard = self.store.registry.shard(request.model, request.shard_id)
        info = _shard_info(shard)
        stats = inspection.value_stats(self.store, shard, bins=bins)
        info.norm, info.min, info.max, info.nan_count = stats.norm, stats.min, stats.max, stats.nan_count
        info.histogram.extend(stats.histogram)
        info.histogram_low, info.histogram_high = stats.histogram_low, stats.histogram_high
        return info

    @grpc_errors
    def Evict(self, request: ps_pb2.GetShardRequest, context: grpc.ServicerContext):
        return ps_pb2.TierResponse(tier=tier_admin.evict(self.store, request.model, request.shard_id).tier)

    @grpc_errors
    def Load(self, request: ps_pb2.GetShardRequest, context: grpc.ServicerContext):
        return ps_pb2.TierResponse(tier=tier_admin.load(self.store, request.model, request.shard_id).tier)

    @grpc_errors
    def Stats(self, request: ps_pb2.StatsRequest, context: grpc.ServicerContext):
        waits = self.pull_waits
        return ps_pb2.StatsResponse(
            **dataclasses.asdict(self.store.stats_snapshot()),
            pulls_waiting=waits.waiting if waits else 0,
            pulls_refused_waiting=waits.refused if waits else 0,
            **self.fronts.stats(),
            daemon_version=release(),
        )

    @grpc_errors
    def ListModels(self, request: ps_pb2.ListModelsRequest, context: grpc.ServicerContext):
        models = sorted(self.store.registry.models(), key=lambda m: m.spec.model)
        infos = [conversions.model_info(m) for m in models]
        infos += [
            ps_pb2.ModelInfo(spec=ps_pb2.ModelSpec(model=name), damaged=why)
            for name, why in sorted(self.store.registry.damaged.items())
        ]
        return ps_pb2.ListModelsResponse(models=infos, daemon_version=release(), protocol=PROTOCOL)

    @grpc_errors
    def CreateSnapshot(self, request: ps_pb2.CreateSnapshotRequest, context: grpc.ServicerContext):
        if not request.model or not request.name:
            raise InvalidArgument("CreateSnapshot needs a model and a snapshot name")
        wait = request.wait_seconds or 600.0
        if not 0 < wait <= 86400:
            raise InvalidArgument(f"CreateSnapshot: wait_seconds must be in (0, 86400], got {request.wait_seconds}")
        remaining = context.time_remaining()
        if remaining is not None:
            wait = min(wait, max(remaining - 1.0, 0.1))  # answer before the caller's deadline
        if not self._snapshot_waits.acquire(blocking=False):
            raise ResourceExhausted(
                f"{SNAPSHOTS_AT_ONCE} snapshots are being taken on this daemon already (each holds an RPC thread while "
                "it waits for its step); try again when one is done"
            )
        try:
            left = threading.Event()  # the caller cancelled or its deadline passed: stop waiting
            files = self.store.files
            context.add_callback(lambda: (left.set(), snapshot_admin.wake(files, request.model)))
            shard_ids = set(self.store.registry.model(request.model).shards)
            info = snapshot_admin.take(files, request.model, request.name, request.step, shard_ids, wait, left)
        finally:
            self._snapshot_waits.release()
        return _snapshot_info(request.model, info)

    @grpc_errors
    def ListSnapshots(self, request: ps_pb2.ListSnapshotsRequest, context: grpc.ServicerContext):
        self.store.registry.model(request.model)  # NotFound for a model not here
        infos = snapshot_admin.listed(self.store.files, request.model)
        return ps_pb2.ListSnapshotsResponse(snapshots=[_snapshot_info(request.model, i) for i in infos])

    @grpc_errors
    def DeleteSnapshot(self, request: ps_pb2.DeleteSnapshotRequest, context: grpc.ServicerContext):
        self.store.registry.model(request.model)  # NotFound for a model not here
        return _snapshot_info(request.model, snapshot_admin.delete(self.store.files, request.model, request.name))

    @grpc_errors
    def DropModel(self, request: ps_pb2.DropModelRequest, context: grpc.ServicerContext):
        if not request.model:
            raise InvalidArgument("DropModel needs a model name (ListModels lists them)")
        dropped = self.store.registry.drop(request.model)
        return ps_pb2.DropModelResponse(
            shards=dropped.shards,
            disk_bytes=dropped.disk_bytes,
            ram_bytes=dropped.ram_bytes,
            was_damaged=dropped.was_damaged,
        )

    @grpc_errors
    def GetModel(self, request: ps_pb2.GetModelRequest, context: grpc.ServicerContext):
        if not request.model:
            raise InvalidArgument("GetModel needs a model name (ListModels lists them)")
        return conversions.model_info(self.store.registry.model(request.model))

    @grpc_errors_stream
    def Verify(self, request: ps_pb2.VerifyRequest, context: grpc.ServicerContext):
        shards, files = inspection.shards_to_verify(self.store, request.model), self.store.files
        bytes_read = inspection.verify_bytes(files, shards)
        damaged = inspection.damaged_models(self.store, request.model)
        plan = ps_pb2.VerifyPlan(shards=len(shards), bytes=bytes_read, at_rest=files.at_rest, damaged=damaged)
        yield ps_pb2.VerifyResponse(plan=plan)
        for verdict in inspection.verify(files, shards):
            if not context.is_active():  # the client went away: stop reading the disk
                return
            yield conversions.verdict_to_proto(verdict)


def _shard_info(shard) -> ps_pb2.ShardInfo:
    return ps_pb2.ShardInfo(
        model=shard.model,
        shard_id=shard.slice.shard_id,
        version=shard.version,
        numel=shard.slice.numel,
        offset=shard.slice.offset,
        tier=shard.tier,
        initialized=shard.initialized,
        params=list(shard.param_names),
        bytes=shard.resident_bytes,
    )


def _identity(data: bytes) -> bytes:
    return data


def _decode_push_chunk(buf: bytes) -> codec.Chunk | codec.CodecError:
    """A malformed chunk becomes a value the servicer answers with INVALID_ARGUMENT; raised
    here, gRPC would only report an opaque deserialization failure."""
    try:
        return codec.push_chunks.decode(buf)
    except codec.CodecError as exc:
        return exc


def _handlers(service: str, methods: dict[str, grpc.RpcMethodHandler]) -> grpc.GenericRpcHandler:
    """Checks the handlers against the service descriptor, so a method added to ps.proto
    without a handler fails at start-up, not at the first call."""
    descriptor = ps_pb2.DESCRIPTOR.services_by_name[service]
    missing = {m.name for m in descriptor.methods} - set(methods)
    if missing:
        raise RuntimeError(f"{service}: no handler for {sorted(missing)}")
    return grpc.method_handlers_generic_handler(descriptor.full_name, methods)


def _unary(method, request_cls, response_cls) -> grpc.RpcMethodHandler:
    return grpc.unary_unary_rpc_method_handler(
        method,
        request_deserializer=Undecodable.decoder(request_cls),
        response_serializer=response_cls.SerializeToString,
    )


def parameter_server_handler(servicer: ParameterServerServicer) -> grpc.GenericRpcHandler:
    return _handlers(
        "ParameterServer",
        {
            "RegisterModel": _unary(servicer.RegisterModel, ps_pb2.RegisterModelRequest, ps_pb2.RegisterModelResponse),
            "Pull": grpc.unary_stream_rpc_method_handler(
                servicer.Pull,
                request_deserializer=Undecodable.decoder(ps_pb2.PullRequest),
                response_serializer=_identity,
            ),
            "Push": grpc.stream_unary_rpc_method_handler(
                servicer.Push,
                request_deserializer=_decode_push_chunk,
                response_serializer=ps_pb2.PushResponse.SerializeToString,
            ),
            "Prefetch": _unary(servicer.Prefetch, ps_pb2.PrefetchRequest, ps_pb2.PrefetchResponse),
        },
    )


def admin_handler(servicer: AdminServicer) -> grpc.GenericRpcHandler:
    return _handlers(
        "Admin",
        {
            "ListShards": _unary(servicer.ListShards, ps_pb2.ListShardsRequest, ps_pb2.ListShardsResponse),
            "GetShard": _unary(servicer.GetShard, ps_pb2.GetShardRequest, ps_pb2.ShardInfo),
            "Stats": _unary(servicer.Stats, ps_pb2.StatsRequest, ps_pb2.StatsResponse),
            "Evict": _unary(servicer.Evict, ps_pb2.GetShardRequest, ps_pb2.TierResponse),
            "Load": _unary(servicer.Load, ps_pb2.GetShardRequest, ps_pb2.TierResponse),
            "ListModels": _unary(servicer.ListModels, ps_pb2.ListModelsRequest, ps_pb2.ListModelsResponse),
            "GetModel": _unary(servicer.GetModel, ps_pb2.GetModelRequest, ps_pb2.ModelInfo),
            "DropModel": _unary(servicer.DropModel, ps_pb2.DropModelRequest, ps_pb2.DropModelResponse),
            "CreateSnapshot": _unary(servicer.CreateSnapshot, ps_pb2.CreateSnapshotRequest, ps_pb2.SnapshotInfo),
            "ListSnapshots": _unary(servicer.ListSnapshots, ps_pb2.ListSnapshotsRequest, ps_pb2.ListSnapshotsResponse),
            "DeleteSnapshot": _unary(servicer.DeleteSnapshot, ps_pb2.DeleteSnapshotRequest, ps_pb2.SnapshotInfo),
            "Verify": grpc.unary_stream_rpc_method_handler(
                servicer.Verify,
                request_deserializer=Undecodable.decoder(ps_pb2.VerifyRequest),
                response_serializer=ps_pb2.VerifyResponse.SerializeToString,
            ),
        },
    )
