"""The engine-error classes: every failed HTTP call to a model server raises one of them.

Raised by :mod:`pipeline.engine_api.client` and every other caller of
:mod:`pipeline.engine_api.transport` (the proxy, the judge's votes and teacher, the syncer, the
simulated users): ``status`` is the HTTP code, None when the server could not be reached or its
answer could not be used; a timeout is :class:`EngineTimeout`; a refused, reset or closed
connection is :class:`EngineUnavailable`. :func:`retried` makes a call again while its failure
is one that can pass (:attr:`EngineError.retryable`), with :mod:`pipeline.retry`'s waits.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, TypeVar

from pipeline.errors import PipelineError
from pipeline.retry import Transient, retrying

T = TypeVar("T")

#: HTTP statuses besides 5xx that a later try can change: request time-out, conflict, too early,
#: too many requests
RETRY_STATUS = frozenset({408, 409, 425, 429})


class EngineError(PipelineError):
    """A call to a model server failed: it answered with an error (``status`` = HTTP status), its
    answer could not be used (``status`` None: not JSON, misaligned log-probs), or it could not
    be reached (:class:`EngineTimeout`, :class:`EngineUnavailable`, :class:`EngineUnreachable`).

    Attributes:
        status: HTTP status code, or None.
        message: the server's error message (SGLang's ``message`` / ``error.message``).
        body: the decoded error body when there was one.
    """

    def __init__(self, message: str, status: int | None = None, body: Any = None) -> None:
        super().__init__(f"{status}: {message}" if status is not None else message)
        self.status, self.message, self.body = status, message, body

    @property
    def retryable(self) -> bool:
        """True when another try may pass: a time-out, an unreachable server, a 5xx answer or one
        of :data:`RETRY_STATUS`; False for any other answer (a 4xx, an unusable body)."""
        if isinstance(self, (EngineTimeout, EngineUnavailable)):
            return True
        return self.status is not None and (self.status >= 500 or self.status in RETRY_STATUS)

    def within(self, context: str) -> "EngineError":
        """The same failure (same class, status and body) with ``context: `` before its message."""
        return type(self)(f"{context}: {self.message}", self.status, self.body)


class EngineTimeout(EngineError):
    """No (complete) answer within ``timeout_s``."""


class EngineUnavailable(EngineError):
    """Connection refused, reset or closed before an answer."""


class EngineUnreachable(EngineUnavailable):
    """The connection could not be opened (refused, unknown host, connect time-out): the request
    never reached the server, so sending it again cannot serve it twice."""


def error_message(body: Any, fallback: str) -> str:
    """The error message of a server's error body (``message``, ``error.message``, ``error``,
    ``detail``: SGLang's, OpenAI's and FastAPI's shapes), else ``fallback``."""
    if isinstance(body, dict):
        if isinstance(body.get("message"), str):
            return body["message"]
        err = body.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
        if isinstance(body.get("detail"), str):
            return body["detail"]
    return fallback


async def retried(call: Callable[[], Awaitable[T]], attempts: int, backoff_s: float,
                  retry_if: Callable[[EngineError], bool] | None = None) -> T:
    """``await call()``, made again while it raises an :class:`EngineError` for which ``retry_if``
    (default :attr:`EngineError.retryable`) is true, at most ``attempts`` tries in all, waiting
    as :func:`pipeline.retry.retrying` does. Raises the last :class:`EngineError` unchanged."""
    check = retry_if or (lambda e: e.retryable)
    try:
        async for attempt in retrying(attempts, backoff_s):
            with attempt:
                try:
                    return await call()
                except EngineError as e:
                    if not check(e):
                        raise
                    raise Transient(str(e)) from e
    except Transient as t:
        raise t.__cause__ from None
    raise AssertionError("unreachable: retrying makes at least one try")
