"""A push as the wire carries it: the header built once, its bytes chunked for gRPC."""

from __future__ import annotations

import pytest

from ps_offload.proto import ps_pb2
from ps_offload.proto.codec import push_chunks
from ps_offload.proto.push import Push


def test_build_fills_the_header_and_counts_the_bytes():
    groups = [ps_pb2.GroupHyperparams(lr=0.5)]
    push = Push.unchecked(
        "gpt", 3, memoryview(bytes(40)), step=7, kind=ps_pb2.APPLY, lr=0.25, groups=groups,
        grad_multiplier=0.125, parts=4, check_only=True,
    )  # fmt: skip
    header = push.header
    assert (header.model, header.shard_id, header.step, header.kind) == ("gpt", 3, 7, ps_pb2.APPLY)
    assert (header.nbytes, header.encoding, header.dtype) == (40, ps_pb2.RAW, ps_pb2.FLOAT32)
    assert header.lr == 0.25 and header.grad_multiplier == 0.125 and list(header.groups) == groups
    assert (header.parts, header.check_only) == (4, True)
    assert push.describe() == "push of shard 3 step 7"


def test_each_kind_has_a_constructor_that_fills_what_it_carries():
    groups = [ps_pb2.GroupHyperparams(lr=0.5)]
    data = memoryview(bytes(8))
    built = {
        "gradient": Push.gradient("m", 1, data, step=3, encoding=ps_pb2.BF16, groups=groups, grad_multiplier=0.5),
        "part": Push.gradient_part("m", 1, data, step=3, part=0, speculate=(groups, 0.5)),
        "apply": Push.apply("m", 1, step=3, parts=2, groups=groups, check_only=True),
        "momentum": Push.momentum("m", 1, data, step=3, encoding=ps_pb2.ONEBIT, lr=0.1, variance_frozen_at=2),
        "parameters": Push.parameters("m", 1, data),
        "state": Push.state("m", 1, data, step=3),
    }
    kinds = {name: push.header.kind for name, push in built.items()}
    assert kinds == {"gradient": ps_pb2.GRADIENT, "part": ps_pb2.GRADIENT_PART, "apply": ps_pb2.APPLY,
                     "momentum": ps_pb2.MOMENTUM, "parameters": ps_pb2.PARAMETERS, "state": ps_pb2.STATE}  # fmt: skip
    part, apply = built["part"].header, built["apply"].header
    assert part.speculate and list(part.groups) == groups and part.grad_multiplier == 0.5
    assert not Push.gradient_part("m", 1, data, step=3, part=1).header.speculate
    assert (apply.nbytes, apply.parts, apply.check_only) == (0, 2, True)
    assert built["momentum"].header.variance_frozen_at == 2 and not built["momentum"].header.groups


def test_unset_optionals_stay_unset():
    header = Push.gradient("m", 0, memoryview(b""), step=0).header
    for field in ("lr", "variance_frozen_at", "grad_multiplier"):
        assert not header.HasField(field), field  # the daemon falls back to the registered values


@pytest.mark.parametrize("nbytes", [0, 1, 7, 8, 9, 16, 17, 40])
def test_chunks_carry_the_header_once_and_every_byte_in_order(nbytes):
    data = bytes(range(nbytes))
    push = Push.gradient("m", 1, memoryview(data), step=2)
    chunks = [push_chunks.decode(wire) for wire in push.chunks(chunk_bytes=8)]
    assert len(chunks) == max(1, -(-nbytes // 8))
    assert chunks[0].header == push.header
    assert all(chunk.header is None for chunk in chunks[1:])
    assert all(len(chunk.data) <= 8 for chunk in chunks)
    assert b"".join(bytes(chunk.data) for chunk in chunks) == data
