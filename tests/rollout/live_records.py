"""A small rollout log for the live-metrics tests (``tests/rollout/test_live.py``, ``pipeline tail
versions``, the dashboard's versions view): tenant alice's adapter A1 promoted over the base, then
A2 canaried against A1 and rolled back; bob's adapter B1 live meanwhile; full-weight traffic of
version 0. Every count below is what the tests expect."""

from __future__ import annotations

from pipeline import events

A1 = {"name": events.adapter_name("alice", "a" * 64), "version": "a" * 64, "sha256": "1" * 64}
A2 = {"name": events.adapter_name("alice", "b" * 64), "version": "b" * 64, "sha256": "2" * 64}
B1 = {"name": events.adapter_name("bob", "c" * 64), "version": "c" * 64, "sha256": "3" * 64}
CONFIG = {"min_n": 400, "margin": 0.05}
#: the rollback's evidence: A2 rewarded 2 of 10, A1 (its incumbent) 24 of 30
EVIDENCE = {"rule": "newcombe-noninferiority-v1", "reason": "reward_fell", "config": CONFIG, "incumbent": "a" * 64,
            "arms": {"candidate": {"reward": [2, 10], "served": [10, 40]},
                     "incumbent": {"reward": [24, 30], "served": [30, 40]}},
            "bounds": {"reward": [-0.85, -0.25]}}
PROMOTE = {**EVIDENCE, "reason": "non_inferior", "incumbent": None,
           "arms": {"candidate": {"reward": [3, 4], "served": [4, 8]}, "incumbent": {"reward": [2, 4], "served": [4, 8]}},
           "bounds": {"reward": [-0.3, 0.6]}}


def ctl(action: str, epoch: int, tenant=None, adapter=None, t: int = 0, **kw) -> events.Control:
    if action == "weights":
        kw.update(location=f"/w/{epoch}", sha256=adapter["sha256"] if adapter else "f" * 64)
    if action == "applied":
        kw["engine_id"] = "engine-0"
    return events.Control(action=action, epoch=epoch, policy_version=0 if tenant else epoch, tenant=tenant,
                          adapter=adapter, created_at=1_000 + t, **kw)


def sync(epoch: int, tenant, adapter, t: int) -> list:
    """pause -> weights -> applied -> resume of ``adapter``."""
    return [ctl(a, epoch, tenant, adapter, t + i) for i, a in enumerate(("pause", "weights", "applied", "resume"))]


def turn_and_sample(sid: str, i: int, tenant, adapter, reward, t: int, canary=None, content="Sure: 42.",
                    finish="stop", feedback=None) -> tuple[events.Turn, events.Sample]:
    pre = f"{tenant}/" if tenant else ""
    turn = events.Turn(session_id=sid, turn_index=i, request_id=f"{sid}-{i}", created_at=10_000 + t, tenant=tenant,
                       adapter=adapter, canary=canary, response={"content": content}, finish_reason=finish,
                       prompt_token_ids=[1], response_token_ids=[2], response_logprobs=[-0.5])
    sample = events.Sample(sample_id=f"{pre}{sid}:{i}:rl:{sid}-{i}", session_id=sid, turn_index=i, kind="rl",
                           tokens=[1, 2], response_length=1, reward=reward, loss_mask=1 if reward is not None else 0,
                           created_at=10_001 + t, tenant=tenant, adapter=adapter,
                           reward_source=None if reward is None else "feedback" if feedback is not None else "judge",
                           feedback_score=feedback)
    return turn, sample


def canary_log() -> dict[str, list]:
    """Logical topic -> records. Alice A2 (candidate, 10 turns: 2 rewarded of 10 judged, 3
    refusals, 1 abort, 4 words each... see the counts in the tests) vs A1 (incumbent, 30 turns:
    24 rewarded of 30), then rolled back; bob B1 (5 turns); full weights v0 (6 turns, 1 unjudged)."""
    control = sync(1, "alice", A1, 0) + [ctl("promote", 1, "alice", A1, 4, evidence=PROMOTE)]
    control += sync(1, "bob", B1, 10) + sync(2, "alice", A2, 20)
    control.append(ctl("rollback", 2, "alice", A2, 30, evidence=EVIDENCE))
    turns, samples, t = [], [], 0
    for k in range(30):  # A1, the incumbent arm: 24 of 30 rewarded, two with a thumbs-up
        tr, s = turn_and_sample(f"inc{k}", 0, "alice", A1, 1.0 if k < 24 else -1.0, t := t + 2, canary="incumbent",
                                content="The answer is forty two.", feedback=1.0 if k < 2 else None)
        turns.append(tr), samples.append(s)
    for k in range(10):  # A2, the candidate: 2 of 10 rewarded, 3 refusals, 1 aborted generation
        content = "I'm sorry, I can't help with that." if k < 3 else "No."
        tr, s = turn_and_sample(f"cand{k}", 0, "alice", A2, 1.0 if k < 2 else -1.0, t := t + 2, canary="candidate",
                                content=content, finish="abort" if k == 9 else "stop",
                                feedback=-1.0 if k == 5 else None)
        turns.append(tr), samples.append(s)
    for k in range(5):  # bob's B1: 5 of 5 rewarded
        tr, s = turn_and_sample(f"b{k}", 0, "bob", B1, 1.0, t := t + 2)
        turns.append(tr), samples.append(s)
    for k in range(6):  # the full weights, version 0: 3 of 5 judged rewarded, one not judged
        tr, s = turn_and_sample(f"f{k}", 0, None, None, None if k == 5 else (1.0 if k < 3 else -1.0), t := t + 2)
        turns.append(tr), samples.append(s)
    # side and imported turns are not served answers: never counted
    turns.append(events.Turn(session_id="f0", turn_type="side", tenant=None, response={"content": "Title"}))
    turns.append(events.Turn(session_id="imp", turn_index=0, source="import", response={"content": "old"}))
    evaluations = [events.Evaluation(policy_version=0, n=200, name="gsm8k-eval",
                                     metrics={"accuracy": 0.6, "accuracy_n": 200, "accuracy_low": 0.53,
                                              "accuracy_high": 0.66, "words_per_reply": 31.5})]
    return {"control": control, "turns": turns, "samples": samples, "metrics": evaluations}
