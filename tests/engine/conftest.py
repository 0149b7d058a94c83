"""The engine's fixtures: ``http`` (a client of the file's ``engine_url``, tests/conftest.py) and
``perturbed_dir`` (tiny-random with every weight moved)."""

from __future__ import annotations

import httpx
import pytest


@pytest.fixture(scope="module")
def http(engine_url):
    """An ``httpx.Client`` on the file's engine (settings: the file's ``ENGINE_SETTINGS``)."""
    with httpx.Client(base_url=engine_url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def perturbed_dir(tmp_path_factory):
    """tiny-random with every weight shifted by seeded noise (same architecture and tokenizer),
    one copy per test file (:func:`pipeline.testing.engine.perturbed_copy`)."""
    from pipeline.testing.engine import perturbed_copy

    return perturbed_copy(tmp_path_factory.mktemp("perturbed"), seed=123)
