"""The training step on the tiny model: positions, log-probs, micro-batching, options, checkpoints."""

from __future__ import annotations

import random

import pytest
import torch

from pipeline import events
from pipeline.testing.trainer import param_copies, policy_trainer
from pipeline.trainer import batch as B


def _sample(i, n_prompt=6, n_resp=4, reward=1.0, seed=0, **kw):
    rng = random.Random(seed * 1000 + i)
    toks = [rng.randrange(1, 49152) for _ in range(n_prompt + n_resp)]
    kw.setdefault("rollout_log_probs", [-1.0] * n_resp)
    return events.Sample(sample_id=f"x:{i}", session_id=f"x{i}", turn_index=0, tokens=toks, response_length=n_resp,
                         reward=reward, **kw)


def test_collate_places_response_positions():
    s = events.Sample(sample_id="a", session_id="a", turn_index=0, tokens=[10, 11, 12, 13, 14], response_length=2,
                      rollout_log_probs=[-0.5, -0.25], teacher_log_probs=[-0.1, -0.2], kind="opd+rl",
                      rollout_temperature=0.7, reward=1.0)
    short = events.Sample(sample_id="b", session_id="b", turn_index=0, tokens=[20, 21, 22], response_length=1,
                          rollout_log_probs=[-2.0], reward=-1.0, loss_mask=0)
    mb = B.collate([s, short], [1.0, 0.5])
    assert mb.tokens.tolist() == [[10, 11, 12, 13], [20, 21, 0, 0]]
    assert mb.targets.tolist() == [[11, 12, 13, 14], [21, 22, 0, 0]]
    # response tokens 13, 14 are predicted at positions 2, 3; the masked sample has no positions
    assert mb.mask.tolist() == [[0, 0, 1, 1], [0, 0, 0, 0]]
    assert mb.rollout_log_probs.tolist() == [[0, 0, -0.5, -0.25], [0, 0, 0, 0]]
    assert torch.allclose(mb.teacher_log_probs[0], torch.tensor([0, 0, -0.1, -0.2]))
    assert mb.temperatures.tolist() == pytest.approx([0.7, 1.0])
    assert mb.has_reward.tolist() == [True, True] and mb.has_teacher.tolist() == [True, False]
    assert mb.has_rollout.tolist() == [True, True] and mb.policy_versions.tolist() == [0, 0]
    assert mb.weights.tolist() == [1.0, 0.5] and mb.num_tokens == 2
    scored = B.collate([short], include_masked=True)
    assert scored.mask.tolist() == [[0, 1]]
    assert not B.trainable(short) and B.trainable(s)


def test_split_bounds_samples_and_tokens():
    samples = [_sample(i, n_prompt=2 + i, n_resp=2) for i in range(5)]  # lengths 4..8
    mbs = B.split(samples, micro_batch_size=2)
    assert [mb.size for mb in mbs] == [2, 2, 1]
    assert sorted(i for mb in mbs for i in mb.index) == list(range(5))
    mbs = B.split(samples, micro_batch_size=8, max_tokens=14)
    assert all(mb.tokens.numel() <= 14 or mb.size == 1 for mb in mbs)
    assert sum(mb.size for mb in mbs) == 5
    for mb in mbs:  # each row is its sample
        for row, i in enumerate(mb.index):
            n = len(samples[i].tokens) - 1
            assert mb.tokens[row, :n].tolist() == samples[i].tokens[:-1]
    assert B.split([], 4) == []


def test_log_probs_and_entropy_match_full_softmax(runtime):
    from pipeline.trainer.policy import token_log_probs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 50, generator=g) * 3
    targets = torch.randint(0, 50, (2, 5), generator=g)
    temps = torch.tensor([1.0, 0.6])
    lp, ent = token_log_probs(logits, targets, temps, entropy="grad")
    ref = torch.log_softmax(logits / temps[:, None, None], -1)
    assert torch.allclose(lp, ref.gather(-1, targets[..., None])[..., 0], atol=1e-5)
    assert torch.allclose(ent, -(ref.exp() * ref).sum(-1), atol=1e-5)
    # restricted to a mask: same values there, zeros elsewhere, gradients only through the mask
    mask = torch.tensor([[0, 1, 1, 0, 1], [0, 0, 0, 1, 1]])
    x = logits.clone().requires_grad_()
    lp2, ent2 = token_log_probs(x, targets, temps, entropy="grad", mask=mask)
    assert torch.allclose(lp2, lp * mask, atol=1e-6) and torch.allclose(ent2, ent * mask, atol=1e-6)
    (lp2.sum() + ent2.sum()).backward()
    assert (x.grad[mask == 0] == 0).all() and (x.grad[mask == 1].abs().sum(-1) > 0).all()


def test_positive_advantage_raises_logprob_negative_lowers(runtime):
    pt = policy_trainer(runtime)
    samples = [_sample(0, reward=1.0), _sample(1, reward=-1.0)]
    before = pt.log_probs(samples)
    for s, lp in zip(samples, before):
        s.rollout_log_probs = lp
    res = pt.train_batch(samples)
    after = pt.log_probs(samples)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert not res.skipped and res.metrics["train_samples"] == 2
    assert mean(after[0]) > mean(before[0]) and mean(after[1]) < mean(before[1])
    assert res.metrics["logprob_abs_diff"] < 1e-5  # identical weights before the step
    assert res.metrics["pg_clipfrac"] == 0.0 and abs(res.metrics["ppo_kl"]) < 1e-6


def test_imported_samples_use_recomputed_behaviour_log_probs(runtime):
    # imported turns carry no rollout log-probs; the trainer's own log-probs are the behaviour
    # policy, so the ratio starts at 1 and the sample is trained
    pt = policy_trainer(runtime)
    s = _sample(0, reward=1.0, source="import", rollout_log_probs=None)
    before = pt.log_probs([s])[0]
    res = pt.train_batch([s, _sample(1, reward=-1.0, source="import", rollout_log_probs=None)])
    after = pt.log_probs([s])[0]
    assert not res.skipped and res.metrics["pg_clipfrac"] == 0.0
    assert sum(after) > sum(before), "the imported positive sample was not trained"


def test_micro_batching_does_not_change_the_update(runtime):
    samples = [_sample(i, n_prompt=3 + i, n_resp=2 + (i % 3), reward=(-1.0) ** i) for i in range(6)]
    results = []
    for mbs, agg in ((1, "sum_of_sample_mean"), (6, "sum_of_sample_mean"), (2, "token_mean"), (6, "token_mean")):
        pt = policy_trainer(runtime, micro_batch_size=mbs, loss_agg=agg)
        pt.train_batch(samples)
        results.append(param_copies(pt))
    for a, b in ((0, 1), (2, 3)):
        for k in results[a]:
            assert torch.allclose(results[a][k], results[b][k], atol=1e-6), k
    # and the two aggregations really differ (the test can fail)
    assert any(not torch.allclose(results[0][k], results[2][k], atol=1e-6) for k in results[0])


def test_empty_batch_makes_no_optimizer_step(runtime):
    pt = policy_trainer(runtime)
    before = param_copies(pt)
    masked = [_sample(0, loss_mask=0), _sample(1, loss_mask=0)]
    res = pt.train_batch(masked)
    assert res.skipped and res.metrics["train_samples"] == 0 and pt.optimizer_steps == 0
    assert all(torch.equal(before[k], v) for k, v in param_copies(pt).items())
    res = pt.train_batch([_sample(2)], weights=[0.0])  # a dropped (weight 0) sample trains nothing either
    assert res.skipped


def test_options_recompute_tis_kl_entropy_opd(runtime):
    pt = policy_trainer(runtime, old_log_probs="recompute", tis_cap=2.0, kl_coef=0.1, kl_type="k3", entropy_coef=0.01,
                        steps_per_batch=2, eps_clip_c=3.0, normalize_advantages=True)
    assert pt.ref_model is not None
    opd = _sample(0, kind="opd", reward=None, teacher_log_probs=[-0.5, -1.0, -2.0, -0.1])
    both = _sample(1, kind="opd+rl", teacher_log_probs=[-1.0] * 4, reward=1.0)
    rl = _sample(2, reward=-1.0)
    res = pt.train_batch([opd, both, rl], weights=[1.0, 0.5, 1.0])
    m = res.metrics
    assert pt.optimizer_steps == 2 and not res.skipped
    for k in ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "kl", "tis", "grad_norm"):
        assert m[k] == m[k] and abs(m[k]) < 1e6, (k, m[k])  # finite
    assert m["kl"] > 0.0  # the second step moved away from the frozen reference
    assert m["entropy"] > 0.0 and m["tis"] > 0.0
    ref = pt.log_probs([rl], reference=True)[0]
    assert len(ref) == 4


def test_checkpoint_round_trip_restores_model_and_optimizer(runtime, tmp_path):
    from pipeline.trainer import checkpoint as C

    samples = [_sample(i, reward=(-1.0) ** i) for i in range(3)]
    a = policy_trainer(runtime)
    a.train_batch(samples)
    C.save(tmp_path, 1, runtime, a.state_dict(), {"policy_version": 1, "offsets": {"t": {"0": 3}}})
    a.train_batch(samples)  # uninterrupted second step
    b = policy_trainer(runtime)
    meta, state = C.load(C.latest(tmp_path), runtime)
    assert meta["step"] == 1 and meta["offsets"] == {"t": {"0": 3}}
    b.load_state_dict(state)
    assert b.optimizer_steps == 1
    b.train_batch(samples)  # resumed second step: same Adam moments, same result
    pa, pb = param_copies(a), param_copies(b)
    assert all(torch.allclose(pa[k], pb[k], atol=1e-7) for k in pa)
    with pytest.raises(ValueError, match="tensor parallel"):
        from dataclasses import replace

        C.load(C.latest(tmp_path), replace(runtime, tp=2))


def test_metrics_log_follows_the_checkpoint(tmp_path):
    from pipeline.trainer.metrics import MetricsLog

    log = MetricsLog(tmp_path / "m.jsonl")
    for step in (1, 2, 3):
        log.append({"step": step, "sample_ids": [f"s{step}"]})
    with open(tmp_path / "m.jsonl", "a") as f:
        f.write('{"step": 4, "torn')  # a crash in the middle of a line
    log.reconcile(2, {"step": 2, "sample_ids": ["s2"]})  # restored checkpoint: step 2
    assert [r["step"] for r in log.records()] == [1, 2]
    log.reconcile(3, {"step": 3, "sample_ids": ["s3"]})  # died after the checkpoint, before the log line
    assert [r["step"] for r in log.records()] == [1, 2, 3]
    log.append({"step": 4, "loss": float("nan")})
    assert log.records()[-1]["loss"] is None


def test_export_versions_lists_complete_folders_only(tmp_path):
    from pipeline.weightsync import CHECKSUM_FILE
    from pipeline.trainer.stage import export_versions

    for v, complete in ((1, True), (2, True), (3, False)):
        d = tmp_path / f"v{v:06d}"
        d.mkdir()
        if complete:
            (d / CHECKSUM_FILE).write_text("x  model.safetensors\n")
    (tmp_path / ".v000004.tmp-abc").mkdir()
    assert export_versions(tmp_path) == [1, 2]
    assert export_versions(tmp_path / "missing") == []
