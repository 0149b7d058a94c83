"""``python -m pipeline syncer --engine URL``: apply published weights to one engine replica.

Runs beside each engine replica (Kubernetes: a sidecar) and applies what the trainer publishes
on ``control``: full weights (``/update_weights_from_disk``) and each tenant's LoRA adapter
(``/load_lora_adapter``, ``/unload_lora_adapter``; docs/tenants.md "Adapter sync"), answering
``applied``/``failed``, and reconciles a restarted engine before it takes traffic.

- :mod:`pipeline.syncer.core`: :class:`Syncer` (the loop, full weights, ``/readyz``);
- :mod:`pipeline.syncer.adapters`: the tenants' adapters (:class:`~pipeline.syncer.adapters.AdapterSync`);
- :mod:`pipeline.syncer.published`: what was published, read back from ``control``
  (:func:`last_published`, :func:`scan_control`).
"""

from __future__ import annotations

import argparse
import signal
import threading

from pipeline.config import Config
from pipeline.syncer.core import Syncer
from pipeline.syncer.published import TenantAdapters, TenantServing, last_published, scan_control

HELP = "apply published weights (control topic) to one engine replica via /update_weights_from_disk"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--engine URL``, ``--engine-id``, ``--group-id``, ``--ready-port``."""
    parser.add_argument("--engine", dest="engine_url", help="engine base URL (syncer.engine_url; default engine.url)")
    parser.add_argument("--engine-id", help="this replica's id in applied/failed reports (syncer.engine_id)")
    parser.add_argument("--group-id", help="consumer group (default syncer-<engine_id>)")
    parser.add_argument("--ready-port", type=int,
                        help="serve GET /readyz here: 200 once the engine serves the last published version "
                             "and every tenant's adapter (syncer.ready_port; the replica's readiness probe)")


def run(args: argparse.Namespace, config: Config) -> int:
    """Apply the flags to ``config.syncer`` and run the :class:`Syncer` until SIGTERM/SIGINT."""
    flags = {"engine_url": args.engine_url, "engine_id": args.engine_id, "group_id": args.group_id}
    config = config.replace(syncer={k: v for k, v in flags.items() if v}
                            | ({"ready_port": args.ready_port} if args.ready_port is not None else {}))
    s = config.syncer
    from pipeline.metrics import serve_metrics

    serve_metrics(config.metrics_port)
    syncer = Syncer(config)
    if s.ready_port is not None:
        syncer.serve_ready(s.ready_port)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: syncer.stop.set())
    syncer.run()
    return 0


__all__ = ["HELP", "Syncer", "TenantAdapters", "TenantServing", "add_arguments", "last_published", "run", "scan_control"]
