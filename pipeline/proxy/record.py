"""What the engine returned, turned into the turn's record: ids, log-probs, message, version.

Non-stream responses carry (when the proxy asked for them; SGLang >= 0.5.13 semantics, see
docs/sglang-api.md §2.2, §2.4) ``choices[0].token_ids``, ``choices[0].prompt_token_ids``,
``choices[0].logprobs.content[i].logprob`` aligned with ``token_ids`` (or
``choices[0].meta_info.output_token_logprobs`` as ``[logprob, id, text]``) and
``metadata.weight_version``. Streamed chunks of our engine (vLLM-style extension) carry
``token_ids`` deltas per choice, ``prompt_token_ids`` in the first chunk (top level or per
choice) and per-chunk ``logprobs.content``. Nothing is re-tokenized: what the engine sampled is
what is recorded. The CPU engine also reports its effective sampling parameters
(``metadata.sampling_params``: greedy normalised, generation-config defaults applied), recorded
so the turn says which temperature its log-probs are of.

:class:`StreamRecorder` also removes the fields the proxy added and the user did not ask for
from each chunk before it is forwarded.
"""

from __future__ import annotations

from typing import Any, Callable

import orjson

from pipeline.events import FINISHED

_NO_ID = object()  # StreamRecorder.feed: the chunk's id was not replaced


def _metadata_sampling(md: Any) -> dict | None:
    sp = md.get("sampling_params") if isinstance(md, dict) else None
    return sp if isinstance(sp, dict) else None


def policy_version(raw: Any, fallback: int) -> int:
    """The engine's ``weight_version`` as an int, else ``fallback`` (e.g. the control topic's)."""
    if isinstance(raw, bool):
        return fallback
    if isinstance(raw, int):
        return raw
    if isinstance(raw, str):
        s = raw.strip()
        if s.lstrip("-").isdigit():
            return int(s)
        if s[:1] in ("v", "V") and s[1:].isdigit():
            return int(s[1:])
    return fallback


def _logprob_values(lp: Any) -> list[float]:
    if not isinstance(lp, dict):
        return []
    content = lp.get("content")
    if not isinstance(content, list):
        return []
    return [e.get("logprob") for e in content if isinstance(e, dict)]


class Recorded:
    """The parts of one engine answer a turn needs (filled by the functions below)."""

    __slots__ = ("prompt_ids", "token_ids", "logprobs", "response", "finish_reason", "weight_version", "model",
                 "sampling_params", "lora_reported", "lora_name", "lora_sha256", "version_unknown")

    def __init__(self) -> None:
        self.prompt_ids: list[int] | None = None
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.response: dict = {"content": None, "reasoning_content": None, "tool_calls": None}
        self.finish_reason: str | None = None
        self.weight_version: Any = None
        self.version_unknown = False  # a weight sync happened while it was served (vLLM's bracket)
        self.model: str = ""
        self.sampling_params: dict | None = None  # the engine's effective parameters, when it reports them
        # which LoRA adapter served it (our engine's metadata/meta_info ``lora_name``; None: the base
        # model), only when the engine reports it (``lora_reported``; SGLang does not)
        self.lora_reported = False
        self.lora_name: str | None = None
        self.lora_sha256: str | None = None  # the content id of that adapter, when the engine reports it

    def saw_lora(self, holder: Any) -> None:
        """Record ``holder["lora_name"]`` and ``holder["lora_sha256"]`` (a ``metadata`` or
        ``meta_info`` dict) when they are there."""
        if isinstance(holder, dict) and "lora_name" in holder:
            self.lora_reported = True
            self.lora_name = holder["lora_name"] if isinstance(holder["lora_name"], str) else None
            sha = holder.get("lora_sha256")
            self.lora_sha256 = sha if isinstance(sha, str) else None

    @property
    def finished(self) -> bool:
        """The generation ended by its own rule (an OpenAI finish reason, not ``abort``/none)."""
        return self.finish_reason in FINISHED

    @property
    def complete(self) -> bool:
        """Token ids, prompt ids and one log-prob per response token are all present."""
        return (self.prompt_ids is not None and len(self.logprobs) == len(self.token_ids)
                and all(isinstance(x, (int, float)) for x in self.logprobs))


def from_response(resp: dict) -> Recorded:
    """Read a non-stream chat completion (``choices[0]``)."""
    r = Recorded()
    r.model = resp.get("model") or ""
    choices = resp.get("choices") or []
    c = choices[0] if choices and isinstance(choices[0], dict) else {}
    msg = c.get("message") or {}
    r.response = {"content": msg.get("content"), "reasoning_content": msg.get("reasoning_content"),
                  "tool_calls": msg.get("tool_calls") or None}
    r.finish_reason = c.get("finish_reason")
    meta = c.get("meta_info") if isinstance(c.get("meta_info"), dict) else {}
    ids = c.get("token_ids")
    otl = meta.get("output_token_logprobs")
    if isinstance(otl, list) and otl and (ids is None or len(otl) == len(ids)):
        r.token_ids = [e[1] for e in otl]
        r.logprobs = [e[0] for e in otl]
    else:
        r.token_ids = list(ids) if isinstance(ids, list) else []
        r.logprobs = _logprob_values(c.get("logprobs"))
    pids = c.get("prompt_token_ids", resp.get("prompt_token_ids"))
    r.prompt_ids = list(pids) if isinstance(pids, list) else None
    md = resp.get("metadata")
    r.weight_version = md.get("weight_version") if isinstance(md, dict) else None
    r.sampling_params = _metadata_sampling(md)
    r.saw_lora(meta)
    r.saw_lora(md)
    if r.weight_version is None:
        r.weight_version = meta.get("weight_version")
    return r


def repair_logprob_bytes(resp: dict, token_bytes: Callable[[int], bytes] | None) -> int:
    """Set each log-prob item's ``bytes`` to its token's raw bytes (in place); returns how many changed.

    SGLang fills ``bytes`` with the UTF-8 of the token decoded alone, so half of a character
    split over two tokens reads ``[239, 191, 189]`` and joining the bytes no longer rebuilds the
    text. The chosen tokens' ids come from ``choices[i].token_ids`` (or ``meta_info``'s
    ``output_token_logprobs``), the alternatives' from ``meta_info.output_top_logprobs``
    (matched by log-prob and text). An item whose id is unknown keeps the engine's bytes unless
    they encode a replacement character, in which case it gets ``null`` (OpenAI: no bytes
    representation) rather than wrong bytes; so does every such item when ``token_bytes`` is None.
    """
    changed = 0

    def fix(item: dict, tid: Any) -> None:
        nonlocal changed
        new = None
        if token_bytes is not None and isinstance(tid, int):
            try:
                new = list(token_bytes(tid))
            except KeyError:
                new = None
        if new is None:
            if "\ufffd" not in str(item.get("token", "")):
                return
        if item.get("bytes") != new:
            item["bytes"] = new
            changed += 1

    for c in resp.get("choices") or ():
        content = ((c.get("logprobs") or {}) if isinstance(c, dict) else {}).get("content")
        if not isinstance(content, list):
            continue
        meta = c.get("meta_info") if isinstance(c.get("meta_info"), dict) else {}
        otl = meta.get("output_token_logprobs")
        ids = [e[1] for e in otl] if isinstance(otl, list) and len(otl) == len(content) else c.get("token_ids")
        rows = meta.get("output_top_logprobs") if isinstance(meta.get("output_top_logprobs"), list) else []
        for k, item in enumerate(content):
            if not isinstance(item, dict):
                continue
            fix(item, ids[k] if isinstance(ids, list) and k < len(ids) else None)
            row = rows[k] if k < len(rows) and isinstance(rows[k], list) else []
            for alt in item.get("top_logprobs") or ():
                tid = next((e[1] for e in row if e[0] == alt.get("logprob") and e[2] in (None, alt.get("token"))),
                           None)
                fix(alt, tid)
    return changed


def strip_response(resp: dict, keep_logprobs: bool, keep_ids: bool, keep_prompt_ids: bool,
                   keep_meta: bool) -> None:
    """Remove from a non-stream response the extras the user did not ask for (in place)."""
    if not keep_prompt_ids:
        resp.pop("prompt_token_ids", None)
    for c in resp.get("choices") or ():
        if not isinstance(c, dict):
            continue
        if not keep_logprobs and "logprobs" in c:
            c["logprobs"] = None
        if not keep_ids:
            c.pop("token_ids", None)
        if not keep_prompt_ids:
            c.pop("prompt_token_ids", None)
        if not keep_meta:
            c.pop("meta_info", None)


class StreamRecorder:
    """Accumulates a streamed answer chunk by chunk and rewrites chunks for the user.

    Args:
        keep_logprobs, keep_ids, keep_prompt_ids: the user asked for these (else they are removed
            from the forwarded chunks).
        answer_id: the ``id`` every forwarded chunk gets (the proxy's id of the answer, which
            ``POST /v1/feedback`` resolves), or None (the engine's, unchanged).
    """

    def __init__(self, keep_logprobs: bool, keep_ids: bool, keep_prompt_ids: bool,
                 answer_id: str | None = None) -> None:
        self.rec = Recorded()
        self.answer_id = answer_id
        self._answer_head = b'{"id":' + orjson.dumps(answer_id) if answer_id is not None else b""
        self._engine_id: Any = None  # the engine's id last replaced, and its encoded head
        self._engine_head = b""
        self.keep_logprobs = keep_logprobs
        self.keep_ids = keep_ids
        self.keep_prompt_ids = keep_prompt_ids
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._tools: dict[int, dict] = {}
        self.error: Any = None
        self.chunks = 0

    @property
    def aborted(self) -> bool:
        """The engine ended the generation with ``finish_reason: "abort"`` (not an OpenAI value:
        the proxy turns it into an error for the client)."""
        return self.rec.finish_reason == "abort"

    def _take_prompt_ids(self, holder: dict) -> bool:
        """Record ``holder["prompt_token_ids"]`` (the chunk or one choice: engines put them in either)
        once, and strip it unless kept; True when ``holder`` was changed."""
        pids = holder.get("prompt_token_ids")
        if pids is None:
            return False
        if self.rec.prompt_ids is None and isinstance(pids, list):
            self.rec.prompt_ids = pids
        if self.keep_prompt_ids:
            return False
        del holder["prompt_token_ids"]
        return True

    def feed(self, data: bytes) -> bytes:
        """Record one SSE ``data`` payload; return the payload to forward (maybe rewritten)."""
        self.chunks += 1
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return data
        if not isinstance(obj, dict):
            return data
        if "error" in obj:
            self.error = obj["error"]
            return data
        rec = self.rec
        if not rec.model and isinstance(obj.get("model"), str):
            rec.model = obj["model"]
        changed = "prompt_token_ids" in obj and self._take_prompt_ids(obj)
        engine_id = _NO_ID
        if self.answer_id is not None and "id" in obj and obj["id"] != self.answer_id:
            engine_id, obj["id"] = obj["id"], self.answer_id
        md = obj.get("metadata")
        if isinstance(md, dict):  # engine metadata: most chunks have none
            if md.get("weight_version") is not None:
                rec.weight_version = md["weight_version"]
            if isinstance(md.get("sampling_params"), dict):
                rec.sampling_params = md["sampling_params"]
            rec.saw_lora(md)
        for c in obj.get("choices") or ():
            if isinstance(c, dict):
                changed = self._feed_choice(c) or changed
        if changed:
            return orjson.dumps(obj)
        return data if engine_id is _NO_ID else self._with_answer_id(data, obj, engine_id)

    def _with_answer_id(self, data: bytes, obj: dict, engine_id: Any) -> bytes:
        """``data`` with its leading ``{"id":<engine id>`` made the answer's id: a bytes splice,
        no re-serialisation (engines write ``id`` first, compact); any other layout is
        re-serialised from ``obj`` (whose ``id`` is already the answer's)."""
        if engine_id != self._engine_id or not self._engine_head:  # one id per stream: encoded once
            self._engine_id, self._engine_head = engine_id, b'{"id":' + orjson.dumps(engine_id)
        head = self._engine_head
        if data.startswith(head):
            return self._answer_head + data[len(head):]
        return orjson.dumps(obj)

    def _feed_choice(self, c: dict) -> bool:
        """Record one choice of a chunk (its deltas, ids, log-probs, finish reason, metadata) and
        strip what the user did not ask for; True when ``c`` was changed."""
        rec = self.rec
        changed = False
        d = c.get("delta")
        if isinstance(d, dict):
            if d.get("content"):
                self._content.append(d["content"])
            if d.get("reasoning_content"):
                self._reasoning.append(d["reasoning_content"])
            if d.get("tool_calls"):
                self._tool_deltas(d["tool_calls"])
        ids = c.get("token_ids")
        if ids is not None:
            if isinstance(ids, list):
                rec.token_ids.extend(ids)
            if not self.keep_ids:
                del c["token_ids"]
                changed = True
        if "prompt_token_ids" in c:
            changed = self._take_prompt_ids(c) or changed
        lp = c.get("logprobs")
        if lp is not None:
            rec.logprobs.extend(_logprob_values(lp))
            if not self.keep_logprobs:
                c["logprobs"] = None
                changed = True
        if c.get("finish_reason") is not None:
            rec.finish_reason = c["finish_reason"]
        mi = c.get("meta_info")
        if isinstance(mi, dict):
            if mi.get("weight_version") is not None:
                rec.weight_version = mi["weight_version"]
            rec.saw_lora(mi)
        return changed

    def _tool_deltas(self, deltas: Any) -> None:
        if not isinstance(deltas, list):
            return
        for pos, tc in enumerate(deltas):
            if not isinstance(tc, dict):
                continue
            idx = tc.get("index", pos)
            e = self._tools.get(idx)
            if e is None:
                e = self._tools[idx] = {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
            if tc.get("id"):
                e["id"] = tc["id"]
            if tc.get("type"):
                e["type"] = tc["type"]
            fn = tc.get("function")
            if isinstance(fn, dict):
                if fn.get("name"):
                    e["function"]["name"] += fn["name"]
                if fn.get("arguments"):
                    e["function"]["arguments"] += fn["arguments"]

    def finish(self) -> Recorded:
        """The accumulated record (content, reasoning, tool calls in index order)."""
        r = self.rec
        r.response = {"content": "".join(self._content),
                      "reasoning_content": "".join(self._reasoning) or None,
                      "tool_calls": [dict(self._tools[i], index=i) for i in sorted(self._tools)] or None}
        return r
