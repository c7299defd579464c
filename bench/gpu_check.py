"""gpu_check: everything a lent GPU machine should show, in one shot of at most 8 minutes.

Two verbs (docs/gpu.md says when to use each):

    python3 bench/gpu_check.py wheels --dest gpu-wheels     # here, with PyPI: `make gpu-wheels`
    python3 bench/gpu_check.py check --out DIR              # there: `make gpu-check OUT=$OUT`

`wheels` downloads, for CPython 3.12 on manylinux x86_64 and without their dependencies (so
torch and the nvidia wheels never come along), what the GPU image lacks or has too old
(GPU_WHEELS). `check` runs the stages of STAGES in order, each a subprocess under its own
timeout and all under one budget: a stage that fails or times out is recorded as such and the
next one still runs. Without CUDA the CUDA stages are skipped with the reason (a dry run), and
the summary is written all the same.

The GPU machine reaches no package registry and its python3 holds the CUDA torch we must not
replace, so `check` makes a venv of its own that sees the image's packages, puts the carried
wheels in front of them (pip --no-index --no-deps), and installs the project from the working
tree in editable mode (the tests and benchmarks run from the repository root, where the
folder ps_offload/ would shadow a non-editable install; and the code run is the code sent).

Only the standard library is imported here: this runs before anything is installed.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import tarfile
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUDGET_S = 480  # the whole check, machine start excluded: 8 of the session's 15 device minutes
RESERVE_S = 10  # kept back from the budget for the summary and the archive

# What the GPU image lacks or has too old (its package list: the device tool's KINDS.md), pinned
# to the versions this project's CPU venv runs, without their dependencies: only grpcio needs one
# (typing-extensions, which torch brings). typer, click, rich and shellingham stay the image's:
# the typer this venv runs (0.29) needs pydantic, which the image has not.
GPU_WHEELS = {
    "grpcio": "1.85.1",  # the image's is older; ps_pb2_grpc.py refuses < 1.85.1 at import
    "grpcio-health-checking": "1.85.1",  # not in the image
    "grpcio-reflection": "1.85.1",  # not in the image
    "protobuf": "7.36.2",  # ps_pb2.py checks the runtime: >= 7.35.1 and < 8
    "crc32c": "2.9.post0",  # not in the image
    "prometheus-client": "0.26.0",  # in the image at a version nobody has read; pure Python, no dependencies
    "torchao": "0.17.0",  # the peer of gpu_step_vs_torchao; 0.17 is the release built for torch 2.11
    "setuptools": "84.2.1",  # builds the editable install (pyproject's license field needs >= 77)
    # The image pairs numba-cuda 0.30.4 with numpy 2.5.2, which removed np.row_stack that
    # numba-cuda's first compile registers an overload for: every CUDA kernel failed on the
    # 2026-11-27 run. The version this project's CPU venv runs; torch takes any numpy 2.
    "numpy": "2.4.6",
}
# The project's other requirements, taken from the image as they are (the CUDA builds among them).
IMAGE_PROVIDES = frozenset({"torch", "tqdm", "safetensors", "numba", "numba-cuda", "cuda-bindings", "typer", "rich"})
PY_TAG = "cp312"
PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]

ACCELERATOR = "tests/trainer/io/test_accelerator.py"
EQUIVALENCE_TESTS = [
    f"{ACCELERATOR}::test_bf16_model_on_cuda_through_a_daemon_equals_fp32_masters_in_process",  # both transports
    f"{ACCELERATOR}::test_fp16_model_on_cuda_through_a_daemon_with_loss_scaling_equals_fp32_masters_in_process",
]
NCCL_TESTS = [f"{ACCELERATOR}::test_a_pipeline_stage_on_cuda_over_nccl_with_daemons"]
# gpu_step_vs_torchao at the real model's width and a sixth of its depth (~0.27B parameters):
# a figure in about a minute; its result goes to bench/results/quick/ (scaled down).
TORCHAO_ARGS = ["--n-layer", "4", "--blocks", "4", "--block-steps", "3", "--profile"]
# The versions recorded from every interpreter involved.
VERSIONS = [
    "torch", "numba", "numba-cuda", "cuda-bindings", "grpcio", "grpcio-health-checking", "protobuf", "numpy",
    "torchao", "transformers", "accelerate", "typer", "rich", "click", "crc32c", "prometheus-client",
    "safetensors", "pytest", "pytest-timeout", "setuptools", "pip", "ps-offload",
]  # fmt: skip


@dataclass(frozen=True)
class Stage:
    name: str
    timeout_s: int
    cuda: bool
    shows: str


STAGES = [
    Stage("install", 90, False, "a venv over the image's packages, the carried wheels, the project (editable)"),
    Stage("imports", 60, False, "torch is still the image's; ps_offload.trainer and ps_offload.daemon import"),
    Stage("machine", 45, False, "nvidia-smi and the versions of torch, CUDA, NCCL, numba, numba-cuda, grpcio"),
    Stage("equivalence", 120, True, "bf16 and fp16 models on the GPU through a local daemon = fp32 masters"),
    Stage("nccl", 120, True, "PipelineTrainer over NCCL, pp=1 x dp=1, bf16, through a daemon"),
    Stage("gpu-tests", 150, True, "every other test marked gpu (CUDA kernels, pinned-buffer copies)"),
    Stage("compress-bench", 90, True, "bench.compress_gpu: the compression kernels vs a device copy"),
    Stage("torchao-bench", 150, True, "bench.gpu_step_vs_torchao (scaled down) vs torchao's CPUOffloadOptimizer"),
]
STAGE_NAMES = [s.name for s in STAGES]


# ---------------------------------------------------------------------------------------------
# The wheel folder: one wheel per package, each one CPython 3.12 on Linux x86_64 can take.

_WHEEL = re.compile(
    r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl$"
)


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _fits(py: str, abi: str, plat: str) -> bool:
    """Whether CPython 3.12 on manylinux x86_64 takes a wheel of these (possibly dotted) tags."""
    pys, abis, plats = py.split("."), abi.split("."), plat.split(".")
    py_ok = any(p in ("py3", PY_TAG) for p in pys) or (
        "abi3" in abis and any(re.fullmatch(r"cp3(\d+)", p) and int(p[3:]) <= int(PY_TAG[3:]) for p in pys)
    )
    abi_ok = any(a in ("none", "abi3", PY_TAG) for a in abis)
    plat_ok = any(p == "any" or (p.endswith("_x86_64") and p.startswith(("manylinux", "linux"))) for p in plats)
    return py_ok and abi_ok and plat_ok


def plan_install(files: list[str], expected: dict[str, str] = GPU_WHEELS) -> list[str]:
    """The wheel files to install, sorted. Raises ValueError, naming them, for a file that is not a
    wheel CPython 3.12 on x86_64 Linux takes, for two versions of one package (pip would refuse
    the whole install), and for an expected package missing or at another version."""
    problems, chosen = [], {}
    for f in sorted(files):
        if not f.endswith(".whl"):
            continue
        m = _WHEEL.match(f)
        if m is None:
            problems.append(f"{f}: not a wheel file name")
            continue
        name = normalize(m["name"])
        if not _fits(m["py"], m["abi"], m["plat"]):
            problems.append(f"{f}: not for CPython 3.12 on manylinux x86_64")
        if name in chosen:
            problems.append(f"{f}: a second wheel of {name} (also {chosen[name][1]})")
        chosen[name] = (m["version"], f)
    for name, version in expected.items():
        if name not in chosen:
            problems.append(f"{name}=={version}: missing")
        elif chosen[name][0] != version:
            problems.append(f"{chosen[name][1]}: {name} is expected at {version}")
    if problems:
        raise ValueError("; ".join(problems))
    return sorted(f for _, f in chosen.values())


def download_wheels(dest: Path) -> int:
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", *(f"--platform={p}" for p in PLATFORMS), "--dest", str(dest),
           *(f"{name}=={version}" for name, version in GPU_WHEELS.items())]  # fmt: skip
    print("$", shlex.join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    files = plan_install([p.name for p in dest.iterdir()])
    total = 0
    for f in files:
        size = (dest / f).stat().st_size
        total += size
        print(f"  {size / 1e6:7.2f} MB  {f}")
    print(f"{len(files)} wheels, {total / 1e6:.1f} MB in {dest}: carry it (docs/gpu.md)")
    return 0


# ---------------------------------------------------------------------------------------------
# Running a stage.


@dataclass
class Result:
    name: str
    status: str = "skipped"  # passed, failed, skipped, timed_out
    seconds: float = 0.0
    timeout_s: float | None = None
    reason: str = ""
    commands: list[str] = field(default_factory=list)
    figures: dict = field(default_factory=dict)


class Runner:
    def __init__(self, work: Path, budget_s: float) -> None:
        self.work = work
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.deadline = time.monotonic() + budget_s
        self.stage_deadline = self.deadline

    def log_path(self, stage: str) -> Path:
        return self.logs / f"{STAGE_NAMES.index(stage) + 1:02d}-{stage}.log"

    def remaining(self) -> float:
        return self.deadline - time.monotonic() - RESERVE_S

    def begin(self, stage: Stage) -> None:
        self.stage_deadline = time.monotonic() + stage.timeout_s

    def run(self, result: Result, cmd: list[str], *, env: dict | None = None) -> int | None:
        """Runs cmd in the repository root with its output appended to the stage's log, in a
        process group of its own that is killed at the end (daemons the tests left included).
        Returns the exit status, or None when it ran past the stage's timeout or the budget
        (and marks the stage timed_out)."""
        result.commands.append(shlex.join(cmd))
        timeout = max(min(self.stage_deadline - time.monotonic(), self.remaining()), 1.0)
        with open(self.log_path(result.name), "a") as log:
            log.write(f"$ {shlex.join(cmd)}\n")
            log.flush()
            proc = subprocess.Popen(
                cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                return proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc, signal.SIGTERM)
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    pass
                result.status, result.reason = "timed_out", f"ran past {timeout:.0f} s: {shlex.join(cmd)[:200]}"
                log.write(f"\n[gpu_check] timed out after {timeout:.0f} s\n")
                return None
            finally:
                _kill_group(proc, signal.SIGKILL)

    def output(self, cmd: list[str], *, timeout: float = 60, env: dict | None = None) -> str:
        """The stdout of a short command that must succeed (raises CalledProcessError else)."""
        return subprocess.run(
            cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=True
        ).stdout


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stage_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    for name in ("NUMBA_ENABLE_CUDASIM", "PS_BENCH_QUICK", "PYTHONPATH"):
        env.pop(name, None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


# ---------------------------------------------------------------------------------------------
# The stages.

_IMAGE_SITE_PTH = "_gpu_check_image_site.pth"
_TREE_FINDER = '''"""Maps ps_offload.* onto the repository's folders (pyproject's package-dir): gpu_check's
fallback when the editable install fails."""
import importlib.util, sys
ROOT, MAP = {root!r}, {mapping!r}
class _TreeFinder:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name not in MAP:
            return None
        folder = ROOT + "/" + MAP[name]
        init = folder + "/__init__.py"
        return importlib.util.spec_from_file_location(name, init, submodule_search_locations=[folder])
sys.meta_path.insert(0, _TreeFinder)
'''


def stage_install(runner: Runner, result: Result, wheels: Path, venv: Path) -> Path:
    """Returns the python the later stages run: the venv's, or this one when the venv failed."""
    py = venv / "bin" / "python"
    try:
        files = plan_install([p.name for p in wheels.iterdir()] if wheels.is_dir() else [])
    except ValueError as e:
        result.status = "failed"
        result.reason = f"{wheels.name}/ is not the wheel set to carry (`make gpu-wheels` here, then carry it): {e}"
        return Path(sys.executable)
    if f"cp{sys.version_info[0]}{sys.version_info[1]}" != PY_TAG:
        result.status = "failed"
        result.reason = f"the wheels are for {PY_TAG}, this is Python {platform.python_version()} (see --no-install)"
        return Path(sys.executable)
    stamp = venv / "gpu-check-wheels.txt"
    if py.exists() and stamp.exists() and stamp.read_text().split() == files:
        result.status, result.reason = "passed", "the venv an earlier run on this machine made, with the same wheels"
        result.figures = {"venv": str(venv), "wheels": len(files), "reused": True}
        return py
    shutil.rmtree(venv, ignore_errors=True)
    env = {**_stage_env(), "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INPUT": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    rc = runner.run(
        result, [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], env=env
    )
    if rc != 0:
        if rc is not None:
            result.status, result.reason = "failed", f"python -m venv exited {rc}"
        return Path(sys.executable)
    # If this python is itself a venv (the image's is), --system-site-packages reaches only its base
    # interpreter: add this one's site-packages (and their .pth files) behind the venv's own.
    purelib = Path(runner.output([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).strip())
    ours = sorted({p for p in [*site.getsitepackages(), sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]
                   if os.path.isdir(p)})  # fmt: skip
    (purelib / _IMAGE_SITE_PTH).write_text("".join(f"import site; site.addsitedir({p!r})\n" for p in ours))
    pip = [str(py), "-m", "pip"]
    if subprocess.run([*pip, "--version"], env=env, capture_output=True, timeout=60).returncode != 0:
        pip = [sys.executable, "-m", "pip", "--python", str(py)]
    quiet = ["--no-index", "--no-deps", "--disable-pip-version-check", "--no-warn-script-location"]
    rc = runner.run(result, [*pip, "install", *quiet, "--ignore-installed", "--no-compile", "--no-warn-conflicts",
                             *(str(wheels / f) for f in files)], env=env)  # fmt: skip
    if rc != 0:
        if rc is not None:
            result.status, result.reason = "failed", f"pip install of the carried wheels exited {rc}"
        return py
    rc = runner.run(result, [*pip, "install", *quiet, "--no-build-isolation", "-e", str(REPO)], env=env)
    project = "editable (pip install -e, the working tree)"
    if rc != 0:
        if rc is None:
            return py
        _write_tree_finder(purelib)
        project = f"tree finder (pip install -e exited {rc}; see the log): the working tree, no console scripts"
    stamp.write_text("\n".join(files) + "\n")
    result.status = "passed"
    result.figures = {"venv": str(venv), "wheels": len(files), "project": project, "image_site": ours}
    return py


def _write_tree_finder(purelib: Path) -> None:
    import tomllib

    mapping = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    (purelib / "_gpu_check_tree.py").write_text(_TREE_FINDER.format(root=str(REPO), mapping=mapping))
    (purelib / "_gpu_check_tree.pth").write_text("import _gpu_check_tree\n")


_IMPORTS = """
import json, sys, grpc, google.protobuf, torch
import ps_offload.trainer, ps_offload.daemon
print(json.dumps({"torch": torch.__version__, "torch_file": torch.__file__, "grpcio": grpc.__version__,
                  "protobuf": google.protobuf.__version__, "ps_offload": ps_offload.trainer.__file__,
                  "python": sys.executable}))
"""


def stage_imports(runner: Runner, result: Result, py: Path, image: dict) -> None:
    rc = runner.run(result, [str(py), "-c", _IMPORTS], env=_stage_env())
    if rc is None:
        return
    if rc != 0:
        result.status, result.reason = "failed", f"importing ps_offload.trainer and .daemon exited {rc} (see the log)"
        return
    got = json.loads(_last_json_line(runner.log_path(result.name)))
    result.figures = got
    want_version, want_file = image.get("torch"), image.get("torch_file")
    # torch.__version__ carries the local build ("2.11.0+cu130"); the metadata has no suffix
    if want_version and got["torch"].split("+")[0] != want_version.split("+")[0]:
        result.status, result.reason = "failed", f"torch is {got['torch']}, the image has {want_version}"
    elif want_file and Path(got["torch_file"]).resolve() != Path(want_file).resolve():
        result.status, result.reason = "failed", f"torch imports from {got['torch_file']}, the image's is {want_file}"
    else:
        result.status = "passed"


def _last_json_line(log: Path) -> str:
    return next(line for line in reversed(log.read_text().splitlines()) if line.startswith("{"))


_PROBE = """
import importlib.metadata as md, json, platform, sys, tomllib
names = json.loads(sys.argv[1])
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
out = {"python": sys.version.split()[0], "executable": sys.executable,
       "packages": {n: version(n) for n in names}, "unmet": []}
try:
    from packaging.requirements import Requirement
    project = tomllib.load(open("pyproject.toml", "rb"))["project"]
    for text in project["dependencies"] + project.get("optional-dependencies", {}).get("cuda", []):
        req = Requirement(text)
        have = version(req.name)
        if have is None or not req.specifier.contains(have, prereleases=True):
            out["unmet"].append(f"{text} (have {have})")
except Exception as e:
    out["unmet"] = [f"not checked: {e!r}"]
import torch
out["torch"] = {"version": torch.__version__, "cuda_build": torch.version.cuda, "file": torch.__file__,
                "cuda_available": torch.cuda.is_available()}
facts = {
    "device": lambda: torch.cuda.get_device_name(0),
    "devices": torch.cuda.device_count,
    "capability": lambda: ".".join(map(str, torch.cuda.get_device_capability(0))),
    "memory_gib": lambda: round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
    "multiprocessors": lambda: torch.cuda.get_device_properties(0).multi_processor_count,
    "nccl": lambda: str(torch.cuda.nccl.version()),
    "cudnn": torch.backends.cudnn.version,
}
if out["torch"]["cuda_available"]:
    for name, fact in facts.items():
        try:
            out["torch"][name] = fact()
        except Exception as e:  # a fact missing is no reason to lose the others
            out["torch"][name] = f"not read: {e!r}"
print(json.dumps(out))
"""


def stage_machine(runner: Runner, result: Result, py: Path, machine: dict) -> None:
    """Fills `machine`, the summary's block (as far as it gets when the probe fails)."""
    machine.update(platform=platform.platform(), cpu=_cpu_model(), cores=os.cpu_count(), memory_gib=_mem_gib())
    machine["gpu"] = _nvidia_smi(runner, runner.log_path(result.name))
    rc = runner.run(result, [str(py), "-c", _PROBE, json.dumps(VERSIONS)], env=_stage_env())
    if rc is None:
        return
    if rc != 0:
        result.status, result.reason = "failed", f"the probe exited {rc} (see the log)"
        return
    probe = json.loads(_last_json_line(runner.log_path(result.name)))
    machine["python"] = {"version": probe["python"], "executable": probe["executable"]}
    machine["torch"] = probe["torch"]
    machine["packages"] = probe["packages"]
    machine["unmet_requirements"] = probe["unmet"]
    with open(runner.log_path(result.name), "a") as log:
        log.write("\n" + json.dumps(machine, indent=2) + "\n")
    result.status = "passed"
    result.figures = {"cuda": probe["torch"]["cuda_available"], "gpu": machine["gpu"].get("name")}
    if probe["unmet"]:
        result.reason = "requirements not met: " + "; ".join(probe["unmet"])


def _nvidia_smi(runner: Runner, log: Path) -> dict:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"nvidia_smi": "not found"}
    gpu: dict = {"nvidia_smi": exe}
    try:
        fields = "name,memory.total,driver_version"
        line = runner.output([exe, f"--query-gpu={fields}", "--format=csv,noheader"], timeout=20).splitlines()[0]
        gpu.update(zip(["name", "memory", "driver"], (v.strip() for v in line.split(",")), strict=False))
        head = runner.output([exe], timeout=20)
        with open(log, "a") as f:
            f.write(f"$ {exe}\n{head}\n")
        if m := re.search(r"CUDA Version:\s*([\d.]+)", head):
            gpu["cuda"] = m[1]
        (runner.work / "nvidia-smi-q.txt").write_text(runner.output([exe, "-q"], timeout=20))
    except (subprocess.SubprocessError, OSError, IndexError) as e:
        gpu["error"] = repr(e)
    return gpu


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _mem_gib() -> float | None:
    try:
        kib = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0])
        return round(kib / 2**20, 1)
    except (OSError, IndexError, ValueError):
        return None


def _gpu_test_files() -> list[str]:
    """The test files holding tests marked gpu: the only ones collected (the others may import
    what the GPU image lacks, trustme or grpc_tools)."""
    found = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        if re.search(r"pytest\.mark\.gpu\b", path.read_text()):
            found.append(str(path.relative_to(REPO)))
    return found


def stage_pytest(runner: Runner, result: Result, py: Path, targets: list[str], *, per_test_s: int,
                 deselect: list[str] = ()) -> None:  # fmt: skip
    junit = runner.work / f"junit-{result.name}.xml"
    cmd = [str(py), "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "gpu", "-o", f"timeout={per_test_s}",
           f"--junitxml={junit}", *(f"--deselect={d}" for d in deselect), *targets]  # fmt: skip
    rc = runner.run(result, cmd, env=_stage_env())
    counts = _junit(junit)
    result.figures = counts
    if rc is None:
        return
    ran = counts.get("tests", 0) - counts.get("skipped", 0)
    if rc == 0 and ran > 0 and not counts.get("skipped"):
        result.status = "passed"
        return
    result.status = "failed"
    if rc == 5 or counts.get("tests", 0) == 0:
        result.reason = "no test collected"
    elif counts.get("skipped"):
        result.reason = f"{counts['skipped']} skipped on a CUDA machine: " + "; ".join(counts["skip_reasons"][:3])
    else:
        result.reason = f"pytest exited {rc}: " + "; ".join(counts.get("failed_tests", [])[:5])


def _junit(path: Path) -> dict:
    if not path.exists():
        return {}
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return {}
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["seconds"] = float(suite.get("time", 0))
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    counts["failed_tests"], counts["skip_reasons"] = [], []
    for case in suite.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        for bad in [*case.findall("failure"), *case.findall("error")]:
            counts["failed_tests"].append(f"{name}: {(bad.get('message') or '')[:200]}")
        for skip in case.findall("skipped"):
            counts["skip_reasons"].append(f"{name}: {skip.get('message') or ''}"[:200])
    counts["failed_tests"], counts["skip_reasons"] = counts["failed_tests"][:20], counts["skip_reasons"][:20]
    return counts


def stage_bench(runner: Runner, result: Result, py: Path, module: str, args: list[str], results: list[Path],
                env_extra: dict | None = None) -> None:  # fmt: skip
    started = time.time()
    rc = runner.run(result, [str(py), "-m", module, *args], env={**_stage_env(), **(env_extra or {})})
    fresh = [p for p in results if p.exists() and p.stat().st_mtime >= started - 1]
    if fresh:
        figures = json.loads(fresh[0].read_text())
        result.figures = {k: figures.get(k) for k in ("ours", "peer", "unit", "ratio", "target", "target_met", "quick",
                                                      "notes", "extra") if k in figures}  # fmt: skip
        result.figures["file"] = str(fresh[0].relative_to(REPO))
        shutil.copy(fresh[0], runner.work / fresh[0].name)
    if rc is None:
        return
    if rc != 0:
        result.status, result.reason = "failed", f"exited {rc} (see the log)"
    elif not fresh:
        result.status, result.reason = "failed", "recorded nothing (see the log for why it skipped)"
    else:
        result.status = "passed"


# ---------------------------------------------------------------------------------------------


@dataclass
class _State:
    py: Path  # the python the stages run
    machine: dict
    cuda: bool


def _run_stage(stage: Stage, runner: Runner, result: Result, state: _State, *, wheels: Path, venv: Path,
               install: bool, image: dict) -> None:  # fmt: skip
    py = state.py
    if stage.name == "install":
        if install:
            state.py = stage_install(runner, result, wheels, venv)
        else:
            result.reason = f"--no-install: runs {sys.executable} as it is"
    elif stage.name == "imports":
        stage_imports(runner, result, py, image)
    elif stage.name == "machine":
        try:
            stage_machine(runner, result, py, state.machine)
        finally:  # without the probe's word, nvidia-smi's: a GPU it names gets its stages
            probe = state.machine.get("torch")
            state.cuda = bool(probe["cuda_available"] if probe else state.machine.get("gpu", {}).get("name"))
    elif stage.name == "equivalence":
        stage_pytest(runner, result, py, EQUIVALENCE_TESTS, per_test_s=90)
    elif stage.name == "nccl":
        stage_pytest(runner, result, py, NCCL_TESTS, per_test_s=110)
    elif stage.name == "gpu-tests":
        stage_pytest(runner, result, py, _gpu_test_files(), per_test_s=60, deselect=EQUIVALENCE_TESTS + NCCL_TESTS)
    elif stage.name == "compress-bench":
        stage_bench(runner, result, py, "bench.compress_gpu", [], [REPO / "bench/results/compress_gpu.json"])
    elif stage.name == "torchao-bench":
        stage_bench(runner, result, py, "bench.gpu_step_vs_torchao", TORCHAO_ARGS,
                    [REPO / "bench/results/quick/gpu_step_vs_torchao.json",
                     REPO / "bench/results/gpu_step_vs_torchao.json"],
                    # CPUOffloadOptimizer is Python over torch's fused AdamW: none of torchao's .so files
                    env_extra={"TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1"})  # fmt: skip


def check(out: Path, work: Path, wheels: Path, venv: Path, *, install: bool, only: list[str], budget_s: float) -> int:
    started_at = datetime.datetime.now(datetime.UTC)
    t0 = time.monotonic()
    shutil.rmtree(work, ignore_errors=True)
    runner = Runner(work, budget_s)
    out.mkdir(parents=True, exist_ok=True)
    results = {s.name: Result(s.name, timeout_s=s.timeout_s) for s in STAGES}
    image = {n: _version(n) for n in VERSIONS}
    torch_spec = importlib.util.find_spec("torch")
    image["torch_file"] = torch_spec.origin if torch_spec else None
    image["python"] = f"{platform.python_version()} ({sys.executable})"
    state = _State(py=Path(sys.executable), machine={}, cuda=False)
    for stage in STAGES:
        result = results[stage.name]
        runner.begin(stage)
        t = time.monotonic()
        print(f"[gpu_check] {stage.name}: {stage.shows} (up to {stage.timeout_s} s)", flush=True)
        if only and stage.name not in only and stage.name not in ("install", "imports", "machine"):
            result.reason = f"not among --only {','.join(only)}"
        elif stage.cuda and not state.cuda:
            why = state.machine.get("torch", {})
            result.reason = (
                "no CUDA device (a dry run): "
                + (f"torch {why['version']} (CUDA build {why['cuda_build']}) says torch.cuda.is_available() is False"
                   if why else "the machine probe failed or did not run")
                + f"; nvidia-smi {state.machine.get('gpu', {}).get('nvidia_smi', 'not looked for')}"
            )  # fmt: skip
        elif runner.remaining() < 15:
            result.reason = f"the {budget_s:.0f} s budget is spent"
        else:
            try:
                _run_stage(stage, runner, result, state, wheels=wheels, venv=venv, install=install, image=image)
            except Exception as e:  # a bug or a surprise of the machine: this stage fails, the next one runs
                result.status, result.reason = "failed", f"gpu_check itself: {e!r}"
                with open(runner.log_path(stage.name), "a") as log:
                    traceback.print_exc(file=log)
        result.seconds = round(time.monotonic() - t, 1)
        print(f"[gpu_check] {stage.name}: {result.status} in {result.seconds} s"
              + (f": {result.reason}" if result.reason else ""), flush=True)  # fmt: skip
    machine, cuda = state.machine, state.cuda

    failed = [r.name for r in results.values() if r.status in ("failed", "timed_out")]
    summary = {
        "check": "gpu_check",
        "result": "failed" if failed else "passed",
        "failed_stages": failed,
        "cuda": cuda,
        "dry_run": not cuda,
        "started": started_at.isoformat(timespec="seconds"),
        "seconds": round(time.monotonic() - t0, 1),
        "budget_s": budget_s,
        "machine": machine,
        "versions": {"image": image, "run": machine.get("packages", {})},
        "stages": [
            {
                "name": r.name,
                "status": r.status,
                "seconds": r.seconds,
                "timeout_s": r.timeout_s,
                "reason": r.reason,
                "figures": r.figures,
                "commands": r.commands,
                "log": runner.log_path(r.name).name,
            }
            for r in results.values()
        ],  # fmt: skip
    }
    _write_out(out, work, summary)
    said = f" (failed: {', '.join(failed)})" if failed else ""
    print(f"[gpu_check] {summary['result']} in {summary['seconds']} s{said}; summary in {out / 'summary.json'}")
    return 1 if failed else 0


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _write_out(out: Path, work: Path, summary: dict) -> None:
    """At most 8 files, none deeper than the folder (what the device tool brings back): the
    summary, every stage's log in one file, the benchmarks' results, and the rest in a tarball."""
    files = ["summary.json", "gpu-check.log", "details.tar.gz"]
    with open(out / "gpu-check.log", "w") as log:
        for path in sorted(work.joinpath("logs").glob("*.log")):
            log.write(f"\n===== {path.name} =====\n{path.read_text(errors='replace')}")
    for path in sorted(work.glob("*.json")):  # the benchmarks' results
        shutil.copy(path, out / path.name)
        files.append(path.name)
    with tarfile.open(out / "details.tar.gz", "w:gz") as tar:
        tar.add(work, arcname="gpu-check")
    summary["files"] = files
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    w = verbs.add_parser("wheels", help="download the wheels the GPU machine lacks (needs PyPI)")
    w.add_argument("--dest", type=Path, default=REPO / "gpu-wheels")
    c = verbs.add_parser("check", help="run the stages, write OUT/summary.json")
    c.add_argument("--out", type=Path, default=REPO / "runs" / "gpu-check", help="where the results go")
    c.add_argument("--work", type=Path, default=REPO / "build" / "gpu-check", help="logs and junit files (emptied)")
    c.add_argument("--wheels", type=Path, default=REPO / "gpu-wheels", help="what `make gpu-wheels` downloaded")
    c.add_argument("--venv", type=Path, default=REPO / "build" / "gpu-check-venv", help="the venv it makes")
    c.add_argument("--no-install", action="store_true", help="run this python as it is (a dry run on the CPU)")
    c.add_argument("--only", default="", help=f"comma-separated stages to run after install, imports, machine: "
                                              f"{', '.join(STAGE_NAMES[3:])} (a rerun)")  # fmt: skip
    c.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole check")
    args = parser.parse_args(argv)
    if args.verb == "wheels":
        return download_wheels(args.dest.resolve())
    only = [s for s in args.only.split(",") if s]
    if unknown := [s for s in only if s not in STAGE_NAMES]:
        parser.error(f"unknown stages {unknown}; there are {STAGE_NAMES}")
    return check(args.out.resolve(), args.work.resolve(), args.wheels.resolve(), args.venv.resolve(),
                 install=not args.no_install, only=only, budget_s=args.budget)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
