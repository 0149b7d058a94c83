"""The training signal as the trainer computes it: a missing signal contributes exactly zero.

Samples are built by the judge's own constructors (:mod:`pipeline.judge.samples`) from turns,
sent through the wire format (encode/decode), and scored by the real trainer (Megatron-core,
tiny model, CPU). Expected values come from ``tests/reference_method.py``, an independent
implementation of the method's definitions, compared at 1e-6.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import reference_method as ref
from pipeline import events
from pipeline.config import load_config
from pipeline.judge import samples as S
from pipeline.judge.backends.base import Verdict
from pipeline.judge.teacher import TeacherOutput
from pipeline.testing.trainer import policy_trainer

TOL = 1e-6


def _turn(session: str, n_prompt: int = 5, n_resp: int = 3, *, seed: int = 0, log_probs=None,
          temperature: float | None = None, source: str = "proxy", version: int = 0) -> events.Turn:
    rng = random.Random(hash((session, seed)) & 0xFFFF)
    prompt = [rng.randrange(1, 49152) for _ in range(n_prompt)]
    resp = [rng.randrange(1, 49152) for _ in range(n_resp)]
    if log_probs is None:
        log_probs = [] if source == "import" else [-1.0] * n_resp
    return events.Turn(session_id=session, turn_index=0, prompt_token_ids=prompt, response_token_ids=resp,
                       response_logprobs=list(log_probs), source=source, policy_version=version,
                       sampling={} if temperature is None else {"temperature": temperature},
                       messages=[{"role": "user", "content": "hi"}])


def _wire(s: events.Sample) -> events.Sample:
    """What the trainer reads back from the ``samples`` topic."""
    return events.decode(events.encode(s))


def _model_log_probs(pt, turn: events.Turn) -> list[float]:
    """The trainer's log-probs of the turn's response (at the turn's temperature)."""
    probe = S.rl_sample(turn, Verdict(1, [1]), False, "probe")
    return pt.log_probs([probe])[0]


def _with_log_probs(turn: events.Turn, lps) -> events.Turn:
    return events.Turn(**{**turn.__dict__, "response_logprobs": [float(x) for x in lps]})


def _close(a, b, tol=TOL):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, (a, b)
    assert np.allclose(a, b, rtol=0, atol=tol), (a.tolist(), b.tolist())


# ------------------------------------------------------------------ case 3


@pytest.mark.parametrize("old_mode", ["recompute", "rollout"])
def test_vote_without_hint_has_no_distillation_term(runtime, old_mode):
    """Issue 11 case 3: kind opd+rl, vote +1, no hint; recomputed old log-probs drift
    [+0.3, -0.3, +0.2] from rollout. Was [0.7, 1.3, 0.8] with recomputed old log-probs."""
    pt = policy_trainer(runtime, old_log_probs=old_mode)
    turn = _turn("c3")
    recomputed = _model_log_probs(pt, turn)
    drift = [0.3, -0.3, 0.2]
    turn = _with_log_probs(turn, [r - d for r, d in zip(recomputed, drift)])
    s = _wire(S.combine_sample(turn, 1, None, None, [[1], [-1]], "test"))
    _close(np.asarray(recomputed) - np.asarray(s.rollout_log_probs), drift, 1e-6)
    _close(pt.advantages([s])[0], [1.0, 1.0, 1.0])


@pytest.mark.parametrize("old_mode", ["recompute", "rollout"])
def test_imported_turn_vote_without_hint(runtime, old_mode):
    """Issue 11 case 3, imported turn (no rollout log-probs), vote -1. Was
    ``-1 + (0 - recomputed)`` per token (the zeros stood in for the teacher)."""
    pt = policy_trainer(runtime, old_log_probs=old_mode)
    turn = _turn("c3i", source="import")
    s = _wire(S.combine_sample(turn, -1, None, None, [[-1], [-1]], "test"))
    assert max(abs(x) for x in pt.log_probs([s])[0]) > 0.1  # recomputed log-probs are far from 0
    _close(pt.advantages([s])[0], [-1.0, -1.0, -1.0])


# ------------------------------------------------------------------ case 4


@pytest.mark.parametrize("votes", [(1, 1), (1, -1)])
def test_normalisation_runs_over_samples_with_a_reward(runtime, votes):
    """Issue 11 case 4: combine, normalize_advantages, rewards [v0, v1, hint only, hint only].
    Was: the hint-only samples entered the normalisation as reward 0 ([1, 1, -1, -1])."""
    pt = policy_trainer(runtime, normalize_advantages=True)
    teacher_lp = [-0.5, -1.5, -0.25]
    batch = [_wire(S.combine_sample(_turn(f"c4-{i}"), v, None, None, [[v], [-1]], "test"))
             for i, v in enumerate(votes)]
    batch += [_wire(S.combine_sample(_turn(f"c4-h{i}"), 0, "use one word", TeacherOutput(teacher_lp),
                                     [[0], [1]], "test")) for i in range(2)]
    got = pt.advantages(batch)
    rl = ref.rl_advantages([float(v) for v in votes] + [None, None], normalize=True)
    assert rl[2:] == [0.0, 0.0]
    for i in range(2):  # RL term only, normalised over the two rewarded samples
        _close(got[i], [rl[i]] * 3)
    for i in (2, 3):  # OPD term only: teacher - rollout (-1.0 per token)
        _close(got[i], np.asarray(teacher_lp) + 1.0)


# ------------------------------------------------------------------ variants of the kind


def test_tis_weight_is_one_without_rollout_log_probs(runtime):
    """No TIS weight from missing rollout log-probs: an imported sample is not down-weighted, and it
    adds no ratio of 1 to the ``tis`` figure (a batch of imported samples alone has none). Was:
    exp(old - 0) clipped, i.e. the imported sample's loss scaled by ~exp(-|log p|); then a figure
    of 1.0."""
    imported = _wire(S.rl_sample(_turn("tis", source="import"), Verdict(1, [1]), False, "test"))
    m = policy_trainer(runtime, old_log_probs="recompute", tis_cap=2.0).train_batch(
        [imported], policy_version=0).metrics
    assert "tis" not in m
    assert m["loss"] == policy_trainer(runtime).train_batch([imported], policy_version=0).metrics["loss"]


def test_tis_needs_recomputed_behaviour_log_probs():
    """With the engine's log-probs as the PPO behaviour policy the ratio already is trainer vs
    engine; TIS on top would correct the mismatch twice (slime: TIS belongs to decoupled PPO).
    Was: accepted, and the weight was exp(rollout - rollout) = 1, a silent no-op."""
    from pipeline.config import load_config

    with pytest.raises(ValueError, match="tis_cap needs old_log_probs=recompute"):
        load_config(None, trainer={"tis_cap": 1.5})
    assert load_config(None, trainer={"tis_cap": 1.5, "old_log_probs": "recompute"}).trainer.tis_cap == 1.5


@pytest.mark.parametrize("old_mode", ["recompute"])
def test_tis_weight_is_the_trainer_vs_engine_ratio_per_token(runtime, old_mode):
    """TIS = clip(exp(trainer log-prob before the update - rollout log-prob), floor, cap) per token
    (decoupled PPO: the PPO ratio is against the trainer's recomputed log-probs); the ``tis``
    figure leaves out the imported sample. Drifts [+0.3, -0.3, +0.05] with cap 1.2, floor 0.9
    give weights [1.2, 0.9, e^0.05]."""
    pt = policy_trainer(runtime, old_log_probs=old_mode, tis_cap=1.2, tis_floor=0.9)
    turn = _turn("tis-drift")
    recomputed = _model_log_probs(pt, turn)
    drift = [0.3, -0.3, 0.05]
    turn = _with_log_probs(turn, [r - d for r, d in zip(recomputed, drift)])
    sampled = _wire(S.rl_sample(turn, Verdict(1, [1]), False, "test"))
    imported = _wire(S.rl_sample(_turn("tis-imp", source="import"), Verdict(-1, [-1]), False, "test"))
    weights = np.clip(np.exp(drift), 0.9, 1.2)  # from the definition, by hand
    _close(weights, [1.2, 0.9, np.exp(0.05)])
    m = pt.train_batch([sampled, imported], policy_version=0).metrics
    assert m["tis"] == pytest.approx(float(weights.mean()), abs=TOL)
    # the loss: PPO surrogate per token (advantage +1; first step, so the policy is the trainer's
    # recomputed log-probs) times the weight; the imported sample: ratio 1, advantage -1, weight 1
    old = np.asarray(recomputed) - np.asarray(drift) if old_mode == "rollout" else np.asarray(recomputed)
    ratio = np.exp(np.asarray(recomputed) - old)
    pg = np.maximum(-ratio, -np.clip(ratio, 0.8, 1.28)) * weights
    assert m["pg_loss"] == pytest.approx((pg.mean() + 1.0) / 2, abs=TOL)


def test_mismatch_figure_leaves_out_imported_samples_and_splits_versions(runtime):
    """Imported samples never enter the train-vs-rollout figure; samples of the trainer's own
    version (engine/trainer mismatch) and of older versions (drift) are reported apart."""
    pt = policy_trainer(runtime)
    current = _turn("mm-cur", version=3)
    current = _with_log_probs(current, _model_log_probs(pt, current))  # the engine agrees exactly
    stale = _turn("mm-old", version=2)
    stale = _with_log_probs(stale, np.asarray(_model_log_probs(pt, stale)) - 0.25)  # drifted by 0.25
    batch = [_wire(S.rl_sample(t, Verdict(1, [1]), False, "test"))
             for t in (current, stale, _turn("mm-imp", source="import"))]
    m = pt.train_batch(batch, policy_version=3).metrics
    assert m["logprob_abs_diff"] == pytest.approx(0.125, abs=1e-5)  # (0 * 3 + 0.25 * 3) / 6 tokens
    assert m["logprob_abs_diff_current"] == pytest.approx(0.0, abs=1e-5)
    assert m["logprob_abs_diff_stale"] == pytest.approx(0.25, abs=1e-5)
    assert (m["logprob_tokens_current"], m["logprob_tokens_stale"]) == (3.0, 3.0)
    # a batch with no stale sample has no stale figure (absent, not 0)
    m = pt.train_batch(batch[:1], policy_version=4).metrics
    assert "logprob_abs_diff_current" not in m and m["logprob_abs_diff_stale"] >= 0.0


def test_reward_mean_counts_only_samples_with_a_reward(runtime):
    pt = policy_trainer(runtime)
    rl = _wire(S.combine_sample(_turn("rm-0"), 1, None, None, [[1], [-1]], "test"))
    hint_only = _wire(S.combine_sample(_turn("rm-1"), 0, "a hint here", TeacherOutput([-1.0, -2.0, -3.0]),
                                       [[0], [1]], "test"))
    m = pt.train_batch([rl, hint_only], policy_version=0).metrics
    assert m["reward_mean"] == 1.0
    assert (m["rl_samples"], m["opd_samples"]) == (1.0, 1.0)


def test_all_failed_votes_carry_no_rl_term(runtime):
    """Every PRM vote failed (backend errors, no box): the judge's majority is absent, the sample
    (even a session's turn 0, the at-least-one candidate) has no reward and loss_mask 0, and
    the trainer leaves it out: no advantage, not an RL sample, not in the reward mean or the
    normalisation, exactly the loss of the batch without it. Was: reward 0, trained on turn 0
    (rl_samples 2, reward_mean 0.5, normalised advantages [1, -1])."""
    from pipeline.votes import majority_vote

    def judged(turn, votes, candidate):  # as the llm backend and the judge app build it
        return _wire(S.rl_sample(turn, Verdict(majority_vote(votes), votes), candidate, "test"))

    good = judged(_turn("af-good"), [1, 1, None], False)
    failed = judged(_turn("af-failed"), [None, None, None], True)
    assert (failed.reward, failed.loss_mask) == (None, 0)
    adv = policy_trainer(runtime, normalize_advantages=True).advantages([good, failed])
    assert adv[1] == [] and adv[0] == [0.0] * 3  # the only rewarded sample: nothing to normalise against
    pt, alone = policy_trainer(runtime), policy_trainer(runtime)
    assert pt.advantages([good, failed]) == [[1.0] * 3, []]
    m = pt.train_batch([good, failed], policy_version=0).metrics
    want = alone.train_batch([good], policy_version=0).metrics
    assert (m["rl_samples"], m["train_samples"], m["reward_mean"]) == (1.0, 1.0, 1.0)
    assert want["loss"] != 0.0
    for key in ("loss", "pg_loss", "grad_norm"):
        assert m[key] == want[key], key


def test_grad_norm_is_absent_when_not_measured(runtime):
    """With ``clip_grad`` 0 Megatron's optimizer measures no gradient norm: the step has no
    ``grad_norm`` figure (was 0.0, which reads as "no gradient"); with clipping it is measured."""
    batch = [_wire(S.rl_sample(_turn("gn"), Verdict(1, [1]), False, "test"))]
    m = policy_trainer(runtime, clip_grad=0.0).train_batch(batch, policy_version=0).metrics
    assert "grad_norm" not in m and m["loss"] != 0.0
    assert policy_trainer(runtime).train_batch(batch, policy_version=0).metrics["grad_norm"] > 0.0


# ------------------------------------------------------------------ case 5 (trainer half)


async def _engine_turn(url, session: str, temperature: float, seed: int) -> events.Turn:
    from pipeline.engine_api.client import EngineClient

    prompt = list(range(200 + seed, 220 + seed))
    async with EngineClient(url, timeout_s=60) as eng:
        out = await eng.generate(prompt, sampling_params={"max_new_tokens": 6, "temperature": temperature,
                                                          "sampling_seed": seed}, return_logprob=True)
    lp = out["meta_info"]["output_token_logprobs"]
    return events.Turn(session_id=session, turn_index=0, prompt_token_ids=prompt,
                       response_token_ids=[e[1] for e in lp], response_logprobs=[e[0] for e in lp],
                       sampling={"temperature": temperature}, messages=[{"role": "user", "content": "hi"}])


def test_greedy_turn_is_trained_at_the_temperature_of_its_log_probs(runtime, kafka_config, tmp_path):
    """Issue 11 case 5: a turn served with ``temperature: 0``. The engine samples the argmax and
    reports log-probs of softmax(logits), i.e. at T=1. Was: the sample said T=0 and the trainer
    sent it to the DLQ. Through the real ``samples`` topic and trainer stage."""
    import asyncio

    from pipeline.bus import EventProducer
    from pipeline.testing.engine import running_engine
    from pipeline.trainer.stage import TrainerStage

    with running_engine("tiny-random", threads=1) as url:
        turns = [asyncio.run(_engine_turn(url, name, t, seed))
                 for name, t, seed in (("greedy", 0.0, 1), ("warm", 0.6, 2), ("filler", 1.0, 3))]
    made = [S.rl_sample(t, Verdict(1, [1]), False, "test") for t in turns]
    p = EventProducer(kafka_config, name="test")
    for s in made:
        p.send(kafka_config.topics.name("samples"), s, key="one-partition")  # consumed in this order
    p.flush(10)
    p.close()
    cfg = load_config(None, kafka=kafka_config.kafka.model_dump(), topics=kafka_config.topics.model_dump(), trainer=dict(
        model="tiny-random", rollout_batch_size=2, micro_batch_size=2, max_steps=1, engines=[], progress=False,
        checkpoint_dir=str(tmp_path / "ckpt"), export_dir=str(tmp_path / "weights")))
    stage = TrainerStage(cfg)  # in this module's Megatron runtime
    assert stage.run(install_signals=False) == 0
    rec = stage.log.records()[-1]
    assert sorted(rec["sample_ids"]) == sorted([made[0].sample_id, made[1].sample_id]), rec["sample_ids"]
    assert rec["dead_letters"] == 0
    assert made[0].rollout_temperature == 1.0 and made[1].rollout_temperature == pytest.approx(0.6)
    # trained at the temperatures the engine's log-probs refer to: trainer == engine log-probs
    assert rec["logprob_abs_diff_current"] < 1e-4, rec


# ------------------------------------------------------------------ the reference comparison


def _fixture_batch(pt) -> tuple[list[events.Sample], list[float]]:
    """Every combination of signals the judge emits, as the judge builds them, off the wire.

    Rollout log-probs are the model's own minus a per-token offset in [-0.7, 0.7] (so PPO
    ratios spread over both clip edges); teachers are the model's plus noise.
    """
    rng = np.random.default_rng(7)

    def sampled(name, n_resp, version=0, temperature=None):
        t = _turn(name, n_prompt=4 + len(name) % 3, n_resp=n_resp, temperature=temperature, version=version)
        lp = np.asarray(_model_log_probs(pt, t))
        return _with_log_probs(t, lp - rng.uniform(-0.7, 0.7, n_resp)), lp

    def teacher(lp):
        return TeacherOutput((np.asarray(lp) + rng.normal(0, 0.5, len(lp))).tolist())

    rl_t, _ = sampled("rl", 4, version=5)
    both_t, both_lp = sampled("both", 3, version=4)
    hint_t, hint_lp = sampled("hint", 5, version=5, temperature=0.7)
    vote_t, _ = sampled("vote", 2, version=5)
    imp_t = _turn("imp", n_resp=3, source="import")
    imp_hint_t = _turn("imph", n_resp=4, source="import")
    imp_hint_lp = _model_log_probs(pt, imp_hint_t)
    flushed_t, _ = sampled("flushed", 3)
    batch = [
        S.rl_sample(rl_t, Verdict(1, [1, 1, 0]), False, "test"),
        S.combine_sample(both_t, -1, "the hint", teacher(both_lp), [[-1], [1]], "test"),
        S.combine_sample(hint_t, 0, "the hint", teacher(hint_lp), [[0], [1]], "test"),
        S.combine_sample(vote_t, 1, None, None, [[1], [-1]], "test"),
        S.combine_sample(imp_t, -1, None, None, [[-1], [-1]], "test"),
        S.combine_sample(imp_hint_t, 0, "the hint", teacher(imp_hint_lp), [[0], [1]], "test"),
        S.rl_flush_sample(flushed_t, "test"),
    ]
    return [_wire(s) for s in batch], [1.0, 0.5, 1.0, 1.0, 0.25, 1.0, 1.0]


CONFIGS = {  # trainer settings, and the options that must change the result on the fixture batch
    "defaults": ({}, []),
    "normalised-recompute-token-mean": (dict(normalize_advantages=True, old_log_probs="recompute", w_rl=0.5,
                                             w_opd=2.0, loss_agg="token_mean"), []),
    "tis-recompute-k3": (dict(old_log_probs="recompute", tis_cap=1.2, tis_floor=0.9, kl_coef=0.1, kl_type="k3",
                              normalize_advantages=True), ["tis_cap"]),
    "tis-recompute-wide": (dict(old_log_probs="recompute", tis_cap=1.3, tis_floor=0.8), ["tis_cap"]),
    "dual-clip-k2": (dict(eps_clip=0.1, eps_clip_high=0.15, eps_clip_c=1.5, kl_coef=0.05, kl_type="k2", w_opd=0.3),
                     ["dual_clip", "eps_clip_high"]),
    "low-var-kl-k1": (dict(kl_coef=0.2, kl_type="low_var_kl", loss_agg="token_mean"), []),
}
_OFF = {"tis_cap": dict(tis_cap=None), "dual_clip": dict(dual_clip=None), "eps_clip_high": dict(eps_clip_high=None)}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_trainer_matches_the_reference(runtime, name):
    kw, binding = CONFIGS[name]
    pt = policy_trainer(runtime, **kw)
    cfg = pt.cfg
    batch, weights = _fixture_batch(pt)
    if cfg.kl_coef:  # move the policy away from the frozen reference first, so KL is not 0
        pt.train_batch(batch, weights, policy_version=5)
    trained = [i for i, s in enumerate(batch) if s.loss_mask]
    assert len(trained) == 6  # the flushed turn is carried, not trained
    # the policy's log-probs, scored in the micro-batches the trainer forms for the same samples
    logp = dict(zip(trained, pt.log_probs([batch[i] for i in trained])))
    refs = [ref.RefSample.of(batch[i], weights[i]) for i in trained]
    ref_logp = pt.log_probs([batch[i] for i in trained], reference=True) if cfg.kl_coef else None

    def objective(**over):
        kw = dict(old_mode=cfg.old_log_probs, w_rl=cfg.w_rl, w_opd=cfg.w_opd, normalize=cfg.normalize_advantages,
                  eps_clip=cfg.eps_clip, eps_clip_high=cfg.eps_clip_high, dual_clip=cfg.eps_clip_c,
                  tis_cap=cfg.tis_cap, tis_floor=cfg.tis_floor, ref=ref_logp, kl_coef=cfg.kl_coef,
                  kl_type=cfg.kl_type, agg=cfg.loss_agg)
        kw.update(over)
        return ref.objective(refs, [logp[i] for i in trained], [logp[i] for i in trained], **kw)

    want = objective()
    for option in binding:  # the option matters on this batch, so the comparison can fail
        assert abs(objective(**_OFF[option])["pg_loss"] - want["pg_loss"]) > 1e-4, option
    got = pt.advantages(batch, weights)
    assert got[6] == []
    for k, i in enumerate(trained):
        _close(got[i], want["advantages"][k])
    m = pt.train_batch(batch, weights, policy_version=5).metrics
    for key in ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "kl", "tis"):
        if want[key] is None:  # no figure (TIS off): absent, never 0
            assert key not in m, key
            continue
        assert m[key] == pytest.approx(want[key], abs=TOL), (key, m[key], want[key])
    if cfg.old_log_probs == "rollout":  # (recomputed old log-probs give ratio 1 on the first step)
        assert 0.0 < want["pg_clipfrac"] < 1.0  # the clip is exercised
    mm = ref.logprob_mismatch(refs, [logp[i] for i in trained], 5)
    assert mm["current"] is not None and mm["stale"] is not None
    for key, part in (("logprob_abs_diff", "all"), ("logprob_abs_diff_current", "current"),
                      ("logprob_abs_diff_stale", "stale")):
        assert m[key] == pytest.approx(mm[part], abs=TOL), key


# ------------------------------------------------------------------ properties


_signals = st.tuples(st.sampled_from([None, 1.0, -1.0, 0.0]), st.booleans(), st.booleans())


def _property_batch(pt, draws, temperature):
    out = []
    rng = np.random.default_rng(len(draws))
    for i, (reward, hint, sampled) in enumerate(draws):
        if reward is None and not hint:
            reward = 1.0
        t = _turn(f"p{i}", n_resp=3, temperature=temperature, source="proxy" if sampled else "import")
        if sampled:
            t = _with_log_probs(t, np.asarray(_model_log_probs(pt, t)) + rng.uniform(-0.3, 0.3, 3))
        teacher = TeacherOutput(rng.uniform(-4.0, -0.1, 3).tolist()) if hint else None
        out.append((t, reward, teacher))
    return out


def _build(t, reward, teacher) -> events.Sample:
    return _wire(S.make_sample(t, "combine", reward=reward, loss_mask=1, teacher=teacher,
                               hint="h" * 12 if teacher is not None else None, judge="test"))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(draws=st.lists(_signals, min_size=1, max_size=5), which=st.integers(0, 4),
       normalize=st.booleans(), recompute=st.booleans())
def test_removing_a_signal_removes_exactly_its_term(runtime, draws, which, normalize, recompute):
    pt = _property_trainer(runtime, normalize, recompute)
    parts = _property_batch(pt, draws, None)
    which %= len(parts)
    full = [_build(*p) for p in parts]
    base = pt.advantages(full)
    t, reward, teacher = parts[which]
    old = pt.log_probs([full[which]])[0] if (recompute or full[which].rollout_log_probs is None) \
        else full[which].rollout_log_probs
    if teacher is not None and reward is not None:  # drop the teacher: only its OPD term goes
        less = pt.advantages(full[:which] + [_build(t, reward, None)] + full[which + 1:])
        for i, (a, b) in enumerate(zip(base, less)):
            want = np.asarray(teacher.log_probs) - np.asarray(old) if i == which else 0.0
            _close(np.asarray(a) - np.asarray(b), np.broadcast_to(want, np.shape(a)), 2e-6)
    if reward is not None and teacher is not None:  # drop the reward: the RL term goes
        less = pt.advantages(full[:which] + [_build(t, None, teacher)] + full[which + 1:])
        rewards = [p[1] for p in parts]
        before = ref.rl_advantages(rewards, normalize)
        after = ref.rl_advantages(rewards[:which] + [None] + rewards[which + 1:], normalize)
        for i, (a, b) in enumerate(zip(base, less)):
            _close(np.asarray(a) - np.asarray(b), [before[i] - after[i]] * 3, 2e-6)


_TRAINERS: dict = {}


def _property_trainer(par, normalize, recompute):
    key = (normalize, recompute)
    if key not in _TRAINERS:  # one trainer per configuration (never trained: same weights)
        _TRAINERS[key] = policy_trainer(par, normalize_advantages=normalize,
                                        old_log_probs="recompute" if recompute else "rollout")
    return _TRAINERS[key]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(temperature=st.floats(0.05, 2.0), recompute=st.booleans(), n_resp=st.integers(1, 6))
def test_a_hint_that_changes_nothing_gives_zero_opd_advantage(runtime, temperature, recompute, n_resp):
    """Teacher = the student's own distribution at the turn's temperature: OPD advantage 0."""
    pt = _property_trainer(runtime, False, recompute)
    t = _turn("same", n_resp=n_resp, temperature=temperature)
    lp = _model_log_probs(pt, t)
    s = _build(_with_log_probs(t, lp), None, TeacherOutput(list(lp)))
    _close(pt.advantages([s])[0], [0.0] * n_resp)


# ------------------------------------------------------------------ issue 24 case 10


def test_count_masked_samples_divides_by_the_whole_batch(runtime):
    """Issue 24 case 10: with ``trainer.count_masked_samples`` the masked samples count in the
    ``sum_of_sample_mean`` denominator (slime divides by the global batch size): 2 trainable of 8
    weigh 1/8 each. Was: 1/2 each (the loss 4x too large)."""
    good = [_wire(S.rl_sample(_turn(f"cm-good{i}"), Verdict(1, [1]), False, "test")) for i in range(2)]
    masked = [_wire(S.rl_sample(_turn(f"cm-m{i}"), Verdict(0, [0]), False, "test")) for i in range(6)]
    assert all(s.loss_mask == 0 for s in masked)
    kw = dict(old_log_probs="recompute")  # ratio 1 on the first step: pg_loss = -A per token
    counted = policy_trainer(runtime, count_masked_samples=True, **kw).train_batch(
        good + masked, policy_version=0).metrics
    plain = policy_trainer(runtime, **kw).train_batch(good + masked, policy_version=0).metrics
    assert counted["train_samples"] == plain["train_samples"] == 2.0
    assert plain["pg_loss"] != 0.0
    _close([counted["pg_loss"]], [plain["pg_loss"] * 2 / 8])
    want = ref.aggregate([np.full(3, -1.0)] * 2 + [np.zeros(0)] * 6, [1.0] * 8, batch_size=8)
    _close([counted["pg_loss"]], [want])  # -2 / 8


def test_normalisation_uses_the_bessel_corrected_std(runtime):
    """Issue 24 case 10: ``normalize_advantages`` standardises with the Bessel-corrected std (slime's
    GRPO normalisation, torch's default). Rewards [1, -1]: mean 0, std sqrt(2) -> +-0.7071. Was the
    population std (1) -> +-1."""
    batch = [_wire(S.rl_sample(_turn(f"bs-{i}"), Verdict(v, [v]), False, "test")) for i, v in enumerate((1, -1))]
    got = policy_trainer(runtime, normalize_advantages=True).advantages(batch)
    _close(got[0], [1 / math.sqrt(2)] * 3)
    _close(got[1], [-1 / math.sqrt(2)] * 3)
