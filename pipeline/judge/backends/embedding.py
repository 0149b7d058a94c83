"""``embedding`` backend: the CPU judge (:mod:`pipeline.judge.cpu`) as a judge backend
(single-machine default): one shared classifier per process, the last judgements remembered so
that combine mode's score and hint of one turn judge it once, and the OPD hint.

For OPD the hint is the corrective next state itself: when the next state is scored -1 and its
text is longer than ``judge.hint_min_chars``, that text (clipped) is the hint.
"""

from __future__ import annotations

import asyncio
import json
import threading

from pipeline.judge import metrics
from pipeline.judge.backends.base import Backend, HintVerdict, Verdict
from pipeline.judge.cpu.classifier import Embedder, Judgement, NextStateClassifier
from pipeline.judge.prompts import JudgeInput, clip

HINT_MAX_CHARS = 1000
RECENT = 256


class EmbeddingBackend(Backend):
    """Structured tool reading + MiniLM classifier of the next state (CPU; no judge endpoint)."""

    name = "embedding"
    _shared: NextStateClassifier | None = None
    _shared_lock = threading.Lock()

    def __init__(self, config) -> None:
        super().__init__(config)
        self.min_chars = config.judge.hint_min_chars
        with EmbeddingBackend._shared_lock:  # one model per process
            if EmbeddingBackend._shared is None:
                EmbeddingBackend._shared = NextStateClassifier(
                    Embedder(threads=config.judge.embedding_threads), cache_dir=config.engine.cache_dir,
                    finetune_epochs=config.judge.embedding_finetune_epochs)
        self.clf = EmbeddingBackend._shared
        self._recent: dict[str, Judgement] = {}  # last RECENT judgements, oldest first

    async def _judge(self, inp: JudgeInput) -> Judgement:
        key = json.dumps([inp.next_state, inp.response, inp.request], sort_keys=True, default=str)
        j = self._recent.get(key)
        if j is None:  # combine mode asks score and hint of the same turn: judge it once
            j = await asyncio.to_thread(self.clf.judge, inp.next_state, inp.response, inp.request)
            self._recent[key] = j
            while len(self._recent) > RECENT:
                self._recent.pop(next(iter(self._recent)))
        metrics.count_vote(j.label)
        return j

    async def score(self, inp: JudgeInput) -> Verdict:
        j = await self._judge(inp)
        return Verdict(j.label, [j.label])

    async def hint(self, inp: JudgeInput) -> HintVerdict:
        j = await self._judge(inp)
        text = clip(inp.next_state_text(with_roles=False).strip(), HINT_MAX_CHARS)
        if not text:
            return HintVerdict(None, [j.label], "empty_next_state")
        if j.label != -1:
            return HintVerdict(None, [j.label], "not_corrective")
        if len(text) <= self.min_chars:
            return HintVerdict(None, [j.label], "hint_too_short")
        return HintVerdict(text, [j.label])
