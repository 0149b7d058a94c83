"""Retries (pipeline.retry, tenacity): only transient failures are retried, with exponential
back-off plus jitter; the judge's HTTP client retries 429/5xx and connection failures, never
another 4xx."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from pipeline.engine_api.errors import (EngineError, EngineTimeout, EngineUnavailable, EngineUnreachable,
                                         retried)
from pipeline.engine_api.judging import HttpJudge
from pipeline.retry import Transient, retrying
from pipeline.testing.servers import serve_app


def test_only_transient_failures_are_retried():
    calls = {"transient": 0, "other": 0}

    async def run(kind: str, fail_times: int):
        async for attempt in retrying(attempts=4, backoff_s=0.001):
            with attempt:
                calls[kind] += 1
                if calls[kind] <= fail_times:
                    raise Transient("try again") if kind == "transient" else ValueError("bad input")
                return "ok"

    assert asyncio.run(run("transient", 2)) == "ok" and calls["transient"] == 3
    with pytest.raises(ValueError):
        asyncio.run(run("other", 1))
    assert calls["other"] == 1  # never retried
    calls["transient"] = -10
    with pytest.raises(Transient):
        asyncio.run(run("transient", 100))
    assert calls["transient"] == -6  # stopped after 4 attempts, the last error re-raised


def test_back_off_grows_and_is_jittered():
    r = retrying(attempts=6, backoff_s=0.1, max_backoff_s=0.5)

    class State:
        def __init__(self, n):
            self.attempt_number = n

    waits = {n: [r.wait(State(n)) for _ in range(200)] for n in (1, 2, 3)}
    for n, ws in waits.items():
        base = 0.1 * 2 ** (n - 1)
        assert all(base - 1e-9 <= w <= base + 0.1 + 1e-9 for w in ws), (n, min(ws), max(ws))
        assert max(ws) - min(ws) > 0.05  # jitter: not all clients wait the same
    assert r.wait(State(5)) == 0.5  # capped


class _Flaky:
    """ASGI stand-in that answers each POST with the next status of ``statuses`` (then 200)."""

    def __init__(self, statuses):
        self.statuses, self.calls = list(statuses), 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        await receive()
        self.calls += 1
        status = self.statuses.pop(0) if self.statuses else 200
        body = orjson.dumps({"ok": True} if status == 200 else {"error": "x"})
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


@pytest.mark.parametrize("statuses,calls,ok", [([503, 429], 3, True), ([400], 1, False), ([503, 503, 503], 3, False)])
def test_judge_http_client_retries_what_can_pass(statuses, calls, ok):
    app = _Flaky(statuses)
    with serve_app(app) as url:
        async def main():
            http = HttpJudge(url, timeout_s=5, retries=2, backoff_s=0.01)
            try:
                return await http.post("/v1/chat/completions", {"x": 1})
            finally:
                await http.aclose()

        t0 = time.monotonic()
        if ok:
            assert asyncio.run(main()) == {"ok": True}
        else:
            with pytest.raises(EngineError):
                asyncio.run(main())
        assert app.calls == calls and time.monotonic() - t0 < 10


@pytest.mark.parametrize("err,expect", [
    (EngineTimeout("no answer"), True), (EngineUnreachable("refused"), True), (EngineUnavailable("reset"), True),
    (EngineError("m", 500), True), (EngineError("m", 503), True), (EngineError("m", 429), True),
    (EngineError("m", 408), True), (EngineError("m", 409), True), (EngineError("m", 425), True),
    (EngineError("m", 400), False), (EngineError("m", 404), False), (EngineError("misaligned answer", None), False),
])
def test_engine_error_is_retryable_when_another_try_can_pass(err, expect):
    assert err.retryable is expect


def test_retried_tries_again_only_what_can_pass_and_raises_the_last_error_unchanged():
    calls: list[int] = []

    async def failing(status):
        calls.append(status)
        raise EngineError("boom", status)

    with pytest.raises(EngineError) as ei:
        asyncio.run(retried(lambda: failing(503), 3, 0.001))
    assert ei.value.status == 503 and calls == [503] * 3
    calls.clear()
    with pytest.raises(EngineError) as ei:
        asyncio.run(retried(lambda: failing(400), 3, 0.001))
    assert ei.value.status == 400 and calls == [400]  # a refusal is not asked again
    calls.clear()

    async def second_try_passes():
        calls.append(0)
        if len(calls) < 2:
            raise EngineTimeout("slow")
        return "ok"

    assert asyncio.run(retried(second_try_passes, 3, 0.001)) == "ok" and len(calls) == 2
