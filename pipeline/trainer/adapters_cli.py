"""``python -m pipeline adapters``: commands about one tenant's LoRA adapter (``trainer.lora``).

::

    pipeline adapters freeze   --tenant T    # T's samples are consumed and train nothing
    pipeline adapters unfreeze --tenant T
    pipeline adapters reset    --tenant T    # drop T's adapter and optimizer state; T is served by the base
    pipeline adapters delete   --tenant T    # reset, and remove T's exported folders
    pipeline adapters export   --tenant T --out DIR   # copy T's current adapter folder to DIR

The first four publish one ``control`` record (``action``, ``tenant`` T, no adapter, this
config's ``trainer.run_id``); the trainer applies it between steps, in log order
(:mod:`pipeline.trainer.adapters`). ``export`` reads ``control`` from the beginning: T's current
adapter is the one its last ``resume`` names, its folder the ``location`` of the ``weights``
record of that version; the folder is verified against its version
(:func:`pipeline.weightsync.verify_adapter`), copied atomically to ``DIR`` (which must not
exist) and the copy verified again. Exit status 2 for a bad tenant id or ``DIR`` existing, 1 when
T has no adapter (no ``resume`` of T, or its last one names the base) or its folder is missing
or does not verify.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from pipeline import events, weightsync

HELP = "freeze / unfreeze / reset / delete a tenant's LoRA adapter, or export its current folder"
ACTIONS = events.ADAPTER_COMMANDS + ("export",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``ACTION --tenant T [--out DIR]``."""
    parser.add_argument("action", choices=ACTIONS, help="what to do with the tenant's adapter")
    parser.add_argument("--tenant", required=True, help="the tenant id")
    parser.add_argument("--out", help="export: the folder to write (must not exist)")


def export(records: list, tenant: str, run_id: str, out: str | Path) -> dict:
    """Copy ``tenant``'s current adapter folder to ``out`` (see the module docstring); returns the
    adapter. Raises ``LookupError`` (no adapter), ``FileNotFoundError``/``ValueError`` (its
    folder is missing or does not verify), ``FileExistsError`` (``out`` exists)."""
    from pipeline.files import atomic_folder

    found = weightsync.current_adapters(records, run_id).get(tenant)
    if found is None:
        raise LookupError(f"tenant {tenant!r} has no adapter: control holds no resume of it in run {run_id!r}, "
                          f"or its last one names the base model")
    adapter, location = found
    weightsync.verify_adapter(location, adapter["version"])
    with atomic_folder(out) as tmp:
        for name in (*weightsync.ADAPTER_FILES, weightsync.ADAPTER_CHECKSUM_FILE):
            if (Path(location) / name).exists():
                shutil.copyfile(Path(location) / name, tmp / name)
    weightsync.verify_adapter(out, adapter["version"])
    return adapter


def run(args: argparse.Namespace, config) -> int:
    """Publish the command, or export (see the module docstring)."""
    bad = events.tenant_error(args.tenant)
    if bad:
        print(f"pipeline adapters: --tenant {args.tenant!r}: {bad}", file=sys.stderr)
        return 2
    run_id = config.trainer.run_id
    if args.action == "export":
        if not args.out:
            print("pipeline adapters export: --out DIR is required", file=sys.stderr)
            return 2
        from pipeline.bus import read_events

        try:
            adapter = export(read_events(config, "control"), args.tenant, run_id, args.out)
        except FileExistsError as e:
            print(f"pipeline adapters export: {e}", file=sys.stderr)
            return 2
        except (LookupError, OSError, ValueError) as e:
            print(f"pipeline adapters export: {e}", file=sys.stderr)
            return 1
        print(f"exported {args.tenant}'s adapter {adapter['name']} (version {adapter['version']}) to {args.out}")
        return 0
    from pipeline.bus import EventProducer

    ev = events.Control(action=args.action, epoch=0, policy_version=0, run_id=run_id, tenant=args.tenant,
                        created_at=events.now_ms())
    producer = EventProducer(config, name="adapters")
    try:
        meta = producer.send(config.topics.name("control"), ev, key=run_id).get(timeout=30)
    finally:
        producer.close()
    print(f"published {args.action} of tenant {args.tenant} (run {run_id}) at control offset {meta.offset}")
    return 0
