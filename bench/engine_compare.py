"""Our CPU engine vs vLLM's CPU build, in the same run, on the same model and the same calls
(``bench/engine.py --engines native,vllm``; docs/vllm.md has the last table).

Each engine runs as its own process, one after the other (never both at once: they would share
the cores), with LoRA enabled (rank ``--rank``), and is spoken to through
:func:`pipeline.engine_api.backend.engine_client`, i.e. through the chat API both serve:

- ``decode``: one streamed request of ``--tokens`` new tokens (``ignore_eos``, temperature 1):
  tokens after the first / time from the first to the last token, tok/s;
- ``prefill``: time to the first token of a fresh ~``--prefill-tokens`` prompt (an agent's
  system prompt of tool descriptions with a new first line each repeat: nothing cached), ms;
- ``reuse``: the same prompt again right after (the prefix cache holds it), ms;
- ``clients``: ``--concurrency`` non-streamed requests at once, ``--tokens`` each: aggregate
  completion tokens / wall time, tok/s;
- ``full sync``: ``update_weights_from_disk`` of a full fp32 export (the trainer's format,
  :func:`pipeline.testing.trainer.shifted_export`, written before the clock starts); on vLLM
  that is VllmClient's folder check + pause + reload + prefix-cache reset + version + resume;
- ``adapter load``: ``load_lora_adapter`` of a new rank-``--rank`` PEFT adapter (the trainer's
  export layout, :func:`pipeline.testing.lora.export_tenant_adapter`, versioned name), and
  the time to the first token of a short request on it right after the load (what a tenant
  waits for when the engine loads lazily), beside the same request on the base model just
  before the load. Each adapter is unloaded afterwards.

vLLM's request figures include what VllmClient adds to every call, as in the proxy: a ``GET
/weight_info`` before the request and one after its answer (the version bracket).

Every figure is ``--repeats`` samples, printed as median (min-max); vLLM / ours ratios are of the
medians. Nothing here asserts a speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Iterator

#: the figures, in table order: key -> (label, unit, higher is better)
FIGURES = {
    "decode": ("decode, 1 request", "tok/s", True),
    "prefill": ("prefill ~2k-token prompt (TTFT)", "ms", False),
    "reuse": ("same prompt again (TTFT, prefix cache)", "ms", False),
    "clients": ("clients aggregate", "tok/s", True),
    "full": ("full-weight sync", "s", False),
    "adapter": ("adapter load", "s", False),
    "base_first": ("short request on the base model (TTFT)", "ms", False),
    "adapter_first": ("the same request on the new adapter (TTFT)", "ms", False),
}


def vllm_missing() -> str | None:
    """None when vLLM's venv is installed, else the reason (with how to install it)."""
    from pipeline.testing.vllm import vllm_missing as missing

    return missing()


@contextlib.contextmanager
def vllm_server(model: str, threads: int, rank: int, log_dir: Path) -> Iterator[str]:
    """vLLM's OpenAI server over ``model`` (:func:`pipeline.testing.vllm.running_vllm`: ``serve_command``
    / ``serve_env``, LoRA on), waited for on ``/health``, stopped with its engine core on exit."""
    from pipeline.testing.vllm import running_vllm

    with running_vllm(model, max_model_len=4096, max_lora_rank=rank, threads=threads, start_timeout_s=600,
                      log_path=log_dir / "vllm.log") as url:  # 600 s: once over 300 s on a busy 2-core machine
        yield url


@contextlib.contextmanager
def native_server(model: str, threads: int | None, rank: int, concurrency: int) -> Iterator[str]:
    """Our engine over ``model`` as a child process (``pipeline engine``), LoRA on."""
    from pipeline.engine.lora import LoraSettings
    from pipeline.testing.engine import running_engine

    with running_engine(model, subprocess=True, threads=threads, max_batch_size=max(16, concurrency),
                        context_length=4096, lora=LoraSettings(enabled=True, max_rank=rank)) as url:
        yield url


def long_messages(tokenizer, n_tokens: int, tag: str) -> list[dict]:
    """A chat of about ``n_tokens`` prompt tokens: a system prompt of tool descriptions whose first
    line is ``tag`` (a new tag: no cached prefix), then a user question."""
    lines, k = [f"Session {tag}. You are a personal assistant with these tools. Call one when it helps."], 0
    while len(tokenizer.encode("\n".join(lines))) < n_tokens - 30:
        lines.append(f"- tool_{k}: {{\"name\": \"tool_{k}\", \"description\": \"Reads item {k} of the user's "
                     f"notes, calendar or files and returns it as JSON\", \"parameters\": {{\"id\": \"integer\"}}}}")
        k += 1
    return [{"role": "system", "content": "\n".join(lines)},
            {"role": "user", "content": "What is on my calendar tomorrow morning?"}]


async def _stream(c, body: dict) -> tuple[float, float, int, int]:
    """``(seconds to the first token, seconds to the last, new tokens, prompt tokens)`` of one
    streamed chat (token ids counted from the chunks)."""
    t0, first, last, n, prompt = time.perf_counter(), None, None, 0, 0
    async for ch in c.chat_stream(body, token_ids=True):
        prompt = prompt or len(ch.get("prompt_token_ids") or [])
        for choice in ch.get("choices") or []:
            ids = choice.get("token_ids") or []
            if ids:
                now = time.perf_counter() - t0
                first = now if first is None else first
                last, n = now, n + len(ids)
    if first is None:
        raise RuntimeError(f"no token streamed for {body.get('model')}")
    return first, last, n, prompt


async def _generation(c, model: str, tokenizer, args, out: dict) -> None:
    """decode, prefill, reuse and clients (``out[key]`` gets one sample per repeat)."""
    gen = {"model": model, "max_tokens": args.tokens, "ignore_eos": True, "temperature": 1.0}
    hello = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
    await _stream(c, dict(gen, messages=hello, max_tokens=8))  # warm-up: first allocations of both paths
    await _stream(c, dict(gen, messages=long_messages(tokenizer, args.prefill_tokens, "warm-up"), max_tokens=2))
    for r in range(args.repeats):
        first, last, n, _ = await _stream(c, dict(gen, messages=hello))
        out["decode"].append((n - 1) / (last - first))
        msgs = long_messages(tokenizer, args.prefill_tokens, uuid.uuid4().hex[:12])
        cold, _, _, plen = await _stream(c, dict(gen, messages=msgs, max_tokens=1))
        warm, _, _, _ = await _stream(c, dict(gen, messages=msgs, max_tokens=1))
        out["prefill"].append(1000 * cold), out["reuse"].append(1000 * warm)
        out["prompt_tokens"] = plen
        t0 = time.perf_counter()
        answers = await asyncio.gather(*(c.chat(dict(gen, messages=[{"role": "user", "content": f"Story {r}-{i}:"}]))
                                         for i in range(args.concurrency)))
        out["clients"].append(sum(a["usage"]["completion_tokens"] for a in answers) / (time.perf_counter() - t0))


async def _syncs(kind: str, c, model: str, served: str, args, tmp: Path, out: dict) -> None:
    """full and adapter syncs of ``model`` (served as ``served``; exports written before each clock starts)."""
    from pipeline.engine_api.backend import adapter_model
    from pipeline.testing.lora import export_tenant_adapter
    from pipeline.testing.trainer import shifted_export

    for r in range(args.repeats):
        folder, adapter = export_tenant_adapter(tmp / "export", "bench-tenant", model, r=args.rank,
                                                alpha=2.0 * args.rank, seed=100 + r)
        name = adapter["name"]  # versioned, as the syncer loads it
        body = {"model": served, "max_tokens": 2, "temperature": 1.0,
                "messages": [{"role": "user", "content": f"Hi {r}"}]}
        out["base_first"].append(1000 * (await _stream(c, body))[0])
        t0 = time.perf_counter()
        await c.load_lora_adapter(name, str(folder))
        out["adapter"].append(time.perf_counter() - t0)
        first, _, _, _ = await _stream(c, dict(body, model=adapter_model(kind, served, name)))
        out["adapter_first"].append(1000 * first)
        await c.unload_lora_adapter(name)
    for r in range(args.repeats):
        folder, _ = shifted_export(tmp / "export", r + 1, shift=0.001 * (r + 1), model=model)
        t0 = time.perf_counter()
        await c.update_weights_from_disk(str(folder), weight_version=str(r + 1))
        out["full"].append(time.perf_counter() - t0)
        got = await c.weight_version()
        if got != str(r + 1):
            raise RuntimeError(f"{kind}: serves weight version {got} after the update to {r + 1}")


async def measure(kind: str, url: str, model: str, args, tmp: Path) -> dict:
    """Every figure of one running engine: ``{key: [samples]}`` plus ``prompt_tokens``."""
    from pipeline.engine.model import load_tokenizer
    from pipeline.engine_api.backend import engine_client
    from pipeline.models import resolve_model

    tokenizer = load_tokenizer(resolve_model(model))
    out: dict = {k: [] for k in FIGURES}
    async with engine_client(kind, url, 600, reference_dir=resolve_model(model)) as c:
        served = (await c.models())["data"][0]["id"]
        await _generation(c, served, tokenizer, args, out)
        await _syncs(kind, c, model, served, args, tmp, out)
    return out


def run_engine(kind: str, model: str, args) -> dict:
    """Start ``kind`` (native | vllm), measure it, stop it."""
    with tempfile.TemporaryDirectory(prefix=f"bench-engine-{kind}-") as tmp:
        if kind == "vllm":
            server = vllm_server(model, args.vllm_threads, args.rank, Path(tmp))
        else:
            server = native_server(model, args.threads, args.rank, args.concurrency)
        t0, load0 = time.monotonic(), os.getloadavg()[0]
        with server as url:
            started = time.monotonic() - t0
            out = asyncio.run(measure(kind, url, model, args, Path(tmp)))
        out["start_s"], out["load"] = started, (load0, os.getloadavg()[0])
        return out


def _cell(v: list[float], unit: str) -> str:
    fmt = ".2f" if unit == "s" else ".1f" if unit == "tok/s" else ".0f"
    return f"{statistics.median(v):{fmt}} ({min(v):{fmt}}-{max(v):{fmt}})"


def table(results: dict[str, dict], args) -> list[str]:
    """The markdown table: one row per figure, a column per engine (median (min-max)), and
    vLLM / ours of the medians when both ran."""
    kinds = list(results)
    both = "native" in results and "vllm" in results
    names = {"native": "ours (native)", "vllm": "vLLM-CPU"}
    head = "| figure | unit | n | " + " | ".join(names[k] for k in kinds) + (" | vLLM / ours |" if both else " |")
    rows = [head, "|---|---|---|" + "---|" * (len(kinds) + both)]
    for key, (label, unit, _) in FIGURES.items():
        if key == "clients":
            label = f"{args.concurrency} {label}"
        if key == "prefill":
            label = label.replace("~2k", "/".join(str(results[k].get("prompt_tokens", "?")) for k in kinds))
        n = min(len(results[k][key]) for k in kinds)
        cells = [_cell(results[k][key], unit) for k in kinds]
        ratio = ""
        if both:
            ratio = f" {statistics.median(results['vllm'][key]) / statistics.median(results['native'][key]):.2f}x |"
        rows.append(f"| {label} | {unit} | {n} | " + " | ".join(cells) + " |" + ratio)
    starts = ", ".join(f"{names[k]} {results[k]['start_s']:.0f} s" for k in kinds)
    loads = ", ".join(f"{names[k]} {results[k]['load'][0]:.1f} -> {results[k]['load'][1]:.1f}" for k in kinds)
    rows.append(f"\nstart to healthy: {starts}; 1-min load average at start -> end (other work on the "
                f"machine): {loads}")
    return rows
