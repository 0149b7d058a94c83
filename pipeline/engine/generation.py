"""The asyncio side of one sequence: submit to the model thread, accumulate its updates, and
format them as SGLang ``/generate`` output or OpenAI chat pieces."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from pipeline.engine.params import SamplingParams
from pipeline.engine.worker import GenRequest, Update
from pipeline.errors import PipelineError


class RequestFailed(PipelineError):
    """The engine could not finish a request (shutdown, crash); ``status`` is the HTTP code."""

    def __init__(self, message: str, status: int = 503) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Item:
    """One sequence of a (possibly batched) request, validated and tokenised."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    lora: Any = None  # pipeline.engine.lora.LoraAdapter the sequence runs under; None: the base model


def partial_suffix(text: str, stop: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``stop``."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0


class Generation:
    """Handle of one submitted sequence (create inside the event loop, then :meth:`start`)."""

    def __init__(self, state: Any, item: Item) -> None:
        self.state = state
        self.item = item
        loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Update] = asyncio.Queue()
        put = self.queue.put_nowait

        def sink(u: Update) -> None:
            loop.call_soon_threadsafe(put, u)

        self.req = GenRequest(item.rid, item.input_ids, item.params, sink, item.return_logprob,
                              item.logprob_start_len, item.top_logprobs_num, item.token_ids_logprob,
                              lora=item.lora)
        self.output_ids: list[int] = []
        self.output_lps: list[float] = []
        self.output_top: list[Any] = []
        self.output_fixed: list[Any] = []
        self.input_lps: list[float | None] | None = None
        self.input_top: list[Any] | None = None
        self.input_fixed: list[Any] | None = None
        self.finish: dict | None = None
        self.cached_tokens = 0  # prompt tokens served from the prefix cache
        self.version: str = state.worker.version
        self.t0 = time.monotonic()
        self.latency: float | None = None
        self.sent_text = 0  # chars of text already streamed

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "Generation":
        self.state.inflight[self.item.rid] = self
        self.state.metrics.prompt_tokens.inc(len(self.item.input_ids))
        self.state.worker.submit(self.req)
        return self

    @property
    def done(self) -> bool:
        return self.finish is not None

    async def next(self) -> Update:
        """Wait for and apply the next update. Raises :class:`RequestFailed`."""
        u = await self.queue.get()
        self.version = u.weight_version
        self.output_ids.extend(u.token_ids)
        self.output_lps.extend(u.logprobs)
        if u.top_logprobs:
            self.output_top.extend(u.top_logprobs)
        if u.token_ids_logprobs:
            self.output_fixed.extend(u.token_ids_logprobs)
        if u.cached_tokens is not None:
            self.cached_tokens = u.cached_tokens
        if u.input_logprobs is not None:
            self.input_lps = u.input_logprobs
            self.input_top = u.input_top_logprobs
            self.input_fixed = u.input_token_ids_logprobs
        if u.error is not None:
            self.finish = {"type": "abort", "message": u.error, "status_code": u.status}
            self._close()
            raise RequestFailed(u.error, u.status)
        if u.finish is not None:
            self.finish = u.finish
            self.latency = time.monotonic() - self.t0
            self._close()
        return u

    async def wait(self) -> "Generation":
        while not self.done:
            await self.next()
        return self

    def _close(self) -> None:
        if self.state.inflight.get(self.item.rid) is self:
            del self.state.inflight[self.item.rid]

    def cancel(self) -> None:
        """Abort if still running (client went away)."""
        if not self.done:
            self.state.worker.abort(self.req, "Abort: client disconnected.")
        self._close()

    # ---- text ---------------------------------------------------------------------------------
    def text(self) -> str:
        """Decoded output: stop token/string trimmed when finished (unless ``no_stop_trim``);
        while running, an incomplete UTF-8 tail and a possible stop-string prefix are held back."""
        p = self.item.params
        ids = self.output_ids
        f = self.finish
        matched = f.get("matched") if f and f.get("type") == "stop" else None
        if isinstance(matched, int) and not p.no_stop_trim and ids:
            ids = ids[:-1]
        text = self.state.tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens)
        if isinstance(matched, str) and not p.no_stop_trim:
            i = text.find(matched)
            if i >= 0:
                text = text[:i]
        if not self.done:
            text = text.rstrip("\ufffd")
            if p.stop:
                text = text[:len(text) - max(partial_suffix(text, s) for s in p.stop)]
        return text

    def text_delta(self) -> str:
        """Text not yet streamed (monotone: never retracts what was sent)."""
        text = self.text()
        if len(text) <= self.sent_text:
            return ""
        delta = text[self.sent_text:]
        self.sent_text = len(text)
        return delta

    # ---- SGLang /generate output ---------------------------------------------------------------------
    def _entries(self, lps: list, ids: list[int], with_text: bool) -> list[list]:
        tok_text = self.state.token_text
        return [[lp, t, tok_text(t) if with_text else None] for lp, t in zip(lps, ids)]

    def _top_entries(self, tops: list | None, with_text: bool) -> list:
        tok_text = self.state.token_text
        return [None if row is None else [[lp, t, tok_text(t) if with_text else None] for lp, t in row]
                for row in (tops or [])]

    def meta_info(self, with_text: bool = False) -> dict:
        """SGLang ``meta_info`` (cumulative), with log-prob lists when ``return_logprob``."""
        it = self.item
        mi: dict[str, Any] = {
            "id": it.rid,
            "finish_reason": self.finish,
            "prompt_tokens": len(it.input_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "weight_version": self.version,
            **self.lora_info(),
        }
        if self.latency is not None:
            mi["e2e_latency"] = self.latency
        if it.return_logprob:
            k = it.logprob_start_len
            in_ids = [] if k < 0 else (it.input_ids if k == 0 else it.input_ids[k + 1:])
            in_lps = self.input_lps or []
            mi["input_token_logprobs"] = self._entries(in_lps, in_ids, with_text)
            mi["output_token_logprobs"] = self._entries(self.output_lps, self.output_ids, with_text)
            mi["output_token_logprobs_length"] = len(self.output_lps)
            if it.top_logprobs_num > 0:
                mi["input_top_logprobs"] = self._top_entries(self.input_top, with_text)
                mi["output_top_logprobs"] = self._top_entries(self.output_top, with_text)
            if it.token_ids_logprob:
                mi["input_token_ids_logprobs"] = self._top_entries(self.input_fixed, with_text)
                mi["output_token_ids_logprobs"] = self._top_entries(self.output_fixed, with_text)
        return mi

    def lora_info(self) -> dict[str, str | None]:
        """``lora_name`` and ``lora_sha256`` of the adapter that served the request (its content
        id: the version; both None for the base model)."""
        a = self.item.lora
        return {"lora_name": a.name if a is not None else None, "lora_sha256": a.sha256 if a is not None else None}

    def generate_output(self, *, with_text: bool = False, prompt_ids: bool = False) -> dict:
        """The ``/generate`` response object (or one cumulative stream chunk)."""
        out: dict[str, Any] = {"text": self.text(), "output_ids": list(self.output_ids),
                               "meta_info": self.meta_info(with_text)}
        if prompt_ids:
            out["prompt_token_ids"] = list(self.item.input_ids)
        return out

    # ---- OpenAI chat pieces ----------------------------------------------------------------------
    def chat_logprobs(self, start: int, end: int | None = None) -> list[dict]:
        """``logprobs.content`` items for output tokens ``[start:end]``.

        ``token`` is the id decoded alone (SGLang's text; half a character reads ``"\ufffd"``);
        ``bytes`` are the token's raw bytes (:mod:`pipeline.engine_api.tokenbytes`), so joining them
        rebuilds the output even where a character is split over tokens.
        """
        tok_text, tok_bytes = self.state.token_text, self.state.token_bytes.as_list
        items = []
        ids = self.output_ids[start:end]
        lps = self.output_lps[start:end]
        tops = self.output_top[start:end] if self.output_top else [None] * len(ids)
        for t, lp, top in zip(ids, lps, tops):
            items.append({"token": tok_text(t), "bytes": tok_bytes(t), "logprob": lp,
                          "top_logprobs": [{"token": tok_text(i), "bytes": tok_bytes(i), "logprob": v}
                                           for v, i in (top or [])]})
        return items

    def chat_finish_reason(self, has_tool_calls: bool) -> tuple[str | None, Any]:
        """(OpenAI finish_reason, matched_stop)."""
        f = self.finish or {}
        kind = f.get("type")
        if kind == "stop":
            return ("tool_calls" if has_tool_calls else "stop"), f.get("matched")
        if kind == "length":
            return "length", None
        if kind == "abort":
            return "abort", None
        return None, None
