"""The real proxy served in a thread for tests: :func:`running_proxy`."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from typing import Any, Iterator

from pipeline.testing.servers import serve_app


@contextlib.contextmanager
def running_proxy(config, engine_url: str, *, follow_control: bool = False, publisher=None,
                  **proxy_settings: Any) -> Iterator[tuple[str, Any]]:
    """Serve a :class:`pipeline.proxy.app.ProxyApp` for ``engine_url``; yield ``(base_url, app)``.

    ``proxy_settings`` override fields of ``config.proxy`` (on a copy), e.g. ``api_keys=["k"]``.
    Without ``buffer_dir`` the proxy gets a fresh temporary buffer folder (removed afterwards).
    """
    from pipeline.proxy.app import ProxyApp

    tmp = None
    if "buffer_dir" not in proxy_settings and publisher is None:  # each proxy its own durable buffer
        tmp = tempfile.mkdtemp(prefix="proxy-buffer-")
        proxy_settings = {"buffer_dir": tmp, **proxy_settings}
    cfg = config.replace(proxy=proxy_settings)
    try:
        app = ProxyApp(cfg, engine_url=engine_url, publisher=publisher, follow_control=follow_control)
        with serve_app(app) as url:
            yield url, app
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def stack(config, script=None, **proxy_settings: Any) -> Iterator[tuple[str, Any, Any]]:
    """A :class:`pipeline.testing.servers.StandInEngine` answering by ``script`` and the real proxy
    in front of it; yield ``(proxy base url, app, engine)``."""
    from pipeline.testing.servers import StandInEngine

    up = StandInEngine(script)
    with serve_app(up) as up_url, running_proxy(config, up_url, **proxy_settings) as (url, app):
        yield url, app, up
