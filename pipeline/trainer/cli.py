"""``python -m pipeline trainer``: Megatron-core policy updates from ``samples`` batches.

Single process on the CPU (or one GPU)::

    python -m pipeline trainer --model tiny-random --max-steps 3 --set trainer.rollout_batch_size=4

Tensor parallel (CPU: gloo; TP must divide heads, KV groups and vocabulary)::

    torchrun --nproc-per-node 2 -m pipeline trainer --model tiny-random --set trainer.tp=2

Without a checkpoint but with exported weights (the checkpoint volume was lost or not mounted)
the trainer refuses to start rather than push the base model over trained weights; restore the
checkpoint directory, or say ``--from-newest-export`` or ``--start-fresh``.

Every flag below overrides the ``trainer`` config section (``--set trainer.<key>=...`` reaches
the rest, see ``python -m pipeline config``).
"""

from __future__ import annotations

import argparse
import logging
import re
import warnings

# What megatron-core says at import and set-up on an install without Transformer Engine and
# Apex: expected on the CPU (docs/environment.md §3), no news to a user.
_EXPECTED_WARNINGS = re.compile(r"(Transformer Engine|Apex)( and Apex)? (is|are) not installed")

HELP = "Megatron-core policy updates from sample batches; checkpoints with offsets; weight sync on control"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Trainer flags (each maps onto ``trainer.<name>``)."""
    g = parser.add_argument_group("trainer")
    g.add_argument("--model", help="policy: smollm2-135m | tiny-random | HF folder (trainer.model)")
    g.add_argument("--max-steps", type=int, help="stop after this many trainer steps (trainer.max_steps)")
    g.add_argument("--batch-size", type=int, dest="rollout_batch_size", help="samples per step (trainer.rollout_batch_size)")
    g.add_argument("--micro-batch-size", type=int, help="samples per micro-batch (trainer.micro_batch_size)")
    g.add_argument("--checkpoint-dir", help="trainer.checkpoint_dir")
    g.add_argument("--export-dir", help="trainer.export_dir")
    g.add_argument("--engines", help="comma-separated engine ids to wait for at each sync ('' for none)")
    g.add_argument("--tp", type=int, help="tensor parallel size (trainer.tp)")
    g.add_argument("--threads", type=int, help="torch threads (trainer.threads)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    start = g.add_mutually_exclusive_group()
    start.add_argument("--start-fresh", action="store_true",
                       help="the checkpoint directory is empty but exports exist: train from the base model "
                            "anyway, published as a new, higher version (trainer.missing_checkpoint=fresh)")
    start.add_argument("--from-newest-export", action="store_true",
                       help="the checkpoint directory is empty but exports exist: continue from the newest "
                            "export's weights with fresh optimizer moments (trainer.missing_checkpoint=newest_export)")


def quiet_megatron() -> None:
    """Keep megatron-core's set-up chatter out of the trainer's log unless it runs at DEBUG.

    Above DEBUG: the ``megatron`` loggers show warnings and errors only (their INFO lines are
    whole config dumps and the parameter list of every gradient bucket), and megatron's
    "Transformer Engine / Apex is not installed" warnings go to the ``megatron`` logger at
    DEBUG instead of stderr. Other warnings are shown as before. At DEBUG nothing is changed.
    """
    if logging.getLogger().getEffectiveLevel() <= logging.DEBUG:
        return
    logging.getLogger("megatron").setLevel(logging.WARNING)
    show = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if _EXPECTED_WARNINGS.search(str(message)) and "megatron" in str(filename):
            logging.getLogger("megatron").debug("%s:%s: %s", filename, lineno, message)
            return
        show(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning


def run(args: argparse.Namespace, config) -> int:
    """Apply the flags to ``config.trainer`` and run :class:`pipeline.trainer.stage.TrainerStage`."""
    t: dict = {name: getattr(args, name) for name in ("model", "max_steps", "rollout_batch_size", "micro_batch_size",
                                                     "checkpoint_dir", "export_dir", "tp", "threads")
               if getattr(args, name, None) is not None}
    if args.engines is not None:
        t["engines"] = [e for e in args.engines.split(",") if e]
    if args.no_progress:
        t["progress"] = False
    if args.start_fresh:
        t["missing_checkpoint"] = "fresh"
    if args.from_newest_export:
        t["missing_checkpoint"] = "newest_export"
    import sys

    config = config.replace(trainer=t)
    quiet_megatron()

    from pipeline.trainer.guards import NonFiniteWeights
    from pipeline.trainer.stage import CheckpointMissing, TrainerStage

    try:
        return TrainerStage(config).run()
    except (CheckpointMissing, NonFiniteWeights) as e:  # a clear refusal, not a traceback
        print(f"pipeline trainer: {e}", file=sys.stderr)
        return 2
