"""The trainer stage: Megatron-core policy updates from ``samples`` batches.

Modules (each small, one purpose):

- :mod:`~pipeline.trainer.cpu_shim` — megatron-core on a CPU-only torch (gloo), reversible;
- :mod:`~pipeline.trainer.dist` — process group + Megatron parallel state (one process or torchrun);
- :mod:`~pipeline.trainer.model` — HF Llama-family <-> Megatron ``GPTModel`` (TP shards, atomic export);
- :mod:`~pipeline.trainer.loss` — advantages (GRPO, OPD, combine), PPO clip, KL, TIS, aggregation, staleness;
- :mod:`~pipeline.trainer.batch` — samples -> padded micro-batch tensors;
- :mod:`~pipeline.trainer.policy` — model + Megatron DDP + Megatron optimizer; one training step;
- :mod:`~pipeline.trainer.source` — fixed-size batches from ``samples`` with exact offsets;
- :mod:`~pipeline.trainer.checkpoint` — model, optimizer, step, policy version, offsets;
- :mod:`~pipeline.trainer.sync` — pause -> weights -> applied/failed -> resume on ``control``;
- :mod:`~pipeline.trainer.tenants`, :mod:`~pipeline.trainer.adapters` — ``trainer.lora``: each
  tenant's update count and adapter versions; export, adapter sync and commands per tenant;
- :mod:`~pipeline.trainer.adapters_cli` — ``python -m pipeline adapters``;
- :mod:`~pipeline.trainer.metrics`, :mod:`~pipeline.trainer.prom` — JSONL log, progress bar, Prometheus;
- :mod:`~pipeline.trainer.stage` / :mod:`~pipeline.trainer.cli` — ``python -m pipeline trainer``.

The per-engine syncer is :mod:`pipeline.syncer` (``python -m pipeline syncer --engine URL``); what
both sides of a weight sync share (folder checksum, ``published.json``, the syncer's metrics) is
:mod:`pipeline.weightsync`, and durable file writes are :mod:`pipeline.files`.
"""
