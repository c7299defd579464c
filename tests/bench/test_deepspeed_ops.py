"""An interrupted DeepSpeed op build leaves torch's build lock behind, and the next `make bench`
used to wait on it forever without a word: now a lock with no compiler running is removed,
saying so, and one held by a running build is waited for, at most a bounded time."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest

from bench import deepspeed_ops


@pytest.fixture
def lock(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    path = tmp_path / "cpu_adam" / "lock"
    path.parent.mkdir()
    path.write_text("")
    return path


def test_a_lock_left_by_an_interrupted_build_is_removed_saying_so(lock, capsys, monkeypatch):
    monkeypatch.setattr(deepspeed_ops, "compiler_running", lambda: False)
    deepspeed_ops.clear_stale_lock("cpu_adam")
    assert not lock.exists()
    assert "an interrupted build left it: removed" in capsys.readouterr().out


def test_a_lock_held_by_a_running_build_is_waited_for_at_most_the_bound(lock, capsys, monkeypatch):
    monkeypatch.setattr(deepspeed_ops, "compiler_running", lambda: True)
    started = time.monotonic()
    with pytest.raises(SystemExit, match="still held after 2s while a compiler runs"):
        deepspeed_ops.clear_stale_lock("cpu_adam", wait_seconds=2.0)
    assert time.monotonic() - started < 30
    assert lock.exists() and "another build of this op holds it" in capsys.readouterr().out


def test_a_running_compiler_is_seen_in_proc(tmp_path):
    if deepspeed_ops.compiler_running():
        pytest.skip("a compiler runs on this host already")
    ninja = tmp_path / "ninja"  # `sleep` under ninja's name
    shutil.copy(shutil.which("sleep"), ninja)
    process = subprocess.Popen([str(ninja), "30"])
    try:
        deadline = time.monotonic() + 30
        while not deepspeed_ops.compiler_running():
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        process.kill()
        process.wait()
