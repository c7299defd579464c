from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]

class Encoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENCODING_UNSPECIFIED: _ClassVar[Encoding]
    RAW: _ClassVar[Encoding]
    ONEBIT: _ClassVar[Encoding]
    BF16: _ClassVar[Encoding]
    FP16: _ClassVar[Encoding]
    TOPK: _ClassVar[Encoding]

class PushKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUSH_KIND_UNSPECIFIED: _ClassVar[PushKind]
    GRADIENT: _ClassVar[PushKind]
    PARAMETERS: _ClassVar[PushKind]
    MOMENTUM: _ClassVar[PushKind]
    GRADIENT_PART: _ClassVar[PushKind]
    APPLY: _ClassVar[PushKind]
    STATE: _ClassVar[PushKind]

class ShardTensor(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MASTER: _ClassVar[ShardTensor]
    EXP_AVG: _ClassVar[ShardTensor]
    EXP_AVG_SQ: _ClassVar[ShardTensor]

class VerifyStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERIFY_STATUS_UNSPECIFIED: _ClassVar[VerifyStatus]
    VERIFY_OK: _ClassVar[VerifyStatus]
    VERIFY_BAD: _ClassVar[VerifyStatus]
    VERIFY_NOT_AT_REST: _ClassVar[VerifyStatus]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
BFLOAT16: DType
FLOAT16: DType
ENCODING_UNSPECIFIED: Encoding
RAW: Encoding
ONEBIT: Encoding
BF16: Encoding
FP16: Encoding
TOPK: Encoding
PUSH_KIND_UNSPECIFIED: PushKind
GRADIENT: PushKind
PARAMETERS: PushKind
MOMENTUM: PushKind
GRADIENT_PART: PushKind
APPLY: PushKind
STATE: PushKind
MASTER: ShardTensor
EXP_AVG: ShardTensor
EXP_AVG_SQ: ShardTensor
VERIFY_STATUS_UNSPECIFIED: VerifyStatus
VERIFY_OK: VerifyStatus
VERIFY_BAD: VerifyStatus
VERIFY_NOT_AT_REST: VerifyStatus

class ParamSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype", "weight_decay", "group", "starts_shard")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    STARTS_SHARD_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    weight_decay: float
    group: int
    starts_shard: bool
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., weight_decay: _Optional[float] = ..., group: _Optional[int] = ..., starts_shard: _Optional[bool] = ...) -> None: ...

class AdamWSpec(_message.Message):
    __slots__ = ("lr", "beta1", "beta2", "eps", "weight_decay")
    LR_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    def __init__(self, lr: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., weight_decay: _Optional[float] = ...) -> None: ...

class SGDSpec(_message.Message):
    __slots__ = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
    LR_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    DAMPENING_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    NESTEROV_FIELD_NUMBER: _ClassVar[int]
    lr: float
    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool
    def __init__(self, lr: _Optional[float] = ..., momentum: _Optional[float] = ..., dampening: _Optional[float] = ..., weight_decay: _Optional[float] = ..., nesterov: _Optional[bool] = ...) -> None: ...

class PluginOptimizerSpec(_message.Message):
    __slots__ = ("name", "settings")
    class SettingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    name: str
    settings: _containers.ScalarMap[str, float]
    def __init__(self, name: _Optional[str] = ..., settings: _Optional[_Mapping[str, float]] = ...) -> None: ...

class OptimizerSpec(_message.Message):
    __slots__ = ("adamw", "sgd", "plugin")
    ADAMW_FIELD_NUMBER: _ClassVar[int]
    SGD_FIELD_NUMBER: _ClassVar[int]
    PLUGIN_FIELD_NUMBER: _ClassVar[int]
    adamw: AdamWSpec
    sgd: SGDSpec
    plugin: PluginOptimizerSpec
    def __init__(self, adamw: _Optional[_Union[AdamWSpec, _Mapping]] = ..., sgd: _Optional[_Union[SGDSpec, _Mapping]] = ..., plugin: _Optional[_Union[PluginOptimizerSpec, _Mapping]] = ...) -> None: ...

class ModelSpec(_message.Message):
    __slots__ = ("model", "params", "optimizer", "shard_bytes", "daemons", "replicas", "state_dtype")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    SHARD_BYTES_FIELD_NUMBER: _ClassVar[int]
    DAEMONS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    STATE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    model: str
    params: _containers.RepeatedCompositeFieldContainer[ParamSpec]
    optimizer: OptimizerSpec
    shard_bytes: int
    daemons: _containers.RepeatedScalarFieldContainer[str]
    replicas: int
    state_dtype: DType
    def __init__(self, model: _Optional[str] = ..., params: _Optional[_Iterable[_Union[ParamSpec, _Mapping]]] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., shard_bytes: _Optional[int] = ..., daemons: _Optional[_Iterable[str]] = ..., replicas: _Optional[int] = ..., state_dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class RegisterModelRequest(_message.Message):
    __slots__ = ("spec", "daemon_index")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    DAEMON_INDEX_FIELD_NUMBER: _ClassVar[int]
    spec: ModelSpec
    daemon_index: int
    def __init__(self, spec: _Optional[_Union[ModelSpec, _Mapping]] = ..., daemon_index: _Optional[int] = ...) -> None: ...

class ShardPlacement(_message.Message):
    __slots__ = ("shard_id", "daemon_index", "offset", "numel", "holders")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    DAEMON_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    daemon_index: int
    offset: int
    numel: int
    holders: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, shard_id: _Optional[int] = ..., daemon_index: _Optional[int] = ..., offset: _Optional[int] = ..., numel: _Optional[int] = ..., holders: _Optional[_Iterable[int]] = ...) -> None: ...

class RegisterModelResponse(_message.Message):
    __slots__ = ("shards", "created", "shard_bytes", "data_port", "nvme_tier", "local_endpoint", "daemon_version", "protocol", "kernel_digest", "state_dtype")
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    SHARD_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    NVME_TIER_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    DAEMON_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    KERNEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    STATE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[ShardPlacement]
    created: bool
    shard_bytes: int
    data_port: int
    nvme_tier: bool
    local_endpoint: str
    daemon_version: str
    protocol: int
    kernel_digest: str
    state_dtype: DType
    def __init__(self, shards: _Optional[_Iterable[_Union[ShardPlacement, _Mapping]]] = ..., created: _Optional[bool] = ..., shard_bytes: _Optional[int] = ..., data_port: _Optional[int] = ..., nvme_tier: _Optional[bool] = ..., local_endpoint: _Optional[str] = ..., daemon_version: _Optional[str] = ..., protocol: _Optional[int] = ..., kernel_digest: _Optional[str] = ..., state_dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("model", "shard_id", "min_version", "tensor", "dtype", "snapshot")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    model: str
    shard_id: int
    min_version: int
    tensor: ShardTensor
    dtype: DType
    snapshot: str
    def __init__(self, model: _Optional[str] = ..., shard_id: _Optional[int] = ..., min_version: _Optional[int] = ..., tensor: _Optional[_Union[ShardTensor, str]] = ..., dtype: _Optional[_Union[DType, str]] = ..., snapshot: _Optional[str] = ...) -> None: ...

class ShardHeader(_message.Message):
    __slots__ = ("model", "shard_id", "version", "numel", "dtype")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    model: str
    shard_id: int
    version: int
    numel: int
    dtype: DType
    def __init__(self, model: _Optional[str] = ..., shard_id: _Optional[int] = ..., version: _Optional[int] = ..., numel: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class PullChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: ShardHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[ShardHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class GroupHyperparams(_message.Message):
    __slots__ = ("lr", "weight_decay", "beta1", "beta2", "eps", "momentum", "dampening", "settings")
    class SettingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    LR_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    DAMPENING_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    lr: float
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    momentum: float
    dampening: float
    settings: _containers.ScalarMap[str, float]
    def __init__(self, lr: _Optional[float] = ..., weight_decay: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., momentum: _Optional[float] = ..., dampening: _Optional[float] = ..., settings: _Optional[_Mapping[str, float]] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("model", "shard_id", "step", "kind", "encoding", "dtype", "nbytes", "lr", "variance_frozen_at", "groups", "grad_multiplier", "part", "parts", "check_only", "lost_holders", "speculate")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    VARIANCE_FROZEN_AT_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    GRAD_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    CHECK_ONLY_FIELD_NUMBER: _ClassVar[int]
    LOST_HOLDERS_FIELD_NUMBER: _ClassVar[int]
    SPECULATE_FIELD_NUMBER: _ClassVar[int]
    model: str
    shard_id: int
    step: int
    kind: PushKind
    encoding: Encoding
    dtype: DType
    nbytes: int
    lr: float
    variance_frozen_at: int
    groups: _containers.RepeatedCompositeFieldContainer[GroupHyperparams]
    grad_multiplier: float
    part: int
    parts: int
    check_only: bool
    lost_holders: _containers.RepeatedScalarFieldContainer[int]
    speculate: bool
    def __init__(self, model: _Optional[str] = ..., shard_id: _Optional[int] = ..., step: _Optional[int] = ..., kind: _Optional[_Union[PushKind, str]] = ..., encoding: _Optional[_Union[Encoding, str]] = ..., dtype: _Optional[_Union[DType, str]] = ..., nbytes: _Optional[int] = ..., lr: _Optional[float] = ..., variance_frozen_at: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[GroupHyperparams, _Mapping]]] = ..., grad_multiplier: _Optional[float] = ..., part: _Optional[int] = ..., parts: _Optional[int] = ..., check_only: _Optional[bool] = ..., lost_holders: _Optional[_Iterable[int]] = ..., speculate: _Optional[bool] = ...) -> None: ...

class PushChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("applied", "version", "pulled")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PULLED_FIELD_NUMBER: _ClassVar[int]
    applied: bool
    version: int
    pulled: bool
    def __init__(self, applied: _Optional[bool] = ..., version: _Optional[int] = ..., pulled: _Optional[bool] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("model", "shard_ids")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SHARD_IDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    shard_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model: _Optional[str] = ..., shard_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    def __init__(self, accepted: _Optional[int] = ...) -> None: ...

class ListShardsRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ShardInfo(_message.Message):
    __slots__ = ("model", "shard_id", "version", "numel", "offset", "tier", "initialized", "params", "bytes", "norm", "min", "max", "nan_count", "histogram", "histogram_low", "histogram_high")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    NORM_FIELD_NUMBER: _ClassVar[int]
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    NAN_COUNT_FIELD_NUMBER: _ClassVar[int]
    HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    HISTOGRAM_LOW_FIELD_NUMBER: _ClassVar[int]
    HISTOGRAM_HIGH_FIELD_NUMBER: _ClassVar[int]
    model: str
    shard_id: int
    version: int
    numel: int
    offset: int
    tier: str
    initialized: bool
    params: _containers.RepeatedScalarFieldContainer[str]
    bytes: int
    norm: float
    min: float
    max: float
    nan_count: int
    histogram: _containers.RepeatedScalarFieldContainer[int]
    histogram_low: float
    histogram_high: float
    def __init__(self, model: _Optional[str] = ..., shard_id: _Optional[int] = ..., version: _Optional[int] = ..., numel: _Optional[int] = ..., offset: _Optional[int] = ..., tier: _Optional[str] = ..., initialized: _Optional[bool] = ..., params: _Optional[_Iterable[str]] = ..., bytes: _Optional[int] = ..., norm: _Optional[float] = ..., min: _Optional[float] = ..., max: _Optional[float] = ..., nan_count: _Optional[int] = ..., histogram: _Optional[_Iterable[int]] = ..., histogram_low: _Optional[float] = ..., histogram_high: _Optional[float] = ...) -> None: ...

class ListShardsResponse(_message.Message):
    __slots__ = ("shards",)
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[ShardInfo]
    def __init__(self, shards: _Optional[_Iterable[_Union[ShardInfo, _Mapping]]] = ...) -> None: ...

class GetShardRequest(_message.Message):
    __slots__ = ("model", "shard_id", "histogram_bins")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    HISTOGRAM_BINS_FIELD_NUMBER: _ClassVar[int]
    model: str
    shard_id: int
    histogram_bins: int
    def __init__(self, model: _Optional[str] = ..., shard_id: _Optional[int] = ..., histogram_bins: _Optional[int] = ...) -> None: ...

class TierResponse(_message.Message):
    __slots__ = ("tier",)
    TIER_FIELD_NUMBER: _ClassVar[int]
    tier: str
    def __init__(self, tier: _Optional[str] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("models", "shards", "ram_bytes_used", "bytes_pulled", "bytes_pushed", "pulls", "pushes_applied", "pushes_duplicate", "optimizer_seconds", "uptime_seconds", "prefetch_hints", "tier_hits", "tier_misses", "prefetched", "evictions", "nvme_bytes_read", "nvme_bytes_written", "ram_bytes_budget", "nvme_bytes_allocated", "nvme_bytes_capacity", "shards_in_ram", "shards_on_nvme", "shards_corrupt", "nvme_write_seconds", "nvme_read_seconds", "nvme_master_reads", "nvme_master_bytes_read", "pulls_waiting", "pulls_refused_waiting", "data_connections", "data_pulls_waiting", "data_connections_refused", "local_connections", "local_connections_refused", "local_pool_bytes", "local_pool_bytes_used", "clients", "daemon_version", "pulls_carried", "speculative_steps", "speculative_redone", "speculation_bytes", "window_loads", "nvme_commits", "nvme_commit_groups", "nvme_flushes", "nvme_flush_seconds")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    RAM_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    BYTES_PULLED_FIELD_NUMBER: _ClassVar[int]
    BYTES_PUSHED_FIELD_NUMBER: _ClassVar[int]
    PULLS_FIELD_NUMBER: _ClassVar[int]
    PUSHES_APPLIED_FIELD_NUMBER: _ClassVar[int]
    PUSHES_DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_HINTS_FIELD_NUMBER: _ClassVar[int]
    TIER_HITS_FIELD_NUMBER: _ClassVar[int]
    TIER_MISSES_FIELD_NUMBER: _ClassVar[int]
    PREFETCHED_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    NVME_BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    NVME_BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    RAM_BYTES_BUDGET_FIELD_NUMBER: _ClassVar[int]
    NVME_BYTES_ALLOCATED_FIELD_NUMBER: _ClassVar[int]
    NVME_BYTES_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    SHARDS_IN_RAM_FIELD_NUMBER: _ClassVar[int]
    SHARDS_ON_NVME_FIELD_NUMBER: _ClassVar[int]
    SHARDS_CORRUPT_FIELD_NUMBER: _ClassVar[int]
    NVME_WRITE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NVME_READ_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NVME_MASTER_READS_FIELD_NUMBER: _ClassVar[int]
    NVME_MASTER_BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    PULLS_WAITING_FIELD_NUMBER: _ClassVar[int]
    PULLS_REFUSED_WAITING_FIELD_NUMBER: _ClassVar[int]
    DATA_CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    DATA_PULLS_WAITING_FIELD_NUMBER: _ClassVar[int]
    DATA_CONNECTIONS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    LOCAL_CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_CONNECTIONS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    LOCAL_POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_POOL_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    DAEMON_VERSION_FIELD_NUMBER: _ClassVar[int]
    PULLS_CARRIED_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_STEPS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_REDONE_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_BYTES_FIELD_NUMBER: _ClassVar[int]
    WINDOW_LOADS_FIELD_NUMBER: _ClassVar[int]
    NVME_COMMITS_FIELD_NUMBER: _ClassVar[int]
    NVME_COMMIT_GROUPS_FIELD_NUMBER: _ClassVar[int]
    NVME_FLUSHES_FIELD_NUMBER: _ClassVar[int]
    NVME_FLUSH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    models: int
    shards: int
    ram_bytes_used: int
    bytes_pulled: int
    bytes_pushed: int
    pulls: int
    pushes_applied: int
    pushes_duplicate: int
    optimizer_seconds: float
    uptime_seconds: float
    prefetch_hints: int
    tier_hits: int
    tier_misses: int
    prefetched: int
    evictions: int
    nvme_bytes_read: int
    nvme_bytes_written: int
    ram_bytes_budget: int
    nvme_bytes_allocated: int
    nvme_bytes_capacity: int
    shards_in_ram: int
    shards_on_nvme: int
    shards_corrupt: int
    nvme_write_seconds: float
    nvme_read_seconds: float
    nvme_master_reads: int
    nvme_master_bytes_read: int
    pulls_waiting: int
    pulls_refused_waiting: int
    data_connections: int
    data_pulls_waiting: int
    data_connections_refused: int
    local_connections: int
    local_connections_refused: int
    local_pool_bytes: int
    local_pool_bytes_used: int
    clients: _containers.RepeatedCompositeFieldContainer[ClientPath]
    daemon_version: str
    pulls_carried: int
    speculative_steps: int
    speculative_redone: int
    speculation_bytes: int
    window_loads: int
    nvme_commits: int
    nvme_commit_groups: int
    nvme_flushes: int
    nvme_flush_seconds: float
    def __init__(self, models: _Optional[int] = ..., shards: _Optional[int] = ..., ram_bytes_used: _Optional[int] = ..., bytes_pulled: _Optional[int] = ..., bytes_pushed: _Optional[int] = ..., pulls: _Optional[int] = ..., pushes_applied: _Optional[int] = ..., pushes_duplicate: _Optional[int] = ..., optimizer_seconds: _Optional[float] = ..., uptime_seconds: _Optional[float] = ..., prefetch_hints: _Optional[int] = ..., tier_hits: _Optional[int] = ..., tier_misses: _Optional[int] = ..., prefetched: _Optional[int] = ..., evictions: _Optional[int] = ..., nvme_bytes_read: _Optional[int] = ..., nvme_bytes_written: _Optional[int] = ..., ram_bytes_budget: _Optional[int] = ..., nvme_bytes_allocated: _Optional[int] = ..., nvme_bytes_capacity: _Optional[int] = ..., shards_in_ram: _Optional[int] = ..., shards_on_nvme: _Optional[int] = ..., shards_corrupt: _Optional[int] = ..., nvme_write_seconds: _Optional[float] = ..., nvme_read_seconds: _Optional[float] = ..., nvme_master_reads: _Optional[int] = ..., nvme_master_bytes_read: _Optional[int] = ..., pulls_waiting: _Optional[int] = ..., pulls_refused_waiting: _Optional[int] = ..., data_connections: _Optional[int] = ..., data_pulls_waiting: _Optional[int] = ..., data_connections_refused: _Optional[int] = ..., local_connections: _Optional[int] = ..., local_connections_refused: _Optional[int] = ..., local_pool_bytes: _Optional[int] = ..., local_pool_bytes_used: _Optional[int] = ..., clients: _Optional[_Iterable[_Union[ClientPath, _Mapping]]] = ..., daemon_version: _Optional[str] = ..., pulls_carried: _Optional[int] = ..., speculative_steps: _Optional[int] = ..., speculative_redone: _Optional[int] = ..., speculation_bytes: _Optional[int] = ..., window_loads: _Optional[int] = ..., nvme_commits: _Optional[int] = ..., nvme_commit_groups: _Optional[int] = ..., nvme_flushes: _Optional[int] = ..., nvme_flush_seconds: _Optional[float] = ...) -> None: ...

class ClientPath(_message.Message):
    __slots__ = ("client", "transport", "connections", "shared_bytes")
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    SHARED_BYTES_FIELD_NUMBER: _ClassVar[int]
    client: str
    transport: str
    connections: int
    shared_bytes: int
    def __init__(self, client: _Optional[str] = ..., transport: _Optional[str] = ..., connections: _Optional[int] = ..., shared_bytes: _Optional[int] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models", "daemon_version", "protocol")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    DAEMON_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    daemon_version: str
    protocol: int
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ..., daemon_version: _Optional[str] = ..., protocol: _Optional[int] = ...) -> None: ...

class GetModelRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class CreateSnapshotRequest(_message.Message):
    __slots__ = ("model", "name", "step", "wait_seconds")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    name: str
    step: int
    wait_seconds: float
    def __init__(self, model: _Optional[str] = ..., name: _Optional[str] = ..., step: _Optional[int] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class ListSnapshotsRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class DeleteSnapshotRequest(_message.Message):
    __slots__ = ("model", "name")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    model: str
    name: str
    def __init__(self, model: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class SnapshotInfo(_message.Message):
    __slots__ = ("model", "name", "step", "created_unix", "shards", "bytes", "complete", "damaged")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    DAMAGED_FIELD_NUMBER: _ClassVar[int]
    model: str
    name: str
    step: int
    created_unix: float
    shards: int
    bytes: int
    complete: bool
    damaged: str
    def __init__(self, model: _Optional[str] = ..., name: _Optional[str] = ..., step: _Optional[int] = ..., created_unix: _Optional[float] = ..., shards: _Optional[int] = ..., bytes: _Optional[int] = ..., complete: _Optional[bool] = ..., damaged: _Optional[str] = ...) -> None: ...

class ListSnapshotsResponse(_message.Message):
    __slots__ = ("snapshots",)
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    snapshots: _containers.RepeatedCompositeFieldContainer[SnapshotInfo]
    def __init__(self, snapshots: _Optional[_Iterable[_Union[SnapshotInfo, _Mapping]]] = ...) -> None: ...

class DropModelRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class DropModelResponse(_message.Message):
    __slots__ = ("shards", "disk_bytes", "ram_bytes", "was_damaged")
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    RAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    WAS_DAMAGED_FIELD_NUMBER: _ClassVar[int]
    shards: int
    disk_bytes: int
    ram_bytes: int
    was_damaged: bool
    def __init__(self, shards: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., ram_bytes: _Optional[int] = ..., was_damaged: _Optional[bool] = ...) -> None: ...

class ParamPlacement(_message.Message):
    __slots__ = ("name", "shape", "offset", "numel")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    numel: int
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., numel: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("spec", "daemon_index", "shards", "params", "total_numel", "damaged")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    DAEMON_INDEX_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NUMEL_FIELD_NUMBER: _ClassVar[int]
    DAMAGED_FIELD_NUMBER: _ClassVar[int]
    spec: ModelSpec
    daemon_index: int
    shards: _containers.RepeatedCompositeFieldContainer[ShardPlacement]
    params: _containers.RepeatedCompositeFieldContainer[ParamPlacement]
    total_numel: int
    damaged: str
    def __init__(self, spec: _Optional[_Union[ModelSpec, _Mapping]] = ..., daemon_index: _Optional[int] = ..., shards: _Optional[_Iterable[_Union[ShardPlacement, _Mapping]]] = ..., params: _Optional[_Iterable[_Union[ParamPlacement, _Mapping]]] = ..., total_numel: _Optional[int] = ..., damaged: _Optional[str] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class VerifyPlan(_message.Message):
    __slots__ = ("shards", "bytes", "at_rest", "damaged")
    class DamagedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    AT_REST_FIELD_NUMBER: _ClassVar[int]
    DAMAGED_FIELD_NUMBER: _ClassVar[int]
    shards: int
    bytes: int
    at_rest: bool
    damaged: _containers.ScalarMap[str, str]
    def __init__(self, shards: _Optional[int] = ..., bytes: _Optional[int] = ..., at_rest: _Optional[bool] = ..., damaged: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ShardVerdict(_message.Message):
    __slots__ = ("model", "shard_id", "status", "detail", "version", "bytes_read", "tier", "nonfinite")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    NONFINITE_FIELD_NUMBER: _ClassVar[int]
    model: str
    shard_id: int
    status: VerifyStatus
    detail: str
    version: int
    bytes_read: int
    tier: str
    nonfinite: int
    def __init__(self, model: _Optional[str] = ..., shard_id: _Optional[int] = ..., status: _Optional[_Union[VerifyStatus, str]] = ..., detail: _Optional[str] = ..., version: _Optional[int] = ..., bytes_read: _Optional[int] = ..., tier: _Optional[str] = ..., nonfinite: _Optional[int] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("plan", "shard")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    plan: VerifyPlan
    shard: ShardVerdict
    def __init__(self, plan: _Optional[_Union[VerifyPlan, _Mapping]] = ..., shard: _Optional[_Union[ShardVerdict, _Mapping]] = ...) -> None: ...

class DataRequest(_message.Message):
    __slots__ = ("pull", "push", "attach", "batch", "timeout_ms", "authorization", "local", "pull_into", "pull_dtype")
    PULL_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    AUTHORIZATION_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    PULL_INTO_FIELD_NUMBER: _ClassVar[int]
    PULL_DTYPE_FIELD_NUMBER: _ClassVar[int]
    pull: PullRequest
    push: PushHeader
    attach: LocalAttach
    batch: DataBatch
    timeout_ms: int
    authorization: str
    local: LocalRef
    pull_into: LocalRef
    pull_dtype: DType
    def __init__(self, pull: _Optional[_Union[PullRequest, _Mapping]] = ..., push: _Optional[_Union[PushHeader, _Mapping]] = ..., attach: _Optional[_Union[LocalAttach, _Mapping]] = ..., batch: _Optional[_Union[DataBatch, _Mapping]] = ..., timeout_ms: _Optional[int] = ..., authorization: _Optional[str] = ..., local: _Optional[_Union[LocalRef, _Mapping]] = ..., pull_into: _Optional[_Union[LocalRef, _Mapping]] = ..., pull_dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class DataBatch(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[DataRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[DataRequest, _Mapping]]] = ...) -> None: ...

class LocalAttach(_message.Message):
    __slots__ = ("client", "window")
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    client: str
    window: int
    def __init__(self, client: _Optional[str] = ..., window: _Optional[int] = ...) -> None: ...

class LocalRef(_message.Message):
    __slots__ = ("window", "offset", "nbytes")
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    window: int
    offset: int
    nbytes: int
    def __init__(self, window: _Optional[int] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class DataResponse(_message.Message):
    __slots__ = ("code", "message", "shard", "push", "send_payload", "closing", "answers")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    SEND_PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    CLOSING_FIELD_NUMBER: _ClassVar[int]
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    shard: ShardHeader
    push: PushResponse
    send_payload: bool
    closing: bool
    answers: _containers.RepeatedCompositeFieldContainer[DataResponse]
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., shard: _Optional[_Union[ShardHeader, _Mapping]] = ..., push: _Optional[_Union[PushResponse, _Mapping]] = ..., send_payload: _Optional[bool] = ..., closing: _Optional[bool] = ..., answers: _Optional[_Iterable[_Union[DataResponse, _Mapping]]] = ...) -> None: ...
