"""Retries with exponential back-off and jitter (tenacity), for calls whose failure can pass.

Only an error that the caller marks as transient (:class:`Transient`: a refused connection, a
time-out, HTTP 429/5xx) is retried; anything else propagates at once. A failure that a retry
cannot change (a 4xx, a checksum mismatch) must never be raised as :class:`Transient`.

Example::

    async for attempt in retrying(attempts=3, backoff_s=0.5):
        with attempt:
            status = await call()
            if status in (429, 503):
                raise Transient(f"HTTP {status}")
"""

from __future__ import annotations

import time
from typing import Callable

from tenacity import AsyncRetrying, Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from pipeline.errors import PipelineError


class Transient(PipelineError):
    """A failure that may pass if the call is made again (raised inside a :func:`retrying` block)."""


def retrying(attempts: int, backoff_s: float, max_backoff_s: float = 30.0) -> AsyncRetrying:
    """An async tenacity loop: at most ``attempts`` tries (>= 1) of a block, retried only on
    :class:`Transient`.

    Waits between tries: ``backoff_s * 2**k`` (k = 0, 1, ...) plus a uniform jitter in
    ``[0, backoff_s]`` seconds, so that many clients failing together do not retry in lockstep;
    the sum is capped at ``max_backoff_s``. After the last try the last :class:`Transient` is re-raised.
    """
    return AsyncRetrying(stop=stop_after_attempt(max(1, attempts)), reraise=True,
                         retry=retry_if_exception_type(Transient),
                         wait=wait_exponential_jitter(initial=backoff_s, max=max_backoff_s, jitter=backoff_s))


def retrying_sync(attempts: int, backoff_s: float, max_backoff_s: float = 30.0,
                  sleep: Callable[[float], None] = time.sleep) -> Retrying:
    """The blocking twin of :func:`retrying` (same waits, same rule: only :class:`Transient` is
    retried). ``sleep(seconds)`` waits between tries; a sleep that raises (e.g. because the
    caller is stopping) ends the loop with that exception."""
    return Retrying(stop=stop_after_attempt(max(1, attempts)), reraise=True, sleep=sleep,
                    retry=retry_if_exception_type(Transient),
                    wait=wait_exponential_jitter(initial=backoff_s, max=max_backoff_s, jitter=backoff_s))


__all__ = ["Transient", "retrying", "retrying_sync"]
