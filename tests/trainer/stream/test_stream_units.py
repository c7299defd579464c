"""What a streamed model must be, refused with a message naming the problem before anything
changes; and how its parameters sit in their units' buffers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ps_offload import trainer
from ps_offload.trainer.debug_models import GPTConfig, TinyGPT
from ps_offload.trainer.stream.units import initialise, stream_units

CONFIG = GPTConfig(vocab_size=16, block_size=4, n_layer=2, n_head=2, n_embd=8)


def test_units_follow_blocks_and_parameters_become_views_of_their_buffers():
    model = TinyGPT(CONFIG)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = {n: id(p) for n, p in model.named_parameters()}
    units, _ = stream_units(model, list(model.blocks), torch.device("cpu"))
    assert [u.streamed for u in units] == [False, True, True, False]
    assert units[1].names[0] == "blocks.0.ln1.weight" and units[3].names == ["ln_f.weight", "ln_f.bias"]
    for unit in units:
        for p, offset in zip(unit.params, unit.offsets, strict=True):
            assert p.data_ptr() == unit.values[offset:].data_ptr()
    # A materialised model keeps its values and its parameter objects.
    for name, p in model.named_parameters():
        assert id(p) == ids[name] and torch.equal(p, before[name])
    units[1].release()
    assert not units[1].allocated and units[1].params[0].shape == before["blocks.0.ln1.weight"].shape
    units[1].allocate()
    assert units[1].allocated


def test_a_meta_model_is_initialised_by_reset_parameters_one_unit_at_a_time():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    units, owners = stream_units(model, [model[0], model[1]], torch.device("cpu"))
    assert all(not u.allocated for u in units)
    torch.manual_seed(3)
    expected = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))  # same reset_parameters calls, same order
    torch.manual_seed(3)
    for unit in units:
        unit.allocate()
        initialise(unit, owners, None)
    assert torch.equal(model[0].weight, expected[0].weight) and torch.equal(model[1].bias, expected[1].bias)


class _Raw(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.empty(3))

    def forward(self, x):
        return x * self.scale


def test_a_parameter_nobody_initialises_is_named():
    with torch.device("meta"):
        model = nn.Sequential(_Raw(), nn.Linear(3, 3))
    units, owners = stream_units(model, [model[1]], torch.device("cpu"))
    units[0].allocate()
    with pytest.raises(ValueError, match=r"parameter '0.scale' was built on the meta device"):
        initialise(units[0], owners, None)


@pytest.mark.parametrize(
    "case,match",
    [
        ("foreign_block", "not a submodule"),
        ("shared", "shared between a streamed block and a module outside it"),
        ("interleaved", "one run of the model's named_parameters"),
        ("frozen", "frozen"),
        ("mixed_dtype", "one dtype"),
        ("nested_blocks", "share a module"),
    ],
)
def test_models_that_cannot_stream_are_refused_before_anything_changes(case, match):
    model = TinyGPT(CONFIG)
    blocks = list(model.blocks)
    if case == "foreign_block":
        blocks = [nn.Linear(2, 2)]
    elif case == "shared":
        model.head.weight = model.blocks[0].attn.proj.weight
    elif case == "interleaved":
        model = _Interleaved()
        blocks = [model.first]
    elif case == "frozen":
        model.blocks[0].ln1.weight.requires_grad_(False)
    elif case == "mixed_dtype":
        model.blocks[1].to(torch.bfloat16)
    elif case == "nested_blocks":
        blocks = [model.blocks[0], model.blocks[0].attn]
    before = {n: (p.data_ptr(), p.dtype) for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=match):
        stream_units(model, blocks, torch.device("cpu"))
    assert {n: (p.data_ptr(), p.dtype) for n, p in model.named_parameters()} == before


class _Interleaved(nn.Module):
    """A block whose parameters are split by another module's in named_parameters() order."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(2, 2)
        self.other = nn.Linear(2, 2)

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        params = dict(super().named_parameters(prefix, recurse, remove_duplicate))
        if not recurse:
            return iter(params.items())
        order = ["first.weight", "other.weight", "first.bias", "other.bias"]
        return iter([(n, params[n]) for n in order])


def test_streaming_settings_are_checked_where_they_are_written():
    model = TinyGPT(CONFIG)
    with pytest.raises(ValueError, match="blocks is empty"):
        trainer.Streaming(blocks=[])
    with pytest.raises(ValueError, match="window_bytes"):
        trainer.Streaming(blocks=list(model.blocks), window_bytes=0)
    with pytest.raises(ValueError, match="micro_batches"):
        trainer.Streaming(blocks=list(model.blocks), micro_batches=2)
    for wrong in (1, "yes"):
        with pytest.raises(ValueError, match="return_freed must be True, False or None"):
            trainer.Streaming(blocks=list(model.blocks), return_freed=wrong)


def test_freed_memory_stays_in_the_heap_only_where_a_quarter_of_what_is_free_holds_the_model():
    blocks = list(TinyGPT(CONFIG).blocks)
    decide = trainer.Streaming(blocks=blocks)
    assert not decide.returns_freed(1 << 30, 4 << 30)  # its rise fits a quarter
    assert decide.returns_freed((1 << 30) + 1, 4 << 30)
    assert decide.returns_freed(1, None)  # not known: as before
    assert trainer.Streaming(blocks=blocks, return_freed=False).returns_freed(1 << 40, 1 << 20) is False
    assert trainer.Streaming(blocks=blocks, return_freed=True).returns_freed(1, 1 << 40) is True
