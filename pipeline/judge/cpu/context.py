"""Context checks of a tool result: did the call act on what the user asked for?

A tool can succeed at the wrong thing: the right command on the wrong file, a message to the
wrong person, the tests of another module. The result alone then reads as a success; only the
user's request next to the assistant's tool call shows the mismatch.

- :func:`target_mismatch` compares the things of a kind users name exactly (e-mail addresses,
  file names, branches such as ``feature/login``, environments, also read from the argument
  they are passed as): when both sides name things of one kind and none match, the call acted
  on another one (the judge scores the success -1).
- :func:`wrong_action` finds a success at the wrong thing shown by the request's own words
  (a misspelt target, a reversed direction, another target language or currency ...; -1 too).
- :func:`call_query` finds the query of a search call, whose results the judge checks for
  relevance to the query and the request.

All are heuristics, kept because each decides rows of the left-out labelled sets
(docs/judge.md, "What each rule earns").
"""

from __future__ import annotations

import json
import re

_FILE = re.compile(r"(?<![\w@/.-])(?:[\w-]+/)*[\w-]+\.(?:[a-z][a-z0-9]{0,4})\b", re.I)
_EMAIL = re.compile(r"\b[\w.+-]+@[\w-]+(?:\.[\w-]+)+\b")
_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?![\w])")
_ENV = re.compile(r"\b(?:prod|production|staging|stage|dev|development|qa|sandbox|preview|live|main|master|develop|"
                  r"release|canary|beta|test|testing)\b", re.I)
_BRANCHLIKE = re.compile(r"(?<![\w./-])(?:feature|feat|fix|bugfix|hotfix|release|chore|dev|topic|wip)/[\w./-]+", re.I)
_WORDS = re.compile(r"[^\W_]+")
_QUERY_KEYS = ("q", "query", "search", "search_query", "term", "terms", "keywords")
_SEARCH_TOOL = re.compile(r"search|find|lookup|look_up|browse|google|bing|retriev|news|wiki", re.I)


def call_text(response: str) -> str:
    """The rendered tool calls (``name(arguments)`` lines) of an assistant output, or ""."""
    _, sep, calls = (response or "").partition("[tool calls]")
    return calls.strip() if sep else ""


def _calls(calls: str):
    """``(tool name, arguments)`` of each rendered call: the parsed JSON, or the raw argument text."""
    for line in calls.splitlines():
        name, sep, rest = line.partition("(")
        if sep:
            raw = rest[:-1] if rest.endswith(")") else rest
            try:
                yield name, json.loads(raw)
            except ValueError:
                yield name, raw


def _call_items(calls: str) -> list[tuple[str, str]]:
    """``(argument name, value)`` of the tool calls' JSON arguments, nested values flattened
    (name "" for the whole argument text when it is not JSON)."""
    out = []
    for _, args in _calls(calls):
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
    """The things of each kind of :data:`KINDS` a text names, in lower case."""
    without_emails = _EMAIL.sub(" ", text)
    found = {"email": _EMAIL.findall(text),
             "file": [f.rsplit("/", 1)[-1] for f in _FILE.findall(without_emails) if not re.fullmatch(r"[\d.]+", f)],
             "branch": [b.rstrip(".,;:") for b in _BRANCHLIKE.findall(without_emails)],  # not a full stop
             "env": _ENV.findall(text)}
    return {kind: {v.lower().strip() for v in vals} for kind, vals in found.items() if vals}


KINDS = ("email", "file", "branch", "env")


def target_mismatch(request: str, response: str) -> str | None:
    """Why the tool call seems to act on another thing than the request names, or None.

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
    asked, called = _things(request), _things(" \n".join(_call_args(calls)))
    called_text = " ".join(_call_args(calls)).lower()
    for kind in KINDS:
        want, got = asked.get(kind), called.get(kind)
        if not want or not got:
            continue
        if kind == "env":  # an environment matches when it appears anywhere in the call
            if any(re.search(r"(?<![^\W_])" + re.escape(w), called_text) for w in want):
                continue
        elif want & got or any(w in called_text for w in want):
            continue
        return f"{kind}: request names {', '.join(sorted(want))[:60]}, the call {', '.join(sorted(got))[:60]}"
    return None


def call_query(response: str) -> str | None:
    """The query string of a search call: an argument ``q``, ``search`` or ``keywords``, or
    ``query``/``term`` of a tool whose name says search (``web_search``, ``kb_lookup`` ...)."""
    for name, args in _calls(call_text(response)):
        if isinstance(args, dict):
            for key in _QUERY_KEYS:
                v = args.get(key)
                if not isinstance(v, str) or not _WORDS.findall(v):
                    continue
                if _SEARCH_TOOL.search(name) or key in ("q", "search", "search_query", "keywords"):
                    return v
    return None


# -- a success at the wrong thing, shown by the request itself (the judge scores it -1) ----------------------
_TOKEN = re.compile(r"[\w./~-]*[A-Za-z][\w./~-]*")
_CURRENCY = {"euro": "eur", "euros": "eur", "dollar": "usd", "dollars": "usd", "pound": "gbp", "pounds": "gbp",
             "sterling": "gbp", "yen": "jpy", "franc": "chf", "francs": "chf", "rupee": "inr", "rupees": "inr",
             "yuan": "cny", "renminbi": "cny", "krona": "sek", "kronor": "sek", "zloty": "pln", "reais": "brl",
             "peso": "mxn", "pesos": "mxn"}  # currency names -> ISO 4217 codes
_DIRECTION = re.compile(r"(\w+)\s+(?:to|into)\s+(\w+)", re.I)
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


def _currency(word: str) -> str:
    """A currency name as its code (``"euros"`` -> ``"eur"``); any other word in lower case."""
    return _CURRENCY.get(word.lower(), word.lower())


def reversed_direction(request: str, response: str) -> str | None:
    """The request says "A to B" (a currency conversion, a rename) and the call goes from B to A:
    by ``from``/``to``-style arguments, or by the order of A and B in a ``mv``/``cp`` command."""
    items = _call_items(call_text(response))
    src = {_currency(v) for k, v in items if k in _FROM_KEYS}
    dst = {_currency(v) for k, v in items if k in _TO_KEYS}
    for a, b in _DIRECTION.findall(request or ""):
        a, b = _currency(a), _currency(b)
        if a == b:
            continue
        if src and dst and a in dst and b in src and a not in src and b not in dst:
            return f"the request goes {a} to {b}, the call {b} to {a}"
    for fa, fb in _RENAME.findall(request or ""):
        for _, v in items:
            mm = re.search(r"\b(?:mv|cp)\s+(?:-\w+\s+)*(\S+)\s+(\S+)", v)
            if mm and mm.group(1).endswith(fb.strip(".,")) and mm.group(2).endswith(fa.strip(".,")):
                return f"the request renames {fa} to {fb}, the call the other way"
    return None


_LANGUAGE = {"en": "english", "es": "spanish", "fr": "french", "de": "german", "it": "italian", "pt": "portuguese",
             "nl": "dutch", "pl": "polish", "ru": "russian", "ja": "japanese", "zh": "chinese", "ko": "korean",
             "ar": "arabic", "tr": "turkish", "sv": "swedish", "hi": "hindi", "uk": "ukrainian", "el": "greek",
             "cs": "czech"}  # ISO 639-1 codes -> English names
_LANGUAGE_OF = {name: code for code, name in _LANGUAGE.items()}
_CURRENCY_CODES = {"eur", "usd", "gbp", "jpy", "chf", "inr", "cny", "sek", "pln", "brl", "mxn", "cad", "aud", "nzd",
                   "nok", "dkk", "krw", "hkd", "sgd", "try", "zar", "czk", "huf"}
_LANGUAGE_KEYS = ("language", "lang", "target_lang", "target_language", "to_lang", "currency")
_TARGET_OF = re.compile(r"\b(?:to|into)\s+([^\W\d_]+)(?:\s+([^\W\d_]+))?", re.I)  # a destination: "to X", "into X"


def _kind_value(word: str) -> tuple[str, str] | None:
    """``("language", "es")`` or ``("currency", "jpy")`` of one word, or None."""
    w = word.lower().strip(".,:;!?'\"")
    if w in _LANGUAGE_OF:
        return "language", _LANGUAGE_OF[w]
    return ("currency", _currency(w)) if _currency(w) in _CURRENCY_CODES else None


def _call_value(kind: str, value: str) -> str | None:
    """The value of a ``to``/``target`` argument as the same kind (``"es-ES"`` -> ``"es"``)."""
    v = value.strip().lower()
    if kind == "language":
        code = re.split(r"[-_]", v)[0]
        return code if code in _LANGUAGE else _LANGUAGE_OF.get(v)
    got = _kind_value(v)
    return got[1] if got and got[0] == kind else None


def wrong_conversion_target(request: str, response: str) -> str | None:
    """The request converts or translates *to* a named language or currency ("into Spanish",
    "to Japanese yen": its last such destination) and the call's ``to``/``target``
    argument is another one of the same kind (``"target": "fr"``) that the request names nowhere
    ("I wrote it in German, translate it into English" with target ``de`` is not caught: German is
    named, so the call may have read the request another way)."""
    dst = [v for k, v in _call_items(call_text(response)) if k in _TO_KEYS + _LANGUAGE_KEYS]
    # "to Japanese yen": the second word names the currency; "into Spanish, please": the first
    destinations = [d for a, b in _TARGET_OF.findall(request or "") if (d := (b and _kind_value(b)) or _kind_value(a))]
    if not dst or not destinations:
        return None
    kind, want = destinations[-1]
    named = {v[1] for w in _WORDS.findall(request or "") for v in [_kind_value(w)] if v and v[0] == kind} | {want}
    got = {g for g in (_call_value(kind, v) for v in dst) if g}
    if got and not got & named:
        return f"the request converts to {want} ({kind}), the call to {', '.join(sorted(got))}"
    return None


def public_instead_of_private(request: str, response: str) -> str | None:
    """The request asks for a private message and the call posts to a channel (``#name``)."""
    if not _PRIVATE.search(request or ""):
        return None
    for key, v in _call_items(call_text(response)):
        if key in ("channel", "channel_id", "room", "to", "conversation") and v.strip().startswith("#"):
            return f"a private message was asked, the call posts to {v.strip()[:40]}"
    return None


def narrower_scope(request: str, response: str) -> str | None:
    """The request asks for the whole test suite and the call runs one test file or a filtered subset."""
    if not _WHOLE.search(request or ""):
        return None
    for v in _call_args(call_text(response)):
        if _TEST_CMD.search(v) and _ONE_TEST.search(v):
            return "the whole suite was asked, the call runs a subset"
    return None


def wrong_count(request: str, response: str) -> str | None:
    """A count argument (``people``, ``guests``, ``quantity`` ...) whose value the request never
    states while the request states numbers (a table for 2 when 4 were asked)."""
    said = {n.lstrip("0") or "0" for n in _NUMBER.findall(request or "")}
    if not said:
        return None
    for key, v in _call_items(call_text(response)):
        if key in _COUNT_KEYS and re.fullmatch(r"\d+", v.strip()) and (v.strip().lstrip("0") or "0") not in said:
            return f"{key}={v.strip()}, the request says {', '.join(sorted(said))[:30]}"
    return None


def wrong_action(request: str, response: str) -> str | None:
    """Why a successful call did the wrong thing by the request's own words, or None: a misspelt
    target, a reversed direction, another target language or currency, a public post for a
    private message, a narrower test run, a wrong count. The judge scores such a success -1."""
    for check in (misspelt_target, reversed_direction, wrong_conversion_target, public_instead_of_private,
                  narrower_scope, wrong_count):
        why = check(request, response)
        if why:
            return why
    return None
