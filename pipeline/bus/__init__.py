"""The Kafka data plane shared by every stage.

- :class:`EventProducer`: idempotent producer (acks=all, compression, bounded in-flight buffer,
  delivery callbacks, metrics).
- :class:`ConsumerApp`: one consumer-group application per process in the spirit of Quix
  Streams' ``Application``: poll, decode, handle, commit only after processing (or after a
  deferred acknowledgement), dead-letter undecodable records, pause on backpressure, graceful
  shutdown on SIGTERM/SIGINT.
- :class:`TopicReader`: assign-mode reader for observers (no group, no commit, no writes).
- :func:`consumer_kwargs` / :func:`producer_kwargs`: kafka-python settings for direct use.
"""

from pipeline.bus.consumer import ConsumerApp, Record
from pipeline.bus.producer import BufferFull, EventProducer
from pipeline.bus.reader import Offset, Time, TopicReader, Undecodable
from pipeline.bus.settings import admin_kwargs, consumer_kwargs, producer_kwargs

__all__ = ["ConsumerApp", "Record", "EventProducer", "BufferFull", "consumer_kwargs",
           "producer_kwargs", "admin_kwargs", "TopicReader", "Undecodable", "Offset", "Time"]
