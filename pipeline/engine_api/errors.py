"""The engine-error classes: every failed HTTP call to a model server raises one of them.

Raised by :mod:`pipeline.engine_api.client` (and every other caller of
:mod:`pipeline.engine_api.transport`): ``status`` is the HTTP code, None when the server could
not be reached or its answer could not be used; a timeout is :class:`EngineTimeout`; a refused,
reset or closed connection is :class:`EngineUnavailable`.
"""

from __future__ import annotations

from typing import Any

from pipeline.errors import PipelineError


class EngineError(PipelineError):
    """The engine answered with an error (``status`` = HTTP status) or could not be used.

    Attributes:
        status: HTTP status code, or None for transport failures.
        message: the server's error message (SGLang's ``message`` / ``error.message``).
        body: the decoded error body when there was one.
    """

    def __init__(self, message: str, status: int | None = None, body: Any = None) -> None:
        super().__init__(f"{status}: {message}" if status is not None else message)
        self.status, self.message, self.body = status, message, body

    @property
    def retryable(self) -> bool:
        """True for transport failures, timeouts and 5xx/429 answers."""
        return self.status is None or self.status >= 500 or self.status == 429


class EngineTimeout(EngineError):
    """No (complete) answer within ``timeout_s``."""


class EngineUnavailable(EngineError):
    """Connection refused, reset or closed before an answer."""


def error_message(body: Any, fallback: str) -> str:
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
