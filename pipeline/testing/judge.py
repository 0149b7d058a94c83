"""Judge-side helpers for tests and benchmarks: small events, the judge in a thread, a scripted
stream with its expected samples.

- :func:`make_turn` / :func:`make_next_state`: small ``turns``-topic events.
- :class:`JudgeThread`: a real :class:`pipeline.judge.app.JudgeApp` in a background thread.
- :func:`scripted_stream` / :func:`check_samples`: an interleaved multi-session stream whose votes
  are scripted for :class:`pipeline.testing.servers.StandInJudge`, and the check of a samples stream
  against what it should give (crash, rebalance and replay tests).
- :func:`short_id`: a sample id without its request id.
"""

from __future__ import annotations

import threading


def short_id(sample_id: str) -> str:
    """``<session>:<turn_index>:<mode>`` of a sample id (drops the turn's request id; an id of
    the older ``<session>:<turn_index>:<mode>`` form is returned as it is)."""
    return sample_id.rsplit(":", 1)[0] if sample_id.count(":") >= 3 else sample_id


def make_turn(session_id: str, turn_index: int, request: str = "question", answer: str = "answer",
              prompt_ids=(1, 2, 3, 4), response_ids=(5, 6, 7), temperature: float = 1.0,
              policy_version: int = 0, tools=None, request_id: str | None = None, renderer=None, **fields):
    """A main :class:`pipeline.events.Turn` with small token arrays and log-probs.

    ``renderer`` (a :class:`pipeline.engine_api.render.ChatRenderer`): the prompt ids are the rendering of the
    turn's messages and tools (as the engine would have used), not ``prompt_ids``. ``fields``
    override any other Turn field (``finish_reason``, ``chat_options``, ``logprob_processors`` ...).
    """
    from pipeline import events
    from pipeline.sampling import effective_temperature

    response_ids = list(response_ids)
    messages = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": request}]
    if renderer is not None:
        from pipeline.engine_api.render import PromptSpec

        prompt_ids = renderer.render_spec(PromptSpec.from_request(
            {**fields.get("chat_options", {}), "messages": messages, "tools": tools}))
    base = dict(session_id=session_id, turn_index=turn_index, request_id=request_id or f"{session_id}-{turn_index}",
                created_at=events.now_ms(), policy_version=policy_version, model="test", messages=messages,
                tools=tools, sampling={"temperature": temperature}, prompt_token_ids=list(prompt_ids),
                response_token_ids=response_ids,
                response_logprobs=[-0.125 * (i + 1) for i in range(len(response_ids))],
                response={"content": answer, "reasoning_content": None, "tool_calls": None},
                finish_reason="stop", logprob_temperature=effective_temperature(temperature))
    base.update(fields)
    return events.Turn(**base)


def make_next_state(session_id: str, after: int, text: str | None, role: str = "user", name: str | None = None):
    """A :class:`pipeline.events.NextState` with one message (``text`` None: no message)."""
    from pipeline import events

    msgs = []
    if text is not None:
        msgs = [{"role": role, "content": text, **({"name": name} if name else {})}]
    return events.NextState(session_id=session_id, messages=msgs, after_turn_index=after,
                            created_at=events.now_ms())


class JudgeThread:
    """Run a :class:`pipeline.judge.app.JudgeApp` in a background thread (context manager)."""

    def __init__(self, config, **kwargs) -> None:
        from pipeline.judge.app import JudgeApp

        self.app = JudgeApp(config, **kwargs)
        self.rc: int | None = None
        self._thread = threading.Thread(target=self._run, name="judge-app", daemon=True)

    def _run(self) -> None:
        self.rc = self.app.run(install_signals=False)

    def __enter__(self) -> "JudgeThread":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.app.stop()
        self._thread.join(timeout=60)


def scripted_stream(n_sessions: int, turns: int, seed: int = 0, window: int = 8, prefix: str = "s",
                    vote_delay_s: float = 0.0):
    """A synthetic ``turns`` stream for crash and rebalance tests, with its expected RL samples.

    Sessions interleave (``window`` open at a time, seeded random choice) but each keeps its
    order. Session ``i`` follows pattern ``i % 3``: 0 every turn gets a next state; 1 turn 0
    gets none (turn 1 arrives directly); 2 turn 1 gets an empty next state. Every session ends
    with ``SessionEnd`` (its last turn is flushed). A joined turn's vote is scripted into its
    next state (answered after ``vote_delay_s``), so a re-judged turn gets the same vote.

    Returns ``(events, expected)`` with ``expected[sample_id] = (reward, loss_mask)`` for mode rl,
    computed from the at-least-one rule as documented in :mod:`pipeline.judge.join`.
    """
    import random

    from pipeline import events

    from pipeline.judge.samples import sample_id

    rng = random.Random(seed)
    per_session, expected = [], {}
    for i in range(n_sessions):
        sid = f"{prefix}{i}"
        evs = []
        for k in range(turns):
            t = make_turn(sid, k, request=f"request {k} of {sid}", response_ids=[10 + k, 20 + i % 50, 30])
            evs.append(t)
            sample = sample_id(t, "rl")
            last = k == turns - 1
            if last or (i % 3 == 1 and k == 0):
                expected[sample] = (None, 0)  # never judged (no next state): no reward
                continue
            if i % 3 == 2 and k == 1:
                evs.append(make_next_state(sid, k, None))
                expected[sample] = (None, 0)  # an empty next state is not judged
                continue
            v = (i + 2 * k) % 3 - 1
            item = f"\\boxed{{{v}}}" if not vote_delay_s else f"!sleep {vote_delay_s} \\boxed{{{v}}}"
            evs.append(make_next_state(sid, k, f"reply {k} <<score: {item}>>"))
            expected[sample] = (float(v), 1 if (v != 0 or k == 0) else 0)  # at-least-one: turn 0
        evs.append(events.SessionEnd(session_id=sid))
        per_session.append(evs)
    out, open_, pending = [], [], list(reversed(per_session))
    while pending or open_:
        while pending and len(open_) < window:
            open_.append(pending.pop())
        j = rng.randrange(len(open_))
        out.append(open_[j].pop(0))
        if not open_[j]:
            open_.pop(j)
    return out, expected


def check_samples(samples, expected: dict) -> dict:
    """Check a samples stream against ``expected`` after de-duplication by ``sample_id``.

    Returns ``{"unique", "duplicates", "missing", "unexpected", "mismatched", "reordered"}``:
    lists of ids (``reordered``: sessions whose first occurrences are not in turn order), and
    counts for ``unique`` / ``duplicates``. Duplicates must equal the first occurrence in
    reward and loss_mask (else they are reported as mismatched).
    """
    first, dups, mismatched = {}, 0, []
    order: dict[str, list[int]] = {}
    for s in samples:
        if s.sample_id in first:
            dups += 1
            f = first[s.sample_id]
            if (f.reward, f.loss_mask) != (s.reward, s.loss_mask):
                mismatched.append(s.sample_id)
            continue
        first[s.sample_id] = s
        order.setdefault(s.session_id, []).append(s.turn_index)
        want = expected.get(s.sample_id)
        if want is not None and (s.reward, s.loss_mask) != want:
            mismatched.append(s.sample_id)
    return {"unique": len(first), "duplicates": dups,
            "missing": sorted(set(expected) - set(first)), "unexpected": sorted(set(first) - set(expected)),
            "mismatched": sorted(set(mismatched)),
            "reordered": sorted(sid for sid, idx in order.items() if idx != sorted(idx))}
