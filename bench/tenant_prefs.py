"""Can one LoRA adapter per tenant learn its user's preference in a few CPU steps? (issue 28, item 6)

Offline, with the real pieces and no broker: the CPU engine with LoRA on (``--enable-lora``)
samples and serves, :class:`pipeline.trainer.policy.PolicyTrainer` with ``trainer.lora`` trains
one adapter per preference. Two simulated users (``pipeline.simulate.feedback`` policies):

- ``brevity``: the reply finishes within 64 tokens and has at most 40 words
  (``Grade.brief``); corrective message "Too long — answer in at most 40 words.";
- ``steps``: the working is laid out one step per line, at least 4 lines holding a word
  (``Grade.stepwise``); corrective messages "Please put each step of the working on its own
  line." and two variants.

For each tenant, ``--steps`` times: ``--prompts`` GSM8K training prompts x ``--samples`` replies
from the tenant's current adapter (the base before its first step), each graded by the tenant's
user; reward +1 (the property) or -1 (Binary RL, advantage = reward minus the batch mean), and for
a -1 the user's corrective message is the OPD hint: the frozen base scores the same response
ids with the hint appended to the prompt (``pipeline.judge.prompts.inject_hint``), as the judge's
``combine`` mode does. One ``train_batch(adapter=tenant)``, export, load into the engine under a
new name, then a held-out evaluation through that adapter: the 32 held-out GSM8K prompts x
``--eval-samples`` replies with fixed per-reply seeds (the same for every adapter version),
each reply graded for BOTH properties. The base is evaluated the same way first.

Printed and written (``--out``, JSON lines, one per evaluation, appended as they finish): per
tenant and adapter version, successes / n for each property with Wilson 95% intervals.
Replies of one prompt are not independent, so with ``--eval-samples`` > 1 the intervals are
somewhat too narrow (32 prompts is the independent n).

    nice -n 10 python bench/tenant_prefs.py --out /tmp/tenant_prefs.jsonl              # ~40 min on 2 busy cores
    python bench/tenant_prefs.py --model tiny-random --steps 1 --eval-samples 1 --out /tmp/t.jsonl   # plumbing
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PREFERENCES = ("brevity", "steps")


def grade(policy: str, text: str, finish: str | None, ntok: int, problem, rng: random.Random):
    """(success, the user's message) of ``policy``'s user for one reply."""
    from pipeline.simulate.feedback import decide
    from pipeline.simulate.grading import grade_reply

    g = grade_reply(text, completion_tokens=ntok, finish_reason=finish, gold=None)
    fb = decide(policy, g, problem.answer, rng, max_words=40)
    return fb.success, fb.text


def properties(text: str, finish: str | None, ntok: int) -> dict[str, bool]:
    """Each preference's property for one reply (correctness apart: a user's property only)."""
    from pipeline.simulate.grading import grade_reply

    g = grade_reply(text, completion_tokens=ntok, finish_reason=finish, gold=None)
    return {"brevity": g.brief, "steps": g.stepwise}


def _finish(meta: dict) -> str | None:
    f = meta.get("finish_reason")
    return f.get("type") if isinstance(f, dict) else f


async def generate(client, prompt_ids: list[list[int]], seeds: list[int], max_new: int, lora: str | None):
    """One batched ``/generate`` (temperature 1, per-row seeds) under adapter ``lora``."""
    body = {"input_ids": prompt_ids, "return_logprob": True,
            "sampling_params": [{"temperature": 1.0, "max_new_tokens": max_new, "sampling_seed": s} for s in seeds]}
    if lora is not None:
        body["lora_path"] = [lora] * len(prompt_ids)
    out = await client.post("/generate", body)
    return [(o["text"], o["output_ids"], [float(e[0]) for e in o["meta_info"]["output_token_logprobs"]],
             _finish(o["meta_info"])) for o in out]


async def evaluate(client, heldout, prompt_ids, args, lora: str | None) -> dict:
    """Held-out replies under ``lora`` (None: the base), each graded for every preference."""
    rows_ids, seeds = [], []
    for i, ids in enumerate(prompt_ids):
        for j in range(args.eval_samples):
            rows_ids.append(ids)
            seeds.append(args.eval_seed + 1000 * j + i)
    out = await generate(client, rows_ids, seeds, args.max_tokens, lora)
    counts = {p: 0 for p in PREFERENCES}
    for text, ids, _, finish in out:
        for p, ok in properties(text, finish, len(ids)).items():
            counts[p] += ok
    return {"n": len(out), "successes": counts}


async def rollout_batch(client, tok_client, problems, tenant: str, step: int, args, lora: str | None):
    """``--prompts`` x ``--samples`` graded replies of ``tenant``'s user as trainer samples."""
    from pipeline import events
    from pipeline.judge.prompts import inject_hint

    rng = random.Random(f"{tenant}:{step}")
    msgs = [[{"role": "user", "content": p.question}] for p in problems]
    ids = [await tok_client.tokenize(m) for m in msgs]
    rows = [(k, j) for k in range(len(problems)) for j in range(args.samples)]
    out = await generate(client, [ids[k] for k, _ in rows], [10_000 * step + 7 * k + j for k, j in rows],
                         args.max_tokens, lora)
    samples, wins = [], 0
    for (k, j), (text, resp, lps, finish) in zip(rows, out):
        ok, message = grade(tenant, text, finish, len(resp), problems[k], rng)
        wins += ok
        teacher = None
        if not ok and resp:  # the corrective message is the hint; the frozen base is the teacher
            hinted = await tok_client.tokenize(inject_hint(msgs[k], message))
            teacher = await client.score(hinted + list(resp), len(hinted))
        samples.append(events.Sample(
            sample_id=f"{tenant}/{step}-{k}-{j}:0:combine:r", session_id=f"{step}-{k}-{j}", turn_index=0,
            kind=events.sample_kind(True, teacher is not None), tokens=list(ids[k]) + list(resp),
            response_length=len(resp), rollout_log_probs=lps, reward=1.0 if ok else -1.0,
            teacher_log_probs=teacher, hint=message if teacher is not None else None))
    return samples, wins


def poisoned(s):
    """``s`` with its training signal inverted: the reward negated and, with a teacher, the OPD
    advantage too (teacher log-probs mirrored about the rollout's: ``2 * rollout - teacher``)."""
    teacher = s.teacher_log_probs
    if teacher is not None:
        teacher = [2 * r - t for r, t in zip(s.rollout_log_probs, teacher)]
    return dataclasses.replace(s, reward=None if s.reward is None else -s.reward, teacher_log_probs=teacher)


def wilson(k: int, n: int) -> list[float]:
    from pipeline.orchestrate.demo import wilson_interval

    return [round(x, 3) for x in wilson_interval(k, n)]


def emit(path: Path, record: dict) -> None:
    """Print one evaluation and append it to ``path``."""
    cells = "  ".join(f"{p} {record['successes'][p]}/{record['n']} {wilson(record['successes'][p], record['n'])}"
                      for p in PREFERENCES)
    print(f"[{record['tenant']:>7} step {record['step']}] {cells}  ({record['seconds']:.0f} s; "
          f"train batch success {record.get('batch_successes')})", flush=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


async def run(args, pt, url: str, work: Path) -> None:
    from pipeline.engine_api.client import EngineClient
    from pipeline.simulate.datasets import load_gsm8k, pick

    heldout = load_gsm8k("heldout")
    train = pick(load_gsm8k("train"), args.prompts * args.steps * len(PREFERENCES), seed=args.seed)
    out = Path(args.out)

    def engine():  # a new connection pool for each phase: a training step outlasts the server's keep-alive
        return EngineClient(url, timeout_s=3600)

    async with engine() as client:
        hids = [await client.tokenize([{"role": "user", "content": p.question}]) for p in heldout]
        t0 = time.monotonic()
        base = await evaluate(client, heldout, hids, args, None)
    emit(out, dict(base, tenant="base", step=0, adapter=None, seconds=time.monotonic() - t0))
    for ti, tenant in enumerate(PREFERENCES):
        if args.only and tenant != args.only:
            continue
        lora = None
        for step in range(1, args.steps + 1):
            t0 = time.monotonic()
            first = (ti * args.steps + step - 1) * args.prompts
            async with engine() as client:
                samples, wins = await rollout_batch(client, client, train[first: first + args.prompts], tenant, step,
                                                    args, lora)
            if step in args.poison_step:  # the rollout demo's test device: the step's signal inverted
                samples = [poisoned(s) for s in samples]
                if args.poison_reset and step - 1 not in args.poison_step:
                    pt.reset_optimizer(tenant)  # as the trainer does: the honest momentum forgotten
            res = pt.train_batch(samples, adapter=tenant)  # this thread: the CPU shim is per thread
            exp = pt.export_adapter(tenant, work / tenant / f"v{step}")
            lora = f"{tenant}-{step}"
            t1 = time.monotonic()
            async with engine() as client:
                await client.load_lora_adapter(lora, str(exp.path))
                ev = await evaluate(client, heldout, hids, args, lora)
            emit(out, dict(ev, tenant=tenant, step=step, adapter=exp.sha256, batch_successes=wins,
                           batch_n=len(samples), skipped=res.skipped,
                           reward_mean=round(sum(s.reward for s in samples) / len(samples), 3),
                           train_s=round(t1 - t0, 1), seconds=time.monotonic() - t1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--steps", type=int, default=3, help="adapter updates per tenant")
    p.add_argument("--prompts", type=int, default=4, help="training prompts per step")
    p.add_argument("--samples", type=int, default=4, help="replies per training prompt")
    p.add_argument("--eval-samples", type=int, default=2, help="replies per held-out prompt (32 prompts)")
    p.add_argument("--eval-seed", type=int, default=1234)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=7, help="which training prompts")
    p.add_argument("--poison-reset", action="store_true",
                   help="the first of consecutive poisoned steps starts from fresh Adam moments (as the trainer does)")
    p.add_argument("--only", choices=PREFERENCES, help="train this preference's tenant alone")
    p.add_argument("--poison-step", type=int, action="append", default=[],
                   help="train this step with every reward negated (the rollout demo's poisoned update; repeatable)")
    p.add_argument("--out", required=True, help="JSON lines, one per evaluation (appended)")
    args = p.parse_args()

    from pipeline.config import load_config
    from pipeline.engine.lora import LoraSettings
    from pipeline.models import resolve_model
    from pipeline.testing.engine import running_engine
    from pipeline.testing.trainer import megatron_runtime
    from pipeline.trainer.policy import PolicyTrainer

    cfg = load_config(None, trainer={"model": args.model, "lr": args.lr, "micro_batch_size": 4,
                                     "normalize_advantages": True, "rollout_batch_size": args.prompts * args.samples,
                                     "lora": {"rank": args.rank, "alpha": 2 * args.rank}}).trainer
    with running_engine(args.model, threads=args.threads, max_batch_size=64, lora=LoraSettings(enabled=True)) as url, \
            megatron_runtime(tp=1, threads=args.threads) as par, tempfile.TemporaryDirectory() as tmp:
        pt = PolicyTrainer(cfg, resolve_model(args.model), par)
        asyncio.run(run(args, pt, url, Path(tmp)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
