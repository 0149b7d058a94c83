"""Sampling parameters of one request, validated like SGLang's ``SamplingParams.verify``.

Pure Python (no torch): the HTTP layer builds these from ``/generate`` ``sampling_params`` or
from chat-completion fields, and a :class:`ValueError` becomes an HTTP 400.

Defaults follow SGLang (``sampling/sampling_params.py`` at 00c17ca):
``max_new_tokens`` 128 on ``/generate`` (None = up to the context on chat), temperature 1.0,
top_p 1.0, top_k all, min_p 0. A temperature in ``[0, 1e-6)`` means greedy: it is rewritten to
temperature 1.0 with top_k 1, so greedy log-probs are those of ``softmax(logits)``.

Constrained decoding (:mod:`pipeline.engine.grammar`): ``sampling_params.json_schema`` and
``regex`` become :attr:`SamplingParams.grammar`; the chat layer sets it for ``tool_choice``
``required`` / a named function and for ``response_format`` json. ``ebnf``, ``structural_tag``
and ``stop_regex`` are refused (400).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from pipeline.sampling import GREEDY_EPS

#: SGLang's "all tokens" top_k.
TOP_K_ALL = 1 << 30

#: Keys of ``sampling_params`` that SGLang accepts but this engine does not implement.
UNSUPPORTED = ("ebnf", "structural_tag", "stop_regex")
#: Keys of ``sampling_params`` that constrain decoding (a grammar), in the order they are tried.
CONSTRAINTS = ("json_schema", "regex")
#: Keys accepted and ignored (they only change text formatting or scheduling details here).
IGNORED = ("spaces_between_special_tokens", "stream_interval", "custom_params")


@dataclass
class SamplingParams:
    """Per-request sampling settings (SGLang names).

    Attributes:
        max_new_tokens: cap on generated tokens; 0 runs the prefill only (scoring); None: up to
            the context length.
        temperature: > 0 after normalisation; the reported log-probs are of softmax(logits/T).
        top_p, top_k, min_p: truncation applied after the log-probs are taken (sampling only).
        stop: stop strings (matched on the decoded text, trimmed unless ``no_stop_trim``).
        stop_token_ids: extra token ids that end the generation (the id is kept in output_ids).
        sampling_seed: per-request seed for a private ``torch.Generator``.
        grammar: an llguidance grammar string the output must match (None: unconstrained).
        constraint: what set the grammar, as reported (``{"tool_choice": "required"}``,
            ``{"json_schema": ...}``, ``{"response_format": {"type": ...}}``), so that the caller
            records a constrained distribution (:func:`pipeline.sampling.logprob_processors`).
    """

    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    logit_bias: dict[int, float] | None = None
    sampling_seed: int | None = None
    grammar: str | None = None
    constraint: dict[str, Any] | None = None

    @property
    def greedy(self) -> bool:
        return self.top_k == 1

    def reported(self) -> dict[str, Any]:
        """The parameters that shape the reported log-probs, after normalisation (greedy is
        temperature 1.0 with top_k 1): what the engine actually used, for the caller to record
        (chat responses carry it as ``metadata.sampling_params``)."""
        out: dict[str, Any] = {"temperature": self.temperature, "top_p": self.top_p,
                               "top_k": -1 if self.top_k == TOP_K_ALL else self.top_k, "min_p": self.min_p,
                               "frequency_penalty": self.frequency_penalty,
                               "presence_penalty": self.presence_penalty,
                               "repetition_penalty": self.repetition_penalty,
                               "min_new_tokens": self.min_new_tokens}
        if self.logit_bias:
            out["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}
        if self.grammar is not None:
            out.update(self.constraint or {"constrained_decoding": True})
        return out

    @property
    def needs_penalty(self) -> bool:
        return (self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, vocab_size: int, *, default_max_new_tokens: int | None = 128
                  ) -> "SamplingParams":
        """Build and verify from a ``sampling_params`` dict.

        Raises:
            ValueError: unknown key, wrong type, or a value out of SGLang's range.
        """
        d = dict(d or {})
        p = cls(max_new_tokens=default_max_new_tokens)
        for key in UNSUPPORTED:
            if d.pop(key, None) not in (None, "", [], {}):
                raise ValueError(f"sampling_params.{key} (constrained decoding) is not supported by this engine")
        for key in IGNORED:
            d.pop(key, None)
        for key in CONSTRAINTS:
            value = d.pop(key, None)
            if value in (None, ""):
                continue
            if p.grammar is not None:
                raise ValueError("sampling_params: give at most one of json_schema and regex")
            if not isinstance(value, (str, dict)) or (key == "regex" and not isinstance(value, str)):
                raise ValueError(f"sampling_params.{key} must be a string")
            from pipeline.engine.grammar import json_grammar, regex_grammar

            p.grammar = json_grammar(value) if key == "json_schema" else regex_grammar(value)
            p.constraint = {key: value if isinstance(value, str) else json.dumps(value)}
        for key, value in d.items():
            if key not in _FIELDS:
                raise ValueError(f"unknown sampling parameter {key!r}")
            if value is None:
                continue
            setattr(p, key, _coerce(key, value))
        p.verify(vocab_size)
        return p

    def verify(self, vocab_size: int) -> None:
        """Check ranges (SGLang's ``verify``) and normalise greedy / top_k.

        Raises:
            ValueError: with a message naming the field.
        """
        if not math.isfinite(self.temperature) or self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative and finite, got {self.temperature}")
        if self.temperature < GREEDY_EPS:
            self.temperature = 1.0
            self.top_k = 1
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k == -1 or self.top_k >= vocab_size:
            self.top_k = TOP_K_ALL
        if self.top_k < 1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be at least 0, got {self.min_new_tokens}")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens({self.max_new_tokens})], "
                             f"got {self.min_new_tokens}")
        if self.grammar is not None and self.min_new_tokens > 0:
            # the grammar may need EOS before min_new_tokens: every token would be masked
            raise ValueError("min_new_tokens cannot be combined with constrained decoding")
        if not 1 <= self.n <= 64:
            raise ValueError(f"n must be in [1, 64], got {self.n}")
        for t in self.stop_token_ids:
            if not 0 <= t < vocab_size:
                raise ValueError(f"stop_token_ids: {t} is outside the vocabulary [0, {vocab_size})")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.logit_bias:
            for t, b in self.logit_bias.items():
                if not 0 <= t < vocab_size:
                    raise ValueError(f"logit_bias: token id {t} is outside the vocabulary [0, {vocab_size})")
                if not math.isfinite(b):
                    raise ValueError(f"logit_bias: bias for {t} must be finite")


def _coerce(key: str, value: Any) -> Any:
    """Type-check one field; ints may be given for floats, never bools for numbers."""
    kind = _FIELDS[key]
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"sampling_params.{key} must be a number, got {value!r}")
        return float(value)
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ValueError(f"sampling_params.{key} must be an integer, got {value!r}")
        return value
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"sampling_params.{key} must be a boolean, got {value!r}")
        return value
    if key == "stop":
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return list(value)
        raise ValueError(f"sampling_params.stop must be a string or a list of strings, got {value!r}")
    if key == "stop_token_ids":
        if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return list(value)
        raise ValueError(f"sampling_params.stop_token_ids must be a list of integers, got {value!r}")
    if key == "logit_bias":
        if not isinstance(value, dict):
            raise ValueError("sampling_params.logit_bias must be an object {token_id: bias}")
        out = {}
        for k, v in value.items():
            try:
                tid = int(k)
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias: key {k!r} is not a token id") from None
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"logit_bias: value for {k!r} must be a number")
            out[tid] = float(v)
        return out
    raise AssertionError(key)  # pragma: no cover


_FIELDS: dict[str, Any] = {
    "max_new_tokens": int, "temperature": float, "top_p": float, "top_k": int, "min_p": float,
    "frequency_penalty": float, "presence_penalty": float, "repetition_penalty": float,
    "min_new_tokens": int, "stop": "stop", "stop_token_ids": "ids", "ignore_eos": bool,
    "skip_special_tokens": bool, "no_stop_trim": bool, "n": int, "logit_bias": "bias",
    "sampling_seed": int,
}
