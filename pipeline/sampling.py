"""Which distribution a turn's log-probs are of, and whether a teacher can score the same one.

Shared by the engine (it normalises and reports its effective parameters), the proxy (it records
them on every turn) and the judge (the OPD teacher re-applies them). Sources: SGLang's
``SamplingParams`` (a temperature in ``[0, 1e-6)`` is greedy: rewritten to temperature 1.0 with
``top_k = 1``) and its sampler (the returned log-prob of a sampled token is
``log_softmax(processed_logits / T)``, taken *before* top-k / top-p / min-p truncation, where
``processed_logits`` already carry the logit bias, the penalties and any grammar mask).

Per request option, the decision (see also ``docs/training-signal.md``):

==========================  ===========================================================
option                      effect on the reported log-probs -> what the teacher does
==========================  ===========================================================
temperature                 divides the logits -> recorded as the turn's effective
                            temperature (greedy: 1.0) and sent with the teacher request
top_p, top_k, min_p         truncate *after* the log-probs are taken -> nothing to re-apply
                            (greedy's ``top_k = 1`` included)
seed, n, stop, max_tokens,  choose / end tokens, do not change a token's log-prob ->
ignore_eos, stop_token_ids  nothing to re-apply
logit_bias, repetition /    change the logits before the log-probs, and a prefill (the
frequency / presence        teacher's scoring pass) cannot apply them -> listed in the
penalty, min_tokens,        turn's ``logprob_processors``; the teacher refuses such a turn
response_format (json),     (no OPD term; counted)
regex / ebnf / json_schema,
tool_choice "required" or
a named function (both
engines constrain decoding)
==========================  ===========================================================
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

#: temperatures below this are greedy (SGLang's rule)
GREEDY_EPS = 1e-6
#: sampling keys a chat request takes from the model's generation_config.json when it has none
#: (SGLang's and our engine's chat path: request value, then generation_config, then the default)
CHAT_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def effective_temperature(temperature: Any, default: float = 1.0) -> float:
    """The temperature the engine's log-probs are computed at: ``temperature`` when it is a number
    >= 1e-6, 1.0 for greedy (< 1e-6), ``default`` when it is None (not sent).

    Raises:
        ValueError: a negative, non-finite or non-numeric temperature.
    """
    if temperature is None:
        return float(default)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature must be a number, got {temperature!r}")
    t = float(temperature)
    if not math.isfinite(t) or t < 0:
        raise ValueError(f"temperature must be non-negative and finite, got {temperature!r}")
    return 1.0 if t < GREEDY_EPS else t


def generation_config(path: str | os.PathLike) -> dict:
    """The ``generation_config.json`` of the HF folder ``path`` as a dict; ``{}`` when it is
    absent, unreadable or not a JSON object."""
    gen_file = Path(os.path.expanduser(str(path))) / "generation_config.json"
    try:
        gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    except (OSError, ValueError):
        return {}
    return gen if isinstance(gen, dict) else {}


def generation_defaults(path: str | os.PathLike) -> dict[str, float]:
    """The :data:`CHAT_DEFAULTED` values of the folder's ``generation_config.json`` (SGLang's chat
    defaults when a request gives none), as floats; ``{}`` if absent. Read by the engine that
    serves the folder and by the proxy in front of an engine that does not report them."""
    gen = generation_config(path)
    return {k: float(gen[k]) for k in CHAT_DEFAULTED
            if isinstance(gen.get(k), (int, float)) and not isinstance(gen.get(k), bool)}


def with_generation_defaults(params: dict, defaults: dict | None) -> dict:
    """``params`` (chat or ``sampling_params`` names) with every :data:`CHAT_DEFAULTED` key that is
    absent or None taken from ``defaults`` (the served model's generation_config values; ``top_k``
    as an int): the parameters a chat path really samples with. Returns a new dict."""
    out = dict(params)
    for key in CHAT_DEFAULTED:
        if out.get(key) is None and (defaults or {}).get(key) is not None:
            out[key] = int(defaults[key]) if key == "top_k" else defaults[key]
    return out


def _num(v: Any, neutral: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return neutral
    return float(v)


def logprob_processors(params: dict) -> list[str]:
    """Names of the options in ``params`` that changed the log-prob distribution in a way a
    prefill cannot reproduce (sorted; ``[]`` = the teacher can score the same distribution).

    ``params`` may use chat names (``min_tokens``, ``response_format``, ``tool_choice``) or
    SGLang ``sampling_params`` names (``min_new_tokens``, ``json_schema``, ``regex``, ``ebnf``).
    """
    out = set()
    if params.get("logit_bias"):
        out.add("logit_bias")
    if _num(params.get("repetition_penalty"), 1.0) != 1.0:
        out.add("repetition_penalty")
    for key in ("frequency_penalty", "presence_penalty"):
        if _num(params.get(key), 0.0) != 0.0:
            out.add(key)
    if _num(params.get("min_tokens"), 0) > 0 or _num(params.get("min_new_tokens"), 0) > 0:
        out.add("min_tokens")
    rf = params.get("response_format")
    if isinstance(rf, dict) and rf.get("type", "text") != "text":
        out.add("constrained_decoding")
    if any(params.get(k) for k in ("json_schema", "regex", "ebnf", "structural_tag", "constrained_decoding")):
        out.add("constrained_decoding")
    tc = params.get("tool_choice")
    if tc == "required" or isinstance(tc, dict):
        out.add("tool_choice")
    return sorted(out)
