"""ForwardWaits (trainer/offload/forward_waits.py) on its own: which shards each module's
forward waits for, recorded by the callbacks, for models whose modules read a child's
parameters without calling it."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ps_offload.trainer.offload.forward_waits import ForwardWaits


class Recorder:
    """The waits as they happen: ("all",) or ("wait", module name, shard ids)."""

    def __init__(self, model: nn.Module) -> None:
        self.events: list[tuple] = []
        self.running: list[str] = []
        names = {id(m): n or "<root>" for n, m in model.named_modules()}
        for module in model.modules():  # after the waits' own hooks: names the module being entered
            module.register_forward_pre_hook(lambda m, _a: self.running.append(names[id(m)]), prepend=True)

    def wait(self, ids: list[int]) -> None:
        self.events.append(("wait", self.running[-1], tuple(ids)))

    def wait_all(self) -> None:
        self.events.append(("all",))

    def clear(self) -> list[tuple]:
        events, self.events, self.running = self.events, [], []
        return events


def _own_by_parameter(model: nn.Module) -> dict[nn.Module, list[int]]:
    """A shard id per parameter, in named_parameters order: each module's own ids."""
    number = {id(p): i for i, p in enumerate(model.parameters())}
    return {m: [number[id(p)] for p in m.parameters(recurse=False)] for m in model.modules()}


def _waits(model: nn.Module) -> tuple[ForwardWaits, Recorder]:
    recorder = Recorder(model)
    waits = ForwardWaits(model, _own_by_parameter(model), wait=recorder.wait, wait_all=recorder.wait_all)
    return waits, recorder


def _ids_of(model: nn.Module, *prefixes: str) -> set[int]:
    return {i for i, (n, _) in enumerate(model.named_parameters()) if n.startswith(prefixes)}


def test_the_first_forward_waits_for_everything_and_later_ones_wait_for_out_proj_at_the_attention():
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    waits, recorder = _waits(model)
    x = torch.randn(2, 5, 16)
    model(x)
    assert recorder.clear()[0] == ("all",) and waits.kinds == 1
    model(x)
    events = recorder.clear()
    assert ("all",) not in events
    by_module = {name: set(ids) for _, name, ids in events}
    # out_proj's forward never runs: the attention, which reads its weight and bias, waits.
    assert "self_attn.out_proj" not in by_module
    assert _ids_of(model, "self_attn.out_proj") <= by_module["self_attn"]
    assert by_module["linear1"] == _ids_of(model, "linear1")
    waited = set().union(*by_module.values())
    assert waited == set(range(len(list(model.parameters())))), "every parameter is waited for"


def test_eval_without_grad_is_a_kind_of_its_own():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    waits, recorder = _waits(model)
    x = torch.randn(2, 5, 16)
    model(x)
    model(x)
    recorder.clear()
    model.eval()
    with torch.no_grad():
        model(x)  # a new kind: everything first
        assert recorder.clear()[0] == ("all",) and waits.kinds == 2
        model(x)
    events = recorder.clear()
    by_module = {name: set(ids) for _, name, ids in events}
    for index in range(2):
        # Every parameter of each layer is waited for in the layer's forward (torch's fast path
        # is off with hooks attached: the children run and wait for their own).
        inside = _ids_of(model, f"layers.{index}.")
        waited = set().union(*(ids for name, ids in by_module.items() if name.startswith(f"layers.{index}")))
        assert waited == inside
    model.train()
    model(x)
    assert recorder.clear()[0] != ("all",)  # the training kind is known still


def test_a_root_forward_that_reads_a_childs_weight_waits_for_it_first():
    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(8, 8)
            self.head = nn.Linear(8, 4)

        def forward(self, x):
            return F.linear(self.body(x), self.head.weight, self.head.bias)  # head is never called

    model = Head()
    waits, recorder = _waits(model)
    model(torch.randn(3, 8))
    model(torch.randn(3, 8))
    events = recorder.clear()[1:]
    assert events[0] == ("wait", "<root>", tuple(sorted(_ids_of(model, "head."))))
    assert events[1] == ("wait", "body", tuple(sorted(_ids_of(model, "body."))))


def test_an_exception_in_a_forward_leaves_no_forward_half_open():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    waits, recorder = _waits(model)
    try:
        model(torch.randn(2, 5))  # a shape error inside the first Linear
    except RuntimeError:
        pass
    model(torch.randn(2, 4))
    model(torch.randn(2, 4))
    events = recorder.clear()
    assert events.count(("all",)) == 2  # the failed forward learned nothing; the next one did
    assert events[-2:] == [("wait", "0", (0, 1)), ("wait", "2", (2, 3))]
    waits.remove()
    model(torch.randn(2, 4))
    assert not recorder.clear()
