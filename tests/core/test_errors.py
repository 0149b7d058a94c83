"""One exception root: every public exception class the package defines derives from PipelineError."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pipeline
from pipeline.errors import PipelineError


def _modules():
    for info in pkgutil.walk_packages(pipeline.__path__, "pipeline."):
        if info.name.endswith("__main__"):
            continue
        yield importlib.import_module(info.name)


def test_every_package_exception_derives_from_pipeline_error():
    found, bad = [], []
    for mod in _modules():
        for name, obj in vars(mod).items():
            if (inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == mod.__name__
                    and not name.startswith("_")):
                found.append(f"{mod.__name__}.{name}")
                if not issubclass(obj, PipelineError):
                    bad.append(f"{mod.__name__}.{name}")
    assert len(found) >= 20, found  # the walk really saw the package's errors
    assert not bad, f"exceptions outside the root: {bad}"
