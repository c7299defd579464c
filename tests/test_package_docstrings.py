"""Every package's docstring names every module of its folder, frozen.

The `__init__.py` of each folder under ps_proto/, ps_daemon/, ps_admin/, trainer/, kernels/ and
optimizers/ opens with a map of that folder: each module (`*.py` but `__init__`, `__main__`
included, generated ones too) and each subpackage (a subfolder with an `__init__.py`), named by
its bare name with a few words on what it holds. A map kept by hand drifts the day a module is
added, so this test holds it to the folder: a name missing from its package's docstring fails,
listing the folder and the names. docs/layout.md keeps the same facts file by file, checked by
tests/test_doc_paths.py; tests/test_layering.py checks that the dotted names docstrings use exist.
The checker also runs on a planted package, so it cannot pass by finding nothing.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("ps_proto", "ps_daemon", "ps_admin", "trainer", "kernels", "optimizers")


def packages_under(root: Path) -> list[Path]:
    """Every folder under root (root included) that holds an __init__.py, __pycache__ skipped."""
    folders = [root, *(p for p in root.rglob("*") if p.is_dir() and "__pycache__" not in p.relative_to(root).parts)]
    return sorted(f for f in folders if (f / "__init__.py").is_file())


def members(package: Path) -> list[str]:
    """What a package's docstring must name: its modules' stems and its subpackages' names."""
    modules = [p.stem for p in package.glob("*.py") if p.stem != "__init__"]
    subpackages = [
        p.name for p in package.iterdir() if p.is_dir() and p.name != "__pycache__" and (p / "__init__.py").is_file()
    ]
    return sorted(modules + subpackages)


def unnamed_members(root: Path) -> dict[Path, list[str]]:
    """Each package under root whose __init__.py docstring leaves out some of its members (as a
    whole word), with those members; {} when every docstring names them all."""
    missing = {}
    for package in packages_under(root):
        docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
        absent = [name for name in members(package) if not re.search(rf"\b{re.escape(name)}\b", docstring)]
        if absent:
            missing[package] = absent
    return missing


def test_every_package_docstring_names_its_modules():
    missing = {folder: names for root in ROOTS for folder, names in unnamed_members(REPO / root).items()}
    assert missing == {}, "package docstrings that do not name every module of their folder:\n  " + "\n  ".join(
        f"{folder.relative_to(REPO)}/__init__.py: {', '.join(names)}" for folder, names in missing.items()
    )


def test_the_roots_hold_packages():
    """The walk finds the packages it is meant to check (a renamed root would check nothing)."""
    for root in ROOTS:
        assert (REPO / root) in packages_under(REPO / root), f"{root}/ is not a package"
    assert REPO / "ps_daemon" / "store" in packages_under(REPO / "ps_daemon")


def test_a_planted_unnamed_module_is_found(tmp_path):
    root = tmp_path / "pkg"
    (root / "sub" / "__pycache__").mkdir(parents=True)
    (root / "empty").mkdir()  # a folder without __init__.py: not a subpackage, not a member
    (root / "__init__.py").write_text('"""The package: shard_store (the store), sub/ (a folder)."""\n')
    (root / "shard_store.py").write_text("")
    (root / "shard.py").write_text("")  # `shard` only inside `shard_store`: not a whole word
    (root / "__main__.py").write_text("")
    (root / "sub" / "__init__.py").write_text("x = 1  # no docstring at all\n")
    (root / "sub" / "push.py").write_text("")
    (root / "sub" / "__pycache__" / "stale.py").write_text("")
    (root / "sub" / "__pycache__" / "__init__.py").write_text("")

    assert unnamed_members(root) == {root: ["__main__", "shard"], root / "sub": ["push"]}

    (root / "__init__.py").write_text('"""shard_store, shard, __main__ and sub/."""\n')
    (root / "sub" / "__init__.py").write_text('"""push: one push."""\n')
    assert unnamed_members(root) == {}
