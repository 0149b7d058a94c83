"""Judge backends against labelled next states, and against the real small model.

- ``embedding`` (tool-result structure, context and reply cues, fine-tuned MiniLM heads):
  agreement with the labelled fixture (tuned on, not trained on) and with the larger tuning set
  we wrote (its user replies are also training rows, so that bar checks the fit end to end,
  not generalisation: the held-out evaluation set does that; the bars are below the measured
  values so a broken judge fails), few sign errors, the simulated users'
  feedback read with its sign (``pipeline demo`` learns from it), and its OPD path in the stream
  (the corrective next state itself is the hint).
- The real small model (SmolLM2-135M-Instruct on the CPU engine) as the ``choice`` judge in the
  stream and as the OPD teacher: checks the plumbing (no parse failures, teacher log-probs
  aligned with the engine's own scoring of the same ids); its agreement is printed, not
  asserted (a 135M model is at chance as a judge).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.judge.judge_overlap import normalise, overlaps
from pipeline import events
from pipeline.config import load_config
from pipeline.engine_api.render import ChatRenderer, load_tokenizer
from pipeline.judge.backends.embedding import EmbeddingBackend
from pipeline.judge.cpu.classifier import training_examples
from pipeline.judge.evaluate import evaluate, load_rows, report, row_input
from pipeline.testing.judge import JudgeThread, make_next_state, make_turn, short_id
from pipeline.testing.servers import StandInJudge
from pipeline.testing.topics import publish, read_events

FIXTURE = Path(__file__).parents[1] / "fixtures" / "judge_next_states.jsonl"
DEV = Path(__file__).resolve().parents[2] / "pipeline" / "judge" / "data" / "tuning_next_states.jsonl"
EMBEDDING_BAR = 0.85  # measured 39/40 when written (the backend before issue 12: 34/40 with 2 sign errors)
# the tuning set's user replies are training rows: this bar checks the fit end to end, not
# generalisation (measured 473/505 = 93.7% with 1 sign error; before it was learned from: 447/505)
DEV_BAR = 0.85
MAX_SIGN_ERRORS = 0.02


@pytest.fixture(scope="module")
def embedding_backend():
    return EmbeddingBackend(load_config(None))


def test_fixture_is_labelled_and_has_tool_results():
    rows = load_rows(FIXTURE)
    roles = {r["next_state"][0]["role"] for r in rows}
    labels = {r["label"] for r in rows}
    assert len(rows) >= 40 and roles == {"user", "tool"} and labels == {1, 0, -1}


@pytest.mark.parametrize("path,bar", [(FIXTURE, EMBEDDING_BAR), (DEV, DEV_BAR)], ids=["fixture", "dev"])
def test_embedding_agreement_with_labelled_next_states(embedding_backend, path, bar):
    rows = load_rows(path)
    res, preds = asyncio.run(evaluate(embedding_backend, rows))
    print("\n" + report(res, rows, preds))
    assert res.n == len(rows) and res.failed == 0
    assert res.agreement >= bar, report(res, rows, preds)
    assert res.sign_error_rate <= MAX_SIGN_ERRORS, report(res, rows, preds)
    for role in ("user", "tool"):
        assert res.roles[role].agreement >= bar - 0.1, report(res, rows, preds)


def test_fixture_is_not_what_the_judge_learns_from():
    """The 40-row fixture was tuned on but is no training row (the larger tuning set's user
    replies are: :data:`~pipeline.judge.cpu.classifier.LABELLED_SETS`). One- and two-word
    replies ("perfect", "brb") are everyone's wording and are not compared."""
    examples = [e["text"] for e in training_examples()]
    rows = load_rows(FIXTURE)
    texts = [m["content"] if len(normalise(m["content"]).split()) > 2 else "" for r in rows for m in r["next_state"]]
    assert not [(examples[i], rows[j]["id"], kind) for i, j, kind in overlaps(examples, texts)]


def test_simulated_feedback_keeps_its_sign(embedding_backend):
    """``pipeline demo`` learns from the simulated users' messages: thanks must read +1, a
    "too long", a correction with a hint or a "one step per line" request -1 (and the
    corrective message is the OPD hint)."""
    from pipeline.simulate import feedback as fb

    hint = "Natalia sold 48/2 = 24 clips in May."
    cases = [(t, 1) for t in fb.THANKS_BRIEF + fb.THANKS_CORRECT + fb.THANKS_STEPS]
    cases += [(fb.TOO_LONG.format(n=n), -1) for n in (20, 40)] + [("That's not right. Please try again.", -1)]
    cases += [(t, -1) for t in fb.NOT_STEPWISE]
    cases += [(c.format(hint=hint), -1) for c in fb.CORRECTIONS]

    async def go():
        out = []
        for text, want in cases:
            inp = row_input({"request": "Natalia sold clips to 48 friends ...", "response": "She sold 72 clips.",
                             "next_state": [{"role": "user", "content": text}]})
            out.append((text, want, (await embedding_backend.score(inp)).score, (await embedding_backend.hint(inp))))
        return out

    for text, want, got, hv in asyncio.run(go()):
        assert got == want, text
        assert (hv.hint == text) == (want == -1), (text, hv)


def test_embedding_abstains_rather_than_guess(embedding_backend):
    """Empty, pending and contradictory next states score 0; a hint is refused with a reason."""
    async def go(role, text):
        inp = row_input({"request": "q", "response": "a", "next_state": [{"role": role, "content": text}]})
        return (await embedding_backend.score(inp)).score, await embedding_backend.hint(inp)

    for role, text in [("tool", ""), ("tool", "Job 12 queued, position 4"), ("user", "brb"), ("user", "")]:
        score, hv = asyncio.run(go(role, text))
        assert score == 0 and hv.hint is None and hv.reason in ("not_corrective", "empty_next_state"), (text, hv)
    score, hv = asyncio.run(go("user", "nope"))
    assert score == -1 and hv.hint is None and hv.reason == "hint_too_short"


def test_embedding_opd_uses_the_corrective_next_state_as_hint(kafka_config, embedding_backend):
    c = kafka_config
    correction = "That's incorrect, 17 times 23 is 391."  # classified -1 (corrective)
    with StandInJudge() as teacher:
        c = c.replace(judge={"group_id": f"{c.topics.prefix}judge"},
                      engine={"model": "tiny-random", "teacher_url": teacher.url})
        renderer = ChatRenderer(load_tokenizer("tiny-random"))  # the teacher checks the prompt ids
        publish(c, [make_turn("e", 0, request="What is 17*23?", answer="381", renderer=renderer),
                    make_next_state("e", 0, correction),
                    make_turn("e", 1), make_next_state("e", 1, "Perfect, thank you!"),
                    events.SessionEnd(session_id="e")])
        with JudgeThread(c, mode="opd", backend=embedding_backend):
            got = read_events(c, "samples", 1, timeout_s=30, settle_s=1.0)
    assert [(short_id(s.sample_id), s.hint, s.judge) for s in got] == [("e:0:opd", correction, "embedding")]
    assert len(got[0].teacher_log_probs) == got[0].response_length == 3


@pytest.mark.slow
def test_real_small_model_as_choice_judge_and_opd_teacher(kafka_config):
    from pipeline.engine_api.client import EngineClient
    from pipeline.testing.engine import running_engine
    from pipeline.judge.backends.choice import ChoiceBackend
    from pipeline.judge.teacher import Teacher

    rows = load_rows(FIXTURE)[::10]  # 4 rows: 3 scoring passes each on the CPU
    c = kafka_config
    with running_engine("smollm2-135m", threads=2) as url:
        c = c.replace(engine={"url": url, "teacher_url": url, "model": "smollm2-135m"},
                      judge={"url": url, "backend": "choice", "group_id": f"{c.topics.prefix}judge",
                             "vote_timeout_s": 120})

        async def direct():
            backend = ChoiceBackend(c)
            await backend.start()
            teacher = Teacher(c, tokenizer=backend.tokenizer)
            await teacher.start()
            try:
                res, preds = await evaluate(backend, rows, concurrency=4)
                turn = make_turn("t", 0, request="What is the capital of France?",
                                 response_ids=backend.tokenizer.encode("The capital is Paris.", add_special_tokens=False),
                                 renderer=teacher.renderer)
                out = await teacher.log_probs(turn, "Answer in one word.")
                prompt = teacher.prompt_ids(turn, "Answer in one word.")
                async with EngineClient(url) as client:
                    ref = await client.score(prompt + list(turn.response_token_ids), len(prompt))
                    # the student's own prompt (a hint that changes nothing) gives the rollout's
                    # distribution: teacher log-probs at the turn's temperature == the engine's
                    null = await teacher.score(teacher.prompt_ids(turn, None), list(turn.response_token_ids), 1.0)
                    ref0 = await client.score(list(turn.prompt_token_ids) + list(turn.response_token_ids),
                                              len(turn.prompt_token_ids))
                assert null.log_probs == pytest.approx(ref0, abs=1e-5)
                return res, preds, turn, out, ref
            finally:
                await backend.aclose()
                await teacher.aclose()

        res, preds, turn, out, ref = asyncio.run(direct())
        print("\nSmolLM2-135M as choice judge:\n" + report(res, rows, preds))
        assert res.n == len(rows) and res.failed == 0  # scoring never fails to parse
        assert len(out.log_probs) == len(turn.response_token_ids)
        assert out.log_probs == pytest.approx(ref, abs=1e-5)  # one to one with the engine's own scoring
        # and through the stream: Binary RL samples judged by the real model
        publish(c, [make_turn("r", 0), make_next_state("r", 0, "Thanks, that is right."),
                    make_turn("r", 1), make_next_state("r", 1, "Error: command not found", role="tool"),
                    events.SessionEnd(session_id="r")])
        with JudgeThread(c, mode="rl"):
            got = {short_id(s.sample_id): s for s in read_events(c, "samples", 2, timeout_s=120)}
    assert set(got) == {"r:0:rl", "r:1:rl"}
    assert all(s.judge == "choice" and s.votes != [None] for s in (got["r:0:rl"], got["r:1:rl"]))
    print("stream verdicts:", {k: (s.reward, s.loss_mask) for k, s in sorted(got.items())})
