"""Loading a causal LM (HF folder) for the CPU engine, in fp32.

The engine keeps one tokenizer for its whole life (the trainer exports the same tokenizer with
new weights) and swaps :class:`LoadedModel` objects on ``/update_weights_from_disk``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


class ModelLoadError(PipelineError, ValueError):
    """The folder has no loadable causal LM, or its shapes do not match the serving tokenizer."""


@dataclass
class LoadedModel:
    """A model ready to serve.

    Attributes:
        model: ``transformers`` causal LM in eval mode, fp32, gradients off.
        path: the folder it was loaded from.
        vocab_size: rows of the output layer (logits width).
        max_position_embeddings: the model's own context limit (tokens).
        model_type, architectures: from ``config.json`` (reported by ``/model_info``).
        eos_token_ids: end-of-sequence ids from the config and ``generation_config.json``.
        generation_defaults: temperature/top_p/top_k/min_p/repetition_penalty found in
            ``generation_config.json`` (SGLang uses them as chat defaults).
    """

    model: Any
    path: Path
    vocab_size: int
    max_position_embeddings: int
    model_type: str
    architectures: list[str]
    eos_token_ids: set[int]
    generation_defaults: dict[str, float]


def _as_set(v: Any) -> set[int]:
    if v is None:
        return set()
    if isinstance(v, int):
        return {v}
    return {int(x) for x in v}


def _generation_config(path: Path) -> dict:
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        try:
            gen = json.loads(gen_file.read_text())
            return gen if isinstance(gen, dict) else {}
        except (OSError, ValueError):
            return {}
    return {}


def generation_defaults(path: str | os.PathLike) -> dict[str, float]:
    """temperature / top_p / top_k / min_p / repetition_penalty from the folder's
    ``generation_config.json`` (SGLang's chat defaults when a request gives none); ``{}`` if absent."""
    gen = _generation_config(Path(os.path.expanduser(str(path))))
    return {k: float(gen[k]) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
            if isinstance(gen.get(k), (int, float)) and not isinstance(gen.get(k), bool)}


def load_model(path: str | os.PathLike) -> LoadedModel:
    """Load the HF causal LM at ``path`` in fp32 (``~2 s`` for SmolLM2-135M on 2 cores).

    Raises:
        ModelLoadError: missing folder/config or a load failure (message says why).
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    path = Path(os.path.expanduser(str(path)))
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"no config.json in {path}")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - any loader failure is a bad model_path
        raise ModelLoadError(f"cannot load a causal LM from {path}: {type(e).__name__}: {e}") from e
    model.eval()
    model.requires_grad_(False)
    cfg = model.config
    gen = _generation_config(path)
    eos = _as_set(getattr(cfg, "eos_token_id", None)) | _as_set(gen.get("eos_token_id"))
    defaults = generation_defaults(path)
    out_emb = model.get_output_embeddings()
    vocab = int(out_emb.weight.shape[0]) if out_emb is not None else int(cfg.vocab_size)
    return LoadedModel(
        model=model, path=path, vocab_size=vocab,
        max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 0) or 0) or 1 << 20,
        model_type=str(getattr(cfg, "model_type", "")), architectures=list(getattr(cfg, "architectures", None) or []),
        eos_token_ids=eos, generation_defaults=defaults,
    )


def load_tokenizer(path: str | os.PathLike):
    """The HF tokenizer of the folder (with its chat template).

    Raises:
        ModelLoadError: no tokenizer files there.
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(Path(os.path.expanduser(str(path))))
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {type(e).__name__}: {e}") from e
