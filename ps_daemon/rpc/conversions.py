"""Protobuf <-> domain conversions shared by the two front ends of the data path (the gRPC
servicer and the TCP data plane, through ps_offload.daemon.rpc.data_path), so both validate and
answer identically."""

from __future__ import annotations

import torch

from ps_offload.daemon.errors import InvalidArgument
from ps_offload.daemon.model.kernel_digest import kernel_digest
from ps_offload.daemon.model.spec import ModelSpec, ParamSpec
from ps_offload.daemon.store.inspection import Verdict
from ps_offload.daemon.store.pull import PullRequest
from ps_offload.daemon.store.pull_rounding import PULL_DTYPES
from ps_offload.daemon.store.push import PushRequest
from ps_offload.daemon.store.registry import RegisteredModel
from ps_offload.daemon.store.shard import SHARD_TENSORS
from ps_offload.optimizers import GroupSettings, plugin_for_spec, plugin_of
from ps_offload.proto import ps_pb2
from ps_offload.proto.channel import PROTOCOL
from ps_offload.version import release

DTYPE_NAMES = {ps_pb2.FLOAT32: "float32", ps_pb2.BFLOAT16: "bfloat16", ps_pb2.FLOAT16: "float16"}
_DTYPES_BY_NAME = {name: value for value, name in DTYPE_NAMES.items()}
PUSH_KINDS = {
    ps_pb2.GRADIENT: "gradient",
    ps_pb2.PARAMETERS: "parameters",
    ps_pb2.MOMENTUM: "momentum",
    ps_pb2.GRADIENT_PART: "gradient_part",
    ps_pb2.APPLY: "apply",
    ps_pb2.STATE: "state",
}
ENCODING_NAMES = {
    ps_pb2.RAW: "raw",
    ps_pb2.ONEBIT: "onebit",
    ps_pb2.BF16: "bf16",
    ps_pb2.FP16: "fp16",
    ps_pb2.TOPK: "topk",
}


def _optimizer_from_proto(spec: ps_pb2.ModelSpec):
    """The optimizer's config, through the table (ps_offload.optimizers): AdamW and SGD by their
    own messages, any other by PluginOptimizerSpec.name; its own checks' ValueError as INVALID_ARGUMENT."""
    try:
        plugin = plugin_for_spec(spec.optimizer)
    except KeyError as exc:
        raise InvalidArgument(f"model {spec.model!r}: {exc.args[0]}") from exc
    try:
        return plugin.from_proto(spec.optimizer)
    except (ValueError, TypeError) as exc:
        raise InvalidArgument(f"model {spec.model!r}: optimizer {exc}") from exc


def spec_from_proto(spec: ps_pb2.ModelSpec) -> ModelSpec:
    params = []
    for p in spec.params:
        if p.dtype not in DTYPE_NAMES:
            raise InvalidArgument(f"parameter {p.name!r}: dtype is unspecified or unknown ({p.dtype})")
        params.append(
            ParamSpec(
                name=p.name,
                shape=tuple(p.shape),
                dtype=DTYPE_NAMES[p.dtype],
                weight_decay=p.weight_decay if p.HasField("weight_decay") else None,
                group=p.group,
                starts_shard=p.starts_shard,
            )
        )
    optimizer = _optimizer_from_proto(spec)
    if spec.state_dtype == ps_pb2.DTYPE_UNSPECIFIED:
        state_dtype = "float32"
    elif spec.state_dtype in DTYPE_NAMES:
        state_dtype = DTYPE_NAMES[spec.state_dtype]  # (float16 is refused by validate_spec, saying why)
    else:  # proto3 enums are open: any int32 arrives
        raise InvalidArgument(f"model {spec.model!r}: state_dtype {spec.state_dtype} is unknown; FLOAT32 or BFLOAT16")
    return ModelSpec(
        spec.model, tuple(params), optimizer, spec.shard_bytes, tuple(spec.daemons), max(1, spec.replicas), state_dtype
    )


def plan_to_proto(
    model: RegisteredModel, created: bool, *, data_port: int, nvme_tier: bool, local_endpoint: str = ""
) -> ps_pb2.RegisterModelResponse:
    return ps_pb2.RegisterModelResponse(
        created=created,
        data_port=data_port,
        local_endpoint=local_endpoint,
        nvme_tier=nvme_tier,
        shard_bytes=model.spec.shard_bytes,
        shards=_placements(model),
        daemon_version=release(),
        protocol=PROTOCOL,
        kernel_digest=kernel_digest(plugin_of(model.spec.optimizer).name),
        state_dtype=_DTYPES_BY_NAME[model.spec.state_dtype],
    )


def _placements(model: RegisteredModel) -> list[ps_pb2.ShardPlacement]:
    return [
        ps_pb2.ShardPlacement(
            shard_id=s.shard_id, daemon_index=s.daemon_index, offset=s.offset, numel=s.numel, holders=s.holders
        )
        for s in model.plan
    ]


def push_request(header: ps_pb2.PushHeader) -> PushRequest:
    """The domain's push for a header, checked as far as the header alone allows."""
    if header.kind not in PUSH_KINDS:
        known = ", ".join(ps_pb2.PushKind.Name(k) for k in PUSH_KINDS)
        raise InvalidArgument(f"push to shard {header.shard_id}: kind {header.kind} is unknown; send {known}")
    if header.encoding not in ENCODING_NAMES:
        known = ", ".join(ps_pb2.Encoding.Name(e) for e in ENCODING_NAMES)
        raise InvalidArgument(f"push to shard {header.shard_id}: encoding {header.encoding} is unknown; send {known}")
    return PushRequest(
        header.model,
        header.shard_id,
        step=header.step,
        kind=PUSH_KINDS[header.kind],
        encoding=ENCODING_NAMES[header.encoding],
        dtype=DTYPE_NAMES.get(header.dtype, f"unspecified ({header.dtype})"),
        nbytes=header.nbytes,
        lr=header.lr if header.HasField("lr") else None,
        variance_frozen_at=header.variance_frozen_at if header.HasField("variance_frozen_at") else None,
        groups=tuple(
            GroupSettings(
                g.lr,
                g.weight_decay,
                g.beta1,
                g.beta2,
                g.eps,
                g.momentum,
                g.dampening,
                tuple(sorted(g.settings.items())),
            )
            for g in header.groups
        ),
        grad_multiplier=header.grad_multiplier if header.HasField("grad_multiplier") else None,
        part=header.part,
        parts=header.parts,
        check_only=header.check_only,
        speculate=header.speculate,
        lost_holders=tuple(header.lost_holders),
    )


def pull_request(request: ps_pb2.PullRequest) -> PullRequest:
    """The domain's pull for a PullRequest, its enums checked (what the shard allows is the
    store's to check). A snapshot's pull travels in FLOAT32 only."""
    if request.snapshot:
        dtype = pull_dtype(request)
        if dtype != "float32":
            raise InvalidArgument(f"pull of shard {request.shard_id} from snapshot {request.snapshot!r}: FLOAT32 only")
        tensor = pull_tensor(request)
    else:
        tensor, dtype = pull_tensor(request), pull_dtype(request)
    return PullRequest(
        request.model,
        request.shard_id,
        min_version=request.min_version,
        tensor=tensor,
        dtype=dtype,
        snapshot=request.snapshot,
    )


_SENT_DTYPES = {PULL_DTYPES[name]: value for value, name in DTYPE_NAMES.items()}  # torch dtype -> DType


def shard_header(model: str, shard_id: int, version: int, values: torch.Tensor) -> ps_pb2.ShardHeader:
    """The header of a pull that sends `values`: their element count and dtype, read off the
    tensor itself so that the header cannot disagree with the bytes."""
    dtype = _SENT_DTYPES[values.dtype]
    return ps_pb2.ShardHeader(model=model, shard_id=shard_id, version=version, numel=values.numel(), dtype=dtype)


def pull_dtype(request: ps_pb2.PullRequest) -> str:
    """The store's name of the dtype a pull asks to travel in (unset: float32). Whether the
    tensor pulled may travel in it is the store's rule (ps_offload.daemon.store.pull_rounding)."""
    if request.dtype == ps_pb2.DTYPE_UNSPECIFIED:
        return "float32"
    if request.dtype not in DTYPE_NAMES:  # proto3 enums are open: any int32 arrives
        known = ", ".join(ps_pb2.DType.Name(d) for d in DTYPE_NAMES)
        raise InvalidArgument(
            f"pull of shard {request.shard_id}: dtype {request.dtype} is unknown; ask for {known} (unset: FLOAT32)"
        )
    return DTYPE_NAMES[request.dtype]


def pull_tensor(request: ps_pb2.PullRequest) -> str:
    """The store's name of the tensor a pull asks for."""
    if not 0 <= request.tensor < len(SHARD_TENSORS):  # proto3 enums are open: any int32 arrives
        known = ", ".join(ps_pb2.ShardTensor.Name(i) for i in range(len(SHARD_TENSORS)))
        raise InvalidArgument(f"pull of shard {request.shard_id}: tensor {request.tensor} is unknown; ask for {known}")
    return SHARD_TENSORS[request.tensor]


# -- Admin ---------------------------------------------------------------------------------

DEFAULT_HISTOGRAM_BINS = 20
MAX_HISTOGRAM_BINS = 1000
VERIFY_STATUS = {"ok": ps_pb2.VERIFY_OK, "bad": ps_pb2.VERIFY_BAD, "not_at_rest": ps_pb2.VERIFY_NOT_AT_REST}


def spec_to_proto(spec: ModelSpec) -> ps_pb2.ModelSpec:
    """The inverse of spec_from_proto."""
    params = [
        ps_pb2.ParamSpec(
            name=p.name,
            shape=list(p.shape),
            dtype=_DTYPES_BY_NAME[p.dtype],
            weight_decay=p.weight_decay,
            group=p.group,
            starts_shard=p.starts_shard,
        )
        for p in spec.params
    ]
    optimizer = plugin_of(spec.optimizer).to_proto(spec.optimizer)
    return ps_pb2.ModelSpec(
        model=spec.model, params=params, optimizer=optimizer, shard_bytes=spec.shard_bytes, daemons=list(spec.daemons),
        replicas=spec.replicas, state_dtype=_DTYPES_BY_NAME[spec.state_dtype],
    )  # fmt: skip


def model_info(model: RegisteredModel) -> ps_pb2.ModelInfo:
    """A registered model's spec, plan and each parameter's place in the flat layout."""
    return ps_pb2.ModelInfo(
        spec=spec_to_proto(model.spec),
        daemon_index=model.daemon_index,
        shards=_placements(model),
        params=[
            ps_pb2.ParamPlacement(name=p.name, shape=list(p.shape), offset=p.offset, numel=p.numel)
            for p in model.layouts
        ],
        total_numel=sum(p.numel for p in model.layouts),
    )


def histogram_bins(request: ps_pb2.GetShardRequest) -> int:
    if request.histogram_bins > MAX_HISTOGRAM_BINS:
        raise InvalidArgument(
            f"histogram_bins {request.histogram_bins} is too many; ask for at most {MAX_HISTOGRAM_BINS} "
            f"(0: {DEFAULT_HISTOGRAM_BINS})"
        )
    return request.histogram_bins or DEFAULT_HISTOGRAM_BINS


def verdict_to_proto(v: Verdict) -> ps_pb2.VerifyResponse:
    return ps_pb2.VerifyResponse(
        shard=ps_pb2.ShardVerdict(
            model=v.model,
            shard_id=v.shard_id,
            status=VERIFY_STATUS[v.status],
            detail=v.detail,
            version=v.version,
            bytes_read=v.bytes_read,
            tier=v.tier,
            nonfinite=v.nonfinite,
        )
    )
