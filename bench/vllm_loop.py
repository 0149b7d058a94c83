"""The whole loop on vLLM with a real model: what ``pipeline up --engine vllm`` starts
(:func:`pipeline.orchestrate.up.start_stack` with ``engine.kind: vllm``), simulated GSM8K users
until the trainer's first step is served by vLLM, then more users; prints the time to each point,
the turns per recorded policy version (read from vLLM's answers by the proxy), how many carry ids,
the trainer's recomputed-vs-vLLM log-prob difference of its first step, and the stop codes.

    .venv/bin/python bench/vllm_loop.py                       # SmolLM2-135M, batches of 4
    .venv/bin/python bench/vllm_loop.py --model tiny-random-64 --run-dir /tmp/vllm-loop

Nothing here asserts a time; ``tests/e2e/test_vllm_loop_e2e.py`` is the test (tiny model).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from pipeline import events  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.orchestrate.demo import read_topic  # noqa: E402
from pipeline.orchestrate.up import start_stack  # noqa: E402


def _simulate(stack, run: Path, sessions: int, tag: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "pipeline", "simulate", "--dataset", "gsm8k", "--sessions",
                          str(sessions), "--proxy-url", stack.proxy_url, "--concurrency", "2", "--max-tokens", "32",
                          "--max-turns", "2", "--log", str(run / f"sim-{tag}.jsonl"), "--no-progress", "--config",
                          str(run / "config.yaml")], capture_output=True, text=True, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {"error": out.stderr[-500:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--run-dir", default="/tmp/vllm-loop-run")
    ap.add_argument("--batch-size", type=int, default=4)
    a = ap.parse_args()
    run = Path(a.run_dir)
    shutil.rmtree(run, ignore_errors=True)
    cfg = load_config(None, engine={"kind": "vllm", "model": a.model, "threads": 1},
                      judge={"mode": "rl", "backend": "embedding", "idle_timeout_s": 5},
                      trainer={"model": a.model, "rollout_batch_size": a.batch_size, "threads": 1,
                               "recompute_attention": True, "checkpoint_dir": str(run / "ckpt"),
                               "export_dir": str(run / "weights"), "metrics_file": str(run / "trainer.jsonl"),
                               "progress": False, "max_staleness": None})
    t0 = time.time()
    stack = start_stack(cfg, run, ready_timeout_s=900)
    c = stack.config
    print(f"stack ready: {time.time() - t0:.0f} s", flush=True)
    try:
        print("users a:", _simulate(stack, run, 4, "a").get("sessions_failed"), "sessions failed", flush=True)
        version = "0"
        while version in ("0", "default") and time.time() - t0 < 1800:
            version = httpx.get(f"{c.engine.url}/weight_info", timeout=5).json()["weight_version"]
            time.sleep(2)
        print(f"vLLM serves version {version}: {time.time() - t0:.0f} s", flush=True)
        print("users b:", _simulate(stack, run, 2, "b").get("sessions_failed"), "sessions failed", flush=True)
        turns = [e for e in read_topic(c, "turns") if isinstance(e, events.Turn)]
        print("turns by recorded policy version:", dict(sorted(Counter(t.policy_version for t in turns).items())),
              f"with ids {sum(bool(t.response_token_ids) for t in turns)}/{len(turns)}",
              "logprob temperatures:", sorted({t.logprob_temperature for t in turns if t.logprob_temperature}))
        steps = [json.loads(line) for line in Path(c.trainer.metrics_file).read_text().splitlines()]
        if steps:
            print(f"first step: {steps[0]['batch_samples']} samples, trainer-vs-vLLM log-prob |diff| "
                  f"{steps[0]['logprob_abs_diff']:.2e}, forward+backward {steps[0]['forward_backward_s']:.1f} s")
    finally:
        codes = stack.stop()
        print("stopped:", {k: o.code for k, o in codes.items()}, f"clean {all(o.clean for o in codes.values())}",
              f"total {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
