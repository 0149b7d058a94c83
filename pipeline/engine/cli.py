"""``python -m pipeline engine``: the CPU inference server speaking SGLang's HTTP API.

Examples::

    python -m pipeline engine --model smollm2-135m --port 30000
    python -m pipeline engine --model tiny-random --port 0          # any free port (printed)
    python -m pipeline engine --model runs/weights/v3 --weight-version 3
    python -m pipeline engine --model tiny-random --enable-lora --lora-paths alice=runs/lora/alice/v2

Flags override the ``engine`` section of the config (``--set engine.threads=2`` works too).
The first line on stdout once serving is ``ENGINE READY http://HOST:PORT`` (for supervisors).
"""

from __future__ import annotations

import logging
import socket
import sys

HELP = "CPU inference server speaking SGLang's HTTP API (/generate, /v1/chat/completions, weight updates)"


def add_arguments(parser) -> None:
    parser.add_argument("--model", help="smollm2-135m | tiny-random | path of an HF folder (engine.model)")
    parser.add_argument("--kind", choices=("native", "vllm"),
                        help="native: this package's CPU server; vllm: vLLM's OpenAI server from its own venv "
                             "(deploy/install-vllm.sh; docs/vllm.md) (engine.kind)")
    parser.add_argument("--host", help="bind address (engine.host)")
    parser.add_argument("--port", type=int, help="port, 0 = any free port (engine.port)")
    parser.add_argument("--threads", type=int, help="torch threads (engine.threads; default all cores)")
    parser.add_argument("--weight-version", help="initial policy version string (engine.weight_version)")
    parser.add_argument("--context-length", type=int, help="prompt + output token limit (engine.context_length)")
    parser.add_argument("--max-batch-size", type=int, help="rows decoded together (engine.max_batch_size)")
    parser.add_argument("--prefix-cache-bytes", type=int,
                        help="bytes of prompt KV kept for reuse, 0 = off (engine.prefix_cache_bytes)")
    parser.add_argument("--served-model-name", help="name in /v1/models (default: --model)")
    parser.add_argument("--cache-dir", help="where built-in models are converted (engine.cache_dir)")
    parser.add_argument("--seed", type=int, help="seed of the shared sampling generator (engine.seed)")
    lora = parser.add_argument_group("LoRA (SGLang's flags; docs/tenants.md)")
    lora.add_argument("--enable-lora", action="store_true", default=None,
                      help="serve LoRA adapters: /load_lora_adapter, lora_path, model 'base:adapter' (engine.enable_lora)")
    lora.add_argument("--max-lora-rank", type=int, help="largest adapter rank accepted (engine.max_lora_rank)")
    lora.add_argument("--lora-target-modules", nargs="+", metavar="MODULE",
                      help="projections adapters may target, or 'all' (engine.lora_target_modules)")
    lora.add_argument("--max-loras-per-batch", type=int,
                      help="distinct adapters in one batch, the base counting as one (engine.max_loras_per_batch)")
    lora.add_argument("--lora-paths", nargs="+", metavar="NAME=PATH",
                      help="adapters to load at start; turns LoRA on (engine.lora_paths)")


def _lora_paths(items: list[str] | None) -> dict[str, str] | None:
    """``NAME=PATH`` items as a dict (a bare ``PATH`` is named after its folder, as in SGLang).

    Raises:
        ValueError: an empty name or path, or a name given twice.
    """
    if not items:
        return None
    out: dict[str, str] = {}
    for item in items:
        name, _, path = item.partition("=") if "=" in item else (item.rstrip("/").rsplit("/", 1)[-1], "", item)
        if not name or not path or name in out:
            raise ValueError(f"--lora-paths: bad or repeated item {item!r} (NAME=PATH)")
        out[name] = path
    return out


def run(args, config) -> int:
    from pipeline.engine.lora import SUPPORTED_TARGETS, LoraSettings
    from pipeline.engine.model import ModelLoadError
    from pipeline.engine.runtime import build_state, serve
    from pipeline.models import ModelNotFound

    try:
        lora_paths = _lora_paths(args.lora_paths)
    except ValueError as exc:
        print(f"pipeline engine: {exc}", file=sys.stderr)
        return 2
    targets = args.lora_target_modules
    if targets == ["all"]:
        targets = list(SUPPORTED_TARGETS)
    overrides = {"enable_lora": args.enable_lora, "max_lora_rank": args.max_lora_rank,
                 "lora_target_modules": targets, "max_loras_per_batch": args.max_loras_per_batch,
                 "lora_paths": lora_paths, "model": args.model, "host": args.host, "port": args.port, "threads": args.threads,
                 "weight_version": args.weight_version, "context_length": args.context_length,
                 "max_batch_size": args.max_batch_size, "served_model_name": args.served_model_name,
                 "cache_dir": args.cache_dir, "seed": args.seed, "prefix_cache_bytes": args.prefix_cache_bytes,
                 "kind": args.kind}
    config = config.replace(engine={k: v for k, v in overrides.items() if v is not None})
    e = config.engine
    if e.kind == "vllm":
        return exec_vllm(config)
    log = logging.getLogger("pipeline.engine")
    try:
        state = build_state(e.model, cache_dir=e.cache_dir, context_length=e.context_length,
                            max_batch_size=e.max_batch_size, weight_version=e.weight_version, seed=e.seed,
                            threads=e.threads, served_model_name=e.served_model_name,
                            prefix_cache_bytes=e.prefix_cache_bytes, prefix_cache_entries=e.prefix_cache_entries,
                            prefix_cache_min_tokens=e.prefix_cache_min_tokens,
                            lora=LoraSettings(e.enable_lora, e.max_lora_rank, tuple(e.lora_target_modules),
                                              e.max_loras_per_batch), lora_paths=e.lora_paths)
    except (ModelNotFound, ModelLoadError) as exc:
        print(f"pipeline engine: {exc}", file=sys.stderr)
        return 2
    # proto IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted connections only then (else Nagle +
    # delayed ACK add ~40 ms to every response with a body)
    sock = socket.socket(socket.AF_INET6 if ":" in e.host else socket.AF_INET, socket.SOCK_STREAM,
                         socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((e.host, e.port))
    except OSError as exc:
        print(f"pipeline engine: cannot bind {e.host}:{e.port}: {exc}", file=sys.stderr)
        state.worker.stop()
        return 2
    sock.listen(128)
    port = sock.getsockname()[1]
    print(f"ENGINE READY http://{e.host}:{port}", flush=True)
    log.info("serving %s on http://%s:%d (weight version %s)", e.model, e.host, port, e.weight_version)
    api_key = e.api_key.get_secret_value() if e.api_key is not None else None
    serve(state, e.host, port, api_key=api_key, sock=sock, log_level=config.log_level.lower()
          if config.log_level.upper() == "DEBUG" else "warning")
    return 0


def exec_vllm(config) -> int:
    """Replace this process with vLLM's OpenAI server over ``engine.model`` (its HF folder), with
    the engine section's port, LoRA and length settings (:func:`pipeline.engine_api.vllm.serve_command`).
    Returns 2 (with a message) when vLLM is not installed or the model cannot be found."""
    import os

    from pipeline.engine_api.vllm import find_python, serve_command, serve_env
    from pipeline.models import ModelNotFound, resolve_model
    from pipeline.procutil import free_port

    e = config.engine
    try:
        python, folder = find_python(e.cache_dir), resolve_model(e.model, e.cache_dir)
    except (FileNotFoundError, ModelNotFound) as exc:
        print(f"pipeline engine --kind vllm: {exc}", file=sys.stderr)
        return 2
    port = e.port or free_port()
    api_key = e.api_key.get_secret_value() if e.api_key is not None else None
    cmd = serve_command(python, folder, port, host=e.host, served_model_name=e.served_model_name or e.model,
                        max_model_len=e.context_length, enable_lora=e.enable_lora or bool(e.lora_paths),
                        max_lora_rank=e.max_lora_rank, max_loras=e.max_loras_per_batch, api_key=api_key,
                        lora_modules=e.lora_paths or None)
    print(f"ENGINE READY http://{e.host}:{port} (vLLM; answers once /health does)", flush=True)
    os.execve(cmd[0], cmd, dict(os.environ, **serve_env(e.threads)))
    return 0  # not reached
