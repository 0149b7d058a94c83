"""``pipeline connect openclaw``: point the user's OpenClaw at the running stack's proxy.

Writes (or merges into) OpenClaw's config file — ``--openclaw-config``, else
``$OPENCLAW_CONFIG_PATH``, else ``$OPENCLAW_STATE_DIR/openclaw.json``, else
``$OPENCLAW_HOME`` or ``~`` + ``/.openclaw/openclaw.json`` — what OpenClaw needs to use the proxy
as a custom OpenAI-compatible provider (see docs/openclaw.md):

- ``models.providers.<provider>`` (default ``pipeline``): ``baseUrl`` ``<proxy>/v1``, ``api``
  ``openai-completions``, the served model with its real context window (``max_model_len`` of the
  proxy's ``/v1/models``; OpenClaw refuses a window below 4,000 tokens) and ``maxTokens``;
- ``agents.defaults.model.primary`` = ``<provider>/<model id>``;
- the small-model prompt profile (unless ``--no-prompt-profile``): ``tools.profile: minimal``,
  ``agents.defaults.contextInjection: never``, ``skipBootstrap: true``, ``skills: []`` — OpenClaw's
  default request is ~12.9k prompt tokens, this profile ~3.2k.

It then says whether the plugin of ``integrations/openclaw`` is installed for this config
(:func:`plugin_state`: linked in ``plugins.load.paths`` and not disabled); every ``openclaw agent
--local`` command loads it at start (OpenClaw's "Saved for the next Gateway start" concerns a
running Gateway only). ``--check`` proves it: one real OpenClaw turn in a fresh session, and the
proxy's ``pipeline_proxy_session_source_total`` says whether the session id came from the
plugin's header or from OpenClaw's prompt footer (:func:`plugin_check`).

Every other setting of the file is kept. The file may be JSON5 (comments, unquoted keys): it is
read with ``json5`` and written back as JSON (comments are not kept), after a copy of the old
file is saved as ``<file>.bak-<first 12 hex of its sha256>`` (same content, same name).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Callable

import httpx
from pipeline.errors import PipelineError

HELP = "write the running stack's proxy into an agent's config (openclaw)"
MIN_CONTEXT = 4000  # OpenClaw refuses a model whose contextWindow is smaller
PLUGIN_DIR = Path(__file__).resolve().parent.parent / "integrations" / "openclaw"
PLUGIN_ID = "openclaw-pipeline-rl"
CHECK_TIMEOUT_S = 900  # one OpenClaw turn: seconds on a GPU, minutes with SmolLM2 on a busy CPU


class ConnectError(PipelineError, RuntimeError):
    """Nothing to connect to, or the OpenClaw config cannot be read or written (one line)."""


def add_arguments(parser) -> None:
    parser.add_argument("agent", choices=["openclaw"], help="the agent whose config is written")
    parser.add_argument("--openclaw-config", metavar="FILE", help="OpenClaw's config file (default: "
                        "$OPENCLAW_CONFIG_PATH, else ~/.openclaw/openclaw.json)")
    parser.add_argument("--proxy-url", help="the proxy (default: the running stack's, from its stack.json)")
    parser.add_argument("--model", help="model id to configure (default: the one the proxy serves)")
    parser.add_argument("--context-window", type=int, help="tokens (default: the served model's max_model_len)")
    parser.add_argument("--max-tokens", type=int, default=128, help="longest reply OpenClaw asks for (default 128)")
    parser.add_argument("--provider", default="pipeline", help="provider id in OpenClaw's config (default pipeline)")
    parser.add_argument("--api-key", default="pipeline", help="bearer key OpenClaw sends, when the proxy has "
                        "keys: one of proxy.api_keys (no tenant) or a tenant's key (proxy.tenants: "
                        "docs/tenants.md); default: a placeholder")
    parser.add_argument("--no-prompt-profile", action="store_true",
                        help="keep OpenClaw's own prompt settings (tools, skills, bootstrap, context injection)")
    parser.add_argument("--dry-run", action="store_true", help="print the merged config instead of writing it")
    parser.add_argument("--check", action="store_true",
                        help="then send one OpenClaw turn (openclaw agent --local, a fresh session, ended at once) "
                             "and report whether the proxy saw the plugin's session header")


def openclaw_config_path(explicit: str | None = None) -> Path:
    """Where OpenClaw reads its config (the precedence of its own path variables)."""
    if explicit:
        return Path(explicit).expanduser()
    if os.environ.get("OPENCLAW_CONFIG_PATH", "").strip():
        return Path(os.environ["OPENCLAW_CONFIG_PATH"].strip()).expanduser()
    if os.environ.get("OPENCLAW_STATE_DIR", "").strip():
        return Path(os.environ["OPENCLAW_STATE_DIR"].strip()).expanduser() / "openclaw.json"
    home = os.environ.get("OPENCLAW_HOME", "").strip()
    home = home if home not in ("", "undefined", "null") else os.path.expanduser("~")
    return Path(home).expanduser() / ".openclaw" / "openclaw.json"


def served_model(proxy_url: str, api_key: str, fallback: dict) -> tuple[str, int | None]:
    """(model id, context window) from the proxy's ``/v1/models``; ``fallback`` (stack.json's
    ``model``) when the proxy does not answer or does not say."""
    try:
        r = httpx.get(f"{proxy_url}/v1/models", headers={"Authorization": f"Bearer {api_key}"}, timeout=10.0)
        card = r.json()["data"][0]
        window = card.get("max_model_len")
        return str(card["id"]), window if isinstance(window, int) else fallback.get("context_window")
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        if fallback.get("id"):
            return str(fallback["id"]), fallback.get("context_window")
        raise ConnectError(f"the proxy at {proxy_url} does not answer GET /v1/models") from None


def provider_block(proxy_url: str, model_id: str, context_window: int, max_tokens: int, api_key: str) -> dict:
    """OpenClaw's ``models.providers.<id>`` entry for the proxy (a custom OpenAI-compatible provider)."""
    return {"baseUrl": f"{proxy_url.rstrip('/')}/v1", "apiKey": api_key, "api": "openai-completions",
            "timeoutSeconds": 900,
            "models": [{"id": model_id, "name": f"{model_id} (openclaw-pipeline)", "reasoning": False,
                        "input": ["text"], "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
                        "contextWindow": context_window, "maxTokens": max_tokens}]}


def merge(config: dict, provider: str, block: dict, model_id: str, prompt_profile: bool) -> dict:
    """``config`` with the provider, the primary model and (optionally) the prompt profile set;
    every other key kept. A new dict (``config`` is not changed).

    Raises:
        ConnectError: a section that must be an object is something else.
    """
    out = json.loads(json.dumps(config))

    def obj(parent: dict, key: str, where: str) -> dict:
        node = parent.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConnectError(f"{where} in the OpenClaw config is {type(node).__name__}, not an object")
        return node

    models = obj(out, "models", "models")
    obj(models, "providers", "models.providers")[provider] = block
    agents = obj(out, "agents", "agents")
    defaults = obj(agents, "defaults", "agents.defaults")
    obj(defaults, "model", "agents.defaults.model")["primary"] = f"{provider}/{model_id}"
    if prompt_profile:
        defaults.update(contextInjection="never", skipBootstrap=True, skills=[])
        obj(out, "tools", "tools")["profile"] = "minimal"
    return out


def read_config(path: Path) -> tuple[dict, str | None]:
    """(parsed config, raw text) of ``path``; ``({}, None)`` when there is no file yet.

    Raises:
        ConnectError: unreadable, not JSON5, or not an object at the top level.
    """
    import json5

    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}, None
    except OSError as e:
        raise ConnectError(f"cannot read {path}: {e}") from None
    try:
        data = json5.loads(text) if text.strip() else {}
    except ValueError as e:
        raise ConnectError(f"{path} is not valid JSON5 ({e}); fix it or pass --openclaw-config") from None
    if not isinstance(data, dict):
        raise ConnectError(f"{path} must hold an object at the top level")
    return data, text


def write_config(path: Path, data: dict, old_text: str | None) -> Path | None:
    """Back up ``old_text`` (content-named), then write ``data`` atomically; the backup's path."""
    backup = None
    path.parent.mkdir(parents=True, exist_ok=True)
    if old_text is not None:
        backup = path.with_name(f"{path.name}.bak-{hashlib.sha256(old_text.encode()).hexdigest()[:12]}")
        if not backup.exists():
            backup.write_text(old_text)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
    return backup


def plugin_state(config: dict) -> tuple[bool, str]:
    """``(installed, one line)``: whether ``config`` links this repository's plugin (a
    ``plugins.load.paths`` entry holding ``openclaw.plugin.json`` with id :data:`PLUGIN_ID`) and
    does not disable it (``plugins.enabled``, ``plugins.entries.<id>.enabled``)."""
    plugins = config.get("plugins") if isinstance(config.get("plugins"), dict) else {}
    paths = (plugins.get("load") or {}).get("paths") if isinstance(plugins.get("load"), dict) else None
    linked = [p for p in paths or [] if isinstance(p, str) and _is_plugin_dir(Path(p).expanduser())]
    entry = (plugins.get("entries") or {}).get(PLUGIN_ID) if isinstance(plugins.get("entries"), dict) else None
    disabled = plugins.get("enabled") is False or (isinstance(entry, dict) and entry.get("enabled") is False)
    if linked and not disabled:
        return True, (f"plugin {PLUGIN_ID}: installed ({linked[0]}); every `openclaw agent --local` command loads "
                      "it (OpenClaw's 'Saved for the next Gateway start' is about a running Gateway); "
                      "`pipeline connect openclaw --check` proves it with one turn")
    if linked:
        return False, f"plugin {PLUGIN_ID}: linked but disabled in this config (plugins.entries.{PLUGIN_ID}.enabled)"
    return False, (f"plugin {PLUGIN_ID}: not installed (optional; the proxy reads OpenClaw's session footer "
                   f"without it): openclaw plugins install -l {PLUGIN_DIR} --force --accept-capabilities")


def _is_plugin_dir(path: Path) -> bool:
    try:
        return json.loads((path / "openclaw.plugin.json").read_text()).get("id") == PLUGIN_ID
    except (OSError, ValueError, AttributeError):
        return False


def session_sources(proxy_url: str, api_key: str) -> dict[str, float]:
    """The proxy's ``pipeline_proxy_session_source_total`` by ``source`` (empty when unreadable)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{proxy_url}/metrics", headers={"Authorization": f"Bearer {api_key}"}, timeout=10.0).text
        return {s.labels.get("source", ""): s.value for fam in text_string_to_metric_families(text)
                for s in fam.samples if s.name == "pipeline_proxy_session_source_total"}
    except (httpx.HTTPError, ValueError):
        return {}


def plugin_check(proxy_url: str, api_key: str, turn: Callable[[str], None]) -> tuple[bool | None, str]:
    """Run ``turn(session_id)`` (one OpenClaw turn in a fresh session) and tell from the proxy's
    session-source counters whether its request carried the plugin's header: ``(True, line)``
    (``header``), ``(False, line)`` (OpenClaw's footer, ``marker:openclaw``), ``(None, line)``
    (neither moved: another client's traffic in between, or the proxy's metrics unreadable).
    The session is ended at the proxy afterwards (one turn with no next state: never trained)."""
    sid = f"pipeline-connect-check-{os.urandom(4).hex()}"
    before = session_sources(proxy_url, api_key)
    turn(sid)
    after = session_sources(proxy_url, api_key)
    httpx.post(f"{proxy_url}/v1/sessions/openclaw:{sid}/end", headers={"Authorization": f"Bearer {api_key}"},
               timeout=10.0)
    moved = {k: after.get(k, 0) - before.get(k, 0) for k in ("header", "marker:openclaw")}
    if moved["header"] > 0 and moved["marker:openclaw"] == 0:
        return True, f"check: the proxy saw the plugin's X-Session-Id (session openclaw:{sid}): the plugin is active"
    if moved["marker:openclaw"] > 0 and moved["header"] == 0:
        return False, (f"check: the proxy took session openclaw:{sid} from OpenClaw's prompt footer, not from the "
                       "plugin's header: the plugin is not active for this OpenClaw config")
    return None, f"check: inconclusive (session-source counters moved {moved}; other traffic, or no metrics)"


def _openclaw_turn(config_path: Path) -> Callable[[str], None]:
    """One ``openclaw agent --local`` turn against the config at ``config_path``."""
    import shutil
    import subprocess

    exe = shutil.which("openclaw")
    if exe is None:
        raise ConnectError("--check needs the openclaw command on PATH (deploy/install.sh puts it in .venv/bin)")

    def turn(session_id: str) -> None:
        env = {**os.environ, "OPENCLAW_CONFIG_PATH": str(config_path)}
        out = subprocess.run([exe, "agent", "--local", "--session-id", session_id, "-m", "Reply with OK.", "--json"],
                             env=env, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
        if out.returncode != 0:
            raise ConnectError(f"--check: openclaw agent exited with {out.returncode}: {out.stderr.strip()[-300:]}")
    return turn


def _target(args) -> tuple[str, dict]:
    """(proxy URL, stack.json's model) from the flags or the running stack."""
    from pipeline.stack import find_stack

    if args.proxy_url:
        return args.proxy_url.rstrip("/").removesuffix("/v1"), {}
    info, why = find_stack()
    if info is None:
        raise ConnectError(f"no running stack ({why}): start one with 'pipeline up --proxy-port 8000', "
                           "or pass --proxy-url")
    print(f"pipeline connect: using the stack of {info.describe()}", file=sys.stderr)
    return str(info.data["proxy_url"]), dict(info.data.get("model") or {})


def connect(args) -> int:
    """The work of ``pipeline connect openclaw`` (raises :class:`ConnectError` with its one line)."""
    path = openclaw_config_path(args.openclaw_config)
    data, old = read_config(path)
    proxy_url, fallback = _target(args)
    model_id, window = args.model, args.context_window
    if not (model_id and window):
        served_id, served_window = served_model(proxy_url, args.api_key, fallback)
        model_id, window = model_id or served_id, window or served_window
    if not window or window < MIN_CONTEXT:
        raise ConnectError(f"the served model's context is {window} tokens; OpenClaw needs at least {MIN_CONTEXT} "
                           "and sends ~3k prompt tokens a turn: serve a model with a longer window (`pipeline up` "
                           "with the default smollm2-135m: 8192; engine.context_length cannot exceed the model's "
                           "own maximum, 2048 for tiny-random); --context-window only if the proxy under-reports it")
    block = provider_block(proxy_url, model_id, window, args.max_tokens, args.api_key)
    merged = merge(data, args.provider, block, model_id, not args.no_prompt_profile)
    if args.dry_run:
        print(json.dumps(merged, indent=2))
        return 0
    backup = write_config(path, merged, old)
    print(f"OpenClaw config {path}: provider {args.provider!r} -> {block['baseUrl']}, model "
          f"{args.provider}/{model_id} (context {window}, replies <= {args.max_tokens} tokens)"
          + ("" if args.no_prompt_profile else ", small-model prompt profile")
          + (f"; previous file saved as {backup}" if backup else ""))
    installed, line = plugin_state(merged)
    print(line)
    if args.check:
        print(f"check: one OpenClaw turn through {proxy_url} (up to {CHECK_TIMEOUT_S // 60} minutes on a CPU) ...",
              flush=True)
        active, line = plugin_check(proxy_url, args.api_key, _openclaw_turn(path))
        print(line)
        if active is False and installed:
            return 1
    print("try it: openclaw agent --local --session-id demo -m 'Hello'")
    return 0


def run(args, config) -> int:
    try:
        return connect(args)
    except ConnectError as e:
        print(f"pipeline connect: {e}", file=sys.stderr)
        return 1
