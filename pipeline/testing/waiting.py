"""Waiting on states instead of sleeping, and reading server-sent events: small helpers of the tests."""

from __future__ import annotations

import time
from typing import Any, Callable

import orjson


def until(cond: Callable[[], Any], timeout_s: float = 30.0, step_s: float = 0.02) -> Any:
    """Poll ``cond`` every ``step_s`` seconds until it returns something truthy; return that, or the
    last (falsy) value once ``timeout_s`` passed (for ``assert until(...)``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got or time.monotonic() >= deadline:
            return got
        time.sleep(step_s)


def wait_for(cond: Callable[[], Any], what: str = "condition", timeout_s: float = 60.0, step_s: float = 0.05) -> Any:
    """:func:`until`, but a state not reached in time fails the test.

    Raises:
        AssertionError: ``timed out waiting for <what>``.
    """
    got = until(cond, timeout_s, step_s)
    assert got, f"timed out waiting for {what}"
    return got


def process_gone(pid: int) -> bool:
    """True once process ``pid`` has finished dying: a zombie (state ``Z``/``X`` in
    ``/proc/<pid>/stat``, Linux) or reaped. By then the kernel has closed all its files and
    sockets: a connection to a port it listened on is refused. Right after ``kill -9`` it may
    not have run its exit yet (more so on a busy machine): its listening socket still completes
    handshakes, and what it accepted is reset when it does exit."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
    return state in ("Z", "X")


def sse_events(resp) -> list:
    """The ``data:`` payloads of a streamed HTTP response (an ``httpx`` response read with
    ``iter_lines``): parsed JSON objects, and the final ``"[DONE]"`` as the string."""
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            payload = line[6:]
            out.append(payload if payload == "[DONE]" else orjson.loads(payload))
    return out
