"""JSON-lines files (one JSON value per line): the one reader of the package.

Used for the shipped data sets and labelled examples (strict: a bad line is an error that names
it) and for logs that a running process appends to (``strict=False``: a line that is not JSON,
e.g. the torn last line of a log being written or cut by a kill, is skipped). The history
archive has its own streaming reader (:mod:`pipeline.history.store`: offsets, merge by time).
"""

from __future__ import annotations

import json
import os
from typing import Any

from pipeline.errors import PipelineError


class JsonlError(PipelineError, ValueError):
    """A JSON-lines file cannot be read, or (strict) one of its lines is not JSON (``path:line``)."""


def read_jsonl(path: str | os.PathLike, *, strict: bool = True, missing_ok: bool = False,
               numbered: bool = False) -> list[Any]:
    """The values of the non-blank lines of ``path``, in file order.

    Args:
        strict: a line that is not JSON raises; False skips it.
        missing_ok: a missing file gives ``[]`` instead of an error.
        numbered: ``(line number, value)`` pairs (from 1), for errors about a row's content.
    Raises:
        JsonlError: the file cannot be read (``<path>: <reason>``), or (strict) a line is not
            JSON (``<path>:<line number>: not JSON: <reason>``).
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError as e:
        if missing_ok:
            return []
        raise JsonlError(f"{path}: {e.strerror or e}") from None
    except OSError as e:
        raise JsonlError(f"{path}: {e.strerror or e}") from None
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            if strict:
                raise JsonlError(f"{path}:{n}: not JSON: {e}") from None
            continue
        out.append((n, value) if numbered else value)
    return out


__all__ = ["JsonlError", "read_jsonl"]
