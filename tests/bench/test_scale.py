"""`make bench-scale` sizes its model from the machine's RAM, says what it needs before it
starts and refuses a disk or a memory too small; its smoke run trains two narrow blocks end
to end through a daemon, the trainer in its own process."""

from __future__ import annotations

import shutil
import subprocess
import sys
import types

import pytest

from bench import scale
from bench.common import REPO

MEM_TOTAL = 25_276_063_744  # the machine the figures come from: 23.5 GiB


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench.scale", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def test_the_model_is_the_smallest_whose_state_is_twice_the_ram():
    p = scale.plan(2.0, mem_total=MEM_TOTAL)
    assert p.n_embd == 2560 and p.n_layer == 54 and 4.2e9 < p.params < 4.3e9
    assert p.state_bytes == 12 * p.params >= 2 * MEM_TOTAL
    one_block_less = p.params - scale.block_params(p.n_embd)
    assert 12 * one_block_less < 2 * MEM_TOTAL
    # Five shards per block, one per run of parameters outside the blocks (embeddings, ln_f).
    assert p.shards == 5 * p.n_layer + 2
    assert p.shard_bytes % 4096 == 0 and p.shard_bytes * 5 >= 4 * scale.block_params(p.n_embd)
    # The arena file holds the state about once: one slot per shard and a few spares.
    assert p.state_bytes < p.arena_bytes < 1.05 * p.state_bytes
    assert p.disk_bytes > p.arena_bytes + p.fio_bytes and p.ram_tier_bytes == 4 << 30


def test_a_small_run_shrinks_its_tier_but_keeps_what_a_step_holds():
    p = scale.plan(0.3, mem_total=MEM_TOTAL)
    assert p.n_layer < 54 and p.ram_tier_bytes < 4 << 30
    slot = p.arena_bytes // (p.shards + 8)  # 8 spare slots, the daemon's default
    assert p.ram_tier_bytes >= scale.MIN_TIER_ARENAS * slot


def test_check_only_reports_the_size_and_what_it_needs():
    result = _run("--check-only", "--ram-multiple", "0.01")
    assert result.returncode == 0, result.stderr
    assert "parameters" in result.stdout and "GB of disk" in result.stdout and "GiB of memory" in result.stdout


def test_a_disk_too_small_is_refused_with_what_it_needs():
    result = _run("--check-only", "--ram-multiple", "1000")  # 1000x RAM: no test machine has that much disk
    assert result.returncode != 0
    assert "bench-scale: needs" in result.stderr and "GB free under" in result.stderr
    assert "Traceback" not in result.stderr


def test_too_little_memory_is_refused_with_what_it_needs(tmp_path, monkeypatch):
    p = scale.plan(0.01, mem_total=MEM_TOTAL)
    real = scale.meminfo
    monkeypatch.setattr(scale, "meminfo", lambda key: 1 << 30 if key == "MemAvailable" else real(key))
    monkeypatch.setattr(shutil, "disk_usage", lambda _: types.SimpleNamespace(free=1 << 50))  # disk enough
    with pytest.raises(SystemExit, match=r"needs .* GiB of available memory .* 1.0 GiB are available"):
        scale.check_room(tmp_path, p)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed (make bench-tools)")
def test_smoke_trains_two_blocks_end_to_end():
    result = _run("--smoke", timeout=170)
    assert result.returncode == 0, result.stderr[-4000:]
    out = result.stdout
    assert "step 0: loss" in out and "step 1: loss" in out and "fio:" in out
    assert "trainer peak RSS" in out and "nothing recorded" in out
