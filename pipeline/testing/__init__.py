"""Stand-ins and helpers for the tests (``tests/``) and the benchmarks (``bench/``), like
``torch.testing``: both import them from here, so ``bench/`` never reaches into the test tree.

Rules of this package: no pipeline module imports it (it is built on the pipeline, never under
it); nothing here imports pytest (or another test-only package) when it is imported; stand-ins
say so in their names (``StandIn*``, ``SglangStyleEngine``): scripted answers, never models.

- :mod:`pipeline.testing.servers`: :func:`serve_app` and the stand-ins (scripted, not models):
  :class:`StandInEngine` (inference engine) and :class:`StandInJudge` (judge LLM and teacher).
- :mod:`pipeline.testing.sglang_style`: our real CPU engine behind SGLang's known differences.
- :mod:`pipeline.testing.engine`: ``running_engine``, the real CPU engine in a thread or process.
- :mod:`pipeline.testing.proxy`: ``running_proxy``, the real proxy in a thread.
- :mod:`pipeline.testing.judge`: small events, the real judge in a thread, scripted streams.
- :mod:`pipeline.testing.trainer`: a world-of-one Megatron runtime, exported "trained" weights.
- :mod:`pipeline.testing.topics`: reading (through :class:`pipeline.bus.TopicReader`) and publishing.
"""
