"""Per-step metrics of the trainer: a JSONL log (one object per step) and a console progress bar.

Every record has ``step`` and ``policy_version``; see :class:`pipeline.trainer.stage.TrainerStage`
for the fields. The log follows the checkpoint: on restart, records of steps after the restored
checkpoint are removed (those steps are trained again), and the checkpoint's own record is
appended if the process died between writing the checkpoint and the log line. So the log lists
every sample exactly once per trained step of the surviving history.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from pipeline.jsonl import read_jsonl


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class MetricsLog:
    """Append-only JSONL file of step records (``path`` None: keep nothing)."""

    def __init__(self, path: str | os.PathLike | None) -> None:
        self.path = Path(path) if path else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def records(self) -> list[dict]:
        """Every record in the file (skipping a torn last line)."""
        if not self.path:
            return []
        return read_jsonl(self.path, strict=False, missing_ok=True)

    def reconcile(self, step: int, last_record: dict | None) -> None:
        """Make the log agree with a checkpoint at ``step`` (see the module docstring)."""
        if not self.path:
            return
        recs = [r for r in self.records() if int(r.get("step", 0)) <= step]
        if last_record is not None and step > 0 and not any(int(r.get("step", 0)) == step for r in recs):
            recs.append(last_record)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with open(tmp, "w") as f:
            for r in recs:
                f.write(json.dumps(r, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def append(self, record: dict) -> None:
        """Write one record as a line (flushed and fsynced)."""
        if not self.path:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({k: _clean(v) for k, v in record.items()}, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())


def fmt(value: Any, spec: str = ".4f") -> str:
    """A figure for people: ``format(value, spec)``, or ``n/a`` when absent (None, NaN, not a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return "n/a"
    return format(value, spec)


def step_line(record: dict) -> str:
    """The console log line of one step record (absent figures read ``n/a``, never 0)."""
    return (f"step {record.get('step')} v{record.get('policy_version')} loss {fmt(record.get('loss'))} "
            f"reward {fmt(record.get('reward_mean'), '.3f')} samples {record.get('batch_samples')} "
            f"({fmt(record.get('step_s'), '.1f')} s)")


class Progress:
    """A tqdm bar over trainer steps (disabled when ``enabled`` is false or not a main rank)."""

    def __init__(self, enabled: bool, total: int | None, initial: int = 0) -> None:
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", desc="trainer", dynamic_ncols=True)

    def update(self, record: dict) -> None:
        """Advance by one step and show the main numbers."""
        if self.bar is None:
            return
        keys = ("loss", "reward_mean", "policy_version", "samples_per_s")
        self.bar.set_postfix({k: (round(record[k], 4) if isinstance(record.get(k), float) else record.get(k))
                              for k in keys if k in record}, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        """Close the bar."""
        if self.bar is not None:
            self.bar.close()
