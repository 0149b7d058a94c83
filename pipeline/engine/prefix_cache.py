"""Prefix cache of the CPU engine: the KV cache of recent prompts, reused by later prompts that
start with the same token ids (an agent re-sends its whole history every turn).

Each entry holds the token ids of one prefilled prompt and, per attention layer, its keys and
values ``[1, H, n, D]`` (fp32, exact copies of what the prefill computed). A lookup returns the
entry with the **longest common prefix** with the new prompt, compared token id by token id
(never by text, never by hash alone); the new prompt's prefill then runs only on the tokens after
that prefix, attending to the cached keys/values. An entry whose ids are a prefix of a newly
inserted prompt is dropped (the new entry answers every lookup the old one could), so a
conversation keeps one entry that grows turn by turn.

Bounds: at most ``max_entries`` entries and ``max_bytes`` bytes of keys + values; the least
recently used entry (inserted or hit) is evicted first, and a prompt larger than ``max_bytes`` on
its own is not stored. ``max_bytes == 0`` or ``max_entries == 0`` disables the cache. Prompts
shorter than ``min_tokens`` are not stored and a shorter common prefix is not reused (the copy
would cost more than the prefill it saves).

Adapters: keys/values are a function of the LoRA adapter too (its delta changes the k/v
projections and every layer after the first), so every entry carries the content id (sha256) of
the adapter its prefill ran under (None: the base model), and a lookup considers only entries of
the same adapter: a prefix computed under adapter X is never reused for adapter Y or the base.

Validity: keys/values are a function of the weights, so the engine clears the cache whenever
its weights change (:meth:`clear`, called by the model thread at every swap) and on
``/flush_cache``. The cache is owned by the model thread; it takes no lock.

Memory per token: ``2 * layers * kv_heads * head_dim * 4`` bytes (SmolLM2-135M: 30 layers, 3 KV
heads of 64 -> 46,080 bytes, so a 3,000-token prompt is ~138 MB).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(eq=False)
class PrefixEntry:
    """One cached prompt: ``ids`` [n] (int64) and per-layer ``keys``/``values`` [1, H, n, D],
    computed under the LoRA adapter whose sha256 is ``adapter`` (None: the base model)."""

    ids: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    nbytes: int
    adapter: str | None = None


@dataclass
class PrefixStats:
    """Counters since start: lookups, hits (a prefix was reused), tokens reused, entries
    inserted, evicted (for room) and cleared (weight change / flush)."""

    lookups: int = 0
    hits: int = 0
    reused_tokens: int = 0
    inserted: int = 0
    evicted: int = 0
    cleared: int = 0


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two 1-D int64 tensors."""
    n = min(a.shape[0], b.shape[0])
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0, 0]) if diff.numel() else n


class PrefixCache:
    """LRU store of prompt KV caches keyed by token ids (see the module docstring).

    Args:
        max_bytes: bound on the keys + values held (bytes); 0 disables the cache.
        max_entries: bound on the number of prompts held; 0 disables the cache.
        min_tokens: shortest prompt stored and shortest prefix reused.
    """

    def __init__(self, max_bytes: int, max_entries: int, min_tokens: int = 16) -> None:
        self.max_bytes = max(0, int(max_bytes))
        self.max_entries = max(0, int(max_entries))
        self.min_tokens = max(1, int(min_tokens))
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()  # id(entry) -> entry, LRU first
        self.nbytes = 0
        self.stats = PrefixStats()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0 and self.max_entries > 0

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, ids: list[int], limit: int, adapter: str | None = None) -> tuple[int, PrefixEntry | None]:
        """The longest cached prefix of ``ids``, at most ``limit`` tokens, among the entries
        computed under ``adapter`` (a LoRA adapter's sha256; None: the base model).

        Returns:
            ``(n, entry)``: the first ``n`` tokens of ``ids`` equal ``entry.ids[:n]``; ``(0, None)``
            when the cache is off or no entry shares ``min_tokens`` tokens (or ``limit`` is below).
            A hit makes the entry the most recently used.
        """
        if not self.enabled:
            return 0, None
        self.stats.lookups += 1
        if limit < self.min_tokens or not self._entries:
            return 0, None
        q = torch.tensor(ids[:limit], dtype=torch.long)
        best, best_n = None, 0
        for entry in self._entries.values():
            if entry.adapter != adapter:
                continue
            n = common_prefix(entry.ids, q)
            if n > best_n:
                best, best_n = entry, n
        if best is None or best_n < self.min_tokens:
            return 0, None
        self._entries.move_to_end(id(best))
        self.stats.hits += 1
        self.stats.reused_tokens += best_n
        return best_n, best

    def insert(self, ids: list[int], layers: list, adapter: str | None = None) -> bool:
        """Store the KV of prompt ``ids`` taken from cache ``layers`` (each with ``keys``/``values``
        ``[1, H, S, D]``, ``S >= len(ids)``; the first ``len(ids)`` positions are copied), computed
        under ``adapter`` (sha256; None: base). Only entries of the same adapter cover or are
        covered by it.

        Returns:
            True when stored; False when the cache is off, the prompt is shorter than
            ``min_tokens`` or larger than ``max_bytes``, or an entry already covers it (that
            entry becomes the most recently used).
        """
        n = len(ids)
        if not self.enabled or n < self.min_tokens:
            return False
        q = torch.tensor(ids, dtype=torch.long)
        nbytes = sum(2 * layer.keys[:, :, :n].numel() * layer.keys.element_size() for layer in layers)
        if nbytes > self.max_bytes:
            return False
        for key, entry in list(self._entries.items()):
            if entry.adapter != adapter:
                continue
            shared = common_prefix(entry.ids, q)
            if shared == n:  # an entry starts with the whole prompt: nothing new to keep
                self._entries.move_to_end(key)
                return False
            if shared == entry.ids.shape[0]:  # the new prompt extends this entry
                self._drop(key)
        keys = [layer.keys[:, :, :n].clone() for layer in layers]
        values = [layer.values[:, :, :n].clone() for layer in layers]
        entry = PrefixEntry(q, keys, values, nbytes, adapter)
        self._entries[id(entry)] = entry
        self.nbytes += nbytes
        self.stats.inserted += 1
        while self.nbytes > self.max_bytes or len(self._entries) > self.max_entries:
            self._drop(next(iter(self._entries)))
            self.stats.evicted += 1
        return True

    def clear(self) -> int:
        """Drop every entry (the weights changed); returns how many were dropped."""
        n = len(self._entries)
        self._entries.clear()
        self.nbytes = 0
        self.stats.cleared += n
        return n

    def _drop(self, key: int) -> None:
        self.nbytes -= self._entries.pop(key).nbytes
