"""``pipeline connect openclaw``: the provider block merged into OpenClaw's (JSON5) config with the
served model and its real context window, other settings kept, the old file backed up; refusals
in one line. The served model comes from a real engine's ``/v1/models`` (the tiny model)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.stack import write_stack

USER_CONFIG = """// my OpenClaw settings
{
  gateway: {port: 18789},  // keep me
  models: {providers: {other: {baseUrl: 'http://elsewhere/v1', api: 'openai-completions', models: []},
                       pipeline: {baseUrl: 'http://old/v1', headers: {'X-Session-Id': '${OC_RL_SESSION}'}}}},
  agents: {defaults: {timeoutSeconds: 600, model: {primary: 'other/x'}}},
}
"""


#: the conftest ``engine_url`` engine's settings: the tests check a served context window of 2048
ENGINE_SETTINGS = {"context_length": 2048}


@pytest.fixture
def oc_config(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "oc" / "openclaw.json"
    path.parent.mkdir()
    path.write_text(USER_CONFIG)
    monkeypatch.setenv("OPENCLAW_CONFIG_PATH", str(path))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))  # no pointer to any real stack
    monkeypatch.delenv("PIPELINE_STACK", raising=False)
    return path


def test_merges_provider_model_and_profile_keeping_the_rest(engine_url, oc_config, capsys):
    assert main(["connect", "openclaw", "--proxy-url", engine_url, "--context-window", "8192",
                 "--max-tokens", "32"]) == 0
    data = json.loads(oc_config.read_text())
    assert data["gateway"] == {"port": 18789}
    assert data["models"]["providers"]["other"]["baseUrl"] == "http://elsewhere/v1"
    block = data["models"]["providers"]["pipeline"]
    assert block["baseUrl"] == f"{engine_url}/v1" and block["api"] == "openai-completions"
    assert "headers" not in block  # the static-header workaround is gone
    assert block["models"][0]["id"] == "tiny-random"  # what the server reports, not a guess
    assert block["models"][0]["contextWindow"] == 8192 and block["models"][0]["maxTokens"] == 32
    defaults = data["agents"]["defaults"]
    assert defaults["timeoutSeconds"] == 600 and defaults["model"]["primary"] == "pipeline/tiny-random"
    assert defaults["contextInjection"] == "never" and defaults["skipBootstrap"] is True and defaults["skills"] == []
    assert data["tools"] == {"profile": "minimal"}
    backups = list(oc_config.parent.glob("openclaw.json.bak-*"))
    assert len(backups) == 1 and backups[0].read_text() == USER_CONFIG
    assert str(oc_config) in capsys.readouterr().out


def test_the_key_is_the_one_openclaw_sends(oc_config, capsys):
    """``--api-key`` (a tenant's key, say) is the provider's ``apiKey``; without it, the placeholder."""
    fixed = ["connect", "openclaw", "--proxy-url", "http://127.0.0.1:9/v1", "--model", "m", "--context-window", "8192"]
    assert main([*fixed, "--api-key", "k-alice"]) == 0
    assert json.loads(oc_config.read_text())["models"]["providers"]["pipeline"]["apiKey"] == "k-alice"
    assert main(fixed) == 0
    assert json.loads(oc_config.read_text())["models"]["providers"]["pipeline"]["apiKey"] == "pipeline"


def test_the_served_context_window_is_used_and_a_small_one_refused(engine_url, oc_config, capsys):
    assert main(["connect", "openclaw", "--proxy-url", f"{engine_url}/v1"]) == 1
    err = capsys.readouterr().err
    assert "2048 tokens" in err and "at least 4000" in err and len(err.strip().splitlines()) == 1
    assert oc_config.read_text() == USER_CONFIG  # nothing written


def test_the_stack_file_gives_the_proxy(engine_url, oc_config, tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    write_stack(run_dir, {"bootstrap": "127.0.0.1:1", "proxy_url": engine_url,
                          "model": {"id": "tiny-random", "context_window": 2048}})
    monkeypatch.setenv("PIPELINE_STACK", str(run_dir))
    assert main(["connect", "openclaw", "--no-prompt-profile", "--context-window", "4096"]) == 0
    data = json.loads(oc_config.read_text())
    assert data["models"]["providers"]["pipeline"]["baseUrl"] == f"{engine_url}/v1"
    assert "tools" not in data and "skills" not in data["agents"]["defaults"]
    assert "using the stack of" in capsys.readouterr().err


def test_no_stack_and_bad_files_are_one_line(oc_config, tmp_path, capsys):
    assert main(["connect", "openclaw"]) == 1
    err = capsys.readouterr().err.strip()
    assert "no running stack" in err and len(err.splitlines()) == 1
    oc_config.write_text("{models: [")
    assert main(["connect", "openclaw", "--proxy-url", "http://127.0.0.1:9", "--model", "m",
                 "--context-window", "8192"]) == 1
    err = capsys.readouterr().err.strip()
    assert "not valid JSON5" in err and len(err.splitlines()) == 1
    assert oc_config.read_text() == "{models: ["


def test_config_path_follows_openclaw_variables(tmp_path, monkeypatch):
    from pipeline.connect import openclaw_config_path

    for var in ("OPENCLAW_CONFIG_PATH", "OPENCLAW_STATE_DIR", "OPENCLAW_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert openclaw_config_path() == tmp_path / ".openclaw" / "openclaw.json"
    monkeypatch.setenv("OPENCLAW_HOME", str(tmp_path / "h"))
    assert openclaw_config_path() == tmp_path / "h" / ".openclaw" / "openclaw.json"
    monkeypatch.setenv("OPENCLAW_STATE_DIR", str(tmp_path / "s"))
    assert openclaw_config_path() == tmp_path / "s" / "openclaw.json"
    monkeypatch.setenv("OPENCLAW_CONFIG_PATH", str(tmp_path / "c.json"))
    assert openclaw_config_path() == tmp_path / "c.json"
    assert openclaw_config_path(str(tmp_path / "x.json")) == tmp_path / "x.json"
    assert os.environ["HOME"] == str(tmp_path)


def test_the_plugin_state_is_read_from_the_config(tmp_path):
    """Installed = a plugins.load.paths folder holding this plugin's manifest, not disabled."""
    from pipeline.connect import PLUGIN_DIR, PLUGIN_ID, plugin_state

    assert plugin_state({})[0] is False and "openclaw plugins install -l" in plugin_state({})[1]
    linked = {"plugins": {"load": {"paths": [str(PLUGIN_DIR)]}, "entries": {PLUGIN_ID: {"enabled": True}}}}
    ok, line = plugin_state(linked)
    assert ok and "installed" in line and "--local" in line
    other = tmp_path / "other"
    other.mkdir()
    (other / "openclaw.plugin.json").write_text(json.dumps({"id": "someone-else"}))
    assert plugin_state({"plugins": {"load": {"paths": [str(other)]}}})[0] is False
    off = {"plugins": {"load": {"paths": [str(PLUGIN_DIR)]}, "entries": {PLUGIN_ID: {"enabled": False}}}}
    assert plugin_state(off) == (False, plugin_state(off)[1]) and "disabled" in plugin_state(off)[1]
    assert plugin_state({"plugins": {"enabled": False, "load": {"paths": [str(PLUGIN_DIR)]}}})[0] is False


def test_the_check_tells_the_plugins_header_from_the_footer(kafka_config):
    """``plugin_check`` against the real proxy: a turn sent as the plugin sends it (header) is
    ``True``, one with only OpenClaw's footer ``False``; the check's session is ended."""
    import httpx

    from pipeline.connect import plugin_check
    from pipeline.testing.proxy import stack

    footer = "Runtime: agent=main | session=agent:main:main | sessionId={} | model=pipeline/m"

    def turn(with_header: bool):
        def send(sid: str) -> None:
            msgs = [{"role": "user", "content": "Reply with OK.\n\n" + footer.format(sid)}]
            headers = {"X-Session-Id": f"openclaw:{sid}"} if with_header else {}
            assert httpx.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": msgs}, headers=headers,
                              timeout=30).status_code == 200
        return send

    with stack(kafka_config) as (url, app, _up):
        active, line = plugin_check(url, "k", turn(True))
        assert active is True and "plugin is active" in line
        active, line = plugin_check(url, "k", turn(False))
        assert active is False and "footer" in line
        assert app.publisher.wait_idle(10)
    from pipeline.testing.topics import read_events

    ends = [e for e in read_events(kafka_config, "turns", 6, timeout_s=15) if e.TYPE == "session_end"]
    assert len(ends) == 2 and all(e.session_id.startswith("openclaw:pipeline-connect-check-") for e in ends)
