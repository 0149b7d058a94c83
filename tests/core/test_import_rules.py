"""Who may import whom in ``pipeline/``, read from the source (``ast``), every import counted:
at module level and inside functions.

**One home for the Kafka wire.** Only modules under ``pipeline/bus/`` import a Kafka client
library (``kafka``, ``confluent_kafka``, ``aiokafka``), by ``import``, ``from ... import``,
``__import__`` or ``importlib.import_module`` with a literal name. Every other module reads and
writes Kafka through :mod:`pipeline.bus`.

**Stages do not reach into each other.** A stage is one of :data:`STAGES` (a subpackage, or
``pipeline/syncer.py``). The rule:

1. A module of stage A imports nothing of stage B != A. What two stages both need lives on the
   floor (a root module such as ``pipeline/sampling.py`` or ``pipeline/votes.py``, a contract,
   or ``pipeline/bus/``), never in one of them.
2. Floor modules (root modules, ``pipeline/bus/``, ``pipeline/data/`` ...) import no stage.
3. Launchers start stages, so they may import any stage, at module level or lazily inside
   the function that starts it: ``pipeline/orchestrate/`` (``pipeline up``, ``demo``),
   ``pipeline/testing/`` (runs stages in-process for the tests), ``pipeline/cli.py`` and
   ``pipeline/__main__.py``.
4. A command module (one that ``pipeline/cli.py`` registers, e.g. ``pipeline.dashboard.cli`` or
   ``pipeline.history.retrain``) may also use the launcher, ``pipeline.orchestrate``, to start
   what it needs (the dashboard's command starts a run's broker, ``retrain`` starts a judge and a
   trainer under a supervisor), and nothing else of another stage.

Function-local imports that only defer the cost of a heavy library (torch, transformers) inside
one stage are not affected: they cross no boundary.
"""

from __future__ import annotations

import ast
from pathlib import Path

from pipeline.cli import COMMANDS

PIPELINE = Path(__file__).resolve().parents[2] / "pipeline"
KAFKA_CLIENTS = {"kafka", "confluent_kafka", "aiokafka"}
STAGES = {"proxy", "engine", "judge", "trainer", "syncer", "history", "simulate", "orchestrate", "dashboard", "evaluator"}
LAUNCHERS = ("pipeline.orchestrate", "pipeline.testing", "pipeline.cli", "pipeline.__main__")
COMMAND_MODULES = {module for module, _help in COMMANDS.values()}
# imports that break the rules knowingly (none)
KNOWN: set[tuple[str, str]] = set()


def _module_name(path: Path, root: Path = PIPELINE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(source: str, module: str) -> list[tuple[int, str]]:
    """``(line, module)`` for every module ``source`` imports (``from m import a`` gives ``m`` and
    ``m.a``; relative imports resolved against ``module``; literal ``__import__``/``import_module``)."""
    out = []
    package = module.split(".")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level] + ([base] if base else []))
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names if a.name != "*"]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in ("__import__", "import_module"):
                out.append((node.lineno, node.args[0].value))
    return out


def _stage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "pipeline" and parts[1] in STAGES else None


def _within(module: str, packages) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def kafka_outside_bus(sources: dict[str, str]) -> list[str]:
    """``module:line: imported`` for every Kafka client import outside ``pipeline.bus``."""
    hits = []
    for module, source in sources.items():
        if _within(module, ["pipeline.bus"]):
            continue
        for line, name in imported_modules(source, module):
            if name.split(".")[0] in KAFKA_CLIENTS:
                hits.append(f"{module}:{line}: {name.split('.')[0]}")
    return sorted(set(hits))


def stage_crossings(sources: dict[str, str]) -> list[str]:
    """``module:line: imported`` for every import that breaks the rule of the module docstring."""
    hits = []
    for module, source in sources.items():
        if _within(module, LAUNCHERS):
            continue
        own = _stage(module)
        for line, name in imported_modules(source, module):
            target = _stage(name)
            if target is None or target == own or any(module == m and _within(name, [t]) for m, t in KNOWN):
                continue
            if module in COMMAND_MODULES and target == "orchestrate":
                continue
            hits.append(f"{module}:{line}: {name}")
    return sorted(set(hits))


def _sources() -> dict[str, str]:
    return {_module_name(p): p.read_text(encoding="utf-8") for p in sorted(PIPELINE.rglob("*.py"))}


def test_only_the_bus_imports_a_kafka_client():
    sources = _sources()
    assert "pipeline.bus.window_producer" in sources and len(sources) > 100  # the walk found the package
    hits = kafka_outside_bus(sources)
    assert not hits, "Kafka client imports outside pipeline/bus/:\n" + "\n".join(hits)


def test_no_import_crosses_a_stage_boundary():
    hits = stage_crossings(_sources())
    assert not hits, "imports from one stage into another (or from the floor into a stage):\n" + "\n".join(hits)


def test_the_checks_find_each_kind_of_violation():
    lazy = "def f():\n    from pipeline.engine.model import generation_defaults\n"
    assert stage_crossings({"pipeline.proxy.app": lazy}) == ["pipeline.proxy.app:2: pipeline.engine.model",
                                                              "pipeline.proxy.app:2: pipeline.engine.model.generation_defaults"]
    assert stage_crossings({"pipeline.sampling": "import pipeline.judge.parse\n"}) == \
        ["pipeline.sampling:1: pipeline.judge.parse"]  # the floor importing a stage
    assert stage_crossings({"pipeline.judge.x": "from pipeline.judge import parse\nimport torch\n"}) == []
    assert stage_crossings({"pipeline.orchestrate.demo": lazy}) == []  # a launcher
    assert stage_crossings({"pipeline.dashboard.cli": "def f():\n    from pipeline.orchestrate.up import x\n"}) == []
    assert stage_crossings({"pipeline.dashboard.views": "def f():\n    from pipeline.orchestrate.up import x\n"})
    assert stage_crossings({"pipeline.dashboard.cli": "def f():\n    from pipeline.judge import parse\n"})
    assert stage_crossings({"pipeline.history.replay": "from ..judge import parse\n"}) == \
        ["pipeline.history.replay:1: pipeline.judge", "pipeline.history.replay:1: pipeline.judge.parse"]
    for src in ("import kafka\n", "def f():\n    from confluent_kafka import Producer\n",
                "import importlib\nimportlib.import_module('kafka.admin')\n", "__import__('aiokafka')\n"):
        assert len(kafka_outside_bus({"pipeline.proxy.publisher": src})) == 1, src
        assert kafka_outside_bus({"pipeline.bus.window_producer": src}) == []
    assert kafka_outside_bus({"pipeline.proxy.app": "import kafka_broker_tools\n"}) == []
