"""Context checks of a tool result: did the call act on what the user asked for?

A tool can succeed at the wrong thing: the right command on the wrong file, a message to the
wrong person, the tests of another module. The result alone then reads as a success; only the
user's request next to the assistant's tool call shows the mismatch.

- :func:`target_mismatch` compares the specific things each names (file names and paths, e-mail
  addresses and the names in them, @handles and #channels, ticket-style ids, identifiers such as
  ``web-2`` or ``feature/login``, environments and branches, dates and times, numbers, names of
  people or places, also read from the argument they are passed as) kind by kind: when both
  sides name things of one kind and none of them match, the call targeted something else.
- :func:`unrequested_target` flags a target argument (path, recipient, branch ...) with a
  distinctive word the request never uses.
- :func:`call_query` and :func:`is_search_call` find search calls, whose results the judge
  checks for relevance to the query and the request.

All are heuristics that can only make the judge abstain (score 0); they never produce a sign.
"""

from __future__ import annotations

import json
import re

_FILE = re.compile(r"(?<![\w@/.-])(?:[\w-]+/)*[\w-]+\.(?:[a-z][a-z0-9]{0,4})\b", re.I)
_EMAIL = re.compile(r"\b[\w.+-]+@[\w-]+(?:\.[\w-]+)+\b")
_HANDLE = re.compile(r"(?<![\w])[@#][\w-]+(?:\.[\w-]+)*")
_QUOTED = re.compile(r"[\"'`“‘]([^\"'`”’\n]{2,60})[\"'`”’]")
_TICKET = re.compile(r"\b[A-Z]{2,}-\d+\b")
_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?![\w])")
_NAME = re.compile(r"(?<=[a-z,;:] )[A-Z][a-z]{2,}\b")  # a capitalised word inside a sentence
_IDENT = re.compile(r"(?<![\w@#/.-])(?=[\w-]*[a-z])[a-z0-9]+(?:[-_/:.][a-z0-9]+)+(?![\w-])", re.I)
_ENV = re.compile(r"\b(?:prod|production|staging|stage|dev|development|qa|sandbox|preview|live|main|master|develop|"
                  r"release|canary|beta|test|testing)\b", re.I)
_WEEKDAY = re.compile(r"\b(?:mon|tues|wednes|thurs|fri|satur|sun)day\b", re.I)
_MONTH = re.compile(r"\b(?:january|february|march|april|may|june|july|august|september|october|november|december)\b",
                    re.I)
_ISODATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
_CLOCK = re.compile(r"\b\d{1,2}:\d{2}\b")
_AMPM = re.compile(r"\b\d{1,2}\s?(?:am|pm)\b", re.I)
_PERSON_KEYS = {"to", "recipient", "recipients", "user", "username", "assignee", "owner", "name", "contact", "cc",
                "reviewer", "reviewers", "member", "person", "attendee", "attendees", "invitee", "for"}
_ENV_KEYS = {"env", "environment", "stage", "target", "cluster", "namespace", "branch", "region", "workspace"}
_WORDS = re.compile(r"[^\W_]+")
_QUERY_KEYS = ("q", "query", "search", "search_query", "term", "terms", "keywords")
_CODE_QUERY = re.compile(r"\s*(?:select|insert|update|delete|with|match|create|drop)\b|\s*[{\[]", re.I)
_SEARCH_TOOL = re.compile(r"search|find|lookup|look_up|browse|google|bing|retriev|news|wiki", re.I)
_NOT_TARGETS = {"json", "yaml", "true", "false", "null", "none"}


def call_text(response: str) -> str:
    """The rendered tool calls (``name(arguments)`` lines) of an assistant output, or ""."""
    _, sep, calls = (response or "").partition("[tool calls]")
    return calls.strip() if sep else ""


def _call_items(calls: str) -> list[tuple[str, str]]:
    """``(argument name, value)`` of the tool calls' JSON arguments, nested values flattened
    (name "" for the whole argument text when it is not JSON)."""
    out = []
    for line in calls.splitlines():
        _, sep, rest = line.partition("(")
        if not sep:
            continue
        raw = rest[:-1] if rest.endswith(")") else rest
        try:
            args = json.loads(raw)
        except ValueError:
            out.append(("", raw))
            continue
        stack = [("", args)]
        while stack:
            key, v = stack.pop()
            if isinstance(v, dict):
                stack.extend((str(k).lower(), x) for k, x in v.items())
            elif isinstance(v, list):
                stack.extend((key, x) for x in v)
            elif v is not None and not isinstance(v, bool):
                out.append((key, str(v)))
    return out


def _call_args(calls: str) -> list[str]:
    """String values of the tool calls' arguments."""
    return [v for _, v in _call_items(calls)]


def _things(text: str) -> dict[str, set[str]]:
    """The specific things a text names, by kind, normalised to lower case."""
    found: dict[str, set[str]] = {}

    def add(kind: str, values) -> None:
        vals = {v.lower().strip() for v in values if v and v.lower().strip() not in _NOT_TARGETS}
        if vals:
            found.setdefault(kind, set()).update(vals)

    emails = _EMAIL.findall(text)
    add("email", emails)
    without_emails = _EMAIL.sub(" ", text)
    add("file", [f.rsplit("/", 1)[-1] for f in _FILE.findall(without_emails) if not re.fullmatch(r"[\d.]+", f)])
    add("handle", _HANDLE.findall(without_emails))
    add("ticket", _TICKET.findall(text))
    add("number", [n.lstrip("0") or "0" for n in _NUMBER.findall(_FILE.sub(" ", without_emails))])
    add("name", [n for n in _NAME.findall(" " + without_emails) if not (_WEEKDAY.fullmatch(n) or _MONTH.fullmatch(n))]
        + [p for e in emails for p in re.split(r"[._+-]", e.split("@")[0])
                                                        if len(p) >= 3])
    add("env", _ENV.findall(text))
    add("weekday", _WEEKDAY.findall(text))
    add("month", _MONTH.findall(text))
    add("isodate", _ISODATE.findall(text))
    add("clock", _CLOCK.findall(text))
    add("ampm", [a.replace(" ", "") for a in _AMPM.findall(text)])
    add("ident", [i for i in _IDENT.findall(without_emails) if not _ISODATE.fullmatch(i) and not _CLOCK.fullmatch(i)])
    return found


def _call_things(calls: str) -> dict[str, set[str]]:
    """:func:`_things` of the call's argument values, plus names and environments read from
    the argument they are passed as (``to``, ``assignee`` ...; ``env``, ``branch`` ...)."""
    items = _call_items(calls)
    found = _things(" \n".join(v for _, v in items))
    for key, value in items:
        words = [w.lower() for w in _WORDS.findall(value)]
        if key in _PERSON_KEYS and 1 <= len(words) <= 3 and not value.isupper():
            found.setdefault("name", set()).update(w for w in words if len(w) >= 3)
        if key in _ENV_KEYS and 1 <= len(words) <= 3:
            found.setdefault("env", set()).update(words)
    return found


KINDS = ("email", "file", "handle", "ticket", "name", "env", "weekday", "month", "isodate", "clock", "ampm", "ident",
         "number")


def target_mismatch(request: str, response: str) -> str | None:
    """Why the tool call seems to act on something other than the request names, or None.

    Args:
        request: the user's request the turn answered.
        response: the assistant's output with its rendered tool calls (``[tool calls]`` block).
    Returns:
        e.g. ``"file: request names report.pdf, the call summary.pdf"``; None when no kind of
        thing is named on both sides, or when a named thing matches.
    """
    calls = call_text(response)
    if not calls or not (request or "").strip():
        return None
    asked = _things(request)
    called = _call_things(calls)
    called_text = " ".join(_call_args(calls)).lower()
    for kind in KINDS:
        want, got = asked.get(kind), called.get(kind)
        if not want or not got:
            continue
        if kind in ("name", "env"):  # a name matches when it appears anywhere in the call
            if any(re.search(r"(?<![^\W_])" + re.escape(w), called_text) for w in want):
                continue
        elif want & got or any(w in called_text for w in want):
            continue
        return f"{kind}: request names {', '.join(sorted(want))[:60]}, the call {', '.join(sorted(got))[:60]}"
    return None


def call_query(response: str) -> str | None:
    """The query string of a search call: an argument ``q``, ``search`` or ``keywords``, or
    ``query``/``term`` of a tool whose name says search (``web_search``, ``kb_lookup`` ...);
    not database or code queries (SQL, JSON)."""
    for line in call_text(response).splitlines():
        name, sep, rest = line.partition("(")
        if not sep:
            continue
        try:
            args = json.loads(rest[:-1] if rest.endswith(")") else rest)
        except ValueError:
            continue
        if isinstance(args, dict):
            for key in _QUERY_KEYS:
                v = args.get(key)
                if not isinstance(v, str) or not _WORDS.findall(v) or _CODE_QUERY.match(v):
                    continue
                if _SEARCH_TOOL.search(name) or key in ("q", "search", "search_query", "keywords"):
                    return v
    return None


_TARGET_KEYS = {"path", "file", "filename", "filepath", "file_path", "dir", "directory", "folder", "dest",
                "destination",
                "to", "recipient", "recipients", "cc", "email", "assignee", "user", "username", "contact", "customer",
                "branch", "env", "environment", "region", "cluster", "namespace", "database", "db", "table", "repo",
                "repository", "ticket", "issue", "order_id", "account"}
_SHELL_KEYS = {"cmd", "command", "script", "shell", "args", "argv", ""}
_PATHLIKE = re.compile(r"(?<![\w-])(?:~|\.{0,2})?/?(?:[\w.-]+/)+[\w.-]*|(?<![\w/.-])[\w-]+\.[a-z][a-z0-9]{0,4}\b", re.I)
_GENERIC = set("""tmp var log logs home usr bin etc src lib test tests spec specs data file files dir py js ts tsx jsx
json yml yaml txt md csv sh cfg ini toml lock the app apps main index default new old all root local www api v1 v2
http https com org net io example localhost dev null none true false out build dist docs doc html css png jpg pdf zip
gz tar mnt opt srv run user users config conf settings public static assets images img node_modules venv env""".split())


def _present(word: str, request: str) -> bool:
    """``word`` (lower case) or a word sharing its first 5 letters occurs in the request."""
    if re.search(r"(?<![^\W_])" + re.escape(word), request):
        return True
    return len(word) >= 6 and re.search(r"(?<![^\W_])" + re.escape(word[:5]), request) is not None


def unrequested_target(request: str, response: str) -> str | None:
    """Why a tool call seems to act on a target the request never mentions, or None.

    A target is an argument passed as a path, recipient, branch, environment, channel, service,
    id ... (or a path in a shell command). It is unrequested when it has a distinctive word
    (not a generic one such as ``src``, ``tests``, ``json``) and none of its distinctive words,
    nor a word sharing their first five letters, occurs in the request.
    """
    calls = call_text(response)
    req = (request or "").lower()
    if not calls or len(_WORDS.findall(req)) < 3:
        return None
    for key, value in _call_items(calls):
        if key in _SHELL_KEYS:  # paths in a command count when the request itself names a file or path
            values = _PATHLIKE.findall(value) if _PATHLIKE.search(request or "") else []
        elif key in _TARGET_KEYS and len(value) <= 120 and not (value.isupper() and len(value) <= 5):
            values = [value]  # (short upper-case codes such as airport or currency codes are not names)
        else:
            continue
        for v in values:
            words = {w.lower() for w in re.split(r"[\W_]+", _EMAIL.sub(lambda m: m.group(0).split("@")[0], v))
                     if len(w) >= 3 and not w.isdigit()}
            distinctive = words - _GENERIC
            if distinctive and not any(_present(w, req) for w in distinctive):
                return f"{key or 'command'} {v[:60]!r} is not in the request"
    return None


def is_search_call(response: str) -> bool:
    """The assistant called a tool whose name says search (``web_search``, ``kb_lookup`` ...)."""
    return any(_SEARCH_TOOL.search(line.partition("(")[0]) for line in call_text(response).splitlines())
