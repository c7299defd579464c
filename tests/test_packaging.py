"""The installed package claims one import name, `ps_offload`, and installs beside the PyPI
projects that own the names `kernels` (Hugging Face's hub kernels, installed beside
transformers) and `trainer` (Coqui's) without overwriting a file of theirs.

The wheel is built from this checkout; the two PyPI projects are installed into a fresh venv
with what their imports need. torch and our other dependencies come from this project's
venv through a path entry, so nothing heavy is downloaded.

It also installs beside the torch a user already has (2.11 or newer, a CUDA build, say)
without replacing it, and without the CUDA packages unless the `cuda` extra is asked for:
checked offline, against stand-in distributions made on the spot for every requirement the
wheel states. And nothing but a CUDA path needs those packages at import.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from importlib.metadata import version as installed_version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

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
    for module in (
        "trainer",
        *(f"trainer/{p}" for p in ("wire", "io", "offload", "stream", "pipeline")),
        "daemon",
        *(f"daemon/{p}" for p in ("tiers", "model", "store", "rpc", "dataplane")),
        "admin",
        "kernels",
        "proto",
    ):
        assert f"ps_offload/{module}/__init__.py" in names, f"ps_offload.{module.replace('/', '.')} missing"
    assert "ps_offload/proto/ps_pb2_grpc.py" in names
    assert "ps_offload/py.typed" in names  # PEP 561: type checkers read our annotations
    licenses = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    assert licenses, "the wheel carries no LICENSE"
    with zipfile.ZipFile(wheel) as archive:
        assert "Apache License" in archive.read(licenses[0]).decode()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata and "Classifier: Typing :: Typed" in metadata


def test_the_version_is_one_number_everywhere():
    """pyproject's version is what `ps_offload.__version__`, `ps-daemon --version` and
    `ps-admin --version` say (the daemon's ps_build_info metric: tests/integration/test_metrics.py)."""
    import ps_offload

    assert ps_offload.__version__ == installed_version("ps-offload")
    for program, module in (("ps-daemon", "ps_offload.daemon.cli"), ("ps-admin", "ps_offload.admin.cli")):
        shown = _run(sys.executable, "-m", module, "--version", timeout=120)
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.startswith(f"{program} {ps_offload.__version__} (python ") and "torch " in shown.stdout


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


# The CUDA pieces, only with `pip install ps-offload[cuda]`.
CUDA_EXTRA = {"numba-cuda", "cuda-bindings"}


def _standin_wheel(directory: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    """An empty distribution of that name and version (metadata only) that pip installs as
    the real one, so the resolver's choices can be watched without downloading anything."""
    project = canonicalize_name(name).replace("-", "_")
    info = f"{project}-{version}.dist-info"
    files = {
        f"{info}/METADATA": "".join(
            [f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"]
            + [f"Requires-Dist: {requirement}\n" for requirement in requires]
        ),
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test_packaging\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}\n")
    files[f"{info}/RECORD"] = "".join(record) + f"{info}/RECORD,,\n"
    wheel = directory / f"{project}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
    return wheel


def _requirements(wheel: Path, extras: tuple[str, ...] = ("", "cuda")) -> dict[str, SpecifierSet]:
    """What installing the wheel (with any of those extras) may ask for, by project name."""
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = [name for name in archive.namelist() if name.endswith(".dist-info/METADATA")]
        lines = archive.read(metadata).decode().splitlines()
    wanted: dict[str, SpecifierSet] = {}
    for line in lines:
        if not line.startswith("Requires-Dist: "):
            continue
        requirement = Requirement(line.removeprefix("Requires-Dist: "))
        name = canonicalize_name(requirement.name)
        if name == "ps-offload":  # dev's self-reference, ps-offload[cuda]
            continue
        if requirement.marker is None or any(requirement.marker.evaluate({"extra": extra}) for extra in extras):
            wanted[name] = wanted.get(name, SpecifierSet()) & requirement.specifier
    return wanted


def _satisfying(specifier: SpecifierSet) -> str:
    """A version the specifier allows: one of its own bounds where it can, else 1.0 or 99."""
    for version in sorted({spec.version for spec in specifier} | {"1.0", "99"}, key=Version):
        if "*" not in version and specifier.contains(version, prereleases=True):
            return version
    raise AssertionError(f"no stand-in version satisfies {specifier}")


def _offline_pip_env() -> dict[str, str]:
    """pip with no configuration of this machine's (its extra indexes, find-links, constraints)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PIP_")}
    return env | {"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}


def _installed(python: Path) -> dict[str, str]:
    script = (
        "import importlib.metadata as m, json\n"
        "print(json.dumps({d.metadata['Name'].lower(): d.version for d in m.distributions()}))\n"
    )
    listed = subprocess.run([str(python), "-c", script], capture_output=True, text=True, timeout=120, check=True)
    return {canonicalize_name(name): version for name, version in json.loads(listed.stdout).items()}


def install_beside_users_torch(wheel: Path, workdir: Path) -> None:
    """Stand-in torch 2.11.0 first, then the wheel, offline, with a stand-in torch 2.13.0 on
    offer: torch must stay 2.11.0, and the CUDA packages come only with the `cuda` extra."""
    links = workdir / "links"
    links.mkdir()
    wanted = _requirements(wheel)
    assert "torch" in wanted, "the wheel no longer requires torch"
    for version in ("2.11.0", "2.13.0"):
        _standin_wheel(links, "torch", version)
    for name, specifier in wanted.items():
        if name != "torch":
            _standin_wheel(links, name, _satisfying(specifier))
    # Requires the newer torch outright: shows pip here would upgrade torch if asked to.
    _standin_wheel(links, "needs-newer-torch", "1.0", ("torch==2.13.0",))

    venv = workdir / "venv"
    made = _run(sys.executable, "-m", "venv", "--without-pip", str(venv), timeout=180)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"

    def install(*what: str) -> dict[str, str]:
        pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-index"]
        done = subprocess.run(
            [*pip, "--find-links", str(links), *what],
            capture_output=True,
            text=True,
            timeout=300,
            env=_offline_pip_env(),
        )
        assert done.returncode == 0, f"pip install {' '.join(what)} failed:\n{done.stdout}\n{done.stderr}"
        return _installed(python)

    assert install("torch==2.11.0")["torch"] == "2.11.0"
    plain = install(str(wheel))
    assert plain.get("ps-offload") == "0.1.0", sorted(plain)
    assert plain["torch"] == "2.11.0", (
        f"installing the wheel replaced the user's torch 2.11.0 with {plain['torch']}: "
        f"pyproject.toml asks for torch{wanted['torch']}; keep it a range from 2.11"
    )
    assert "numba" in plain, "numba (the CPU kernels) is a base requirement"
    assert not CUDA_EXTRA & plain.keys(), f"installed without the cuda extra: {sorted(CUDA_EXTRA & plain.keys())}"

    with_cuda = install(f"{wheel}[cuda]")
    assert CUDA_EXTRA <= with_cuda.keys(), f"the cuda extra lacks {sorted(CUDA_EXTRA - with_cuda.keys())}"
    assert with_cuda["torch"] == "2.11.0", f"the cuda extra replaced torch 2.11.0 with {with_cuda['torch']}"

    assert install("needs-newer-torch")["torch"] == "2.13.0", "the stand-in torch 2.13.0 was not on offer"


@pytest.mark.slow  # builds the wheel, and four offline pip installs
def test_installs_beside_the_users_torch_and_cuda_pieces_only_with_the_extra(wheel: Path, tmp_path: Path):
    install_beside_users_torch(wheel, tmp_path)


def test_stand_in_versions_satisfy_what_they_stand_in_for():
    assert _satisfying(SpecifierSet(">=1.85.1,<2")) == "1.85.1"
    assert _satisfying(SpecifierSet("<3")) == "1.0"
    assert _satisfying(SpecifierSet("")) == "1.0"
    assert _satisfying(SpecifierSet(">=2.11")) == "2.11"
    assert _satisfying(SpecifierSet("==2.13.0")) == "2.13.0"


@pytest.mark.slow  # imports torch and the whole package, and runs a Numba CPU kernel
def test_nothing_but_a_cuda_path_needs_the_cuda_extra(tmp_path: Path):
    """Every entry point imports, and the CPU kernels run, with numba-cuda and cuda-bindings
    hidden (as on a node installed without the `cuda` extra)."""
    probe = (
        "import importlib.abc, sys\n"
        "HIDDEN = ('cuda', 'numba_cuda', 'numba.cuda')\n"
        "def hidden(name): return any(name == h or name.startswith(h + '.') for h in HIDDEN)\n"
        "class NoCuda(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if hidden(name): raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, NoCuda())\n"
        "import torch\n"
        "import ps_offload, ps_offload.trainer, ps_offload.daemon.server, ps_offload.daemon.cli\n"
        "import ps_offload.admin.cli, ps_offload.kernels.fused_adamw\n"
        "from ps_offload import kernels\n"
        "grad = torch.randn(3000)\n"
        "bits, scales = kernels.onebit_compress(grad, None)\n"
        "mine = kernels.onebit_decompress(bits, scales, 3000)\n"
        "assert torch.equal(mine, kernels.onebit_decompress(bits, scales, 3000, backend='torch'))\n"
        "loaded = sorted(name for name in sys.modules if hidden(name))\n"
        "assert not loaded, loaded\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "NUMBA_ENABLE_CUDASIM"}
    ran = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env
    )
    assert ran.returncode == 0, f"importing or running the CPU kernels needed a CUDA package:\n{ran.stderr[-3000:]}"
