"""The repository is self-contained: no code, test, doc or deploy file points at files that are
not in it (developers' notes, a reference folder, absolute paths of a development machine).

Facts the code relies on live in ``docs/environment.md`` and ``docs/sglang-api.md``; this test
keeps references to anything outside from coming back.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("pipeline", "tests", "bench", "docs", "deploy", ".ci", "README.md", "topics.yaml", "pyproject.toml")
SKIP_DIRS = {"__pycache__", ".venv", ".git", "node_modules", ".pytest_cache", "runs", "reports"}

# spelled in pieces so that this file does not match itself
FORBIDDEN = (
    "ENVIRONMENT" + ".md",
    "SGLANG" + "_API",
    "DESIGN" + ".md",
    "shared" + "/reference",
    "../" + "shared",
    "/work" + "/",
    "openclaw-rl" + "-method",
)


def _files():
    for root in ROOTS:
        p = REPO / root
        if p.is_file():
            yield p
            continue
        for dirpath, dirnames, filenames in os.walk(p):
            dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
            for name in filenames:
                yield Path(dirpath) / name


def find_outside_references(files, root: Path = REPO) -> list[str]:
    """``path:line: text`` for every line of a text file that names something outside the repo."""
    hits = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # images, binary data
        for n, line in enumerate(text.splitlines(), 1):
            if any(s in line for s in FORBIDDEN):
                hits.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    return hits


def test_nothing_points_outside_the_repository():
    files = list(_files())
    assert len(files) > 100  # the walk found the repository
    hits = find_outside_references(files)
    assert not hits, "references to files outside the repository:\n" + "\n".join(hits)


def test_the_check_finds_a_reference(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text('"""See ' + "../" + 'shared/notes for why."""\n')
    good = tmp_path / "y.py"
    good.write_text('"""See docs/environment.md §6."""\n')
    (tmp_path / "z.png").write_bytes(b"\x89PNG\xff\xfe" + b"../" + b"shared")
    hits = find_outside_references([bad, good, tmp_path / "z.png"], root=tmp_path)
    assert hits == ['x.py:1: """See ' + "../" + 'shared/notes for why."""']


def test_the_docs_cited_by_the_code_exist():
    for doc in ("docs/environment.md", "docs/sglang-api.md"):
        assert (REPO / doc).is_file(), doc
