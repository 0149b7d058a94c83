"""OpenAI-style error bodies and the exceptions the proxy maps to them.

Every error the proxy answers has the shape the official ``openai`` client parses::

    {"error": {"message": str, "type": str, "param": str | null, "code": str | int | null}}

``type`` is ``invalid_request_error`` for 4xx caused by the request, ``authentication_error``
for 401, ``upstream_error`` for 502, ``timeout_error`` for 504 and ``server_error`` for 503
(weight-sync hold timed out, or ``generation_aborted``: the engine aborted the generation; a
stream cut off that way ends with this body as its last ``data:`` event instead of a
``finish_reason``, never with the non-OpenAI ``finish_reason: "abort"``).
"""

from __future__ import annotations

import orjson

from pipeline.engine_api.errors import EngineError, EngineTimeout
from pipeline.errors import PipelineError


class ProxyError(PipelineError):
    """An error answered to the client with ``status`` and an OpenAI-style body.

    Args:
        status: HTTP status code (4xx for bad input, 502/503/504 for engine trouble).
        message: a clear, human-readable reason (never conversation content).
        type_: OpenAI error ``type``.
        param: the offending request field, e.g. ``messages[2].role``.
        code: a short machine-readable code.
    """

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> bytes:
        """The JSON error body (bytes)."""
        return error_body(self.message, self.type, self.param, self.code)


class ClientGone(PipelineError):
    """The client disconnected before its request body arrived (nothing is answered)."""


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> bytes:
    """Serialise an OpenAI-style error object."""
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})


def bad_request(message: str, param: str | None = None, code: str = "invalid_request") -> ProxyError:
    """A 400 for a malformed or invalid request field."""
    return ProxyError(400, message, param=param, code=code)


def upstream_error(message: str, status: int = 502) -> ProxyError:
    """A 502 (engine failed or unreachable) or 504 (engine timed out)."""
    return ProxyError(status, message, type_="timeout_error" if status == 504 else "upstream_error",
                      code="engine_timeout" if status == 504 else "engine_error")


def engine_failure(e: EngineError) -> ProxyError:
    """The answer to an engine call that failed before the engine answered: 504 for a time-out,
    502 for an unreachable engine or a broken connection (the error's own message)."""
    return upstream_error(e.message, 504 if isinstance(e, EngineTimeout) else 502)


def generation_aborted(detail: str = "the engine aborted the generation before it finished") -> ProxyError:
    """A 503 for a generation that did not finish (engine abort, pause, shutdown): the client
    should retry. The same body is sent as an SSE ``error`` event when a stream was cut off."""
    return ProxyError(503, f"{detail}; retry the request", "server_error", code="generation_aborted")
