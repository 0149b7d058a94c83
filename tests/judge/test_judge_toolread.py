"""The structured reading of tool results (pipeline.judge.cpu.toolread): conventions decide, data does not.

Each case is a tool output written for this test (not taken from any labelled set the judge is
measured on), with the label the reading must give; None means "no convention: the model decides".
Every named rule of the ordered table ``RULES`` decides at least one case.
"""

from __future__ import annotations

import pytest

from pipeline.judge.cpu.toolread import RULES, read_tool_result

CASES = [
    # test runners: counts decide, zero counts are not failures
    ("===== 12 passed in 0.40s =====", "", 1),
    ("===== 1 failed, 11 passed in 0.52s =====", "", -1),
    ("Ran 4 tests in 0.002s\n\nOK", "", 1),
    ("Ran 4 tests in 0.002s\n\nFAILED (errors=1)", "", -1),
    ("test result: ok. 9 passed; 0 failed; 0 ignored", "", 1),
    ("test result: FAILED. 8 passed; 1 failed; 0 ignored", "", -1),
    ("--- FAIL: TestParse (0.00s)\nFAIL\texample.com/p\t0.01s", "", -1),
    ("ok  \texample.com/p\t0.01s", "", 1),
    ("Tests run: 10, Failures: 0, Errors: 0, Skipped: 1", "", 1),
    ("Tests run: 10, Failures: 1, Errors: 0, Skipped: 0", "", -1),
    ("Tests:       2 failed, 9 passed, 11 total", "", -1),
    ("FAILURES!\nTests: 5, Assertions: 9, Failures: 2.", "", -1),
    ("collected 0 items\n\n==== no tests ran in 0.01s ====", "", 0),
    ("Found 0 errors. 0 warnings.", "", 1),
    # exit and HTTP statuses
    ("done\n[exit code 0]", "", 1),
    ("[process exited with code 3]", "", -1),
    ("Command '['make']' returned non-zero exit status 2.", "", -1),
    ("[exit code 1]", 'shell({"cmd": "grep -q needle file.txt"})', 0),
    ("[exit code 1]", 'shell({"cmd": "make"})', -1),
    ("HTTP/1.1 503 Service Unavailable", "", 0),  # the environment failed, not the call
    ("429 Too Many Requests. Retry after 30 s.", "", 0),
    ("HTTP/1.1 500 Internal Server Error", "", -1),
    ("HTTP/1.1 201 Created", "", 1),
    ("202 Accepted", "", 0),
    # error signatures
    ("Traceback (most recent call last):\n  File \"a.py\", line 1\nNameError: name 'x' is not defined", "", -1),
    ("zsh: command not found: pyhton3", "", -1),
    ("fatal: remote origin already exists.", "", -1),
    ("cp: cannot stat 'a.txt': No such file or directory", "", -1),
    ("make: *** [Makefile:3: all] Error 1", "", -1),
    ("lib/x.js:4:10: error Unexpected token", "", -1),
    ("The coupon code has expired.", "", -1),
    # JSON fields
    ('{"ok": false, "error": "invalid_auth"}', "", -1),
    ('{"ok": true}', "", 1),
    ('{"status": "queued", "id": 4}', "", 0),
    ('{"status": "completed", "id": 4}', "", 1),
    ('{"results": [], "total": 0}', "", 0),
    ('{"results": [{"title": "a"}]}', "", 1),
    ('{"code": 404, "message": "page not found"}', "", -1),
    ('{"errors": [], "data": {"id": 1}}', "", None),
    ('{"error_count": 0, "rows": [1, 2]}', "", 1),
    # not settled: dry run, partial or truncated output, flaky test
    ("Dry run: would delete 14 files", "", 0),
    ("Imported 40 of 100 rows processed before the connection dropped", "", 0),
    ("1 flaky test passed on retry; 20 passed", "", 0),
    # pending, empty, no results
    ("[3] 12345", "", 0),
    ("Upload 35% complete", "", 0),
    ("Report requested. You'll get an email when it is ready.", "", 0),
    ("", 'shell({"cmd": "mkdir -p out"})', 1),
    ("", 'shell({"cmd": "cat notes.txt"})', 0),
    ("[]", "", 0),
    ("No results found for 'zzkx'", "", 0),
    ("We could not find any matching orders.", "", 0),
    # data is not an error, even when it talks about errors
    ("1. Fixing TypeError in Python - https://a.example/1\n2. TypeError explained - https://b.example/2", "", 1),
    ("Found 3 matches:\n- retry on failure (config)\n- failed jobs view\n- error budget", "", 1),
    ("def check(x):\n    if x < 0:\n        raise ValueError('invalid input')\n    return x\n" * 3, "", None),
    ("Monday 12°C cloudy", "", None),
    ("warning: unused variable 'n'", "", None),  # warnings alone: the model decides
    # a weak error word on a warning line of npm, Maven or pip is no failure: the model decides
    ("npm WARN deprecated inflight@1.0.6: not supported\nadded 3 packages in 2s", 'shell({"cmd": "npm i"})', None),
    ("[WARNING] Parameter 'x' is unknown\n[INFO] Copying 3 resources", 'shell({"cmd": "mvn package"})', None),
    ("WARNING: Retrying after connection broken\nCollecting six", 'shell({"cmd": "pip install six"})', None),
    ("npm WARN config cannot be set\nnpm ERR! code E404", 'shell({"cmd": "npm i nope"})', -1),
    ("Saved 2 files.", "", 1),
    # a command result given as JSON reads like the same result printed
    ('{"exit_code": 0, "stdout": "", "stderr": ""}', 'shell({"cmd": "find . -size +1G"})', 0),
    ('{"exit_code": 0, "stdout": "", "stderr": ""}', 'shell({"cmd": "npx tsc --noEmit"})', 1),
    ('{"exit_code": 0, "stdout": "", "stderr": ""}', 'shell({"cmd": "sort names.txt > sorted.txt"})', 1),
    ('{"exit_code": 0, "stdout": "a.txt", "stderr": ""}', 'shell({"cmd": "ls"})', 1),
    ('{"exit_code": 1, "stdout": "", "stderr": ""}', 'shell({"cmd": "grep -rn TODO src"})', 0),
    ('{"exit_code": 1, "stdout": "", "stderr": "No such file"}', 'shell({"cmd": "grep -rn TODO srcx"})', -1),
    ('{"exit_code": 2, "stdout": "", "stderr": ""}', 'shell({"cmd": "make"})', -1),
    # search hits are content, even short ones with error words in them
    ("1. Task groups - cancelled tasks and errors explained", 'web_search({"query": "task groups"})', 1),
    ("Traceback (most recent call last):\n  File \"s.py\", line 1\nKeyError: 'q'", 'web_search({"query": "x"})', -1),
    # a listing's items are content, but an error line beside them is the tool's own: a numbered
    # list of steps that ends in a traceback or an error line failed
    ("1. fetch sources\n2. compile\n3. link\nerror: ld returned 1 exit status", 'shell({"cmd": "make"})', -1),
    ("1) migrate users\n2) migrate orders\n3) migrate invoices\nTraceback (most recent call last):\n"
     "  File \"m.py\", line 3\nKeyError: 'id'", 'shell({"cmd": "python migrate.py"})', -1),
    ("1. Login fails with Permission denied\n2. Dark mode\n3. Crash on start", 'shell({"cmd": "gh issue list"})', 1),
    # ... only a line after the last item, not indented: titles above links and items' details are content
    ("Error handling guide\nhttps://docs.example.com/errors\nRetry policy\nhttps://docs.example.com/retry",
     "list_bookmarks({})", 1),
    ("1. Fix build\n   Traceback (most recent call last): seen in CI\n2. Docs\n3. Release", "gh_issues({})", 1),
    ("1. INC-12 checkout down\n   Error: payment gateway unreachable\n2. INC-13 slow search\n3. INC-14 logins",
     "list_incidents({})", 1),
    # a document that was read: the failures it names are its content (the model decides)
    ("2026-12-03 02:14:07 INFO job 41 started\n2026-12-03 02:14:09 ERROR job 41 failed\n"
     "Traceback (most recent call last):\n  File \"w.py\", line 9\nKeyError: 'id'", 'read_file({"path": "w.log"})', None),
    ("# Postmortem\n\nFor 42 minutes, 31% of checkout requests failed with HTTP 500.\nRoot cause: a config push.",
     'read_document({"doc_id": "pm-11"})', None),
    ("Permission denied", 'read_file({"path": "/etc/shadow"})', -1),  # the read itself failed ...
    ("Error: ENOENT: no such file or directory, open 'w.log'\n    at Object.openSync (fs.js:1)\n    at read (r.js:2)",
     'read_file({"path": "w.log"})', -1),  # ... and says so on its first line
    ("Traceback (most recent call last):\n  File \"r.py\", line 2\nFileNotFoundError: [Errno 2] w.log",
     'read_file({"path": "w.log"})', -1),
    ("HTTP 404 Not Found\nThe requested document does not exist.\nCheck the id.", 'read_document({"id": "x"})', -1),
    ("## Build\ncompiling main.c\nerror: ld returned 1 exit status\n", 'shell({"cmd": "make"})', -1),  # not a read
    # the shell's "command not found" in other locales; terraform's boxed errors; an envelope object
    ("bash: kubctl : commande introuvable", 'shell({"cmd": "kubctl get pods"})', -1),
    ("zsh: Befehl nicht gefunden: pyhton", 'shell({"cmd": "pyhton a.py"})', -1),
    ("╷\n│ Error: Reference to undeclared resource\n│\n│   on main.tf line 31", 'shell({"cmd": "terraform plan"})', -1),
    ("ERROR: (gcloud.compute.instances.create) The service is currently unavailable.", "", 0),
    ('{"reservation": {"code": "CO-58", "status": "CONFIRMED"}}', "", 1),
    ('{"result": {"status": "failed", "reason": "card expired"}}', "", -1),
    ('{"error": {"status": "PERMISSION_DENIED", "message": "no"}}', "", -1),  # a failure's envelope stays one
    ('{"fault": {"faultstring": "Invalid ApiKey"}}', "", -1),
    ('{"failed": {"id": 3}}', "", -1),
    # ... but a search that found nothing did not succeed at finding: no results (0), not a listing
    ("No results found for 'flange bracket 77'", 'web_search({"query": "flange bracket 77"})', 0),
    ("We couldn't find anything for \"Chez Plume\".", 'kb_lookup({"q": "Chez Plume"})', 0),
    ("0 messages match your search.", 'search_mail({"q": "invoice 7781"})', 0),
    # JSON: titles describe an object; an identified resource is a success; a page is partial
    ('{"number": 7, "title": "Login fails on Safari", "state": "open"}', "", 1),
    ('{"id": "c_1", "description": "invalid rows are skipped"}', "", 1),
    ('{"id": "c_1", "status": "failed"}', "", -1),
    ('{"items": [{"n": 1}], "next_page": 2}', "", 0),
    ('{"data": [{"n": 1}], "has_more": true}', "", 0),
    ('{"message": "Not Found"}', "", -1),
    # failures of the environment inside a JSON error object: the call is not at fault
    ('{"error": {"code": 503, "message": "The model is overloaded"}}', "", 0),
    ('{"error": {"status": "429", "message": "slow down"}}', "", 0),
    ('{"status_code": 502, "error": "Bad Gateway"}', "", 0),
    ('{"error": "Too many requests, please retry later"}', "", 0),
    ('{"error": {"code": 404, "message": "no such repo"}}', "", -1),  # a client error stays a failure
    ("<html><title>504 Gateway Time-out</title><body>upstream timed out</body></html>", "", 0),
    # a flag that the thing happened; a false flag decides nothing alone
    ('{"reservation": "T-88", "confirmed": true}', "", 1),
    ('{"reservation": "T-88", "confirmed": false, "error": "slot taken"}', "", -1),
    # progress that ended in a success; a container still starting
    ("Waiting for rollout of api: 1 of 2 new replicas updated...\nrollout of api completed successfully", "", 1),
    ("NAME        READY   STATUS              RESTARTS   AGE\nweb-5f7d   0/1     ContainerCreating   0          5s",
     "", 0),
    ("NAME        READY   STATUS    RESTARTS   AGE\nworker-9b   0/1     Init:0/2  0          40s", "", 0),
    ("NAME        READY   STATUS             RESTARTS   AGE\napi-77c    0/1     CrashLoopBackOff   6          9m", "", -1),
    # runs cut short, flaky passes
    ("Copying shard 1/8 ... done\nCopying shard 2/8 ...\n(still running after 120 s; output so far)", "", 0),
    ("tests/test_io.py::test_retry PASSED\n==== 3 passed, 2 rerun in 4.10s ====", "", 0),
    # a test module that does not import: nothing ran, a failure (not a partial run)
    ("_____ ERROR collecting tests/test_cli.py _____\nImportError: cannot import name 'main'\n"
     "!!!!! Interrupted: 1 error during collection !!!!!", 'bash({"command": "pytest tests"})', -1),
    ("ImportError while importing test module '/srv/tests/test_db.py'.", "", -1),
    # OS errors in other locales
    ("cp: 'a.txt' kann nicht angelegt werden: Keine Berechtigung", 'bash({"command": "cp a.txt /etc/"})', -1),
    ("ls: impossible d'accéder à 'logs': Aucun fichier ou dossier de ce type", "", -1),
    ("mkdir: no se puede crear el directorio «/opt/x»: Permiso denegado", "", -1),
    ("cat: notes.txt: そのようなファイルやディレクトリはありません", "", -1),
    ("rm: 无法删除 'x.log': 权限不够", "", -1),
    ("Fehler: Verbindung zur Datenbank fehlgeschlagen", "", -1),
    # a document read from a file: the errors it quotes are its content, not the read's outcome
    ("## Known issues\n\nWhen the worker prints 'Permission denied' on start, check the socket owner.\n"
     "A \"connection refused\" usually means the broker is down.", 'read_file({"path": "docs/ops.md"})', None),
    ("Permission denied", 'read_file({"path": "docs/ops.md"})', -1),  # the read itself failed
    ("File not found: src/app.py", 'read_file({"path": "src/app.py"})', -1),
    ("Could not post message: channel not found", 'slack_thread_reply({"channel": "x", "text": "y"})', -1),
    # flags and statuses: the most specific outcome field decides
    ('{"completed": true, "exit_code": 2, "stderr": "boom"}', "", -1),
    ('{"done": true, "status": "failed"}', "", -1),
    ('{"status": "completed", "conclusion": "failure"}', "", -1),
    ('{"ok": true, "error": null, "note": "quota resets later; retry later if needed"}', "", 1),
    # a search for an error message returns hits that quote it
    ("1. ImportError while importing test module - pytest docs - docs.example.org\n"
     "2. Fixing ImportError while importing test module - blog.example.com\n3. conftest tips - q.example.net",
     'web_search({"query": "ImportError while importing test module"})', 1),
    # zero counts in other languages are no failure
    ("Tests : 12 réussis, 0 échec", "", 1),
    ("成功 12 个, 失败 0 个", "", 1),
    # "successfully" queued is still pending; a pending line followed by a final success is done
    ("Build queued successfully. Waiting for runner...", "", 0),
    ("Job submitted successfully. Status: pending", "", 0),
]


@pytest.mark.parametrize("text,call,label", CASES)
def test_reading(text, call, label):
    reading = read_tool_result(text, call)
    assert reading.label == label, reading


def test_reading_names_its_reason():
    assert "exit" in read_tool_result("[exit code 2]").reason
    assert read_tool_result("all good").reason  # never empty


@pytest.mark.parametrize("name", [name for name, _ in RULES])
def test_every_rule_decides_a_case(name):
    """Each rule of the table is exercised: some case is decided by it, with the case's label."""
    decided = [(text, label) for text, call, label in CASES if read_tool_result(text, call).rule == name]
    assert decided, f"no case is decided by rule {name}"
    assert len(RULES) == len({n for n, _ in RULES})  # names are unique
