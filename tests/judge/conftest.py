"""The judge's fixtures: ``judge_server`` (the stand-in judge LLM, scripted, not a model) and
``rows`` (a labelled set loaded by the project's own loader)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def judge_server(request, tokenizer):
    """A :class:`pipeline.testing.servers.StandInJudge` (votes scripted in the next-state text)
    decoding ``/generate`` input ids with tiny-random's tokenizer, one per test file; a file that
    needs other settings names them in a module-level ``JUDGE_SETTINGS`` dict (e.g.
    ``{"hang_s": 5.0}``)."""
    from pipeline.testing.servers import StandInJudge

    with StandInJudge(tokenizer=tokenizer, **getattr(request.module, "JUDGE_SETTINGS", {})) as server:
        yield server


@pytest.fixture(scope="module")
def rows(request):
    """The rows of the file's module-level ``ROWS`` (a labelled ``.jsonl``), by
    :func:`pipeline.judge.evaluate.load_rows` (which checks every row's fields)."""
    from pipeline.judge.evaluate import load_rows

    return load_rows(request.module.ROWS)
