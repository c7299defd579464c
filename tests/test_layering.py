"""Who may import whom, frozen: the trainer and ps-admin are clients of the contract package
and never load the daemon; the daemon's store knows nothing of gRPC; the contract package
imports nothing else of ours; and no two of our modules import each other at import time.

The graph is read from the source (ast), so the rules hold for every module, not only the
ones a test happens to import.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
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
}


def _loaded_after_import(module: str) -> list[str]:
    """sys.modules after importing `module` in a fresh interpreter (this one has loaded
    everything the other tests needed)."""
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("client", ["ps_offload.trainer", "ps_offload.admin.cli"])
def test_clients_load_no_daemon_module(client):
    daemon = [m for m in _loaded_after_import(client) if m == "ps_offload.daemon" or m.startswith("ps_offload.daemon.")]
    assert daemon == [], f"importing {client} loads daemon modules: {daemon}"


def test_the_store_loads_no_grpc():
    grpc = [m for m in _loaded_after_import("ps_offload.daemon.store") if m.split(".")[0].startswith("grpc")]
    assert grpc == [], f"importing ps_offload.daemon.store loads gRPC: {grpc}"


# -- the import graph, from the source --------------------------------------------------


@dataclass(frozen=True)
class Import:
    target: str  # a module of ours, by its installed name
    path: Path
    line: int

    def __str__(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line} imports {self.target}"


def _modules() -> dict[str, Path]:
    """Every module of ours by installed name: ps_daemon/tiers/nvme.py -> ps_offload.daemon.tiers.nvme."""
    modules = {}
    for folder, name in PACKAGES.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = [name, *path.relative_to(REPO / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_time_nodes(body: list[ast.stmt]):
    """The import statements that run when the module is imported: the module's body and
    what it nests (if, try, with, class bodies), not function bodies or `if TYPE_CHECKING:`."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        elif isinstance(node, ast.If):
            if not _is_type_checking(node):
                yield from _import_time_nodes(node.body)
            yield from _import_time_nodes(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                yield from _import_time_nodes(block)
        elif isinstance(node, ast.With | ast.ClassDef):
            yield from _import_time_nodes(node.body)


def _imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """Absolute names `node` imports: a module for `import x.y`; for `from x import a`, x.a
    when that is a module, else x."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, *([base] if base else [])])
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def _graph(*, import_time_only: bool) -> dict[str, list[Import]]:
    """For each module of ours, its imports of modules of ours."""
    modules = _modules()
    graph: dict[str, list[Import]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        nodes = (
            _import_time_nodes(tree.body)
            if import_time_only
            else (n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom))
        )
        edges = []
        for node in nodes:
            names = _imported_names(node, module, path.name == "__init__.py")
            # `from pkg import sub` runs pkg.sub; `from pkg import name` reads pkg's __init__.
            submodules = [n for n in names[1:] if n in modules] if isinstance(node, ast.ImportFrom) else []
            targets = submodules or [n for n in names if n in modules] or names[:1]
            edges += [Import(t, path, node.lineno) for t in targets if t != module]
        graph[module] = edges
    return graph


def _find_cycle(graph: dict[str, list[Import]]) -> list[Import] | None:
    """One cycle of the graph, as the imports that close it, or None."""
    done: set[str] = set()
    path: list[str] = []  # the modules on the depth-first path, from its root
    edges: list[Import] = []  # edges[i] leads from path[i] to path[i + 1]

    def visit(module: str) -> list[Import] | None:
        path.append(module)
        for edge in graph[module]:
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


def test_no_import_cycles_among_our_modules():
    graph = _graph(import_time_only=True)
    assert len(graph) > 30  # the walk found the packages
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle:\n  " + "\n  ".join(map(str, cycle))


def test_the_cycle_finder_finds_a_cycle():
    path = REPO / "ps_proto" / "codec.py"
    graph = {"a": [Import("b", path, 1)], "b": [Import("c", path, 2)], "c": [Import("a", path, 3)], "d": []}
    assert [e.line for e in _find_cycle(graph)] == [1, 2, 3]
    assert _find_cycle({"a": [Import("b", path, 1)], "b": []}) is None


def test_the_contract_package_imports_nothing_else_of_ours():
    ours = ("ps_offload", *PACKAGES, "bench", "tests")  # the folders too: a bare `import trainer` is ours
    graph = _graph(import_time_only=False)  # a lazy import inside a function is a dependency all the same
    bad = [
        str(edge)
        for module, edges in graph.items()
        if module == "ps_offload.proto" or module.startswith("ps_offload.proto.")
        for edge in edges
        if edge.target.split(".")[0] in ours
        and not (edge.target == "ps_offload.proto" or edge.target.startswith("ps_offload.proto."))
    ]
    assert bad == [], "ps_proto/ must import only the contract package:\n  " + "\n  ".join(bad)
