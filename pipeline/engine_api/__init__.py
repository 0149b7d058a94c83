"""Everything that speaks to a model server (SGLang, vLLM, this package's CPU engine, an
OpenAI-compatible judge) over HTTP; no other package opens a connection to one.

=====================  ========================================================================
module                 what it holds
=====================  ========================================================================
``client.py``          :class:`EngineClient`: chat, streaming chat with token ids, ``/generate``,
                       scoring (``score_result``), tokenize, weight updates, pause/abort, health
``sglang.py``          :class:`GenerateChatStream`, SGLang's streamed chat with token ids through
                       ``/v1/tokenize`` + ``/generate``; the chat-field -> ``sampling_params``
                       mapping (``chat_sampling_params``, ``response_format_schema``) and
                       ``generate_path_refusal``
``vllm.py``            :class:`VllmClient`: the same calls against vLLM's OpenAI server (raw
                       log-probs recorded as temperature 1, the weight version bracketed by
                       ``/weight_info``, scoring through ``prompt_logprobs``, full-weight reload
                       with the folder checked first, LoRA); how vLLM is started
``backend.py``         ``engine_client(kind, url)``: the client of a server family
                       (``engine.kind``: native, sglang, vllm); ``adapter_model``
``transport.py``       :class:`Transport`, the one aiohttp connection pool (the proxy forwards
                       through it, every client here sends through it); ``sse_batches``
``errors.py``          :class:`EngineError` (``status``: HTTP code or None), :class:`EngineTimeout`,
                       :class:`EngineUnavailable`, :class:`EngineUnreachable`: every failed call
                       to a model server; ``retried`` (call again while the failure can pass)
``render.py``          the one chat renderer (:class:`ChatRenderer`, :class:`PromptSpec`): an
                       OpenAI chat request -> prompt token ids; ``content_text``, the one
                       text of a message's content (parts joined with nothing)
``schema.py``          ``CHAT_FIELDS``: every chat-completions field the package knows, its role
                       and its check (``check_chat_body``)
``judging.py``        :class:`HttpJudge`: an LLM judge's votes (chat completions with time-outs,
                       retries, back-off), for the judge stage and the eval set's judge checks
``tokenbytes.py``      :class:`TokenBytes`: the raw bytes of each token id (log-prob ``bytes``)
``tools.py``           tool-call parsing of generated text (``parse_tool_calls``,
                       :class:`ToolStreamParser`)
=====================  ========================================================================

The package imports only the contracts (:mod:`pipeline.errors`, :mod:`pipeline.sampling`,
:mod:`pipeline.retry`, :mod:`pipeline.models`), never a stage.
"""
