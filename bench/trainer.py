"""Trainer step-time breakdown: consume+decode, forward/backward, optimizer, checkpoint, export, sync.

CPU (default): for each model, a real embedded broker, a real engine (its own process) with a
syncer, and the real trainer stage; samples of ``--seq`` tokens (half prompt, half response) are
produced to ``samples`` and the stage trains ``--steps`` batches. Printed per model: the median
seconds of each phase over the steps after the first, tokens per second, and as a baseline
measured in the same run, the forward+backward time of plain transformers on the same
micro-batches (the ratio shows Megatron's overhead on this machine).

    python bench/trainer.py                                   # tiny-random and smollm2-135m
    python bench/trainer.py --models smollm2-135m --batch 8 --micro 2 --seq 300 --steps 3

GPU check (``--gpu-check``, used by ``bench/gpu_check.sh``): no Kafka, no engine. Builds a
random-init Llama-shaped HF checkpoint with transformers (``--size``: 0.5b, 1b, 3b), trains it
with the GPU path (bf16, Transformer Engine spec when installed), prints the step time and MFU,
then the weight-sync time: export (TP gather + safetensors + sha256) and a reload of the
exported folder onto the GPU with transformers as a stand-in for SGLang's
``/update_weights_from_disk``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.args import trainer_workload  # noqa: E402  (this checkout's bench helpers)

PHASES = ("consume_s", "forward_backward_s", "optimizer_s", "checkpoint_s", "export_s", "sync_s", "step_s")


def _samples(n: int, seq: int, vocab: int, seed: int, version: int = 0):
    from pipeline import events

    rng = random.Random(seed)
    out = []
    for i in range(n):
        toks = [rng.randrange(1, vocab) for _ in range(seq)]
        r = seq // 2
        out.append(events.Sample(sample_id=f"bench{seed}:{i}", session_id=f"b{seed}-{i}", turn_index=0, tokens=toks,
                                 response_length=r, rollout_log_probs=[-10.0] * r, reward=(-1.0) ** i,
                                 policy_version=version))
    return out


def _hf_baseline(model_dir: Path, samples, micro: int, threads: int) -> float:
    """Seconds of one transformers forward+backward over the same micro-batches (fp32, CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.trainer import batch as B

    torch.set_num_threads(threads)
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    m.train()
    t0 = time.perf_counter()
    for mb in B.split(samples, micro):
        logits = m(input_ids=mb.tokens).logits.float()
        lp = torch.log_softmax(logits, -1).gather(-1, mb.targets[..., None])[..., 0]
        (-(lp * mb.mask).sum() / mb.mask.sum()).backward()
    dt = time.perf_counter() - t0
    del m
    return dt


def bench_cpu(args) -> None:
    from pipeline.broker import EmbeddedBroker
    from pipeline.bus import EventProducer
    from pipeline.config import load_config
    from pipeline.models import resolve_model
    from pipeline.syncer import Syncer
    from pipeline.bus.admin import apply_topics
    from pipeline.topics import load_topics
    from pipeline.trainer.stage import TrainerStage
    from pipeline.testing.engine import running_engine
    from pipeline.testing.trainer import megatron_runtime

    rows = []
    with EmbeddedBroker() as broker, tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        for k, name in enumerate(args.models.split(",")):
            work = Path(tmp) / name
            cfg = load_config(None, kafka={"bootstrap_servers": broker.bootstrap}, topics={"prefix": f"bench{k}-"},
                              trainer=dict(model=name, rollout_batch_size=args.batch, micro_batch_size=args.micro,
                                           max_steps=args.steps, lr=1e-5, checkpoint_dir=str(work / "ckpt"),
                                           export_dir=str(work / "weights"), engines=["engine-0"],
                                           progress=False, threads=args.threads, run_id=f"bench{k}"),
                              syncer=dict(engine_id="engine-0"))
            apply_topics(cfg, load_topics(cfg.topics.file))
            hf_dir = resolve_model(name)
            vocab = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
            samples = _samples(args.batch * args.steps, args.seq, vocab, seed=k)
            p = EventProducer(cfg, name="bench")
            for s in samples:
                p.send(cfg.topics.name("samples"), s, key=s.session_id)
            p.flush(30)
            p.close()
            with running_engine(name, subprocess=True, threads=1) as url:
                cfg = cfg.replace(syncer={"engine_url": url})
                syncer = Syncer(cfg)
                t = threading.Thread(target=syncer.run, daemon=True)
                t.start()
                try:
                    with megatron_runtime(tp=1, threads=args.threads):
                        stage = TrainerStage(cfg)
                        stage.run(install_signals=False)
                        load_s = stage.policy.load_seconds
                finally:
                    syncer.stop.set()
                    t.join(30)
            recs = stage.log.records()
            base = _hf_baseline(hf_dir, samples[:args.batch], args.micro, args.threads) if args.baseline else None
            rows.append((name, recs, load_s, base))
    print(f"\ntrainer step breakdown (CPU, {args.threads} threads; batch {args.batch} x {args.seq} tokens, "
          f"micro-batch {args.micro}; median of steps 2..{args.steps}, seconds)")
    head = f"{'model':<14}" + "".join(f"{p.replace('_s', ''):>18}" for p in PHASES) + f"{'train tok/s':>13}"
    print(head)
    for name, recs, load_s, base in rows:
        use = recs[1:] if len(recs) > 1 else recs
        def median(key):  # over the steps that measured it; None (printed n/a) when none did
            vals = [r[key] for r in use if r.get(key) is not None]
            return statistics.median(vals) if vals else None

        med = {p: median(p) for p in PHASES}
        tok = median("train_tokens_per_s")
        fmt = lambda v, spec, width: f"{'n/a':>{width}}" if v is None else f"{v:>{width}{spec}}"  # noqa: E731
        print(f"{name:<14}" + "".join(fmt(med[p], ".3f", 18) for p in PHASES) + fmt(tok, ".0f", 13))
        extra = f"  model load {load_s:.2f} s"
        if base and med["forward_backward_s"] is not None:
            extra += (f"; baseline transformers fwd+bwd of the same micro-batches {base:.3f} s -> "
                      f"Megatron/transformers = {med['forward_backward_s'] / base:.2f}")
        print(extra)
        print("  sync = pause -> weights -> syncer verifies sha256 -> engine /update_weights_from_disk -> applied -> resume")


# ------------------------------------------------------------------ GPU check

SIZES = {  # Llama-shaped configs (GQA, SwiGLU, tied embeddings), ~params; "tiny" checks the script on a CPU
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024),
    "0.5b": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                 num_key_value_heads=8, vocab_size=128256),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, vocab_size=128256),
}

PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12}


def make_random_llama(size: str, out: Path, device: str) -> Path:
    """A random-init Llama-shaped HF checkpoint (bf16) written with transformers; no download."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (out / "model.safetensors").exists() or (out / "model.safetensors.index.json").exists():
        return out
    cfg = LlamaConfig(**SIZES[size], max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=True,
                      rope_theta=500000.0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        m = LlamaForCausalLM(cfg).to(torch.bfloat16)
    m.save_pretrained(out, max_shard_size="20GB")
    return out


def bench_gpu(args) -> None:
    import torch

    from pipeline import events  # noqa: F401
    from pipeline.config import load_config
    from pipeline.trainer import dist
    from pipeline.trainer.model import have_transformer_engine
    from pipeline.trainer.policy import PolicyTrainer

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    print(f"device: {name}; transformer engine: {have_transformer_engine()}; torch {torch.__version__}", flush=True)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="gpu-check-"))
    t0 = time.perf_counter()
    hf_dir = make_random_llama(args.size, work / f"llama-{args.size}", device)
    print(f"random HF checkpoint {hf_dir} in {time.perf_counter() - t0:.1f} s", flush=True)
    cfg = load_config(None, trainer=dict(model=str(hf_dir), micro_batch_size=args.micro, lr=1e-6,
                                         dtype="bfloat16" if cuda else "float32")).trainer
    par = dist.init(1)
    t0 = time.perf_counter()
    pt = PolicyTrainer(cfg, hf_dir, par)
    n_params = sum(p.numel() for p in pt.model.parameters())
    print(f"Megatron GPTModel: {n_params / 1e9:.2f} B params, built + loaded in {time.perf_counter() - t0:.1f} s",
          flush=True)
    a = pt.arch
    samples = _samples(args.batch, args.seq, a.vocab_size, seed=0)
    times = []
    for step in range(args.steps):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        res = pt.train_batch(samples)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        print(f"step {step}: {times[-1]:.3f} s  loss {res.metrics['loss']:.4f}  grad_norm {res.metrics['grad_norm']:.3f}",
              flush=True)
    step_s = statistics.median(times[2:] if len(times) > 3 else times[1:] or times)  # skip warm-up steps
    tokens = args.batch * (args.seq - 1)
    # training FLOPs per token: 6 * matmul params (incl. the output head) + attention 12 * L * h * s
    # (causal attention does about half of that; the usual MFU convention counts all of it)
    matmul_params = n_params + (0 if a.tie_embeddings else -a.vocab_size * a.hidden_size)
    flops = tokens * (6 * matmul_params + 12 * a.num_layers * a.hidden_size * args.seq)
    peak = next((v for k, v in PEAK_BF16.items() if k in name), float(os.environ.get("PEAK_FLOPS", 989e12)))
    print(f"\nMEGATRON STEP: {step_s:.3f} s for {args.batch} x {args.seq} tokens "
          f"({tokens / step_s:,.0f} tokens/s), {flops / step_s / 1e12:.1f} TFLOP/s, "
          f"MFU {100 * flops / step_s / peak:.1f} % of {peak / 1e12:.0f} TFLOP/s bf16 dense", flush=True)
    out = work / "export-v000001"
    t = time.perf_counter()
    exported = pt.export(out)
    export_s = time.perf_counter() - t
    print(f"export: {exported.bytes / 1e9:.2f} GB in {export_s:.2f} s (gather + safetensors + sha256 "
          f"{exported.sha256[:12]}...)", flush=True)
    from transformers import AutoModelForCausalLM

    from pipeline.weightsync import verify_folder

    t = time.perf_counter()
    verify_folder(out, exported.sha256)
    verify_s = time.perf_counter() - t
    t = time.perf_counter()
    m = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16, device_map=device)
    if cuda:
        torch.cuda.synchronize()
    reload_s = time.perf_counter() - t
    del m
    print(f"WEIGHT SYNC: {export_s + verify_s + reload_s:.2f} s = export {export_s:.2f} + syncer sha256 check "
          f"{verify_s:.2f} + reload onto {device} {reload_s:.2f} (transformers as the engine stand-in)", flush=True)
    dist.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    trainer_workload(p, seq=300, threads=2)
    p.add_argument("--no-baseline", dest="baseline", action="store_false")
    p.add_argument("--gpu-check", action="store_true", help="GPU path check (see the module docstring)")
    p.add_argument("--size", default="1b", choices=sorted(SIZES))
    p.add_argument("--workdir", help="GPU check: where the random checkpoint and export go")
    args = p.parse_args()
    import warnings

    warnings.filterwarnings("ignore")
    if args.gpu_check:
        bench_gpu(args)
    else:
        bench_cpu(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
