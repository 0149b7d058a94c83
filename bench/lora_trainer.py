"""Trainer step time, memory and bytes per update: LoRA adapter vs full fine-tuning, same batch.

For each model, each mode runs in its own process (so peak memory is that mode's): the real
:class:`pipeline.trainer.policy.PolicyTrainer` is built (full fine-tuning, or ``trainer.lora`` with
rank 16 / alpha 32 on q/k/v/o/gate/up/down, OpenClaw-RL's LoRA settings), trains ``--steps``
batches of the same ``--batch`` samples of ``--seq`` tokens (half prompt, half response), then
exports what an update publishes: the whole model as an HF folder, or the adapter alone as a PEFT
folder. Printed per model and mode: median step seconds (steps after the first), peak resident
memory of the process and its growth during training, the bytes of trained state (trainable
parameters + their gradient buffer + optimizer state), bytes on disk of one update and its export
seconds; then the full / LoRA ratios. Step time is given as wall seconds and as the process's CPU
seconds (``time.process_time``, all threads), with the 1-minute load average: on a shared machine
the wall time mostly measures the neighbours, the CPU seconds much less so.

    python bench/lora_trainer.py                              # tiny-random and smollm2-135m
    python bench/lora_trainer.py --models smollm2-135m --batch 8 --seq 512 --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.args import trainer_workload  # noqa: E402  (this checkout's bench helpers)

LORA = {"rank": 16, "alpha": 32}  # targets: every attention and MLP projection (the default)


def _samples(n: int, seq: int, vocab: int):
    from pipeline import events

    rng = random.Random(0)
    out = []
    for i in range(n):
        toks = [rng.randrange(1, vocab) for _ in range(seq)]
        r = seq // 2
        out.append(events.Sample(sample_id=f"lb:{i}", session_id=f"lb{i}", turn_index=0, tokens=toks,
                                 response_length=r, rollout_log_probs=[-10.0] * r, reward=(-1.0) ** i))
    return out


def _rss_mb() -> float:
    """Current resident set size (MiB), from /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _state_bytes(pt) -> int:
    """Bytes of what training keeps for the trained parameters: the parameters themselves, Megatron
    DDP's gradient buffers and the optimizer state (Adam moments, fp32 master copies)."""
    import torch

    total = 0
    for unit in pt.trainables.values():
        total += sum(p.numel() * p.element_size() for p in unit.ddp.module.parameters() if p.requires_grad)
        total += sum(b.grad_data.numel() * b.grad_data.element_size() for b in unit.ddp.buffers)
        for opt in getattr(unit.optimizer, "chained_optimizers", [unit.optimizer]):
            for st in opt.optimizer.state.values():
                total += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
    return total


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def child(args) -> dict:
    """One model in one mode (this process): build, train, export; returns the measurements."""
    import torch

    from pipeline.config import load_config
    from pipeline.models import resolve_model
    from pipeline.testing.trainer import megatron_runtime
    from pipeline.trainer.policy import PolicyTrainer

    lora = args.mode == "lora"
    path = resolve_model(args.model)
    settings = {"model": args.model, "lr": 1e-5, "micro_batch_size": args.micro, **({"lora": LORA} if lora else {})}
    cfg = load_config(None, trainer=settings).trainer
    with megatron_runtime(tp=1, threads=args.threads) as par:
        pt = PolicyTrainer(cfg, path, par)
        samples = _samples(args.batch, args.seq, pt.arch.vocab_size)
        rss0 = _rss_mb()
        times, cpu = [], []
        for _ in range(args.steps):
            t0, c0 = time.perf_counter(), time.process_time()
            res = pt.train_batch(samples, adapter="bench" if lora else None)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            assert not res.skipped
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        with tempfile.TemporaryDirectory() as tmp:
            out = pt.export_adapter("bench", Path(tmp) / "u") if lora else pt.export(Path(tmp) / "u")
            disk = _folder_bytes(out.path)
        trained = sum(p.numel() for u in pt.trainables.values() for p in u.ddp.module.parameters() if p.requires_grad)
        return {"model": args.model, "mode": args.mode, "step_s": statistics.median(times[1:] or times),
                "step_cpu_s": statistics.median(cpu[1:] or cpu), "first_step_s": times[0],
                "load_avg": os.getloadavg()[0], "peak_rss_mb": peak, "train_rss_growth_mb": peak - rss0,
                "state_bytes": _state_bytes(pt), "trained_params": trained,
                "update_bytes": disk, "update_tensor_bytes": out.bytes, "export_s": out.seconds,
                "threads": torch.get_num_threads()}


def _run_child(args, model: str, mode: str) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--models", model, "--batch", str(args.batch),
           "--micro", str(args.micro), "--seq", str(args.seq), "--steps", str(args.steps),
           "--threads", str(args.threads)]
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT))
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if r.returncode != 0:
        raise SystemExit(f"{model} {mode} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _report(rows: list[dict]) -> None:
    print(f"{'model':14} {'mode':5} {'step s':>8} {'CPU s':>7} {'load':>5} {'peak RSS MiB':>13} {'train +MiB':>11} {'state MiB':>10} "
          f"{'trained params':>15} {'update bytes':>13} {'export s':>9}")
    for r in rows:
        print(f"{r['model']:14} {r['mode']:5} {r['step_s']:8.3f} {r['step_cpu_s']:7.2f} {r['load_avg']:5.1f} {r['peak_rss_mb']:13.0f} {r['train_rss_growth_mb']:11.0f} "
              f"{r['state_bytes'] / 2**20:10.1f} {r['trained_params']:15,d} {r['update_bytes']:13,d} {r['export_s']:9.3f}")
    for model in dict.fromkeys(r["model"] for r in rows):
        full, lora = (next(r for r in rows if r["model"] == model and r["mode"] == m) for m in ("full", "lora"))
        print(f"{model}: full / LoRA  step time {full['step_s'] / lora['step_s']:.2f}x "
              f"(CPU seconds {full['step_cpu_s'] / lora['step_cpu_s']:.2f}x), "
              f"peak RSS {full['peak_rss_mb'] / lora['peak_rss_mb']:.2f}x, "
              f"trained state {full['state_bytes'] / lora['state_bytes']:.1f}x, "
              f"bytes on disk per update {full['update_bytes'] / lora['update_bytes']:.1f}x, "
              f"export time {full['export_s'] / lora['export_s']:.1f}x")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    trainer_workload(p, seq=256, threads=1, threads_help="torch threads per process (1: on a shared CPU, two "
                     "threads' barrier spinning inflated LoRA's many small matmuls 3-4x in CPU seconds)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per model and mode")
    p.add_argument("--child", choices=["full", "lora"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.mode, args.model = args.child, args.models
        print(json.dumps(child(args)), flush=True)
        return 0
    print(f"# batch {args.batch} x {args.seq} tokens, micro-batch {args.micro}, {args.steps} steps, "
          f"{args.threads} threads, LoRA rank {LORA['rank']} alpha {LORA['alpha']} on q/k/v/o/gate/up/down")
    rows = [_run_child(args, m, mode) for m in args.models.split(",") for mode in ("full", "lora")]
    _report(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
