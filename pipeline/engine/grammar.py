"""Constrained decoding for the CPU engine: grammars (llguidance) and the per-row matcher.

What is constrained (each becomes one llguidance grammar string, carried in
:attr:`pipeline.engine.params.SamplingParams.grammar`):

- chat ``tool_choice: "required"``: exactly one call to any of the request's tools, in the form
  the engine's tool-call parser reads back (:mod:`pipeline.engine_api.tools`)::

      <tool_call>
      {"name": "<one of the tools>", "arguments": {<that tool's parameters schema>}}
      </tool_call>

  then EOS. A grammar alternation over the tools, each branch a JSON schema whose ``name`` is
  that tool's name (a ``const``) and whose ``arguments`` are its ``parameters`` schema
  (``{"type": "object"}`` when it declares none; a schema with ``properties`` and no
  ``additionalProperties`` gets ``additionalProperties: false``: only declared parameters, so a
  call valid here is valid under the tool's own schema too).
- chat ``tool_choice`` naming a function: the same with that one tool.
- chat ``response_format`` ``json_object`` / ``json_schema``, ``/generate``
  ``sampling_params.json_schema``: a JSON value of the schema (``json_object`` is the schema
  ``{"type": "object"}``, as SGLang's chat path maps it), then EOS.
- ``/generate`` ``sampling_params.regex``: text matching the regex, then EOS.

JSON is written with ``", "`` and ``": "`` separators and no other whitespace
(:data:`JSON_OPTIONS`; a schema's own ``x-guidance`` options win), the layout of
``json.dumps`` that the chat renderer uses for past tool calls, so a small model is not free
to emit whitespace forever.

Masking (:class:`Matcher`): before each sampling step the row's matcher gives the set of
allowed next tokens (a bitmask over the tokenizer's vocabulary, bit ``t % 8`` of byte
``t // 8`` for token ``t``); the sampler sets every other logit to ``-inf`` *before* the
log-probs are taken, so the reported log-probs are those of the masked, renormalised
distribution the token was drawn from (``docs/training-signal.md``: such a turn gets no OPD
term). After sampling, the token is fed to the matcher. Measured on a busy 2-core machine
(49k vocabulary, one tool): building the matcher 15-40 ms, a mask ~0.5 ms per token, its
unpacking into a tensor ~0.01 ms.
"""

from __future__ import annotations

import json
from typing import Any

from pipeline.engine_api.render import CLOSE, OPEN
from pipeline.errors import PipelineError

#: JSON layout options for every JSON grammar (llguidance ``JsonCompileOptions``).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(PipelineError, ValueError):
    """A schema or regex that cannot be compiled into a grammar (answered 400)."""


def _lark_str(s: str) -> str:
    """A Lark string literal of ``s`` (JSON string escapes are valid Lark escapes)."""
    return json.dumps(s)


def tool_call_schema(tool: dict) -> dict:
    """JSON schema of one call ``{"name": <tool's name>, "arguments": <its parameters>}``.

    Args:
        tool: an OpenAI tool, normalised (:func:`pipeline.engine_api.render.normalise_tools`).
    """
    fn = tool["function"]
    params = fn.get("parameters")
    if not isinstance(params, dict) or not params:
        params = {"type": "object"}
    elif "properties" in params and "additionalProperties" not in params:
        params = dict(params, additionalProperties=False)  # only the declared parameters
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_call_grammar(tools: list[dict]) -> str:
    """llguidance grammar of exactly one ``<tool_call>`` block calling one of ``tools``.

    Raises:
        GrammarError: no tools.
    """
    if not tools:
        raise GrammarError("constrained tool calls need at least one tool")
    lines = [f"start: {_lark_str(OPEN + chr(10))} call {_lark_str(chr(10) + CLOSE)}",
             "call: " + " | ".join(f"t{i}" for i in range(len(tools)))]
    for i, t in enumerate(tools):
        schema = dict(tool_call_schema(t), **{"x-guidance": JSON_OPTIONS})
        lines.append(f"t{i}: %json " + json.dumps(schema, ensure_ascii=False))
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_lark("\n".join(lines))


def json_grammar(schema: str | dict) -> str:
    """llguidance grammar of one JSON value of ``schema`` (a JSON string or an object).

    Raises:
        GrammarError: ``schema`` is not a JSON object.
    """
    from llguidance import LLMatcher

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise GrammarError(f"json_schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise GrammarError("json_schema must be a JSON object")
    try:
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as e:
        raise GrammarError(f"json_schema: {e}") from None


def regex_grammar(regex: str) -> str:
    """llguidance grammar of text matching ``regex`` (checked when validated)."""
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_regex(regex)


def check_grammar(grammar: str, ll_tokenizer: Any, what: str) -> None:
    """Validate ``grammar`` against the served tokenizer.

    Raises:
        GrammarError: ``"<what>: <llguidance's message>"``.
    """
    from llguidance import LLMatcher

    msg = LLMatcher.validate_grammar(grammar, ll_tokenizer)
    if msg and not msg.startswith("WARNING"):
        raise GrammarError(f"{what} cannot be compiled into a grammar: {msg}")


class Matcher:
    """The grammar state of one generating row (model thread only).

    Args:
        ll_tokenizer: the served tokenizer as an ``llguidance.LLTokenizer``.
        grammar: a grammar string from this module (validated with :func:`check_grammar`).
    Raises:
        GrammarError: the grammar does not compile (the request fails at admission).
    """

    def __init__(self, ll_tokenizer: Any, grammar: str) -> None:
        from llguidance import LLMatcher

        self._m = LLMatcher(ll_tokenizer, grammar, log_level=0)
        if self._m.is_error():
            raise GrammarError(f"grammar does not compile: {self._m.get_error()}")

    def mask(self) -> bytes:
        """Allowed next tokens: bit ``t % 8`` of byte ``t // 8`` is set iff token ``t`` is allowed
        (``ceil(n_vocab / 32) * 4`` bytes, n_vocab of the llguidance tokenizer)."""
        return self._m.compute_bitmask()

    def advance(self, token_id: int) -> str | None:
        """Feed the sampled token. Returns None, or the matcher's error (the token was not
        allowed: impossible under the mask unless the grammar itself failed)."""
        if self._m.consume_token(int(token_id)):
            return None
        return self._m.get_error() or f"token {token_id} is not allowed by the grammar"
