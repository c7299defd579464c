"""trainer/io/device.py on the CPU: the host buffers' bound (DeviceConfig.max_pinned_bytes and the
host's MemAvailable, not RLIMIT_MEMLOCK), and the ordering every staged copy and compression
gets. On an accelerator each copy and each push's compression runs on an I/O thread, whose
current stream is not the compute stream, so each must be handed the compute stream's event
taken on the training thread (`ShardMover.mark_compute`). Here a recording stand-in for the
copies (DeviceConfig(staging="always") on the CPU) checks that each got it; the same paths
on a GPU with a non-default compute stream are in tests/trainer/io/test_accelerator.py."""

from __future__ import annotations

import contextlib
import logging
import resource
import threading

import pytest
import torch

from ps_offload import trainer
from ps_offload.trainer.debug_models import GPTConfig, TinyGPT, mlp
from ps_offload.trainer.io import device as device_module
from ps_offload.trainer.io.device import (
    PINNED_SHARE,
    HostBuffers,
    HostCopies,
    PinnedMemoryError,
    check_host_buffers,
    mem_available,
    note_memlock,
)
from ps_offload.trainer.io.push_compression import PushCompressor

MiB, GiB = 1 << 20, 1 << 30

# -- the bound -----------------------------------------------------------------------------


def test_the_default_gpu_setup_fits_a_stock_host():
    """4 host buffers of a 64 MiB shard on a host with 16 GiB available: allowed, whatever
    RLIMIT_MEMLOCK says (8 MiB on a stock machine); the bound is a quarter of MemAvailable."""
    assert check_host_buffers(4 * 64 * MiB, budget=None, available=16 * GiB) == 16 * GiB // PINNED_SHARE


def test_more_than_the_default_share_of_available_memory_is_refused_naming_the_key():
    with pytest.raises(PinnedMemoryError, match=r"set DeviceConfig\.max_pinned_bytes") as e:
        check_host_buffers(5 * GiB, budget=None, available=16 * GiB)
    assert "DeviceConfig.host_buffers" in str(e.value) and "OffloadConfig.shard_bytes" in str(e.value)


def test_an_explicit_budget_binds_both_ways():
    # Above the default share, below MemAvailable: the user's budget allows it.
    assert check_host_buffers(5 * GiB, budget=6 * GiB, available=16 * GiB) == 6 * GiB
    with pytest.raises(PinnedMemoryError, match=r"DeviceConfig\.max_pinned_bytes allows 1048576: raise"):
        check_host_buffers(2 * MiB, budget=MiB, available=16 * GiB)
    # With MemAvailable unknown (not Linux), only a given budget binds.
    assert check_host_buffers(64 * GiB, budget=None, available=None) is None
    with pytest.raises(PinnedMemoryError):
        check_host_buffers(2 * MiB, budget=MiB, available=None)


def test_more_than_the_host_has_is_refused_even_within_the_budget():
    with pytest.raises(PinnedMemoryError, match=r"the host has 1073741824 available \(MemAvailable\)"):
        check_host_buffers(2 * GiB, budget=4 * GiB, available=GiB)


def test_mem_available_reads_proc_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24684096 kB\nMemFree:  1 kB\nMemAvailable:   24200100 kB\n")
    assert mem_available(str(meminfo)) == 24200100 * 1024
    meminfo.write_text("MemTotal:       24684096 kB\n")
    assert mem_available(str(meminfo)) is None
    assert mem_available(str(tmp_path / "absent")) is None


def test_rlimit_memlock_below_the_buffers_is_only_noted(monkeypatch, caplog):
    monkeypatch.setattr(device_module.resource, "getrlimit", lambda which: (8 * MiB, 8 * MiB))
    with caplog.at_level(logging.DEBUG, logger=device_module.__name__):
        note_memlock(256 * MiB)  # no refusal
    assert "exceed RLIMIT_MEMLOCK (8388608)" in caplog.text


def test_host_buffers_report_their_bytes_and_apply_the_budget(caplog):
    with caplog.at_level(logging.INFO, logger=device_module.__name__):
        buffers = HostBuffers(3, 1000, torch.bfloat16, pin=False, max_bytes=6000)
    assert buffers.nbytes == 6000
    assert "host buffers: 3 of 2000 bytes, 6000 bytes in all (bound 6000)" in caplog.text
    with pytest.raises(PinnedMemoryError, match="need 6000 bytes"):
        HostBuffers(3, 1000, torch.bfloat16, pin=False, max_bytes=5999)


def test_a_staged_run_within_the_budget_trains_with_rlimit_memlock_below_it(daemon, caplog):
    """A real tiny staged run: RLIMIT_MEMLOCK (soft, restored after) far below the buffers is
    no reason to refuse; max_pinned_bytes is; the figure is logged and exposed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    low = 4096 if hard == resource.RLIM_INFINITY else min(4096, hard)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (low, hard))
    try:
        torch.manual_seed(0)
        model = mlp((33, 129, 17, 10)).to(torch.bfloat16)
        with caplog.at_level(logging.INFO, logger=device_module.__name__):
            opt = trainer.offload(
                model, daemons=[daemon.address], optimizer=trainer.AdamW(lr=1e-2),
                config=trainer.OffloadConfig(model_name="budget", shard_bytes=8192),
                device=trainer.DeviceConfig(staging="always", host_buffers=2, max_pinned_bytes=1 << 20),
            )  # fmt: skip
        with opt:
            expected = 2 * max(s.numel for s in opt.plan) * 2
            assert opt.host_buffer_bytes == expected > low
            assert f"{expected} bytes in all (bound 1048576)" in caplog.text
            x = torch.randn(4, 33).to(torch.bfloat16)
            torch.nn.functional.cross_entropy(model(x).float(), torch.tensor([1, 2, 3, 4])).backward()
            opt.step()
            assert opt.step_count == 1
        with pytest.raises(PinnedMemoryError, match=r"DeviceConfig\.max_pinned_bytes allows 4096"):
            trainer.offload(
                mlp((33, 129, 17, 10)).to(torch.bfloat16), daemons=[daemon.address], optimizer=trainer.AdamW(),
                config=trainer.OffloadConfig(model_name="over-budget", shard_bytes=8192),
                device=trainer.DeviceConfig(staging="always", host_buffers=2, max_pinned_bytes=4096),
            )  # fmt: skip
    finally:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))


# -- the ordering ----------------------------------------------------------------------------


class _Mark:
    """What the recording stand-in's mark_compute returns: which call, on which thread."""

    def __init__(self, number: int, thread: str) -> None:
        self.number, self.thread = number, thread

    def __repr__(self) -> str:
        return f"mark{self.number}@{self.thread}"


class RecordingCopies(HostCopies):
    """The CPU's copies, recording each call's `after` and thread; `inside` says whether the
    current thread is in a `following` block (where a push's compression must run)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object, str]] = []
        self.marks: list[_Mark] = []
        self._lock = threading.Lock()
        self._local = threading.local()

    def _record(self, what: str, after: object) -> None:
        with self._lock:
            self.calls.append((what, after, threading.current_thread().name))

    def mark_compute(self, device: torch.device) -> _Mark:
        with self._lock:
            mark = _Mark(len(self.marks), threading.current_thread().name)
            self.marks.append(mark)
            return mark

    def to_host(self, source, host, after) -> None:
        self._record("to_host", after)
        super().to_host(source, host, after)

    def to_device(self, host, target, after) -> None:
        self._record("to_device", after)
        super().to_device(host, target, after)

    @contextlib.contextmanager
    def following(self, after):
        self._record("following", after)
        self._local.inside = True
        try:
            yield
        finally:
            self._local.inside = False

    @property
    def inside(self) -> bool:
        return getattr(self._local, "inside", False)

    def take(self) -> tuple[list[_Mark], list[tuple[str, object, str]]]:
        with self._lock:
            marks, calls = self.marks, self.calls
            self.marks, self.calls = [], []
            return marks, calls


@pytest.fixture
def recording(monkeypatch):
    """Every ShardMover built in the test gets a RecordingCopies (they are listed here)."""
    made: list[RecordingCopies] = []

    def make() -> RecordingCopies:
        made.append(RecordingCopies())
        return made[-1]

    monkeypatch.setattr(device_module, "HostCopies", make)
    return made


def _staged(daemon, name: str, model, **options):
    return trainer.offload(
        model, daemons=[daemon.address], optimizer=trainer.AdamW(lr=1e-2),
        config=trainer.OffloadConfig(model_name=name, shard_bytes=4096),
        device=trainer.DeviceConfig(staging="always", host_buffers=2), **options,
    )  # fmt: skip


def _one_step(model, opt) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 33, generator=g).to(torch.bfloat16)
    torch.nn.functional.cross_entropy(model(x).float(), torch.randint(10, (8,), generator=g)).backward()
    opt.step()
    opt.synchronize()


def _assert_all_after(calls, what: str, mark: _Mark, count: int) -> None:
    got = [(after, thread) for kind, after, thread in calls if kind == what]
    assert len(got) == count, (what, calls)
    for after, thread in got:
        assert after is mark, f"{what} on {thread} followed {after!r}, not the training thread's {mark!r}"
        assert thread.startswith("ps-io"), thread


def test_initial_push_step_and_resume_pull_follow_the_training_threads_mark(daemon, recording):
    torch.manual_seed(0)
    model = mlp((33, 129, 17, 10)).to(torch.bfloat16)
    with _staged(daemon, "ordering", model) as opt:
        (copies,) = recording
        shards = len(opt.plan)
        # Fresh model: each shard's first push copies the values after the mark taken on
        # the calling thread (the flat buffer was filled on its stream).
        marks, calls = copies.take()
        assert [m.thread for m in marks] == [threading.main_thread().name]
        _assert_all_after(calls, "to_host", marks[0], shards)
        _one_step(model, opt)
        marks, calls = copies.take()
        assert [m.thread for m in marks] == [threading.main_thread().name]
        _assert_all_after(calls, "to_host", marks[0], shards)  # the gradients
        _assert_all_after(calls, "to_device", marks[0], shards)  # the new values
    # Known model: the resume's pulls land after what the device queued into the buffer.
    with _staged(daemon, "ordering", mlp((33, 129, 17, 10)).to(torch.bfloat16)) as again:
        assert again.step_count == 1
        marks, calls = recording[1].take()
        assert [m.thread for m in marks] == [threading.main_thread().name]
        _assert_all_after(calls, "to_device", marks[0], shards)


def test_compressed_pushes_run_after_the_mark_inside_following(daemon, recording, monkeypatch):
    compressed_inside: list[bool] = []
    payload = PushCompressor.payload

    def recorded(self, shard, step, grads):
        compressed_inside.append(recording[0].inside)
        return payload(self, shard, step, grads)

    monkeypatch.setattr(PushCompressor, "payload", recorded)
    torch.manual_seed(0)
    model = mlp((33, 129, 17, 10)).to(torch.bfloat16)
    with _staged(daemon, "ordering-bf16", model, compression=trainer.CompressionConfig(method="bf16")) as opt:
        (copies,) = recording
        copies.take()
        _one_step(model, opt)
        marks, calls = copies.take()
        assert [m.thread for m in marks] == [threading.main_thread().name]
        _assert_all_after(calls, "following", marks[0], len(opt.plan))
        assert compressed_inside == [True] * len(opt.plan)
        assert opt.bytes_pushed == 2 * opt.flat.numel  # compressed, not the gradient as it is


def test_a_streamed_models_initial_push_follows_the_mark(daemon, recording):
    config = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
    with torch.device("meta"):
        model = TinyGPT(config).to(torch.bfloat16)
    stream = trainer.Streaming(blocks=list(model.blocks), window_bytes=1 << 20, device="cpu")
    with trainer.offload(
        model, daemons=[daemon.address], optimizer=trainer.AdamW(lr=1e-2),
        config=trainer.OffloadConfig(model_name="ordering-stream", shard_bytes=4096), stream=stream,
        device=trainer.DeviceConfig(staging="always", host_buffers=2),
    ) as opt:  # fmt: skip
        (copies,) = recording
        marks, calls = copies.take()
        # One mark per unit, after its initialisation, on the calling thread; each of the
        # unit's shards copied after it.
        assert len(marks) == len(opt.units) and {m.thread for m in marks} == {threading.main_thread().name}
        pushed = [(after, thread) for kind, after, thread in calls if kind == "to_host"]
        assert len(pushed) == len(opt.plan)
        expected = sorted(marks[i].number for i, unit in enumerate(opt.units) for _ in unit.shards)
        assert all(isinstance(after, _Mark) for after, _ in pushed), pushed
        assert sorted(after.number for after, _ in pushed) == expected
        assert all(thread.startswith("ps-io") for _, thread in pushed)
