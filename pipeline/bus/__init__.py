"""The Kafka data plane shared by every stage: the one way to read and write Kafka.

- :class:`EventProducer`: idempotent producer (acks=all, compression, bounded in-flight buffer,
  delivery callbacks, metrics); :data:`NOT_QUEUED`: what its ``send`` raises for a record it did
  not queue (send it again later).
- :class:`ConsumerApp`: one consumer-group application per process in the spirit of Quix
  Streams' ``Application``: poll, decode, handle, commit only after processing (or after a
  deferred acknowledgement), pause on backpressure, graceful shutdown on SIGTERM/SIGINT.
- :class:`TopicReader`: assign-mode reader (no group membership) for stages that own their
  offsets (trainer, followers of ``control``, replay; ``dlq=True``) and for observers that must
  write nothing (``pipeline tail``, the dashboard; bad records come back as :class:`Undecodable`).
  Start positions: ``"beginning"``, ``"end"``, ``"committed"``, :class:`Offset`, :class:`Time`.
- :class:`Follower`: the one long-lived "follow a topic, reconnect on errors, go on" loop over a
  :class:`TopicReader` (the proxy's ``control`` follower, the dashboard), with
  :class:`ConsumerApp`'s dead-letter and shutdown rules.
- :class:`RecordIntake` (used by both readers): decode, check the event type against
  ``topics.yaml``, dead-letter bad records to ``<topic>.dlq`` with the error and source offset,
  count consumed records and dead letters.
- :mod:`pipeline.bus.window_producer`: the proxy publisher's producers (librdkafka or
  kafka-python), one window of records at a time.
- :mod:`pipeline.bus.bounds`: topic positions as people write them (a time or offsets).
- :func:`consumer_kwargs` / :func:`producer_kwargs`: kafka-python settings.
"""

from pipeline.bus.consumer import ConsumerApp
from pipeline.bus.follow import Follower
from pipeline.bus.producer import NOT_QUEUED, BufferFull, EventProducer
from pipeline.bus.reader import Offset, Time, TopicMissing, TopicReader, Undecodable, read_events
from pipeline.bus.records import DECLARED, DeadLetterError, Record, RecordIntake, WrongTopic, stop_on_signals
from pipeline.bus.settings import admin_kwargs, consumer_kwargs, producer_kwargs

__all__ = ["ConsumerApp", "Follower", "TopicReader", "read_events", "Offset", "Time", "Undecodable", "Record", "RecordIntake", "DECLARED",
           "DeadLetterError", "WrongTopic", "TopicMissing", "stop_on_signals", "EventProducer", "BufferFull", "NOT_QUEUED",
           "consumer_kwargs", "producer_kwargs", "admin_kwargs"]
