"""``pipeline dashboard`` and ``pipeline tail``: seeing the loop from the outside.

- :mod:`~pipeline.dashboard.views`: events as plain dicts (text only on request);
- :mod:`~pipeline.dashboard.state`: the fold of the topics' records the pages show;
- :mod:`~pipeline.dashboard.sources`: the assign-mode topic reader thread and the Prometheus scraper;
- :mod:`~pipeline.dashboard.app`: the web app (overview, conversation browser, live stream);
- :mod:`~pipeline.dashboard.cli`: ``pipeline dashboard``; :mod:`~pipeline.dashboard.tail`: ``pipeline tail``.
"""
