"""Context checks of a tool result: did the call act on what the user asked for?

A tool can succeed at the wrong thing: the right command on the wrong file, a message to the
wrong person, the tests of another module. The result alone then reads as a success; only the
user's request next to the assistant's tool call shows the mismatch.

- :func:`target_mismatch` compares the specific things each names (file names and paths, e-mail
  addresses and the names in them, @handles and #channels, ticket-style ids, identifiers such as
  ``web-2``, branches such as ``feature/login``, environments and branches, dates and times, numbers, names of
  people or places, also read from the argument they are passed as) kind by kind: when both
  sides name things of one kind and none of them match, the call targeted something else.
- :func:`unrequested_target` flags a target argument (path, recipient, branch ...) with a
  distinctive word the request never uses.
- :func:`call_query` and :func:`is_search_call` find search calls, whose results the judge
  checks for relevance to the query and the request.

All are heuristics. A mismatch makes the judge abstain (score 0), except for the kinds of thing a
user names exactly (e-mail, file, @handle/#channel, ticket, branch, environment): a call on
another one of those succeeded at the wrong thing and scores -1
(:data:`pipeline.judge.cpu.classifier.DISTINCT_KINDS`).
"""

from __future__ import annotations

import datetime
import json
import re

_FILE = re.compile(r"(?<![\w@/.-])(?:[\w-]+/)*[\w-]+\.(?:[a-z][a-z0-9]{0,4})\b", re.I)
_EMAIL = re.compile(r"\b[\w.+-]+@[\w-]+(?:\.[\w-]+)+\b")
_HANDLE = re.compile(r"(?<![\w])[@#][\w-]+(?:\.[\w-]+)*")
_TICKET = re.compile(r"\b[A-Z]{2,}-\d+\b")
_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?![\w])")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")  # "3,200" -> "3200"
_MONTHS = ("january", "february", "march", "april", "may", "june", "july", "august", "september", "october",
           "november", "december")
_MON = "(?:" + "|".join("May" if m == "may" else f"[{m[0].upper()}{m[0]}]{m[1:3]}(?:{m[3:]})?"
                         for m in _MONTHS) + r")\b"  # a month's name or its first three letters ("may": a verb)
_DATETIME = re.compile(r"\d{4}-\d{2}-\d{2}(?:[T ][\d:.]+(?:Z|[+-]\d{2}:?\d{2})?)?|\d{1,2}:\d{2}(?::\d{2})?(?:\s?[AaPp][Mm])?"
                       rf"|\b\d{{1,2}}\s?[AaPp][Mm]\b|\b\d{{1,2}}(?:st|nd|rd|th)?(?:\s+of)?\s+{_MON}\b(?:,?\s+\d{{4}})?"
                       rf"|\b{_MON}\.?\s+\d{{1,2}}(?:st|nd|rd|th)?\b(?:,?\s+\d{{4}})?")
_NAME = re.compile(r"(?<=[a-z,;:] )[A-Z][a-z]{2,}\b")  # a capitalised word inside a sentence
_IDENT = re.compile(r"(?<![\w@#/.-])(?=[\w-]*[a-z])[a-z0-9]+(?:[-_/:.][a-z0-9]+)+(?![\w-])", re.I)
_ENV = re.compile(r"\b(?:prod|production|staging|stage|dev|development|qa|sandbox|preview|live|main|master|develop|"
                  r"release|canary|beta|test|testing)\b", re.I)
_BRANCHLIKE = re.compile(r"(?<![\w./-])(?:feature|feat|fix|bugfix|hotfix|release|chore|dev|topic|wip)/[\w./-]+", re.I)
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


def _number(n: str) -> str:
    """One spelling per whole value: "007" -> "7", "2300.0" -> "2300" ("3.10" stays: a version)."""
    n = n.lstrip("0") or "0"
    whole, _, frac = n.partition(".")
    return (whole or "0") if frac and not frac.strip("0") else n


def _numbers(text: str) -> list[str]:
    """The numbers a text states (:func:`_number` spellings; "3,200" is one), not those of its
    dates and times ("7 December at 3pm", "2026-12-07T15:00" state no count or amount)."""
    return [_number(n) for n in _NUMBER.findall(_THOUSANDS.sub("", _DATETIME.sub(" ", text)))]


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
    add("number", _numbers(_FILE.sub(" ", without_emails)))
    add("name", [n for n in _NAME.findall(" " + without_emails) if not (_WEEKDAY.fullmatch(n) or _MONTH.fullmatch(n))]
        + [p for e in emails for p in re.split(r"[._+-]", e.split("@")[0])
                                                        if len(p) >= 3])
    add("env", _ENV.findall(text))
    add("weekday", _WEEKDAY.findall(text))
    add("month", _MONTH.findall(text))
    add("isodate", _ISODATE.findall(text))
    add("clock", _CLOCK.findall(text))
    add("ampm", [a.replace(" ", "") for a in _AMPM.findall(text)])
    add("branch", [b.rstrip(".,;:") for b in _BRANCHLIKE.findall(without_emails)])  # not a sentence's full stop
    add("ident", [i for i in _IDENT.findall(without_emails) if not _ISODATE.fullmatch(i) and not _CLOCK.fullmatch(i)])
    add("numbered", [f"{w} {_number(n)}" for w, n in _NUMBERED_NAME.findall(_DATETIME.sub(" ", without_emails))
                     if len(w) >= 3 and w.lower() not in _NOT_NAMES])
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


KINDS = ("email", "file", "handle", "ticket", "branch", "name", "env", "weekday", "month", "isodate", "clock", "ampm",
         "ident", "numbered", "number")
_NUMBERED_NAME = re.compile(r"\b([^\W\d_]+)[ _-](\d+(?:\.\d+)?)(?![\w.])")  # "Budget 2027", "sprint 14", "room-204"
_NOT_NAMES = {"for", "and", "the", "with", "from", "than", "about", "over", "under", "only", "last", "next", "top",
              "first", "all", "every", "each", "per", "via", "into", "onto", "out", "off", "are", "was", "were"}


def _same_name_other_number(want: set[str], got: set[str]) -> bool:
    """A name the request numbers ("budget 2027") carries only other numbers in the call ("budget 2026")."""
    def by_name(values: set[str]) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for v in values:
            name, _, n = v.rpartition(" ")
            out.setdefault(name, set()).add(n)
        return out
    asked, called = by_name(want), by_name(got)
    return any(not asked[name] & called[name] for name in asked.keys() & called.keys())


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
        if kind == "numbered":  # only the same name with another number counts
            if not _same_name_other_number(want, got):
                continue
        elif kind in ("name", "env"):  # a name matches when it appears anywhere in the call
            if any(re.search(r"(?<![^\W_])" + re.escape(w), called_text) for w in want):
                continue
        elif want & got or any(w in called_text for w in want):
            if kind == "file" and _swapped(want, got, called_text):
                return f"file: the call names {', '.join(sorted(got - want))[:60]} where the request names " \
                       f"{', '.join(sorted(w for w in want if w not in called_text))[:60]}"
            continue
        return f"{kind}: request names {', '.join(sorted(want))[:60]}, the call {', '.join(sorted(got))[:60]}"
    ref = git_ref_mismatch(request, calls)
    if ref:
        return ref
    return None


def _swapped(want: set[str], got: set[str], called_text: str) -> bool:
    """Some files match, but the call also names a file the request does not while a file the
    request names is missing from the call (``mv draft.docx new.docx`` for "rename final.docx to
    new.docx"): one of the targets was swapped for another."""
    return bool(got - want) and any(w not in called_text for w in want)


_GIT_REF_CMD = re.compile(r"\bgit\s+(?:-\S+\s+)*(push|checkout|switch|merge|rebase|branch|reset|pull|cherry-pick)\b([^;&|\n]*)")


def git_ref_mismatch(request: str, calls: str) -> str | None:
    """A git command (push, checkout, merge ...) on a branch other than the one the request
    names (``feature/search`` asked, ``git push origin main`` called)."""
    req_refs = {r.lower().rstrip(".,") for r in _BRANCHLIKE.findall(request or "")}
    if not req_refs:
        return None
    for _, v in _call_items(calls):
        for m in _GIT_REF_CMD.finditer(v):
            args = [a for a in m.group(2).split() if not a.startswith("-")]
            if m.group(1) in ("push", "pull") and args:
                args = args[1:]  # the remote
            refs = {a.split(":")[-1].lower() for a in args if a}
            if refs and not refs & req_refs and not any(r in v.lower() for r in req_refs):
                return f"branch: git {m.group(1)} on another branch; the request names {', '.join(sorted(req_refs))[:60]}, the call " \
                       f"{', '.join(sorted(refs))[:60]}"
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


# -- a success at the wrong thing, shown by the request itself (the judge scores it -1) ----------------------
_TOKEN = re.compile(r"[\w./~-]*[A-Za-z][\w./~-]*")
_CURRENCY = {"euro": "eur", "euros": "eur", "€": "eur", "dollar": "usd", "dollars": "usd", "$": "usd",
             "pound": "gbp", "pounds": "gbp", "sterling": "gbp", "£": "gbp", "yen": "jpy", "¥": "jpy",
             "franc": "chf", "francs": "chf", "rupee": "inr", "rupees": "inr", "yuan": "cny", "renminbi": "cny",
             "krona": "sek", "kronor": "sek", "zloty": "pln", "real": "brl", "reais": "brl", "peso": "mxn",
             "pesos": "mxn", "celsius": "c", "fahrenheit": "f", "kelvin": "k", "miles": "mi", "kilometres": "km",
             "kilometers": "km", "km": "km", "mi": "mi", "kg": "kg", "kilograms": "kg", "pounds_mass": "lb",
             "lb": "lb", "lbs": "lb", "metres": "m", "meters": "m", "feet": "ft", "ft": "ft", "inches": "in",
             "cm": "cm", "centimetres": "cm", "centimeters": "cm"}
_DIRECTION = re.compile(r"([\w€$£¥]+)\s+(?:to|into|in|->|→)\s+([\w€$£¥]+)", re.I)
_HOW_MANY = re.compile(r"\bhow (?:many|much)\s+([\w€$£¥]+)\s+(?:is|are|in|for|make|equals?|would|do I get for)\s+"
                       r"(?:[\d.,]+\s*)?(?:\w+\s+)?([\w€$£¥]+)", re.I)
_FROM_KEYS = ("from", "source", "src", "from_currency", "base", "from_unit", "input", "old", "old_name")
_TO_KEYS = ("to", "target", "dst", "dest", "destination", "to_currency", "quote", "to_unit", "output", "new",
            "new_name")
_PRIVATE = re.compile(r"\b(?:privately|in private|direct(?:ly| message)|dm|via dm|in a dm|personal message|"
                               r"only to|just to|one-on-one|1:1)\b", re.I)
_WHOLE = re.compile(r"\b(?:whole|entire|full|all(?: the| of the)?|every|complete)\s+(?:test ?suite|suite|tests?|"
                    r"project|repo(?:sitory)?|specs?)\b", re.I)
_ONE_TEST = re.compile(r"(?:\btest_[\w-]+\.py\b|\b[\w-]+_test\.(?:py|go)\b|\b[\w-]+\.(?:spec|test)\.[jt]sx?\b|::|"
                       r"\s-k\s|--run\s|-run\s|--grep\s|\bTest[A-Z]\w+\b)")
_TEST_CMD = re.compile(r"\b(?:pytest|py\.test|unittest|go test|cargo test|npm (?:run )?test|jest|vitest|mocha|rspec|"
                       r"phpunit|mvn test|gradle test|tox|nox|make test)\b")
_RENAME = re.compile(r"\b(?:rename|move|copy|mv|cp)\s+(\S+\.\w+)\s+(?:to|as|into)\s+(\S+\.\w+)", re.I)
_COUNT_KEYS = {"people", "guests", "party_size", "partysize", "seats", "tickets", "quantity", "qty", "count",
               "adults", "persons", "covers", "rooms", "nights", "copies", "units"}


def _distance(a: str, b: str) -> int:
    """Optimal-string-alignment edit distance (insertions, deletions, substitutions, adjacent swaps)."""
    prev2, prev = None, list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        cur = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cost = a[i - 1] != b[j - 1]
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
            if prev2 is not None and i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        prev2, prev = prev, cur
    return prev[-1]


def _parts(text: str) -> set[str]:
    """Lower-case word parts of the names in a text (split at / . - _), 4 letters or more."""
    return {p for tok in _TOKEN.findall(text.lower()) for p in re.split(r"[/._~-]+", tok)
            if len(p) >= 4 and p.isalpha()}


def misspelt_target(request: str, response: str) -> str | None:
    """A name in the tool call that is a near miss (1-2 edits, same first letter) of a name the
    request gives, while the request's spelling is absent from the call (``./biuld`` for
    ``./build``): the call acted on a typo."""
    calls = call_text(response)
    if not calls or not (request or "").strip():
        return None
    asked, called = _parts(request), _parts(" ".join(_call_args(calls)))
    for c in sorted(called - asked):
        for a in sorted(asked - called):
            if c[0] == a[0] and abs(len(c) - len(a)) <= 1 and sorted(c) == sorted(a) and _distance(c, a) <= 2:
                return f"the call names {c!r} where the request says {a!r}"
    return None


def _unit(word: str) -> str:
    w = word.lower()
    return _CURRENCY.get(w, w)


def reversed_direction(request: str, response: str) -> str | None:
    """The request says "A to B" (a conversion, a rename, a copy) and the call goes from B to A:
    by ``from``/``to``-style arguments, or by the order of A and B in a ``mv``/``cp`` command."""
    calls = call_text(response)
    if not calls:
        return None
    items = _call_items(calls)
    src = {_unit(v) for k, v in items if k in _FROM_KEYS}
    dst = {_unit(v) for k, v in items if k in _TO_KEYS}
    pairs = [(m.group(1), m.group(2)) for m in _DIRECTION.finditer(request or "")]
    pairs += [(m.group(2), m.group(1)) for m in _HOW_MANY.finditer(request or "")]  # "how many B is N A": A to B
    for a, b in pairs:
        a, b = _unit(a), _unit(b)
        if a == b:
            continue
        if src and dst and a in dst and b in src and a not in src and b not in dst:
            return f"the request goes {a} to {b}, the call {b} to {a}"
    moves = _RENAME.findall(request or "") + [(a, b) for a, b in _FROM_TO.findall(request or "")
                                              if all("/" in x or _FILE.fullmatch(x.strip(".,")) for x in (a, b))]
    for fa, fb in moves:
        for _, v in items:
            mm = _COPY_CMD.search(v)
            if mm and not _TARGET_FIRST.search(v) and _same_path(mm.group(1), fb) and _same_path(mm.group(2), fa):
                return f"the request moves {fa} to {fb}, the call the other way"
    return None


_FROM_TO = re.compile(r"\bfrom\s+(\S+)\s+(?:\S+\s+){0,3}?(?:to|into)\s+(\S+)", re.I)  # "download X from A into B"
_TARGET_FIRST = re.compile(r"\s(?:-t|--target-directory)\b")  # cp -t DIR FILE: the destination first
_COPY_CMD = re.compile(r"\b(?:mv|cp|scp|rsync|s3 cp|gsutil cp)\s+(?:-\S+\s+)*(\S+)\s+(\S+)")


def _same_path(p: str, q: str) -> bool:
    """``p`` names ``q`` or a file inside it (``./reports/q3.csv`` and ``reports``), quotes,
    ``./`` and a closing full stop aside."""
    p, q = (x.strip("'\".,").removeprefix("./").rstrip("/") for x in (p, q))
    return bool(p and q) and (p.endswith(q) or p.startswith(q + "/"))


_LANGUAGE = {  # language names (English and native, a few other spellings) -> ISO 639-1
    "en": ("english", "anglais", "englisch", "inglés", "ingles", "inglese", "inglês", "engels", "angielski"),
    "es": ("spanish", "español", "espanol", "espagnol", "spanisch", "spagnolo", "espanhol", "spaans", "hiszpański",
           "castilian"),
    "fr": ("french", "français", "francais", "französisch", "francés", "frances", "francese", "francês", "frans",
           "francuski"),
    "de": ("german", "deutsch", "allemand", "alemán", "aleman", "tedesco", "alemão", "duits", "niemiecki"),
    "it": ("italian", "italiano", "italien", "italienisch", "italiaans", "włoski"),
    "pt": ("portuguese", "português", "portugues", "portugais", "portugiesisch", "portoghese", "portugués",
           "portugees", "portugalski"),
    "nl": ("dutch", "nederlands", "néerlandais", "niederländisch", "holandés", "olandese", "holenderski"),
    "pl": ("polish", "polski", "polonais", "polnisch", "polaco", "polacco"),
    "ru": ("russian", "русский", "russe", "russisch", "ruso", "russo", "rosyjski"),
    "ja": ("japanese", "日本語", "japonais", "japanisch", "japonés", "giapponese", "japonês", "japans"),
    "zh": ("chinese", "mandarin", "中文", "汉语", "chinois", "chinesisch", "chino", "cinese", "chinês"),
    "ko": ("korean", "한국어", "coréen", "koreanisch", "coreano"),
    "ar": ("arabic", "arabe", "arabisch", "árabe", "arabo"),
    "tr": ("turkish", "türkçe", "turc", "türkisch", "turco"),
    "sv": ("swedish", "svenska", "suédois", "schwedisch", "sueco", "svedese"),
    "hi": ("hindi",), "uk": ("ukrainian", "українська"), "el": ("greek", "ελληνικά"), "cs": ("czech", "čeština"),
}
_LANGUAGE_OF = {name: code for code, names in _LANGUAGE.items() for name in names}
_CURRENCY_CODES = {"eur", "usd", "gbp", "jpy", "chf", "inr", "cny", "sek", "pln", "brl", "mxn", "cad", "aud", "nzd",
                   "nok", "dkk", "krw", "hkd", "sgd", "try", "zar", "czk", "huf"}
_UNIT_CODES = set(_CURRENCY.values()) - _CURRENCY_CODES
# a destination: "to X", "into X", and "in X" only closing the request ("what is 30 GBP in yen?"),
# not inside it ("I wrote it in German", "paid in euros")
_TARGET_OF = re.compile(r"\b(?:to|into|nach|naar|auf|na)\s+([^\W\d_]+|[€$£¥])(?:\s+([^\W\d_]+))?", re.I)
_IN_AT_END = re.compile(r"\bin\s+([^\W\d_]+|[€$£¥])(?:\s+([^\W\d_]+))?\s*[?.!]*\s*$", re.I)  # "... in km?"
_AMBIGUOUS_UNITS = {"real", "in", "m", "c", "f", "k", "ft", "mi"}  # also ordinary words


def _kind_value(word: str) -> tuple[str, str] | None:
    """``("language", "es")``, ``("currency", "jpy")`` or ``("unit", "km")`` of one word, or None."""
    w = word.lower().strip(".,:;!?'\"")
    if w in _AMBIGUOUS_UNITS:
        return None
    if w in _LANGUAGE_OF:
        return "language", _LANGUAGE_OF[w]
    unit = _CURRENCY.get(w, w)
    if unit in _CURRENCY_CODES:
        return "currency", unit
    if w in _CURRENCY:
        return "unit", unit
    return None


def _call_value(kind: str, value: str) -> str | None:
    """The value of a ``to``/``target`` argument as the same kind (``"es-ES"`` -> ``"es"``)."""
    v = value.strip().lower()
    if kind == "language":
        code = re.split(r"[-_]", v)[0]
        return code if code in _LANGUAGE else _LANGUAGE_OF.get(v)
    got = _kind_value(v)
    if got is None and kind == "unit" and v in _UNIT_CODES:  # a unit's code ("m", "lb") in an argument
        return v
    return got[1] if got and got[0] == kind else None


def wrong_conversion_target(request: str, response: str) -> str | None:
    """The request converts or translates *to* a named language, currency or unit ("into
    Spanish", "to Japanese yen": its last such destination) and the call's ``to``/``target``
    argument is another one of the same kind (``"target": "fr"``) that the request names nowhere
    ("I wrote it in German, translate it into English" with target ``de`` is not caught: German is
    named, so the call may have read the request another way)."""
    calls = call_text(response)
    if not calls:
        return None
    dst = [v for k, v in _call_items(calls) if k in _TO_KEYS or k in ("language", "lang", "target_lang",
                                                                        "target_language", "to_lang", "currency")]
    if not dst:
        return None
    destinations = []
    for m in [*_TARGET_OF.finditer(request or ""), *_IN_AT_END.finditer(request or "")]:
        # "to Japanese yen": the second word names the currency; "into Spanish, please": the first
        wanted = (m.group(2) and _kind_value(m.group(2))) or _kind_value(m.group(1))
        if wanted:
            destinations.append(wanted)
    if not destinations:
        return None
    kind, want = destinations[-1]
    named = {v for w in _WORDS.findall(request or "") for v in [_kind_value(w)] if v and v[0] == kind}
    named |= {("currency", c) for c in re.findall(r"\b[A-Z]{3}\b", request or "") if c.lower() in _CURRENCY_CODES}
    named = {v for _, v in named} | {want}
    got = {g for g in (_call_value(kind, v) for v in dst) if g}
    if got and not got & named:
        return f"the request converts to {want} ({kind}), the call to {', '.join(sorted(got))}"
    return None


_DAY_MONTH = re.compile(r"\b(\d{1,2})(?:st|nd|rd|th)?(?:\s+of)?\s+(" + "|".join(_MONTHS) + r"|"
                        + "|".join(m[:3] for m in _MONTHS) + r")\b", re.I)
_MONTH_DAY = re.compile(r"\b(" + "|".join(_MONTHS) + r"|" + "|".join(m[:3] for m in _MONTHS)
                        + r")\.?\s+(\d{1,2})(?:st|nd|rd|th)?\b(?!:)", re.I)
_ISO_DAY = re.compile(r"\b\d{4}-(\d{2})-(\d{2})")
_ISO_FULL = re.compile(r"\b(\d{4})-(\d{2})-(\d{2})")


def _month_index(name: str) -> int:
    return [m[:3] for m in _MONTHS].index(name.lower()[:3]) + 1


_DERIVED = re.compile(r"\b(?:before|after|prior|following|next day|eve)\b", re.I)  # "the day before Tuesday 9 Feb"
_ZONED = re.compile(r"\d{2}:\d{2}(?::\d{2})?(?:\.\d+)?(?:Z|[+-]\d{2}:?\d{2})")  # a time moved to UTC or an offset


def other_day(request: str, response: str) -> str | None:
    """The request names one calendar day ("Tuesday 10 June", "June 10th", "2025-06-10") and the
    call passes one date (ISO ``YYYY-MM-DD``) more than a day away from it, or a day away and on
    another weekday than the one the request names (not for a time with a zone, which UTC can
    move a day, nor for a day the request derives: "the day before"). The judge abstains on it
    rather than scoring -1: a date can be derived from the request ("due in 7 days"), a range
    query passes two, a time converted to UTC moves a day."""
    calls = call_text(response)
    if not calls:
        return None
    wanted = {(_month_index(m), int(d)) for d, m in _DAY_MONTH.findall(request or "")}
    wanted |= {(_month_index(m), int(d)) for m, d in _MONTH_DAY.findall(request or "")}
    wanted |= {(int(mo), int(d)) for mo, d in _ISO_DAY.findall(request or "")}
    wanted = {(mo, d) for mo, d in wanted if 1 <= mo <= 12 and 1 <= d <= 31}
    if len(wanted) != 1:
        return None
    got = {m for _, v in _call_items(calls) for m in _ISO_FULL.findall(v)}
    if len(got) != 1:
        return None
    (year, mo, d), = [tuple(int(x) for x in g) for g in got]
    (wm, wd), = wanted
    try:
        called = datetime.date(year, mo, d)
    except ValueError:
        return None
    gaps = []
    for y in (year - 1, year, year + 1):  # "Jan 2" asked in late December may land in the next year
        try:
            gaps.append(abs((called - datetime.date(y, wm, wd)).days))
        except ValueError:  # 29 February of a common year
            pass
    gap = min(gaps, default=0)
    days = {w.lower() for w in _WEEKDAY.findall(request or "")}  # "Tuesday 9 February": the call's day must be one
    other_weekday = len(days) == 1 and called.strftime("%A").lower() not in days and not _DERIVED.search(
        request or "") and not any(_ZONED.search(v) for _, v in _call_items(calls))
    if gap > 1 or (gap == 1 and other_weekday):
        return f"date: the request names {wm:02d}-{wd:02d}, the call {year}-{mo:02d}-{d:02d}"
    return None


def _asked_and_called(request: str, response: str, asked: re.Pattern, called) -> tuple[str, str] | None:
    """The first argument ``(name, value)`` of the tool calls for which ``called(name, value)``
    holds, when ``asked`` occurs in the request; else None."""
    calls = call_text(response)
    if not calls or not asked.search(request or ""):
        return None
    return next(((key, v) for key, v in _call_items(calls) if called(key, v)), None)


def public_instead_of_private(request: str, response: str) -> str | None:
    """The request asks for a private message and the call posts to a channel (``#name``)."""
    hit = _asked_and_called(request, response, _PRIVATE, lambda key, v: v.strip().startswith("#") and key in (
        "channel", "channel_id", "room", "to", "conversation"))
    return f"a private message was asked, the call posts to {hit[1].strip()[:40]}" if hit else None


def narrower_scope(request: str, response: str) -> str | None:
    """The request asks for the whole test suite and the call runs one test file or a filtered subset."""
    hit = _asked_and_called(request, response, _WHOLE, lambda _, v: bool(_TEST_CMD.search(v) and _ONE_TEST.search(v)))
    return "the whole suite was asked, the call runs a subset" if hit else None


def wrong_count(request: str, response: str) -> str | None:
    """A count argument (``people``, ``guests``, ``quantity`` ...) whose value the request never
    states while the request states numbers (a table for 2 when 4 were asked)."""
    calls = call_text(response)
    if not calls:
        return None
    said = set(_numbers(request or ""))
    words = {"one": "1", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6", "seven": "7", "eight": "8",
             "nine": "9", "ten": "10", "twelve": "12"}
    said |= {n for w, n in words.items() if re.search(rf"\b{w}\b", request or "", re.I)}
    if not said:
        return None
    for key, v in _call_items(calls):
        if key in _COUNT_KEYS and re.fullmatch(r"\d+", v.strip()) and _number(v.strip()) not in said:
            return f"{key}={v.strip()}, the request says {', '.join(sorted(said))[:30]}"
    return None


def wrong_action(request: str, response: str) -> str | None:
    """Why a successful call did the wrong thing by the request's own words, or None: a misspelt
    target, a reversed direction, another target language, currency or unit, a public post for a
    private message, a narrower test run, a wrong count. The judge scores such a success -1 (a call that succeeded at the wrong thing)."""
    for check in (misspelt_target, reversed_direction, wrong_conversion_target, public_instead_of_private,
                  narrower_scope, wrong_count):
        why = check(request, response)
        if why:
            return why
    return None
