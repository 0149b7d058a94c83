"""Configuration that explains itself: every setting has a description and (where numeric) a
range, ``pipeline config show --explain`` prints them, bad combinations are refused when the
configuration is loaded (not inside the first training step), and a loaded configuration is
frozen (a changed copy comes from :meth:`Config.replace`, validated again)."""

from __future__ import annotations

import subprocess
import sys

import pydantic
import pytest

from pipeline.config import Config, ConfigError, explain, load_config


def _fields():
    for name, field in Config.model_fields.items():
        sub = getattr(field.annotation, "model_fields", None)
        yield name, field
        for key, f in (sub or {}).items():
            yield f"{name}.{key}", f


def test_every_setting_has_a_description():
    missing = [key for key, f in _fields() if not (f.description or "").strip()]
    assert not missing, f"settings without a description: {missing}"


def test_numeric_settings_have_ranges():
    free = []
    for key, f in _fields():
        ann = str(f.annotation)
        if ("int" in ann or "float" in ann) and "Literal" not in ann and "dict" not in ann and "list" not in ann:
            if not any(getattr(m, a, None) is not None for m in f.metadata for a in ("ge", "gt", "le", "lt")):
                free.append(key)
    # seeds take any integer
    assert free == ["engine.seed", "trainer.seed"], free


def test_explain_lists_every_setting_with_value_meaning_and_range():
    rows = {k: (v, d, r) for k, v, d, r in explain(load_config(None, trainer={"lr": 5e-5}))}
    assert len(rows) == sum(1 for key, f in _fields() if "." in key) + 2  # + log_level, metrics_port
    assert rows["trainer.lr"] == (5e-5, "learning rate", "0 < x <= 1")
    assert rows["trainer.kl_type"][2] == "one of k1|k2|k3|low_var_kl"
    assert rows["kafka.session_timeout_ms"][2] == "100 <= x <= 3600000"


def test_config_show_explain_prints_meaning_and_masks_secrets(monkeypatch):
    env = {"PIPELINE_KAFKA__SASL_PLAIN_PASSWORD": "hunter2", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "pipeline", "config", "show", "--explain", "--set", "judge.votes=5"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = {ln.split(" = ", 1)[0]: ln for ln in out.stdout.splitlines() if " = " in ln}
    assert lines["judge.votes"].startswith("judge.votes = 5    # PRM votes per turn (majority decides) (1 <= x <= 64)")
    assert "hunter2" not in out.stdout and "**" in lines["kafka.sasl_plain_password"]
    assert len(lines) == len(explain(load_config(None)))


@pytest.mark.parametrize("sections,needle", [
    ({"trainer": {"w_rl": 0, "w_opd": 0}}, "w_rl and w_opd are both 0"),
    ({"trainer": {"eps_clip_c": 1.0}}, "trainer.eps_clip_c: Input should be greater than 1"),
    ({"trainer": {"tis_cap": 1.0, "tis_floor": 1.5, "old_log_probs": "recompute"}}, "tis_floor (1.5) must be below tis_cap (1.0)"),
    ({"trainer": {"stale_policy": "downweight", "max_staleness": None}}, "stale_policy=downweight needs max_staleness"),
    ({"judge": {"idle_timeout_s": 28800}}, "judge.idle_timeout_s (28800) is above proxy.session_idle_s (14400)"),
    ({"proxy": {"session_idle_s": 60}}, "judge.idle_timeout_s (14400) is above proxy.session_idle_s (60)"),
    ({"kafka": {"session_timeout_ms": 6000, "heartbeat_interval_ms": 6000}}, "heartbeat_interval_ms (6000) must be below"),
    ({"judge": {"fetch_max_wait_ms": 30000}}, "judge.fetch_max_wait_ms (30000) must be below kafka.request_timeout_ms (30000)"),
    ({"kafka": {"security_protocol": "SASL_SSL"}}, "needs sasl_mechanism"),
    ({"trainer": {"keep_exports": 0}}, "trainer.keep_exports: Input should be greater than or equal to 1"),
    ({"trainer": {"eps_clip": 1.5}}, "trainer.eps_clip: Input should be less than 1"),
    ({"log_level": "LOUD"}, "log_level: Input should be"),
    ({"rollout": {"enabled": True}}, "set rollout.eval_set (its guards, or rollout.guards, must not fall)"),
    ({"rollout": {"enabled": True, "guards": ["accuracy"]}}, "eval_set=None"),
])
def test_bad_combinations_are_refused_at_load_with_the_keys_named(sections, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, **sections)
    assert needle in str(e.value)


def test_a_bad_combination_on_the_command_line_is_a_clear_error_not_a_traceback():
    out = subprocess.run([sys.executable, "-m", "pipeline", "trainer", "--set", "trainer.w_rl=0",
                          "--set", "trainer.w_opd=0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "configuration error" in out.stderr and "w_rl and w_opd are both 0" in out.stderr


def test_loaded_config_is_frozen_and_replace_gives_a_validated_copy():
    c = load_config(None)
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        c.trainer.lr = 1.0
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        c.judge = c.judge
    d = c.replace(trainer={"lr": 5e-5}, judge={"votes": 5})
    assert (d.trainer.lr, d.judge.votes, d.trainer.rollout_batch_size) == (5e-5, 5, c.trainer.rollout_batch_size)
    assert (c.trainer.lr, c.judge.votes) == (1e-6, 3)  # the original is unchanged
    with pytest.raises(ConfigError, match="w_rl and w_opd are both 0"):
        c.replace(trainer={"w_rl": 0, "w_opd": 0})
    with pytest.raises(ConfigError, match="judge.idle_timeout_s"):
        c.replace(proxy={"session_idle_s": 10})


def test_replace_keeps_secrets(monkeypatch):
    monkeypatch.setenv("PIPELINE_PROXY__API_KEYS", '["k1"]')
    c = load_config(None).replace(proxy={"port": 9})
    assert [k.get_secret_value() for k in c.proxy.api_keys] == ["k1"] and c.proxy.port == 9


def test_a_config_file_with_full_weight_rollout_needs_the_eval_set_gate(tmp_path):
    """Full weights (no trainer.lora) on one engine are gated by the eval set alone (docs/rollout.md):
    a config file that turns rollout on without an eval set is refused at load; with one (its
    guards are the evaluator's to check), or with tenants' adapters, it loads."""
    path = tmp_path / "stack.yaml"
    path.write_text("rollout:\n  enabled: true\n")
    with pytest.raises(ConfigError, match="rollout.enabled with full weights"):
        load_config(path)
    path.write_text("rollout:\n  enabled: true\n  eval_set: team.jsonl\n  guards: [accuracy]\n")
    assert load_config(path).rollout.guards == ["accuracy"]
    path.write_text("rollout:\n  enabled: true\n  eval_set: team.jsonl\n")  # the eval set's own guards
    assert load_config(path).rollout.eval_set == "team.jsonl"
    path.write_text("rollout:\n  enabled: true\ntrainer:\n  per_tenant: true\n  lora: {rank: 8}\n")
    assert load_config(path).trainer.lora.rank == 8
