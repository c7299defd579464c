"""The installed package claims one import name, `ps_offload`, and installs beside the PyPI
projects that own the names `kernels` (Hugging Face's hub kernels, installed beside
transformers) and `trainer` (Coqui's) without overwriting a file of theirs.

The wheel is built from this checkout; the two PyPI projects are installed into a fresh venv
with what their imports need. torch and our other dependencies come from this project's
venv through a path entry, so nothing heavy is downloaded.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Versions seen to install and import here; pinned so the test does not move with PyPI.
NEIGHBOURS = ["kernels==0.17.2", "trainer==0.0.36"]
# What `import kernels` and `import trainer` load at import time (not their whole closure:
# sigstore, tensorboard and soundfile are imported lazily by them).
NEIGHBOUR_IMPORT_NEEDS = ["huggingface-hub", "pyyaml", "tomlkit", "packaging", "coqpit", "psutil", "fsspec", "requests"]


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, cwd=REPO)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    built = _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), ".")
    assert built.returncode == 0, f"building the wheel failed:\n{built.stdout}\n{built.stderr}"
    (path,) = out.glob("ps_offload-*.whl")
    return path


def test_wheel_installs_one_import_name(wheel: Path):
    with zipfile.ZipFile(wheel) as archive:
        tops = {name.split("/")[0] for name in archive.namelist()}
    packages = {top for top in tops if not top.endswith(".dist-info")}
    assert packages == {"ps_offload"}, f"the wheel installs import names other than ps_offload: {sorted(packages)}"
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    for module in ("trainer", "daemon", "daemon/tiers", "admin", "kernels", "proto"):
        assert f"ps_offload/{module}/__init__.py" in names, f"ps_offload.{module.replace('/', '.')} missing"
    assert "ps_offload/proto/ps_pb2_grpc.py" in names


def _files_intact(python: Path, dist: str) -> list[str]:
    """Files of an installed distribution whose content no longer matches its RECORD."""
    script = (
        "import base64, hashlib, sys\n"
        "from importlib.metadata import distribution\n"
        "bad = []\n"
        "for f in distribution(sys.argv[1]).files or []:\n"
        "    if f.hash is None: continue\n"
        "    path = f.locate()\n"
        "    try: data = open(path, 'rb').read()\n"
        "    except OSError: bad.append(str(f)); continue\n"
        "    digest = base64.urlsafe_b64encode(hashlib.new(f.hash.mode, data).digest()).rstrip(b'=').decode()\n"
        "    if digest != f.hash.value: bad.append(str(f))\n"
        "print('\\n'.join(bad))\n"
    )
    checked = subprocess.run([str(python), "-c", script, dist], capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stderr
    return [line for line in checked.stdout.splitlines() if line]


def test_installs_beside_pypi_kernels_and_trainer(wheel: Path, tmp_path: Path):
    venv = tmp_path / "venv"
    made = _run(sys.executable, "-m", "venv", str(venv), timeout=180)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    neighbours = _run(*pip, "--no-deps", *NEIGHBOURS)
    if neighbours.returncode != 0 and "No matching distribution" not in neighbours.stderr:
        pytest.skip(f"PyPI not reachable from here: {neighbours.stderr.strip()[-300:]}")
    assert neighbours.returncode == 0, neighbours.stderr
    needs = _run(*pip, *NEIGHBOUR_IMPORT_NEEDS)
    assert needs.returncode == 0, needs.stderr
    # pip replaces a file another distribution installed without a word, so ours goes in
    # after the neighbours, and then the neighbours go in again over ours.
    for step in ([str(wheel)], ["--force-reinstall", *NEIGHBOURS]):
        done = _run(*pip, "--no-deps", *step)
        assert done.returncode == 0, done.stderr
    # torch, grpc and the rest of our dependencies from this project's venv, appended after
    # the fresh venv's own site-packages (a path line: the editable install's finder there
    # is not activated, so `ps_offload` can only come from the wheel).
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (site / "zz_project_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    probe = (
        "import kernels, trainer, ps_offload\n"
        "import ps_offload.trainer, ps_offload.daemon.server, ps_offload.admin.cli, ps_offload.kernels\n"
        "import ps_offload.proto.ps_pb2_grpc\n"
        "print(kernels.__file__); print(trainer.__file__); print(ps_offload.__file__)\n"
        "assert hasattr(kernels, 'get_kernel'), 'kernels is not Hugging Face kernels'\n"
        "assert hasattr(trainer, 'Trainer'), 'trainer is not Coqui trainer'\n"
        "assert callable(ps_offload.offload)\n"
    )
    imported = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert imported.returncode == 0, f"importing all three failed:\n{imported.stdout}\n{imported.stderr}"
    for path in imported.stdout.split():
        assert path.startswith(str(site)), f"{path} was not imported from the fresh venv"
    for dist in ("kernels", "trainer", "ps-offload"):
        assert _files_intact(python, dist) == [], f"files of {dist} were overwritten"
