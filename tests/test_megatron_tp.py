"""Tensor parallelism on the CPU: ``torchrun --nproc-per-node 2`` with the tiny model.

The test launches this same file under torchrun; the ``__main__`` block is the worker. Each rank
holds half of every split weight; the gathered vocab-parallel logits must equal transformers'
and the TP=2 export must reproduce the source checkpoint bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_tp2_tiny_matches_transformers_and_exports(tmp_path):
    from pipeline.models import resolve_model
    from pipeline.trainer.dist import free_port

    path = resolve_model("tiny-random")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           __file__, str(path), str(tmp_path)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "RANK0 OK" in r.stdout and "RANK1 OK" in r.stdout, r.stdout[-2000:]


def _worker(hf_dir: str, out_dir: str) -> None:
    import torch
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

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
        src, dst = load_file(Path(hf_dir) / M.WEIGHTS_FILE), load_file(out.path / M.WEIGHTS_FILE)
        assert set(src) == set(dst) and all(torch.equal(src[k], dst[k]) for k in src)
    else:
        assert out is None
    print(f"RANK{par.rank} OK", flush=True)
    dist.shutdown()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
