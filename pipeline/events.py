"""Event contracts: every value on every topic (see topics.yaml and docs/training-signal.md).

Wire format: a msgpack map with ``type`` (event name) and ``v`` (the schema version of that event
type: ``Event.V``; 2 for ``sample``, 1 for the others).

Versions: a new *optional* field whose absence (None) means what records without it always
meant keeps ``v`` (``session_source``, ``teacher_model``, ``tenant``, ``adapter`` were added so:
older records decode unchanged, with the field None); a change of what an existing field or its
absence means bumps the type's ``V`` and adds an upgrade in :data:`_UPGRADES` so older versions
stay readable (``sample`` v1 -> v2). A reader older than a field ignores it, so upgrade the
readers (judge, trainer) before a proxy starts writing tenants.
Token ids travel as packed little-endian int32 bytes, log-probs as packed little-endian float32
bytes (so a 300-token sample is ~2.4 KB, not a list of Python objects). In memory those fields
are plain ``list[int]`` / ``list[float]``; float values round-trip at float32 precision.

:func:`decode` validates strictly and raises a subclass of :class:`EventError` naming the field
(unknown ``type`` -> :class:`UnknownEventType`, unknown ``v`` -> :class:`UnsupportedVersion`,
anything else -> :class:`MalformedEvent`). Stages route such records to the dead-letter topic.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import numpy as np

from pipeline.errors import PipelineError
from pipeline.sampling import GREEDY_EPS

SCHEMA_VERSION = 1  # the version of every event type that never changed (``Event.V`` is per type)


class EventError(PipelineError, ValueError):
    """A record that is not a valid event of this schema."""


class UnknownEventType(EventError):
    """The ``type`` field names no event this version knows."""


class UnsupportedVersion(EventError):
    """The ``v`` field is a schema version this code cannot read."""


class MalformedEvent(EventError):
    """A field is missing, of the wrong type, or inconsistent with another field."""


def now_ms() -> int:
    """Wall-clock time in integer milliseconds since the epoch (the unit of every ``*_at``)."""
    return int(time.time() * 1000)


# ---- field domains: checked by decode() on every topic (and by encode()) ----------------------
#: longest id (session, sample, request, run, engine ids) in characters
MAX_ID_LEN = 256
#: largest turn index, policy version or epoch (int32 range: indices and versions are counts)
MAX_INDEX = 2**31 - 1
#: lowest log-prob accepted (nats): a token this unlikely carries no usable signal, and a larger
#: magnitude is a broken engine (the loss would be ~1e37 for -3e38)
LOGPROB_MIN = -1e4
#: highest sampling temperature accepted for recorded log-probs
MAX_TEMPERATURE = 100.0
#: the range of a PRM vote and of a reward built from votes
VOTE_RANGE = (-1.0, 1.0)


def _ident(v: str) -> str | None:
    if not v:
        return "must not be empty"
    return f"must be at most {MAX_ID_LEN} characters (has {len(v)})" if len(v) > MAX_ID_LEN else None


def _sample_ident(v: str) -> str | None:
    """A sample id joins a tenant, a session id, an index, a mode and a request id: up to 4 ids
    long (an index and a mode are short)."""
    if not v:
        return "must not be empty"
    return f"must be at most {4 * MAX_ID_LEN} characters (has {len(v)})" if len(v) > 4 * MAX_ID_LEN else None


def _short(v: str) -> str | None:
    return f"must be at most {MAX_ID_LEN} characters (has {len(v)})" if len(v) > MAX_ID_LEN else None


def _index(v: int) -> str | None:
    return None if 0 <= v <= MAX_INDEX else f"must be in [0, {MAX_INDEX}], got {v}"


def _time_ms(v: int) -> str | None:
    return None if 0 <= v < 2**53 else f"must be milliseconds since the epoch in [0, 2^53), got {v}"


def _token_ids(v: list) -> str | None:
    bad = next((i for i, t in enumerate(v) if t < 0), None)
    return None if bad is None else f"[{bad}] must be a token id >= 0, got {v[bad]}"


def logprob_domain_error(values, allow_neg_inf: bool = False) -> str | None:
    """Why ``values`` are not log-probs (nats, each in [:data:`LOGPROB_MIN`, 0]; ``-inf`` only
    when ``allow_neg_inf``: a missing top-k entry), or None when they all are."""
    arr = np.asarray(values, dtype=np.float64)
    ok = (arr >= LOGPROB_MIN) & (arr <= 0.0)
    if allow_neg_inf:
        ok |= np.isneginf(arr)
    bad = np.flatnonzero(~ok)
    if not bad.size:
        return None
    return f"[{int(bad[0])}] must be a log-prob in [{LOGPROB_MIN:g}, 0], got {float(arr[bad[0]])!r}"


def _topk_logprobs(v: list) -> str | None:
    return logprob_domain_error(v, allow_neg_inf=True)


def _vote(v: float) -> str | None:
    lo, hi = VOTE_RANGE
    return None if lo <= v <= hi else f"must be in the vote range [{lo:g}, {hi:g}], got {v!r}"


def _votes(v: list, nested: bool = True) -> str | None:
    """Votes in :data:`VOTE_RANGE` or null (failed); one level of lists (combine: PRM and hint votes)."""
    for i, x in enumerate(v):
        if nested and isinstance(x, list):
            err = _votes(x, nested=False)
            if err is not None:
                return f"[{i}]{err}"
        elif x is not None and (isinstance(x, bool) or not isinstance(x, (int, float)) or _vote(x)):
            return f"[{i}] must be a vote in [{VOTE_RANGE[0]:g}, {VOTE_RANGE[1]:g}] or null (failed), got {x!r}"
    return None


def _temperature(v: float) -> str | None:
    ok = math.isfinite(v) and 0 < v <= MAX_TEMPERATURE
    return None if ok else f"must be in (0, {MAX_TEMPERATURE:g}], got {v!r}"


def _messages(v: list) -> str | None:
    bad = next((i for i, m in enumerate(v) if not isinstance(m, dict) or not isinstance(m.get("role"), str)), None)
    return None if bad is None else f"[{bad}] must be a message (an object with a string 'role')"


def _sha256(v: str) -> str | None:
    ok = len(v) == 64 and all(c in "0123456789abcdef" for c in v)
    return None if ok else "must be 64 lower-case hex digits (a sha256)"


#: the keys of an ``adapter`` field: which LoRA adapter served a turn or trained a sample
ADAPTER_KEYS = ("name", "version", "sha256")


def _adapter(v: dict) -> str | None:
    """An adapter reference ``{name, version, sha256}``: ``name`` an id (:func:`_ident`),
    ``version`` the adapter's content id (:func:`pipeline.weightsync.adapter_version`: the sha256
    of the manifest of its config and tensors, 64 lower-case hex digits) and ``sha256`` the
    checksum of its tensor file ``adapter_model.safetensors`` (64 lower-case hex digits); no
    other key. Absent (None): the base model's full weights."""
    if set(v) != set(ADAPTER_KEYS):
        return f"must have exactly the keys {'|'.join(ADAPTER_KEYS)}, got {sorted(map(str, v))}"
    for k in ADAPTER_KEYS:
        if not isinstance(v[k], str):
            return f".{k} must be a string, got {type(v[k]).__name__}"
        err = _ident(v[k]) if k == "name" else _sha256(v[k])
        if err is not None:
            return f".{k} {err}"
    return None


#: the alphabet of ids a client sends (session ids, tenants): 1-256 printable ASCII characters
#: without spaces
CLIENT_ID = re.compile(r"^[\x21-\x7e]{1,%d}$" % MAX_ID_LEN)


def tenant_error(v: str) -> str | None:
    """Why ``v`` is not a tenant id as a client or the config names one (:data:`CLIENT_ID`:
    1-256 printable ASCII characters without spaces), or None when it is one. On the wire a
    tenant has the domain of a session id (:func:`_ident`)."""
    if not isinstance(v, str) or not CLIENT_ID.match(v):
        return f"must be 1-{MAX_ID_LEN} printable ASCII characters without spaces"
    return None


#: characters kept as they are when a tenant names a folder or an engine adapter
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def tenant_slug(tenant: str) -> str:
    """A file- and adapter-name-safe form of ``tenant``, distinct for distinct tenants (also on a
    case-insensitive file system): the tenant itself when it is ``[a-z0-9._-]`` (and not
    ``.``/``..``, at most 64 long), else its safe characters (at most 64) + ``~`` + the first 12
    hex digits of its sha256."""
    safe = _SAFE.sub("_", tenant)
    if safe == tenant and tenant == tenant.lower() and tenant not in (".", "..") and len(tenant) <= 64:
        return tenant
    return f"{safe[:64]}~{hashlib.sha256(tenant.encode()).hexdigest()[:12]}"


def adapter_name(tenant: str, version: str) -> str:
    """The name an engine loads ``tenant``'s adapter ``version`` under (SGLang's ``lora_name``):
    ``<tenant_slug>@<first 16 hex digits of the version>``; no ``:`` (``model: "base:name"``
    splits there). One name per content, so a new version is loaded beside the old one."""
    return f"{tenant_slug(tenant)}@{version[:16]}"


#: the form of every name :func:`adapter_name` gives
ADAPTER_NAME = re.compile(r".+@[0-9a-f]{16}")


def is_adapter_name(name: str) -> bool:
    """``name`` has the form of a tenant adapter's engine name (:func:`adapter_name`)."""
    return ADAPTER_NAME.fullmatch(name) is not None


def adapter_tenant_error(tenant: str | None, adapter: dict | None) -> str | None:
    """Why a record's ``adapter`` cannot be its ``tenant``'s (its name is not
    :func:`adapter_name` of that tenant and its version), or None. A record without a tenant may
    name any adapter (the fields are then reserved); one with both never names another tenant's."""
    if tenant is None or adapter is None or adapter["name"] == adapter_name(tenant, adapter["version"]):
        return None
    return (f"names adapter {adapter['name']!r}, not tenant {tenant!r}'s "
            f"({adapter_name(tenant, adapter['version'])!r} for its version)")


def session_key(tenant: str | None, session_id: str) -> str:
    """The Kafka key of a session's records on ``turns`` (and of its samples):
    ``<tenant>/<session_id>`` when the session has a tenant, ``session_id`` alone otherwise (the
    key of records written before tenants, so their partitioning and order are unchanged).
    Only a partitioning key: two tenants may map to one key string (a ``/`` in an id), which
    shares a partition, never a session; in memory sessions are keyed by ``(tenant, session_id)``."""
    return session_id if tenant is None else f"{tenant}/{session_id}"


def session_of(ev) -> str | tuple[str, str]:
    """The in-memory key of a record's session: its ``session_id`` when it has no ``tenant``
    (the key of every record written before tenants), ``(tenant, session_id)`` when it has one.
    A string never equals a tuple, so two tenants' sessions (or a tenant's and an untenanted
    one) never share state, whatever their ids."""
    return ev.session_id if ev.tenant is None else (ev.tenant, ev.session_id)


def split_session(key: str | tuple[str, str]) -> tuple[str | None, str]:
    """``(tenant, session_id)`` of a :func:`session_of` key."""
    return (None, key) if isinstance(key, str) else key


# field kinds: str, int, float, bool, list, dict, i32 (packed int32), f32 (packed float32), any;
# ``domain``: a function of a present (non-null) value -> why it is out of its domain, or None
def _f(kind: str, default: Any = dataclasses.MISSING, *, optional: bool = False, domain=None):
    meta = {"kind": kind, "optional": optional, "domain": domain}
    if default is dataclasses.MISSING:
        return field(metadata=meta)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


_PY = {"str": str, "int": int, "float": (int, float), "bool": bool, "list": list, "dict": dict}
_DT = {"i32": np.dtype("<i4"), "f32": np.dtype("<f4")}


@dataclass
class Event:
    """Base of all events. Subclasses set ``TYPE`` and declare fields with kinds."""

    TYPE: ClassVar[str] = ""
    V: ClassVar[int] = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        """Plain-data view (arrays as lists), e.g. for JSON archives."""
        d = {"type": self.TYPE, "v": self.V}
        d.update(dataclasses.asdict(self))
        return d

    def validate(self) -> None:
        """Cross-field checks; raises :class:`MalformedEvent`. Field types are checked on decode."""


#: OpenAI finish reasons of a generation that ended by its own rule; anything else (``abort``,
#: none) means it did not finish and is never trained as an answer
FINISHED = ("stop", "length", "tool_calls", "function_call")

#: the arms of a canary, as a turn records which one served it (``Turn.canary``)
CANARY_ARMS = ("candidate", "incumbent")

def _canary(v: str) -> str | None:
    return None if v in CANARY_ARMS else f"must be one of {'|'.join(CANARY_ARMS)}, got {v[:40]!r}"


#: which rule of the proxy decided a turn's session (``Turn.session_source``; docs/sessions.md)
SESSION_SOURCES = ("header", "body", "previous_response", "marker:openclaw", "user", "continuation", "new",
                   "housekeeping")


@dataclass
class Turn(Event):
    """One assistant turn as served: the exact tokens and log-probs the engine sampled.

    ``response_logprobs[i]`` is log p(response_token_ids[i] | prompt, response[:i]) in nats under
    the policy that sampled it (``policy_version``), of the distribution
    ``softmax(processed_logits / logprob_temperature)``. ``source`` is ``proxy`` for live traffic,
    ``import`` for conversations loaded from files (not sampled: log-probs may be empty) and
    ``replay`` for re-fed history.

    What the prompt and the log-probs depend on, recorded so a teacher can re-apply it
    (:mod:`pipeline.engine_api.render`, :mod:`pipeline.sampling`):

    - ``chat_options``: the request's prompt-shaping options besides ``messages`` and ``tools``
      (``tool_choice``, ``continue_final_message``, ``chat_template_kwargs``);
    - ``logprob_temperature``: the engine's *effective* temperature (greedy: 1.0), None when
      the turn has no log-probs (import) or predates this field;
    - ``logprob_processors``: options that changed the logits before the log-probs were taken
      and that a scoring pass cannot reproduce (``logit_bias``, penalties, ``min_tokens``,
      ``constrained_decoding``, ``tool_choice``); empty for a plain request.

    ``finish_reason`` is the OpenAI value (``stop``, ``length``, ``tool_calls``) for a generation
    that finished, ``abort`` for one that did not (engine abort, client gone, stream broken):
    such a turn is never trained as a finished answer.

    ``session_source``: the proxy's rule that chose ``session_id`` (:data:`SESSION_SOURCES`);
    None for imported turns and records written before this field.

    ``tenant``: who the request belongs to (the proxy's API key map or ``X-Tenant-Id``;
    ``docs/tenants.md``), None when it has none (and in records written before this field).
    A session is ``(tenant, session_id)``: two tenants reusing a session id are two sessions.
    ``adapter``: the LoRA adapter that served the turn (``{name, version, sha256}``, see
    :func:`_adapter`), None for the base model's full weights.

    ``response_id``: the id of the answer as the client received it (``chatcmpl-...`` from chat
    completions, ``resp_...`` from ``/v1/responses``, ``msg_...`` from ``/v1/messages``): what a
    ``feedback`` refers to (``docs/feedback.md``); None for imported turns, turns whose engine
    gave no id and records written before this field.
    ``housekeeping``: ``<agent>:<kind>`` when the proxy recognised the request as an agent's own
    upkeep (``openclaw:compaction``, ``:title``, ``:memory``, ``:heartbeat``;
    :mod:`pipeline.proxy.housekeeping`): always a ``side`` turn, never trained. Its session is the
    one the request names, else ``housekeeping:<agent>`` (``session_source`` ``housekeeping``).
    None for every other turn (and in records written before this field).

    ``canary``: which arm of a canary rollout served the turn (:data:`CANARY_ARMS`; sticky per
    session, :func:`pipeline.rollout.assign.assign_arm`); None when no canary ran (the default,
    and records written before this field).
    """

    TYPE: ClassVar[str] = "turn"
    session_id: str = _f("str", domain=_ident)
    turn_type: str = _f("str", "main")
    turn_index: int | None = _f("int", None, optional=True, domain=_index)
    request_id: str = _f("str", "", domain=_short)
    created_at: int = _f("int", 0, domain=_time_ms)
    policy_version: int = _f("int", 0, domain=_index)
    model: str = _f("str", "", domain=_short)
    messages: list = _f("list", [], domain=_messages)
    tools: list | None = _f("list", None, optional=True)
    sampling: dict = _f("dict", {})
    prompt_token_ids: list = _f("i32", [], domain=_token_ids)
    response_token_ids: list = _f("i32", [], domain=_token_ids)
    response_logprobs: list = _f("f32", [], domain=logprob_domain_error)
    response: dict = _f("dict", {})  # {"content", "reasoning_content", "tool_calls"}
    finish_reason: str | None = _f("str", None, optional=True, domain=_short)
    source: str = _f("str", "proxy")
    engine_id: str | None = _f("str", None, optional=True, domain=_ident)
    chat_options: dict = _f("dict", {})
    logprob_temperature: float | None = _f("float", None, optional=True, domain=_temperature)
    logprob_processors: list = _f("list", [])
    session_source: str | None = _f("str", None, optional=True)
    tenant: str | None = _f("str", None, optional=True, domain=_ident)
    adapter: dict | None = _f("dict", None, optional=True, domain=_adapter)
    response_id: str | None = _f("str", None, optional=True, domain=_short)
    housekeeping: str | None = _f("str", None, optional=True, domain=_short)
    canary: str | None = _f("str", None, optional=True, domain=_canary)

    def validate(self) -> None:
        if self.housekeeping is not None and self.turn_type != "side":
            raise MalformedEvent(f"turn.housekeeping ({self.housekeeping}) is only for side turns")
        if self.session_source is not None and self.session_source not in SESSION_SOURCES:
            raise MalformedEvent(f"turn.session_source must be one of {'|'.join(SESSION_SOURCES)}, "
                                 f"got {self.session_source!r}")
        if self.logprob_temperature is not None and not self.logprob_temperature > 0:
            raise MalformedEvent(f"turn.logprob_temperature must be > 0, got {self.logprob_temperature}")
        if self.turn_type not in ("main", "side"):
            raise MalformedEvent(f"turn.turn_type must be 'main' or 'side', got {self.turn_type!r}")
        if self.turn_type == "main" and self.turn_index is None:
            raise MalformedEvent("turn.turn_index is required for main turns")
        if self.source not in ("proxy", "import", "replay"):
            raise MalformedEvent(f"turn.source must be proxy|import|replay, got {self.source!r}")
        n = len(self.response_token_ids)
        if len(self.response_logprobs) != n and not (self.source == "import" and not self.response_logprobs):
            raise MalformedEvent(
                f"turn.response_logprobs has {len(self.response_logprobs)} entries for {n} response tokens")


@dataclass
class NextState(Event):
    """What arrived after an assistant turn: the user's reply and/or tool results, all of them.

    ``after_turn_index`` is the ``turn_index`` of the main turn this state follows;
    ``after_request_id`` that turn's ``request_id`` when the proxy that wrote this recorded it
    (None otherwise, and in records written before this field): a turn's identity that no
    eviction or restart of the proxy can reuse. ``tenant``: the session's tenant (as on
    :class:`Turn`; None: none).
    """

    TYPE: ClassVar[str] = "next_state"
    session_id: str = _f("str", domain=_ident)
    messages: list = _f("list", domain=_messages)
    after_turn_index: int | None = _f("int", None, optional=True, domain=_index)
    request_id: str = _f("str", "", domain=_short)
    created_at: int = _f("int", 0, domain=_time_ms)
    after_request_id: str | None = _f("str", None, optional=True, domain=_short)
    tenant: str | None = _f("str", None, optional=True, domain=_ident)

    def validate(self) -> None:
        for m in self.messages:
            if not isinstance(m, dict) or "role" not in m:
                raise MalformedEvent("next_state.messages must be messages with a 'role'")


@dataclass
class SessionEnd(Event):
    """A session is over (``reason``: ``header``, ``api``, ``no_session``, ``import``,
    ``idle_timeout``).

    ``turn_index`` set: the end applies only while that main turn is the session's latest one
    (the judge publishes ``idle_timeout`` ends naming the turn it found idle, and ignores an end
    that a newer record of the session overtook). None: the session ends whatever came before.
    ``tenant``: the session's tenant (as on :class:`Turn`; None: none).
    ``outcome``: the session's result as its client reported it (``X-Session-Outcome`` or the
    body of ``POST /v1/sessions/{id}/end``), a score in [-1, 1] the judge credits to the
    session's main turns (``docs/feedback.md``); None: no outcome reported (no signal).
    """

    TYPE: ClassVar[str] = "session_end"
    session_id: str = _f("str", domain=_ident)
    reason: str = _f("str", "header", domain=_ident)
    created_at: int = _f("int", 0, domain=_time_ms)
    turn_index: int | None = _f("int", None, optional=True, domain=_index)
    tenant: str | None = _f("str", None, optional=True, domain=_ident)
    outcome: float | None = _f("float", None, optional=True, domain=_vote)


#: who gave a feedback (:class:`Feedback`): the user of the app, a reviewer reading the
#: conversation later, or the app itself (a CI run, a ticket marked solved)
FEEDBACK_SOURCES = ("user", "reviewer", "app")
#: longest feedback comment (characters): a correction is a hint of a few sentences
MAX_COMMENT_CHARS = 8000


def _feedback_source(v: str) -> str | None:
    return None if v in FEEDBACK_SOURCES else f"must be one of {'|'.join(FEEDBACK_SOURCES)}, got {v[:40]!r}"


def _comment(v: str) -> str | None:
    if not v.strip():
        return "must not be blank (omit it: no comment)"
    return None if len(v) <= MAX_COMMENT_CHARS else f"must be at most {MAX_COMMENT_CHARS} characters (has {len(v)})"


#: the domain of each text field a client sends in a feedback (the proxy answers 400 with it)
FEEDBACK_CHECKS = {"comment": _comment, "source": _feedback_source, "response_id": _ident, "session_id": _ident}


@dataclass
class Feedback(Event):
    """An explicit judgement of one main turn, sent by a client (``POST /v1/feedback``).

    ``turn_index`` and ``turn_request_id`` name the turn (its ``request_id``: the turn's
    identity, so a session id reused by a later conversation never takes another turn's
    feedback); ``response_id`` is the id the client referred to, when it used one. ``score``
    in [-1, 1] (thumbs are +-1) is the reward the judge gives the turn (explicit feedback takes
    precedence by default); ``comment``, a correction, is the turn's OPD hint (None: no
    comment). ``source``: :data:`FEEDBACK_SOURCES`. ``feedback_id``: unique per request (the
    proxy's request id). Keyed like the turn (:func:`session_key`), so the judge reads it after
    the turn, in the session's order.
    """

    TYPE: ClassVar[str] = "feedback"
    session_id: str = _f("str", domain=_ident)
    turn_index: int = _f("int", domain=_index)
    score: float = _f("float", domain=_vote)
    feedback_id: str = _f("str", domain=_ident)
    turn_request_id: str | None = _f("str", None, optional=True, domain=_short)
    response_id: str | None = _f("str", None, optional=True, domain=_short)
    comment: str | None = _f("str", None, optional=True, domain=_comment)
    source: str = _f("str", "user", domain=_feedback_source)
    created_at: int = _f("int", 0, domain=_time_ms)
    tenant: str | None = _f("str", None, optional=True, domain=_ident)


SAMPLE_KINDS = ("rl", "opd", "opd+rl")
#: where a sample's reward came from: the judge's votes, explicit feedback, the session's outcome;
#: ``Sample.reward_source`` is one of them or several joined by ``+`` in this order
REWARD_SOURCES = ("judge", "feedback", "outcome")
#: the rules that decide a reward from its sources (``judge.reward.rule``; docs/feedback.md)
REWARD_RULES = ("precedence", "weighted")
#: where a sample's hint came from: the judge's hint votes, or a feedback comment
HINT_SOURCES = ("judge", "feedback")


def _reward_source(v: str) -> str | None:
    parts = v.split("+")
    if parts and all(p in REWARD_SOURCES for p in parts) and parts == sorted(set(parts), key=REWARD_SOURCES.index):
        return None
    return f"must be one or more of {'|'.join(REWARD_SOURCES)} joined by '+' in that order, got {v[:60]!r}"


def _one_of(values: tuple):
    def check(v: str) -> str | None:
        return None if v in values else f"must be one of {'|'.join(values)}, got {v[:40]!r}"
    return check


def sample_kind(has_reward: bool, has_teacher: bool) -> str | None:
    """The ``kind`` of a sample that carries these signals (None: it carries neither)."""
    return {(True, False): "rl", (False, True): "opd", (True, True): "opd+rl"}.get((has_reward, has_teacher))


def _all_finite(values) -> bool:
    return bool(np.isfinite(np.asarray(values, dtype=np.float64)).all())


@dataclass
class Sample(Event):
    """One judged turn as a training sample (schema v2). Shapes, with R = ``response_length``:

    - ``tokens``: prompt + response token ids, length P + R;
    - ``rollout_temperature``: T > 0, the temperature the rollout (and teacher) log-probs were
      computed at: they are log-probs of softmax(logits / T), and the trainer scores at T. A
      greedy request (temperature below 1e-6) is sampled as the argmax with log-probs at T = 1;
    - ``loss_mask``: 1 = train on it, 0 = carried for accounting only.

    Each training signal is present or absent, never a stand-in value:

    - ``reward``: the RL signal (Binary RL: the PRM majority vote), a finite float, or **None**
      when the sample carries no RL signal (an OPD-only sample, a combine turn whose vote was 0,
      a turn that never got a next state). A present 0 is a real vote of 0.
    - ``teacher_log_probs``: R finite floats (nats), the hinted teacher's log-probs of the same
      response ids at ``rollout_temperature``, or **None** when there is no hint (no OPD
      signal). ``teacher_top_k`` > 0 with ``teacher_topk_ids`` / ``teacher_topk_log_probs``
      (R*k values, row-major; -inf for a missing entry) only alongside teacher log-probs.
    - ``rollout_log_probs``: R finite floats (nats) from the engine that sampled the response,
      or **None** when no engine recorded them (an imported conversation): the trainer then
      uses its own log-probs as the behaviour policy, applies no TIS weight and leaves the
      sample out of the train-vs-rollout figure.

    ``teacher_model`` / ``teacher_version``: which weights computed ``teacher_log_probs`` (the
    teacher engine's model path and the ``weight_version`` it reported for the scoring call);
    set only alongside teacher log-probs, absent (null) in records written before these fields.

    ``kind`` names the signals carried: ``rl`` (reward only), ``opd`` (teacher only),
    ``opd+rl`` (both); a sample that carries neither must have ``loss_mask`` 0 (its ``kind`` is
    then the judge mode's). On the wire the arrays are packed little-endian float32 / int32
    bytes and an absent one is msgpack nil.

    ``sample_id`` is ``<session>:<turn_index>:<mode>:<turn request_id>``, prefixed by
    ``<tenant>/`` when the turn has a tenant: the same turn record (a replay, a re-delivery
    after a crash) gives the same id, so duplicates are recognisable, while a different
    conversation that reuses the session id does not, nor does another tenant's session of the
    same id. ``tenant`` and ``adapter`` are copied from the turn (None: no tenant, the base
    model).

    Where the reward came from (``docs/feedback.md``): ``reward_source`` (:data:`REWARD_SOURCES`,
    several joined by ``+``) and ``reward_rule`` (:data:`REWARD_RULES`) that combined them,
    ``feedback_score`` (the turn's explicit feedback, None: none) and ``outcome_reward`` (the
    session outcome's discounted credit to this turn, None: none); ``hint_source``: whether
    ``hint`` came from the judge or from a feedback comment. All None in records written before
    these fields and on samples without a reward (``reward_source``) or hint (``hint_source``):
    a reward without a ``reward_source`` is the judge's.

    Version 1 records (which wrote 0 for a missing reward, the rollout log-probs in place of a
    missing teacher, zeros for missing rollout log-probs and the requested temperature of greedy
    turns) are read by :func:`_sample_from_v1`.
    """

    TYPE: ClassVar[str] = "sample"
    V: ClassVar[int] = 2
    sample_id: str = _f("str", domain=_sample_ident)
    session_id: str = _f("str", domain=_ident)
    turn_index: int = _f("int", domain=_index)
    policy_version: int = _f("int", 0, domain=_index)
    kind: str = _f("str", "rl")
    tokens: list = _f("i32", [], domain=_token_ids)
    response_length: int = _f("int", 0)
    rollout_log_probs: list | None = _f("f32", None, optional=True, domain=logprob_domain_error)
    rollout_temperature: float = _f("float", 1.0, domain=_temperature)
    reward: float | None = _f("float", None, optional=True, domain=_vote)
    loss_mask: int = _f("int", 1)
    teacher_log_probs: list | None = _f("f32", None, optional=True, domain=logprob_domain_error)
    teacher_top_k: int = _f("int", 0)
    teacher_topk_ids: list = _f("i32", [], domain=_token_ids)
    teacher_topk_log_probs: list = _f("f32", [], domain=_topk_logprobs)
    votes: list = _f("list", [], domain=_votes)
    hint: str | None = _f("str", None, optional=True)
    judge: str = _f("str", "", domain=_short)
    created_at: int = _f("int", 0, domain=_time_ms)
    turn_created_at: int = _f("int", 0, domain=_time_ms)
    source: str = _f("str", "proxy")
    teacher_model: str | None = _f("str", None, optional=True, domain=_ident)
    teacher_version: str | None = _f("str", None, optional=True, domain=_short)
    tenant: str | None = _f("str", None, optional=True, domain=_ident)
    adapter: dict | None = _f("dict", None, optional=True, domain=_adapter)
    reward_source: str | None = _f("str", None, optional=True, domain=_reward_source)
    reward_rule: str | None = _f("str", None, optional=True, domain=_one_of(REWARD_RULES))
    feedback_score: float | None = _f("float", None, optional=True, domain=_vote)
    outcome_reward: float | None = _f("float", None, optional=True, domain=_vote)
    hint_source: str | None = _f("str", None, optional=True, domain=_one_of(HINT_SOURCES))

    @property
    def has_reward(self) -> bool:
        """The sample carries an RL signal."""
        return self.reward is not None

    @property
    def has_teacher(self) -> bool:
        """The sample carries teacher log-probs (an OPD signal)."""
        return self.teacher_log_probs is not None

    @property
    def has_rollout_log_probs(self) -> bool:
        """The engine that sampled the response recorded its log-probs."""
        return self.rollout_log_probs is not None

    def validate(self) -> None:
        if self.kind not in SAMPLE_KINDS:
            raise MalformedEvent(f"sample.kind must be rl|opd|opd+rl, got {self.kind!r}")
        r = self.response_length
        if r < 0 or r > len(self.tokens):
            raise MalformedEvent(f"sample.response_length {r} out of range for {len(self.tokens)} tokens")
        if self.loss_mask not in (0, 1):
            raise MalformedEvent(f"sample.loss_mask must be 0 or 1, got {self.loss_mask}")
        for name in ("rollout_log_probs", "teacher_log_probs"):
            values = getattr(self, name)
            if values is None:
                continue
            if len(values) != r:
                raise MalformedEvent(f"sample.{name} has {len(values)} entries, want {r} (or null: absent)")
            if not _all_finite(values):
                raise MalformedEvent(f"sample.{name} holds a non-finite value")
        if self.reward is not None and not math.isfinite(self.reward):
            raise MalformedEvent(f"sample.reward must be finite or null (absent), got {self.reward}")
        if not (math.isfinite(self.rollout_temperature) and self.rollout_temperature > 0):
            raise MalformedEvent(f"sample.rollout_temperature must be > 0 (the temperature of the log-probs; "
                                 f"greedy turns have log-probs at 1.0), got {self.rollout_temperature}")
        carried = sample_kind(self.has_reward, self.has_teacher)
        if carried is None:
            if self.loss_mask:
                raise MalformedEvent("sample has loss_mask 1 but carries no signal (reward and teacher_log_probs "
                                     "are both null)")
        elif self.kind != carried:
            raise MalformedEvent(f"sample.kind {self.kind!r} does not name the signals it carries ({carried!r})")
        k = self.teacher_top_k
        if k < 0 or len(self.teacher_topk_ids) != len(self.teacher_topk_log_probs) or (
                len(self.teacher_topk_ids) not in ((0, k * r) if k else (0,))):
            raise MalformedEvent("sample.teacher_topk_* must both hold response_length * teacher_top_k values")
        if self.teacher_topk_ids and not self.has_teacher:
            raise MalformedEvent("sample.teacher_topk_* given without teacher_log_probs")
        if (self.teacher_model is not None or self.teacher_version is not None) and not self.has_teacher:
            raise MalformedEvent("sample.teacher_model / teacher_version given without teacher_log_probs")
        if self.reward_source is not None and self.reward is None:
            raise MalformedEvent("sample.reward_source given without a reward")
        if self.hint_source is not None and self.hint is None:
            raise MalformedEvent("sample.hint_source given without a hint")
        if self.tenant is not None and not self.sample_id.startswith(self.tenant + "/"):
            raise MalformedEvent(f"sample.sample_id must start with its tenant's '{self.tenant}/' (one id space "
                                 f"per tenant), got {self.sample_id[:80]!r}")


GREEDY_TEMPERATURE = GREEDY_EPS  # a requested temperature below this is greedy: log-probs at T = 1


def _sample_from_v1(s: Sample) -> Sample:
    """Read a schema-v1 sample: recover which signals it carried from the v1 judge's rules.

    v1 had no way to say "absent"; the v1 judge wrote stand-in values, undone here:
    ``opd`` samples carried reward 0 (no RL signal); ``opd+rl`` (combine) samples without a hint
    carried the rollout log-probs as teacher (no OPD signal), and with a vote of 0 carried reward
    0 (no RL signal); ``rl`` samples flushed without a next state (loss_mask 0, no votes)
    carried reward 0, and so did ``rl`` samples whose votes all failed (no judgement: read as no
    reward and loss_mask 0, even when the at-least-one rule had set loss_mask 1); imported turns carried zeros as rollout log-probs; greedy turns carried
    their requested temperature (below 1e-6) although the engines report log-probs at T = 1.
    ``kind`` is then re-derived from what is carried.
    """
    s.teacher_log_probs = s.teacher_log_probs or None
    if s.kind == "rl" or (s.kind == "opd+rl" and s.hint is None):
        s.teacher_log_probs = None
        s.teacher_top_k, s.teacher_topk_ids, s.teacher_topk_log_probs = 0, [], []
    if s.kind == "opd" or (s.kind == "opd+rl" and s.reward == 0) or (
            s.kind == "rl" and not s.loss_mask and not s.votes):
        s.reward = None
    if s.kind == "rl" and s.votes and all(v is None for v in s.votes):
        s.reward, s.loss_mask = None, 0
    if s.source == "import" and s.rollout_log_probs is not None and not any(s.rollout_log_probs):
        s.rollout_log_probs = None
    if not s.rollout_temperature >= GREEDY_TEMPERATURE:
        s.rollout_temperature = 1.0
    s.kind = sample_kind(s.has_reward, s.has_teacher) or s.kind
    return s


CONTROL_ACTIONS = ("pause", "weights", "applied", "resume", "failed")
#: a canary's outcome (issue 39, docs/rollout.md): the candidate (``policy_version``, or the
#: tenant's ``adapter``) becomes the incumbent, or never serves a new session again
ROLLOUT_DECISIONS = ("promote", "rollback")
#: the keys of a decision's ``evidence`` (:func:`_evidence`)
EVIDENCE_KEYS = ("rule", "reason", "config", "incumbent", "arms", "bounds")


def _counts_error(v) -> str | None:
    ok = (isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
          and 0 <= v[0] <= v[1] <= MAX_INDEX)
    return None if ok else f"must be [successes, n] with 0 <= successes <= n, got {str(v)[:60]}"


def _bound_error(v) -> str | None:
    ok = (isinstance(v, list) and len(v) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                      and math.isfinite(x) and -1 <= x <= 1 for x in v)
          and v[0] <= v[1])
    return None if ok else f"must be [low, high] with -1 <= low <= high <= 1, got {str(v)[:60]}"


def _evidence(v: dict) -> str | None:
    """A decision's evidence (:data:`EVIDENCE_KEYS`, no other key): ``rule`` and ``reason``
    (ids), ``config`` (the rule's parameters by name: numbers, booleans, lists of names),
    ``incumbent`` (the version compared against: a policy version, an adapter version, or null
    for the base model), ``arms`` (``candidate``/``incumbent`` -> metric -> ``[successes, n]``)
    and ``bounds`` (metric -> ``[low, high]`` on candidate - incumbent, in [-1, 1])."""
    if set(v) != set(EVIDENCE_KEYS):
        return f"must have exactly the keys {'|'.join(EVIDENCE_KEYS)}, got {sorted(map(str, v))}"
    for k in ("rule", "reason"):
        if not isinstance(v[k], str) or _ident(v[k]):
            return f".{k} must be a non-empty id"
    if not isinstance(v["config"], dict) or not all(isinstance(x, str) for x in v["config"]):
        return ".config must be a map of parameter names"
    inc = v["incumbent"]
    if inc is not None and not ((isinstance(inc, int) and not isinstance(inc, bool) and _index(inc) is None)
                                or (isinstance(inc, str) and _sha256(inc) is None)):
        return ".incumbent must be a policy version, an adapter version (sha256) or null"
    arms = v["arms"]
    if not isinstance(arms, dict) or set(arms) != set(CANARY_ARMS):
        return f".arms must have exactly the keys {'|'.join(CANARY_ARMS)}"
    for arm, metrics in arms.items():
        if not isinstance(metrics, dict):
            return f".arms.{arm} must be a map of metric -> [successes, n]"
        for name, c in metrics.items():
            err = _counts_error(c)
            if err:
                return f".arms.{arm}.{str(name)[:40]} {err}"
    if not isinstance(v["bounds"], dict):
        return ".bounds must be a map of metric -> [low, high]"
    for name, b in v["bounds"].items():
        err = _bound_error(b)
        if err:
            return f".bounds.{str(name)[:40]} {err}"
    return None

#: commands about one tenant's adapter (``pipeline adapters``; ``tenant`` set, ``adapter`` absent):
#: ``freeze`` (its samples train nothing until ``unfreeze``), ``reset`` (the adapter and its
#: optimizer state are dropped: the tenant is served by the base until its next update) and
#: ``delete`` (``reset``, and its exported folders are removed)
ADAPTER_COMMANDS = ("freeze", "unfreeze", "reset", "delete")


@dataclass
class Control(Event):
    """An order or report on the ``control`` topic (one partition: total order).

    ``action``: ``pause`` (stop admitting work for this epoch), ``weights`` (new weights at
    ``location`` with ``sha256`` for ``policy_version``), ``applied`` (``engine_id`` now serves
    ``policy_version``), ``resume``, ``failed`` (an engine could not apply; ``message`` says why).
    ``tenant`` / ``adapter``: the order is about that tenant's LoRA adapter only (adapter sync,
    ``docs/tenants.md``): ``pause``/``resume`` hold and release that tenant's requests only, a
    ``resume`` names the adapter the tenant is served by from then on (None: the base model),
    ``weights`` carries the adapter's folder (``sha256`` = ``adapter.sha256``), ``applied``/
    ``failed`` answer it; :data:`ADAPTER_COMMANDS` act on the tenant's adapter. Absent (None):
    the full weights, as before these fields.
    ``promote`` / ``rollback`` (:data:`ROLLOUT_DECISIONS`, docs/rollout.md): the canary of
    ``policy_version`` (or of the tenant's ``adapter``) is over; ``evidence`` (:func:`_evidence`,
    required with them and only with them) holds the counts per arm, the rule and its bounds.
    """

    TYPE: ClassVar[str] = "control"
    action: str = _f("str")
    epoch: int = _f("int", domain=_index)
    policy_version: int = _f("int", 0, domain=_index)
    run_id: str = _f("str", "default", domain=_ident)
    location: str | None = _f("str", None, optional=True)
    sha256: str | None = _f("str", None, optional=True, domain=_sha256)
    engine_id: str | None = _f("str", None, optional=True, domain=_ident)
    message: str = _f("str", "")
    created_at: int = _f("int", 0, domain=_time_ms)
    tenant: str | None = _f("str", None, optional=True, domain=_ident)
    adapter: dict | None = _f("dict", None, optional=True, domain=_adapter)
    evidence: dict | None = _f("dict", None, optional=True, domain=_evidence)

    def validate(self) -> None:
        actions = CONTROL_ACTIONS + ADAPTER_COMMANDS + ROLLOUT_DECISIONS
        if self.action not in actions:
            raise MalformedEvent(f"control.action must be one of {actions}, got {self.action!r}")
        if (self.evidence is not None) != (self.action in ROLLOUT_DECISIONS):
            raise MalformedEvent("control.evidence is required with promote/rollback and only with them")
        if self.action in ADAPTER_COMMANDS and (self.tenant is None or self.adapter is not None):
            raise MalformedEvent(f"control '{self.action}' needs a tenant and no adapter")
        if self.adapter is not None and self.tenant is None:
            raise MalformedEvent("control: an adapter order needs its tenant")
        if self.action == "weights" and not (self.location and self.sha256):
            raise MalformedEvent("control 'weights' needs location and sha256")
        if self.action == "weights" and self.tenant is not None and (
                self.adapter is None or self.adapter["sha256"] != self.sha256):
            raise MalformedEvent("control 'weights' of a tenant needs its adapter, whose sha256 is the record's")
        if self.action in ("applied", "failed") and not self.engine_id:
            raise MalformedEvent(f"control '{self.action}' needs engine_id")

    @property
    def full_weights(self) -> bool:
        """True when the order is about the full weights (no ``tenant``, no ``adapter``); an
        order about a tenant's adapter is never read as one about the full weights."""
        return self.tenant is None and self.adapter is None


@dataclass
class DeadLetter(Event):
    """A record a stage could not decode or process, kept with its origin for operators."""

    TYPE: ClassVar[str] = "dead_letter"
    source_topic: str = _f("str")
    partition: int = _f("int", domain=_index)
    offset: int = _f("int")
    error: str = _f("str")
    stage: str = _f("str", "")
    key: bytes | None = _f("any", None, optional=True)
    raw: bytes = _f("any", b"")
    created_at: int = _f("int", 0)


@dataclass
class TrainStep(Event):
    """One trainer step as the trainer's metrics log records it, for observers (``metrics`` topic).

    ``metrics``: the step's numbers by name (``loss``, ``kl``, ``ppo_kl``, ``entropy``,
    ``pg_clipfrac``, ``logprob_abs_diff`` in nats, ``reward_mean``, ``step_s``/``sync_s`` in
    seconds, ...: see :class:`pipeline.trainer.stage.TrainerStage`). ``sample_ids``: every
    sample of the batch; ``trained``: sample_id -> mean advantage over its response tokens, for
    the samples the step actually trained (a batch sample absent from it was not trained). A
    step redone after a restart is published again: the later record of a step wins.
    """

    TYPE: ClassVar[str] = "train_step"
    step: int = _f("int", domain=_index)
    policy_version: int = _f("int", 0, domain=_index)
    run_id: str = _f("str", "default", domain=_ident)
    created_at: int = _f("int", 0, domain=_time_ms)
    skipped: bool = _f("bool", False)
    metrics: dict = _f("dict", {})
    sample_ids: list = _f("list", [])
    trained: dict = _f("dict", {})
    tenant: str | None = _f("str", None, optional=True, domain=_ident)
    adapter: dict | None = _f("dict", None, optional=True, domain=_adapter)

    def validate(self) -> None:
        if self.step < 1:
            raise MalformedEvent(f"train_step.step must be >= 1, got {self.step}")
        if not all(isinstance(i, str) for i in self.sample_ids):
            raise MalformedEvent("train_step.sample_ids must be strings")


@dataclass
class Evaluation(Event):
    """A held-out evaluation of one policy version (``metrics`` topic; written by ``pipeline demo``
    and the ``evaluator`` stage).

    ``metrics``: rates in [0, 1] and means by name (``success_rate``, ``accuracy``,
    ``words_per_reply``); ``n``: replies evaluated. ``tenant`` / ``adapter`` (optional, added
    without a ``v`` bump: absent in older records): the evaluation is of that tenant's
    ``adapter`` (``adapter`` None with a tenant: the base model serving the tenant); both
    absent: of the full weights ``policy_version``. An ``adapter`` needs its ``tenant`` and is
    that tenant's (:func:`adapter_tenant_error`).
    """

    TYPE: ClassVar[str] = "evaluation"
    policy_version: int = _f("int", domain=_index)
    n: int = _f("int")
    name: str = _f("str", "heldout", domain=_short)
    run_id: str = _f("str", "default", domain=_ident)
    created_at: int = _f("int", 0, domain=_time_ms)
    metrics: dict = _f("dict", {})
    tenant: str | None = _f("str", None, optional=True, domain=_ident)
    adapter: dict | None = _f("dict", None, optional=True, domain=_adapter)

    def validate(self) -> None:
        if self.n < 0:
            raise MalformedEvent(f"evaluation.n must be >= 0, got {self.n}")
        if self.adapter is not None and self.tenant is None:
            raise MalformedEvent("evaluation: an adapter needs its tenant")


EVENT_TYPES: dict[str, type[Event]] = {
    c.TYPE: c for c in (Turn, NextState, SessionEnd, Feedback, Sample, Control, DeadLetter, TrainStep, Evaluation)
}
_FIELDS = {t: [(f.name, f.metadata["kind"], f.metadata["optional"],
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
               for f in dataclasses.fields(c)] for t, c in EVENT_TYPES.items()}
_DOMAINS = {t: [(f.name, f.metadata["domain"]) for f in dataclasses.fields(c) if f.metadata.get("domain")]
            for t, c in EVENT_TYPES.items()}


def check_domains(event: Event) -> None:
    """Every present field of ``event`` is in its domain (ids non-empty and at most
    :data:`MAX_ID_LEN` long, indices and versions in [0, :data:`MAX_INDEX`], token ids >= 0,
    log-probs in [:data:`LOGPROB_MIN`, 0], rewards and votes in :data:`VOTE_RANGE`,
    temperatures in (0, :data:`MAX_TEMPERATURE`], sha256 as 64 hex digits, messages with a
    role). Raises :class:`MalformedEvent` naming the field."""
    for name, domain in _DOMAINS[event.TYPE]:
        value = getattr(event, name)
        if value is None:
            continue
        err = domain(value)
        if err is not None:
            sep = "" if err.startswith("[") else " "
            raise MalformedEvent(f"{event.TYPE}.{name}{sep}{err}")
    err = adapter_tenant_error(getattr(event, "tenant", None), getattr(event, "adapter", None))
    if err is not None:
        raise MalformedEvent(f"{event.TYPE}.adapter {err}")


#: older schema versions still read, per event type: ``(type, v) -> function`` that turns the
#: event decoded with today's fields into today's meaning (then validated as usual)
_UPGRADES: dict[tuple[str, int], Any] = {("sample", 1): _sample_from_v1}


def readable_versions(etype: str) -> list[int]:
    """Schema versions of event type ``etype`` that :func:`decode` reads (current one last)."""
    cls = EVENT_TYPES[etype]
    return sorted(v for (t, v) in _UPGRADES if t == etype) + [cls.V]


def encode(event: Event) -> bytes:
    """Serialise an event to msgpack bytes (arrays packed). Raises :class:`MalformedEvent`."""
    event.validate()
    out: dict[str, Any] = {"type": event.TYPE, "v": event.V}
    for name, kind, _opt, _req in _FIELDS[event.TYPE]:
        value = getattr(event, name)
        if kind in _DT and value is not None:
            try:
                value = np.asarray(value, dtype=_DT[kind]).tobytes()
            except (TypeError, ValueError, OverflowError) as e:
                raise MalformedEvent(f"{event.TYPE}.{name}: cannot pack as {kind}: {e}") from e
        out[name] = value
    return msgpack.packb(out, use_bin_type=True)


def decode(data: bytes | bytearray | memoryview | None) -> Event:
    """Parse and validate msgpack bytes into an :class:`Event` subclass.

    Each event type has its own schema version (``Event.V``); an older version listed in
    :func:`readable_versions` is read and brought to today's meaning (``sample`` v1: see
    :func:`_sample_from_v1`), any other version is refused.

    Raises:
        MalformedEvent: not msgpack, not a map, a missing/ill-typed field, inconsistent lengths.
        UnknownEventType: ``type`` is not one of :data:`EVENT_TYPES`.
        UnsupportedVersion: ``v`` is not a version this code reads (a v2 ``sample`` read by
            code that only knows v1 is refused the same way: upgrade the trainer first).
    """
    if data is None:
        raise MalformedEvent("record has no value (tombstone)")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated exception types
        raise MalformedEvent(f"not a msgpack value: {type(e).__name__}: {e}") from None
    if not isinstance(obj, dict):
        raise MalformedEvent(f"event must be a msgpack map, got {type(obj).__name__}")
    etype = obj.get("type")
    cls = EVENT_TYPES.get(etype) if isinstance(etype, str) else None
    if cls is None:
        raise UnknownEventType(f"unknown event type {etype!r}")
    v = obj.get("v")
    upgrade = _UPGRADES.get((etype, v)) if isinstance(v, int) and not isinstance(v, bool) else None
    if (v != cls.V or isinstance(v, bool)) and upgrade is None:
        readable = ", ".join(f"v{x}" for x in readable_versions(etype))
        raise UnsupportedVersion(f"{etype}: schema version {v!r} not supported (this code reads {readable})")
    kwargs: dict[str, Any] = {}
    for name, kind, optional, required in _FIELDS[etype]:
        if name not in obj:
            if required:
                raise MalformedEvent(f"{etype}.{name} is missing")
            continue
        value = obj[name]
        if value is None:
            if not optional:
                raise MalformedEvent(f"{etype}.{name} must not be null")
        elif kind in _DT:
            if not isinstance(value, bytes) or len(value) % 4:
                raise MalformedEvent(f"{etype}.{name} must be packed {kind} bytes")
            value = np.frombuffer(value, dtype=_DT[kind]).tolist()
        elif kind != "any":
            want = _PY[kind]
            if not isinstance(value, want) or (kind in ("int", "float") and isinstance(value, bool)):
                raise MalformedEvent(f"{etype}.{name} must be {kind}, got {type(value).__name__}")
        kwargs[name] = value
    event = cls(**kwargs)
    if upgrade is not None:
        event = upgrade(event)
    event.validate()
    check_domains(event)
    return event
