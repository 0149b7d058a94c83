"""Command-line options the trainer benches share (``bench/trainer.py``, ``bench/lora_trainer.py``)."""

from __future__ import annotations

import argparse


def trainer_workload(p: argparse.ArgumentParser, seq: int, threads: int, threads_help: str = "torch threads") -> None:
    """Add the workload of a trainer bench to ``p``: models, samples per step and per micro-batch,
    tokens per sample, steps and torch threads (``seq`` and ``threads``: this bench's defaults)."""
    p.add_argument("--models", default="tiny-random,smollm2-135m", help="comma-separated model names")
    p.add_argument("--batch", type=int, default=4, help="samples per step")
    p.add_argument("--micro", type=int, default=2, help="samples per micro-batch")
    p.add_argument("--seq", type=int, default=seq, help="tokens per sample (half prompt, half response)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps")
    p.add_argument("--threads", type=int, default=threads, help=threads_help)
