"""Data parallelism (DP=2, ``torchrun --nproc-per-node 2``) on batches that split unevenly.

The trainable samples of a batch are dealt round-robin over the DP ranks, so a small batch can
leave a rank with nothing (one trainable sample and two masked ones), and a non-finite sample
can land on one rank only. Every such batch must finish on both ranks (no rank waiting in a
collective the other never enters) and give the single-process result. The test launches this
file under torchrun; the ``__main__`` block is the worker.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# two optimizer steps per batch and recomputed behaviour log-probs: more collectives per batch
_TRAIN = {"model": "tiny-random", "lr": 1e-3, "micro_batch_size": 2, "steps_per_batch": 2,
          "old_log_probs": "recompute", "entropy_coef": 0.01}


def _sample(i, reward=1.0, loss_mask=1, **kw):
    from pipeline import events

    toks = [(i * 37 + j * 11) % 4000 + 5 for j in range(10 + i % 3)]
    return events.Sample(sample_id=f"dp:{i}", session_id=f"dp{i}", turn_index=0, tokens=toks, response_length=4,
                         rollout_log_probs=[-3.0] * 4, reward=reward, loss_mask=loss_mask, **kw)


def _batches():
    """The batches, in order, and what each must do (``True``: a step is taken)."""
    nan = float("nan")
    return [
        # one trainable sample, two masked: rank 1 gets no sample at all
        ([_sample(0, 1.0), _sample(1, loss_mask=0), _sample(2, loss_mask=0)], True),
        # the non-finite sample lands on rank 1 only: both ranks must skip together
        ([_sample(3, 1.0), _sample(4, reward=nan)], False),
        # nothing trainable anywhere
        ([_sample(5, loss_mask=0), _sample(6, loss_mask=0)], False),
        # three trainable samples: 2 on rank 0, 1 on rank 1
        ([_sample(7, 1.0), _sample(8, -1.0), _sample(9, 1.0)], True),
        # one trainable sample after a masked one
        ([_sample(10, loss_mask=0), _sample(11, -1.0)], True),
    ]


def _run(pt, out_dir: Path, tag: str) -> list[str]:
    lines = []
    for i, (batch, trains) in enumerate(_batches()):
        res = pt.train_batch(batch)
        assert res.skipped == (not trains), (i, res)
        lines.append(f"{tag} {i} skipped={res.skipped} loss={res.metrics.get('loss', 0.0):.6f} "
                     f"samples={res.metrics['train_samples']:.0f}")
    pt.export(out_dir)
    return lines


@pytest.mark.slow(seconds=21)
def test_dp2_uneven_batches_complete_and_match_single_process(tmp_path):
    from safetensors.torch import load_file

    from pipeline.config import load_config
    from pipeline.models import resolve_model
    from tests.trainer.torchrun import torchrun_two  # here: this file is also the ranks' script
    from pipeline.trainer.policy import PolicyTrainer
    from pipeline.testing.trainer import megatron_runtime

    path = resolve_model("tiny-random")
    r = torchrun_two([__file__, str(path), str(tmp_path / "dp2")], timeout_s=200)
    assert "RANK0 OK" in r.stdout and "RANK1 OK" in r.stdout, r.stdout[-2000:]
    with megatron_runtime(tp=1, threads=1) as par:
        pt = PolicyTrainer(load_config(None, trainer=_TRAIN).trainer, path, par)
        lines = _run(pt, tmp_path / "dp1", "STEP")
    for line in lines:  # same decisions, same losses (the loss is a global mean)
        assert line in r.stdout, (line, r.stdout[-2000:])
    a, b = load_file(tmp_path / "dp1" / "model.safetensors"), load_file(tmp_path / "dp2" / "model.safetensors")
    src = load_file(path / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 5e-5
    assert max((a[k] - src[k]).abs().max().item() for k in a) > 1e-4  # the steps did move the weights


def _worker(hf_dir: str, out_dir: str) -> None:
    import torch

    from pipeline.config import load_config
    from pipeline.trainer import dist
    from pipeline.trainer.policy import PolicyTrainer

    torch.set_num_threads(1)
    par = dist.init(tp=1)
    assert par.dp == 2
    pt = PolicyTrainer(load_config(None, trainer=_TRAIN).trainer, hf_dir, par)
    lines = _run(pt, Path(out_dir), "STEP")
    if par.rank == 0:
        print("\n".join(lines), flush=True)
    print(f"RANK{par.rank} OK", flush=True)
    dist.shutdown()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
