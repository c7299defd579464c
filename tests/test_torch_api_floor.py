"""Our code uses only torch APIs that torch 2.11, the oldest version pyproject.toml accepts,
already has.

Every .py file of the installed packages, bench/ and examples/ is read (not imported): each
name reached through torch as that file imports it (`torch.x.y`, `dist.y` for
`import torch.distributed as dist`, `nn.y`, `F.y`, `from torch.x import y`) must be on
TORCH_2_11 below, the names checked one by one in torch 2.11.0's own sources (the Python files
and the .pyi stubs of its C extension in the released wheel). A new name fails here until
someone has checked it there and added it. Methods of tensors reached through a variable are
not seen (nothing here knows a variable's type); the test suite's own files are not read
(they run on the venv's torch only).

NEWER_THAN_2_11 lists names that torch 2.13 has and 2.11 lacks, found by comparing the two
releases' sources (`__all__` of torch, torch.distributed, torch.accelerator, torch.cuda,
torch.optim, torch.autograd.graph; torch.nn.functional's functions), with what to use instead
where there is one.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# The folders of the installed packages (pyproject.toml maps them under ps_offload), and the
# scripts users run.
SCANNED = ["ps_offload", "ps_proto", "ps_daemon", "ps_admin", "trainer", "kernels", "bench", "examples"]

OLDEST = "2.11"

# Names checked to exist in torch 2.11.0, by namespace. A namespace itself (torch.cuda) and
# anything on the way to a listed name (torch.autograd.Variable) count as present too.
TORCH_2_11 = {
    "torch": """
        Event Generator Size Stream Tensor __version__ _foreach_norm _fused_adamw_ _fused_sgd_
        aminmax arange autocast bfloat16 bool cat clamp device dtype empty empty_like enable_grad equal finfo
        float16 float32 float64 from_file frombuffer full full_like get_num_threads histc int16 int32 int64
        is_grad_enabled isfinite isnan long manual_seed mul multinomial nextafter no_grad ones rand
        randint randn set_num_threads softmax sort split stack tensor uint16 uint32 uint8 where zeros
        zeros_like
    """,
    "torch._C": "_will_engine_execute_node",
    "torch._C._autograd": "_unsafe_set_version_counter",
    "torch.accelerator": """
        current_accelerator current_device_index current_stream device_count is_available
        set_device_index set_stream synchronize
    """,
    "torch.autograd": "Function",
    "torch.autograd.Variable._execution_engine": "queue_callback",
    "torch.autograd.graph": "get_gradient_edge",
    "torch.cuda": """
        Event Stream cudart current_device current_stream device device_count get_device_name is_available
        set_device stream synchronize
    """,
    "torch.distributed": """
        ProcessGroup Work all_gather_into_tensor all_gather_object all_reduce all_to_all_single
        barrier destroy_process_group get_rank get_world_size init_process_group is_initialized
    """,
    "torch.distributed.ReduceOp": "MAX",
    "torch.distributed.device_mesh": "init_device_mesh",
    "torch.distributed.pipelining": "PipelineStage Schedule1F1B ScheduleGPipe",
    "torch.linalg": "vector_norm",
    "torch.nn": """
        Embedding GELU LayerNorm Linear Module ModuleList Parameter ReLU Sequential TransformerEncoder
        TransformerEncoderLayer
    """,
    "torch.nn.Transformer": "generate_square_subsequent_mask",
    "torch.nn.functional": "cross_entropy linear scaled_dot_product_attention",
    "torch.nn.init": "normal_ zeros_",
    "torch.nn.utils": "clip_grad_norm_ get_total_norm",
    "torch.optim": "AdamW Optimizer SGD",
    "torch.profiler": "ProfilerActivity profile",  # bench/gpu_step_vs_torchao.py --profile (ran on 2.11)
    "torch.profiler.ProfilerActivity": "CPU CUDA",
    "torch.utils": "swap_tensors",
    "torch.utils._pytree": "tree_flatten",
    "torch.utils.cpp_extension": "_get_build_directory",
    "torch.utils.data": "Dataset",
}
ALLOWED = frozenset(f"{space}.{name}" for space, names in TORCH_2_11.items() for name in names.split())

# Present in torch 2.13, absent from 2.11: what to write instead.
NEWER_THAN_2_11 = {
    "torch.distributed.all_gather_single": "dist.all_gather_into_tensor(output, input, group=...)",
    "torch.distributed.reduce_scatter_single": "dist.reduce_scatter_tensor(output, input, group=...)",
    "torch.distributed.record_comm": None,
    "torch.accelerator.Graph": None,
    "torch.accelerator.empty_host_cache": None,
    "torch.cuda.caching_allocator_disabled": None,
    "torch.cuda.current_solver_handle": None,
    "torch.thread_safe_generator": None,
    "torch.autograd.graph.region_activation_memory_budget": None,
    "torch.autograd.graph.set_override_stale_capture_stream": None,
    "torch.optim.swap_in_optimizer_params_and_state": None,
    "torch.nn.functional.linear_cross_entropy": "F.cross_entropy(F.linear(x, weight), target)",
}


class _TorchNames(ast.NodeVisitor):
    """Every torch name one file reaches: its imports from torch, and each longest attribute
    chain (`dist.ReduceOp.MAX`) that starts at a name bound by such an import."""

    def __init__(self, tree: ast.AST) -> None:
        self.aliases: dict[str, str] = {}  # local name -> what it is in torch
        self.found: list[tuple[str, int]] = []
        for node in ast.walk(tree):  # imports anywhere in the file, functions' included
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] != "torch":
                        continue
                    if alias.asname:
                        self.aliases[alias.asname] = alias.name
                    else:
                        self.aliases["torch"] = "torch"
                    self.found.append((alias.name, node.lineno))
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.split(".")[0] != "torch":
                    continue
                for alias in node.names:
                    self.aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                    self.found.append((f"{node.module}.{alias.name}", node.lineno))
        self.visit(tree)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain = []
        base: ast.expr = node
        while isinstance(base, ast.Attribute):
            chain.append(base.attr)
            base = base.value
        if isinstance(base, ast.Name):
            if base.id in self.aliases:
                self.found.append((".".join([self.aliases[base.id], *reversed(chain)]), node.lineno))
        else:
            self.visit(base)  # torch.cuda.Stream(...).wait_stream: the call's own chains


def _scanned_files() -> list[Path]:
    files = [path for folder in SCANNED for path in sorted((REPO / folder).rglob("*.py"))]
    assert len(files) > 50, f"found only {len(files)} files under {SCANNED}"
    return files


def _uses() -> dict[str, list[str]]:
    """torch name -> where it is used (path:line)."""
    uses: dict[str, list[str]] = {}
    for path in _scanned_files():
        tree = ast.parse(path.read_text(), str(path))
        for name, line in _TorchNames(tree).found:
            uses.setdefault(name, []).append(f"{path.relative_to(REPO)}:{line}")
    return uses


def _known(name: str) -> bool:
    """Listed, or a namespace on the way to a listed name."""
    return name == "torch" or name in ALLOWED or any(allowed.startswith(name + ".") for allowed in ALLOWED)


def test_every_torch_name_we_use_exists_in_the_oldest_supported_torch():
    uses = _uses()
    assert "torch.distributed.all_to_all_single" in uses, "the scan no longer sees `dist.` calls"
    newer = [
        f"{name} does not exist in torch {OLDEST} (the oldest supported)"
        + (f"; use {NEWER_THAN_2_11[name]}" if NEWER_THAN_2_11[name] else "")
        + f", at {', '.join(where)}"
        for name, where in sorted(uses.items())
        if name in NEWER_THAN_2_11
    ]
    unknown = [
        f"check that {name} exists in torch {OLDEST} (the oldest supported) and add it to TORCH_2_11 "
        f"in tests/test_torch_api_floor.py; used at {', '.join(where[:5])}"
        for name, where in sorted(uses.items())
        if name not in NEWER_THAN_2_11 and not _known(name)
    ]
    assert not newer + unknown, "\n".join(newer + unknown)


def test_the_lists_agree_with_each_other_and_with_pyproject():
    assert not ALLOWED & NEWER_THAN_2_11.keys(), "a name is both allowed and newer than 2.11"
    requires = (REPO / "pyproject.toml").read_text()
    assert f'"torch>={OLDEST}"' in requires, f"pyproject.toml's torch floor is no longer {OLDEST}: update this test"


def _resolve(name: str) -> object:
    """The object a dotted torch name denotes in the installed torch (imports its module)."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            found = getattr(found, attr)
        return found
    raise ModuleNotFoundError(name)


@pytest.mark.slow  # imports torch.distributed.pipelining (seconds on a loaded machine)
def test_every_listed_name_resolves_in_the_installed_torch():
    """The list is spelled right: torch is at least 2.11 here, so each name must be found."""
    pytest.importorskip("torch.distributed.pipelining")
    missing = []
    for name in sorted(ALLOWED):
        try:
            _resolve(name)
        except (AttributeError, ModuleNotFoundError) as error:
            missing.append(f"{name}: {error}")
    assert not missing, "names on TORCH_2_11 that the installed torch lacks:\n" + "\n".join(missing)


def test_the_scan_sees_each_way_of_importing_torch():
    source = (
        "import torch\n"
        "import torch.distributed as dist\n"
        "from torch import nn\n"
        "from torch.nn import functional as F\n"
        "from torch.utils import swap_tensors\n"
        "def f(x):\n"
        "    import torch.accelerator as acc\n"
        "    dist.all_gather_single(x, x)\n"
        "    torch.cuda.Stream(x).wait_stream(nn.Linear(2, 2))\n"
        "    return F.relu(acc.current_stream()), dist.ReduceOp.MAX, swap_tensors\n"
    )
    found = {name for name, _ in _TorchNames(ast.parse(source)).found}
    assert found == {
        "torch",
        "torch.distributed",
        "torch.nn",
        "torch.nn.functional",
        "torch.utils.swap_tensors",
        "torch.accelerator",
        "torch.distributed.all_gather_single",
        "torch.cuda.Stream",
        "torch.nn.Linear",
        "torch.nn.functional.relu",
        "torch.accelerator.current_stream",
        "torch.distributed.ReduceOp.MAX",
    }
    assert not _known("torch.distributed.all_gather_single")
    assert _known("torch.distributed") and _known("torch.autograd.Variable")
