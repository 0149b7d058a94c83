"""``pipeline config show``: print the effective configuration, secrets masked."""

from __future__ import annotations

import json

import yaml

from pipeline.config import Config, redacted

HELP = "Show the effective configuration (defaults < YAML file < PIPELINE_* env < flags)."


def add_arguments(parser) -> None:
    parser.add_argument("action", choices=["show"], help="what to do")
    parser.add_argument("--format", choices=["yaml", "json"], default="yaml")


def run(args, config: Config) -> int:
    data = redacted(config)
    print(json.dumps(data, indent=2) if args.format == "json" else yaml.safe_dump(data, sort_keys=False))
    return 0
