"""Fine-tuning the embedding judge's MiniLM on labelled replies (``pipeline/judge/cpu/finetune.py``).

Real MiniLM, real torch training, on a small slice of the shipped labelled replies (a few
seconds). Checks that training moves stance into the embedding (replies of one label closer
to each other than to the other label's, more than before), that it is reproducible and leaves
the caller's random state and thread count alone, that the on-disk cache returns the same
weights without training again, keys on everything that shapes the model, trains once for two
callers and survives an unwritable folder, and that bad input raises.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pipeline.judge.cpu.classifier import LABELLED_SETS, Embedder, NextStateClassifier, labelled_replies
from pipeline.judge.cpu.finetune import FineTuned, _model_key, fine_tune, fine_tuned_encoder


@pytest.fixture(scope="module")
def embedder():
    return Embedder()


@pytest.fixture(scope="module")
def replies():
    """48 labelled replies, +1 and -1 only, balanced, from the shipped sets."""
    rows = [r for r in labelled_replies(LABELLED_SETS[2:]) if r["label"] != 0]
    pos = [r for r in rows if r["label"] == 1][:24]
    neg = [r for r in rows if r["label"] == -1][:24]
    picked = pos + neg
    return [r["text"] for r in picked], [r["label"] for r in picked]


def _separation(embedder, texts, labels) -> float:
    """Mean cosine similarity within a label minus across labels (higher: labels apart)."""
    e = embedder.encode(texts)
    sim = e @ e.T
    y = torch.tensor(labels)
    same = (y[:, None] == y[None, :]) & ~torch.eye(len(labels), dtype=torch.bool)
    diff = y[:, None] != y[None, :]
    return float(sim[same].mean() - sim[diff].mean())


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.slow(seconds=20)
def test_fine_tuning_pulls_the_labels_apart(embedder, replies):
    texts, labels = replies
    before = _separation(embedder, texts, labels)
    tuned = fine_tune(embedder, texts, labels, epochs=4, lr=5e-5)
    after = _separation(embedder.with_model(tuned, "t"), texts, labels)
    print(f"separation {before:.4f} -> {after:.4f}")
    assert after > before + 0.015, (before, after)
    # the frozen encoder is untouched
    assert _separation(embedder, texts, labels) == pytest.approx(before, abs=1e-6)


def test_fine_tuning_is_reproducible_and_keeps_the_callers_rng(embedder, replies):
    texts, labels = replies
    torch.manual_seed(1234)
    random.seed(99)
    want_torch, want_py = torch.rand(3), random.random()
    torch.manual_seed(1234)
    random.seed(99)
    threads = torch.get_num_threads()
    a = _state(fine_tune(embedder, texts[:16], labels[:16], epochs=1, seed=7))
    assert torch.equal(torch.rand(3), want_torch) and random.random() == want_py
    assert torch.get_num_threads() == threads
    b = _state(fine_tune(embedder, texts[:16], labels[:16], epochs=1, seed=7))
    c = _state(fine_tune(embedder, texts[:16], labels[:16], epochs=1, seed=8))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_the_cache_returns_the_same_weights_and_keys_on_the_labels(embedder, replies, tmp_path):
    texts, labels = replies[0][:16], replies[1][:16]
    first = fine_tuned_encoder(embedder, texts, labels, tmp_path, epochs=1)
    assert isinstance(first, FineTuned) and first.trained
    again = fine_tuned_encoder(embedder, texts, labels, tmp_path, epochs=1)
    assert not again.trained and again.key == first.key
    sa, sb = _state(first.encoder), _state(again.encoder)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    flipped = fine_tuned_encoder(embedder, texts, [-x for x in labels], tmp_path, epochs=1)
    assert flipped.trained and flipped.key != first.key
    keys = {_model_key(embedder, texts, labels, 1, 3e-5, 0), _model_key(embedder, texts, labels, 2, 3e-5, 0),
            _model_key(embedder, texts, labels, 1, 5e-5, 0), _model_key(embedder, texts, labels, 1, 3e-5, 1),
            _model_key(embedder.with_model(first.encoder, "other weights"), texts, labels, 1, 3e-5, 0),
            _model_key(embedder, texts[:-1], labels[:-1], 1, 3e-5, 0)}
    assert first.key in keys and len(keys) == 6
    # a corrupt cache file is trained again, not trusted
    (tmp_path / "judge" / f"finetuned-{first.key}.pt").write_bytes(b"not a model")
    assert fine_tuned_encoder(embedder, texts, labels, tmp_path, epochs=1).trained
    assert not list((tmp_path / "judge").glob("*.tmp*"))


def test_two_processes_train_a_model_once(embedder, replies, tmp_path):
    """The second caller waits on the file lock and loads the first one's result."""
    texts, labels = replies[0][:16], replies[1][:16]
    with ThreadPoolExecutor(2) as pool:  # two open() calls: flock treats them like two processes
        got = list(pool.map(lambda _: fine_tuned_encoder(embedder, texts, labels, tmp_path, epochs=1), range(2)))
    assert sorted(g.trained for g in got) == [False, True]


def test_an_unwritable_cache_is_no_error(embedder, replies, tmp_path):
    texts, labels = replies[0][:16], replies[1][:16]
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache folder would be")
    tuned = fine_tuned_encoder(embedder, texts, labels, blocked, epochs=1)
    assert tuned.trained and tuned.encoder is not None
    assert fine_tuned_encoder(embedder, texts, labels, "", epochs=1).trained  # empty: no cache


@pytest.mark.parametrize("texts,labels,epochs", [([], [], 1), (["a"], [1, 0], 1), (["a"], [2], 1), (["a"], [1], 0)],
                         ids=["empty", "lengths", "label", "epochs"])
def test_bad_input_raises(embedder, texts, labels, epochs):
    with pytest.raises(ValueError):
        fine_tune(embedder, texts, labels, epochs=epochs)


@pytest.mark.slow(seconds=22)
def test_the_classifier_embeds_user_replies_with_the_tuned_copy_only(embedder, replies, tmp_path):
    texts, labels = replies
    examples = [{"text": t, "label": lab, "role": "user"} for t, lab in zip(texts, labels)]
    examples += [{"text": "exit status 0", "label": 1, "role": "tool"},
                 {"text": "Traceback (most recent call last)", "label": -1, "role": "tool"}]
    frozen = NextStateClassifier(embedder, examples=examples, cache_dir=tmp_path, finetune_epochs=0)
    assert frozen.encoders["user"] is embedder and frozen.encoders["tool"] is embedder
    tuned = NextStateClassifier(embedder, examples=examples, cache_dir=tmp_path, finetune_epochs=1)
    assert tuned.encoders["tool"] is embedder and tuned.encoders["user"] is not embedder
    assert tuned.encoders["user"].fingerprint() != embedder.fingerprint()
    reply = "Great, now nothing compiles at all."
    assert tuned.proba(reply, "user") != frozen.proba(reply, "user")
    assert tuned.proba("exit status 0", "tool") == frozen.proba("exit status 0", "tool")
