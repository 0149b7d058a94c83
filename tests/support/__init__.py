"""Helpers shared by the tests (and by ``bench/``, which puts the repository root on its path).

- :mod:`tests.support.servers`: :func:`serve_app` and the stand-ins (scripted, not models):
  :class:`StandInEngine` (inference engine) and :class:`StandInJudge` (judge LLM and teacher).
- :mod:`tests.support.sglang_style`: our real CPU engine behind SGLang's known differences.
- :mod:`tests.support.engine`: ``running_engine``, the real CPU engine in a thread or process.
- :mod:`tests.support.proxy`: ``running_proxy``, the real proxy in a thread.
- :mod:`tests.support.judge`: small events, the real judge in a thread, scripted streams.
- :mod:`tests.support.trainer`: a world-of-one Megatron runtime, exported "trained" weights.
- :mod:`tests.support.topics`: reading (through :class:`pipeline.bus.TopicReader`) and publishing.
"""
