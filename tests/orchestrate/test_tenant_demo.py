"""``pipeline demo --tenants`` / ``--shared``: configuration and report files (no stack started)."""

from __future__ import annotations

import argparse
import json

import pytest

from pipeline.config import load_config
from pipeline.orchestrate import demo
from pipeline.orchestrate.tenant_demo import two_user_config, write_two_user_report
from pipeline.orchestrate.tenant_report import curves, tenant_verdicts
from pipeline.orchestrate.up import serving_lora


def _args(*argv: str):
    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    return p.parse_args(list(argv))


def test_tenants_config_trains_one_adapter_per_tenant_and_serves_adapters(tmp_path):
    cfg = two_user_config(load_config(None), _args("--tenants", "--steps", "2"), tmp_path)
    assert serving_lora(cfg).engine.enable_lora and cfg.trainer.per_tenant  # the stack's engine serves adapters
    assert (cfg.trainer.lora.rank, cfg.trainer.lora.alpha) == (16, 32)
    # no max_steps: it counts batches of any tenant, and one tenant's batches could take them all
    assert cfg.trainer.lr == 3e-4 and cfg.trainer.max_steps is None
    assert cfg.trainer.export_dir == str(tmp_path / "weights")


def test_shared_config_is_one_full_weight_policy(tmp_path):
    cfg = two_user_config(load_config(None), _args("--shared", "--steps", "3"), tmp_path)
    assert cfg.trainer.lora is None and not cfg.trainer.per_tenant and not cfg.engine.enable_lora
    assert cfg.trainer.lr == 5e-5 and cfg.trainer.max_steps == 6


def test_tenants_and_shared_are_exclusive():
    with pytest.raises(SystemExit):
        _args("--tenants", "--shared")


def test_report_files_and_table(tmp_path, capsys):
    evs = [{"target": "base", "version": "0", "n": 64, "brief_rate": 4 / 64, "stepwise_rate": 9 / 64},
           {"target": "alice", "version": "alice@00ff", "n": 64, "brief_rate": 30 / 64, "stepwise_rate": 7 / 64},
           {"target": "bob", "version": "bob@11ee", "n": 64, "brief_rate": 2 / 64, "stepwise_rate": 25 / 64}]
    c = curves(evs)
    report = {"mode": "tenants", "curves": c, "verdicts": tenant_verdicts(c), "evaluations": evs}
    write_two_user_report(report, tmp_path)
    assert json.loads((tmp_path / "report.json").read_text())["verdicts"]["bob"]["learned"] is True
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "alice@00ff" in out and "30/64" in out and "25/64" in out
