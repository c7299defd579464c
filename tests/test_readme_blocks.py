"""The README's blocks run as written.

* Every ```toml block loads where it belongs: a daemon config through the daemon's own loader
  (unknown keys refused), a cluster file through the trainers' (and ps-admin's) reader.
* Every ```python block compiles; the quickstart runs, end to end, against a real daemon.
* The ps-admin block runs line by line in bash, in order, against four real daemons with NVMe
  tiers, every line exiting 0.

What a test must change to run a block is said where it is changed, and is only ever an
address, a path or the device: `127.0.0.1:50051` becomes the test daemon's address (port 0
picks a free one), `.venv/bin/` this interpreter's folder, `/shared/` a temporary folder, and
`"cuda"` the CPU where no GPU is; the placeholders the quickstart leaves to its reader
(`build_my_model`, `batches`, `loss_fn`) are given.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from ps_offload import trainer
from ps_offload.proto import ps_pb2, ps_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BIN = Path(sys.executable).parent


def blocks(language: str) -> list[tuple[int, str]]:
    """(line, text) of every fenced block of `language` in the README."""
    found, current, start = [], None, 0
    for number, line in enumerate(README.read_text().splitlines(), 1):
        if current is None and line.strip() == f"```{language}":
            current, start = [], number
        elif current is not None and line.strip() == "```":
            found.append((start, "\n".join(current)))
            current = None
        elif current is not None:
            current.append(line)
    assert found, f"no ```{language} block in README.md: the scan is broken"
    return found


def block_holding(language: str, needle: str) -> tuple[int, str]:
    matches = [(line, text) for line, text in blocks(language) if needle in text]
    assert len(matches) == 1, f"one ```{language} block of README.md should hold {needle!r}, found {len(matches)}"
    return matches[0]


def daemon_stats(address: str) -> ps_pb2.StatsResponse:
    import grpc

    with grpc.insecure_channel(address) as channel:
        return ps_pb2_grpc.AdminStub(channel).Stats(ps_pb2.StatsRequest(), timeout=30)


def test_every_toml_block_loads_where_it_belongs(tmp_path):
    from ps_offload.daemon.config import load_config
    from ps_offload.proto.cluster import read_cluster_file

    kinds = []
    for line, text in blocks("toml"):
        # The certificate, key and token files it names stand in tmp_path (the loader checks
        # that they are files); the folders it names are checked when the daemon starts.
        for named in set(re.findall(r'"(/etc/[^"]+)"', text)):
            (tmp_path / Path(named).name).write_text("")
            text = text.replace(f'"{named}"', f'"{tmp_path / Path(named).name}"')
        data = tomllib.loads(text)
        path = tmp_path / f"block{line}.toml"
        path.write_text(text)
        if "daemons" in data:
            assert read_cluster_file(path), f"README.md:{line}"
            kinds.append("cluster")
        else:
            load_config(path)  # the daemon's loader: every key checked
            kinds.append("daemon")
    assert {"cluster", "daemon"} <= set(kinds), kinds


def test_every_python_block_compiles():
    for line, text in blocks("python"):
        compile(text, f"README.md:{line}", "exec")


def test_the_quickstart_trains_through_a_daemon(daemon):
    line, text = block_holding("python", "build_my_model()")
    assert "127.0.0.1:50051" in text and '"cuda"' in text, f"README.md:{line}: the substitutions below are stale"
    text = text.replace("127.0.0.1:50051", daemon.address)
    if not torch.cuda.is_available():
        text = text.replace('"cuda"', '"cpu"')
    torch.manual_seed(0)
    x, y = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(8, 4)  # the block makes the model bf16
    scope = {
        "build_my_model": lambda: torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)),
        "batches": [(x, y)] * 3,
        "loss_fn": lambda out, target: torch.nn.functional.mse_loss(out.float(), target),
    }
    exec(compile(text, f"README.md:{line}", "exec"), scope)  # noqa: S102 - the README's own block
    assert isinstance(scope["opt"], torch.optim.Optimizer)
    assert scope["opt"].param_groups[0]["lr"] < 3e-4  # the scheduler stepped it
    stats = daemon_stats(daemon.address)
    assert stats.models == 1 and stats.pushes_applied == 3 * stats.shards  # 3 steps of every shard


class _Tiny(torch.nn.Module):
    """Names the README's filter finds (`--param attn`), and shards on both daemons."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = torch.nn.Linear(48, 48)
        self.mlp = torch.nn.Linear(48, 96)


@pytest.mark.slow
def test_the_ps_admin_block_runs_line_by_line(daemon_factory, tmp_path):
    line, text = block_holding("sh", "ps-admin models")
    d, d2, e, e2 = daemon_factory.together(
        [("--nvme-dir", str(tmp_path / f"nvme{i}"), "--create-nvme-dir") for i in range(4)]
    )
    torch.manual_seed(0)
    model = _Tiny()
    with trainer.offload(
        model,
        daemons=[d.address, d2.address],
        optimizer=trainer.AdamW(lr=1e-2),
        config=trainer.OffloadConfig(model_name="model", shard_bytes=4096),
    ) as opt:
        assert len(opt.plan) >= 4 and opt.plan[0].daemon_index == 0  # `evict 0 --daemon $D`
        for _ in range(2):
            model.mlp(model.attn(torch.randn(4, 48))).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
    shared = tmp_path / "shared"
    shared.mkdir()
    script = text.replace(".venv/bin/", f"{BIN}/").replace("/shared/", f"{shared}/")
    for name, daemon in (("D", d), ("D2", d2), ("E", e), ("E2", e2)):
        script, count = re.subn(rf"\b{name}=127\.0\.0\.1:\d+", f"{name}={daemon.address}", script)
        assert count == 1, f"README.md:{line}: no {name}=127.0.0.1:PORT to replace"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PS_") and k != "COLUMNS"}
    lines = script.splitlines()
    assignments = "\n".join(lines[:2])
    for offset, command in enumerate(lines[2:], 2):
        proc = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", f"{assignments}\n{command}"],
            cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert proc.returncode == 0, (
            f"README.md:{line + 1 + offset}: {command}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        )
    assert (tmp_path / "model.safetensors").stat().st_size > 0
    assert (shared / "s1").is_dir()
