"""The model thread: continuous batching of concurrent requests with a KV cache (CPU, fp32).

One daemon thread owns the model. Requests arrive through a thread-safe inbox; each step the
thread (1) admits waiting requests up to ``max_batch_size`` — one prefill forward each, which
also yields the prompt log-probs — and merges their KV caches into the running batch
(left-padded), then (2) runs one batched decode forward for every running row and samples one
token per row. Finished rows leave the batch between steps. A prefill starts from the longest
cached prefix of its prompt (:mod:`pipeline.engine.prefix_cache`; never past the first position
whose logits the request needs) and computes only the tokens after it; the prompt's KV is then
offered to the cache, after the request's first token went out. Results go back through each
request's ``sink`` callable (the HTTP layer passes ``loop.call_soon_threadsafe``), so the
asyncio server never blocks on torch.

Weight swap (``/update_weights_from_disk``) follows SGLang's reader/writer lock: once a swap is
requested no new request is admitted, the running batch finishes on the *old* weights, then the
model reference and the weight version change together, the prefix cache is emptied (its KV
came from the old weights), and admission resumes. Every update a
request receives carries the version it was admitted under, so a response never mixes versions.
As in SGLang, a swap requested while generation is paused (``/pause_generation``) happens at
once; rows frozen by an ``in_place``/``retract`` pause then continue on the new weights and report
the new version (use the default ``abort`` pause, or none, to avoid mixed-policy responses).

LoRA (:mod:`pipeline.engine.lora`): each request carries the adapter it was admitted with (or
None); before every forward the thread sets :attr:`EngineWorker.lora_plan` to the adapter of
each row (prefill: the one request; decode: every running row), so rows of different adapters
decode together; admission keeps at most ``lora.max_per_batch`` distinct adapters in the batch,
and prefix-cache entries are keyed by the adapter's sha256. A weight swap hooks the new model.

Log-probs: see :mod:`pipeline.engine.sampler` (softmax(logits/T) before top-p/top-k).
Constrained rows (``params.grammar``, :mod:`pipeline.engine.grammar`) get a matcher at admission;
each step its mask of allowed tokens goes into the row's :class:`RowSpec` (so a constrained row
batches with unconstrained ones: the mask is per row) and the sampled token is fed back to it.
Prompt log-probs follow SGLang's ``logprob_start_len`` alignment (docs/sglang-api.md §1.4): with start
``k >= 0`` the entries are log p(t_i | t_<i) for i = k+1 .. L-1, with a ``None`` pad entry for
t_0 prepended when ``k == 0``; ``k == -1`` gives no prompt entries.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from pipeline.engine.grammar import Matcher
from pipeline.engine.lora import LoraPlan, LoraSettings, install
from pipeline.engine.model import LoadedModel
from pipeline.engine.params import SamplingParams
from pipeline.engine.prefix_cache import PrefixCache
from pipeline.engine.sampler import RowSpec, log_probs, sample_step
from pipeline.engine_api.tokenbytes import TokenBytes

log = logging.getLogger(__name__)


@dataclass
class Update:
    """What one request learns in one step (deltas; the HTTP layer accumulates them).

    Attributes:
        token_ids, logprobs: newly generated ids and their log-probs (nats).
        top_logprobs, token_ids_logprobs: per new token ``[(lp, id), ...]`` or None.
        input_logprobs: prompt log-probs ``[lp | None]`` (first update only, SGLang alignment).
        input_top_logprobs, input_token_ids_logprobs: same alignment, None at the pad entry.
        finish: SGLang ``finish_reason`` object on the last update, else None.
        cached_tokens: prompt tokens whose KV came from the prefix cache (first update only).
        weight_version: the policy version the request runs on.
        error: set (with ``status``) when the request failed; it is also the last update.
    """

    weight_version: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[Any] | None = None
    token_ids_logprobs: list[Any] | None = None
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[Any] | None = None
    input_token_ids_logprobs: list[Any] | None = None
    finish: dict | None = None
    cached_tokens: int | None = None
    error: str | None = None
    status: int = 400


@dataclass(eq=False)
class GenRequest:
    """One sequence to run.

    Attributes:
        rid: request id (unique while in flight).
        input_ids: prompt token ids (validated: non-empty, in the vocabulary, shorter than the
            context).
        params: verified sampling parameters.
        sink: called from the model thread with each :class:`Update` (must be thread-safe).
        return_logprob, logprob_start_len, top_logprobs_num, token_ids_logprob: SGLang's fields.
        lora: the LoRA adapter the request runs under (:class:`pipeline.engine.lora.LoraAdapter`,
            resolved once at admission and held to the end: one version per request); None: base.
    """

    rid: str
    input_ids: list[int]
    params: SamplingParams
    sink: Callable[[Update], None]
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    lora: Any = None
    aborted: bool = False
    abort_message: str = "Abort by user request."
    created: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class _Seq:
    req: GenRequest
    version: str
    output: list[int]
    n_ctx: int  # real tokens of this row in the KV cache
    generator: torch.Generator | None
    stop_ids: list[int]
    max_new: int
    text_checked: int = 0  # chars of decoded output already searched for stop strings
    matcher: Matcher | None = None  # grammar state of a constrained row

    def row_spec(self, want_lp: bool) -> RowSpec:
        r = self.req
        return RowSpec(self.req.params, self.output, self.stop_ids, self.generator,
                       r.top_logprobs_num if want_lp else 0, r.token_ids_logprob if want_lp else None,
                       self.matcher.mask() if self.matcher is not None else None)


def _lora_key(req: GenRequest) -> str | None:
    """The content id of the request's adapter (None: the base model): the prefix-cache key and
    the unit of ``max_loras_per_batch``."""
    return req.lora.sha256 if req.lora is not None else None


def _new_cache(model):
    """A ``DynamicCache`` whose full-attention layers append into preallocated buffers."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=model.config)
    cache.layers = [_GrowLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def _grow_layer_class():
    from transformers.cache_utils import DynamicLayer

    class GrowLayer(DynamicLayer):
        """``DynamicLayer`` that writes new keys/values into spare capacity instead of
        concatenating (HF copies the whole ``[B, H, S, D]`` cache on every token otherwise).
        ``keys``/``values`` stay views ``[B, H, S, D]`` of the buffers."""

        _kbuf = _vbuf = None
        _len = 0

        def set(self, keys: torch.Tensor, values: torch.Tensor, room: int = 0) -> None:
            """Replace the contents (copies into fresh buffers with room for at least ``room`` more
            positions)."""
            b, h, s, d = keys.shape
            cap = s + max(64, s // 2, room)
            self._kbuf = keys.new_empty(b, h, cap, d)
            self._vbuf = values.new_empty(values.shape[0], values.shape[1], cap, values.shape[3])
            self._kbuf[:, :, :s] = keys
            self._vbuf[:, :, :s] = values
            self._len = s
            self.keys, self.values = self._kbuf[:, :, :s], self._vbuf[:, :, :s]
            self.device, self.is_initialized = keys.device, True

        def update(self, key_states, value_states, *args, **kwargs):
            if self._kbuf is None:
                self.set(key_states, value_states)
                return self.keys, self.values
            n = key_states.shape[-2]
            if self._len + n > self._kbuf.shape[2]:
                self.set(self.keys, self.values, n)
            self._kbuf[:, :, self._len:self._len + n] = key_states
            self._vbuf[:, :, self._len:self._len + n] = value_states
            self._len += n
            self.keys, self.values = self._kbuf[:, :, :self._len], self._vbuf[:, :, :self._len]
            return self.keys, self.values

    return GrowLayer


class _LazyGrowLayer:
    cls = None

    def __call__(self):
        if _LazyGrowLayer.cls is None:
            _LazyGrowLayer.cls = _grow_layer_class()
        return _LazyGrowLayer.cls()


_GrowLayer = _LazyGrowLayer()


def _set_kv(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    if hasattr(layer, "set"):
        layer.set(keys, values)
    else:
        layer.keys, layer.values = keys, values


class _Batch:
    """Running rows with a left-padded KV cache ``[B, H, S, D]`` per layer and a mask ``[B, S]``."""

    def __init__(self) -> None:
        self.seqs: list[_Seq] = []
        self.cache = None
        self.mask: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.seqs)

    def add(self, seq: _Seq, cache) -> None:
        """Merge a freshly prefilled row (cache of length ``seq.n_ctx``) into the batch."""
        if not self.seqs:
            self.seqs, self.cache = [seq], cache
            self.mask = torch.ones(1, seq.n_ctx, dtype=torch.long)
            return
        s_old, s_new = self.mask.shape[1], seq.n_ctx
        width = max(s_old, s_new)
        for old_layer, new_layer in zip(self.cache.layers, cache.layers):
            _set_kv(old_layer, torch.cat([_lpad(old_layer.keys, width), _lpad(new_layer.keys, width)], 0),
                    torch.cat([_lpad(old_layer.values, width), _lpad(new_layer.values, width)], 0))
        new_mask = torch.zeros(1, width, dtype=torch.long)
        new_mask[0, width - s_new:] = 1
        old_mask = self.mask if s_old == width else torch.cat(
            [torch.zeros(self.mask.shape[0], width - s_old, dtype=torch.long), self.mask], 1)
        self.mask = torch.cat([old_mask, new_mask], 0)
        self.seqs.append(seq)

    def keep(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` (batch order) and drop columns that are padding in every row."""
        if not keep:
            self.seqs, self.cache, self.mask = [], None, None
            return
        idx = torch.tensor(keep, dtype=torch.long)
        self.seqs = [self.seqs[i] for i in keep]
        self.mask = self.mask[idx]
        valid_cols = self.mask.any(0).nonzero()
        trim = int(valid_cols[0]) if valid_cols.numel() else 0
        self.mask = self.mask[:, trim:]
        for layer in self.cache.layers:
            _set_kv(layer, layer.keys[idx, :, trim:], layer.values[idx, :, trim:])


def _lpad(t: torch.Tensor, width: int) -> torch.Tensor:
    """Left-pad dim 2 of ``[B, H, S, D]`` with zeros to ``width``."""
    s = t.shape[2]
    if s == width:
        return t
    pad = torch.zeros(t.shape[0], t.shape[1], width - s, t.shape[3], dtype=t.dtype)
    return torch.cat([pad, t], 2)


class EngineWorker:
    """Owns the model and runs the batching loop in one thread.

    Args:
        loaded: the model to serve first.
        tokenizer: HF tokenizer (stop strings are matched on its decoded text).
        context_length: prompt + output tokens never exceed this.
        max_batch_size: rows decoded together.
        weight_version: initial policy version string.
        seed: seed of the engine's shared sampling generator.
        prefix_cache: the KV cache of recent prompts (:mod:`pipeline.engine.prefix_cache`);
            None: none (every prompt is prefilled in full).
        lora: LoRA switches (:class:`pipeline.engine.lora.LoraSettings`); when enabled the target
            projections of every served model get the per-row delta of :attr:`lora_plan`, and a
            batch holds at most ``lora.max_per_batch`` distinct adapters (the base counting as one).
    """

    def __init__(self, loaded: LoadedModel, tokenizer, *, context_length: int, max_batch_size: int = 16,
                 weight_version: str = "0", seed: int = 0, prefix_cache: PrefixCache | None = None,
                 lora: LoraSettings | None = None) -> None:
        self.loaded = loaded
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.max_batch_size = max(1, max_batch_size)
        self.version = weight_version
        self.generator = torch.Generator().manual_seed(seed)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: deque[GenRequest] = deque()
        self._head_passed: tuple[GenRequest | None, int] = (None, 0)  # (the waiting head, admissions that passed it)
        self._batch = _Batch()
        self._swap: tuple | None = None
        self._paused = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-model", daemon=True)
        self._submit_lock = threading.Lock()
        self._closed = False
        self.fatal: BaseException | None = None
        self.steps = 0
        self.on_tokens: Callable[[int], None] = lambda n: None  # metrics hook
        self.ll_tokenizer: Any = None  # llguidance.LLTokenizer, set by the server (constrained decoding)
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache(0, 0)
        self.on_prefix: Callable[[int], None] = lambda n: None  # metrics hook: tokens reused by one lookup
        self.lora = lora if lora is not None else LoraSettings()
        self.lora_plan = LoraPlan()
        self.lora_linears = install(loaded.model, self.lora_plan, self.lora.targets) if self.lora.enabled else {}

    # ---- public, thread-safe -------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything and end the thread."""
        self._stop.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.fatal is None

    @property
    def load(self) -> tuple[int, int]:
        """(running rows, waiting requests) — approximate, read without a lock."""
        return len(self._batch), len(self._waiting) + self._inbox.qsize()

    def submit(self, req: GenRequest) -> None:
        """Queue a request; its updates arrive through ``req.sink`` (an error update at once
        when the model thread has ended)."""
        with self._submit_lock:
            if not self._closed:
                self._inbox.put(("req", req))
                return
        self._emit(req, Update(self.version, error=f"engine stopped: {self.fatal!r}" if self.fatal
                               else "engine is shutting down", status=503))

    def abort(self, req: GenRequest, message: str = "Abort by user request.") -> None:
        """Stop a request between steps; it finishes with ``finish_reason.type == "abort"``."""
        req.abort_message = message
        req.aborted = True
        self._inbox.put(("wake",))

    def swap(self, loaded: LoadedModel, version: str | None, on_done: Callable[[str], None],
             abort_all: bool = False) -> None:
        """Swap weights once no request runs on the old ones; ``on_done(new_version)`` is called
        from the model thread. ``version`` None increments an integer version (else appends
        ``+1``)."""
        self._inbox.put(("swap", loaded, version, on_done, abort_all))

    def pause(self, mode: str) -> None:
        """Stop admitting and decoding. ``abort``: abort every request first; ``in_place`` /
        ``retract``: keep running rows frozen (with their cache) until :meth:`resume`."""
        self._inbox.put(("pause", mode))

    def resume(self) -> None:
        self._inbox.put(("resume",))

    def flush_prefix_cache(self, on_done: Callable[[int], None]) -> None:
        """Drop every prefix-cache entry between two steps; ``on_done(entries_dropped)`` is called
        from the model thread."""
        self._inbox.put(("flush", on_done))

    # ---- model thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while not self._stop.is_set():
                    self._drain(block=not self._has_work())
                    self._reap_aborted()
                    if self._swap is not None and (not self._batch or self._paused):
                        self._do_swap()
                    if self._paused:
                        continue
                    while (self._waiting and len(self._batch) < self.max_batch_size
                           and self._swap is None and not self._stop.is_set()):
                        req = self._next_admissible()
                        if req is None:
                            break
                        try:
                            self._prefill(req)
                        except Exception as e:  # noqa: BLE001 - fail this request, keep serving
                            log.exception("prefill of %s failed", req.rid)
                            self._emit(req, Update(self.version, error=f"prefill failed: {e!r}", status=500))
                        self._drain(block=False)
                    if self._batch:
                        try:
                            self._decode()
                        except Exception as e:  # noqa: BLE001 - fail the batch, keep serving
                            log.exception("decode step failed; failing %d running requests", len(self._batch))
                            for s in self._batch.seqs:
                                self._emit(s.req, Update(s.version, error=f"decode failed: {e!r}", status=500))
                            self._batch.keep([])
        except BaseException as e:  # noqa: BLE001 - report, fail every request, end the thread
            log.exception("engine model thread crashed")
            self.fatal = e
        finally:
            with self._submit_lock:
                self._closed = True
            msg = f"engine stopped: {self.fatal!r}" if self.fatal else "engine is shutting down"
            for s in list(self._batch.seqs):
                self._emit(s.req, Update(s.version, error=msg, status=503))
            while self._waiting:
                self._emit(self._waiting.popleft(), Update(self.version, error=msg, status=503))
            while True:
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if cmd[0] == "req":
                    self._emit(cmd[1], Update(self.version, error=msg, status=503))

    def _next_admissible(self) -> GenRequest | None:
        """Take the first waiting request whose adapter fits the batch: at most
        ``lora.max_per_batch`` distinct adapters (by content; the base counts as one, as in SGLang);
        None when none fits (they wait for rows to finish). A head whose adapter does not fit is
        passed over by at most ``max_batch_size`` later requests; then nothing is admitted until it
        fits, so a new tenant's request is never starved by a steady stream for the adapters in use
        (a bound counted in admissions, not time)."""
        kinds = {_lora_key(s.req) for s in self._batch.seqs}
        if len(kinds) < self.lora.max_per_batch:
            return self._waiting.popleft()
        head, passed = self._head_passed
        if head is not self._waiting[0]:
            head, passed = self._waiting[0], 0
        if passed >= self.max_batch_size:
            self._head_passed = (head, passed)
            return None
        for i, r in enumerate(self._waiting):
            if _lora_key(r) in kinds:
                self._head_passed = (head, passed + (i > 0))
                del self._waiting[i]
                return r
        return None

    def _has_work(self) -> bool:
        if self._paused:
            return False
        return bool(self._batch) or bool(self._waiting and self._swap is None) or (
            self._swap is not None and not self._batch)

    def _drain(self, block: bool) -> None:
        while True:
            try:
                cmd = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            kind = cmd[0]
            if kind == "req":
                self._waiting.append(cmd[1])
            elif kind == "swap":
                if self._swap is not None:  # a newer swap replaces a pending one
                    self._swap[2](None)
                self._swap = cmd[1:4]
                if cmd[4]:
                    self._abort_all("Abort: weights are being updated.")
            elif kind == "pause":
                self._paused = True
                if cmd[1] == "abort":
                    self._abort_all("Abort: generation paused.")
                    self._reap_aborted()
            elif kind == "resume":
                self._paused = False
            elif kind == "flush":
                cmd[1](self.prefix_cache.clear())

    def _abort_all(self, message: str) -> None:
        for s in self._batch.seqs:
            s.req.abort_message, s.req.aborted = message, True
        for r in self._waiting:
            r.abort_message, r.aborted = message, True

    def _reap_aborted(self) -> None:
        if any(r.aborted for r in self._waiting):
            keep = deque()
            for r in self._waiting:
                if r.aborted:
                    self._emit(r, Update(self.version, finish={"type": "abort", "message": r.abort_message}))
                else:
                    keep.append(r)
            self._waiting = keep
        if any(s.req.aborted for s in self._batch.seqs):
            keep_idx = []
            for i, s in enumerate(self._batch.seqs):
                if s.req.aborted:
                    self._emit(s.req, Update(s.version, finish={"type": "abort", "message": s.req.abort_message}))
                else:
                    keep_idx.append(i)
            self._batch.keep(keep_idx)

    def _do_swap(self) -> None:
        loaded, version, on_done = self._swap
        self._swap = None
        if version is None:
            try:
                version = str(int(self.version) + 1)
            except ValueError:
                version = f"{self.version}+1"
        if self.lora.enabled:  # adapters are deltas: the new weights get the same hooks
            self.lora_linears = install(loaded.model, self.lora_plan, self.lora.targets)
        self.loaded, self.version = loaded, str(version)
        dropped = self.prefix_cache.clear()  # KV computed by the old weights must never be reused
        for s in self._batch.seqs:  # only when paused in place: they continue on the new weights
            s.version = self.version
        log.info("weights swapped to %s (version %s); %d prefix-cache entries dropped", loaded.path, self.version,
                 dropped)
        on_done(self.version)

    @staticmethod
    def _emit(req: GenRequest, upd: Update) -> None:
        try:
            req.sink(upd)
        except Exception:  # noqa: BLE001 - a closed event loop must not kill the model thread
            log.debug("dropping update for %s", req.rid, exc_info=True)

    def _stop_ids(self, p: SamplingParams) -> list[int]:
        ids = set(p.stop_token_ids)
        if not p.ignore_eos:
            ids |= self.loaded.eos_token_ids
        return sorted(ids)

    def _prefill(self, req: GenRequest) -> None:
        if req.aborted:
            self._emit(req, Update(self.version, finish={"type": "abort", "message": req.abort_message}))
            return
        p = req.params
        ids = req.input_ids
        L = len(ids)
        version = self.version
        start = req.logprob_start_len if (req.return_logprob and req.logprob_start_len >= 0) else L - 1
        budget = self.context_length - L
        max_new = budget if p.max_new_tokens is None else min(p.max_new_tokens, budget)
        generate = max_new > 0
        if not generate and start >= L - 1:
            self._emit(req, Update(version, input_logprobs=[] if req.return_logprob else None,
                                   finish={"type": "length", "length": 0}))
            return
        keep_kv = generate or self.prefix_cache.enabled
        key = _lora_key(req)
        reused, cache = self._cached_prefix(ids, min(start, L - 1), key) if keep_kv else (0, None)
        self.lora_plan.set([req.lora])
        t0 = time.perf_counter()
        out = self.loaded.model(input_ids=torch.tensor([ids[reused:]], dtype=torch.long), cache=cache,
                                use_cache=keep_kv, logits_to_keep=L - start)
        logits = out.logits[0].float()  # [L - start, V]: positions start .. L-1
        upd = Update(version, cached_tokens=reused)
        if req.return_logprob:
            self._prompt_logprobs(req, logits[:-1], start, upd)
        log.debug("prefill %s: %d tokens (%d from the prefix cache) in %.3fs", req.rid, L, reused,
                  time.perf_counter() - t0)
        if not generate:
            upd.finish = {"type": "length", "length": 0}
            self._emit(req, upd)
            self._remember(ids, cache, key)
            return
        gen = torch.Generator().manual_seed(p.sampling_seed) if p.sampling_seed is not None else None
        seq = _Seq(req, version, [], L, gen, self._stop_ids(p), max_new)
        if p.grammar is not None:
            if self.ll_tokenizer is None:
                self.ll_tokenizer = TokenBytes(self.tokenizer).ll
            seq.matcher = Matcher(self.ll_tokenizer, p.grammar)
        res = sample_step(logits[-1:].clone(), [seq.row_spec(req.return_logprob)], self.generator)
        finished = self._append(seq, res, 0, upd)
        self._emit(req, upd)
        self._remember(ids, cache, key)  # after the first token went out: the copy is not on the TTFT path
        if not finished:
            self._batch.add(seq, cache)

    def _cached_prefix(self, ids: list[int], limit: int, key: str | None) -> tuple[int, Any]:
        """(tokens reused, a fresh cache holding their KV) for a prefill of ``ids`` under adapter
        ``key`` (its sha256; None: base): the longest prefix-cache match of at most ``limit``
        tokens (the first position whose logits the request needs) among entries of the same
        adapter, copied into new buffers so the entry stays unchanged; ``(0, empty cache)`` on a
        miss."""
        cache = _new_cache(self.loaded.model)
        if not all(hasattr(layer, "set") for layer in cache.layers):  # sliding-window layers: no reuse
            return 0, cache
        n, entry = self.prefix_cache.match(ids, limit, key)
        if entry is not None:
            for layer, k, v in zip(cache.layers, entry.keys, entry.values):
                layer.set(k[:, :, :n], v[:, :, :n])
        if self.prefix_cache.enabled:
            self.on_prefix(n)
        return n, cache

    def _remember(self, ids: list[int], cache, key: str | None) -> None:
        """Offer the prompt's KV (positions ``0 .. len(ids)-1`` of ``cache``, computed under adapter
        ``key``) to the prefix cache."""
        if cache is not None and self.prefix_cache.enabled and all(hasattr(x, "set") for x in cache.layers):
            self.prefix_cache.insert(ids, cache.layers, key)

    def _prompt_logprobs(self, req: GenRequest, logits: torch.Tensor, start: int, upd: Update) -> None:
        """Fill upd.input_* from logits of positions start .. L-2 ([L-1-start, V])."""
        ids = req.input_ids
        targets = torch.tensor(ids[start + 1:], dtype=torch.long)
        temp = torch.tensor([req.params.temperature])
        lps: list[float | None] = []
        tops: list[Any] = []
        fixed: list[Any] = []
        for c in range(0, logits.shape[0], 256):  # bounded memory for long prompts
            lp = log_probs(logits[c:c + 256], temp.expand(min(256, logits.shape[0] - c)))
            lps.extend(lp.gather(1, targets[c:c + 256, None])[:, 0].tolist())
            if req.top_logprobs_num > 0:
                v, i = lp.topk(min(req.top_logprobs_num, lp.shape[1]), dim=-1)
                tops.extend([list(zip(a, b)) for a, b in zip(v.tolist(), i.tolist())])
            if req.token_ids_logprob:
                tid = torch.tensor(req.token_ids_logprob, dtype=torch.long)
                fixed.extend([list(zip(a, req.token_ids_logprob)) for a in lp[:, tid].tolist()])
        if start == 0:
            lps.insert(0, None)
            tops.insert(0, None)
            fixed.insert(0, None)
        upd.input_logprobs = lps
        if req.top_logprobs_num > 0:
            upd.input_top_logprobs = tops
        if req.token_ids_logprob:
            upd.input_token_ids_logprobs = fixed

    def _append(self, seq: _Seq, res, i: int, upd: Update) -> bool:
        """Record row ``i`` of a sample result into ``seq`` and ``upd``; True when finished."""
        tok = res.token_ids[i]
        seq.output.append(tok)
        upd.token_ids.append(tok)
        if seq.req.return_logprob:
            upd.logprobs.append(res.logprobs[i])
            if seq.req.top_logprobs_num > 0:
                upd.top_logprobs = (upd.top_logprobs or []) + [res.top[i]]
            if seq.req.token_ids_logprob:
                upd.token_ids_logprobs = (upd.token_ids_logprobs or []) + [res.fixed[i]]
        self.on_tokens(1)
        p = seq.req.params
        if seq.matcher is not None and (err := seq.matcher.advance(tok)) is not None:
            upd.finish = {"type": "abort", "message": f"constrained decoding failed: {err}"}
            return True
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.loaded.eos_token_ids):
            upd.finish = {"type": "stop", "matched": tok}
            return True
        if p.stop:
            text = self.tokenizer.decode(seq.output, skip_special_tokens=p.skip_special_tokens)
            longest = max(len(s) for s in p.stop)
            lo = max(0, seq.text_checked - longest)
            window = text[lo:]
            hits = [(window.find(s), s) for s in p.stop if s in window]
            seq.text_checked = len(text)
            if hits:
                upd.finish = {"type": "stop", "matched": min(hits)[1]}
                return True
        if len(seq.output) >= seq.max_new:
            upd.finish = {"type": "length", "length": len(seq.output)}
            return True
        return False

    def _decode(self) -> None:
        batch = self._batch
        seqs = batch.seqs
        model = self.loaded.model
        B = len(seqs)
        input_ids = torch.tensor([[s.output[-1]] for s in seqs], dtype=torch.long)
        positions = torch.tensor([[s.n_ctx] for s in seqs], dtype=torch.long)
        batch.mask = torch.cat([batch.mask, torch.ones(B, 1, dtype=torch.long)], 1)
        self.lora_plan.set([s.req.lora for s in seqs])
        out = model(input_ids=input_ids, attention_mask=batch.mask, position_ids=positions, cache=batch.cache,
                    use_cache=True)
        for s in seqs:
            s.n_ctx += 1
        res = sample_step(out.logits[:, -1].float(), [s.row_spec(s.req.return_logprob) for s in seqs],
                          self.generator)
        self.steps += 1
        keep = []
        for i, s in enumerate(seqs):
            upd = Update(s.version)
            if not self._append(s, res, i, upd):
                keep.append(i)
            self._emit(s.req, upd)
        if len(keep) < B:
            batch.keep(keep)
