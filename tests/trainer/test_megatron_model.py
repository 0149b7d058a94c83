"""Megatron GPTModel <-> HF Llama mapping: logits equal to transformers', export round trip."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline import weightsync
from pipeline.models import resolve_model
from pipeline.trainer import model as M


def _hf_logits(path, ids):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(input_ids=ids).logits


def _mg_logits(model, ids):
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    model.eval()
    with torch.no_grad():
        return model(ids, pos, None)


def _response_logprobs(logits, ids, start):
    lp = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    return lp[:, start - 1:]


@pytest.mark.parametrize("name,tol_logits,tol_lp", [("tiny-random", 1e-5, 1e-6),
                                                   pytest.param("smollm2-135m", 3e-4, 2e-5, marks=pytest.mark.slow(seconds=16))])
def test_logits_match_transformers_and_export_round_trips(runtime, tmp_path, name, tol_logits, tol_lp):
    path = resolve_model(name)
    arch = M.Arch.from_hf(path)
    model = M.build_model(arch)
    M.load_hf_weights(model, path, arch)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, arch.vocab_size, (2, 64), generator=g)
    a, b = _mg_logits(model, ids), _hf_logits(path, ids)
    assert a.shape == b.shape == (2, 64, arch.vocab_size)
    assert (a - b).abs().max().item() < tol_logits
    diff = (_response_logprobs(a, ids, 32) - _response_logprobs(b, ids, 32)).abs().mean().item()
    assert diff < tol_lp, diff

    out = M.export_hf(model, arch, path, tmp_path / "v000001")
    assert out is not None and out.path.is_dir()
    assert weightsync.verify_folder(out.path, out.sha256) == out.sha256
    assert (out.path / "tokenizer.json").exists()
    cfg = json.loads((out.path / "config.json").read_text())
    assert cfg["dtype"] == "float32"
    # exported weights are exactly the source weights (no training happened)
    from safetensors.torch import load_file

    src, dst = load_file(path / "model.safetensors"), load_file(out.path / "model.safetensors")
    assert set(dst) == set(src)
    assert all(torch.equal(src[k], dst[k]) for k in src)
    assert (_hf_logits(out.path, ids) - b).abs().max().item() == 0.0


def test_export_is_atomic_and_checksum_detects_tampering(runtime, tmp_path):
    path = resolve_model("tiny-random")
    arch = M.Arch.from_hf(path)
    model = M.build_model(arch)
    M.load_hf_weights(model, path, arch)
    out = M.export_hf(model, arch, path, tmp_path / "v1")
    assert [p.name for p in tmp_path.iterdir()] == ["v1"]  # no temporary folder left behind
    with pytest.raises(FileExistsError):
        M.export_hf(model, arch, path, tmp_path / "v1")
    with open(out.path / weightsync.WEIGHTS_FILE, "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    with pytest.raises(ValueError, match="sha256"):
        weightsync.verify_folder(out.path, out.sha256)


def test_arch_reads_rope_theta_from_both_config_styles():
    base = {"model_type": "llama", "vocab_size": 32, "hidden_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2, "intermediate_size": 16}
    assert M.Arch.from_hf({**base, "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}).rope_theta == 100000.0
    assert M.Arch.from_hf({**base, "rope_theta": 500000.0}).rope_theta == 500000.0
    assert M.Arch.from_hf(base).rope_theta == 10000.0
    a = M.Arch.from_hf({**base, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 32.0}})
    assert a.rope_scaling_factor == 32.0
    q2 = M.Arch.from_hf({**base, "model_type": "qwen2", "num_key_value_heads": 1})
    assert q2.qkv_bias and not q2.qk_norm and q2.num_kv_heads == 1
    assert M.Arch.from_hf({**base, "model_type": "qwen3", "head_dim": 8}).qk_norm


def test_arch_rejects_unsupported_models():
    base = {"vocab_size": 32, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
            "intermediate_size": 16}
    with pytest.raises(M.UnsupportedModel, match="gpt2"):
        M.Arch.from_hf({**base, "model_type": "gpt2"})
    with pytest.raises(M.UnsupportedModel, match="rope_type"):
        M.Arch.from_hf({**base, "model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4}})
    smol = M.Arch.from_hf(resolve_model("smollm2-135m"))
    smol.check_tp(3)
    with pytest.raises(M.UnsupportedModel, match="9 attention heads"):
        smol.check_tp(2)


def _tiny_variant(tmp_path, model_type: str):
    """A seeded random HF checkpoint of another Llama-family type (qwen2: q/k/v bias; qwen3: qk-norm)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              tie_word_embeddings=False)
    if model_type == "qwen3":
        kw["head_dim"] = 32  # head_dim != hidden / heads
    cfg = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(1)
    m = AutoModelForCausalLM.from_config(cfg).to(torch.float32)
    with torch.no_grad():  # random norms/biases, so a wrong mapping of them shows
        for n, p in m.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    d = tmp_path / model_type
    m.save_pretrained(d)
    return d


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_qwen_variants_match_transformers(runtime, tmp_path, model_type):
    path = _tiny_variant(tmp_path, model_type)
    arch = M.Arch.from_hf(path)
    model = M.build_model(arch)
    M.load_hf_weights(model, path, arch)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(2))
    assert (_mg_logits(model, ids) - _hf_logits(path, ids)).abs().max().item() < 1e-5
    out = M.export_hf(model, arch, path, tmp_path / "out")
    assert (_hf_logits(out.path, ids) - _hf_logits(path, ids)).abs().max().item() == 0.0


def test_output_at_gives_the_selected_rows_of_the_full_logits_and_their_gradients(runtime):
    """``M.output_at``: the same logits at the selected positions as the full call (row-major), the
    same parameter gradients from a loss on them, an empty selection gives no rows, and the hook
    is gone after the block (the next call is the full one again)."""
    path = resolve_model("tiny-random")
    arch = M.Arch.from_hf(path)
    model = M.build_model(arch)
    M.load_hf_weights(model, path, arch)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, arch.vocab_size, (2, 24), generator=g)
    pos = torch.arange(24).unsqueeze(0).expand_as(ids)
    sel = torch.zeros(2, 24, dtype=torch.bool)
    sel[0, 10:15], sel[1, 3:4], sel[1, 20:24] = True, True, True

    def grads(loss):
        model.zero_grad(set_to_none=True)
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    full = model(ids, pos, None)
    want = full[sel]
    g_full = grads(torch.log_softmax(want, -1)[:, 7].sum())
    with M.output_at(model, sel):
        rows = model(ids, pos, None)
    assert rows.shape == (1, int(sel.sum()), arch.vocab_size)
    assert torch.equal(rows[0], want.detach()) or (rows[0] - want).abs().max().item() < 1e-6
    g_rows = grads(torch.log_softmax(rows[0], -1)[:, 7].sum())
    assert g_rows.keys() == g_full.keys()
    for name in g_full:
        diff, scale = (g_rows[name] - g_full[name]).abs().max().item(), g_full[name].abs().max().item()
        assert diff <= 1e-5 * scale, (name, diff, scale)  # fp32 sums in another order
    with torch.no_grad(), M.output_at(model, torch.zeros(2, 24, dtype=torch.bool)):
        assert model(ids, pos, None).shape == (1, 0, arch.vocab_size)
    with torch.no_grad():
        assert model(ids, pos, None).shape == (2, 24, arch.vocab_size)  # the hook was removed
