"""Objects named by import path, the plug-in style of the settings and files that name users' code
(``judge.backend``: :func:`pipeline.judge.backends.backend_class`; an eval set's ``function``
checks: :mod:`pipeline.rollout.evalset`): ``package.module:name`` or ``package.module.name``.
"""

from __future__ import annotations

import importlib

from pipeline.errors import PipelineError


class PluginError(PipelineError, ValueError):
    """An import path that is malformed or names nothing importable."""


def load_object(path: str):
    """The object ``path`` names (``package.module:name``, or ``package.module.name``).

    Raises:
        PluginError: ``path`` is not of that form, its module fails to import (any error raised
            while importing it), or it has no such attribute; the message names ``path``.
    """
    mod_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not mod_name or not attr:
        raise PluginError(f"{path!r} is not an import path 'package.module:name'")
    try:
        return getattr(importlib.import_module(mod_name), attr)
    except Exception as e:  # noqa: BLE001 (ImportError, AttributeError, or the module's own error at import)
        raise PluginError(f"cannot import {path}: {type(e).__name__}: {e}") from e
