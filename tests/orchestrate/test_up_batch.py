"""``pipeline up``'s trainer batch (issue 41): a person's short chat turns the loop. Without
``--batch-size`` or a config value the batch is :data:`~pipeline.orchestrate.up.CHAT_BATCH`
(with long prompts one per forward pass); a batch size the user set anywhere wins."""

from __future__ import annotations

import argparse

from pipeline.config import load_config
from pipeline.orchestrate.up import CHAT_BATCH, CHAT_MICRO_TOKENS, _apply_defaults, add_arguments, batch_settings


def _args(*argv: str):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_the_chat_batch_is_the_default_and_a_users_choice_wins(tmp_path, monkeypatch):
    monkeypatch.delenv("PIPELINE_TRAINER__ROLLOUT_BATCH_SIZE", raising=False)
    default = load_config(None)
    assert default.trainer.rollout_batch_size == 16 and CHAT_BATCH < 16
    assert batch_settings(default, None) == {"rollout_batch_size": CHAT_BATCH, "micro_batch_tokens": CHAT_MICRO_TOKENS,
                                             "recompute_attention": True}
    assert batch_settings(default, 8) == {"rollout_batch_size": 8}
    assert batch_settings(load_config(None, ["trainer.rollout_batch_size=16"]), None) == {}
    assert batch_settings(load_config(None, ["trainer.micro_batch_tokens=2048", "trainer.recompute_attention=false"]),
                          None) == {"rollout_batch_size": CHAT_BATCH}
    yaml = tmp_path / "c.yaml"
    yaml.write_text("trainer:\n  rollout_batch_size: 32\n")
    assert batch_settings(load_config(str(yaml)), None) == {}
    monkeypatch.setenv("PIPELINE_TRAINER__ROLLOUT_BATCH_SIZE", "12")
    assert batch_settings(load_config(None), None) == {}


def test_pipeline_up_applies_it(tmp_path, monkeypatch):
    monkeypatch.delenv("PIPELINE_TRAINER__ROLLOUT_BATCH_SIZE", raising=False)
    c = _apply_defaults(load_config(None), tmp_path, _args())
    assert (c.trainer.rollout_batch_size, c.trainer.micro_batch_tokens) == (CHAT_BATCH, CHAT_MICRO_TOKENS)
    assert c.trainer.recompute_attention is True
    assert c.trainer.checkpoint_dir == str(tmp_path / "checkpoints")
    c = _apply_defaults(load_config(None), tmp_path, _args("--batch-size", "16"))
    assert (c.trainer.rollout_batch_size, c.trainer.micro_batch_tokens, c.trainer.recompute_attention) == (16, 0, False)
