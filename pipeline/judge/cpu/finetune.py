"""Fine-tuning the ``embedding`` judge's sentence encoder on labelled user replies.

A frozen all-MiniLM-L6-v2 embeds what a reply is *about* better than how the user *feels* about
the answer: "Fantastic, now nobody can log in" lands next to praise. Fine-tuning the encoder on
the labelled replies (a classification head on the pooled embedding, trained with the encoder,
as in BERT fine-tuning, Devlin et al. 2019) moves stance into the embedding; the judge then
fits its usual logistic-regression head and k-nearest-neighbour vote on the fine-tuned
embeddings (the head-on-a-tuned-body recipe of SetFit, Tunstall et al. 2022, here with a
cross-entropy body instead of a contrastive one). Measured by leaving each labelled set out in
turn (``docs/judge.md``), it raised agreement on the left-out sets from 82.2 % to 86.5 % with
fewer sign errors (35 -> 29 of 1,256).

Training, in full (:func:`fine_tune`): mean pooling over the attention mask, L2 normalisation,
times :data:`SCALE` (a temperature, since cosine-sized logits train slowly), a linear layer to
three classes (1, 0, -1); class-weighted cross-entropy (weights ``N / (3 * count)``); AdamW
(lr ``lr``, weight decay 0.01), batches of :data:`BATCH` replies truncated to
:data:`MAX_TOKENS` tokens, ``epochs`` passes over a seeded shuffle, learning rate warmed up
linearly over the first 10 % of the steps then decayed linearly to 0. The classification head
is thrown away; only the encoder's weights are kept.

It runs once per training set: the weights are cached under ``<cache_dir>/judge/`` by a key of
the training texts, their labels, the hyper-parameters and the base weights' fingerprint, and
a file lock keeps two processes on one machine from training the same model at once. With a
fixed seed the result is reproducible on one machine (CPU kernels may round differently
elsewhere); every decision of a judge process comes from one cached model, so a replay through
the same model decides the same.
"""

from __future__ import annotations

import copy
import fcntl
import hashlib
import logging
import os
import random
import time
from pathlib import Path
from typing import NamedTuple

from pipeline.judge.evaluate import LABELS  # class index order (1, 0, -1)

log = logging.getLogger(__name__)

BATCH = 16
MAX_TOKENS = 128
SCALE = 20.0  # logits = SCALE * (unit embedding) @ W + b
WEIGHT_DECAY = 0.01
WARMUP = 0.1  # share of the steps with a linearly rising learning rate
# Training always uses this many torch threads: the thread count changes how sums are split, so
# the weights (last bits) would depend on the machine's core count. Part of the cache key.
THREADS = 2


class FineTuned(NamedTuple):
    """What :func:`fine_tuned_encoder` returns."""

    encoder: object  # the fine-tuned transformers model, in eval mode
    key: str  # names the training set, hyper-parameters and base weights (the cache file's name)
    trained: bool  # whether this call trained it (False: loaded from the cache)


def mean_pool(hidden, attention_mask):
    """Mean of the token states over the attention mask: [B, T, H], [B, T] -> [B, H] (not normalised)."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)


def save_atomically(obj, path: Path) -> bool:
    """``torch.save`` to a temporary file, then rename over ``path`` (readers never see half a
    file). Returns False, after a warning and removing the temporary file, when it cannot be
    written (read-only folder, full disk)."""
    import torch

    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(obj, tmp)
        os.replace(tmp, path)
        return True
    except Exception as e:  # torch reports a full disk as RuntimeError, not OSError
        log.warning("cannot write %s: %s", path, e)
        tmp.unlink(missing_ok=True)
        return False


def _model_key(embedder, texts: list[str], labels: list[int], epochs: float, lr: float, seed: int) -> str:
    """Names one trained model: the base weights, this module's code (any change to the training
    recipe retrains), the library versions, the hyper-parameters and the labelled texts."""
    import torch
    import transformers

    h = hashlib.sha256()
    for part in (embedder.fingerprint(), Path(__file__).read_text(encoding="utf-8"), torch.__version__,
                 transformers.__version__, f"{epochs}|{lr}|{seed}|{THREADS}"):
        h.update(part.encode() + b"\x00")
    for text, label in zip(texts, labels, strict=True):
        h.update(f"{label}\x01{text}\x00".encode())
    return h.hexdigest()[:24]


def fine_tune(embedder, texts: list[str], labels: list[int], *, epochs: float = 2.0, lr: float = 3e-5,
              seed: int = 0, threads: int = THREADS, progress_every: int = 50, progress_s: float = 30.0):
    """Fine-tune a copy of ``embedder.model`` to tell +1 / 0 / -1 replies apart (module docstring).

    Args:
        embedder: a :class:`pipeline.judge.backends.embedding.Embedder` (its tokenizer and
            encoder; the encoder itself is not changed).
        texts: N replies. labels: N labels in (1, 0, -1).
        epochs: passes over the data (fractions allowed); must be > 0.
        lr: peak AdamW learning rate.
        seed: seeds the shuffle, the head's initialisation and dropout.
        threads: torch CPU threads while training (default :data:`THREADS`, whatever the machine
            has, so that the weights do not depend on its core count), restored afterwards.
        progress_every: log the running loss every this many steps, and
        progress_s: at least every this many seconds (with the time left at the rate so far).

    Returns:
        The fine-tuned encoder (a ``transformers`` model in eval mode).

    Raises:
        ValueError: no texts, lengths differ, a label outside (1, 0, -1), or epochs <= 0.
    """
    import torch

    if not texts or len(texts) != len(labels):
        raise ValueError(f"fine_tune needs as many labels as texts, at least one ({len(texts)} vs {len(labels)})")
    if epochs <= 0:
        raise ValueError(f"fine_tune: epochs must be > 0, got {epochs}")
    bad = [lab for lab in labels if lab not in LABELS]
    if bad:
        raise ValueError(f"fine_tune: labels must be in (1, 0, -1), got {bad[:3]}")
    encoder = copy.deepcopy(embedder.model)
    tokenizer = embedder.tokenizer
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # the seed drives the head's initialisation and dropout (CPU generator only; fork_rng
        # restores it afterwards, so the caller's random state is left alone)
        with torch.enable_grad(), torch.random.fork_rng(devices=[]):
            torch.random.default_generator.manual_seed(seed)
            head = torch.nn.Linear(encoder.config.hidden_size, len(LABELS))
            y = torch.tensor([LABELS.index(int(lab)) for lab in labels])
            counts = torch.bincount(y, minlength=len(LABELS)).float()
            weight = counts.sum() / (len(LABELS) * counts.clamp(min=1))
            params = list(encoder.parameters()) + list(head.parameters())
            opt = torch.optim.AdamW(params, lr=lr, weight_decay=WEIGHT_DECAY)
            steps = max(1, int(epochs * len(texts) / BATCH))
            warm = max(1.0, WARMUP * steps)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / warm) * max(0.0, 1 - k / steps))
            rng, order, step, running, t0 = random.Random(seed), list(range(len(texts))), 0, 0.0, time.monotonic()
            last_log = t0
            encoder.train()
            log.info("judge: fine-tuning MiniLM on %d labelled replies (%d steps; once: about two minutes on two "
                     "cores, then loaded from the cache)", len(texts), steps)
            while step < steps:
                rng.shuffle(order)
                for i in range(0, len(order), BATCH):
                    if step >= steps:
                        break
                    idx = order[i:i + BATCH]
                    batch = tokenizer([texts[j] for j in idx], padding=True, truncation=True, max_length=MAX_TOKENS,
                                      return_tensors="pt")
                    pooled = mean_pool(encoder(**batch).last_hidden_state, batch["attention_mask"])
                    logits = head(torch.nn.functional.normalize(pooled, dim=-1) * SCALE)
                    loss = torch.nn.functional.cross_entropy(logits, y[idx], weight=weight)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    sched.step()
                    step += 1
                    running = 0.9 * running + 0.1 * loss.item() if step > 1 else loss.item()
                    now = time.monotonic()
                    if step % progress_every == 0 or step == steps or now - last_log >= progress_s:
                        last_log = now
                        log.info("judge: fine-tuning step %d/%d, loss %.3f, %.0f s, about %.0f s left", step, steps,
                                 running, now - t0, (now - t0) / step * (steps - step))
    finally:
        torch.set_num_threads(saved_threads)
    return encoder.eval()


def fine_tuned_encoder(embedder, texts: list[str], labels: list[int], cache_dir: str | os.PathLike | None, *,
                       epochs: float = 2.0, lr: float = 3e-5, seed: int = 0):
    """:func:`fine_tune`, cached on disk (module docstring): the encoder for these texts and
    labels, loaded from ``<cache_dir>/judge/finetuned-<key>.pt`` when it is there, else trained
    (about two minutes on two cores for 3,000 replies) and stored. A second process asking for
    the same key meanwhile waits for the first (a file lock) and loads its result. ``cache_dir``
    None or empty: always trained, never stored. A cache folder that cannot be written is no
    error: a stored model is still loaded, else the model is trained and kept in memory.

    Returns:
        :class:`FineTuned` (encoder, key, trained).

    Raises:
        ValueError: as :func:`fine_tune`.
    """
    import torch

    key = _model_key(embedder, texts, labels, epochs, lr, seed)

    def train() -> FineTuned:
        return FineTuned(fine_tune(embedder, texts, labels, epochs=epochs, lr=lr, seed=seed), key, True)

    def load(path: Path) -> FineTuned | None:
        if not path.is_file():
            return None
        try:
            encoder = copy.deepcopy(embedder.model)
            encoder.load_state_dict(torch.load(path, weights_only=True))
            return FineTuned(encoder.eval(), key, False)
        except Exception as e:  # a corrupt or foreign file is rebuilt
            log.warning("fine-tuned judge weights %s unreadable (%s): training again", path, e)
            return None

    if not cache_dir:
        return train()
    folder = Path(os.path.expanduser(str(cache_dir))) / "judge"
    path = folder / f"finetuned-{key}.pt"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = open(folder / f"finetuned-{key}.lock", "w")
    except OSError as e:
        log.warning("judge cache %s not writable (%s): using a stored model or training one in memory", folder, e)
        return load(path) or train()
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("judge: another process is fine-tuning model %s; waiting for it", key)
            fcntl.flock(lock, fcntl.LOCK_EX)
        done = load(path)
        if done is not None:
            return done
        for stale in folder.glob("finetuned-*.pt.tmp*"):  # left by a killed or failed writer
            stale.unlink(missing_ok=True)
        tuned = train()
        save_atomically(tuned.encoder.state_dict(), path)
        return tuned
