"""HF Llama-family checkpoints <-> Megatron-core ``GPTModel`` (build, load with TP shards, export).

Why a hand-written mapping and not a library: ``mbridge`` (PyPI 0.15.1) does the same job but
needs ``transformers<5`` (we run 5.24), read SmolLM2's RoPE theta from the transformers-5 config
as 10000 instead of 100000 without a warning, and does not copy the tokenizer; NVIDIA's
megatron-bridge needs Transformer Engine (CUDA only). The mapping for the Llama family is short
(docs/environment.md §4: response log-probs equal to transformers' to 2.6e-6, export 0.4 s)
and is checked by tests against transformers on every supported shape.

Supported ``model_type``: ``llama`` (SmolLM2, Llama 2/3 incl. ``llama3`` RoPE scaling),
``mistral`` (without sliding window), ``qwen2`` (q/k/v bias), ``qwen3`` (q/k RMSNorm).
Anything else raises :class:`UnsupportedModel`.

Name mapping (HF -> Megatron, local spec; TE spec names in brackets):

=============================================  ===================================================
``model.embed_tokens.weight``                  ``embedding.word_embeddings.weight`` (vocab-parallel)
``layers.i.input_layernorm.weight``            ``decoder.layers.i.input_layernorm.weight``
                                               [``...self_attention.linear_qkv.layer_norm_weight``]
``layers.i.self_attn.{q,k,v}_proj.*``          ``...self_attention.linear_qkv.*``: per query group
                                               ``[its q heads, k, v]`` stacked on dim 0
``layers.i.self_attn.o_proj.weight``           ``...self_attention.linear_proj.weight`` (row-parallel)
``layers.i.self_attn.{q,k}_norm.weight``       ``...self_attention.{q,k}_layernorm.weight``
``layers.i.post_attention_layernorm.weight``   ``decoder.layers.i.pre_mlp_layernorm.weight``
                                               [``...mlp.linear_fc1.layer_norm_weight``]
``layers.i.mlp.{gate,up}_proj.weight``         ``...mlp.linear_fc1.weight`` = gate on top of up; under
                                               TP rank r holds [gate shard r; up shard r]
``layers.i.mlp.down_proj.weight``              ``...mlp.linear_fc2.weight`` (row-parallel)
``model.norm.weight``                          ``decoder.final_layernorm.weight``
``lm_head.weight`` (untied only)               ``output_layer.weight`` (column-parallel)
=============================================  ===================================================
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

from pipeline.errors import PipelineError
from pipeline.files import atomic_folder
from pipeline.weightsync import CHECKSUM_FILE, WEIGHTS_FILE

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UnsupportedModel(PipelineError, ValueError):
    """The HF config describes an architecture this mapping does not cover."""


@dataclass(frozen=True)
class Arch:
    """The shape of a Llama-family model, read from an HF ``config.json``.

    ``rope_theta`` comes from ``rope_parameters.rope_theta`` (transformers 5) or ``rope_theta``
    (older configs); ``rope_scaling_factor`` is set only for ``rope_type == "llama3"``.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    rms_eps: float
    rope_theta: float
    tie_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    max_positions: int
    rope_scaling_factor: float | None = None

    @property
    def q_per_group(self) -> int:
        """Query heads per KV group."""
        return self.num_heads // self.num_kv_heads

    def check_tp(self, tp: int) -> None:
        """Raise :class:`UnsupportedModel` unless heads, KV groups, FFN and vocab split by ``tp``."""
        for what, n in (("attention heads", self.num_heads), ("KV groups", self.num_kv_heads),
                        ("FFN width", self.ffn_hidden_size), ("vocabulary", self.vocab_size)):
            if n % tp:
                raise UnsupportedModel(f"tensor parallel size {tp} does not divide the {n} {what}")

    @classmethod
    def from_hf(cls, path_or_config: str | os.PathLike | dict) -> Arch:
        """Read ``config.json`` from an HF folder (or take the dict). Raises :class:`UnsupportedModel`."""
        if isinstance(path_or_config, dict):
            c = path_or_config
        else:
            c = json.loads((Path(path_or_config) / "config.json").read_text())
        mt = c.get("model_type")
        if mt not in SUPPORTED:
            raise UnsupportedModel(f"model_type {mt!r} is not supported (supported: {', '.join(SUPPORTED)})")
        if c.get("hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"hidden_act {c.get('hidden_act')!r}: only silu (SwiGLU) is supported")
        if c.get("mlp_bias"):
            raise UnsupportedModel("mlp_bias=true is not supported")
        if mt in ("llama", "mistral", "qwen3") and c.get("attention_bias"):
            raise UnsupportedModel(f"{mt} with attention_bias=true is not supported")
        if mt in ("mistral", "qwen2", "qwen3") and c.get("sliding_window") and c.get("use_sliding_window", mt == "mistral"):
            raise UnsupportedModel("sliding-window attention is not supported")
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
        rtype = rope.get("rope_type", rope.get("type", "default")) or "default"
        factor = None
        if rtype == "llama3":
            want = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
            for k, v in want.items():
                if float(rope.get(k, v)) != v:
                    raise UnsupportedModel(f"llama3 RoPE scaling with {k}={rope.get(k)} (Megatron fixes {v})")
            factor = float(rope.get("factor", 8.0))
        elif rtype != "default":
            raise UnsupportedModel(f"rope_type {rtype!r} is not supported")
        heads = int(c["num_attention_heads"])
        hidden = int(c["hidden_size"])
        return cls(
            model_type=mt, vocab_size=int(c["vocab_size"]), hidden_size=hidden,
            num_layers=int(c["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or hidden // heads),
            ffn_hidden_size=int(c["intermediate_size"]), rms_eps=float(c.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta), tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=(mt == "qwen2") or bool(c.get("attention_bias", False)), qk_norm=(mt == "qwen3"),
            max_positions=int(c.get("max_position_embeddings", 4096)), rope_scaling_factor=factor,
        )


def have_transformer_engine() -> bool:
    """True when Transformer Engine imports (the GPU path then uses its layer spec)."""
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return False
    return True


def _skip_init(tensor: torch.Tensor) -> None:
    """Init method that leaves the tensor as allocated: every weight is loaded from HF afterwards.

    (``perform_initialization`` stays on because Megatron sets the tensor-parallel attributes of
    its parameters inside the init path; skipping it would leave them unmarked.)
    """


def transformer_config(arch: Arch, tp: int = 1, dtype: torch.dtype = torch.float32, cuda: bool = False,
                       recompute_attention: bool = False):
    """Megatron ``TransformerConfig`` for ``arch``.

    CPU (``cuda=False``): fp32, every fusion off, CPU initialisation (docs/environment.md §3). GPU: the
    same model with the pure-PyTorch bias-activation (SwiGLU) and bias-dropout fusions on, and
    RoPE fusion when Transformer Engine is present (its attention is then TE's fused attention);
    the masked-softmax fusion stays off because it needs Megatron's compiled kernels, which a
    plain ``pip install megatron-core`` lacks. ``dtype`` bf16 enables Megatron's mixed-precision
    path. Dropout is 0 (RL
    fine-tuning). Sequence parallel stays off (it does not run on the CPU). ``recompute_attention``:
    Megatron's selective recompute of core attention (``trainer.recompute_attention``): the
    attention scores are recomputed in the backward pass instead of kept, the same gradients with
    far less memory for long sequences (the scores are quadratic in the length).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    te = cuda and have_transformer_engine()
    return TransformerConfig(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads, kv_channels=arch.head_dim, ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=arch.rms_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm, attention_dropout=0.0, hidden_dropout=0.0,
        tensor_model_parallel_size=tp, sequence_parallel=False,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=not cuda, perform_initialization=True, init_method=_skip_init,
        output_layer_init_method=_skip_init, embedding_init_method=_skip_init,
        gradient_accumulation_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=cuda,
        bias_dropout_fusion=cuda, apply_rope_fusion=te, persist_layer_norm=False,
        cuda_graph_scope=[],  # no CUDA graphs; the default "full" is deprecated and warns
        **({"recompute_granularity": "selective", "recompute_modules": ["core_attn"]} if recompute_attention else {}),
    )


def build_model(arch: Arch, tp: int = 1, dtype: torch.dtype = torch.float32, device: torch.device | None = None,
                local_spec: bool = False, recompute_attention: bool = False):
    """An uninitialised Megatron ``GPTModel`` of shape ``arch`` (load weights with :func:`load_hf_weights`).

    Call :func:`pipeline.trainer.dist.init` first. Uses the Transformer Engine layer spec on CUDA
    when TE is installed, else Megatron's local spec; ``local_spec`` forces the local spec (LoRA
    adapters hook Megatron's own parallel linears: TE fuses the input norm into ``linear_qkv`` and
    ``linear_fc1``, :mod:`pipeline.trainer.lora`). Output logits are vocab-parallel:
    ``model(input_ids [b, s], position_ids [b, s], None) -> [b, s, vocab / tp]`` (causal mask).
    Raises :class:`UnsupportedModel` if ``tp`` does not divide the model.
    """
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec)
    from megatron.core.models.gpt.gpt_model import GPTModel

    arch.check_tp(tp)
    device = device or torch.device("cpu")
    cuda = device.type == "cuda"
    cfg = transformer_config(arch, tp, dtype, cuda, recompute_attention)
    if cuda and have_transformer_engine() and not local_spec:
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_norm)
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=arch.qk_norm)
    theta = arch.rope_theta
    model = GPTModel(
        config=cfg, transformer_layer_spec=spec, vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_positions, parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_embeddings, position_embedding_type="rope",
        rotary_base=int(theta) if float(theta).is_integer() else theta,
        rope_scaling=arch.rope_scaling_factor is not None,
        rope_scaling_factor=arch.rope_scaling_factor or 8.0,
    )
    return model.to(device)


# ---------------------------------------------------------------- name mapping


def _names(arch: Arch, megatron_keys: set[str]) -> list[tuple[str, list[str]]]:
    """[(megatron name, [hf names it is made of])] for every weight of ``arch``."""
    def pick(local: str, te: str) -> str:
        return te if te in megatron_keys and local not in megatron_keys else local

    out: list[tuple[str, list[str]]] = [("embedding.word_embeddings.weight", ["model.embed_tokens.weight"])]
    for i in range(arch.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        out.append((pick(m + "input_layernorm.weight", m + "self_attention.linear_qkv.layer_norm_weight"),
                    [h + "input_layernorm.weight"]))
        out.append((m + "self_attention.linear_qkv.weight",
                    [h + f"self_attn.{x}_proj.weight" for x in "qkv"]))
        if arch.qkv_bias:
            out.append((m + "self_attention.linear_qkv.bias", [h + f"self_attn.{x}_proj.bias" for x in "qkv"]))
        if arch.qk_norm:
            out.append((m + "self_attention.q_layernorm.weight", [h + "self_attn.q_norm.weight"]))
            out.append((m + "self_attention.k_layernorm.weight", [h + "self_attn.k_norm.weight"]))
        out.append((m + "self_attention.linear_proj.weight", [h + "self_attn.o_proj.weight"]))
        out.append((pick(m + "pre_mlp_layernorm.weight", m + "mlp.linear_fc1.layer_norm_weight"),
                    [h + "post_attention_layernorm.weight"]))
        out.append((m + "mlp.linear_fc1.weight", [h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"]))
        out.append((m + "mlp.linear_fc2.weight", [h + "mlp.down_proj.weight"]))
    out.append(("decoder.final_layernorm.weight", ["model.norm.weight"]))
    if not arch.tie_embeddings:
        out.append(("output_layer.weight", ["lm_head.weight"]))
    return out


def _pack_qkv(arch: Arch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """HF q [nh*d, ...], k/v [ng*d, ...] -> Megatron [ng*(nh/ng+2)*d, ...] (per group: q heads, k, v)."""
    g, d = arch.num_kv_heads, arch.head_dim
    rest = q.shape[1:]
    q = q.reshape(g, arch.q_per_group * d, *rest)
    return torch.cat([q, k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1).reshape(-1, *rest)


def _unpack_qkv(arch: Arch, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`_pack_qkv`."""
    g, d, qg = arch.num_kv_heads, arch.head_dim, arch.q_per_group
    rest = qkv.shape[1:]
    x = qkv.reshape(g, (qg + 2) * d, *rest)
    q, k, v = x.split([qg * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _is_fc1(name: str) -> bool:
    return name.endswith("mlp.linear_fc1.weight")


def _shard(name: str, full: torch.Tensor, param: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """This TP rank's slice of a full Megatron tensor (fc1: [gate shard; up shard])."""
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    if _is_fc1(name):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, 0)[rank], up.chunk(tp, 0)[rank]], dim=0)
    return full.chunk(tp, dim=param.partition_dim)[rank]


def _unshard(name: str, shards: list[torch.Tensor], param: torch.Tensor) -> torch.Tensor:
    """Full Megatron tensor from every TP rank's shard (inverse of :func:`_shard`)."""
    if len(shards) == 1 or not getattr(param, "tensor_model_parallel", False):
        return shards[0]
    if _is_fc1(name):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=param.partition_dim)


def _to_megatron(arch: Arch, name: str, hf: list[torch.Tensor]) -> torch.Tensor:
    if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
        return _pack_qkv(arch, *hf)
    if _is_fc1(name):
        return torch.cat(hf, dim=0)
    return hf[0]


def _to_hf(arch: Arch, name: str, full: torch.Tensor) -> list[torch.Tensor]:
    if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
        return list(_unpack_qkv(arch, full))
    if _is_fc1(name):
        return list(full.chunk(2, dim=0))
    return [full]


def _unwrap(model):
    """The GPTModel inside Megatron DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


@contextlib.contextmanager
def output_at(model, sel: torch.Tensor) -> Iterator[None]:
    """Within the block, ``model(input_ids [b, s], position_ids, None)`` runs the output layer at
    the positions ``sel`` (``[b, s]`` bool) only and returns ``[1, N, vocab / tp]``: the logits
    of the ``N`` selected positions in row-major order (``logits[sel]`` of the full call), each
    the same numbers as there up to rounding (a row of the output layer's product depends on its
    own hidden state alone; a smaller product may sum in another order). The decoder still runs over every position (attention needs them); what is
    skipped is the output layer's ``[s, hidden] x [hidden, vocab / tp]`` product and its
    ``[b, s, vocab / tp]`` result at prompt and padding positions, which dominate a long agent
    prompt with a short reply (6,000 prompt tokens: 1.2 GB of fp32 logits per sample at
    SmolLM2's vocabulary). A forward hook on the GPTModel's decoder (its output is the final-norm
    hidden state ``[s, b, hidden]``, the output layer's input) keeps the rows of ``sel``."""
    gpt = _unwrap(model)
    if gpt.config.sequence_parallel or gpt.config.context_parallel_size > 1 or gpt.config.mtp_num_layers \
            or not gpt.post_process:
        raise ValueError("output_at needs the whole sequence's hidden state at the output layer: no sequence or "
                         "context parallelism, no multi-token prediction, the last pipeline stage")

    def keep(_module, _args, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.transpose(0, 1)[sel.to(hidden.device)].unsqueeze(1)  # [N, 1, hidden]

    handle = gpt.decoder.register_forward_hook(keep)
    try:
        yield
    finally:
        handle.remove()


# ---------------------------------------------------------------- load / export


def load_hf_weights(model, hf_dir: str | os.PathLike, arch: Arch | None = None) -> None:
    """Copy an HF checkpoint's weights into ``model`` (this process's TP shard only).

    Reads ``model.safetensors`` or the shards named by ``model.safetensors.index.json`` one tensor
    at a time. Raises ``KeyError`` naming a missing HF tensor, ``ValueError`` on a shape mismatch
    and ``RuntimeError`` if a Megatron parameter was left unloaded.
    """
    from megatron.core import parallel_state as ps
    from safetensors import safe_open

    hf_dir = Path(hf_dir)
    arch = arch or Arch.from_hf(hf_dir)
    model = _unwrap(model)
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    index = hf_dir / "model.safetensors.index.json"
    if index.exists():
        where = {k: hf_dir / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    else:
        with safe_open(hf_dir / WEIGHTS_FILE, framework="pt") as f:
            where = {k: hf_dir / WEIGHTS_FILE for k in f.keys()}
    handles: dict[Path, object] = {}

    def get(key: str) -> torch.Tensor:
        if key not in where:
            raise KeyError(f"{hf_dir}: tensor {key} is missing from the checkpoint")
        p = where[key]
        if p not in handles:
            handles[p] = safe_open(p, framework="pt")
        return handles[p].get_tensor(key)

    params = dict(model.named_parameters())
    loaded: set[str] = set()
    with torch.no_grad():
        for mname, hf_names in _names(arch, set(params)):
            param = params[mname]
            full = _to_megatron(arch, mname, [get(n) for n in hf_names])
            part = _shard(mname, full, param, tp, rank)
            if tuple(part.shape) != tuple(param.shape):
                raise ValueError(f"{mname}: checkpoint gives {tuple(part.shape)}, model has {tuple(param.shape)}")
            param.copy_(part.to(param.dtype))
            loaded.add(mname)
    missing = [n for n in params if n not in loaded]
    if missing:
        raise RuntimeError(f"parameters not loaded from {hf_dir}: {missing[:5]}")


def hf_state_dict(model, arch: Arch, dtype: torch.dtype | None = None, dst: int = 0) -> dict[str, torch.Tensor] | None:
    """The model's weights in HF names, gathered across TP ranks onto global rank ``dst``.

    Every rank must call it (collective); ranks other than ``dst`` get ``None``. Tensors are
    contiguous CPU tensors in ``dtype`` (default: the parameters' dtype).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    model = _unwrap(model)
    tp = ps.get_tensor_model_parallel_world_size()
    group = ps.get_tensor_model_parallel_group()
    me = dist.get_rank() if dist.is_initialized() else 0
    params = dict(model.named_parameters())
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for mname, hf_names in _names(arch, set(params)):
            p = params[mname]
            t = p.detach()
            if tp > 1 and getattr(p, "tensor_model_parallel", False):
                shards = [torch.empty_like(t) for _ in range(tp)]
                dist.all_gather(shards, t.contiguous(), group=group)
                full = _unshard(mname, shards, p)
            else:
                full = t
            if me != dst:
                continue
            for n, x in zip(hf_names, _to_hf(arch, mname, full)):
                out[n] = x.to(device="cpu", dtype=dtype or x.dtype).contiguous()
    return out if me == dst else None


@dataclass(frozen=True)
class Exported:
    """A weights folder written by :func:`export_hf`: its path, the sha256 of its safetensors."""

    path: Path
    sha256: str
    bytes: int
    seconds: float


_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
              torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL", torch.float64: "F64"}


def write_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike) -> str:
    """Stream ``tensors`` to ``path`` in the safetensors format and return the file's hex sha256.

    Same file layout as ``safetensors.torch.save_file`` (8-byte little-endian header length,
    JSON header padded to 8 bytes with ``__metadata__ = {"format": "pt"}``, tensors ordered by
    descending item size so every tensor stays aligned), but written tensor by tensor without an
    intermediate copy and hashed on the way: 540 MB in ~0.8 s here instead of ~1.3 s + a re-read.
    The file is fsynced. Raises ``KeyError`` for an unsupported dtype.
    """
    import struct

    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for k in order:
        t = tensors[k]
        n = t.numel() * t.element_size()
        header[k] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    h = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in (struct.pack("<Q", len(raw)), raw):
            f.write(chunk)
            h.update(chunk)
        for k in order:
            t = tensors[k].detach().to("cpu").contiguous()
            buf = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""
            f.write(buf)
            h.update(buf)
        f.flush()
        os.fsync(f.fileno())
    return h.hexdigest()


def _copy_side_files(src: Path, dst: Path, dtype: torch.dtype) -> None:
    """config.json (dtype updated), tokenizer, chat template, generation config from ``src``."""
    cfg = json.loads((src / "config.json").read_text())
    name = {v: k for k, v in _DTYPES.items()}[dtype]
    cfg["dtype"] = name
    cfg.pop("torch_dtype", None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.startswith(("model", "pytorch_model")) \
                and f.suffix in (".json", ".jinja", ".txt", ".model", ".py", ".tiktoken"):
            shutil.copy2(f, dst / f.name)


def write_hf_folder(tensors: dict[str, torch.Tensor], src_dir: str | os.PathLike, out_dir: str | os.PathLike,
                    dtype: torch.dtype) -> Exported:
    """Write an HF folder atomically: ``model.safetensors`` + its sha256 + side files from ``src_dir``.

    Everything is written into a temporary sibling folder, fsynced, then renamed to ``out_dir``,
    so a reader sees either nothing or the complete folder. ``model.safetensors.sha256`` holds
    ``"<hex>  model.safetensors"``. Raises ``FileExistsError`` if ``out_dir`` exists.
    """
    t0 = time.perf_counter()
    src, out = Path(src_dir), Path(out_dir)
    with atomic_folder(out) as tmp:
        digest = write_safetensors(tensors, tmp / WEIGHTS_FILE)
        (tmp / CHECKSUM_FILE).write_text(f"{digest}  {WEIGHTS_FILE}\n")
        _copy_side_files(src, tmp, dtype)
    size = (out / WEIGHTS_FILE).stat().st_size
    return Exported(out, digest, size, time.perf_counter() - t0)


def export_hf(model, arch: Arch, src_dir: str | os.PathLike, out_dir: str | os.PathLike,
              dtype: torch.dtype | None = None) -> Exported | None:
    """Gather the model (collective over TP) and write it as an HF folder on global rank 0.

    ``src_dir`` is the HF folder the model came from (config, tokenizer are copied from it);
    ``dtype`` defaults to the parameters' dtype. Returns :class:`Exported` on rank 0, ``None``
    elsewhere. The folder loads with ``transformers.AutoModelForCausalLM.from_pretrained`` and
    in SGLang's ``/update_weights_from_disk``.
    """
    dtype = dtype or next(_unwrap(model).parameters()).dtype
    tensors = hf_state_dict(model, arch, dtype=dtype)
    if tensors is None:
        return None
    return write_hf_folder(tensors, src_dir, out_dir, dtype)
