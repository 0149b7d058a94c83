"""Loading a causal LM (HF folder) for the CPU engine, in fp32.

The engine keeps one tokenizer for its whole life (the trainer exports the same tokenizer with
new weights) and swaps :class:`LoadedModel` objects on ``/update_weights_from_disk``. New weights
must fit the served model exactly (:func:`check_fits`): the same architecture in ``config.json``,
the same tensor names and shapes, floating-point tensors where the served checkpoint has them,
and, when the folder carries a tokenizer, the same tokenizer. Anything else is refused rather
than loaded, because ``from_pretrained`` quietly initialises missing tensors at random and drops
unknown ones.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError
from pipeline.sampling import generation_config, generation_defaults

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
    config: dict[str, Any] = None  # type: ignore[assignment]  # config.json as loaded
    tensors: dict[str, tuple[tuple[int, ...], str]] | None = None  # checkpoint name -> (shape, dtype)


def _as_set(v: Any) -> set[int]:
    if v is None:
        return set()
    if isinstance(v, int):
        return {v}
    return {int(x) for x in v}


#: config.json keys that may differ between a served model and its new weights (bookkeeping, the
#: storage dtype, generation-time switches); every other key is part of the architecture
CONFIG_FREE_KEYS = frozenset({"_name_or_path", "transformers_version", "dtype", "torch_dtype", "_commit_hash",
                              "use_cache", "output_attentions", "output_hidden_states", "return_dict",
                              "_attn_implementation", "_attn_implementation_autoset", "architectures"})
_FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model",
                    "special_tokens_map.json", "added_tokens.json")


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """``config.json`` of an HF folder as a dict. Raises :class:`ModelLoadError`."""
    f = Path(os.path.expanduser(str(path))) / "config.json"
    try:
        cfg = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {f}: {e}") from e
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{f} is not a JSON object")
    return cfg


def read_tensors(path: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], str]] | None:
    """Name -> (shape, safetensors dtype) of every tensor in the folder's safetensors checkpoint
    (one file or shards listed by ``model.safetensors.index.json``), read from the file headers
    only. None when the folder has no safetensors checkpoint.

    Raises:
        ModelLoadError: an unreadable header or a shard the index names that is missing.
    """
    from safetensors import safe_open

    folder = Path(os.path.expanduser(str(path)))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise ModelLoadError(f"cannot read {index}: {e}") from e
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        return None
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for name in files:
        try:
            with safe_open(str(folder / name), framework="pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    out[key] = (tuple(int(d) for d in sl.get_shape()), str(sl.get_dtype()))
        except Exception as e:  # noqa: BLE001 - any header failure is a bad checkpoint
            raise ModelLoadError(f"cannot read the safetensors header of {folder / name}: {e}") from e
    return out


def _listed(names: list[str], k: int = 5) -> str:
    return ", ".join(names[:k]) + (f" and {len(names) - k} more" if len(names) > k else "")


def check_fits(served: LoadedModel, path: str | os.PathLike, tokenizer: Any = None) -> None:
    """Refuse new weights at ``path`` that do not fit the ``served`` model (nothing is loaded).

    Checked: every ``config.json`` key outside :data:`CONFIG_FREE_KEYS` is equal (layer count,
    hidden size, heads, vocabulary size, rope, norm epsilon, ...); the checkpoint has exactly the
    served checkpoint's tensor names, each with the same shape, and a floating-point dtype where
    the served one is floating point (F32/F16/BF16 are interchangeable: the engine computes in
    fp32, SGLang casts to its own dtype); when the folder has tokenizer files, its tokenizer has
    the served tokenizer's vocabulary, special tokens and chat template.

    Raises:
        ModelLoadError: the first mismatch found, named (e.g. ``num_hidden_layers: 3 != 2``).
    """
    folder = Path(os.path.expanduser(str(path)))
    cfg = read_config(folder)
    mine = served.config or {}
    diffs = sorted(k for k in (set(cfg) | set(mine)) - CONFIG_FREE_KEYS if cfg.get(k) != mine.get(k))
    if diffs:
        shown = "; ".join(f"{k}: {cfg.get(k)!r} != served {mine.get(k)!r}" for k in diffs[:5])
        raise ModelLoadError(f"config.json does not match the served model ({shown})")
    new = read_tensors(folder)
    if served.tensors is not None and new is not None:
        missing = sorted(set(served.tensors) - set(new))
        extra = sorted(set(new) - set(served.tensors))
        if missing:
            raise ModelLoadError(f"{len(missing)} tensor(s) of the served model are missing: {_listed(missing)}")
        if extra:
            raise ModelLoadError(f"{len(extra)} tensor(s) the served model does not have: {_listed(extra)}")
        for name in sorted(new):
            shape, dtype = new[name]
            s_shape, s_dtype = served.tensors[name]
            if shape != s_shape:
                raise ModelLoadError(f"tensor {name} has shape {list(shape)}, the served model's is {list(s_shape)}")
            if (dtype in _FLOAT_DTYPES) != (s_dtype in _FLOAT_DTYPES):
                raise ModelLoadError(f"tensor {name} has dtype {dtype}, the served model's is {s_dtype}")
    if tokenizer is not None and any((folder / f).is_file() for f in _TOKENIZER_FILES):
        other = load_tokenizer(folder)
        if other.get_vocab() != tokenizer.get_vocab():
            a, b = other.get_vocab(), tokenizer.get_vocab()
            diff = sorted(set(a.items()) ^ set(b.items()), key=lambda x: x[1])
            raise ModelLoadError(f"the folder's tokenizer has a different vocabulary ({len(a)} vs {len(b)} entries;"
                                 f" first difference: {diff[0][0]!r} -> {diff[0][1]})")
        if other.all_special_tokens != tokenizer.all_special_tokens:
            raise ModelLoadError(f"the folder's tokenizer has other special tokens: {other.all_special_tokens} != "
                                 f"served {tokenizer.all_special_tokens}")
        if (getattr(other, "chat_template", None) or "") != (getattr(tokenizer, "chat_template", None) or ""):
            raise ModelLoadError("the folder's tokenizer has a different chat template")


def load_model(path: str | os.PathLike, *, like: LoadedModel | None = None, tokenizer: Any = None) -> LoadedModel:
    """Load the HF causal LM at ``path`` in fp32 (``~2 s`` for SmolLM2-135M on 2 cores).

    Args:
        like: the served model, when these are new weights for it: :func:`check_fits` runs
            first, and the load itself must find every parameter in the checkpoint.
        tokenizer: the served tokenizer (compared with the folder's, when it has one).
    Raises:
        ModelLoadError: missing folder/config, weights that do not fit ``like``, or a load
            failure (the message says why).
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    path = Path(os.path.expanduser(str(path)))
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"no config.json in {path}")
    if like is not None:
        check_fits(like, path, tokenizer)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    except Exception as e:  # noqa: BLE001 - any loader failure is a bad model_path
        raise ModelLoadError(f"cannot load a causal LM from {path}: {type(e).__name__}: {e}") from e
    if like is not None:  # also for checkpoints without a safetensors header to compare
        for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
            bad = sorted(str(x) for x in info.get(kind) or ())
            if bad:
                raise ModelLoadError(f"the checkpoint does not fit the served model: {kind.replace('_', ' ')}: "
                                     f"{_listed(bad)}")
        served_shapes = {n: tuple(p.shape) for n, p in like.model.state_dict().items()}
        new_shapes = {n: tuple(p.shape) for n, p in model.state_dict().items()}
        if served_shapes != new_shapes:
            bad = sorted(n for n in set(served_shapes) | set(new_shapes) if served_shapes.get(n) != new_shapes.get(n))
            raise ModelLoadError(f"the loaded model's parameters differ from the served model's: {_listed(bad)}")
    model.eval()
    model.requires_grad_(False)
    cfg = model.config
    gen = generation_config(path)
    eos = _as_set(getattr(cfg, "eos_token_id", None)) | _as_set(gen.get("eos_token_id"))
    defaults = generation_defaults(path)
    out_emb = model.get_output_embeddings()
    vocab = int(out_emb.weight.shape[0]) if out_emb is not None else int(cfg.vocab_size)
    return LoadedModel(
        model=model, path=path, vocab_size=vocab,
        max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 0) or 0) or 1 << 20,
        model_type=str(getattr(cfg, "model_type", "")), architectures=list(getattr(cfg, "architectures", None) or []),
        eos_token_ids=eos, generation_defaults=defaults, config=read_config(path), tensors=read_tensors(path),
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
