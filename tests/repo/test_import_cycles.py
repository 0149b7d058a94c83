"""No import circle in ``pipeline/``: the graph of which module imports which, read from the
source (``ast``) with every import counted — at module level, inside functions, and under
``if TYPE_CHECKING:`` — has no cycle.

An edge ``a -> b`` is an ``import b`` / ``from b import x`` in ``a`` (relative imports resolved;
``from package import submodule`` is an edge to the submodule, not to the package's
``__init__``, which Python has already run as the parent of every module under it). What two
modules both need goes into a lower module that imports neither (e.g. ``pipeline/local_broker.py``
under ``broker.py`` and ``kafka_broker.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

PIPELINE = Path(__file__).resolve().parents[2] / "pipeline"


def module_name(path: Path, root: Path = PIPELINE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``source`` (the module ``module``) imports, anywhere in it."""
    out: set[str] = set()
    package = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package[: len(package) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in known else base)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in ("__import__", "import_module"):
                out.add(node.args[0].value)
    return {m for m in out if m in known and m != module}


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """``module -> modules it imports`` for ``sources`` (``module -> (source, is_package)``)."""
    known = set(sources)
    return {m: imports_of(src, m, pkg, known) for m, (src, pkg) in sources.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (each one holds a circle),
    found with Tarjan's algorithm, iteratively; each sorted, the list sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return sorted(found)


def package_sources() -> dict[str, tuple[str, bool]]:
    return {module_name(p): (p.read_text(encoding="utf-8"), p.name == "__init__.py")
            for p in sorted(PIPELINE.rglob("*.py"))}


def test_pipeline_has_no_import_circle():
    sources = package_sources()
    assert "pipeline.local_broker" in sources and len(sources) > 100  # the walk found the package
    graph = import_graph(sources)
    assert "pipeline.local_broker" in graph["pipeline.kafka_broker"]  # edges were read
    found = cycles(graph)
    assert not found, "import circles in pipeline/ (move what both sides need into a lower module):\n" + \
        "\n".join(" <-> ".join(c) for c in found)


def _graph(modules: dict[str, str]) -> dict[str, set[str]]:
    return import_graph({m: (src, m in ("pipeline", "pipeline.pkg")) for m, src in modules.items()})


def test_the_check_finds_each_kind_of_circle():
    lazy = {"pipeline.a": "from pipeline.b import x\n", "pipeline.b": "def f():\n    from pipeline import a\n",
            "pipeline": ""}
    assert cycles(_graph(lazy)) == [["pipeline.a", "pipeline.b"]]  # function-local import
    typing_only = {"pipeline.a": "import pipeline.b\n",
                   "pipeline.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pipeline.a import A\n"}
    assert cycles(_graph(typing_only)) == [["pipeline.a", "pipeline.b"]]
    three = {"pipeline.a": "from .b import x\n", "pipeline.b": "from .c import y\n", "pipeline.c": "from . import a\n",
             "pipeline": ""}
    assert cycles(_graph(three)) == [["pipeline.a", "pipeline.b", "pipeline.c"]]  # relative, three long
    dynamic = {"pipeline.a": "import importlib\nimportlib.import_module('pipeline.b')\n", "pipeline.b": "import pipeline.a\n"}
    assert cycles(_graph(dynamic)) == [["pipeline.a", "pipeline.b"]]
    package = {"pipeline.pkg": "def __getattr__(n):\n    from pipeline.pkg.app import App\n",
               "pipeline.pkg.app": "from pipeline.pkg import metrics\n", "pipeline.pkg.metrics": "X = 1\n"}
    assert cycles(_graph(package)) == []  # `from pkg import submodule` is an edge to the submodule
    package["pipeline.pkg.app"] = "from pipeline.pkg import helper\n"  # a name defined in the package
    assert cycles(_graph(package)) == [["pipeline.pkg", "pipeline.pkg.app"]]
    lower = {"pipeline.a": "from pipeline.shared import x\ndef f():\n    import pipeline.b\n",
             "pipeline.b": "from pipeline.shared import x\n", "pipeline.shared": "x = 1\n"}
    assert cycles(_graph(lower)) == []
