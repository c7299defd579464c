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


# The folder map in docs/architecture.md: generated from the package docstrings, so it names
# the folders that exist and says of each what its own docstring says.
FOLDER_MAP = ("<!-- folders:begin -->", "<!-- folders:end -->")
IMPORT_ROOT = {
    "ps_proto": "ps_offload.proto",
    "ps_daemon": "ps_offload.daemon",
    "ps_admin": "ps_offload.admin",
    "trainer": "ps_offload.trainer",
    "kernels": "ps_offload.kernels",
    "optimizers": "ps_offload.optimizers",
}


def first_sentence(docstring: str) -> str:
    """The docstring's opening sentence on one line: up to the first full stop that ends a
    sentence (a dotted name such as torch.optim has no space after its dots)."""
    paragraph = " ".join(docstring.split("\n\n", 1)[0].split())
    match = re.search(r"\.(\s|$)", paragraph)
    return paragraph[: match.start() + 1] if match else paragraph


def folder_map() -> str:
    """One line per package: its folder, its import name and its docstring's first sentence."""
    lines = ["- `proto/ps.proto`: the wire contract, the ParameterServer and Admin services."]
    for root in ROOTS:
        for package in packages_under(REPO / root):
            parts = package.relative_to(REPO).parts
            name = ".".join((IMPORT_ROOT[root], *parts[1:]))
            docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
            lines.append(f"- `{'/'.join(parts)}/` (`{name}`): {first_sentence(docstring)}")
    return "\n".join(lines)


def test_the_folder_map_is_generated_from_the_docstrings():
    """docs/architecture.md's folder map; regenerate it with
    `python -c "from tests.test_package_docstrings import write_folder_map; write_folder_map()"`."""
    begin, end = FOLDER_MAP
    shown = (REPO / "docs" / "architecture.md").read_text().split(begin, 1)[1].split(end, 1)[0].strip()
    assert shown == folder_map(), "docs/architecture.md's folder map is stale: run write_folder_map()"


def test_the_folder_map_names_every_package():
    shown = folder_map()
    for root in ROOTS:
        for package in packages_under(REPO / root):
            assert f"`{'/'.join(package.relative_to(REPO).parts)}/`" in shown
    assert first_sentence("Uses torch.optim.Adam. Then more.") == "Uses torch.optim.Adam."
    assert first_sentence("No stop at all") == "No stop at all"


def write_folder_map() -> None:
    begin, end = FOLDER_MAP
    path = REPO / "docs" / "architecture.md"
    head, rest = path.read_text().split(begin, 1)
    path.write_text(f"{head}{begin}\n{folder_map()}\n{end}{rest.split(end, 1)[1]}")
