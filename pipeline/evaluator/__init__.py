"""``python -m pipeline evaluator``: live evaluation per version and the canary decisions (issue 39).

Only with ``rollout.enabled`` (docs/rollout.md "The evaluator stage"). One process, two threads:

- :mod:`pipeline.evaluator.decider`: :class:`Decider` folds ``control``, ``metrics``, ``samples``
  and ``turns`` (:mod:`pipeline.evaluator.merge` orders them) into
  :class:`pipeline.rollout.fold.RolloutFold` and publishes each ``promote``/``rollback`` on
  ``control``;
- :mod:`pipeline.evaluator.runner`: :class:`EvalRunner` runs ``rollout.eval_set`` against every
  version that serves and publishes an :class:`~pipeline.events.Evaluation` on ``metrics``
  (absent without an eval set), its ``judge`` checks graded by :mod:`pipeline.evaluator.judged`;
- :mod:`pipeline.evaluator.cli`: the command; :class:`Evaluator` starts both (for launchers).
"""

from __future__ import annotations

import logging
import threading

from pipeline.config import Config, ConfigError
from pipeline.evaluator.decider import Decider
from pipeline.evaluator.judged import require_llm_judge
from pipeline.evaluator.runner import EvalRunner

log = logging.getLogger(__name__)


class Evaluator:
    """The decider and, with ``rollout.eval_set``, the eval runner, in daemon threads.

    Args:
        config: the process config.
        engine_url / eval_set: override ``engine.url`` / ``rollout.eval_set``.

    Raises:
        pipeline.config.ConfigError: ``rollout.enabled`` is false.
        pipeline.rollout.evalset.EvalSetError, pipeline.jsonl.JsonlError: a bad eval set, guards
            it can never decide (:func:`pipeline.rollout.evalset.check_guards`), or ``judge`` checks
            and no LLM judge configured (:func:`pipeline.evaluator.judged.require_llm_judge`).
    """

    def __init__(self, config: Config, engine_url: str | None = None, eval_set: str | None = None) -> None:
        if not config.rollout.enabled:
            raise ConfigError("the evaluator decides canaries and rollout is off: set rollout.enabled=true "
                              "(--set rollout.enabled=true; docs/rollout.md)")
        if engine_url:
            config = config.replace(engine={"url": engine_url})
        if eval_set:
            config = config.replace(rollout={"eval_set": eval_set})
        self.config = config
        self.stop = threading.Event()
        self.eval_set = None
        guards = ()
        if config.rollout.eval_set:
            from pipeline.rollout.evalset import check_guards, load_eval_set

            self.eval_set = load_eval_set(config.rollout.eval_set)
            require_llm_judge(config, self.eval_set)
            guards = self.eval_set.guards
            gated = config.trainer.lora is None and config.rollout.full_weights_gate == "evalset"
            check_guards(self.eval_set, tuple(config.rollout.guards) or guards,
                         config.rollout.guard_min_n if gated else None, config.rollout.guard_margin, config.rollout.z)
        self.decider = Decider(config, guards, stop=self.stop)
        self.runner = EvalRunner(config, self.eval_set, stop=self.stop) if self.eval_set is not None else None

    def start(self) -> "Evaluator":
        """Start the threads."""
        self.decider.start()
        if self.runner is not None:
            self.runner.start()
        log.info("evaluator: deciding with %s%s", self.decider.rule,
                 f"; eval set {self.eval_set.name} ({len(self.eval_set.items)} items) on {self.config.engine.url}"
                 if self.eval_set is not None else "; no eval set (live reward only)")
        return self

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop both threads and wait for them."""
        self.stop.set()
        self.decider.close(timeout_s)
        if self.runner is not None:
            self.runner.close(timeout_s)


__all__ = ["Decider", "EvalRunner", "Evaluator"]
