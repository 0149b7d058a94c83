"""LoRA under tensor and data parallelism: ``torchrun --nproc-per-node 2`` on the CPU (gloo).

The same adapter (same full A and B), batch and rollout log-probs give, at TP=2 and at DP=2, the
loss and the A/B gradients of one process (TP=1, itself checked against the LoRA definition in
``tests/trainer/test_trainer_lora.py``), and the TP=2 export gathers the shards back into the full
tensors bit for bit. The test launches this file under torchrun; the ``__main__`` block is the
worker.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

_TRAIN = {"model": "tiny-random", "lr": 1e-3, "micro_batch_size": 2, "clip_grad": 0.0,
          "lora": {"rank": 4, "alpha": 12}}


def _samples(rollouts: dict[str, list[float]] | None = None):
    from pipeline import events

    out = []
    for i in range(3):
        toks = [(i * 31 + j * 7) % 4000 + 5 for j in range(10 + i)]
        sid = f"ltp:{i}"
        out.append(events.Sample(sample_id=sid, session_id=f"ltp{i}", turn_index=0, tokens=toks, response_length=4,
                                 rollout_log_probs=(rollouts or {}).get(sid, [-10.0] * 4), reward=(-1.0) ** i))
    return out


def _step(par, out_dir: Path, tag: str, rollouts) -> None:
    """Load the test adapter, export it, train one batch, export again; rank 0 saves loss and gradients."""
    import torch

    from pipeline.config import load_config
    from pipeline.models import resolve_model
    from pipeline.testing.trainer import random_adapter
    from pipeline.trainer.policy import PolicyTrainer

    pt = PolicyTrainer(load_config(None, trainer=_TRAIN).trainer, resolve_model("tiny-random"), par)
    random_adapter(pt, "t1", seed=7)
    pt.export_adapter("t1", out_dir / f"{tag}-init")
    res = pt.train_batch(_samples(rollouts), adapter="t1")
    grads = pt.lora.hf_tensors("t1", grads=True)
    pt.export_adapter("t1", out_dir / f"{tag}-step")
    if par.rank == 0:
        torch.save({"loss": res.metrics["loss"], "grads": grads}, out_dir / f"{tag}.pt")


@pytest.mark.slow(seconds=40)
def test_lora_tp2_and_dp2_reproduce_one_process(tmp_path):
    import torch
    from safetensors.torch import load_file

    from pipeline.testing.trainer import megatron_runtime
    from pipeline.weightsync import ADAPTER_FILE
    from tests.trainer.test_trainer_lora import _rel_norm
    from tests.trainer.torchrun import torchrun_two

    # one process first: its rollout log-probs (near the adapter's own) go to every worker
    with megatron_runtime(tp=1, threads=1) as par:
        from pipeline.config import load_config
        from pipeline.models import resolve_model
        from pipeline.testing.trainer import random_adapter
        from pipeline.trainer.policy import PolicyTrainer

        pt = PolicyTrainer(load_config(None, trainer=_TRAIN).trainer, resolve_model("tiny-random"), par)
        full = random_adapter(pt, "t1", seed=7)
        lps = pt.log_probs(_samples(), adapter="t1")
    rollouts = {s.sample_id: [min(0.0, x + 0.05 * (-1) ** j) for j, x in enumerate(lp)] for s, lp in zip(_samples(), lps)}
    (tmp_path / "rollouts.json").write_text(json.dumps(rollouts))
    with megatron_runtime(tp=1, threads=1) as par:
        _step(par, tmp_path, "tp1", rollouts)

    torchrun_two([__file__, str(tmp_path)], timeout_s=300)

    one = torch.load(tmp_path / "tp1.pt")
    assert min(float(g.abs().max()) for g in one["grads"].values()) > 0  # every A and B has a gradient
    for tag in ("tp2", "dp2"):
        got = torch.load(tmp_path / f"{tag}.pt")
        assert abs(got["loss"] - one["loss"]) <= 1e-5 * abs(one["loss"]), (tag, got["loss"], one["loss"])
        assert got["grads"].keys() == one["grads"].keys()
        assert _rel_norm(got["grads"], one["grads"]) <= 1e-5, (tag, _rel_norm(got["grads"], one["grads"]))
        # the exports: the untrained adapter exactly; after one Adam step (which moves every entry by
        # about lr whatever its gradient's size) within 5 % of a step
        init = load_file(tmp_path / f"{tag}-init" / ADAPTER_FILE)
        assert init.keys() == full.keys() and all(torch.equal(init[k], full[k]) for k in full), tag
        a, b = load_file(tmp_path / "tp1-step" / ADAPTER_FILE), load_file(tmp_path / f"{tag}-step" / ADAPTER_FILE)
        assert max(float((a[k] - b[k]).abs().max()) for k in a) < 5e-5, tag
        assert max(float((a[k] - full[k]).abs().max()) for k in a) > 5e-4  # the step moved the adapter


def _worker(out_dir: str) -> None:
    import torch

    from pipeline.trainer import dist

    torch.set_num_threads(1)
    out = Path(out_dir)
    rollouts = json.loads((out / "rollouts.json").read_text())
    par = dist.init(tp=2)
    assert par.tp == 2 and par.dp == 1
    _step(par, out, "tp2", rollouts)
    par = dist.init(tp=1)
    assert par.tp == 1 and par.dp == 2
    _step(par, out, "dp2", rollouts)
    print(f"RANK{par.rank} OK", flush=True)
    dist.shutdown()


if __name__ == "__main__":
    _worker(sys.argv[1])
