"""The files the docs name exist.

Every repository path that README.md, systemd/README.md or a page under docs/ names, in
backticks or as a link target, must exist: a file, a folder, or a glob that matches something. A bare test file name
(`test_snapshots.py`) must be a file somewhere under tests/. A link to a heading of one of our
Markdown pages (`configuration.md#lifecycle`) must find that heading. test_layering.py checks
the other half of the docs' names, the import names (`ps_offload.daemon.store.push`).

What counts as a path: a token inside backticks, or a link target, that starts with one of the
repository's top-level folders or names one of its root files. Placeholders (`<x>`, `NAME`) and
shell commands around a path are skipped; a link is read relative to the page that holds it.
The checker runs on planted text too, so it cannot pass by finding nothing.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TOP_FOLDERS = (
    "proto", "ps_proto", "ps_daemon", "ps_admin", "ps_offload", "trainer", "kernels",
    "tests", "bench", "examples", "docs", "systemd", "deploy",
)  # fmt: skip
ROOT_FILES = ("README.md", "pyproject.toml", "Makefile", "constraints.txt")


_FENCE = re.compile(r"^\s*(```|~~~)")
_BACKTICKS = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_TOPS = "|".join(map(re.escape, (*TOP_FOLDERS, *ROOT_FILES)))
_PATH = re.compile(rf"^(?:{_TOPS})(?:/[\w.*\-@]*)*$")
_TEST_FILE = re.compile(r"^test_\w+\.py$")
_PLACEHOLDER = re.compile(r"^(NAME|ID|FILE|DIR|MODEL|PATH)(\.\w+)?$")  # bench/results/NAME.json


def doc_files(root: Path) -> list[Path]:
    files = [*(root / "docs").glob("*.md"), root / "README.md", root / "systemd" / "README.md"]
    return sorted(p for p in files if p.exists())


def _prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def _tokens(span: str) -> list[str]:
    """The words of a backtick span that may be paths: `python examples/demo.py --x` -> the
    path; trailing punctuation and a `:line` or `#anchor` suffix dropped."""
    words = []
    for word in span.split():
        if re.search(r"[<>{}$\[\]]|\.\.\.", word) or any(map(_PLACEHOLDER.match, word.split("/"))):
            continue
        word = word.strip(",;()'\"").rstrip(".:")
        word = re.split(r"[:#]", word, maxsplit=1)[0]
        if word:
            words.append(word)
    return words


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for _, line in _prose_lines(path.read_text()):
        match = re.match(r"^#{1,6}\s+(.*)$", line)
        if not match:
            continue
        base = slug(match.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


# Folders a command creates and git ignores (a fresh clone has none of them): a doc may name
# them before they exist.
OUTPUT_FOLDERS = ("bench/results/quick", "gpu-wheels", ".venv", "build")


def _exists(root: Path, rel: str) -> bool:
    if any(rel == folder or rel.startswith(folder + "/") for folder in OUTPUT_FOLDERS):
        return True
    if "*" in rel:
        return any(root.glob(rel))
    return (root / rel).exists()


def missing_paths(root: Path, text: str, where: Path) -> list[str]:
    """`where`'s references (its text given) to repository paths that do not exist."""
    bad = []
    test_names = {p.name for p in (root / "tests").rglob("test_*.py")}
    name = where.relative_to(root) if where.is_relative_to(root) else where
    for number, line in _prose_lines(text):
        for span in _BACKTICKS.findall(line):
            for word in _tokens(span):
                if _PATH.match(word) and not _exists(root, word):
                    bad.append(f"{name}:{number}: `{word}` does not exist")
                elif _TEST_FILE.match(word) and word not in test_names:
                    bad.append(f"{name}:{number}: `{word}` is no file under tests/")
        for target in _LINK.findall(line):
            if re.match(r"^[a-z]+:", target):  # http:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            linked = (where.parent / file_part).resolve() if file_part else where
            rel = linked.relative_to(root) if linked.is_relative_to(root) else None
            if file_part and (rel is None or not _exists(root, str(rel))):
                bad.append(f"{name}:{number}: link {target} names no file")
            elif anchor and linked.suffix == ".md" and linked.exists() and anchor not in anchors(linked):
                bad.append(f"{name}:{number}: link {target}: no heading #{anchor} in {rel}")
    return bad


def test_docs_name_files_that_exist():
    bad = [b for path in doc_files(REPO) for b in missing_paths(REPO, path.read_text(), path)]
    assert bad == [], "docs name paths that do not exist:\n  " + "\n  ".join(bad)


def test_the_checker_sees_paths():
    """Guards the patterns: the docs do name paths, and the checker reads them."""
    readme = (REPO / "README.md").read_text()
    text = "".join(p.read_text() for p in doc_files(REPO))
    assert len(set(re.findall(r"`(ps_daemon/[\w/]+\.py)`", text))) > 10
    assert "docs/benchmarks.md" in readme


def test_a_planted_missing_path_fails(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_here.py").write_text("")
    (tmp_path / "ps_daemon" / "store").mkdir(parents=True)
    (tmp_path / "ps_daemon" / "store" / "push.py").write_text("")
    (docs / "storage.md").write_text("# Storage\n\n## What committed means\n")
    page = docs / "map.md"
    text = (
        "The push is `ps_daemon/store/push.py` (there) and `ps_daemon/store/gone.py` (not).\n"
        "Run `python ps_daemon/store/missing.py --fast`; see `test_here.py` and `test_gone.py`.\n"
        "Placeholders pass: `ps_daemon/<x>/`, `bench/results/...`.\n"
        "```\nps_daemon/in_a_fence.py\n```\n"
        "[ok](storage.md#what-committed-means) [bad](storage.md#recovery) [gone](nowhere.md)\n"
    )
    page.write_text(text)
    bad = missing_paths(tmp_path, text, page)
    assert bad == [
        "docs/map.md:1: `ps_daemon/store/gone.py` does not exist",
        "docs/map.md:2: `ps_daemon/store/missing.py` does not exist",
        "docs/map.md:2: `test_gone.py` is no file under tests/",
        "docs/map.md:7: link storage.md#recovery: no heading #recovery in docs/storage.md",
        "docs/map.md:7: link nowhere.md names no file",
    ]


def test_slug_follows_github():
    assert slug("The config file") == "the-config-file"
    assert slug("Snapshots (`ps_daemon/store/snapshot_admin.py`)") == "snapshots-ps_daemonstoresnapshot_adminpy"
    assert slug("Pipeline stages x data-parallel replicas") == "pipeline-stages-x-data-parallel-replicas"
