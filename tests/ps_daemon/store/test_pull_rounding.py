"""bf16 and fp16 pulls on the daemon's side: the rounding against torch's own cast, the store
rounding under the shard's hold and counting the bytes it sends, the refusals, and the wire
helpers that give both transports the same header."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from ps_offload.daemon.composition import open_store
from ps_offload.daemon.errors import InvalidArgument
from ps_offload.daemon.model.spec import ModelSpec, ParamSpec
from ps_offload.daemon.rpc import conversions, data_path
from ps_offload.daemon.rpc.staging import StagingPool
from ps_offload.daemon.store import tier_admin
from ps_offload.daemon.store.pull import PullRequest
from ps_offload.daemon.store.pull_rounding import check_pull_dtype, round_into, rounded, scratch_numel, tensor_bytes
from ps_offload.daemon.store.push import PushRequest
from ps_offload.daemon.store.shard_store import ShardStore
from ps_offload.daemon.tiers.nvme import PAGE, DirectIO, NvmeFiles
from ps_offload.optimizers import SGD, AdamW
from ps_offload.proto import ps_pb2
from tests.helpers.rounding_edges import EDGE_FLOATS, EDGE_NAN_BITS, edge_values

NARROW = {"bfloat16": torch.bfloat16, "float16": torch.float16}
NUMEL = 1024  # one shard of 4 KiB


def test_edge_values_round_as_written_down():
    """What torch's cast does with them, by hand: the daemon matches torch, and this pins
    torch to the rounding the proto promises."""
    bf16 = dict(zip(EDGE_FLOATS, edge_values().to(torch.bfloat16).float().tolist(), strict=False))
    fp16 = dict(zip(EDGE_FLOATS, edge_values().to(torch.float16).float().tolist(), strict=False))
    assert bf16[1 + 2**-8] == 1.0 and bf16[1 + 3 * 2**-8] == 1 + 2**-6  # ties to even
    assert bf16[257.0] == 256.0 and bf16[259.0] == 260.0 and bf16[1 + 2**-8 + 2**-20] == 1 + 2**-7
    assert bf16[3.4028234663852886e38] == math.inf and bf16[1e-40] != 0.0
    assert fp16[1 + 2**-11] == 1.0 and fp16[1 + 3 * 2**-11] == 1 + 2**-9
    assert fp16[2049.0] == 2048.0 and fp16[2051.0] == 2052.0
    assert fp16[65504.0] == 65504.0 and fp16[65519.0] == 65504.0
    assert fp16[65520.0] == math.inf and fp16[-65520.0] == -math.inf and fp16[3.0e38] == math.inf
    assert fp16[2**-24] == 2**-24 and fp16[2**-25] == 0.0 and fp16[3 * 2**-25] == 2**-23
    assert fp16[1e-9] == 0.0 and fp16[1e-40] == 0.0
    values = edge_values()
    nans, negative_zero = values.isnan(), (values == 0) & values.signbit()
    assert nans.sum() == 1 + len(EDGE_NAN_BITS) and negative_zero.sum() == 1
    for narrow in NARROW.values():
        out = edge_values().to(narrow)
        assert torch.equal(out.isnan(), nans)
        assert ((out == 0) & out.signbit())[negative_zero].all()  # -0.0 keeps its sign
    assert math.copysign(1.0, fp16[-1e-40]) == -1.0  # and so does what underflows


@pytest.mark.parametrize("dtype", NARROW)
@pytest.mark.parametrize("numel", [1, 7, 1001, 4097])
def test_round_into_is_torchs_cast_bit_for_bit(dtype, numel):
    g = torch.Generator().manual_seed(numel)
    values = torch.cat([edge_values(), torch.randn(numel, generator=g) * 1000])[:numel]
    buffer = torch.full((scratch_numel(numel, dtype) + 5,), 7.0)
    out = round_into(values, buffer, dtype)
    assert out.dtype == NARROW[dtype] and out.numel() == numel
    assert out.data_ptr() == buffer.data_ptr()  # in the buffer, not a fresh tensor
    assert torch.equal(out.view(torch.int16), values.to(NARROW[dtype]).view(torch.int16))
    assert bytes(tensor_bytes(out)) == values.to(NARROW[dtype]).view(torch.uint8).numpy().tobytes()
    assert len(tensor_bytes(out)) == 2 * numel


def test_rounded_borrows_from_the_pool_and_gives_back():
    pool = StagingPool(max_bytes=1 << 20)
    values = torch.randn(1001)
    with rounded(values, "bfloat16", pool.borrow) as out:
        assert pool.idle_bytes == 0
        assert torch.equal(out.view(torch.int16), values.to(torch.bfloat16).view(torch.int16))
    assert pool.idle_bytes == scratch_numel(1001, "bfloat16") * 4  # 501 fp32 elements hold 1001 bf16
    with rounded(values, "float16") as out:  # no pool: a fresh buffer
        assert torch.equal(out.view(torch.int16), values.to(torch.float16).view(torch.int16))


def test_only_master_pulls_may_travel_narrow():
    check_pull_dtype("float32", "exp_avg", "pull")
    check_pull_dtype("bfloat16", "master", "pull")
    with pytest.raises(InvalidArgument, match="pull: dtype bfloat16 is for master pulls only; pull exp_avg as float32"):
        check_pull_dtype("bfloat16", "exp_avg", "pull")
    with pytest.raises(InvalidArgument, match="dtype 'int8' is unknown; one of float32, bfloat16, float16"):
        check_pull_dtype("int8", "master", "pull")


# -- the store ------------------------------------------------------------------------------


def _store(optimizer=None, files=None, values: torch.Tensor | None = None) -> ShardStore:
    store = open_store(ram_bytes=1 << 30, default_shard_bytes=NUMEL * 4, files=files)
    spec = ModelSpec("m", (ParamSpec("w", (NUMEL,)),), optimizer or SGD(lr=0.1), NUMEL * 4, ("d",))
    store.registry.register(spec, 0)
    values = _values() if values is None else values
    store.push(PushRequest("m", 0, step=0, kind="parameters", data=values, lr=None))
    return store


def _values() -> torch.Tensor:
    return torch.cat([edge_values(), torch.randn(NUMEL, generator=torch.Generator().manual_seed(0))])[:NUMEL]


@pytest.mark.parametrize("dtype", NARROW)
def test_a_narrow_pull_is_rounded_under_the_hold_and_counts_the_bytes_sent(dtype):
    store, values, pool = _store(), _values(), StagingPool(max_bytes=1 << 20)
    shard = store.registry.shard("m", 0)
    with store.pull(PullRequest("m", 0), timeout=1) as (fp32, version):
        assert fp32.dtype == torch.float32 and shard.readers == 1  # fp32: streamed under the hold
    assert store.stats.bytes_pulled == 4 * NUMEL and store.stats.pulls == 1

    with store.pull(PullRequest("m", 0, dtype=dtype), timeout=1, scratch=pool.borrow) as (out, version):
        assert version == 0 and out.dtype == NARROW[dtype] and out.numel() == NUMEL
        assert torch.equal(out.view(torch.int16), values.to(NARROW[dtype]).view(torch.int16))
        # The hold ended with the rounding: an update goes ahead while the copy is sent,
        # and does not change it.
        assert shard.readers == 0
        sent = out.clone()
        gradient = PushRequest("m", 0, step=0, kind="gradient", data=torch.ones(NUMEL), lr=None)
        step = threading.Thread(target=store.push, args=(gradient,))
        step.start()
        step.join(timeout=10)
        assert not step.is_alive() and shard.version == 1
        assert torch.equal(out.view(torch.int16), sent.view(torch.int16))
    assert store.stats.bytes_pulled == 4 * NUMEL + 2 * NUMEL and store.stats.pulls == 2
    assert pool.idle_bytes == NUMEL * 2  # the buffer went back to the pool


def test_the_rounding_happens_while_the_shard_is_held(monkeypatch):
    """A push waits for the rounding: the copy is one version, never half an update."""
    import ps_offload.daemon.store.pull_rounding as pull_rounding

    store = _store()
    shard, seen = store.registry.shard("m", 0), []
    real = pull_rounding.round_into

    def round_into(values, buffer, dtype):
        seen.append((shard.readers, shard.writing))
        return real(values, buffer, dtype)

    monkeypatch.setattr(pull_rounding, "round_into", round_into)
    with store.pull(PullRequest("m", 0, dtype="bfloat16"), timeout=1):
        pass
    assert seen == [(1, False)]


def test_a_narrow_pull_of_an_evicted_shard_loads_it_first(tmp_path):
    files = NvmeFiles(tmp_path, io=DirectIO(threads=2, block_bytes=PAGE), fsync=False, spare_slots=1)
    store = _store(files=files)
    try:
        assert tier_admin.evict(store, "m", 0).tier == "nvme"
        with store.pull(PullRequest("m", 0, dtype="float16"), timeout=5) as (out, version):
            assert version == 0
            assert torch.equal(out.view(torch.int16), _values().to(torch.float16).view(torch.int16))
    finally:
        store.close()
        files.close()


@pytest.mark.parametrize(
    ("tensor", "dtype", "message"),
    [
        ("exp_avg", "bfloat16", "dtype bfloat16 is for master pulls only; pull exp_avg as float32"),
        ("exp_avg_sq", "float16", "dtype float16 is for master pulls only; pull exp_avg_sq as float32"),
        ("master", "float64", "dtype 'float64' is unknown"),
    ],
)
def test_a_refused_pull_holds_and_counts_nothing(tensor, dtype, message):
    store = _store(AdamW(lr=0.1))
    with pytest.raises(InvalidArgument, match="pull of shard 0 of model 'm'") as info:
        with store.pull(PullRequest("m", 0, tensor=tensor, dtype=dtype), timeout=1):
            pass
    assert message in str(info.value)
    assert store.stats.pulls == 0 and store.stats.bytes_pulled == 0 and store.registry.shard("m", 0).readers == 0
    with store.pull(PullRequest("m", 0, tensor=tensor), timeout=1) as (state, _):
        assert state.dtype == torch.float32  # in fp32 it is served


# -- the wire --------------------------------------------------------------------------------


def test_the_wire_names_the_dtype_a_pull_asks_for():
    assert conversions.pull_dtype(ps_pb2.PullRequest()) == "float32"
    assert conversions.pull_dtype(ps_pb2.PullRequest(dtype=ps_pb2.FLOAT32)) == "float32"
    assert conversions.pull_dtype(ps_pb2.PullRequest(dtype=ps_pb2.BFLOAT16)) == "bfloat16"
    assert conversions.pull_dtype(ps_pb2.PullRequest(dtype=ps_pb2.FLOAT16)) == "float16"
    for bad in (99, -1, 4):
        with pytest.raises(InvalidArgument) as info:
            conversions.pull_dtype(ps_pb2.PullRequest(shard_id=3, dtype=bad))
        assert f"pull of shard 3: dtype {bad} is unknown; ask for FLOAT32, BFLOAT16, FLOAT16" in str(info.value)


SENT = [(torch.float32, ps_pb2.FLOAT32), (torch.bfloat16, ps_pb2.BFLOAT16), (torch.float16, ps_pb2.FLOAT16)]


@pytest.mark.parametrize(("dtype", "expected"), SENT)
def test_the_header_says_what_is_sent(dtype, expected):
    header = conversions.shard_header("m", 2, 7, torch.zeros(1001, dtype=dtype))
    assert (header.model, header.shard_id, header.version, header.numel, header.dtype) == ("m", 2, 7, 1001, expected)


@pytest.mark.parametrize("dtype", [ps_pb2.DTYPE_UNSPECIFIED, ps_pb2.FLOAT32, ps_pb2.BFLOAT16, ps_pb2.FLOAT16])
def test_serve_pull_gives_both_transports_the_header_and_the_bytes(dtype):
    store, pool, values = _store(), StagingPool(max_bytes=1 << 20), _values()
    request = ps_pb2.PullRequest(model="m", shard_id=0, dtype=dtype)
    with data_path.serve_pull(store, conversions.pull_request(request), timeout=1, scratch=pool.borrow) as (
        header,
        raw,
    ):
        torch_dtype = {ps_pb2.BFLOAT16: torch.bfloat16, ps_pb2.FLOAT16: torch.float16}.get(dtype, torch.float32)
        assert header.dtype == (dtype or ps_pb2.FLOAT32) and header.numel == NUMEL and header.version == 0
        assert bytes(raw) == values.to(torch_dtype).view(torch.uint8).numpy().tobytes()
    assert store.stats.bytes_pulled == len(raw)
