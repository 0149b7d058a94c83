"""Request bodies of the SGLang HTTP subset (pydantic; unknown fields are ignored like SGLang).

Field names, types and defaults follow SGLang at commit 004c82e (docs/sglang-api.md):
``GenerateReqInput`` (``/generate``), ``ChatCompletionRequest`` (``/v1/chat/completions``),
``UpdateWeightFromDiskReqInput`` and the tokenize request. A body that fails these models is
answered 400 with SGLang's validation error shape.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from pipeline.engine_api.schema import CHAT_FIELDS


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class GenerateBody(_Body):
    """``POST /generate`` (SGLang ``GenerateReqInput``, the fields this engine implements)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: StrictBool | list[StrictBool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    token_ids_logprob: list[int] | list[list[int]] | None = None
    return_text_in_logprobs: StrictBool = False
    stream: StrictBool = False
    return_prompt_token_ids: StrictBool = False
    # a loaded LoRA adapter's name (None: the base model); a list gives one per prompt of a batch
    lora_path: str | list[str | None] | None = None


class FunctionDef(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class ChatBody(_Body):
    """``POST /v1/chat/completions`` (SGLang ``ChatCompletionRequest`` subset): the types and
    SGLang's defaults of exactly the fields of :data:`pipeline.engine_api.schema.CHAT_FIELDS` (checked when
    this module loads: a field added to or dropped from the table without this model fails the import).

    ``return_token_ids`` is also accepted with ``stream: true`` here (vLLM-style extension:
    per-chunk ``choices[i].token_ids`` deltas and ``prompt_token_ids`` on the first chunk);
    SGLang answers that combination with 400.
    """

    messages: list[Any] = Field(min_length=1)
    model: str = "default"
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: StrictBool = False
    no_stop_trim: StrictBool = False
    min_tokens: int = 0
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: StrictBool = False
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    return_token_ids: StrictBool = False
    return_prompt_token_ids: StrictBool = False
    return_meta_info: StrictBool = False
    input_ids: list[int] | None = None
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    rid: str | None = None
    skip_special_tokens: StrictBool = True
    user: str | None = None
    # SGLang's constrained decoding and regex stops: ``regex`` is served (a grammar); ``ebnf`` and
    # ``stop_regex`` are known here so that they are refused (400), never silently dropped
    regex: str | None = None
    ebnf: str | None = None
    stop_regex: str | list[str] | None = None

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: Any) -> Any:
        if isinstance(v, str) and v not in ("none", "auto", "required"):
            raise ValueError("tool_choice must be 'none', 'auto', 'required' or a named function")
        if isinstance(v, dict):
            fn = v.get("function")
            if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
                raise ValueError("tool_choice object must be {'type': 'function', 'function': {'name': ...}}")
        return v


_drift = set(ChatBody.model_fields) ^ set(CHAT_FIELDS)
if _drift:  # pragma: no cover - a developer's error, caught by any test that imports the engine
    raise ImportError(f"ChatBody and pipeline.engine_api.schema.CHAT_FIELDS differ in {sorted(_drift)}")


class UpdateWeightsBody(_Body):
    """``POST /update_weights_from_disk`` (SGLang ``UpdateWeightFromDiskReqInput`` subset)."""

    model_path: str
    load_format: str | None = None
    abort_all_requests: StrictBool = False
    weight_version: str | int | None = None
    flush_cache: StrictBool = True


class LoadLoraBody(_Body):
    """``POST /load_lora_adapter`` (SGLang ``LoadLoRAAdapterReqInput``). ``pinned`` is accepted
    and has no effect here (every loaded adapter stays in memory until unloaded)."""

    lora_name: str
    lora_path: str
    pinned: StrictBool = False


class UnloadLoraBody(_Body):
    """``POST /unload_lora_adapter`` (SGLang ``UnloadLoRAAdapterReqInput``)."""

    lora_name: str


class TokenizeBody(_Body):
    """``POST /v1/tokenize``: ``prompt`` (text) or ``messages`` (chat, rendered with the template)."""

    prompt: str | list[str] | None = None
    messages: list[Any] | None = None
    tools: list[ToolDef] | None = None
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    model: str | None = None


class DetokenizeBody(_Body):
    tokens: list[int]
    model: str | None = None


class AbortBody(_Body):
    rid: str = ""
    abort_all: StrictBool = False
    abort_message: str | None = None


class PauseBody(_Body):
    mode: Literal["abort", "retract", "in_place"] = "abort"
