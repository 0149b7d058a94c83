"""``python -m pipeline import FILE``: load OpenAI-format conversations as ``turns`` events.

Input: JSONL, one conversation per line::

    {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": ..., "tool_calls"?: [...]}, ...],
     "tools"?: [...], "session_id"?: str, "model"?: str}

For each assistant message (``turn_index`` 0, 1, ... in order, as the proxy numbers main turns):

- a :class:`pipeline.events.Turn` with ``source="import"``: ``messages`` = everything before it
  (as in the file), ``prompt_token_ids`` = those messages rendered exactly as the engine renders
  a request (:class:`pipeline.engine_api.render.ChatRenderer`: the model's chat template, tools in the
  system message if the template lacks them), ``response_token_ids`` = the assistant message as
  the engine would have emitted it (its text, tool calls as ``<tool_call>`` blocks, then EOS:
  the engine keeps the stop id), ``response_logprobs`` empty: these tokens were **not sampled**
  by any policy, so a stage must not treat them as on-policy (there are no rollout log-probs);
- a :class:`pipeline.events.NextState` with the messages between it and the next assistant
  message (user replies, tool results), if any;
- at the end a :class:`pipeline.events.SessionEnd` with ``reason="import"``.

If the rendering of "prompt + assistant" does not extend the prompt's tokens (templates that
rewrite history, e.g. drop reasoning), the response falls back to encoding the message alone. The session id is the line's ``session_id`` or a hash of the line; a
turn's ``request_id`` is ``import-<12 hex of sha256(messages, tools)>-<turn_index>``, so importing
the same conversation twice gives the same ids (the judge's ``sample_id`` then de-duplicates)
while another conversation under the same ``session_id`` never shares them.
"""

from __future__ import annotations

import hashlib
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import orjson

from pipeline import events
from pipeline.engine_api.render import ChatRenderer, ChatTemplateError, PromptSpec, content_text, normalise_tools
from pipeline.errors import PipelineError
from pipeline.models import resolve_model

log = logging.getLogger(__name__)
HELP = "Load OpenAI-format conversation JSONL as turn events (tokenized with the engine's tokenizer; source=import)."

ROLES = ("system", "user", "assistant", "tool", "developer", "function")


class ImportError_(PipelineError, ValueError):
    """A conversation line that cannot be imported (the message says which field)."""


def _validate(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ImportError_("'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ImportError_(f"messages[{i}] needs a role in {ROLES}")
    return messages


@dataclass
class Tokenizer:
    """The engine's tokenizer and chat rendering (:class:`pipeline.engine_api.render.ChatRenderer`: the
    same template, tool descriptions and ``<tool_call>`` rendering the engine applies to requests),
    loaded offline from :func:`pipeline.models.resolve_model`."""

    hf: object
    renderer: object
    eos_id: int | None

    @classmethod
    def load(cls, model: str, cache_dir: str | None = None) -> "Tokenizer":
        """Load the tokenizer of ``model`` (``smollm2-135m`` | ``tiny-random`` | HF folder)."""
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(resolve_model(model, cache_dir)))
        return cls(hf, ChatRenderer(hf), hf.eos_token_id)

    def prompt(self, messages: list[dict], tools: list | None) -> list[int]:
        """Token ids of ``messages`` rendered with the generation prompt (what the engine samples after)."""
        try:
            return self.renderer.render_spec(PromptSpec.from_request({"messages": messages, "tools": tools}))
        except ChatTemplateError as e:
            raise ImportError_(str(e)) from None

    def response(self, prompt_ids: list[int], messages: list[dict], tools: list | None) -> list[int]:
        """Token ids of the final (assistant) message as the engine would have emitted them:
        its rendered text (tool calls as ``<tool_call>`` blocks) followed by EOS."""
        full = self._render(messages, tools, continue_final_message=True)
        if full[:len(prompt_ids)] == prompt_ids:
            ids = full[len(prompt_ids):]
        else:  # a template that rewrites history: encode the message on its own
            last = self.renderer.normalise(messages, tools, continue_final_message=True)[-1]
            ids = list(self.hf.encode(last["content"], add_special_tokens=False))
        return ids + ([self.eos_id] if self.eos_id is not None else [])

    def _render(self, messages, tools, **kw) -> list[int]:
        try:
            return [int(t) for t in self.renderer.render_ids(messages, normalise_tools(tools), **kw)]
        except ChatTemplateError as e:
            raise ImportError_(str(e)) from None


def conversation_events(conv: dict, tok: Tokenizer, session_id: str, *, policy_version: int = 0,
                        created_at: int | None = None) -> list[events.Event]:
    """The events of one conversation (module docstring), in publishing order.

    Raises:
        ImportError_: malformed conversation or no assistant message.
    """
    if not isinstance(conv, dict):
        raise ImportError_("a line must be a JSON object with 'messages'")
    messages = _validate(conv.get("messages"))
    tools = conv.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ImportError_("'tools' must be a list")
    model = str(conv.get("model") or "import")
    at = created_at if created_at is not None else events.now_ms()
    digest = hashlib.sha256(orjson.dumps({"messages": messages, "tools": tools})).hexdigest()[:12]
    assistant_at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistant_at:
        raise ImportError_("conversation has no assistant message")
    out: list[events.Event] = []
    for idx, i in enumerate(assistant_at):
        before = messages[:i]
        if not before:
            raise ImportError_("an assistant message cannot come first")
        msg = messages[i]
        prompt_ids = tok.prompt(before, tools)
        resp_ids = tok.response(prompt_ids, messages[: i + 1], tools)
        tool_calls = msg.get("tool_calls")
        out.append(events.Turn(
            session_id=session_id, turn_type="main", turn_index=idx, request_id=f"import-{digest}-{idx}",
            created_at=at, policy_version=policy_version, model=model, messages=before, tools=tools,
            sampling={}, prompt_token_ids=prompt_ids, response_token_ids=resp_ids, response_logprobs=[],
            response={"content": content_text(msg.get("content")), "reasoning_content": msg.get("reasoning_content"),
                      "tool_calls": tool_calls},
            finish_reason="tool_calls" if tool_calls else "stop", source="import"))
        nxt = assistant_at[idx + 1] if idx + 1 < len(assistant_at) else len(messages)
        after = messages[i + 1: nxt]
        if after:
            out.append(events.NextState(session_id=session_id, messages=after, after_turn_index=idx,
                                        request_id=f"import-{digest}-{idx}-next", created_at=at))
    out.append(events.SessionEnd(session_id=session_id, reason="import", created_at=at))
    return out


def read_conversations(path: str | Path) -> Iterator[tuple[int, dict | Exception, bytes]]:
    """``(line number, parsed object or the parse error, raw line)`` for each non-blank line."""
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield n, orjson.loads(line), line
            except orjson.JSONDecodeError as e:
                yield n, ImportError_(f"invalid JSON: {e}"), line


def session_id_for(conv: dict, raw: bytes) -> str:
    """The line's ``session_id``, or ``import-<sha256 of the line, 16 hex>``."""
    sid = conv.get("session_id") if isinstance(conv, dict) else None
    if isinstance(sid, str) and sid:
        return sid
    return "import-" + hashlib.sha256(raw.strip()).hexdigest()[:16]


def add_arguments(parser) -> None:
    parser.add_argument("file", help="conversation JSONL (one {'messages': [...]} per line)")
    parser.add_argument("--to-topic", help="target topic, physical name (default: turns with the configured prefix)")
    parser.add_argument("--model", help="tokenizer: smollm2-135m | tiny-random | HF folder (default engine.model)")
    parser.add_argument("--policy-version", type=int, default=0, help="policy_version stamped on the turns (default 0)")
    parser.add_argument("--strict", action="store_true", help="stop at the first bad line (default: skip and report)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args, config) -> int:
    from pipeline.bus import EventProducer

    if not Path(args.file).is_file():
        print(f"pipeline import: no such file: {args.file}", file=sys.stderr)
        return 2
    tok = Tokenizer.load(args.model or config.engine.model, config.engine.cache_dir)
    topic = args.to_topic or config.topics.name("turns")
    if args.to_topic:  # a topic of its own: created with the shape of turns (brokers never auto-create)
        from pipeline.history.replay import ensure_topic

        ensure_topic(config, topic)
    producer = EventProducer(config, name="import")
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(desc=f"import -> {topic}", unit="conversation")
    stats = {"conversations": 0, "turns": 0, "events": 0, "bad_lines": 0}
    errors: list[str] = []
    rc = 0
    try:
        for n, conv, raw in read_conversations(args.file):
            try:
                if isinstance(conv, Exception):
                    raise conv
                sid = session_id_for(conv, raw)
                evs = conversation_events(conv, tok, sid, policy_version=args.policy_version)
            except (ImportError_, events.EventError) as e:
                stats["bad_lines"] += 1
                errors.append(f"line {n}: {e}")
                log.warning("import: %s line %d skipped: %s", args.file, n, e)
                if args.strict:
                    rc = 1
                    break
                continue
            for ev in evs:
                producer.send(topic, ev, key=sid)
            stats["conversations"] += 1
            stats["turns"] += sum(isinstance(e, events.Turn) for e in evs)
            stats["events"] += len(evs)
            if bar is not None:
                bar.update(1)
    finally:
        producer.close()
        if bar is not None:
            bar.close()
    stats.update(topic=topic, failed=producer.failed, errors=errors[:10])
    print(orjson.dumps(stats).decode(), flush=True)
    if producer.failed:
        return 1
    return rc
