"""openclaw-pipeline: online RL from live agent traffic over a durable Kafka log.

Stages (each its own process, ``python -m pipeline <stage>``): proxy, engine, judge, trainer,
syncer; plus broker, topics, up, simulate, demo, archive, replay and import. Shared contracts
live in :mod:`pipeline.events` (event schemas), :mod:`pipeline.topics` (topics.yaml) and
:mod:`pipeline.config` (configuration).
"""

__version__ = "0.1.0"
