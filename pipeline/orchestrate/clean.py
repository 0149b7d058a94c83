"""``pipeline clean RUN_DIR``: free the disk a finished run takes (checkpoints, exported weights,
broker data, logs), after saying what it will remove and how much.

A run of ``pipeline up`` or ``pipeline demo`` on SmolLM2-135M keeps its newest checkpoints
(``trainer.keep_checkpoints``, 1.6 GB each with the optimizer state) and exported weight folders
(``trainer.keep_exports``, ~0.5 GB each in fp32) until it is cleaned; both commands print the run
folder's size when they stop. A folder is only cleaned when it looks like a run folder (it has a
``logs`` folder) and no running process has it in its command line (a stack still using it).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

HELP = "remove a finished run's folder (checkpoints, exported weights, broker data, logs)"


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", help="the run folder (e.g. runs/up or reports/demo/run)")
    parser.add_argument("--keep-weights", action="store_true",
                        help="keep the exported weight folders (trainer.export_dir) and remove the rest")
    parser.add_argument("--dry-run", action="store_true", help="only say what would be removed")


def disk_usage(path: str | os.PathLike) -> int:
    """Bytes taken by the files under ``path`` (links are not followed; 0 for a missing path)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def human(nbytes: int) -> str:
    """``nbytes`` as a short human-readable size (decimal units: 1 GB = 10^9 bytes)."""
    size = float(nbytes)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"  # pragma: no cover


def users_of(run_dir: Path) -> list[int]:
    """PIDs of running processes (other than this one) whose command line names ``run_dir``."""
    needle = str(run_dir.resolve()).encode()
    rel = str(run_dir).encode()
    found = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if needle in cmd or (rel and rel in cmd.split(b"\x00")):
            found.append(int(entry.name))
    return found


def run(args, config) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir() or not (run_dir / "logs").is_dir():
        print(f"pipeline clean: {run_dir} is not a run folder (no logs/ inside); nothing removed", file=sys.stderr)
        return 2
    busy = users_of(run_dir)
    if busy:
        print(f"pipeline clean: {run_dir} is in use by running process(es) {busy[:5]}: stop that stack first",
              file=sys.stderr)
        return 1
    keep = set()
    if args.keep_weights:
        keep = {p.resolve() for p in run_dir.iterdir() if p.name == "weights"}
    parts = [p for p in sorted(run_dir.iterdir()) if p.resolve() not in keep]
    sizes = {p: disk_usage(p) if p.is_dir() else p.lstat().st_size for p in parts}
    for p, n in sizes.items():
        print(f"  {human(n):>9}  {p}")
    total = sum(sizes.values())
    if args.dry_run:
        print(f"pipeline clean: would free {human(total)} (--dry-run: nothing removed)")
        return 0
    for p in parts:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    if not keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    print(f"pipeline clean: freed {human(total)} from {run_dir}")
    return 0
