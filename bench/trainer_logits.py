"""A trainer step on long prompts with short replies (an agent's turns): the output layer at the
reply's positions only (:func:`pipeline.trainer.model.output_at`, what the trainer does) against
the baseline run beside it, the output layer at every position and the reply's rows picked
from the full ``[b, S, vocab]`` logits afterwards (what it did before).

Each round trains one batch with each path on the same samples (fresh optimizer state, same
initial weights), alternating which goes first; printed: the median seconds per step of each
path, their ratio, the largest difference of the two paths' loss, and the logits each path
materialises per sample (fp32 bytes).

    python bench/trainer_logits.py                            # tiny-random, 6,000-token prompts
    python bench/trainer_logits.py --model smollm2-135m --prompt 2000 --reply 32 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _samples(n: int, prompt: int, reply: int, vocab: int, seed: int):
    from pipeline import events

    rng = random.Random(seed)
    return [events.Sample(sample_id=f"bench:{i}", session_id=f"b{i}", turn_index=0,
                          tokens=[rng.randrange(1, vocab) for _ in range(prompt + reply)], response_length=reply,
                          rollout_log_probs=[-10.0] * reply, reward=(-1.0) ** i, policy_version=0)
            for i in range(n)]


def _full_logits_forward(self, model, mb, entropy: str = "none"):
    """The baseline: the output layer at every position, then the masked rows."""
    from pipeline.trainer.policy import token_log_probs

    mb = mb.to(self.par.device)
    return token_log_probs(model(mb.tokens, mb.position_ids, None), mb.targets, mb.temperatures, entropy,
                           mask=mb.mask)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--prompt", type=int, default=6000, help="prompt tokens per sample")
    ap.add_argument("--reply", type=int, default=16, help="reply tokens per sample")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    from pipeline.config import load_config
    from pipeline.models import resolve_model
    from pipeline.testing.trainer import megatron_runtime
    from pipeline.trainer import model as M
    from pipeline.trainer.policy import PolicyTrainer

    path = resolve_model(args.model)
    vocab = M.Arch.from_hf(path).vocab_size
    samples = _samples(args.batch, args.prompt, args.reply, vocab, seed=0)
    cfg = load_config(None, trainer={"model": args.model, "micro_batch_size": 1, "rollout_batch_size": args.batch,
                                     "lr": 1e-6}).trainer
    times: dict[str, list[float]] = {"selected": [], "full": []}
    losses: dict[str, list[float]] = {"selected": [], "full": []}
    with megatron_runtime(threads=args.threads) as par:
        original = PolicyTrainer._forward
        for r in range(args.rounds):
            for name in (("selected", "full") if r % 2 == 0 else ("full", "selected")):
                PolicyTrainer._forward = original if name == "selected" else _full_logits_forward
                try:
                    pt = PolicyTrainer(cfg, path, par)
                    t0 = time.perf_counter()
                    metrics = pt.train_batch(samples).metrics
                    times[name].append(time.perf_counter() - t0)
                    losses[name].append(float(metrics["loss"]))
                finally:
                    PolicyTrainer._forward = original
    sel, full = statistics.median(times["selected"]), statistics.median(times["full"])
    gap = max(abs(a - b) for a, b in zip(losses["selected"], losses["full"]))
    print(f"{args.model}: batch {args.batch} x ({args.prompt} prompt + {args.reply} reply tokens), "
          f"{args.rounds} rounds, {args.threads} threads")
    print(f"  step, output layer at the reply only: median {sel:.2f} s  {[round(t, 2) for t in times['selected']]}")
    print(f"  step, output layer everywhere (baseline): median {full:.2f} s  {[round(t, 2) for t in times['full']]}")
    print(f"  ratio baseline / selected: {full / sel:.2f}x; largest loss difference {gap:.2e}")
    print(f"  fp32 logits per sample: {args.reply * vocab * 4 / 2**20:.1f} MiB instead of "
          f"{(args.prompt + args.reply) * vocab * 4 / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
