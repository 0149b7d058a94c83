"""Stand-in judge endpoints for tests and benchmarks (real HTTP servers, scripted answers).

:class:`ScriptedJudgeServer` speaks the subset of the OpenAI / SGLang HTTP API the judge uses
(``POST /v1/chat/completions``, ``POST /generate``, ``GET /health``) and answers from a
*script* written into the conversation itself, so a test controls every vote through the
next-state text it publishes. It is not a model.

Script directives (anywhere in the prompt text the judge sends):

- ``<<score: A || B || C>>``: answers to PRM (score) prompts; the n-th call for the same prompt
  gets item ``n mod len``. Items are raw completion texts (e.g. ``\\boxed{1.0}``, ``no box``).
- ``<<hint: A || B>>``: the same for OPD hint prompts (recognised by ``[HINT_START]`` in the system prompt).
- Special items: ``!500`` (HTTP 500), ``!400`` (HTTP 400), ``!hang`` (sleep ``hang_s``
  seconds before answering), ``!sleep S TEXT`` (answer TEXT after S seconds).
- ``<<choice: X>>`` (``/generate`` with a ``tokenizer`` given): the scored continuation whose text
  contains ``\\boxed{X}`` gets log-prob 0 per token, the others -5.

Without a directive, score prompts get ``\\boxed{0}`` and hint prompts ``\\boxed{-1}``.
``/generate`` with ``max_new_tokens=0`` returns SGLang-shaped ``input_token_logprobs`` (and
``input_top_logprobs`` when ``top_logprobs_num`` > 0) with deterministic values, so OPD plumbing
can be checked for shape and alignment. ``calls`` counts requests per route.

:class:`InstantJudgeServer` answers every chat call with ``\\boxed{1}`` at once (benchmarks).
Both run in a background thread (uvicorn on a free 127.0.0.1 port) or, for benchmarks, as a
subprocess: ``python -m pipeline.judge.testing [--instant]`` prints ``PORT <n>``.
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from collections import Counter, defaultdict

import orjson

_DIRECTIVE = re.compile(r"<<(score|hint|choice):(.*?)>>", re.S)


def free_socket() -> socket.socket:
    """A listening-ready TCP socket bound to a free port on 127.0.0.1."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    return s


def fake_logprob(token_id: int, position: int) -> float:
    """The deterministic log-prob the scripted ``/generate`` reports (nats, in [-1, 0))."""
    return -((token_id * 7919 + position * 104729) % 1000 + 1) / 1000.0


class _AsgiServer:
    def __init__(self) -> None:
        self.calls: Counter = Counter()
        self._server = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    async def __call__(self, scope, receive, send):  # ASGI
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        path = scope["path"]
        self.calls[path] += 1
        try:
            status, payload = await self.route(scope["method"], path, orjson.loads(body) if body else {})
        except orjson.JSONDecodeError:
            status, payload = 400, {"error": {"message": "body is not JSON"}}
        data = orjson.dumps(payload)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    async def route(self, method: str, path: str, body: dict):
        raise NotImplementedError

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:43567``."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "_AsgiServer":
        """Serve in a daemon thread; returns once the port accepts connections."""
        import uvicorn

        sock = free_socket()
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self, log_level="warning", lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("judge test server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop serving and join the thread."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def _chat_answer(text: str) -> dict:
    return {"id": "chatcmpl-scripted", "object": "chat.completion", "created": int(time.time()),
            "model": "scripted-judge",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": text, "reasoning_content": None,
                                     "tool_calls": None}}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}


class ScriptedJudgeServer(_AsgiServer):
    """A stand-in judge endpoint driven by ``<<score: ...>>`` / ``<<hint: ...>>`` directives.

    Args:
        hang_s: how long ``!hang`` sleeps (longer than the judge's vote time-out in tests).
        tokenizer: optional HF tokenizer, to decode ``/generate`` input ids for ``<<choice: X>>``.
    """

    def __init__(self, hang_s: float = 30.0, tokenizer=None) -> None:
        super().__init__()
        self.hang_s = hang_s
        self.tokenizer = tokenizer
        self._counters: dict[tuple, int] = defaultdict(int)
        self.generate_bodies: list[dict] = []

    async def route(self, method: str, path: str, body: dict):
        if path in ("/health", "/health_generate"):
            return 200, {}
        if path == "/v1/chat/completions":
            return await self._chat(body)
        if path == "/generate":
            return self._generate(body)
        return 404, {"error": {"message": f"no route {path}"}}

    async def _chat(self, body: dict):
        msgs = body.get("messages") or []
        text = "\n".join(str(m.get("content", "")) for m in msgs if isinstance(m, dict))
        system = " ".join(str(m.get("content", "")) for m in msgs if isinstance(m, dict) and m.get("role") == "system")
        kind = "hint" if "[HINT_START]" in system else "score"
        items = None
        for m in _DIRECTIVE.finditer(text):
            if m.group(1) == kind:
                items = [i.strip() for i in m.group(2).split("||")]
        if items is None:
            items = ["\\boxed{0}"] if kind == "score" else ["\\boxed{-1}"]
        key = (kind, text)
        n = self._counters[key]
        self._counters[key] = n + 1
        item = items[n % len(items)]
        if item.startswith("!sleep "):  # "!sleep 0.5 <answer>"
            _, secs, item = item.split(" ", 2)
            await asyncio.sleep(float(secs))
        if item == "!hang":
            await asyncio.sleep(self.hang_s)
            item = "\\boxed{0}"
        if item == "!500":
            return 500, {"object": "error", "message": "scripted failure", "code": 500}
        if item == "!400":
            return 400, {"object": "error", "message": "scripted bad request", "code": 400}
        return 200, _chat_answer(item)

    def _generate(self, body: dict):
        self.generate_bodies.append(body)
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids:
            return 400, {"error": {"message": "input_ids cannot be empty."}}
        start = int(body.get("logprob_start_len", -1))
        if start >= len(ids):
            return 400, {"error": {"message": "logprob_start_len is higher than the number of input tokens"}}
        k = int(body.get("top_logprobs_num") or 0)
        positions = range(start + 1, len(ids)) if start >= 0 else range(0)
        choice_lp = None
        if self.tokenizer is not None and start >= 0:
            full = self.tokenizer.decode(ids)
            m = re.search(r"<<choice:\s*(-?\d)\s*>>", full)
            if m:
                tail = self.tokenizer.decode(ids[start + 1:])
                choice_lp = 0.0 if f"\\boxed{{{m.group(1)}}}" in tail else -5.0
        entries, tops = [], []
        for i in positions:
            lp = choice_lp if choice_lp is not None else fake_logprob(ids[i], i)
            entries.append([lp, ids[i], None])
            if k:
                tops.append([[fake_logprob(ids[i] + j, i) - j, ids[i] + j, None] for j in range(k)])
        if start == 0:
            entries.insert(0, [None, ids[0], None])
            if k:
                tops.insert(0, None)
        meta = {"id": "scripted", "finish_reason": {"type": "length", "length": 0},
                "prompt_tokens": len(ids), "completion_tokens": 0, "weight_version": "scripted",
                "input_token_logprobs": entries, "output_token_logprobs": []}
        if k:
            meta["input_top_logprobs"] = tops
            meta["output_top_logprobs"] = []
        return 200, {"text": "", "output_ids": [], "meta_info": meta}


class FixedLogitsServer(_AsgiServer):
    """A stand-in teacher engine (not a model): ``/generate`` scoring where the logits at every
    position are ``logits`` over token ids ``0 .. len(logits)-1`` (the rest -inf), whatever the
    prompt, and the reported log-probs are ``log_softmax(logits / T)`` with T the request's
    ``sampling_params.temperature`` (1.0 when absent; < 1e-6 is greedy, i.e. 1.0), as the CPU
    engine and SGLang (``SGLANG_TEMP_SCALED_LOGPROBS=1``) do. A hint therefore changes nothing.
    ``generate_bodies`` records each request."""

    def __init__(self, logits=(2.0, 1.0, 0.0)) -> None:
        super().__init__()
        self.logits = [float(x) for x in logits]
        self.generate_bodies: list[dict] = []

    def log_prob(self, token_id: int, temperature: float) -> float:
        """log_softmax(logits / T)[token_id] in nats (-inf outside the support)."""
        import math

        if not 0 <= token_id < len(self.logits):
            return -math.inf
        z = [x / temperature for x in self.logits]
        m = max(z)
        return z[token_id] - m - math.log(sum(math.exp(v - m) for v in z))

    async def route(self, method: str, path: str, body: dict):
        if path != "/generate":
            return 200, {}
        self.generate_bodies.append(body)
        ids, start = body["input_ids"], int(body.get("logprob_start_len", -1))
        t = float((body.get("sampling_params") or {}).get("temperature", 1.0))
        t = 1.0 if t < 1e-6 else t
        entries = [[self.log_prob(ids[i], t), ids[i], None] for i in range(max(start, 0) + 1, len(ids))]
        meta = {"id": "fixed", "finish_reason": {"type": "length", "length": 0}, "prompt_tokens": len(ids),
                "completion_tokens": 0, "weight_version": "fixed", "input_token_logprobs": entries,
                "output_token_logprobs": []}
        return 200, {"text": "", "output_ids": [], "meta_info": meta}


class InstantJudgeServer(_AsgiServer):
    """Answers every chat completion with ``\\boxed{1}`` immediately (benchmark baseline)."""

    _ANSWER = orjson.loads(orjson.dumps(_chat_answer("Looks fine. \\boxed{1}")))

    async def route(self, method: str, path: str, body: dict):
        if path == "/v1/chat/completions":
            return 200, self._ANSWER
        return 200, {}


def main(argv=None) -> int:  # pragma: no cover - used by bench/judge.py
    """Serve a stand-in judge in the foreground; prints ``PORT <n>`` once listening."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instant", action="store_true", help="InstantJudgeServer instead of ScriptedJudgeServer")
    args = ap.parse_args(argv)
    srv = (InstantJudgeServer() if args.instant else ScriptedJudgeServer()).start()
    print(f"PORT {srv.port}", flush=True)
    try:
        sys.stdin.read()  # until the parent closes our stdin
    finally:
        srv.stop()
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())


# ---- stream helpers for tests and benchmarks -------------------------------------------------

def short_id(sample_id: str) -> str:
    """``<session>:<turn_index>:<mode>`` of a sample id (drops the turn's request id; an id of
    the older ``<session>:<turn_index>:<mode>`` form is returned as it is)."""
    return sample_id.rsplit(":", 1)[0] if sample_id.count(":") >= 3 else sample_id


def make_turn(session_id: str, turn_index: int, request: str = "question", answer: str = "answer",
              prompt_ids=(1, 2, 3, 4), response_ids=(5, 6, 7), temperature: float = 1.0,
              policy_version: int = 0, tools=None, request_id: str | None = None, renderer=None, **fields):
    """A main :class:`pipeline.events.Turn` with small token arrays and log-probs.

    ``renderer`` (a :class:`pipeline.chat.ChatRenderer`): the prompt ids are the rendering of the
    turn's messages and tools (as the engine would have used), not ``prompt_ids``. ``fields``
    override any other Turn field (``finish_reason``, ``chat_options``, ``logprob_processors`` ...).
    """
    from pipeline import events
    from pipeline.sampling import effective_temperature

    response_ids = list(response_ids)
    messages = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": request}]
    if renderer is not None:
        from pipeline.chat import PromptSpec

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


def publish(config, evs, topic: str = "turns") -> None:
    """Publish events to a logical topic keyed by session id, and wait for the broker."""
    from pipeline.bus import EventProducer

    p = EventProducer(config, name="test-publisher")
    try:
        for ev in evs:
            p.send(config.topics.name(topic), ev, key=getattr(ev, "session_id", None))
        p.flush(30)
    finally:
        p.close()


def read_events(config, topic: str, expect, timeout_s: float = 30.0, settle_s: float = 0.3):
    """All events of a logical topic from the beginning (no group): waits for ``expect`` events
    (an int, or a predicate on the list read so far), then ``settle_s`` more for extras, or
    returns what arrived within ``timeout_s``."""
    from kafka import KafkaConsumer, TopicPartition

    from pipeline import events
    from pipeline.bus import consumer_kwargs

    name = config.topics.name(topic)
    c = KafkaConsumer(**consumer_kwargs(config, None))
    try:
        deadline = time.monotonic() + 10
        parts = None
        while not parts and time.monotonic() < deadline:
            parts = c.partitions_for_topic(name)
            if not parts:
                time.sleep(0.1)
        tps = [TopicPartition(name, p) for p in sorted(parts or [])]
        c.assign(tps)
        c.seek_to_beginning(*tps)
        out = []
        deadline = time.monotonic() + timeout_s
        settle_until = None
        while time.monotonic() < deadline:
            for recs in c.poll(timeout_ms=100).values():
                out.extend(events.decode(r.value) for r in recs)
            if (expect(out) if callable(expect) else len(out) >= expect):
                settle_until = settle_until or time.monotonic() + settle_s
                if time.monotonic() >= settle_until:
                    break
        return out
    finally:
        c.close()


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
