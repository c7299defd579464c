"""Who may import whom, frozen (issue 24's layout).

* The contract package (ps_offload.proto) imports nothing else of ours; the kernels import
  nothing of ours but themselves; the optimizer plug-ins (ps_offload.optimizers) only those two,
  and the daemon, the trainer and ps-admin reach an optimizer only through them; ps-admin and
  the trainer never load the daemon.
* Inside the daemon, folders are layers, each importing only the ones below it:

      app (server, cli, metrics, systemd, local, composition)
        -> dataplane -> rpc -> store -> model, tier roles -> base (errors, config)

  The store sees of the tiers only their roles (ps_offload.daemon.tiers.tier, which imports
  nothing of ours); the tiers themselves (RAM, NVMe) sit beside the store, and the composition
  root in the app layer chooses them. The tiers import neither the store nor the model (they
  store bytes and JSON, whatever the spec says), the store never imports the fronts (rpc,
  dataplane), and rpc never imports the data plane.
* Inside the trainer, folders are features, layered the same way:

      __init__ -> api -> pipeline -> stream -> offload -> io -> wire -> base (config, debug_models)

* Every import counts for the folder rules: module level, `if TYPE_CHECKING:` and inside
  functions (a lazy import is a dependency all the same).
* No cycles among our modules, counting `if TYPE_CHECKING:` imports (only an import inside a
  function may close a loop, and only within one folder).
* Every folder of ours with modules is a package that pyproject.toml installs.
* Docstrings and docs name a module by its import name, and that name exists.

The graph is read from the source (ast), so the rules hold for every module, not only the
ones a test happens to import. Each rule is also run on a planted violation, so none can
pass by finding nothing.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The folders the repository keeps, and the names pyproject.toml installs them under.
PACKAGES = {
    "ps_offload": "ps_offload",
    "ps_proto": "ps_offload.proto",
    "ps_daemon": "ps_offload.daemon",
    "ps_admin": "ps_offload.admin",
    "trainer": "ps_offload.trainer",
    "kernels": "ps_offload.kernels",
    "optimizers": "ps_offload.optimizers",
}

# -- the layers --------------------------------------------------------------------------

DAEMON_FOLDERS = ("model", "tiers", "store", "rpc", "dataplane")
DAEMON_BASE = ("errors", "config")  # the rest of the daemon's top-level modules are "daemon.app"
TRAINER_FOLDERS = ("wire", "io", "offload", "stream", "pipeline")
TRAINER_BASE = ("config", "debug_models")

# unit -> the units it may import (besides itself). Must be acyclic (checked below).
ALLOWED: dict[str, set[str]] = {
    "proto": set(),
    "kernels": set(),
    "optimizers": {"proto", "kernels"},  # the plug-ins: below the daemon and the trainer, which both run them
    "root": {"trainer.root"},  # ps_offload/__init__.py re-exports the trainer lazily
    "admin": {"proto", "optimizers"},
    "daemon.base": {"proto"},
    "daemon.tier_roles": set(),  # ps_offload.daemon.tiers.tier: all the store sees of the tiers
    "daemon.tiers": {"daemon.tier_roles", "daemon.base", "proto"},
    "daemon.model": {"daemon.base", "proto", "kernels", "optimizers"},
    "daemon.store": {"daemon.model", "daemon.tier_roles", "daemon.base", "proto", "kernels", "optimizers"},
    "daemon.rpc": {"daemon.store", "daemon.model", "daemon.base", "proto", "optimizers"},
    "daemon.dataplane": {"daemon.rpc", "daemon.store", "daemon.model", "daemon.base", "proto"},
    "daemon.app": {f"daemon.{f}" for f in (*DAEMON_FOLDERS, "base", "tier_roles")} | {"proto", "kernels"},
    "trainer.base": {"proto", "optimizers"},
    "trainer.wire": {"trainer.base", "proto", "optimizers"},
    "trainer.io": {"trainer.wire", "trainer.base", "proto", "kernels"},
    "trainer.offload": {"trainer.io", "trainer.wire", "trainer.base", "proto", "kernels", "optimizers"},
    "trainer.stream": {"trainer.offload", "trainer.io", "trainer.wire", "trainer.base", "proto"},
    "trainer.pipeline": {
        "trainer.stream", "trainer.offload", "trainer.io", "trainer.wire", "trainer.base", "proto", "kernels",
        "optimizers",
    },
    "trainer.api": {"trainer.offload", "trainer.stream", "trainer.base", "optimizers"},
    "trainer.root": {f"trainer.{f}" for f in (*TRAINER_FOLDERS, "base", "api")} | {"proto"},
}  # fmt: skip


def unit_of(module: str) -> str | None:
    """The layer a module of ours belongs to; None for a name that is not ours."""
    parts = module.split(".")
    if parts[0] != "ps_offload":
        return None
    if len(parts) == 1:
        return "root"
    top = parts[1]
    if top in ("proto", "kernels", "admin", "optimizers"):
        return top
    if top == "daemon":
        if len(parts) == 2:
            return "daemon.app"
        if parts[2:] == ["tiers", "tier"]:
            return "daemon.tier_roles"
        if parts[2] in DAEMON_FOLDERS:
            return f"daemon.{parts[2]}"
        return "daemon.base" if parts[2] in DAEMON_BASE else "daemon.app"
    if top == "trainer":
        if len(parts) == 2:
            return "trainer.root"
        if parts[2] in TRAINER_FOLDERS:
            return f"trainer.{parts[2]}"
        if parts[2] == "api":
            return "trainer.api"
        if parts[2] in TRAINER_BASE:
            return "trainer.base"
        return f"trainer.unplaced:{parts[2]}"  # a new top-level trainer module: place it above
    return None


# -- the import graph, from the source --------------------------------------------------


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, by installed name
    target: str  # a module of ours, by its installed name
    path: Path
    line: int
    kind: str  # "module", "type_checking" or "function"

    def __str__(self) -> str:
        where = self.path.relative_to(REPO) if self.path.is_relative_to(REPO) else self.path
        return f"{where}:{self.line} imports {self.target} ({self.kind})"


def modules_under(root: Path) -> dict[str, Path]:
    """Every module of ours by installed name: ps_daemon/tiers/nvme.py -> ps_offload.daemon.tiers.nvme."""
    modules = {}
    for folder, name in PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = [name, *path.relative_to(root / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(body: list[ast.stmt], kind: str = "module"):
    """(node, kind) for every import statement: "module" when it runs at import, else
    "type_checking" or "function"."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, kind
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from _import_nodes(node.body, "function")
        elif isinstance(node, ast.If):
            yield from _import_nodes(
                node.body, "type_checking" if _is_type_checking(node) and kind == "module" else kind
            )
            yield from _import_nodes(node.orelse, kind)
        elif isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                yield from _import_nodes(block, kind)
        elif isinstance(node, ast.With | ast.ClassDef | ast.For | ast.While):
            yield from _import_nodes(node.body, kind)


def _imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, *([base] if base else [])])
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def import_graph(root: Path) -> dict[str, list[Import]]:
    """For each module of ours, its imports of modules of ours, of every kind."""
    modules = modules_under(root)
    graph: dict[str, list[Import]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges = []
        for node, kind in _import_nodes(tree.body):
            names = _imported_names(node, module, path.name == "__init__.py")
            # `from pkg import sub` runs pkg.sub; `from pkg import name` reads pkg's __init__.
            submodules = [n for n in names[1:] if n in modules] if isinstance(node, ast.ImportFrom) else []
            targets = submodules or [n for n in names if n in modules] or names[:1]
            edges += [Import(module, t, path, node.lineno, kind) for t in targets if t != module]
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, list[Import]], kinds: set[str]) -> list[Import] | None:
    """One cycle through edges of the given kinds, as the imports that close it, or None."""
    done: set[str] = set()
    path: list[str] = []
    edges: list[Import] = []

    def visit(module: str) -> list[Import] | None:
        path.append(module)
        for edge in graph[module]:
            if edge.kind not in kinds:
                continue
            if edge.target in path:
                return [*edges[path.index(edge.target) :], edge]
            if edge.target in graph and edge.target not in done:
                edges.append(edge)
                found = visit(edge.target)
                if found:
                    return found
                edges.pop()
        path.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        if module not in done:
            found = visit(module)
            if found:
                return found
    return None


def layer_violations(graph: dict[str, list[Import]]) -> list[Import]:
    bad = []
    for module, edges in graph.items():
        source = unit_of(module)
        for edge in edges:
            target = unit_of(edge.target)
            if target is None or target == source:
                continue
            if source is None or source.startswith("trainer.unplaced") or target not in ALLOWED.get(source, set()):
                bad.append(edge)
    return bad


def third_spellings(root: Path) -> list[str]:
    """`ps_daemon.store`-style names (the folder, dotted): not an import name."""
    pattern = re.compile(r"(?<![\w./-])ps_(daemon|proto|admin)\.[a-z_]")
    hits = []
    for path in _text_files(root):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return hits


def _text_files(root: Path) -> list[Path]:
    folders = [*PACKAGES, "tests", "bench", "examples", "docs"]
    files = [p for f in folders for p in (root / f).rglob("*") if p.suffix in (".py", ".md")]
    files += [p for p in (root / "README.md", root / "systemd" / "README.md") if p.exists()]
    here = Path(__file__).resolve()  # this file plants violations in its own text
    return [
        p for p in files if "__pycache__" not in p.parts and not p.name.startswith("ps_pb2") and p.resolve() != here
    ]


def _top_level_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


# "ps_offload.x" strings that are not module paths: the safetensors metadata keys ps-admin export writes.
NOT_MODULES = {"ps_offload.model", "ps_offload.version"}


def dangling_names(root: Path) -> list[str]:
    """`ps_offload.x.y` mentions (code, docstrings, docs) whose module does not exist, or whose
    next part is not a module, a name defined in it, or the trainer's public names on the root."""
    modules = modules_under(root)
    public = {"offload", "AdamW", "SGD", "__all__"} | set(_exports(root))
    pattern = re.compile(r"(?<![\w./-])ps_offload(?:\.\w+)+")
    bad = []
    for path in _text_files(root):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for match in pattern.finditer(line):
                if match.group(0) in NOT_MODULES:
                    continue
                parts = match.group(0).split(".")
                for i in range(len(parts), 0, -1):
                    if ".".join(parts[:i]) in modules:
                        break
                module = ".".join(parts[:i])
                rest = parts[i:]
                if not rest:
                    continue
                known = _top_level_names(modules[module]) | ({"__file__", "__all__", "__version__"})
                if module == "ps_offload":
                    known |= public
                if rest[0] not in known:
                    bad.append(f"{path.relative_to(root)}:{number}: {match.group(0)}")
    return bad


def _exports(root: Path) -> list[str]:
    text = (root / "ps_offload" / "__init__.py").read_text()
    return re.findall(r'"(\w+)",', text)


def unlisted_packages(root: Path) -> list[str]:
    """Folders of ours with an __init__.py that pyproject.toml does not install, and the reverse."""
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {m for m, p in modules_under(root).items() if p.name == "__init__.py"}
    return sorted(found ^ listed)


def mirror_problems(root: Path) -> list[str]:
    """tests/ps_daemon/<x>/ and tests/trainer/<x>/ name folders that exist; test file names are
    unique across tests/ (pytest imports them by file name: no __init__.py)."""
    problems = []
    for tests, package in (("ps_daemon", "ps_daemon"), ("trainer", "trainer")):
        for folder in sorted(p for p in (root / "tests" / tests).iterdir() if p.is_dir() and p.name != "__pycache__"):
            if not (root / package / folder.name / "__init__.py").exists():
                problems.append(f"tests/{tests}/{folder.name}/ mirrors no package {package}/{folder.name}/")
    seen: dict[str, Path] = {}
    for path in sorted((root / "tests").rglob("test_*.py")):
        if path.name in seen:
            problems.append(f"{path.relative_to(root)} and {seen[path.name].relative_to(root)} share a file name")
        seen[path.name] = path
    return problems


# -- the tests ---------------------------------------------------------------------------


def _loaded_after_import(module: str) -> list[str]:
    """sys.modules after importing `module` in a fresh interpreter."""
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("client", ["ps_offload.trainer", "ps_offload.admin.cli"])
def test_clients_load_no_daemon_module(client):
    daemon = [m for m in _loaded_after_import(client) if m == "ps_offload.daemon" or m.startswith("ps_offload.daemon.")]
    assert daemon == [], f"importing {client} loads daemon modules: {daemon}"


def test_the_store_loads_no_grpc():
    grpc = [
        m for m in _loaded_after_import("ps_offload.daemon.store.shard_store") if m.split(".")[0].startswith("grpc")
    ]
    assert grpc == [], f"importing the store loads gRPC: {grpc}"


def test_offload_is_the_function():
    """ps_offload.trainer.offload is the function a script calls (ps_offload.trainer.api); no
    module or folder of that name may shadow it (a subpackage is bound on its parent when first
    imported, and dotted-path resolution, monkeypatch's and mock's, would then find the
    function where it looks for the folder, or the reverse)."""
    code = (
        "import inspect, ps_offload, ps_offload.trainer as t\n"
        "print(inspect.isfunction(t.offload) and ps_offload.offload is t.offload)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.stdout.strip() == "True", result.stderr


def test_the_layers_form_no_cycle():
    graph = {unit: [Import(unit, t, REPO, 0, "module") for t in targets] for unit, targets in ALLOWED.items()}
    assert find_cycle(graph, {"module"}) is None


def test_every_import_keeps_to_the_layers():
    graph = import_graph(REPO)
    assert len(graph) > 80  # the walk found the packages
    bad = layer_violations(graph)
    assert bad == [], "imports across the layers (ALLOWED):\n  " + "\n  ".join(map(str, bad))


def test_no_import_cycles_counting_type_checking():
    cycle = find_cycle(import_graph(REPO), {"module", "type_checking"})
    assert cycle is None, "import cycle:\n  " + "\n  ".join(map(str, cycle))


def test_the_contract_package_imports_nothing_else_of_ours():
    bad = [e for e in layer_violations(import_graph(REPO)) if unit_of(e.source) == "proto"]
    assert bad == [], "ps_proto/ must import only the contract package:\n  " + "\n  ".join(map(str, bad))


def test_every_package_is_installed():
    assert unlisted_packages(REPO) == [], "pyproject.toml [tool.setuptools] packages differs from the folders"


def test_docs_name_modules_by_their_import_name():
    assert third_spellings(REPO) == [], "name modules by their import name (ps_offload.daemon...):\n  " + "\n  ".join(
        third_spellings(REPO)
    )
    dangling = dangling_names(REPO)
    assert dangling == [], "names that do not exist:\n  " + "\n  ".join(dangling)


def test_tests_mirror_the_packages():
    problems = mirror_problems(REPO)
    assert problems == [], "\n".join(problems)


# -- planted violations: every rule can fail ------------------------------------------------


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    for folder in PACKAGES:
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
        (tmp_path / folder / "__init__.py").write_text("")
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        for parent in (tmp_path / rel).parents:
            if parent == tmp_path:
                break
            (parent / "__init__.py").touch()
        (tmp_path / rel).write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"ps_daemon/tiers/nvme.py": "from ps_offload.daemon.store.shard_store import ShardStore\n"}, "daemon.store"),
        ({"ps_daemon/tiers/nvme.py": "from ps_offload.daemon.model.spec import ModelSpec\n"}, "daemon.model"),
        ({"ps_daemon/store/shard.py": "def f():\n    from ps_offload.daemon.rpc import status\n"}, "daemon.rpc"),
        # The store sees the tiers' roles only: the composition root (daemon.app) chooses them.
        ({"ps_daemon/store/shard_store.py": "from ps_offload.daemon.tiers.nvme import NvmeFiles\n"}, "daemon.tiers"),
        ({"ps_daemon/tiers/tier.py": "from ps_offload.daemon.errors import DataLoss\n"}, "daemon.base"),
        (
            {"ps_daemon/rpc/servicer.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
             "    from ps_offload.daemon.dataplane.server import DataPlaneServer\n"},
            "daemon.dataplane",
        ),
        (
            {"trainer/offload/whole_model.py": "from ps_offload.trainer.stream.optimizer import StreamedOptimizer\n"},
            "trainer.stream",
        ),
        ({"ps_proto/cluster.py": "import ps_offload.daemon.errors\n"}, "daemon.base"),
        ({"ps_proto/plan.py": "from ps_offload import kernels\n"}, "kernels"),
    ],
)  # fmt: skip
def test_a_planted_layer_violation_fails(tmp_path, files, expected):
    bad = layer_violations(import_graph(_plant(tmp_path, files)))
    assert [unit_of(e.target) for e in bad] == [expected]


def test_a_planted_type_checking_cycle_fails(tmp_path):
    root = _plant(
        tmp_path,
        {
            "ps_daemon/store/shard.py": "from ps_offload.daemon.store.accumulate import GradientParts\n",
            "ps_daemon/store/accumulate.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from ps_offload.daemon.store.shard import Shard\n",
        },
    )
    cycle = find_cycle(import_graph(root), {"module", "type_checking"})
    assert [e.line for e in cycle] in ([1, 3], [3, 1])
    assert find_cycle(import_graph(root), {"module"}) is None  # the old rule missed it


def test_planted_name_package_and_mirror_problems(tmp_path):
    root = _plant(
        tmp_path,
        {
            "ps_daemon/store/shard_store.py": '"""See ps_daemon.store and ps_offload.daemon.gone."""\n',
            "ps_offload/__init__.py": "",
            "pyproject.toml": '[tool.setuptools]\npackages = ["ps_offload"]\n',
            "tests/ps_daemon/nowhere/test_a.py": "",
            "tests/trainer/test_a.py": "",
        },
    )
    assert [h.split(":")[0] for h in third_spellings(root)] == ["ps_daemon/store/shard_store.py"]
    assert dangling_names(root) == ["ps_daemon/store/shard_store.py:1: ps_offload.daemon.gone"]
    assert "ps_offload.daemon.store" in unlisted_packages(root)
    problems = mirror_problems(root)
    assert any("nowhere" in p for p in problems) and any("share a file name" in p for p in problems)


# -- the diagram --------------------------------------------------------------------------

DIAGRAM = ("<!-- layers:begin -->", "<!-- layers:end -->")


def layers_diagram() -> str:
    """ALLOWED as a Mermaid graph, each unit pointing at what it may import, without the
    arrows another path already implies (a transitive reduction of the DAG)."""

    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in ALLOWED[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    def implied(unit: str, target: str) -> bool:
        return any(target in reachable(other) for other in ALLOWED[unit] if other != target)

    def node(unit: str) -> str:
        return unit.replace(".", "_")

    lines = ["```mermaid", "graph TD"]
    for unit in sorted(ALLOWED):  # one line per unit: its label, then its arrows (`a --> b & c`)
        targets = [node(target) for target in sorted(ALLOWED[unit]) if not implied(unit, target)]
        arrows = f" --> {' & '.join(targets)}" if targets else ""
        lines.append(f'    {node(unit)}["{unit}"]{arrows}')
    lines.append("```")
    return "\n".join(lines)


def test_the_architecture_diagram_is_the_layering():
    """docs/architecture.md's diagram is generated from ALLOWED; regenerate it with
    `python -c "from tests.test_layering import write_diagram; write_diagram()"`."""
    begin, end = DIAGRAM
    text = (REPO / "docs" / "architecture.md").read_text()
    shown = text.split(begin, 1)[1].split(end, 1)[0].strip()
    assert shown == layers_diagram(), "docs/architecture.md's layer diagram is stale: run write_diagram()"


def write_diagram() -> None:
    begin, end = DIAGRAM
    path = REPO / "docs" / "architecture.md"
    head, rest = path.read_text().split(begin, 1)
    path.write_text(f"{head}{begin}\n{layers_diagram()}\n{end}{rest.split(end, 1)[1]}")
