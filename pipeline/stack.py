"""Where a running ``pipeline up`` stack is: ``<run-dir>/stack.json`` and the pointer to the latest.

``pipeline up`` writes ``<run-dir>/stack.json`` once every stage is ready (:func:`write_stack`)
and a pointer to it, ``$XDG_STATE_HOME/openclaw-pipeline/latest-stack.json`` (default
``~/.local/state/...``; :func:`pointer_path`), which it removes at a clean stop. Commands that
talk to the broker or to a stage (``tail``, ``archive``, ``replay``, ``judge``, ``trainer``
...: :data:`COMMANDS`; ``connect`` reads :func:`find_stack` itself) call :func:`resolve` when no broker address was given (no
``--bootstrap``, ``--config`` key, ``--set`` or ``PIPELINE_KAFKA__BOOTSTRAP_SERVERS``): it
finds the stack, says so in one line on stderr and returns the configuration with the stack's
addresses, or raises :class:`NoStack` at once (one line, no Kafka client retries) when no stack
runs and nothing listens at the default broker address. ``PIPELINE_STACK`` (a run directory or
a ``stack.json``) picks a stack instead of the pointer.

``stack.json`` (version 1)::

    {"version": 1, "run_dir": str, "pid": int,          # the `pipeline up` process
     "bootstrap": "host:port", "topics_prefix": str,
     "proxy_url": "http://host:port",                   # what clients use (the front of N proxies)
     "openai_base_url": "<proxy_url>/v1", "proxy_urls": {stage: url},
     "engine_url": str, "engine_urls": {stage: url}, "teacher_url": str | null,
     "dashboard_url": str | null, "metrics": {stage: url}, "config": "<run-dir>/config.yaml",
     "model": {"id": str, "context_window": int | null}}  # as the engine's /v1/models reports it
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

from pipeline.errors import PipelineError

STACK_FILE = "stack.json"
VERSION = 1

#: commands that talk to the broker or a stage -> whether this invocation does (offline modes don't)
COMMANDS: dict[str, Callable[[Any], bool]] = {
    "tail": lambda a: True, "archive": lambda a: True, "replay": lambda a: True, "import": lambda a: True,
    "judge": lambda a: not (getattr(a, "fit", False) or getattr(a, "eval", None)),
    "trainer": lambda a: True, "syncer": lambda a: True, "evaluator": lambda a: True, "retrain": lambda a: True, "adapters": lambda a: True,
    "dashboard": lambda a: not getattr(a, "run_dir", None),  # --run-dir: the run's own config and broker
    "simulate": lambda a: not getattr(a, "proxy_url", None),  # --proxy-url: talks to that proxy only
    "topics": lambda a: getattr(a, "action", None) != "render",
}


class NoStack(PipelineError, LookupError):
    """No running stack was found and no broker answers at the configured address."""


@dataclass(frozen=True)
class StackInfo:
    """A ``stack.json`` as read back: ``path`` is the file, ``data`` its content."""

    path: Path
    data: dict

    @property
    def run_dir(self) -> Path:
        return Path(self.data.get("run_dir") or self.path.parent)

    def describe(self) -> str:
        """``runs/X (broker 127.0.0.1:P, proxy http://127.0.0.1:Q)``: the one-line summary."""
        return (f"{self.run_dir} (broker {self.data.get('bootstrap')}, proxy {self.data.get('proxy_url')}, "
                f"model {(self.data.get('model') or {}).get('id')})")


def pointer_path() -> Path:
    """The pointer to the latest ``pipeline up``: ``$XDG_STATE_HOME/openclaw-pipeline/latest-stack.json``."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "openclaw-pipeline" / "latest-stack.json"


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def write_stack(run_dir: Path, data: dict) -> Path:
    """Write ``run_dir/stack.json`` (``data`` plus version, run_dir, pid) atomically; its path."""
    path = Path(run_dir) / STACK_FILE
    _write_json(path, {"version": VERSION, "run_dir": str(Path(run_dir).resolve()), "pid": os.getpid(), **data})
    return path


def write_pointer(stack_file: Path) -> Path:
    """Point :func:`pointer_path` at ``stack_file`` (the latest ``pipeline up``); the pointer's path."""
    path = pointer_path()
    _write_json(path, {"stack": str(Path(stack_file).resolve())})
    return path


def clear_pointer(stack_file: Path) -> None:
    """Remove the pointer if it still names ``stack_file`` (a later ``up`` may have replaced it)."""
    path = pointer_path()
    try:
        if json.loads(path.read_text()).get("stack") == str(Path(stack_file).resolve()):
            path.unlink()
    except (OSError, ValueError, AttributeError):
        pass


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not running
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def read_stack(where: str | os.PathLike) -> StackInfo | None:
    """The stack at ``where`` (a ``stack.json`` or its run directory); None if absent or unreadable."""
    path = Path(where)
    if path.is_dir():
        path = path / STACK_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("version") != VERSION or not data.get("bootstrap"):
        return None
    return StackInfo(path, data)


def find_stack() -> tuple[StackInfo | None, str]:
    """The running stack (``$PIPELINE_STACK``, else the pointer) and, when there is none, why."""
    chosen = os.environ.get("PIPELINE_STACK")
    if chosen:
        info = read_stack(chosen)
        if info is None:
            return None, f"PIPELINE_STACK={chosen} holds no {STACK_FILE}"
        return (info, "") if _alive(info.data.get("pid")) else (None, f"the stack of {info.run_dir} has stopped")
    try:
        target = json.loads(pointer_path().read_text()).get("stack")
    except (OSError, ValueError, AttributeError):
        return None, "no `pipeline up` is running"
    info = read_stack(target) if isinstance(target, str) else None
    if info is None:
        return None, f"the latest `pipeline up` left no readable {target}"
    if not _alive(info.data.get("pid")):
        return None, f"the latest stack, {info.run_dir}, has stopped"
    return info, ""


def stack_overrides(info: StackInfo, config) -> dict:
    """The config sections that point a command at ``info``'s services (values the user set win)."""
    d = info.data
    out: dict = {"kafka": {"bootstrap_servers": d["bootstrap"]}}
    if "prefix" not in config.topics.model_fields_set and d.get("topics_prefix") is not None:
        out["topics"] = {"prefix": d["topics_prefix"]}
    engine = {k: d[v] for k, v in (("url", "engine_url"), ("teacher_url", "teacher_url"))
              if d.get(v) and k not in config.engine.model_fields_set}
    if engine:
        out["engine"] = engine
    url = urlsplit(d.get("proxy_url") or "")
    if url.port and not ({"host", "port"} & config.proxy.model_fields_set):
        out["proxy"] = {"host": url.hostname, "port": url.port}
    if d.get("metrics") and "metrics_urls" not in config.dashboard.model_fields_set:
        out["dashboard"] = {"metrics_urls": dict(d["metrics"])}
    return out


def resolve(command: str, args, config):
    """``config`` pointed at the running stack when ``command`` needs one and no broker was given.

    Prints ``pipeline <command>: using the stack of ...`` on stderr when it finds one; the
    config unchanged when the user gave a broker address, or nothing runs but a broker answers
    at the configured default.

    Raises:
        NoStack: no stack runs and nothing answers at ``kafka.bootstrap_servers`` (the message
            is the one line to print).
    """
    wants = COMMANDS.get(command)
    if wants is None or not wants(args) or "bootstrap_servers" in config.kafka.model_fields_set:
        return config
    info, why = find_stack()
    if info is not None:
        print(f"pipeline {command}: using the stack of {info.describe()}", file=sys.stderr, flush=True)
        return config.replace(**stack_overrides(info, config))
    from pipeline.broker import kafka_answers

    if kafka_answers(config.kafka.bootstrap_servers, timeout_ms=1500):
        return config
    raise NoStack(f"no running stack ({why}) and no Kafka broker answers at {config.kafka.bootstrap_servers}: "
                  "start one with 'pipeline up', or give its address with --bootstrap HOST:PORT")
