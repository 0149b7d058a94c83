"""A structured reading of tool results, before any model sees them.

Tool output has conventions that a sentence-embedding model reads poorly and a parser reads
well: exit statuses, HTTP status codes, test-runner summaries, tracebacks and error lines, JSON
fields such as ``"error"`` or ``"ok": false``, job-queue states, empty results. :func:`read_tool_result`
looks for them and returns a :class:`ToolReading`:

- ``label`` 1 / -1 when the structure decides (a failing test count, a non-zero exit status, an
  HTTP 5xx, a traceback; all tests passed, exit status 0, HTTP 2xx, "successfully ...");
- ``label`` 0 when the structure says the outcome is not known yet or nothing came back
  (queued/pending/running jobs, an empty output, "no results"): nothing to reward or punish;
- ``label`` None when no convention was found (plain data, prose): the model decides.

Outcomes that are not settled come first and give 0: dry runs, partial or truncated output,
flaky tests that passed on a retry, and failures of the environment rather than of the call (a
rate limit, an overloaded or unavailable service: HTTP 429/502/503/504). Then, most specific
first: test summary counts; explicit exit status or HTTP
status; error signatures (a traceback, ``XxxError:`` at a line start, ``fatal:``, "command not
found", "permission denied" ...; weaker words such as "failed", "invalid", "not found" only in a
short, status-like output, not in file contents or data); a listing of results; "no results";
pending states; success signatures.
Counts that say zero (``0 failed``, ``no errors``) are not errors. A search-result listing (several
URLs or numbered hits) is data even when its snippets mention errors. A non-zero exit status of
``grep``/``diff``/``cmp``/``test`` that prints no error means "no match"/"differs", not a failure:
label 0. An empty output of a command that is silent on success (``mkdir``, ``cp``, ``mv`` ...) is +1.

The reading is pure (no model, no I/O); its rules are our own, written from the output formats
of the tools named (pytest, unittest, Jest, Go, Cargo, Maven/JUnit, Mocha, POSIX shells, HTTP).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolReading:
    """The outcome read from a tool result: ``label`` 1 / 0 / -1, or None (undecided), and why."""

    label: int | None
    reason: str


_I = re.I | re.M

# -- counts that say "nothing went wrong" are removed before error words are looked for --------
_ZERO_COUNTS = re.compile(
    r"\b(?:0|zero|no)\s+(?:errors?|failures?|failed|failing|problems?|issues?|vulnerabilit(?:y|ies)|warnings?)\b"
    r"|\b(?:errors?|failures?|failed)\s*[:=]\s*0\b|\bwithout (?:any )?errors?\b|\berror[s]?\s*:\s*(?:none|null|\[\])"
    # the same in other languages ("0 échec", "Fehler: 0", "失败 0 个")
    r"|\b0\s+(?:échecs?|erreurs?|fehler|fehlgeschlagen|errores?|fallos?|fallidos?|errori|falliti|erros?|falhas?|"
    r"fouten|mislukt|błęd(?:y|ów)|ошиб(?:ок|ки|ка)|hata)\b"
    r"|\b(?:échecs?|erreurs?|fehler|fehlgeschlagen|errores?|fallos?|errori|erros?|falhas?|fouten|błęd(?:y|ów)|"
    r"ошиб(?:ок|ки|ка)|hata)\s*[:=]?\s*0\b"
    r"|(?:失败|错误|エラー|失敗|오류|실패)\s*[:：]?\s*0|0\s*(?:个|件|개)?\s*(?:失败|错误|エラー|失敗|오류|실패)",
    re.I)

# -- test runners ---------------------------------------------------------------------------
_FAILED_N = re.compile(r"\b(\d+)\s+(?:tests?\s+)?(?:failed|failing|failures?|errors?|errored|broken)\b"
                       r"|\b(?:failures|failed|errors)\s*[:=]\s*(\d+)", re.I)
_PASSED_N = re.compile(r"\b(\d+)\s+(?:tests?\s+)?(?:passed|passing|succeeded|successful|ok)\b", re.I)
_JUNIT = re.compile(r"Tests run:\s*(\d+),\s*Failures:\s*(\d+)(?:,\s*Errors:\s*(\d+))?", re.I)
_UNITTEST_FAILED = re.compile(r"^FAILED \((?:failures|errors)=\d+", re.M)
_UNITTEST_OK = re.compile(r"^Ran \d+ tests? in [\d.]+s\s*\n+\s*OK\b", re.M)
_CARGO = re.compile(r"test result:\s*(ok|FAILED)", re.I)
_GO_FAIL = re.compile(r"^(?:--- FAIL:|FAIL\s+\S+|FAIL$)", re.M)
_GO_OK = re.compile(r"^ok\s+\S+\s+[\d.]+s", re.M)
_NO_TESTS = re.compile(r"\bno tests? (?:ran|found|collected|to run)\b|\bcollected 0 items\b|\b0 tests?\b", re.I)

# -- exit and HTTP statuses -------------------------------------------------------------------
_EXIT = re.compile(
    r"(?:\bexit(?:ed)?(?:\s+with)?(?:\s+(?:code|status))?|\breturn(?:ed)?\s*code|\breturncode|\bexit_?code"
    r"|\bexit_status|\bexitstatus|\brc)\s*[:=]?\s*\(?(-?\d{1,3})\b", re.I)
_NONZERO_EXIT = re.compile(r"non-?zero exit (?:status|code)|exit status [1-9]", re.I)
_HTTP = re.compile(
    r"\bHTTP/\d(?:\.\d)?\s+(\d{3})\b|\b(?:HTTP|status(?:[ _-]?code)?|http_status|statusCode)\"?\s*[:=]?\s*\"?(\d{3})\b"
    r"|^\s*(\d{3})\s+(?:OK|Created|Accepted|No Content|Moved|Found|Not Modified|Bad Request|Unauthori[sz]ed|"
    r"Payment Required|Forbidden|Not Found|Method Not Allowed|Not Acceptable|Request Timeout|Conflict|Gone|"
    r"Payload Too Large|Unsupported Media Type|Unprocessable (?:Entity|Content)|Too Many Requests|"
    r"Internal Server Error|Not Implemented|Bad Gateway|Service Unavailable|Gateway Time-?out)\b",
    re.I | re.M)
# a search tool's output is a result listing: words in the hits ("failed", "cancelled") are content
_SEARCH_CALL = re.compile(r"^\s*[\w.-]*(?:search|lookup|look_up|browse|google|bing|retriev|wiki)[\w.-]*\(", re.I | re.M)
_SILENT_ON_ERROR_1 = re.compile(r"\b(?:grep|egrep|fgrep|rg|diff|cmp|test|\[)\b")
_SILENT_OK = re.compile(
    r"(?:^|[\s\"'(=;&|])(?:mkdir|cp|mv|rm|rmdir|touch|chmod|chown|ln|cd|export|git (?:add|checkout|switch|stash|tag)|"
    r"write_file|save_file|set_env|sleep|true|kill|pkill|rsync|scp|install|sed -i|crontab|"
    # checkers and compilers that print nothing when all is well
    r"(?:npx )?tsc|eslint|flake8|pyflakes|gofmt|go (?:vet|build)|javac|gcc|g\+\+|clang|shellcheck|"
    r"rustfmt|systemctl (?:start|stop|restart|reload|enable|disable))\b"
    r"|[^>2]>>?\s*[\w./~-]+\s*[\"'})\]]*\s*$", re.I | re.M)  # or output redirected to a file

# -- error and success signatures -------------------------------------------------------------
_ERROR = re.compile("|".join([  # decide at any length: these do not occur in ordinary data
    r"Traceback \(most recent call last\)",
    r"^\s*(?:[\w.$]+\.)?[A-Z]\w*(?:Error|Exception|Fault)\b\s*(?::|$)",
    r"^\s*(?:error|fatal|fatal error|panic|critical|err!?)\s*(?:\[[\w\d]+\])?\s*:",
    r"^[\w./-]+:\d+(?::\d+)?:\s*(?:fatal )?error\b",
    r"^\s*E\s*:\s+\S", r"^\s*\[(?:error|fatal|err)\]", r"^\s*npm ERR!", r"^\s*ERROR\b",
    r"\bcommand not found\b", r"\bis not recognized as (?:an internal|the name)", r"\bNo such file or directory\b",
    r"\bPermission denied\b", r"\bOperation not permitted\b", r"\bSegmentation fault\b", r"\bcore dumped\b",
    r"\bOOMKilled\b", r"\b(?:CrashLoopBackOff|ImagePullBackOff|ErrImagePull|CreateContainerConfigError)\b", r"\bConnection (?:refused|reset by peer)\b", r"\bCould not resolve host\b",
    r"\bName or service not known\b", r"\btemporary failure in name resolution\b", r"\bBUILD FAILED\b",
    r"\bcompilation (?:failed|terminated)\b", r"\bundefined reference to\b", r"^CONFLICT \(",
    r"! \[rejected\]", r"\bFAILED\b", r"\bFAILURES!", r"\bmax retries exceeded\b", r"\bNewConnectionError\b",
    r"^[\w./\\-]+:\d+:\d+: (?:[A-Z]{1,3}\d{2,4}\b|error\b)", r"^\s*\d+:\d+\s+error\s", r"^[\w.-]+: \*\*\* ",
    r"\bNo rule to make target\b",
    # the same OS errors as printed in other locales (permission denied, no such file, access denied)
    r"\bKeine Berechtigung\b", r"\bDatei oder Verzeichnis nicht gefunden\b", r"\bZugriff verweigert\b",
    r"\bPermission non accordée\b", r"\bAucun fichier ou dossier de ce (?:type|nom)\b", r"\bAccès refusé\b",
    r"\bPermiso denegado\b", r"\bNo existe el (?:archivo|fichero)", r"\bAcceso denegado\b",
    r"\bPermesso negato\b", r"\bFile o directory non esistente\b", r"\bPermissão negada\b",
    r"\b(?:Arquivo|Ficheiro) ou (?:diretório|pasta) (?:inexistente|não encontrad[oa])\b", r"\bToegang geweigerd\b",
    r"\bBestand of map bestaat niet\b", r"\bBrak dostępu\b", r"\bNie ma takiego pliku\b",
    r"Отказано в доступе", r"Нет такого файла", r"許可がありません", r"そのようなファイルやディレクトリはありません",
    r"权限不够", r"没有那个文件或目录", r"拒绝访问", r"허가 거부", r"그런 파일이나 디렉터리가 없습니다",
    r"^\s*(?:Fehler|erreur|errore|erro|fout|błąd|ошибка|エラー|错误|오류)\s*:",
]), _I)
_WEAK_ERROR = re.compile("|".join([  # decide only in a short, status-like output
    r"\bAccess (?:is )?denied\b", r"\bKilled\b", r"\bout of memory\b", r"\btimed out\b", r"\btime-?out\b",
    r"\bdeadline exceeded\b", r"\bunable to\b", r"\bcannot\b", r"\bcan't\b", r"\bcould not\b", r"\bcouldn't\b",
    r"\bfailed\b", r"\bfailure\b", r"\bfails\b", r"\berror\b", r"\bunresolved (?:import|reference|external)\b",
    r"\bsyntax error\b", r"\bmerge conflict\b", r"\brejected\b", r"\bnot allowed\b", r"\bdoes not exist\b",
    r"\bdoesn't exist\b", r"\bnot found\b", r"\binvalid\b", r"\bunauthori[sz]ed\b", r"\bforbidden\b",
    r"\brate[ -]limit(?:ed)?\b", r"\bquota exceeded\b", r"\blimit exceeded\b", r"\baborted\b", r"\baborting\b",
    r"\bcrash(?:ed)?\b", r"\bunexpected (?:token|end|EOF|indent)", r"\bis not defined\b", r"\bdenied\b",
    r"\bunavailable\b", r"\bunreachable\b", r"\brefused\b", r"\bexpired\b", r"\bdeclined\b",
    r"\bcancel(?:l)?ed\b", r"\bnot permitted\b", r"\bmissing\b", r"\bno space left\b", r"\bdisk full\b",
    r"\balready (?:booked|taken|exists?|in use|reserved|registered|used|running|claimed|closed)\b",
    r"\bnot available\b", r"\bconflicts? with\b", r"\bfully booked\b", r"\bsold out\b", r"\bout of stock\b",
    r"\bunknown\b", r"\bunsupported\b", r"\bnot supported\b", r"\bdisallowed\b", r"\bblocked\b",
    r"\bwarning: .*(?:failed|error)", r"\bno availability\b", r"^sorry\b", r"\bunfortunately\b",
    # the same words in other languages
    r"\bnicht möglich\b", r"\bfehlgeschlagen\b", r"\bkonnte nicht\b", r"\bimpossible de\b", r"\béchec\b",
    r"\bn'a pas pu\b", r"\bno se (?:puede|pudo)\b", r"\bha fallado\b", r"\bimpossibile\b", r"\bnon riuscit",
    r"\bnão (?:foi possível|é possível)\b", r"\bfalhou\b", r"\bmislukt\b", r"\bkan niet\b", r"\bnie można\b",
    r"\bnie udało się\b", r"не удалось", r"невозможно", r"失敗しました", r"できません", r"失败", r"无法", r"실패",
    r"할 수 없습니다",
]), _I)
SHORT_CHARS = 400  # a tool result up to this long (and up to SHORT_LINES lines) reads as a status message
SHORT_LINES = 6
_WARNING = re.compile(r"^\s*(?:warning|warn)\b\s*:?|\bDeprecationWarning\b", _I)
_SUCCESS = re.compile("|".join([
    r"\bsuccess(?:ful(?:ly)?)?\b", r"\bsucceeded\b", r"\bcompleted?\b", r"\bdone\b", r"\bfinished\b",
    r"\bsaved\b", r"\bwritten\b", r"\bwrote\b", r"\bcreated\b", r"\bdeleted\b", r"\bremoved\b", r"\bupdated\b",
    r"\binstalled\b", r"\bcompiled\b", r"\bbuilt\b", r"\bdeployed\b", r"\bpublished\b", r"\buploaded\b",
    r"\bdownloaded\b", r"\bsent\b", r"\bdelivered\b", r"\bmerged\b", r"\bpushed\b", r"\bcommitted\b",
    r"\bapplied\b", r"\bscheduled\b", r"\bconfirmed\b", r"\bapproved\b", r"\bup[ -]to[ -]date\b",
    r"\bworking tree clean\b", r"\ball checks passed\b", r"^\s*(?:ok|OK)\b", r"[✓✔✅]", r"\bPASS(?:ED)?\b",
    r"\bno (?:issues|problems) found\b", r"^\[[\w/.-]+ [0-9a-f]{7,}\]",
    r"^\s*(?:inflating|extracting|creating|adding|copying|writing|compressing|deflating|installing|linking):",
    r"^\s*(?:active|running|enabled|healthy|ready|up|online|connected|listening|available)\s*$",
    r"\(running\)", r"\blistening on\b", r"\brunning on\b",
]), _I)
_PENDING = re.compile("|".join([
    r"\bqueued\b", r"\bpending\b", r"\bin progress\b", r"\bin_progress\b", r"\bstill running\b",
    r"^\s*running\b", r"\bstarted\b", r"\bstarting\b", r"\bwaiting\b", r"\bprocessing\b", r"\baccepted\b",
    r"\bnot (?:yet )?(?:finished|complete|ready)\b", r"^\s*\[\d+\]\s+\d+\s*$", r"\bpid\s*[:=]?\s*\d+",
    r"\bjob (?:id\s*)?[:#]?\s*\w+ (?:submitted|created)", r"\bsubmitted\b", r"\bpoll(?:ing)? again\b",
    r"\bcheck back\b", r"\bretry after\b", r"\brequested\b", r"\bwill be (?:sent|processed|ready|available|notified)\b",
    r"\byou'?ll (?:get|receive|be notified)\b", r"\b(?:when|once) (?:it is|it's|they are) (?:ready|done|finished)\b",
    r"\b\d{1,2}(?:\.\d+)?\s?% (?:complete|completed|done|finished)\b",
    r"^\s*[A-Z]?[a-z]+ing\b[^.\n]{0,40}\.\.\.", r"\bdeselected\b", r"\bskipped\b.*\bin [\d.]+s\b",
]), _I)
# a container or pod still being set up (kubectl / docker status columns): the outcome is not known yet
_STARTING_UP = re.compile(r"\b(?:ContainerCreating|PodInitializing|Init:\d+/\d+)\b|\bhealth: starting\b"
                          r"|^\S+\s+\d+/\d+\s+Pending\s", re.M)
_NO_RESULTS = re.compile(
    r"\bno (?:results?|matches|matching|hits|records?|rows?|entries|items|documents?|files?)\b(?: (?:were )?found)?"
    r"|\b0 (?:results?|matches|hits|records?|rows?|items|documents?|files?)\b|\bnothing (?:found|matched)\b"
    r"|\bfound 0\b|\breturned 0\b|\bempty (?:result|response|list|set)\b|^\s*(?:\(?empty\)?|none|null|nil)\s*$"
    r"|\b(?:couldn'?t|could not|didn'?t|did not|unable to|can'?t|cannot) find (?:anything|any|a match|results?)\b"
    r"|\bnothing (?:was |has been )?found\b|\bno \w+ (?:results|matches|hits) (?:were )?found\b"
    r"|\bmatch(?:ed)? nothing\b"
    r"|\b0 \w+ match\b|\bdid not match any\b|\bno (?:matching|relevant) \w+",
    _I)
_DONE_NOW = re.compile(r"\b(?:done|finished|completed?|succeeded|ready)\b", re.I)
_DONE_LATER = re.compile(r"\b(?:when|once|until|after|as soon as|if)\b[^.\n]{0,30}?\b(?:done|finished|completed?|"
                         r"succeeded|ready)\b|\b\d{1,2}(?:\.\d+)?\s?% (?:complete|completed|done|finished)\b", re.I)
# failures of the environment, not of the action: rate limits, overload, maintenance (retry later)
_TRANSIENT_CODES = {429, 502, 503, 504}
_TRANSIENT = re.compile(
    r"\brate[ -]?limit(?:ed)?\b|\btoo many requests\b|\btemporar(?:y|ily) (?:unavailable|failure|error|down)\b"
    r"|\b(?:try|retry|please retry) (?:again )?(?:later|in \d+|after)\b|\bretry[- ]after\b|\bunder maintenance\b"
    r"|\bservice (?:is )?(?:temporarily )?unavailable\b|\bserver (?:is )?(?:overloaded|busy)\b|\bquota (?:exceeded|reached)\b"
    r"|\bbad gateway\b|\bgateway time-?out\b", re.I)
# the action did not (fully) happen or its outcome is not known: dry runs, partial or truncated
# output, flaky tests that passed only on a retry
_UNSETTLED = re.compile(
    r"\bdry[- ]run\b|\bwould (?:be )?(?:delete|remove|create|update|change|install|apply|send|write|move|add)\w*\b"
    r"|\bno changes (?:were )?(?:made|applied)\b|\b(?:output )?truncated\b|\bpartial(?:ly)?\b|\bincomplete\b"
    r"|\b\d+ of \d+ (?:\w+ )?(?:processed|done|completed|copied|uploaded|migrated|imported)\b|\bflaky\b"
    r"|\bpassed on (?:retry|rerun|re-run)\b|\brerun\w*\b.*\bpassed\b|\bstopped after\b|\binterrupted\b"
    r"|\b\.\.\. ?\(?\d+ more (?:lines|rows|results|items)\)?|\bstill running after\b|\boutput so far\b"
    r"|\b[1-9]\d* rerun\b", re.I)
# a test run that stopped before any test ran because a test module did not import: a failure
_COLLECTION_ERROR = re.compile(r"\bERROR collecting\b|\berrors? during collection\b|\bImportError while importing "
                               r"test module\b", re.I)
_EMPTY = {"", "[]", "{}", "()", "null", "none", "nil", '""', "''", "(no output)", "<no output>", "no output",
          "(empty)", "<empty>", "empty", "n/a", "-"}
_URL = re.compile(r"https?://\S+")
_NUMBERED = re.compile(r"^\s*(?:\d{1,2}[.)]|[-*•])\s+\S", re.M)

# -- JSON fields ------------------------------------------------------------------------------
_JSON_FAIL_STATUS = {"error", "errored", "failed", "failure", "fail", "denied", "rejected", "invalid", "timeout",
                     "timed_out", "not_found", "unauthorized", "forbidden", "aborted", "cancelled", "canceled",
                     "declined",
                     "refused", "blocked", "expired", "unavailable", "conflict", "crashed", "killed", "rolled_back"}
_JSON_OK_STATUS = {"ok", "success", "succeeded", "successful", "done", "completed", "complete", "created",
                   "sent", "delivered", "saved", "updated", "deleted", "finished", "passed", "active", "healthy",
                   "up", "green", "confirmed", "paid", "shipped", "merged", "deployed", "published"}
_JSON_PENDING_STATUS = {"pending", "queued", "running", "in_progress", "in-progress", "processing", "accepted",
                        "started", "waiting", "scheduled", "submitted", "created_pending"}
_LIST_KEYS = ("results", "items", "data", "hits", "rows", "records", "matches", "documents", "entries", "files",
              "values", "list", "events", "messages")


_STREAM_KEYS = ("stdout", "output", "out")


def _shell_json_reading(low: dict, code: int, key: str, call: str) -> ToolReading:
    """A command result in JSON (``{"exit_code", "stdout", "stderr"}``) read like the same
    result printed as text: an empty stdout is an empty output (+1 only for commands silent on
    success), exit 1 of a match/compare command with nothing printed is "no match"."""
    streams = [low[k] for k in _STREAM_KEYS if isinstance(low.get(k), str)]
    errs = low.get("stderr") if isinstance(low.get("stderr"), str) else ""
    empty = bool(streams) and not any(x.strip() for x in streams)
    if code == 0:
        if empty and not errs.strip() and not (call and _SILENT_OK.search(call)):
            return ToolReading(0, f"JSON {key}=0 with an empty output")
        return ToolReading(1, f"JSON {key}=0")
    if code == 1 and call and _SILENT_ON_ERROR_1.search(call) and empty and not errs.strip():
        return ToolReading(0, f"JSON {key}=1 of a match/compare command (no match)")
    return ToolReading(-1, f"JSON {key}={code}")


_DONE_FLAGS = ("confirmed", "completed", "done", "created", "sent", "saved", "deleted", "booked", "paid",
               "delivered", "approved", "published", "merged", "deployed", "updated", "scheduled")
_CODE_KEYS = ("code", "status", "status_code", "statuscode", "http_status", "http_code")


def _json_transient(low: dict) -> ToolReading | None:
    """An error object that reports a failure of the environment (HTTP 429/502/503/504, a rate
    limit, a gateway timeout), at the top level or inside its ``error`` field: not the call's fault."""
    error = low.get("error")
    scopes = [low] + ([{str(k).lower(): v for k, v in error.items()}] if isinstance(error, dict) else [])
    for scope in scopes:
        for key in _CODE_KEYS:
            v = scope.get(key)
            if isinstance(v, str) and v.strip().isdigit():
                v = int(v)
            if isinstance(v, int) and not isinstance(v, bool) and v in _TRANSIENT_CODES:
                return ToolReading(0, f"JSON {key}={v} (transient, not caused by the call)")
    if not any("error" in k and v not in (None, False, "", [], {}, 0) for k, v in low.items()):
        return None  # no error reported ("error": null is none)
    texts = [v for scope in scopes for v in scope.values() if isinstance(v, str)]
    if any(_TRANSIENT.search(t) for t in texts):
        return ToolReading(0, "JSON error of the environment (rate limit, overload)")
    return None


def _json_reading(obj, call: str = "") -> ToolReading | None:
    if isinstance(obj, list):
        return ToolReading(0, "empty JSON list") if not obj else None
    if not isinstance(obj, dict):
        return None
    low = {str(k).lower(): v for k, v in obj.items()}
    transient = _json_transient(low)
    if transient is not None:
        return transient
    for key, err in low.items():
        if ("error" in key or key in ("exception", "fault", "failure")) and "count" not in key \
                and err not in (None, False, "", [], {}, 0, "none", "null"):
            return ToolReading(-1, f"JSON {key} field")
    for key in ("ok", "success", "succeeded"):
        if isinstance(low.get(key), bool):
            return ToolReading(1 if low[key] else -1, f"JSON {key}={str(low[key]).lower()}")
    for key in ("exit_code", "exitcode", "returncode", "return_code", "exit_status", "rc"):
        if isinstance(low.get(key), int) and not isinstance(low.get(key), bool):
            return _shell_json_reading(low, low[key], key, call)
    for key in ("status_code", "statuscode", "http_status", "code", "status"):
        v = low.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and 100 <= v <= 599:
            return _http_reading(v)
    for key in ("conclusion", "outcome", "result", "status", "state"):  # a conclusion outranks a status
        v = low.get(key)
        if isinstance(v, str):
            s = v.strip().lower().replace(" ", "_")
            if s in _JSON_FAIL_STATUS:
                return ToolReading(-1, f"JSON {key}={v}")
            if s in _JSON_PENDING_STATUS:
                return ToolReading(0, f"JSON {key}={v}")
            if s in _JSON_OK_STATUS:
                return ToolReading(1, f"JSON {key}={v}")
    for key in _DONE_FLAGS:  # "confirmed": true on a booking; a false one says nothing by itself
        if low.get(key) is True:
            return ToolReading(1, f"JSON {key}=true")
    for key in _LIST_KEYS:
        if key in low and isinstance(low[key], list) and not low.get("next_page") and not low.get("has_more"):
            return ToolReading(0, f"JSON {key} empty") if not low[key] else ToolReading(1, f"JSON {key} returned")
    # status-like fields only: a title, name or description describes an object, not the outcome
    for key in ("message", "msg", "detail", "details", "reason", "error_description"):
        v = low.get(key)
        if isinstance(v, str) and len(v) <= SHORT_CHARS and (_ERROR.search(v) or _WEAK_ERROR.search(v)):
            return ToolReading(-1, f"JSON {key} reports an error")
    for key in ("total", "count", "total_count", "num_results", "totalresults"):
        v = low.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v == 0 and len(low) <= 3:
            return ToolReading(0, f"JSON {key}=0")
    if any(low.get(k) for k in ("next_page", "next_cursor", "has_more", "truncated")):
        return ToolReading(0, "JSON page of a longer result (more pages)")
    if any(k in low for k in ("id", "uuid", "number", "html_url", "url", "self", "href")) and not any(
            isinstance(v, str) and v.strip().lower().replace(" ", "_") in _JSON_FAIL_STATUS for v in low.values()):
        return ToolReading(1, "JSON object returned (an identified resource)")
    return None


def _http_reading(code: int) -> ToolReading:
    if code in (202,):
        return ToolReading(0, f"HTTP {code} (accepted, not done)")
    if code in _TRANSIENT_CODES:
        return ToolReading(0, f"HTTP {code} (transient, not caused by the call)")
    if 200 <= code < 300 or code == 304:
        return ToolReading(1, f"HTTP {code}")
    if 400 <= code < 600:
        return ToolReading(-1, f"HTTP {code}")
    return ToolReading(0, f"HTTP {code}")


def _test_reading(text: str) -> ToolReading | None:
    m = _JUNIT.search(text)
    if m:
        bad = int(m.group(2)) + int(m.group(3) or 0)
        return ToolReading(-1, f"JUnit: {bad} failures/errors") if bad else (
            ToolReading(1, "JUnit: all passed") if int(m.group(1)) else ToolReading(0, "JUnit: no tests ran"))
    m = _CARGO.search(text)
    if m:
        return ToolReading(1, "cargo: ok") if m.group(1).lower() == "ok" and not _FAILED_N.search(
            _ZERO_COUNTS.sub(" ", text)) else ToolReading(-1, "cargo: FAILED")
    if _UNITTEST_FAILED.search(text) or _GO_FAIL.search(text):
        return ToolReading(-1, "test run failed")
    cleaned = _ZERO_COUNTS.sub(" ", text)
    failed = sum(int(a or b) for a, b in _FAILED_N.findall(cleaned))
    passed = sum(int(n) for n in _PASSED_N.findall(cleaned))
    if failed:
        return ToolReading(-1, f"tests: {failed} failed")
    if _UNITTEST_OK.search(text) or _GO_OK.search(text):
        return ToolReading(1, "test run ok")
    if passed and re.search(r"\btests?\b|\bpassed\b|\bpassing\b|\bspecs?\b|\bsuites?\b|=====", text, re.I):
        return ToolReading(1, f"tests: {passed} passed")
    if _NO_TESTS.search(text) and re.search(r"\btests?\b|\bcollected\b", text, re.I):
        return ToolReading(0, "no tests ran")
    return None


_FOUND_N = re.compile(r"^\s*(?:found|returned|got|showing|retrieved|fetched)?\s*([1-9]\d*)\s+(?:results?|matches|"
                      r"files?|rows?|items|records|hits|documents?|entries|pages?|issues|messages|emails)\b"
                      r"|^\s*[1-9]\d*\s+[\w -]{1,30}?\s(?:found|returned|matched|available|listed)\b"
                      r"|^\s*(?:top|search) results\b|^\s*(?:results?|matches) (?:for|found)\b", re.I | re.M)


def _is_listing(text: str) -> bool:
    """Search hits / result listings: several URLs, several numbered or bulleted entries, or a
    "Found N matches" header (N > 0)."""
    return (len(_URL.findall(text)) >= 2 or len(_NUMBERED.findall(text)) >= 3
            or bool(_FOUND_N.search(text.split("\n", 1)[0])))


_READ_CALL = re.compile(r"^\s*(?:[\w-]+\.)?(?:read_file|read|open_file|view_file|get_file|cat_file|read_doc|fetch_doc|"
                        r"get_doc|read_document)\(|\b(?:cat|less|head|more|bat)\s+[\w./~-]+\.(?:md|rst|txt|adoc)\b",
                        re.I | re.M)
_HEADING = re.compile(r"^\s{0,3}#{1,6}\s+\S", re.M)
_QUOTED_SPAN = re.compile(r"'[^'\n]{1,80}'|\"[^\"\n]{1,80}\"|`[^`\n]{1,120}`|“[^”\n]{1,80}”|‘[^’\n]{1,80}’")


def _is_document(text: str, call: str) -> bool:
    """A prose document (a file read by a read tool, markdown with a heading): its quoted words
    describe errors rather than report one."""
    if text.count("\n") < 2 and len(text) < 200:  # a short answer is a status line, not a document
        return False
    return bool((call and _READ_CALL.search(call)) or (_HEADING.match(text) and text.count("\n") >= 2))


def read_tool_result(text: str, call: str = "") -> ToolReading:
    """Read one tool result (see the module docstring).

    Args:
        text: the tool message's content as text.
        call: the assistant's tool call(s) as text (``name(arguments)``), used for the few
            commands whose exit status or empty output means something else (grep, mkdir ...).
    Returns:
        A :class:`ToolReading`; ``label`` None means "no convention found".
    """
    s = (text or "").strip()
    if s.lower() in _EMPTY:
        if call and _SILENT_OK.search(call) and not _SILENT_ON_ERROR_1.search(call):
            return ToolReading(1, "empty output of a command silent on success")
        return ToolReading(0, "empty output")
    if s[:1] in "[{":
        try:
            obj = json.loads(s)
        except ValueError:
            obj = None
        if obj is not None:
            reading = _json_reading(obj, call)
            if reading is not None:
                return reading
            if not _ERROR.search(_ZERO_COUNTS.sub(" ", s)):
                return ToolReading(None, "JSON data")
    if _COLLECTION_ERROR.search(s) and not (call and _SEARCH_CALL.search(call)) and not _is_listing(s):
        return ToolReading(-1, "test collection error (no test could run)")
    if _UNSETTLED.search(s):
        return ToolReading(0, "not settled (dry run, partial, truncated or flaky)")
    reading = _test_reading(s)
    if reading is not None:
        return reading
    if _TRANSIENT.search(s):
        return ToolReading(0, "transient failure of the environment (rate limit, overload)")
    cleaned = _ZERO_COUNTS.sub(" ", s)
    document = _is_document(s, call)
    if document:  # error words a document quotes ("if the app logs 'connection refused'") are content
        cleaned = _QUOTED_SPAN.sub(" ", cleaned)
    searched = bool(call and _SEARCH_CALL.search(call))
    listing = _is_listing(s)
    short = len(s) <= SHORT_CHARS and s.count("\n") < SHORT_LINES and not searched and not document
    no_results = bool(_NO_RESULTS.search(cleaned))
    error = None if listing else (_ERROR.search(cleaned) or (
        _WEAK_ERROR.search(cleaned) if short and not no_results else None))
    listing = listing or (searched and not error)
    codes = [int(m) for m in _EXIT.findall(s)]
    if codes:
        code = codes[-1]
        if code != 0:
            if code == 1 and call and _SILENT_ON_ERROR_1.search(call) and not error:
                return ToolReading(0, "exit 1 of a match/compare command (no match)")
            return ToolReading(-1, f"exit status {code}")
        if not error:
            return ToolReading(1, "exit status 0")
    if _NONZERO_EXIT.search(s):
        return ToolReading(-1, "non-zero exit status")
    for groups in _HTTP.findall(s):
        code = int(next(g for g in groups if g))
        if 100 <= code <= 599:
            return _http_reading(code)
    if error:
        return ToolReading(-1, f"error signature: {error.group(0).strip()[:40]}")
    if listing:
        return ToolReading(1, "result listing")
    if no_results:
        return ToolReading(0, "no results")
    if _STARTING_UP.search(s):
        return ToolReading(0, "pending (a container still starting)")
    last = s.splitlines()[-1]
    ended_well = len(s.splitlines()) > 1 and bool(_SUCCESS.search(last)) and not _PENDING.search(last)
    if _PENDING.search(s) and not _DONE_NOW.search(_DONE_LATER.sub(" ", s)) and not ended_well:
        return ToolReading(0, "pending")
    if _SUCCESS.search(s):
        return ToolReading(1, "success signature")
    if _ZERO_COUNTS.search(s):
        return ToolReading(1, "reports zero errors")
    if _WARNING.search(s):
        return ToolReading(None, "warnings only")
    return ToolReading(None, "no convention")
