"""Pull-stream reassembly: a stream that fills its buffer exactly comes back byte for byte;
any other (wrong header, too many bytes, too few, no header) is refused before a byte lands
past the buffer."""

from __future__ import annotations

import pytest
import torch

from ps_offload.proto import codec, ps_pb2
from ps_offload.proto.pull import PullStreamError, read_pull_stream


def _stream(values: torch.Tensor, *, numel: int | None = None, version: int = 7, chunk_bytes: int = 24, header=True):
    """A Pull stream of `values`, decoded as the clients receive it (through the codec)."""
    data = values.numpy().tobytes()
    head = ps_pb2.ShardHeader(numel=values.numel() if numel is None else numel, version=version) if header else None
    pieces = [data[i : i + chunk_bytes] for i in range(0, len(data), chunk_bytes)] or [b""]
    encoded = [codec.pull_chunks.encode(head if i == 0 else None, p) for i, p in enumerate(pieces)]
    return [codec.pull_chunks.decode(e) for e in encoded]


def test_a_whole_stream_comes_back_with_its_version():
    values = torch.randn(37)
    out = bytearray(37 * 4)
    assert read_pull_stream(_stream(values), out, what="shard 3") == 7
    assert torch.equal(torch.frombuffer(out, dtype=torch.float32), values)

    into = torch.zeros(37)  # a byte view of a tensor, as the trainer passes
    assert read_pull_stream(_stream(values, version=0), memoryview(into.numpy()).cast("B"), what="shard 3") == 0
    assert torch.equal(into, values)


def test_a_header_with_another_size_is_refused():
    with pytest.raises(PullStreamError, match=r"shard 3 came with 36 elements, the plan says 37"):
        read_pull_stream(_stream(torch.randn(37), numel=36), bytearray(37 * 4), what="shard 3")


def test_more_bytes_than_the_shard_holds_are_refused_before_they_land():
    out = bytearray(36 * 4 + 8)  # a guard past the shard's 36 elements
    view = memoryview(out)[: 36 * 4]
    with pytest.raises(PullStreamError, match=r"shard 3 came with more than its 36 elements"):
        read_pull_stream(_stream(torch.randn(37), numel=36), view, what="shard 3")
    assert out[36 * 4 :] == bytes(8)


def test_a_short_stream_or_one_without_header_is_refused():
    with pytest.raises(PullStreamError, match=r"shard 3 ended after 148 of 160 bytes"):
        read_pull_stream(_stream(torch.randn(37), numel=40), bytearray(160), what="shard 3")
    with pytest.raises(PullStreamError, match=r"ended after 148 of 148 bytes"):
        read_pull_stream(_stream(torch.randn(37), header=False), bytearray(148), what="shard 3")
