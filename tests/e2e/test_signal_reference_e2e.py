"""Issue 11: every token's advantage, through the real path, against the independent reference.

Real parts: the CPU engine (tiny-random) behind the real proxy, the ``pipeline import`` command
for recorded conversations, the broker, three real :class:`pipeline.judge.app.JudgeApp` (modes
``rl``, ``opd`` and ``combine``, own consumer groups, on the same ``turns``; the OPD teacher is
the same engine), the trainer's own ``samples`` reader
(:class:`pipeline.trainer.source.SampleSource`) and the Megatron-core
:meth:`PolicyTrainer.advantages` (and ``train_batch`` for the PPO objective), under two trainer
configurations (``normalize_advantages``, ``old_log_probs`` and the combine weights each off and
on). The judge LLM is ``StandInJudge``, a stand-in (not a model) whose votes and hints the
test writes into each next state.

Each test runs on two engine paths (the ``run`` fixture's parameter): ``native``, the CPU engine
itself, and ``sglang``, the SGLang-shaped stand-in
(:class:`pipeline.testing.sglang_style.SglangStyleEngine`: no token ids on streamed chat, no
reported sampling parameters) in front of the CPU engine serving tiny-random whose
``generation_config.json`` sets temperature 0.6 and a repetition penalty of 1.3. There a request
without ``temperature`` is sampled at 0.6 with the penalty (its turn must say both), and the
requests that set a temperature also send ``repetition_penalty: 1.0``.

The expected advantages are computed independently, with ``tests/reference_method.py``, from:

- the votes and hints the test scripted (the reference's majority vote, hint selection and the
  mode's dispatch),
- teacher log-probs the test scores itself: the student's recorded prompt ids, decoded, with
  ``\\n\\n[Hint] <hint>`` appended to the last user message as the method defines it,
  re-encoded, followed by the student's response ids, scored by the engine's ``/generate`` at
  the effective temperature the test derives from its own request (greedy and unset: 1.0),
- the behaviour log-probs: the rollout log-probs the proxy recorded on ``turns``, or the
  trainer's own recomputed ones (``old_log_probs: recompute``, and always for imported turns).

Fixture turns (the kind of their ``combine`` sample; ``rl`` and ``opd`` follow the reference's
dispatch, in ``rl`` with the at-least-one rule and the unjudged last turn of each session):

=================  =====================================  ===============================
session            request                                signals -> kind
=================  =====================================  ===============================
``opd-rl-t06``     T 0.6                                  votes 1,1,0 + hint -> opd+rl
``rl-minus``       T unset                                votes -1,-1,1, no hint -> rl
``rl-short-hint``  T 1.0                                  votes 1,1,1, hint too short -> rl
``opd-tie``        T 0.8                                  votes 1,-1,failed (tie 0) + one hint
                                                          among -1 hint votes -> opd
``greedy``         T 0, no system message                 votes -1 x3 + hint -> opd+rl
``tools``          T 0.7, ``tools``                       votes 1,1,-1 + three hints (longest
                                                          valid one wins) -> opd+rl
``stream``         T 0.9, streamed                        votes 1,1,-1 + hint -> opd+rl
``none``           T unset                                votes 0,0,1, no hint -> no sample
``two-turns`` 0    T 0.6                                  votes 1,1,-1 + hint -> opd+rl
``two-turns`` 1    T 0.6, after turn 0 and its reply      votes -1,0,-1 + hint -> opd+rl
``prefill`` 0      T 0.7                                  votes 1 x3 + hint -> opd+rl
``prefill`` 1      continues an assistant prefix          votes -1,-1,1 + hint -> opd+rl
                   (``continue_final_message``)
``parts``          user content as a list of text parts   votes -1,-1,-1 + hint -> opd+rl
``imported`` 0     ``pipeline import``, no log-probs      votes 1 x3 + hint -> opd+rl
``imported`` 1     ``pipeline import``, no log-probs      votes -1,-1,0, no hint -> rl
``imp-tools`` 0    imported tool call, next state: tool   votes 1,1,-1, no hint -> rl
``imp-tools`` 1    imported, prompt ends with the tool    votes 0,0,0 + hint -> opd
                   result (the hint goes to the user
                   message before it)
=================  =====================================  ===============================
"""

from __future__ import annotations

import contextlib
import json
import threading
from dataclasses import dataclass

import httpx
import numpy as np
import pytest

from tests import reference_method as ref
from tests.conftest import make_config
from pipeline import events
from pipeline.testing.judge import JudgeThread
from pipeline.testing.servers import StandInJudge
from pipeline.testing.topics import read_events

TOL = 1e-6
CHAT = "/v1/chat/completions"
MAX_TOKENS = 8
HINT_MIN_CHARS = 10  # the judge's rule: a hint counts when it is longer than this (judge.hint_min_chars)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


@dataclass
class Fixture:
    """One scripted judged turn: how it was requested and what the stand-in judge answers."""

    session: str
    question: str | list  # the user message's content (a list: text parts)
    votes: list  # +1 / 0 / -1, or None for an answer without a box (a failed vote)
    hint: str | list | None = None  # every hint vote gives this hint; a list: per vote (None: a -1 vote)
    temperature: float | None = None  # None: not sent
    tools: list | None = None
    stream: bool = False
    system: bool = True  # False: no system message (the chat template then adds its default one)
    prefill: str | None = None  # the request ends with this assistant text, continued (continue_final_message)
    imported: bool = False
    turn_index: int = 0

    @property
    def effective_temperature(self) -> float:
        """The temperature the rollout's log-probs are of (by the method's rule, not the package's):
        greedy (0) and unset are softmax(logits), i.e. 1.0; imported turns were never sampled: 1.0."""
        return self.temperature_on("native")

    def temperature_on(self, path: str) -> float:
        """:attr:`effective_temperature` on ``path``: on ``sglang`` the served model's
        generation_config says 0.6, which the engine samples an unset temperature at; on ``vllm``
        the recorded log-probs are vLLM's raw ones (temperature 1) whatever the request's."""
        if self.imported or self.temperature == 0 or path == "vllm":
            return 1.0
        if self.temperature is None:
            return GENERATION_CONFIG["temperature"] if path == "sglang" else 1.0
        return float(self.temperature)

    def penalised_on(self, path: str) -> bool:
        """Sampled with the generation_config's repetition penalty: an unset temperature on
        ``sglang`` (requests that set one also set ``repetition_penalty: 1.0`` there)."""
        return path == "sglang" and not self.imported and self.temperature is None

    @property
    def vote(self) -> float:
        return ref.majority_vote(self.votes)

    @property
    def hint_answers(self) -> list[tuple[int, str | None]]:
        """The scripted hint votes, ``(vote, hint)``; no hint: every vote -1."""
        items = self.hint if isinstance(self.hint, list) else [self.hint] * 3
        return [(1, h) if h is not None else (-1, None) for h in items]

    @property
    def accepted_hint(self) -> str | None:
        return ref.select_hint(self.hint_answers, HINT_MIN_CHARS)

    @property
    def hint_accepted(self) -> bool:
        return self.accepted_hint is not None

    def expected(self, mode: str) -> tuple[float | None, bool, int] | None:
        """(reward or None, has teacher, loss_mask) of this judged turn's sample in ``mode`` by the
        reference's dispatch, or None: no sample. ``rl``: the session's turn 0 is trained even with a
        vote of 0 (the at-least-one rule as this project defines it; every fixture's turn 0 is
        judged, so OpenClaw-RL's "first judged turn" gives the same here)."""
        if mode == "rl":
            reward, mask = ref.rl_signals(self.vote)
            return reward, False, 1 if self.turn_index == 0 and reward is not None else mask
        got = ref.opd_signals(self.hint_accepted) if mode == "opd" else ref.combine_signals(self.vote,
                                                                                           self.hint_accepted)
        return None if got is None else (*got, 1)

    def next_state_text(self, lead: str) -> str:
        items = " || ".join("no box" if v is None else f"\\boxed{{{v}}}" for v in self.votes)
        text = f"{lead} <<score: {items}>>"
        # (always given: it also overrides a hint directive earlier in the conversation, imported turn 1)
        hints = " || ".join(f"\\boxed{{1}} [HINT_START]{h}[HINT_END]" if v == 1 else "\\boxed{-1}"
                            for v, h in self.hint_answers)
        return f"{text} <<hint: {hints}>>"


PROXIED = [
    Fixture("opd-rl-t06", "How tall is the Eiffel tower?", [1, 1, 0], "Give the height in metres, not feet.",
            temperature=0.6),
    Fixture("rl-minus", "Name a prime number.", [-1, -1, 1]),
    Fixture("rl-short-hint", "Say hello.", [1, 1, 1], "Be brief.", temperature=1.0),
    Fixture("opd-tie", "What is two plus two?", [1, -1, None], [None, None, "Answer with a single digit only."],
            temperature=0.8),
    Fixture("greedy", "Spell the word cat.", [-1, -1, -1], "Write the letters separated by dashes.", temperature=0,
            system=False),
    Fixture("tools", "What is the weather in Paris?", [1, 1, -1],
            ["Use the tool.", "Call get_weather with city Paris.", "Too short"], temperature=0.7, tools=TOOLS),
    Fixture("stream", "Count to three.", [1, 1, -1], "Write the numbers as digits, one per line.",
            temperature=0.9, stream=True),
    Fixture("none", "Tell me a joke.", [0, 0, 1]),
    Fixture("two-turns", "Pick a colour.", [1, 1, -1], "Name one colour and nothing else.", temperature=0.6),
    Fixture("two-turns", "Now pick a fruit.", [-1, 0, -1], "Answer with one fruit in lower case.",
            temperature=0.6, turn_index=1),
    Fixture("prefill", "How long is a marathon?", [1, 1, 1], "Give the distance in kilometres.", temperature=0.7),
    Fixture("prefill", "In miles?", [-1, -1, 1], "Round to one decimal place.", temperature=0.7, turn_index=1,
            prefill="It is about"),
    Fixture("parts", [{"type": "text", "text": "Translate "}, {"type": "text", "text": "good morning to French."}],
            [-1, -1, -1], "Use the formal greeting Bonjour.", temperature=0.5),
]
IMPORTED = [
    Fixture("imported", "How far away is the moon?", [1, 1, 1], "State the distance in kilometres.",
            imported=True, turn_index=0),
    Fixture("imported", "Thanks. And the sun?", [-1, -1, 0], imported=True, turn_index=1),
]
IMPORTED_ANSWERS = ["About 384,400 km on average.", "About 150 million km."]
IMPORTED_TOOLS = [  # turn 0 calls a tool (its next state is the tool's result); turn 1 answers after it
    Fixture("imp-tools", "What is the weather in Oslo?", [1, 1, -1], imported=True, turn_index=0, tools=TOOLS),
    Fixture("imp-tools", "", [0, 0, 0], "Give the temperature in Celsius first.", imported=True, turn_index=1,
            tools=TOOLS),
]
FIXTURES = PROXIED + IMPORTED + IMPORTED_TOOLS


# ---------------------------------------------------------------------------------- helpers


def _chat(url: str, body: dict, headers: dict) -> dict:
    """One chat completion through the proxy; the assistant message (streamed: reassembled)."""
    if not body.get("stream"):
        r = httpx.post(url + CHAT, json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]
    content = []
    with httpx.stream("POST", url + CHAT, json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for ch in chunk.get("choices") or []:
                content.append((ch.get("delta") or {}).get("content") or "")
    return {"role": "assistant", "content": "".join(content)}


def _drive(url: str, session: list[Fixture], path: str = "native") -> None:
    """One session: each fixture's request (turn k), then the user's reply carrying its script,
    which for k > 0 is also where turn k's question is; the last reply ends the session. On
    ``sglang`` a request that sets a temperature also overrides the model's repetition penalty
    (1.0), so its turn stays scorable by the teacher; one without takes both defaults."""
    first = session[0]
    body = {"max_tokens": MAX_TOKENS}
    if first.temperature is not None:
        body["temperature"] = first.temperature
        if path == "sglang":
            body["repetition_penalty"] = 1.0
    if first.tools is not None:
        body["tools"] = first.tools
    if first.stream:
        body["stream"] = True
    messages = [{"role": "system", "content": "You are helpful."}] if first.system else []
    messages.append({"role": "user", "content": first.question})
    h = {"X-Session-Id": first.session}
    for k, fx in enumerate(session):
        if fx.prefill is None:
            answer = _chat(url, dict(body, messages=messages), h)
        else:  # the client echoes the whole assistant message afterwards: prefix + continuation
            answer = _chat(url, dict(body, messages=messages + [{"role": "assistant", "content": fx.prefill}],
                                     continue_final_message=True), h)
            answer = {"role": "assistant", "content": fx.prefill + answer["content"]}
        lead = session[k + 1].question if k + 1 < len(session) else "ok."
        messages = messages + [answer, {"role": "user", "content": fx.next_state_text(lead)}]
    _chat(url, dict(body, messages=messages), {**h, "X-Session-Done": "true"})


def _import(config, tmp_path) -> None:
    """The recorded conversation through ``pipeline import`` (in this process)."""
    from pipeline.cli import main

    msgs = [{"role": "system", "content": "You are helpful."}]
    for fx, answer in zip(IMPORTED, IMPORTED_ANSWERS):
        if fx.turn_index > 0:
            msgs[-1]["content"] = fx.question + " " + msgs[-1]["content"]  # the reply that precedes this turn
        else:
            msgs.append({"role": "user", "content": fx.question})
        msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": fx.next_state_text("right.")}]
    t0, t1 = IMPORTED_TOOLS
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    tool_msgs = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": t0.question},
                 {"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "call_1", "content": t0.next_state_text('{"sky": "clear", "c": 3}')},
                 {"role": "assistant", "content": "It is clear and 3 C in Oslo."},
                 {"role": "user", "content": t1.next_state_text("thanks.")}]
    path = tmp_path / "conversation.jsonl"
    path.write_text(json.dumps({"session_id": "imported", "messages": msgs}) + "\n" +
                    json.dumps({"session_id": "imp-tools", "messages": tool_msgs, "tools": TOOLS}) + "\n")
    rc = main(["import", str(path), "--bootstrap", config.kafka.bootstrap_servers, "--set",
               f"topics.prefix={config.topics.prefix}", "--set", "engine.model=tiny-random", "--no-progress"])
    assert rc == 0


def hinted_prompt_ids(tokenizer, prompt_ids: list[int], hint: str) -> list[int]:
    """The student's prompt with ``\\n\\n[Hint] <hint>`` appended to its last user message, built
    from the token ids themselves (decode, insert before that message's end marker, encode)."""
    text = tokenizer.decode(prompt_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert tokenizer.encode(text, add_special_tokens=False) == list(prompt_ids)  # the round trip is exact
    start = text.rindex("<|im_start|>user\n")
    end = text.index("<|im_end|>", start)
    return tokenizer.encode(text[:end] + f"\n\n[Hint] {hint}" + text[end:], add_special_tokens=False)


def score(engine_url: str, prompt: list[int], response: list[int], temperature: float, path: str = "native"
          ) -> list[float]:
    """log softmax(logits / T) of each response token after ``prompt``, from the engine's
    ``/generate`` prefill (prompt log-probs from position len(prompt)); on ``vllm`` from its
    ``/v1/completions`` prompt log-probs (temperature 1 only)."""
    if path == "vllm":
        assert temperature == 1.0
        body = {"model": VLLM_MODEL, "prompt": prompt + response, "max_tokens": 1, "prompt_logprobs": 0}
        r = httpx.post(engine_url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        rows = r.json()["choices"][0]["prompt_logprobs"][len(prompt):]
        return [float(row[str(t)]["logprob"]) for row, t in zip(rows, response, strict=True)]
    body = {"input_ids": prompt + response, "return_logprob": True, "logprob_start_len": len(prompt) - 1,
            "sampling_params": {"max_new_tokens": 0, "temperature": temperature}}
    r = httpx.post(engine_url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    entries = r.json()["meta_info"]["input_token_logprobs"][-len(response):]
    assert [e[1] for e in entries] == list(response)
    return [float(e[0]) for e in entries]


# ---------------------------------------------------------------------------------- the run


@dataclass
class Run:
    turns: dict  # (session, turn_index) -> Turn
    judged: dict  # mode -> every sample of that mode's judge on ``samples``
    batch: dict  # mode -> (samples, weights) of the trainer source's batch
    teacher: dict  # (session, turn_index) -> independently scored teacher log-probs
    unhinted: dict  # (session, turn_index) -> the engine's log-probs of the student's own prompt
    path: str = "native"  # the engine path the proxy used: native (our engine) or sglang (stand-in)


def expected_samples(mode: str) -> dict:
    """(session, turn_index) -> (reward, has teacher, loss_mask) of every sample ``mode`` must give:
    the judged fixtures, and in ``rl`` the last turn of each proxied session (no next state:
    no reward, never trained)."""
    out = {(fx.session, fx.turn_index): fx.expected(mode) for fx in FIXTURES if fx.expected(mode) is not None}
    if mode == "rl":
        for sid in {fx.session for fx in PROXIED}:
            out[sid, sum(fx.session == sid for fx in PROXIED)] = (None, False, 0)
    return out


MODES = ("rl", "opd", "combine")


#: the sglang path's model: tiny-random with these generation_config defaults (Qwen3 ships 0.6)
GENERATION_CONFIG = {"temperature": 0.6, "repetition_penalty": 1.3}


@contextlib.contextmanager
def _engine_path(path: str, tmp_path_factory):
    """``(engine URL the proxy uses, CPU engine URL, proxy's engine.model)``: ``native`` is the
    CPU engine serving tiny-random; ``sglang`` is the SGLang-shaped stand-in
    (:class:`pipeline.testing.sglang_style.SglangStyleEngine`) in front of the CPU engine serving
    tiny-random with :data:`GENERATION_CONFIG` in its generation_config.json."""
    import shutil

    from pipeline.models import resolve_model
    from pipeline.testing.engine import running_engine
    from pipeline.testing.servers import serve_app
    from pipeline.testing.sglang_style import SglangStyleEngine
    from pipeline.testing.vllm import require_vllm, running_vllm

    if path == "vllm":
        require_vllm()
        # no LoRA: vLLM 0.32 (CPU) with LoRA on crashed scoring prompt log-probs beside generation
        with running_vllm(VLLM_MODEL, max_model_len=1024, enable_lora=False) as url:
            yield url, url, VLLM_MODEL
        return
    model = "tiny-random"
    if path == "sglang":
        folder = tmp_path_factory.mktemp("gen-config") / "model"
        shutil.copytree(resolve_model("tiny-random"), folder)
        gen = json.loads((folder / "generation_config.json").read_text())
        (folder / "generation_config.json").write_text(json.dumps({**gen, **GENERATION_CONFIG}))
        model = str(folder)
    with running_engine(model, threads=1, context_length=1024) as eng:
        if path == "native":
            yield eng, eng, model
            return
        with serve_app(SglangStyleEngine(eng)) as sglang:
            yield sglang, eng, model


#: the vllm path's model (vLLM's CPU attention refuses tiny-random's 16-wide heads)
VLLM_MODEL = "tiny-random-64"


@pytest.fixture(scope="module", params=["native", "sglang", "vllm"])
def run(request, broker_bootstrap, tmp_path_factory, runtime) -> Run:
    """Everything up to the trainer's batch, once per engine path: one judge per mode (own
    consumer group) on the same ``turns``, all writing to ``samples``."""
    path = request.param
    import uuid

    from transformers import AutoTokenizer

    from pipeline.models import resolve_model
    from pipeline.testing.proxy import running_proxy
    from pipeline.bus.admin import apply_topics
    from pipeline.topics import load_topics
    from pipeline.trainer.source import SampleSource

    c = make_config(broker_bootstrap, f"t-signal-ref-{uuid.uuid4().hex[:6]}-")
    apply_topics(c, load_topics(c.topics.file))
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model("tiny-random")))
    want = {mode: expected_samples(mode) for mode in MODES}
    with contextlib.ExitStack() as up:
        # one stand-in judge per mode: each answers its own calls in the scripted order
        servers = {mode: up.enter_context(StandInJudge()) for mode in MODES}
        front, eng, served = up.enter_context(_engine_path(path, tmp_path_factory))
        kind = {"engine": {"kind": "vllm"}} if path == "vllm" else {}
        c = c.replace(**kind)
        url, app = up.enter_context(running_proxy(c.replace(engine={"model": served}), front))
        for sid in dict.fromkeys(fx.session for fx in PROXIED):
            _drive(url, [fx for fx in PROXIED if fx.session == sid], path)
        assert app.publisher.wait_idle(10)
        _import(c, tmp_path_factory.mktemp("import"))
        n_sessions = len({fx.session for fx in FIXTURES})
        turns = {(e.session_id, e.turn_index): e for e in read_events(
            c, "turns", lambda out: sum(isinstance(e, events.SessionEnd) for e in out) == n_sessions)
            if isinstance(e, events.Turn)}
        c = c.replace(judge={"backend": "llm", "vote_timeout_s": 10.0, "retries": 0, "retry_backoff_s": 0.05,
                             "votes": 3, "hint_min_chars": HINT_MIN_CHARS},
                      engine={"model": served if path == "vllm" else "tiny-random", "teacher_url": front},
                      # each stand-in judge answers its calls in a scripted order, so a turn judged twice would
                      # take the next turn's answers: three judges, a proxy and an engine share this process,
                      # and on a loaded worker a 2 s session timeout expelled a starved judge from its group
                      # (its turns re-delivered and judged again, as at-least-once delivery allows)
                      kafka={"session_timeout_ms": 15000, "heartbeat_interval_ms": 1000})
        total = sum(len(w) for w in want.values())
        with contextlib.ExitStack() as judges:
            for mode in MODES:
                cm = c.replace(judge={"url": servers[mode].url, "mode": mode,
                                      "group_id": f"{c.topics.prefix}judge-{mode}"})
                judges.enter_context(JudgeThread(cm))
            judged = read_events(c, "samples", total, timeout_s=240, settle_s=1.0)  # a loaded CI worker
        assert len(judged) == total, sorted(s.sample_id for s in judged)
        teacher, unhinted = {}, {}
        for fx in FIXTURES:
            t = turns[(fx.session, fx.turn_index)]
            unhinted[fx.session, fx.turn_index] = score(eng, list(t.prompt_token_ids), list(t.response_token_ids),
                                                        fx.temperature_on(path), path)
            if fx.hint_accepted:
                teacher[fx.session, fx.turn_index] = score(
                    eng, hinted_prompt_ids(tokenizer, list(t.prompt_token_ids), fx.accepted_hint),
                    list(t.response_token_ids), fx.temperature_on(path), path)
    # read them as the trainer does: its source, one batch of every trainable sample
    c = c.replace(trainer={"model": served if path == "vllm" else "tiny-random",
                           "rollout_batch_size": sum(e[2] for w in want.values() for e in w.values())})
    source = SampleSource(c)
    stop = threading.Event()
    timer = threading.Timer(60, stop.set)
    timer.start()
    try:
        batch = source.next_batch(trainer_version=0, stop=stop)
    finally:
        timer.cancel()
        source.close()
    assert batch is not None, "the trainer's source did not fill a batch of every trainable sample"
    assert batch.stats["dead_letters"] == 0 and batch.stats["duplicates"] == 0, batch.stats
    by_mode = {m: ([], []) for m in MODES}
    for s, w in zip(batch.samples, batch.weights):
        by_mode[mode_of(s)][0].append(s)
        by_mode[mode_of(s)][1].append(w)
    return Run(turns, {m: [s for s in judged if mode_of(s) == m] for m in MODES}, by_mode, teacher, unhinted, path)


def mode_of(sample) -> str:
    """The judge mode in a sample id (``<session>:<turn_index>:<mode>:<request id>``)."""
    return sample.sample_id.split(":")[2]


# ---------------------------------------------------------------------------------- tests


def test_turns_record_what_the_reference_needs(run):
    """The proxy recorded the engine's log-probs at the effective temperature; imported turns have none."""
    for fx in FIXTURES:
        t = run.turns[fx.session, fx.turn_index]
        assert len(t.response_token_ids) > 0
        if fx.imported:
            assert t.source == "import" and t.response_logprobs == []
            continue
        assert t.source == "proxy" and t.logprob_temperature == pytest.approx(fx.temperature_on(run.path))
        assert t.logprob_processors == (["repetition_penalty"] if fx.penalised_on(run.path) else [])
        assert t.tools == fx.tools
        assert t.chat_options == ({"continue_final_message": True} if fx.prefill else {})
        # the rollout log-probs are the engine's own at the effective temperature (not at the request's)
        if fx.penalised_on(run.path):  # shaped by the penalty: no prefill reproduces them (nor a teacher)
            continue
        np.testing.assert_allclose(t.response_logprobs, run.unhinted[fx.session, fx.turn_index], atol=1e-4, rtol=0)


@pytest.mark.parametrize("mode", MODES)
def test_samples_say_which_signals_they_carry(run, mode):
    """One sample per turn with a signal in ``mode``, of the reference's kind, reward present
    exactly when the mode's dispatch gives one, teacher log-probs exactly with an accepted hint,
    rollout log-probs exactly for proxied turns; the trainer's batch is the trainable ones."""
    got = {(s.session_id, s.turn_index): s for s in run.judged[mode]}
    want = expected_samples(mode)
    assert set(got) == set(want) and len(run.judged[mode]) == len(want)
    for key, (reward, has_teacher, mask) in want.items():
        s, t = got[key], run.turns[key]
        assert s.kind == {(True, True): "opd+rl", (True, False): "rl", (False, True): "opd"}.get(
            (reward is not None, has_teacher), mode), key
        assert s.reward == reward and s.loss_mask == mask, key
        assert (s.teacher_log_probs is not None) == has_teacher, key
        fx = next((f for f in FIXTURES if (f.session, f.turn_index) == key), None)
        assert s.hint == (fx.accepted_hint if has_teacher else None), key
        assert (s.rollout_log_probs is None) == (t.source == "import"), key
        assert s.rollout_temperature == pytest.approx(fx.temperature_on(run.path) if fx else t.logprob_temperature), key
        assert s.tokens == list(t.prompt_token_ids) + list(t.response_token_ids) and \
            s.response_length == len(t.response_token_ids), key
        if t.source != "import":
            assert s.rollout_log_probs == list(t.response_logprobs), key
    assert sorted(s.sample_id for s in run.batch[mode][0]) == sorted(s.sample_id for s in run.judged[mode]
                                                                       if s.loss_mask)
    # the fixture exercises what it claims
    if mode == "combine":  # every kind, proxied and imported
        assert {(s.kind, s.source) for s in got.values()} >= {(k, src) for k in ("opd", "rl", "opd+rl")
                                                              for src in ("proxy", "import")}
    if mode == "rl":  # the at-least-one rule and a masked vote of 0
        assert {(s.reward, s.loss_mask) for s in got.values()} >= {(0.0, 1), (0.0, 0), (None, 0), (1.0, 1),
                                                                    (-1.0, 1)}


def test_hints_change_the_teacher(run):
    """The comparison can see a wrong teacher: each hint moves the teacher away from the student."""
    for key, lp in run.teacher.items():
        assert float(np.max(np.abs(np.asarray(lp) - np.asarray(run.unhinted[key])))) > 100 * TOL, key


CONFIGS = {  # trainer settings (each costs a few seconds: two configs cover both sides of each option)
    "rollout": dict(),
    "recompute-normalised-weighted": dict(normalize_advantages=True, old_log_probs="recompute", w_rl=0.5, w_opd=2.0),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_token_advantage_matches_the_reference(run, runtime, name):
    """Each mode's trainable samples, as one trainer batch: ``PolicyTrainer.advantages`` equals
    the reference's per-token advantage on every token (1e-6); then the PPO objective of the
    combine batch."""
    from pipeline.config import load_config
    from pipeline.models import resolve_model
    from pipeline.trainer.policy import PolicyTrainer

    model = VLLM_MODEL if run.path == "vllm" else "tiny-random"  # the engine's model
    cfg = load_config(None, trainer=dict(model=model, micro_batch_size=4, **CONFIGS[name])).trainer
    pt = PolicyTrainer(cfg, resolve_model(model), runtime)
    report = []
    for mode in MODES:
        samples, weights = run.batch[mode]
        got = pt.advantages(samples, weights)
        recomputed = pt.log_probs(samples)  # the trainer's own log-probs (no update has happened)
        refs, old = [], []
        for s, rec in zip(samples, recomputed):
            key = (s.session_id, s.turn_index)
            reward, has_teacher, mask = expected_samples(mode)[key]
            assert mask == 1
            t = run.turns[key]
            r = ref.RefSample(response_length=len(t.response_token_ids), reward=reward,
                              teacher=run.teacher[key] if has_teacher else None,
                              rollout=None if t.source == "import" else list(t.response_logprobs))
            refs.append(r)
            old.append(ref.behaviour_log_probs(r, rec, cfg.old_log_probs))
            # the trainer scores at the turn's effective temperature
            np.testing.assert_allclose(rec, run.unhinted[key], atol=1e-4, rtol=0, err_msg=s.sample_id)
        want = ref.token_advantages(refs, old, w_rl=cfg.w_rl, w_opd=cfg.w_opd, normalize=cfg.normalize_advantages)
        worst = 0.0
        for s, g, w in zip(samples, got, want):
            assert len(g) == len(w), s.sample_id
            diff = float(np.max(np.abs(np.asarray(g, dtype=np.float64) - w))) if len(w) else 0.0
            worst = max(worst, diff)
            assert diff <= TOL, (mode, s.sample_id, g, w.tolist())
        report.append(f"{mode} {sum(len(w) for w in want)} tokens/{len(want)} samples max diff {worst:.1e}")
        if cfg.normalize_advantages and mode != "opd":  # the normalisation changes the RL term on this batch
            plain = ref.rl_advantages([r.reward for r in refs])
            normed = ref.rl_advantages([r.reward for r in refs], normalize=True)
            assert max(abs(a - b) for a, b in zip(plain, normed)) > 0.1, mode
    print(f"{name}: " + "; ".join(report))
    # and the PPO objective of the combine batch (before the update: current = recomputed log-probs)
    m = pt.train_batch(samples, weights, policy_version=0).metrics
    obj = ref.objective(refs, recomputed, recomputed, old_mode=cfg.old_log_probs, w_rl=cfg.w_rl, w_opd=cfg.w_opd,
                        normalize=cfg.normalize_advantages, eps_clip=cfg.eps_clip, eps_clip_high=cfg.eps_clip_high,
                        dual_clip=cfg.eps_clip_c, agg=cfg.loss_agg)
    for key in ("loss", "pg_loss", "pg_clipfrac", "ppo_kl"):
        assert m[key] == pytest.approx(obj[key], abs=TOL), (key, m[key], obj[key])
