"""bench/gpu_check.py, the GPU machine's one-shot check (`make gpu-check`): its dry run on a
machine without CUDA (every CUDA stage skipped with the reason, the summary written all the
same), the wheel set it carries there, and the tests it names."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import tarfile
import time
import tomllib
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

from bench import gpu_check

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the check runs for real: make gpu-check")
def test_the_dry_run_skips_every_cuda_stage_with_its_reason_and_writes_the_summary(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_check.py"), "check", "--out", str(out),
         "--work", str(tmp_path / "work"), "--no-install", "--budget", "120"],
        cwd=REPO, capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    stages = {s["name"]: s for s in summary["stages"]}
    assert list(stages) == gpu_check.STAGE_NAMES
    assert summary["result"] == "passed" and summary["cuda"] is False and summary["dry_run"] is True

    assert stages["install"]["status"] == "skipped" and "--no-install" in stages["install"]["reason"]
    assert stages["imports"]["status"] == "passed", stages["imports"]
    assert stages["imports"]["figures"]["torch"] == torch.__version__
    assert stages["machine"]["status"] == "passed", stages["machine"]
    for stage in gpu_check.STAGES:
        if stage.cuda:
            got = stages[stage.name]
            assert got["status"] == "skipped" and got["reason"].startswith("no CUDA device"), got
            assert "torch.cuda.is_available() is False" in got["reason"]

    machine = summary["machine"]
    assert {"platform", "cpu", "cores", "memory_gib", "gpu", "python", "torch", "packages"} <= machine.keys()
    assert machine["torch"]["version"] == torch.__version__ and machine["torch"]["cuda_available"] is False
    assert machine["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    assert machine["packages"]["grpcio"] and summary["versions"]["image"]["torch"] == torch.__version__

    # What the device tool brings back: at most 8 plain files, named in letters, digits, . _ -
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted(summary["files"]) and len(files) <= 8
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", f) and (out / f).is_file() for f in files)
    log = (out / "gpu-check.log").read_text()
    assert "===== 02-imports.log" in log and "===== 03-machine.log" in log
    with tarfile.open(out / "details.tar.gz") as tar:
        assert "gpu-check/logs/03-machine.log" in tar.getnames()


def test_a_stage_that_breaks_or_runs_past_its_timeout_is_recorded_and_the_next_one_runs(tmp_path, monkeypatch):
    """With the stages stubbed: one raises, one outlives its timeout (its child process too),
    the others pass; the summary says which and the check exits 1."""
    monkeypatch.setattr(gpu_check, "STAGES", [gpu_check.Stage(s.name, 2, s.cuda, s.shows) for s in gpu_check.STAGES])
    pid_file = tmp_path / "child.pid"

    def stage(stage, runner, result, state, **_):
        if stage.name == "machine":
            state.machine, state.cuda = {"gpu": {"name": "a GPU"}}, True
        if stage.name == "imports":
            raise RuntimeError("boom")
        if stage.name == "nccl":  # a child in the stage's process group that would outlive it
            runner.run(result, ["bash", "-c", f"sleep 60 & echo $! > {pid_file}; wait"])
            return
        result.status = "passed"

    monkeypatch.setattr(gpu_check, "_run_stage", stage)
    rc = gpu_check.check(tmp_path / "out", tmp_path / "work", tmp_path, tmp_path, install=True, only=[], budget_s=60)
    assert rc == 1
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    status = {s["name"]: (s["status"], s["reason"]) for s in summary["stages"]}
    assert status.pop("imports") == ("failed", "gpu_check itself: RuntimeError('boom')")
    assert status.pop("nccl")[0] == "timed_out"
    assert all(s == "passed" for s, _ in status.values()), status
    assert summary["failed_stages"] == ["imports", "nccl"] and summary["cuda"] is True
    assert "RuntimeError: boom" in (tmp_path / "out" / "gpu-check.log").read_text()
    child, deadline = Path(f"/proc/{int(pid_file.read_text())}/stat"), time.monotonic() + 5
    while _running(child) and time.monotonic() < deadline:  # killed; reaped by init soon after
        time.sleep(0.05)
    assert not _running(child)


def _running(stat: Path) -> bool:
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wheel(name: str, version: str, tags: str = "py3-none-any") -> str:
    return f"{name.replace('-', '_')}-{version}-{tags}.whl"


def test_the_wheel_plan_takes_one_wheel_per_package_that_cpython_312_on_x86_64_takes():
    pure = [_wheel(n, v) for n, v in gpu_check.GPU_WHEELS.items()]
    assert gpu_check.plan_install([*pure, "README.txt"]) == sorted(pure)
    # the tags of the wheels PyPI serves for the binary ones
    binary = {
        "grpcio": "cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64",
        "protobuf": "cp310-abi3-manylinux2014_x86_64",
        "crc32c": "cp312-cp312-manylinux1_x86_64.manylinux_2_28_x86_64.manylinux_2_5_x86_64",
        "torchao": "cp310-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64",
    }
    real = [_wheel(n, v, binary.get(n, "py3-none-any")) for n, v in gpu_check.GPU_WHEELS.items()]
    assert gpu_check.plan_install(real) == sorted(real)

    grpcio = gpu_check.GPU_WHEELS["grpcio"]
    for wrong, said in [
        (_wheel("grpcio", grpcio, "cp311-cp311-manylinux2014_x86_64"), "not for CPython 3.12"),
        (_wheel("grpcio", grpcio, "cp312-cp312-manylinux_2_17_aarch64"), "not for CPython 3.12"),
        (_wheel("grpcio", grpcio, "cp312-cp312-musllinux_1_1_x86_64"), "not for CPython 3.12"),
        (_wheel("protobuf", "7.36.2", "cp313-abi3-manylinux2014_x86_64"), "not for CPython 3.12"),
        (_wheel("grpcio", "1.80.0"), "a second wheel of grpcio"),
    ]:
        with pytest.raises(ValueError, match=said):
            gpu_check.plan_install([*pure, wrong])
    with pytest.raises(ValueError, match="torchao==.*: missing"):
        gpu_check.plan_install([w for w in pure if not w.startswith("torchao")])
    with pytest.raises(ValueError, match="grpcio is expected at"):
        gpu_check.plan_install([_wheel("grpcio", "1.80.0") if w.startswith("grpcio-") else w for w in pure])


def test_the_carried_wheels_and_the_image_meet_every_requirement_of_the_project():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for text in project["dependencies"] + project.get("optional-dependencies", {}).get("cuda", []):
        req = Requirement(text)
        name = gpu_check.normalize(req.name)
        if name in gpu_check.GPU_WHEELS:
            assert req.specifier.contains(gpu_check.GPU_WHEELS[name], prereleases=True), text
        else:
            assert name in gpu_check.IMAGE_PROVIDES, f"{text}: neither carried (GPU_WHEELS) nor in the GPU image"


def test_the_tests_it_names_exist_and_are_marked_gpu():
    gpu_files = gpu_check._gpu_test_files()
    assert "tests/trainer/io/test_accelerator.py" in gpu_files and "tests/kernels/test_cuda.py" in gpu_files
    for node in gpu_check.EQUIVALENCE_TESTS + gpu_check.NCCL_TESTS:
        path, name = node.split("::")
        assert path in gpu_files and f"def {name}(" in (REPO / path).read_text(), node
    assert {"bf16", "fp16"} <= {d for t in gpu_check.EQUIVALENCE_TESTS for d in ("bf16", "fp16") if d in t}


def test_it_imports_only_the_standard_library():
    """It runs on the GPU machine before anything of ours is installed."""
    tree = ast.parse((REPO / "bench" / "gpu_check.py").read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
    assert {n.split(".")[0] for n in names} - {"__future__"} <= sys.stdlib_module_names
