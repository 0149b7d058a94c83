"""``pipeline config show``: print the effective configuration, secrets masked.

``--explain`` adds what each setting means and its allowed range (from the field descriptions of
:mod:`pipeline.config`).
"""

from __future__ import annotations

import json

import yaml

from pipeline.config import Config, explain, redacted

HELP = "Show the effective configuration (defaults < YAML file < PIPELINE_* env < flags)."


def add_arguments(parser) -> None:
    parser.add_argument("action", choices=["show"], help="what to do")
    parser.add_argument("--format", choices=["yaml", "json"], default="yaml")
    parser.add_argument("--explain", action="store_true",
                        help="one line per setting: its value, what it means and its allowed range")


def run(args, config: Config) -> int:
    if args.explain:
        rows = explain(config)
        if args.format == "json":
            print(json.dumps([{"key": k, "value": v, "description": d, "range": r} for k, v, d, r in rows], indent=2))
            return 0
        section = None
        for key, value, desc, rng in rows:
            head = key.split(".", 1)[0] if "." in key else None
            if head != section:
                section = head
                print()
                print(f"# [{head}]" if head else "# [top level]")
            shown = json.dumps(value) if not isinstance(value, str) else value
            note = f"{desc} ({rng})" if rng else desc
            print(f"{key} = {shown}    # {note}")
        return 0
    data = redacted(config)
    print(json.dumps(data, indent=2) if args.format == "json" else yaml.safe_dump(data, sort_keys=False))
    return 0
