"""The policy's weights and optimizer state: never corrupted by NaN/inf, hyper-parameters from the
config, Megatron's weight-decay convention, durable checkpoints (tiny model, real Megatron-core)."""

from __future__ import annotations

import logging
import math
import os
import random

import pytest
import torch

from pipeline import events
from pipeline.testing.trainer import param_copies, policy_trainer


def _sample(i, n_prompt=6, n_resp=4, reward=1.0, **kw):
    rng = random.Random(1000 + i)
    toks = [rng.randrange(1, 49152) for _ in range(n_prompt + n_resp)]
    kw.setdefault("rollout_log_probs", [-1.0] * n_resp)
    return events.Sample(sample_id=f"w:{i}", session_id=f"w{i}", turn_index=0, tokens=toks, response_length=n_resp,
                         reward=reward, **kw)


def _good_batch():
    return [_sample(0, reward=1.0), _sample(2, reward=-1.0), _sample(3, reward=1.0)]


def _bad(source: str) -> events.Sample:
    """One sample with a single non-finite value (the issue's three sources, and their kin)."""
    if source == "teacher_-inf":
        return _sample(1, kind="opd+rl", teacher_log_probs=[-1.0, float("-inf"), -1.0, -1.0])
    if source == "rollout_nan":
        return _sample(1, rollout_log_probs=[-1.0, -1.0, float("nan"), -1.0])
    if source == "reward_nan":
        return _sample(1, reward=float("nan"))
    if source == "reward_inf":
        return _sample(1, reward=float("inf"))
    raise ValueError(source)


# ---- case 1 (step side): a step whose loss or gradient is not finite is skipped ---------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nonfinite_step_is_skipped_and_changes_nothing(runtime, dtype):
    pt = policy_trainer(runtime, dtype=dtype)
    before = param_copies(pt)
    for n, source in enumerate(["teacher_-inf", "rollout_nan", "reward_nan", "reward_inf"], start=1):
        batch = _good_batch()
        batch.insert(1, _bad(source))
        res = pt.train_batch(batch)
        # not taken: reported skipped and counted; no weight moved (nor, below, any Adam moment)
        assert res.skipped and res.metrics["nonfinite_steps"] == 1.0, source
        assert pt.optimizer_steps == 0 and pt.nonfinite_steps == n, source
        assert not math.isfinite(res.metrics["loss"]), source  # the bad value reached the loss: the guard caught it
        after = param_copies(pt)
        assert all(torch.equal(before[k], after[k]) for k in before), source
    assert pt.nonfinite_weights() == []
    # the next, good batch trains exactly like a trainer that never saw the bad ones
    ref = policy_trainer(runtime, dtype=dtype)
    pt.train_batch(_good_batch())
    ref.train_batch(_good_batch())
    a, b = param_copies(pt), param_copies(ref)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(before[k], a[k]) for k in a)  # and that step did move the weights


def test_one_nonfinite_step_of_several_skips_only_that_step(runtime):
    from prometheus_client import REGISTRY

    def counts():
        return (REGISTRY.get_sample_value("pipeline_trainer_nonfinite_steps_total"),
                REGISTRY.get_sample_value("pipeline_trainer_optimizer_steps_total"))

    pt = policy_trainer(runtime, steps_per_batch=2)
    bad0, taken0 = counts()
    res = pt.train_batch([_sample(0, reward=1.0), _bad("teacher_-inf")])
    assert res.skipped and res.metrics["nonfinite_steps"] == 2.0 and pt.optimizer_steps == 0
    assert counts() == (bad0 + 2, taken0)  # counted live, as the steps happen
    res = pt.train_batch(_good_batch())
    assert not res.skipped and res.metrics["nonfinite_steps"] == 0.0 and pt.optimizer_steps == 2
    assert counts() == (bad0 + 2, taken0 + 2)


def test_nonfinite_weights_are_named(runtime):
    pt = policy_trainer(runtime)
    assert pt.nonfinite_weights() == []
    name, p = next((n, p) for n, p in pt.model.named_parameters() if "layernorm" in n)
    with torch.no_grad():
        p[0] = float("nan")
    assert pt.nonfinite_weights() == [name]


def test_nonfinite_fields_name_every_bad_value():
    from pipeline.trainer.guards import nonfinite_fields

    assert nonfinite_fields(_good_batch()[0]) == []
    assert nonfinite_fields(_bad("reward_nan")) == ["reward=nan"]
    assert nonfinite_fields(_bad("reward_inf")) == ["reward=inf"]
    assert nonfinite_fields(_bad("rollout_nan")) == ["rollout_log_probs[2]=nan"]
    assert nonfinite_fields(_bad("teacher_-inf")) == ["teacher_log_probs[1]=-inf"]
    topk = _sample(4, kind="opd", teacher_log_probs=[-1.0] * 4, teacher_top_k=2, teacher_topk_ids=[1, 2] * 4,
                   teacher_topk_log_probs=[-0.1, float("nan"), -0.2, float("-inf")] + [-1.0] * 4)
    # -inf marks a top-k entry the teacher did not return (legal); NaN is not
    assert nonfinite_fields(topk) == ["teacher_topk_log_probs[1]=nan"]
    missing = _sample(6, kind="opd", teacher_log_probs=[-1.0] * 4, teacher_top_k=2, teacher_topk_ids=[1, 2] * 4,
                      teacher_topk_log_probs=[-0.1, float("-inf")] * 4)
    assert nonfinite_fields(missing) == []
    missing.teacher_topk_log_probs[3] = float("inf")
    assert nonfinite_fields(missing) == ["teacher_topk_log_probs[3]=inf"]
    temp = _sample(5, rollout_temperature=float("inf"))
    assert nonfinite_fields(temp) == ["rollout_temperature=inf"]
    # a failed PRM vote is None (absent), not NaN: such a sample is valid and must be trained
    assert nonfinite_fields(_sample(7, votes=[1, None, 0])) == []
    assert nonfinite_fields(_sample(8, votes=[None, None, None])) == []
    assert nonfinite_fields(_sample(9, votes=[[1, None, -1], [None]])) == []  # combine: [PRM votes, hint votes]
    assert nonfinite_fields(_sample(10, votes=[1, float("nan")])) == ["votes[1]=nan"]


# ---- case 4: configured hyper-parameters apply on restart, moments are restored ---------------

def test_restart_applies_configured_hyperparameters_and_keeps_moments(runtime, tmp_path, caplog):
    from pipeline.trainer import checkpoint as C

    a = policy_trainer(runtime, lr=1e-3, weight_decay=0.0)
    a.train_batch(_good_batch())
    C.save(tmp_path, 1, runtime, a.state_dict(), {"policy_version": 1})
    saved = {k: v.clone() for k, v in _moments(a).items()}
    b = policy_trainer(runtime, lr=1e-5, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-6,
                       clip_grad=0.5)
    _, state = C.load(C.latest(tmp_path), runtime)
    with caplog.at_level(logging.WARNING, logger="pipeline.trainer.policy"):
        b.load_state_dict(state)
    groups = b.optimizer.param_groups
    assert [g["lr"] for g in groups] == [1e-5, 1e-5]
    # decay on the matrices, none on norm weights / biases (Megatron's wd_mult = 0 group)
    assert sorted(g["weight_decay"] for g in groups) == [0.0, 0.1]
    assert all(tuple(g["betas"]) == (0.8, 0.95) and g["eps"] == 1e-6 for g in groups)
    assert b.optimizer.config.clip_grad == 0.5
    log_text = caplog.text
    assert "lr 0.001 -> 1e-05" in log_text and "weight_decay 0.0 -> 0.1" in log_text, log_text
    assert "betas (0.9, 0.98) -> (0.8, 0.95)" in log_text
    moments = _moments(b)
    assert moments.keys() == saved.keys() and all(torch.equal(moments[k], saved[k]) for k in saved)
    assert b.optimizer_steps == 1


def _moments(pt) -> dict[str, torch.Tensor]:
    """Adam's exp_avg / exp_avg_sq of every parameter, keyed by parameter name."""
    names = {id(p): n for n, p in pt.model.named_parameters()}
    out = {}
    for opt in getattr(pt.optimizer, "chained_optimizers", [pt.optimizer]):
        inner = opt.optimizer
        for g in inner.param_groups:
            for p in g["params"]:
                st = inner.state.get(p, {})
                for k in ("exp_avg", "exp_avg_sq"):
                    if k in st:
                        out[f"{names.get(id(p), id(p))}.{k}"] = st[k]
    return out


# ---- case 5: no weight decay on norm weights and biases ---------------------------------------

def test_weight_decay_skips_norm_weights(runtime):
    pt = policy_trainer(runtime, lr=1e-2, weight_decay=0.1)
    before = param_copies(pt)
    # reward 0 (Binary RL: the advantage is the reward): the gradient is exactly 0 and so is Adam's
    # update; only the decoupled weight decay can change a weight: w <- w * (1 - lr * wd) = 0.999 w
    res = pt.train_batch([_sample(0, reward=0.0), _sample(1, reward=0.0)])
    assert not res.skipped and res.metrics["grad_norm"] == 0.0 and pt.optimizer_steps == 1
    after = param_copies(pt)
    norms = [k for k in before if before[k].dim() == 1]
    mats = [k for k in before if before[k].dim() > 1]
    assert any("input_layernorm" in k for k in norms) and any("final_layernorm" in k for k in norms)
    for k in norms:
        assert torch.equal(after[k], before[k]), f"{k} was decayed"
    for k in mats:
        assert torch.allclose(after[k], before[k] * (1 - 1e-2 * 0.1), rtol=1e-6, atol=0), k


# ---- checkpoints: durable writes, a pointer to a missing folder -------------------------------

def test_checkpoint_save_fsyncs_folders_around_the_rename(runtime, tmp_path, monkeypatch):
    from pipeline.trainer import checkpoint as C

    calls: list[tuple[str, str]] = []
    fds: dict[int, str] = {}
    real_open, real_fsync, real_rename, real_replace = os.open, os.fsync, os.rename, os.replace

    def spy_open(path, flags, *a, **k):
        fd = real_open(path, flags, *a, **k)
        fds[fd] = str(path)
        return fd

    def spy_fsync(fd):
        calls.append(("fsync", fds.get(fd, "<file>")))
        return real_fsync(fd)

    def spy_rename(src, dst):
        calls.append(("rename", f"{src} -> {dst}"))
        return real_rename(src, dst)

    def spy_replace(src, dst):
        calls.append(("replace", str(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "open", spy_open)
    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "rename", spy_rename)
    monkeypatch.setattr(os, "replace", spy_replace)
    root = tmp_path / "ckpt"
    root.mkdir()
    C.save(root, 3, runtime, {"x": torch.ones(2)}, {"policy_version": 3})
    tmp, final = str(root / ".step_00000003.tmp"), str(root / "step_00000003")
    rename = calls.index(("rename", f"{tmp} -> {final}"))
    assert ("fsync", tmp) in calls[:rename], calls  # the folder's entries are on disk before the rename
    after = calls[rename + 1:]
    assert ("fsync", str(root)) in after, calls  # the rename itself is on disk
    latest = after.index(("replace", str(root / "latest")))
    assert ("fsync", str(root)) in after[latest + 1:], calls  # and so is the new pointer
    assert (root / "latest").read_text().strip() == "step_00000003"


def test_latest_pointer_to_a_missing_folder_falls_back_to_the_newest_complete(runtime, tmp_path):
    import shutil

    from pipeline.trainer import checkpoint as C

    for step in (1, 2):
        C.save(tmp_path, step, runtime, {"x": torch.ones(2)}, {"policy_version": step})
    shutil.rmtree(tmp_path / "step_00000002")  # latest still names it
    assert C.latest(tmp_path) == tmp_path / "step_00000001"
    assert C.pointer(tmp_path) == "step_00000002"
    (tmp_path / "step_00000001" / "tp00.pt").unlink()  # incomplete: no shard
    assert C.latest(tmp_path) is None
    assert not C.complete(tmp_path / "step_00000001")
