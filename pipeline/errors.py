"""The package's one exception root.

Every error this package raises on purpose derives from :class:`PipelineError`, so a caller
can tell the pipeline's own failures (a malformed event, a bad config, an engine that answered
with an error, a broker that did not start) from bugs and from third-party exceptions with one
``except PipelineError``. Each subclass also keeps the built-in base that describes it best
(``ValueError`` for bad input, ``RuntimeError`` for a failed operation, ...), so existing
``except ValueError`` handlers keep working.

This module imports nothing from the package: any module may import it.
"""

from __future__ import annotations


class PipelineError(Exception):
    """Base class of every error raised by the ``pipeline`` package."""
