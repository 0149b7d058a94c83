"""Offline retraining from history: ``archive`` (turns -> JSONL files), ``replay`` (files or the
topic -> a topic or consumer group) and ``import`` (OpenAI-format conversations -> turns).

The archive format is in :mod:`pipeline.history.store`.
"""
