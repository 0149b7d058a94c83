"""A structured reading of tool results before any model sees them: an ordered table of named rules.

:func:`read_tool_result` tries the rules of :data:`RULES` in order (outcomes not settled, test
summaries, exit and HTTP statuses, error signatures, listings, "no results", pending, success
words); the first that decides gives a :class:`ToolReading`: 1 / -1 when the structure decides,
0 when the outcome is not known yet or not the call's doing (pending, empty, dry run, truncated,
rate limit, HTTP 429/502/503/504), None when no convention was found (the model decides).
Zero counts ("0 failed") are no errors; hits of a search, the items of a listing and words a
document quotes are content (an error line beside a listing's items is not); weak error words
("failed", "not found") decide only in a short status-like output, and not on a WARN line.
Pure (no model, no I/O); the rules are our own, written from the output
formats of pytest, unittest, Jest, Go, Cargo, Maven/JUnit, POSIX shells and HTTP.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolReading:
    """The outcome read from a tool result: ``label`` 1 / 0 / -1, or None (undecided), why, and
    the name of the rule of :data:`RULES` that decided ("" when none did)."""

    label: int | None
    reason: str
    rule: str = ""


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
    r"^[\s│|]*(?:error|fatal|fatal error|panic|critical|err!?)\s*(?:\[[\w\d]+\])?\s*:",  # (│: terraform's box)
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
    # the same OS errors as printed in other locales (permission denied, no such file, access denied,
    # command not found)
    r"\bcommande introuvable\b", r"\bBefehl nicht gefunden\b", r"\bcomando no encontrado\b",
    r"\bcomando non trovato\b", r"\bcomando não encontrado\b", r"\bopdracht niet gevonden\b",
    r"\bnie znaleziono polecenia\b", r"команда не найдена", r"コマンドが見つかりません", r"未找到命令", r"명령을 찾을 수 없습니다",
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
_WARN_LINE = re.compile(r"^\s*(?:npm\s+)?(?:WARN(?:ING)?\b|\[WARN(?:ING)?\]).*$", re.M)  # npm, Maven, pip warnings
SHORT_CHARS = 400  # a tool result up to this long (and up to SHORT_LINES lines) reads as a status message
SHORT_LINES = 6
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
    r"|\bservice (?:is )?(?:temporarily |currently )?unavailable\b|\bserver (?:is )?(?:overloaded|busy)\b|\bquota (?:exceeded|reached)\b"
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
_FOUND_N = re.compile(r"^\s*(?:found|returned|got|showing|retrieved|fetched)?\s*([1-9]\d*)\s+(?:results?|matches|"
                      r"files?|rows?|items|records|hits|documents?|entries|pages?|issues|messages|emails)\b"
                      r"|^\s*[1-9]\d*\s+[\w -]{1,30}?\s(?:found|returned|matched|available|listed)\b"
                      r"|^\s*(?:top|search) results\b|^\s*(?:results?|matches) (?:for|found)\b", re.I | re.M)

_READ_CALL = re.compile(r"^\s*(?:[\w-]+\.)?(?:read_file|read|open_file|view_file|get_file|cat_file|read_doc|fetch_doc|"
                        r"get_doc|read_document)\(|\b(?:cat|less|head|more|bat)\s+[\w./~-]+\.(?:md|rst|txt|adoc)\b",
                        re.I | re.M)
_HEADING = re.compile(r"^\s{0,3}#{1,6}\s+\S", re.M)
_QUOTED_SPAN = re.compile(r"'[^'\n]{1,80}'|\"[^\"\n]{1,80}\"|`[^`\n]{1,120}`|“[^”\n]{1,80}”|‘[^’\n]{1,80}’")
_TEST_FAILED = re.compile(_UNITTEST_FAILED.pattern + "|" + _GO_FAIL.pattern, re.M)
_TEST_OK = re.compile(_UNITTEST_OK.pattern + "|" + _GO_OK.pattern, re.M)

# -- JSON fields ------------------------------------------------------------------------------
_JSON_FAIL = {"error", "errored", "failed", "failure", "fail", "denied", "rejected", "invalid", "timeout", "timed_out",
              "not_found", "unauthorized", "forbidden", "aborted", "cancelled", "canceled", "declined", "refused",
              "blocked", "expired", "unavailable", "conflict", "crashed", "killed", "rolled_back"}
_JSON_OK = {"ok", "success", "succeeded", "successful", "done", "completed", "complete", "created", "sent", "delivered",
            "saved", "updated", "deleted", "finished", "passed", "active", "healthy", "up", "green", "confirmed", "paid",
            "shipped", "merged", "deployed", "published"}
_JSON_PENDING = {"pending", "queued", "running", "in_progress", "in-progress", "processing", "accepted", "started",
                 "waiting", "scheduled", "submitted", "created_pending"}
_LIST_KEYS = ("results", "items", "data", "hits", "rows", "records", "matches", "documents", "entries", "files",
              "values", "list", "events", "messages")
_DONE_FLAGS = ("confirmed", "completed", "done", "created", "sent", "saved", "deleted", "booked", "paid", "delivered",
               "approved", "published", "merged", "deployed", "updated", "scheduled")
_FAIL_KEYS = ("exception", "fault", "failure")  # besides any key with "error" in it: a failure object
_CODE_KEYS = ("code", "status", "status_code", "statuscode", "http_status", "http_code")
_EXIT_KEYS = ("exit_code", "exitcode", "returncode", "return_code", "exit_status", "rc")


def _int(v) -> int | None:
    """An integer field (a digit string counts; a bool does not)."""
    if isinstance(v, str) and v.strip().isdigit():
        return int(v)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _json_transient(low: dict) -> ToolReading | None:
    """An error object reporting a failure of the environment (HTTP 429/502/503/504 or a rate
    limit, at the top level or inside its ``error`` field): not the call's fault."""
    error = low.get("error")
    scopes = [low] + ([{str(k).lower(): v for k, v in error.items()}] if isinstance(error, dict) else [])
    for scope in scopes:
        for key in _CODE_KEYS:
            if _int(scope.get(key)) in _TRANSIENT_CODES:
                return ToolReading(0, f"JSON {key}={_int(scope.get(key))} (transient, not caused by the call)")
    if any("error" in k and v not in (None, False, "", [], {}, 0) for k, v in low.items()) and any(
            isinstance(v, str) and _TRANSIENT.search(v) for scope in scopes for v in scope.values()):
        return ToolReading(0, "JSON error of the environment (rate limit, overload)")
    return None


def _json_command(low: dict, key: str, call: str) -> ToolReading:
    """``{"exit_code", "stdout", "stderr"}`` read like the same result printed."""
    code = low[key]
    streams = [low[k] for k in ("stdout", "output", "out") if isinstance(low.get(k), str)]
    quiet = bool(streams) and not any(x.strip() for x in streams) and not str(low.get("stderr") or "").strip()
    if code == 0:
        if quiet and not (call and _SILENT_OK.search(call)):
            return ToolReading(0, f"JSON {key}=0 with an empty output")
        return ToolReading(1, f"JSON {key}=0")
    if code == 1 and call and _SILENT_ON_ERROR_1.search(call) and quiet:
        return ToolReading(0, f"JSON {key}=1 of a match/compare command (no match)")
    return ToolReading(-1, f"JSON {key}={code}")


def _json_fields(low: dict, call: str) -> ToolReading | None:
    """The outcome fields of a JSON object, most specific first."""
    for key, err in low.items():
        if ("error" in key or key in _FAIL_KEYS) and "count" not in key \
                and err not in (None, False, "", [], {}, 0, "none", "null"):
            return ToolReading(-1, f"JSON {key} field")
    for key in ("ok", "success", "succeeded"):
        if isinstance(low.get(key), bool):
            return ToolReading(1 if low[key] else -1, f"JSON {key}={str(low[key]).lower()}")
    for key in _EXIT_KEYS:
        if _int(low.get(key)) is not None and not isinstance(low.get(key), str):
            return _json_command(low, key, call)
    for key in ("status_code", "statuscode", "http_status", "code", "status"):
        v = low.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and 100 <= v <= 599:
            return _http_reading(v)
    for key in ("conclusion", "outcome", "result", "status", "state"):  # a conclusion outranks a status
        s = low[key].strip().lower().replace(" ", "_") if isinstance(low.get(key), str) else ""
        for values, label in ((_JSON_FAIL, -1), (_JSON_PENDING, 0), (_JSON_OK, 1)):
            if s in values:
                return ToolReading(label, f"JSON {key}={low[key]}")
    return None


def _json_shape(low: dict) -> ToolReading | None:
    """What a JSON object without outcome fields says by its shape: a flag that the thing
    happened, a list of results, a status message, a zero count, a page, an identified resource."""
    for key in _DONE_FLAGS:  # "confirmed": true on a booking; a false one says nothing by itself
        if low.get(key) is True:
            return ToolReading(1, f"JSON {key}=true")
    more = any(low.get(k) for k in ("next_page", "next_cursor", "has_more", "truncated"))
    for key in _LIST_KEYS:
        if isinstance(low.get(key), list) and not low.get("next_page") and not low.get("has_more"):
            return ToolReading(1 if low[key] else 0, f"JSON {key} {'returned' if low[key] else 'empty'}")
    for key in ("message", "msg", "detail", "details", "reason", "error_description"):  # not titles: they describe
        v = low.get(key)
        if isinstance(v, str) and len(v) <= SHORT_CHARS and (_ERROR.search(v) or _WEAK_ERROR.search(v)):
            return ToolReading(-1, f"JSON {key} reports an error")
    if any(_int(low.get(k)) == 0 and not isinstance(low.get(k), str) for k in ("total", "count", "total_count",
                                                                            "num_results", "totalresults")) \
            and len(low) <= 3:
        return ToolReading(0, "JSON count=0")
    if more:
        return ToolReading(0, "JSON page of a longer result (more pages)")
    if any(k in low for k in ("id", "uuid", "number", "html_url", "url", "self", "href")) and not any(
            isinstance(v, str) and v.strip().lower().replace(" ", "_") in _JSON_FAIL for v in low.values()):
        return ToolReading(1, "JSON object returned (an identified resource)")
    return None


def _http_reading(code: int) -> ToolReading:
    if code == 202:
        return ToolReading(0, f"HTTP {code} (accepted, not done)")
    if code in _TRANSIENT_CODES:
        return ToolReading(0, f"HTTP {code} (transient, not caused by the call)")
    if 200 <= code < 300 or code == 304:
        return ToolReading(1, f"HTTP {code}")
    return ToolReading(-1 if 400 <= code < 600 else 0, f"HTTP {code}")


def _tests(s: str) -> ToolReading | None:
    """Test-runner summaries: JUnit/Maven, Cargo, unittest and Go, then counts (zero counts removed)."""
    m = _JUNIT.search(s)
    if m:
        bad = int(m.group(2)) + int(m.group(3) or 0)
        return ToolReading(-1 if bad else (1 if int(m.group(1)) else 0), f"JUnit: {bad} failures/errors")
    m = _CARGO.search(s)
    if m:
        ok = m.group(1).lower() == "ok" and not _FAILED_N.search(_ZERO_COUNTS.sub(" ", s))
        return ToolReading(1 if ok else -1, f"cargo: {'ok' if ok else 'FAILED'}")
    if _TEST_FAILED.search(s):
        return ToolReading(-1, "test run failed")
    cleaned = _ZERO_COUNTS.sub(" ", s)
    failed = sum(int(a or b) for a, b in _FAILED_N.findall(cleaned))
    if failed:
        return ToolReading(-1, f"tests: {failed} failed")
    if _TEST_OK.search(s):
        return ToolReading(1, "test run ok")
    passed = sum(int(n) for n in _PASSED_N.findall(cleaned))
    if passed and re.search(r"\btests?\b|\bpassed\b|\bpassing\b|\bspecs?\b|\bsuites?\b|=====", s, re.I):
        return ToolReading(1, f"tests: {passed} passed")
    if _NO_TESTS.search(s) and re.search(r"\btests?\b|\bcollected\b", s, re.I):
        return ToolReading(0, "no tests ran")
    return None


class _Output:
    """One tool result and what the rules share about it."""

    def __init__(self, text: str, call: str) -> None:
        self.s, self.call = (text or "").strip(), call or ""
        s = self.s
        self.searched = bool(_SEARCH_CALL.search(self.call))
        self.listing = (len(_URL.findall(s)) >= 2 or len(_NUMBERED.findall(s)) >= 3
                        or bool(_FOUND_N.search(s.split("\n", 1)[0])))  # search hits, a result listing
        # a prose document (a file read by a read tool, markdown with a heading): the errors it quotes are content
        self.document = (s.count("\n") >= 2 or len(s) >= 200) and bool(
            _READ_CALL.search(self.call) or (_HEADING.match(s) and s.count("\n") >= 2))
        self.cleaned = _ZERO_COUNTS.sub(" ", s)
        if self.document:
            self.cleaned = _QUOTED_SPAN.sub(" ", self.cleaned)
        short = len(s) <= SHORT_CHARS and s.count("\n") < SHORT_LINES and not self.searched and not self.document
        self.no_results = bool(_NO_RESULTS.search(self.cleaned))
        if self.listing:  # the items of a listing are content; an error line after them is the tool's own
            lines = self.cleaned.splitlines()
            last = max((i for i, line in enumerate(lines) if _NUMBERED.match(line) or _URL.search(line)), default=-1)
            self.error = None if self.searched else _ERROR.search(
                "\n".join(line for line in lines[last + 1:] if not line[:1].isspace()))
        else:
            self.error = _ERROR.search(self.cleaned) or (  # (a WARN line's words are no failure)
                _WEAK_ERROR.search(_WARN_LINE.sub(" ", self.cleaned)) if short and not self.no_results else None)
        self.listing = self.listing or (self.searched and not self.error and not self.no_results)


def _empty(o: _Output) -> ToolReading | None:
    if o.s.lower() not in _EMPTY:
        return None
    if _SILENT_OK.search(o.call) and not _SILENT_ON_ERROR_1.search(o.call):
        return ToolReading(1, "empty output of a command silent on success")
    return ToolReading(0, "empty output")


def _json(o: _Output) -> ToolReading | None:
    """A JSON result: its fields decide; JSON without an outcome field or error line is data (None)."""
    if o.s[:1] not in "[{":
        return None
    try:
        obj = json.loads(o.s)
    except ValueError:
        return None
    if isinstance(obj, list) and not obj:
        return ToolReading(0, "empty JSON list")
    if isinstance(obj, dict) and len(obj) == 1 and isinstance(inner := next(iter(obj.values())), dict):
        key = str(next(iter(obj))).lower()  # an envelope ({"reservation": {...}}): its object's fields decide,
        if not ("error" in key or key in _JSON_FAIL or key in _FAIL_KEYS):  # not a failure's
            obj = inner
    if isinstance(obj, dict):
        low = {str(k).lower(): v for k, v in obj.items()}
        reading = _json_transient(low) or _json_fields(low, o.call) or _json_shape(low)
        if reading is not None:
            return reading
    return None if _ERROR.search(o.cleaned) else ToolReading(None, "JSON data")


def _exit_status(o: _Output) -> ToolReading | None:
    codes = [int(m) for m in _EXIT.findall(o.s)]
    if codes and codes[-1] != 0:
        if codes[-1] == 1 and _SILENT_ON_ERROR_1.search(o.call) and not o.error:
            return ToolReading(0, "exit 1 of a match/compare command (no match)")
        return ToolReading(-1, f"exit status {codes[-1]}")
    if codes and not o.error:
        return ToolReading(1, "exit status 0")
    return ToolReading(-1, "non-zero exit status") if _NONZERO_EXIT.search(o.s) else None


def _http_status(o: _Output) -> ToolReading | None:
    codes = [int(next(g for g in groups if g)) for groups in _HTTP.findall(o.s)]
    return next((_http_reading(c) for c in codes if 100 <= c <= 599), None)


def _pending(o: _Output) -> ToolReading | None:
    """Queued, running, submitted ... unless the output ends in a success or says it is done now."""
    lines = o.s.splitlines() or [""]
    ended_well = len(lines) > 1 and bool(_SUCCESS.search(lines[-1])) and not _PENDING.search(lines[-1])
    if _PENDING.search(o.s) and not _DONE_NOW.search(_DONE_LATER.sub(" ", o.s)) and not ended_well:
        return ToolReading(0, "pending")
    return None


def _document(o: _Output) -> ToolReading | None:
    """A body that a read tool returned (a file, a log, a page): the failures it names are its
    content, not the read's outcome (None: the model decides, +1 or abstain). A read that failed
    says so on its first line (``Error: ENOENT``, a traceback, ``HTTP 404``): that still decides."""
    if not (o.document and _READ_CALL.search(o.call)):
        return None
    first = next((line for line in o.s.splitlines() if line.strip()), "")
    if _ERROR.search(first) or _HTTP.search(first) or _WEAK_ERROR.search(first):
        return None
    if o.error or any(r is not None and r.label == -1 for r in (_tests(o.s), _exit_status(o), _http_status(o))):
        return ToolReading(None, "a document read (the failures it names are content)")
    return None


def _when(pattern: re.Pattern, label: int | None, reason: str, attr: str = "s"):
    """A rule that decides ``label`` when ``pattern`` occurs in the output (``attr``: raw or cleaned text)."""
    return lambda o: ToolReading(label, reason) if pattern.search(getattr(o, attr)) else None


# The rules, in the order they are tried: outcomes that are not settled before counts, counts and
# statuses before words, errors before listings, listings before success words.
RULES = (
    ("empty", _empty),
    ("json", _json),
    ("collection_error", lambda o: ToolReading(-1, "test collection error (no test could run)")
     if _COLLECTION_ERROR.search(o.s) and not o.searched and not o.listing else None),
    ("unsettled", _when(_UNSETTLED, 0, "not settled (dry run, partial, truncated or flaky)")),
    ("document", _document),
    ("test_summary", lambda o: _tests(o.s)),
    ("transient", _when(_TRANSIENT, 0, "transient failure of the environment (rate limit, overload)")),
    ("exit_status", _exit_status),
    ("http_status", _http_status),
    ("error_signature", lambda o: ToolReading(-1, f"error signature: {o.error.group(0).strip()[:40]}")
     if o.error else None),
    ("listing", lambda o: ToolReading(1, "result listing") if o.listing else None),
    ("no_results", lambda o: ToolReading(0, "no results") if o.no_results else None),
    ("starting_up", _when(_STARTING_UP, 0, "pending (a container still starting)")),
    ("pending", _pending),
    ("success", _when(_SUCCESS, 1, "success signature")),
    ("zero_errors", _when(_ZERO_COUNTS, 1, "reports zero errors")),
)


def read_tool_result(text: str, call: str = "") -> ToolReading:
    """Read one tool result with the first rule of :data:`RULES` that decides.

    Args:
        text: the tool message's content as text.
        call: the assistant's tool call(s) as text (``name(arguments)``), for the few commands
            whose exit status or empty output means something else (grep, mkdir ...).
    Returns:
        A :class:`ToolReading` naming its rule; ``label`` None means "no convention found".
    """
    o = _Output(text, call)
    for name, rule in RULES:
        reading = rule(o)
        if reading is not None:
            return ToolReading(reading.label, reading.reason, name)
    return ToolReading(None, "no convention")
