"""Which session a request belongs to when the client did not say: agent markers, the ``user``
field, conversation continuation (see ``docs/sessions.md`` for the rules and their limits).

The proxy tries, in order, and records the rule that decided as the turn's ``session_source``
(:data:`pipeline.events.SESSION_SOURCES`):

1. ``header`` / ``body``: ``X-Session-Id`` or the body's ``session_id``
   (:func:`pipeline.proxy.validate.session_meta`);
2. ``marker:<agent>``: a known agent's own session id in the prompt (:data:`MARKERS`, first match
   wins; OpenClaw: the ``Runtime: ... sessionId=<id>`` footer of the first user message gives
   ``openclaw:<id>``). The prompt is forwarded exactly as sent: nothing is rewritten;
3. ``user``: the OpenAI ``user`` field gives ``user:<value>``;
4. ``continuation``: the request's messages extend the messages + answer of a turn this proxy
   recorded (:class:`Conversations`), so it continues that turn's session;
5. ``new``: none of these; a new session ``conv-<16 hex of sha256(request id)>``.

A value of rules 1-3 that is an unfilled template (:func:`unfilled`) is never an id: the rule
falls through, the response carries ``x-session-warning`` and
``pipeline_proxy_session_ids_ignored_total`` counts it.

Tenants (:class:`Tenants`) are decided before the session: a session is ``(tenant, session
id)``, and the prefix digests of a tenant's requests start from its tenant, so continuation never
crosses tenants.

Prefix digests (:func:`prompt_chain`) are sha256 over the orjson of each message (an assistant
message in a normal form, :func:`canonical`), chained message by message: O(bytes of the
request), computed once per request; a turn's messages + answer digest is the request's chain
extended by the answer.
"""

from __future__ import annotations

import hashlib
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson

from pipeline.engine_api.render import content_text
from pipeline.events import CLIENT_ID, SESSION_SOURCES, tenant_error
from pipeline.proxy.errors import ProxyError, bad_request

#: the alphabet of a session id: 1-256 printable ASCII characters without spaces
SESSION_ID = CLIENT_ID
_TEMPLATE = re.compile(r"\$\{|\{\{|^<|>$|^\$[A-Za-z_][A-Za-z0-9_]*$|^%[A-Za-z_][A-Za-z0-9_]*%$")
_UNSET_WORDS = ("undefined", "null", "NULL", "None", "nil")  # exact: "none" may be a real id
DIGEST_BYTES = 16


def key_digest(key: bytes) -> str:
    """The sha256 hex digest of an API key: what ``proxy.tenants`` maps (keys are never kept in clear)."""
    return hashlib.sha256(key).hexdigest()


class Tenants:
    """Who a request belongs to: its API key, or its ``X-Tenant-Id`` header when no key map is
    configured (``docs/tenants.md``).

    Args:
        key_map: ``{sha256 hex of an API key: tenant}`` (``proxy.tenants``); empty: the header decides.
        api_keys: accepted keys in clear (``proxy.api_keys``, secret, from the environment); with a
            key map they are accepted with no tenant.

    :meth:`resolve` raises :class:`~pipeline.proxy.errors.ProxyError`, answered by each door in
    its own API's shape: 401 ``invalid_api_key`` (no key, an unknown key), 403
    ``tenant_mismatch`` (a header tenant that is not the key's: never trusted over the key), 400
    ``invalid_tenant_id`` (a header tenant outside :data:`pipeline.events.CLIENT_ID`, or an
    unfilled template: refused rather than served as no tenant).
    """

    def __init__(self, key_map: dict[str, str], api_keys: set[bytes]) -> None:
        self.key_map = dict(key_map)
        self.api_keys = set(api_keys)

    @property
    def authenticates(self) -> bool:
        """Requests need a key."""
        return bool(self.key_map or self.api_keys)

    def resolve(self, headers: dict) -> str | None:
        """The tenant of a request (None: none) from its lower-cased raw ``headers``."""
        claimed = self._header(headers.get(b"x-tenant-id"))
        if not self.authenticates:
            return claimed
        key = self._bearer(headers.get(b"authorization"))
        if not self.key_map:
            return claimed
        tenant = self.key_map.get(key_digest(key))
        if tenant is None and key not in self.api_keys:
            raise ProxyError(401, "invalid API key", "authentication_error", code="invalid_api_key")
        if claimed is not None and claimed != tenant:
            raise ProxyError(403, "X-Tenant-Id does not match the tenant of the API key (a key's tenant is decided "
                             "by the proxy's key map, not by the header)", "permission_error", param="X-Tenant-Id",
                             code="tenant_mismatch")
        return tenant

    def _bearer(self, h: bytes | None) -> bytes:
        """The key of an ``Authorization: Bearer`` header; 401 when missing, or (no key map)
        when it is not one of ``api_keys``."""
        if h is None:
            raise ProxyError(401, "missing API key: send 'Authorization: Bearer <key>' (x-api-key on /v1/messages)",
                             "authentication_error", code="invalid_api_key")
        scheme, _, key = h.partition(b" ")
        key = key.strip()
        if scheme.lower() != b"bearer" or not key or (not self.key_map and key not in self.api_keys):
            raise ProxyError(401, "invalid API key", "authentication_error", code="invalid_api_key")
        return key

    @staticmethod
    def _header(h: bytes | None) -> str | None:
        if h is None:
            return None
        v = h.decode("latin-1").strip()
        why = unfilled(v) or tenant_error(v)
        if why is not None:
            raise bad_request(f"X-Tenant-Id {why}", param="X-Tenant-Id", code="invalid_tenant_id")
        return v


def unfilled(value: Any) -> str | None:
    """Why a client-sent session value is not an id, or None when it may be one.

    ``empty``: empty or whitespace only; ``template``: an unexpanded placeholder (anything with
    ``${`` or ``{{``, a value that starts with ``<`` or ends with ``>`` such as
    ``<session-id>``, a whole ``$VAR`` or ``%VAR%``) or the text a template engine writes for an
    unset variable, exactly (``undefined``, ``null``, ``NULL``, ``None``, ``nil``).
    Non-strings are not judged here (None).
    """
    if not isinstance(value, str):
        return None
    v = value.strip()
    if not v:
        return "empty"
    if v in _UNSET_WORDS or _TEMPLATE.search(v):
        return "template"
    return None


@dataclass(frozen=True, slots=True)
class Marker:
    """A known agent's session id inside its prompt.

    Attributes:
        name: the agent; the turn's ``session_source`` is ``marker:<name>``.
        pattern: searched in the text of the first user message; group 1 is the agent's id.
        prefix: the derived session id is ``prefix + id``.
    """

    name: str
    pattern: re.Pattern
    prefix: str

    @property
    def source(self) -> str:
        return f"marker:{self.name}"


#: the markers tried in order (first match wins); each ``source`` is in events.SESSION_SOURCES
MARKERS: tuple[Marker, ...] = (
    Marker("openclaw", re.compile(r"Runtime:[\s\S]{0,1000}?\bsessionId=([^\s|,;)\]]+)"),
           "openclaw:"),
)
assert all(m.source in SESSION_SOURCES for m in MARKERS)


def _text(content: Any) -> str | None:
    """:func:`content_text` of a string or a list of parts (other parts, such as images, left
    out); None for anything else."""
    return content_text(content) if isinstance(content, (str, list)) else None


def marker_id(messages: list) -> tuple[str | None, str | None, str | None]:
    """``(session id, source, why not)`` from the first marker found in the first user message:
    ``(id, "marker:<name>", None)``, ``(None, "marker:<name>", reason)`` when the marker's id is
    unusable (an unfilled template left in the prompt), ``(None, None, None)`` when none is there."""
    first = next((m for m in messages if isinstance(m, dict) and m.get("role") == "user"), None)
    text = _text(first.get("content")) if first is not None else None
    if not text:
        return None, None, None
    for mk in MARKERS:
        hit = mk.pattern.search(text)
        if hit is None:
            continue
        sid = mk.prefix + hit.group(1)
        why = unfilled(hit.group(1)) or (None if SESSION_ID.match(sid) else "invalid")
        return (None if why else sid), mk.source, why
    return None, None, None


def user_id(user: Any) -> tuple[str | None, str | None]:
    """``("user:<value>", None)`` for a usable OpenAI ``user`` field, ``(None, reason)`` for an
    unusable one (``empty``, ``template``, ``invalid``: not a string of the id alphabet) and
    ``(None, None)`` when there is none."""
    if user is None:
        return None, None
    if not isinstance(user, str):
        return None, "invalid"
    why = unfilled(user)
    sid = "user:" + user.strip()
    if why is None and not SESSION_ID.match(sid):
        why = "invalid"
    return (None, why) if why else (sid, None)


def claim(session_id: str | None, source: str | None, messages: list, user: Any,
          warnings: list) -> tuple[str | None, str | None]:
    """``(session id, source)`` a client gave by rules 1-3 (a header/body id as read by
    :func:`pipeline.proxy.validate.session_meta`, else a marker, else the ``user`` field), or
    ``(None, None)``; appends ``(field, reason)`` to ``warnings`` for each value ignored."""
    if session_id is not None:
        return session_id, source
    sid, src, why = marker_id(messages)
    if why:
        warnings.append((src, why))
    elif sid is not None:
        return sid, src
    sid, why = user_id(user)
    if why:
        warnings.append(("user", why))
    elif sid is not None:
        return sid, "user"
    return None, None


def assistant_parts(content: Any, tool_calls: Any) -> list:
    """The normal form of an assistant message: ``[text stripped, (name, arguments), ...]``.

    Text parts are joined, whitespace at the ends of the text and the JSON formatting of
    tool-call arguments are normalised (a client that re-serialises the answer still matches);
    tool-call ids are left out (clients rewrite them).
    """
    text = content if isinstance(content, str) else _text(content)
    parts: list[Any] = [text.strip() if text is not None else ""]
    if not tool_calls:
        return parts
    for tc in tool_calls:
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict):
            continue
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = orjson.dumps(orjson.loads(args), option=orjson.OPT_SORT_KEYS).decode()
            except orjson.JSONDecodeError:
                args = args.strip()
        parts.append((fn.get("name"), args))
    return parts


def canonical(m: Any) -> bytes:
    """The bytes one message adds to a prefix digest: an assistant message in its
    :func:`assistant_parts` form (clients rebuild it from the answer), any other message as the
    orjson of the message as sent (clients replay those as they sent them)."""
    if isinstance(m, dict) and m.get("role") == "assistant":
        return orjson.dumps(("assistant", assistant_parts(m.get("content"), m.get("tool_calls"))))
    return orjson.dumps(m)


@dataclass(slots=True)
class Chain:
    """Prefix digests of one request's messages.

    Attributes:
        at_assistant: digests of ``messages[:i + 1]`` for each assistant message ``i``, in order.
        prompt: digest of all the messages (the request's own identity as a prompt).
        hasher: the sha256 state after the last message (extended by the answer at completion).
        last_assistant: the last assistant message of the chain, or None.
    """

    at_assistant: list[bytes]
    prompt: bytes
    hasher: Any
    last_assistant: dict | None = None

    def with_answer(self, content: Any, tool_calls: Any) -> bytes:
        """The digest of the messages + this answer (what the next request's chain holds)."""
        h = self.hasher.copy()
        h.update(orjson.dumps(("assistant", assistant_parts(content, tool_calls))))
        return h.digest()[:DIGEST_BYTES]


def prompt_chain(messages: list, continue_final: bool = False, tenant: str | None = None) -> Chain:
    """The :class:`Chain` of a request. ``continue_final``: the trailing assistant message is the
    start of this turn's reply (``continue_final_message``), so it is left out of the chain.
    ``tenant``: the request's tenant, hashed first (a tenant's digests never equal another's, so
    :class:`Conversations` never continues a session of another tenant; no tenant: the digests
    as before tenants)."""
    if continue_final and messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
        messages = messages[:-1]
    h = hashlib.sha256()
    if tenant is not None:
        h.update(orjson.dumps(("tenant", tenant)))  # never the orjson of a message (a JSON list of two strings)
    at: list[bytes] = []
    update = h.update
    last = None
    for m in messages:
        update(canonical(m))
        if isinstance(m, dict) and m.get("role") == "assistant":
            at.append(h.copy().digest()[:DIGEST_BYTES])
            last = m
    return Chain(at, h.copy().digest()[:DIGEST_BYTES], h, last)


def content_id(prefix: str, rid: str) -> str:
    """A derived session id ``prefix + 16 hex of sha256(request id)`` (unique: request ids are)."""
    return prefix + hashlib.sha256(rid.encode()).hexdigest()[:16]


OWNERS_KEPT = 8  # sessions remembered per recorded turn (more: it stays ambiguous for their claims too)


@dataclass(slots=True)
class Recorded:
    """One recorded turn in :class:`Conversations`.

    Attributes:
        session_id: its session; None when two sessions recorded the same messages + answer
            (ambiguous: continuing it would merge them, so nobody continues it).
        child: the prompt digest of the first accepted request that continued it; a different
            prompt continuing it later is a branch, not this conversation.
        owners: the sessions that recorded it: a request that claims one of them (a header)
            continues it even when it is ambiguous for requests that claim nothing.
        request_ids: the request of each owner's latest turn that recorded it (None: not given),
            in ``owners``' order;
            a session's state holds the request ids of its own turns, so a state that does not
            know its owner's is another conversation under the same id
            (:meth:`SessionTable.route <pipeline.proxy.sessions.SessionTable.route>`).
    """

    session_id: str | None
    child: bytes | None = None
    owners: tuple[str, ...] = ()  # every session that recorded it (at most OWNERS_KEPT)
    request_ids: tuple[str | None, ...] = ()

    def request_of(self, session_id: str) -> str | None:
        """The request id of ``session_id``'s turn that recorded this (None: unknown)."""
        for owner, rid in zip(self.owners, self.request_ids):
            if owner == session_id:
                return rid
        return None


class Conversations:
    """Bounded LRU ``digest(messages + answer) -> Recorded`` of completed main turns.

    Args:
        capacity: turns remembered (least recently used dropped first; one entry per turn).
    """

    def __init__(self, capacity: int = 200_000) -> None:
        self.capacity = capacity
        self._d: OrderedDict[bytes, Recorded] = OrderedDict()

    def __len__(self) -> int:
        return len(self._d)

    def record(self, digest: bytes, session_id: str, request_id: str | None = None) -> None:
        """Remember that a turn of ``session_id`` (request ``request_id``) ended with these
        messages + answer."""
        r = self._d.get(digest)
        if r is None:
            self._d[digest] = Recorded(session_id, owners=(session_id,), request_ids=(request_id,))
            if len(self._d) > self.capacity:
                self._d.popitem(last=False)
        else:
            self._d.move_to_end(digest)
            if r.session_id != session_id:
                r.session_id = None
            if session_id in r.owners:  # the same session again (a new conversation under a reused
                # id that began the same way): its latest turn is the one its state knows
                i = r.owners.index(session_id)
                r.request_ids = r.request_ids[:i] + (request_id,) + r.request_ids[i + 1:]
            elif len(r.owners) < OWNERS_KEPT:
                r.owners += (session_id,)
                r.request_ids += (request_id,)

    def find(self, chain: Chain) -> tuple[bytes, Recorded] | None:
        """The longest recorded prefix of a request, as ``(digest, entry)``, or None."""
        for d in reversed(chain.at_assistant):
            r = self._d.get(d)
            if r is not None:
                self._d.move_to_end(d)
                return d, r
        return None

    @staticmethod
    def continues(hit: tuple[bytes, Recorded] | None, chain: Chain) -> str | None:
        """The session a request continues: the hit's, unless ambiguous or a branch."""
        if hit is None:
            return None
        r = hit[1]
        if r.session_id is None or (r.child is not None and r.child != chain.prompt):
            return None
        return r.session_id

    @staticmethod
    def continues_claimed(hit: tuple[bytes, Recorded] | None, chain: Chain, claimed: str, sub: str) -> str | None:
        """The session a request that claims ``claimed`` continues: the one owner of the hit that
        is ``claimed`` or one of its sub-sessions (``sub`` + hash); None when no owner is, or when
        several are (two conversations of that id: not to be told apart). A branch (another
        prompt continued the turn first) stays in the claimed session: the client says it is one."""
        if hit is None:
            return None
        mine = [o for o in hit[1].owners if o == claimed or o.startswith(sub)]
        return mine[0] if len(mine) == 1 else None

    def accepted(self, hit: tuple[bytes, Recorded] | None, chain: Chain) -> None:
        """A request that continued ``hit`` was accepted by the engine: it is its child."""
        if hit is not None and hit[1].child is None:
            hit[1].child = chain.prompt
