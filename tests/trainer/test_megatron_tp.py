"""Tensor and data parallelism on the CPU: ``torchrun --nproc-per-node 2`` with the tiny model.

The test launches this same file under torchrun; the ``__main__`` block is the worker. Each rank
holds half of every split weight; the gathered vocab-parallel logits must equal transformers'
and the TP=2 export must reproduce the source checkpoint bit for bit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


@pytest.mark.slow(seconds=25)
def test_tp2_tiny_matches_transformers_and_exports(tmp_path):
    from pipeline.models import resolve_model
    from tests.trainer.torchrun import torchrun_two  # here: this file is also the ranks' script

    path = resolve_model("tiny-random")
    r = torchrun_two([__file__, str(path), str(tmp_path)], timeout_s=240)
    assert "RANK0 OK" in r.stdout and "RANK1 OK" in r.stdout, r.stdout[-2000:]
    # the same training step in one process (TP=1) gives the same weights as TP=2
    import torch
    from safetensors.torch import load_file

    from pipeline.config import load_config
    from pipeline.trainer.policy import PolicyTrainer
    from pipeline.testing.trainer import megatron_runtime

    with megatron_runtime(tp=1, threads=1) as par:
        pt = PolicyTrainer(load_config(None, trainer=_TRAIN).trainer, path, par)
        res = pt.train_batch(_samples())
        pt.export(tmp_path / "tp1-step")
    a, b = load_file(tmp_path / "tp1-step" / "model.safetensors"), load_file(tmp_path / "tp2-step" / "model.safetensors")
    src = load_file(path / "model.safetensors")
    assert set(a) == set(b)
    # Adam's first step moves every weight by about lr = 1e-3 whatever the gradient's size, so
    # float-rounding differences of near-zero gradients show up at ~1e-5: allow 5 % of a step
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 5e-5
    assert sum((a[k] - b[k]).abs().sum().item() for k in a) / sum(a[k].numel() for k in a) < 1e-7
    assert max((a[k] - src[k]).abs().max().item() for k in a) > 1e-4  # the step did move the weights
    assert f"LOSS {res.metrics['loss']:.6f}" in r.stdout
    d = load_file(tmp_path / "dp2-step" / "model.safetensors")
    assert max((a[k] - d[k]).abs().max().item() for k in a) < 5e-5
    assert f"DP LOSS {res.metrics['loss']:.6f}" in r.stdout


def test_trainer_stage_under_torchrun_tp2(kafka_config, tmp_path):
    """``torchrun -m pipeline trainer --tp 2``: rank 0 consumes and broadcasts, both ranks train,
    each writes its checkpoint shard, the export gathers both halves."""
    import json

    from pipeline.bus import EventProducer
    from pipeline.weightsync import verify_folder
    from tests.trainer.torchrun import torchrun_two

    p = EventProducer(kafka_config, name="test")
    for s in _samples():
        p.send(kafka_config.topics.name("samples"), s, key=s.session_id)
    p.flush(10)
    p.close()
    torchrun_two(["-m", "pipeline", "trainer", "--tp", "2", "--model", "tiny-random",
                  "--batch-size", "3", "--max-steps", "1", "--engines", "", "--threads", "1", "--no-progress",
                  "--checkpoint-dir", str(tmp_path / "ckpt"), "--export-dir", str(tmp_path / "weights"),
                  "--bootstrap", kafka_config.kafka.bootstrap_servers,
                  "--set", f"topics.prefix={kafka_config.topics.prefix}", "--log-level", "WARNING"], timeout_s=240)
    rec = json.loads((tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()[-1])
    assert rec["step"] == 1 and rec["train_samples"] == 3 and sorted(rec["sample_ids"]) == ["tp:0", "tp:1", "tp:2"]
    assert sorted(f.name for f in (tmp_path / "ckpt" / "step_00000001").iterdir()) == ["meta.json", "tp00.pt", "tp01.pt"]
    verify_folder(tmp_path / "weights" / "v000001")


_TRAIN = {"model": "tiny-random", "lr": 1e-3, "micro_batch_size": 2, "entropy_coef": 0.01}


def _samples():
    from pipeline import events

    out = []
    for i in range(3):
        toks = [(i * 31 + j * 7) % 4000 + 5 for j in range(12)]
        out.append(events.Sample(sample_id=f"tp:{i}", session_id=f"tp{i}", turn_index=0, tokens=toks,
                                 response_length=5, rollout_log_probs=[-9.0] * 5, reward=(-1.0) ** i))
    return out


def _worker(hf_dir: str, out_dir: str) -> None:
    import torch
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from pipeline import weightsync
    from pipeline.trainer import dist, model as M

    torch.set_num_threads(1)
    par = dist.init(tp=2)
    assert par.tp == 2 and par.world == 2
    arch = M.Arch.from_hf(hf_dir)
    model = M.build_model(arch, tp=2)
    M.load_hf_weights(model, hf_dir, arch)
    emb = dict(model.named_parameters())["embedding.word_embeddings.weight"]
    assert emb.shape[0] == arch.vocab_size // 2
    ids = torch.randint(0, arch.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(32).unsqueeze(0).expand_as(ids)
    model.eval()
    with torch.no_grad():
        local = model(ids, pos, None)
        full = gather_from_tensor_model_parallel_region(local)
    assert local.shape[-1] == arch.vocab_size // 2 and full.shape[-1] == arch.vocab_size
    out = M.export_hf(model, arch, hf_dir, Path(out_dir) / "tp2")
    if par.rank == 0:
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            ref = hf(input_ids=ids).logits
        err = (full - ref).abs().max().item()
        assert err < 1e-5, err
        src, dst = load_file(Path(hf_dir) / weightsync.WEIGHTS_FILE), load_file(out.path / weightsync.WEIGHTS_FILE)
        assert set(src) == set(dst) and all(torch.equal(src[k], dst[k]) for k in src)
    else:
        assert out is None
    # one training step with TP=2 (vocab-parallel log-probs and entropy, Megatron optimizer)
    from pipeline.config import load_config
    from pipeline.trainer.policy import PolicyTrainer

    pt = PolicyTrainer(load_config(None, trainer=_TRAIN).trainer, hf_dir, par)
    res = pt.train_batch(_samples())
    pt.export(Path(out_dir) / "tp2-step")
    if par.rank == 0:
        print(f"LOSS {res.metrics['loss']:.6f}", flush=True)
    # the same step data-parallel (TP=1, DP=2): each rank trains on half the samples
    par = dist.init(tp=1)
    assert par.dp == 2 and par.tp == 1
    pt = PolicyTrainer(load_config(None, trainer=_TRAIN).trainer, hf_dir, par)
    res = pt.train_batch(_samples())
    pt.export(Path(out_dir) / "dp2-step")
    if par.rank == 0:
        print(f"DP LOSS {res.metrics['loss']:.6f}", flush=True)
    print(f"RANK{par.rank} OK", flush=True)
    dist.shutdown()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
