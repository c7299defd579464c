"""Test files do not import each other: what two of them share lives in tests/helpers/.

pytest imports each test file by its own name (no __init__.py: tests/integration/test_a.py is
module `test_a`), so a test file imported again as `tests.integration.test_a` is a second copy of
it, and a `test_` function imported from it runs twice. Any module under tests/ (test files,
the worker scripts torchrun starts, tests/helpers/ itself) may import `tests.helpers` and its
modules, and no other `tests.` module; no relative import (`from .x import`); and no sibling
module by its bare name (`import kernel_cases`, found only through the folder pytest puts on
sys.path). Code in strings that a test runs in a subprocess (`python -c SCRIPT`) is held to the
same rule. tests/helpers/ holds no `test_` function or `Test` class (pytest would collect them
wherever they are imported), and its __init__ docstring names each of its modules.

The checkers run on planted files too, so they cannot pass by finding nothing.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HELPERS = "tests.helpers"


def _python_files(tests: Path) -> list[Path]:
    return sorted(p for p in tests.rglob("*.py") if "__pycache__" not in p.parts)


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of the module and of each class and function."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _embedded_scripts(tree: ast.AST) -> list[ast.Module]:
    """String constants (not docstrings) that parse as Python with an import: the scripts a
    test hands to `python -c`."""
    docstrings = _docstrings(tree)
    scripts = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if "import" in node.value and "\n" in node.value:
                try:
                    scripts.append(ast.parse(node.value))
                except SyntaxError:
                    continue
    return scripts


def _imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(relative level, dotted module) of every import, nested ones included; `from a import b`
    gives a.b, as b may be a module."""
    modules = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules += [(0, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            modules += [(node.level, f"{base}.{alias.name}" if base else alias.name) for alias in node.names]
    return modules


def _violation(path: Path, level: int, module: str) -> str | None:
    if level:
        return f"relative import {'.' * level}{module}"
    top = module.split(".")[0]
    if top == "tests":
        return None if module == HELPERS or module.startswith(HELPERS + ".") else module
    if (path.parent / f"{top}.py").is_file() or (path.parent / top / "__init__.py").is_file():
        return f"{module} (a sibling module by its bare name)"
    return None


def import_violations(tests: Path) -> list[str]:
    """`file -> imported module` for every import a module under `tests` may not make (this
    file aside: it plants violations in its own strings)."""
    root = tests.parent
    here = Path(__file__).resolve()
    bad = []
    for path in _python_files(tests):
        if path.resolve() == here:
            continue
        tree = ast.parse(path.read_text())
        for source in (tree, *_embedded_scripts(tree)):
            for level, module in _imported_modules(source):
                problem = _violation(path, level, module)
                if problem is not None:
                    bad.append(f"{path.relative_to(root)} -> {problem}")
    return bad


def collectable_helpers(helpers: Path) -> list[str]:
    """`test_` functions and `Test` classes under `helpers` (nested ones included), and
    test_*.py files: pytest would collect them."""
    found = [f"{p.name}: a test file name" for p in helpers.glob("test_*.py")]
    for path in _python_files(helpers):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
                found.append(f"{path.name}: {node.name}")
            elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                found.append(f"{path.name}: {node.name}")
    return found


def unnamed_helper_modules(helpers: Path) -> list[str]:
    """Modules of `helpers` that its __init__ docstring does not name as a whole word."""
    docstring = ast.get_docstring(ast.parse((helpers / "__init__.py").read_text())) or ""
    modules = sorted(p.stem for p in helpers.glob("*.py") if p.stem != "__init__")
    return [m for m in modules if not re.search(rf"\b{re.escape(m)}\b", docstring)]


# -- the tests ---------------------------------------------------------------------------


def test_test_files_import_only_the_helpers_of_tests():
    bad = import_violations(REPO / "tests")
    assert bad == [], "imports of test modules (move what they share into tests/helpers/):\n  " + "\n  ".join(bad)


def test_the_helpers_hold_nothing_pytest_would_collect():
    assert collectable_helpers(REPO / "tests" / "helpers") == []


def test_the_helpers_docstring_names_every_helper_module():
    assert unnamed_helper_modules(REPO / "tests" / "helpers") == []


def test_the_walk_finds_the_test_files_and_the_helpers():
    """A moved folder would leave the checkers nothing to check."""
    files = {p.relative_to(REPO).as_posix() for p in _python_files(REPO / "tests")}
    assert {"tests/test_test_layout.py", "tests/helpers/__init__.py", "tests/integration/pp_dp_worker.py"} <= files
    assert len(files) > 100 and len(list((REPO / "tests" / "helpers").glob("*.py"))) > 10


def _plant(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "tests"


def test_planted_imports_of_test_modules_fail(tmp_path):
    script = '"""A module docstring naming `from tests.a.test_b import f`, which is no import."""\n'
    script += 'SCRIPT = """\nimport sys\nfrom tests.a.test_b import f\n"""\n'
    tests = _plant(
        tmp_path,
        {
            "tests/a/test_a.py": (
                "from tests.a.test_b import helper\n"
                "from tests.a import test_b\n"
                "import tests.b.worker\n"
                "from . import test_b as again\n"
                "from .test_b import helper as same\n"
                "import cases\n"
                "def test_late():\n    from tests.b.worker import main\n"
                # allowed
                "from tests.helpers import payloads\n"
                "from tests.helpers.payloads import tensor_bytes\n"
                "import tests.helpers.specs\n"
                "from tests import helpers\n"
                "import torch\n"
            ),
            "tests/a/test_b.py": "def helper():\n    pass\n",
            "tests/a/cases.py": "",
            "tests/b/worker.py": script,
            "tests/helpers/__init__.py": '"""payloads specs"""\n',
            "tests/helpers/payloads.py": "from tests.helpers.specs import x\n",
        },
    )
    assert sorted(import_violations(tests)) == [
        "tests/a/test_a.py -> cases (a sibling module by its bare name)",
        "tests/a/test_a.py -> relative import .test_b",
        "tests/a/test_a.py -> relative import .test_b.helper",
        "tests/a/test_a.py -> tests.a.test_b",
        "tests/a/test_a.py -> tests.a.test_b.helper",
        "tests/a/test_a.py -> tests.b.worker",
        "tests/a/test_a.py -> tests.b.worker.main",
        "tests/b/worker.py -> tests.a.test_b.f",
    ]


def test_planted_collectable_helpers_and_an_unnamed_module_fail(tmp_path):
    helpers = (
        _plant(
            tmp_path,
            {
                "tests/helpers/__init__.py": '"""named: a module of shared cases, payloads_extra."""\n',
                "tests/helpers/named.py": (
                    "def test_shared():\n    pass\nclass TestCase:\n    pass\ndef checked():\n    pass\n"
                ),
                "tests/helpers/payloads.py": "",
                "tests/helpers/test_oops.py": "",
            },
        )
        / "helpers"
    )
    assert sorted(collectable_helpers(helpers)) == [
        "named.py: TestCase",
        "named.py: test_shared",
        "test_oops.py: a test file name",
    ]
    assert unnamed_helper_modules(helpers) == ["payloads", "test_oops"]
