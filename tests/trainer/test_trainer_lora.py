"""LoRA in the Megatron trainer (``trainer.lora``): exact gradients, frozen shared base, one
optimizer state per adapter, PEFT export.

The gradient reference is written from LoRA's definition, without Megatron and without PEFT:
the merged weight ``W + (alpha / r) * B @ A`` substituted into the Hugging Face model
(``torch.func.functional_call``), the PPO-clip objective of the sampled response tokens
aggregated as a sum of per-sample means, and autograd. The Megatron path computes
``W x + scaling * B (A x)`` inside tensor-parallel layers with fused q/k/v and gate/up outputs, so
the two share nothing but the definition. TP=2 and DP=2 are checked against this file's TP=1
numbers in ``tests/test_trainer_lora_tp.py``.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from pipeline import events, weightsync
from pipeline.config import LORA_TARGETS, ConfigError, load_config
from pipeline.testing.trainer import policy_trainer, random_adapter

LORA = {"rank": 4, "alpha": 12}  # scaling 3: a wrong scaling cannot pass


def _sample(i, n_prompt=6, n_resp=4, reward=1.0, rollout=None):
    rng = random.Random(1000 + i)
    toks = [rng.randrange(1, 49152) for _ in range(n_prompt + n_resp)]
    return events.Sample(sample_id=f"l:{i}", session_id=f"l{i}", turn_index=0, tokens=toks, response_length=n_resp,
                         reward=reward, rollout_log_probs=rollout or [-1.0] * n_resp)


def _hf_model():
    from transformers import AutoModelForCausalLM

    from pipeline.models import resolve_model

    return AutoModelForCausalLM.from_pretrained(resolve_model("tiny-random"), dtype=torch.float32).eval()


def _merged(hf, tensors: dict, scaling: float) -> dict:
    """HF parameter name -> ``W + scaling * B @ A`` for every adapted projection (the definition)."""
    params = dict(hf.named_parameters())
    out = {}
    for k in tensors:
        if k.endswith(".lora_A.weight"):
            module = k.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = tensors[k.replace("lora_A", "lora_B")]
            out[module + ".weight"] = params[module + ".weight"] + scaling * b @ tensors[k]
    return out


def _ref_log_probs(hf, weights: dict, s: events.Sample) -> torch.Tensor:
    """``[response_length]`` log-probs of the response tokens under the HF model with ``weights``."""
    from torch.func import functional_call

    ids = torch.tensor([s.tokens])
    logits = functional_call(hf, weights, (ids,)).logits[0]
    n = len(s.tokens)
    lp = torch.log_softmax(logits[n - 1 - s.response_length:n - 1] / s.rollout_temperature, dim=-1)
    return lp.gather(-1, ids[0, n - s.response_length:, None])[:, 0]


def _reference(hf, tensors: dict, scaling: float, samples, eps_low=0.2, eps_high=0.28):
    """Loss and its gradients w.r.t. every A and B, from the definitions (no Megatron, no PEFT):
    PPO-clip ``max(-adv * ratio, -adv * clip(ratio, 1 - eps_low, 1 + eps_high))`` per response token,
    ``ratio = exp(logp - rollout)``, ``adv`` = the sample's reward, mean over tokens, sum over
    samples / number of samples."""
    leaves = {k: v.clone().requires_grad_(True) for k, v in tensors.items()}
    total = 0.0
    for s in samples:
        lp = _ref_log_probs(hf, _merged(hf, leaves, scaling), s)
        ratio = torch.exp(lp - torch.tensor(s.rollout_log_probs))
        per_token = torch.maximum(-s.reward * ratio, -s.reward * ratio.clamp(1 - eps_low, 1 + eps_high))
        total = total + per_token.mean()
    loss = total / len(samples)
    loss.backward()
    return float(loss), {k: v.grad for k, v in leaves.items()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the reference's largest entry."""
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _rel_norm(got: dict, ref: dict) -> float:
    """``||got - ref|| / ||ref||`` over every tensor together (float64)."""
    num = sum(float(((got[k].double() - ref[k].double()) ** 2).sum()) for k in ref)
    return (num / sum(float((ref[k].double() ** 2).sum()) for k in ref)) ** 0.5


def test_config_defaults_off_and_bounds():
    assert load_config(None).trainer.lora is None  # full fine-tuning unless asked
    lora = load_config(None, overrides=["trainer.lora={}"]).trainer.lora
    assert (lora.rank, lora.alpha, lora.targets) == (16, 32, list(LORA_TARGETS))  # OpenClaw-RL's LoRA scripts
    assert load_config(None, overrides=["trainer.lora.rank=8"]).trainer.lora.rank == 8
    for bad in ("trainer.lora.targets=[]", "trainer.lora.targets=[q_proj, q_proj]",
                "trainer.lora.targets=[lm_head]", "trainer.lora.rank=0"):
        with pytest.raises(ConfigError, match="trainer.lora"):
            load_config(None, overrides=[bad])


def test_fresh_adapter_is_the_base_exactly_and_only_adapters_train(runtime):
    pt = policy_trainer(runtime, lora=LORA)
    pt.add_adapter("t1")
    ad = pt.lora.adapters["t1"]
    assert all(bool((b == 0).all()) for b in ad.B.values())
    for key, a in ad.A.items():  # PEFT's Kaiming-uniform init: U(-1/sqrt(in), 1/sqrt(in)), not zero
        bound = 1 / a.shape[1] ** 0.5
        assert float(a.abs().max()) <= bound and float(a.abs().max()) > bound / 2, key
    ids = torch.randint(0, 49152, (2, 12), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(12).expand(2, 12)
    pt.model.eval()
    with torch.no_grad():
        base = pt.model(ids, pos, None)
        with pt.lora.using("t1"):
            fresh = pt.model(ids, pos, None)
    assert torch.equal(base, fresh)
    # the base is frozen; the optimizer of an adapter holds exactly that adapter's parameters
    assert not any(p.requires_grad for p in pt.model.parameters())
    assert all(p.requires_grad for p in ad.parameters())
    held = [p for g in pt.trainables["t1"].optimizer.param_groups for p in g["params"]]
    assert {id(p) for p in held} == {id(p) for p in ad.parameters()}
    arch = pt.arch
    h, q, kv, f = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.ffn_hidden_size
    per_layer = sum(4 * (i + o) for o, i in ((q, h), (kv, h), (kv, h), (h, q), (f, h), (f, h), (h, f)))
    assert sum(p.numel() for p in ad.parameters()) == arch.num_layers * per_layer


def test_loss_and_gradients_match_the_lora_definition(runtime):
    hf = _hf_model()
    pt = policy_trainer(runtime, lora=LORA, clip_grad=0.0, micro_batch_size=2)
    tensors = random_adapter(pt, "t1", seed=1)
    samples = [_sample(i, n_prompt=4 + i, n_resp=3 + i % 2, reward=(-1.0) ** i) for i in range(3)]
    with torch.no_grad():  # rollout log-probs near the current policy's, so most ratios are unclipped
        merged = _merged(hf, tensors, 3.0)
        for s in samples:
            lp = _ref_log_probs(hf, merged, s)
            s.rollout_log_probs = (lp + 0.1 * torch.linspace(-1, 1, len(lp))).clamp(max=0).tolist()
    ref_loss, ref_grads = _reference(hf, tensors, 3.0, samples)
    res = pt.train_batch(samples, adapter="t1")
    grads = pt.lora.hf_tensors("t1", grads=True)
    assert set(grads) == set(ref_grads)
    assert abs(res.metrics["loss"] - ref_loss) <= 1e-5 * abs(ref_loss), (res.metrics["loss"], ref_loss)
    # fp32 rounding (attention, softmax: measured against a float64 reference too) leaves ~1e-5 of
    # a tensor's largest entry; the whole gradient matches to 1e-5 of its norm, a misplaced or
    # mis-scaled adapter would be off by O(1)
    assert _rel_norm(grads, ref_grads) <= 1e-5, _rel_norm(grads, ref_grads)
    worst = max(_rel(grads[k], ref_grads[k]) for k in grads)
    assert worst <= 1e-4, worst
    assert min(float(g.abs().max()) for g in ref_grads.values()) > 0  # every A and B gets a gradient


def test_a_fresh_adapter_learns_b_first_and_moves_its_log_probs(runtime):
    pt = policy_trainer(runtime, lora=LORA)
    samples = [_sample(0, reward=1.0), _sample(1, reward=-1.0)]
    base = pt.log_probs(samples)
    for s, lp in zip(samples, base):
        s.rollout_log_probs = lp
    pt.add_adapter("t1")
    a0 = {k: v.detach().clone() for k, v in pt.lora.adapters["t1"].A.items()}
    res = pt.train_batch(samples, adapter="t1")
    grads = pt.lora.hf_tensors("t1", grads=True)
    # with B = 0 the definition gives dL/dA = 0 exactly: A does not move on the first step
    assert all(float(g.abs().max()) == 0 for k, g in grads.items() if "lora_A" in k)
    assert all(torch.equal(a0[k], v) for k, v in pt.lora.adapters["t1"].A.items())
    after = pt.log_probs(samples, adapter="t1")
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert not res.skipped and pt.adapter_steps("t1") == 1
    assert mean(after[0]) > mean(base[0]) and mean(after[1]) < mean(base[1])
    assert pt.log_probs(samples) == base  # the base (adapter None) is untouched
    assert pt.log_probs(samples, reference=True) == base  # with LoRA the reference is the base


def _snapshot(pt, name):
    t = pt.trainables[name]
    weights = {k: v.detach().clone() for k, v in pt.lora.adapters[name].state_dict().items()}
    opt = t.optimizer.state_dict()
    state = {f"{i}.{k}": v.clone() for i, s in opt["state"].items() for k, v in s.items() if torch.is_tensor(v)}
    return weights, state, t.steps


def test_a_step_of_one_tenant_leaves_the_other_bit_identical(runtime):
    pt = policy_trainer(runtime, lora=LORA)
    a_batch = [_sample(0, reward=1.0), _sample(1, reward=-1.0)]
    b_batch = [_sample(2, reward=-1.0), _sample(3, reward=1.0)]
    base = {k: v.clone() for k, v in pt.model.state_dict().items() if torch.is_tensor(v)}
    pt.train_batch(b_batch, adapter="b")
    pt.train_batch(a_batch, adapter="a")
    wb, ob, nb = _snapshot(pt, "b")
    wa, oa, _ = _snapshot(pt, "a")
    assert ob, "tenant b has Adam moments to compare"
    for _ in range(2):
        pt.train_batch(a_batch, adapter="a")
    wb2, ob2, nb2 = _snapshot(pt, "b")
    assert nb2 == nb == 1 and pt.adapter_steps("a") == 3
    assert wb2.keys() == wb.keys() and all(torch.equal(wb[k], wb2[k]) for k in wb)
    assert ob2.keys() == ob.keys() and all(torch.equal(ob[k], ob2[k]) for k in ob)
    wa2, oa2, _ = _snapshot(pt, "a")  # and tenant a did move (the test can fail)
    assert any(not torch.equal(wa[k], wa2[k]) for k in wa) and any(not torch.equal(oa[k], oa2[k]) for k in oa)
    assert all(torch.equal(v, pt.model.state_dict()[k]) for k, v in base.items())  # the shared base never moves
    assert pt.adapters() == ["a", "b"]


def test_adapter_use_must_match_the_config(runtime):
    full = policy_trainer(runtime)
    with pytest.raises(ValueError, match="trainer.lora is off"):
        full.train_batch([_sample(0)], adapter="t1")
    with pytest.raises(ValueError, match="trainer.lora is off"):
        full.export_adapter("t1", "/nonexistent")
    pt = policy_trainer(runtime, lora=LORA)
    with pytest.raises(ValueError, match="needs adapter"):
        pt.train_batch([_sample(0)])
    with pytest.raises(KeyError, match="no LoRA adapter"):
        pt.log_probs([_sample(0)], adapter="never-trained")
    with pytest.raises(ValueError, match="base is frozen"):
        pt.export("/nonexistent")
    with pytest.raises(ValueError, match="checkpoint is of full fine-tuning"):
        pt.load_state_dict(full.state_dict())
    with pytest.raises(ValueError, match="adapter name"):
        pt.add_adapter("")


def test_export_is_peft_format_atomic_and_its_version_is_its_sha256(runtime, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from pipeline.trainer import model as M

    pt = policy_trainer(runtime, lora=LORA)
    tensors = random_adapter(pt, "t1", seed=2)
    out = pt.export_adapter("t1", tmp_path / "t1-v1")
    assert sorted(f.name for f in out.path.iterdir()) == sorted(
        [weightsync.ADAPTER_FILE, weightsync.ADAPTER_CHECKSUM_FILE, weightsync.ADAPTER_CONFIG])
    assert out.sha256 == weightsync.adapter_version(out.path)
    assert weightsync.verify_adapter(out.path, out.sha256) == out.sha256
    cfg = json.loads((out.path / weightsync.ADAPTER_CONFIG).read_text())
    assert (cfg["peft_type"], cfg["r"], cfg["lora_alpha"], cfg["bias"]) == ("LORA", 4, 12, "none")
    assert cfg["target_modules"] == list(LORA_TARGETS) and cfg["base_model_name_or_path"] == "tiny-random"
    saved = load_file(out.path / weightsync.ADAPTER_FILE)
    assert saved.keys() == tensors.keys() and all(torch.equal(saved[k], tensors[k]) for k in saved)
    assert saved["base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"].shape == (32, 4)
    assert saved["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"].shape == (4, 128)
    # the same content is the same version; a trained adapter is another
    assert pt.export_adapter("t1", tmp_path / "again").sha256 == out.sha256
    with pytest.raises(FileExistsError):
        pt.export_adapter("t1", out.path)
    # a failed write leaves neither the folder nor a temporary one
    def boom(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(M, "write_safetensors", boom)
    with pytest.raises(OSError, match="disk full"):
        pt.export_adapter("t1", tmp_path / "torn")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "t1-v1"]


def test_exported_adapter_loads_in_peft_with_the_megatron_logits(runtime, tmp_path):
    _peft_parity(runtime, tmp_path, "tiny-random", seq=24)


@pytest.mark.slow(seconds=60)
def test_exported_adapter_loads_in_peft_with_the_megatron_logits_smollm2(runtime, tmp_path):
    _peft_parity(runtime, tmp_path, "smollm2-135m", seq=16)


def _peft_parity(runtime, tmp_path, model: str, seq: int) -> None:
    """Train an adapter one step (plus random weights, so every A and B is non-zero), export it,
    load it with PEFT onto the HF model: the logits agree within 1e-4, or (SmolLM2, logits of
    magnitude ~30 through 30 layers) within twice the base mapping's own fp32 difference, 1.2e-4
    without any adapter: the adapter adds no error beyond fp32 rounding."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from pipeline.config import load_config
    from pipeline.models import resolve_model
    from pipeline.trainer.policy import PolicyTrainer

    path = resolve_model(model)
    cfg = load_config(None, trainer={"model": model, "lr": 1e-3, "micro_batch_size": 2, "lora": LORA}).trainer
    pt = PolicyTrainer(cfg, path, runtime)
    random_adapter(pt, "t1", seed=3)
    pt.train_batch([_sample(0, reward=1.0), _sample(1, reward=-1.0)], adapter="t1")
    out = pt.export_adapter("t1", tmp_path / f"{model}-t1")
    ids = torch.randint(0, 49152, (2, seq), generator=torch.Generator().manual_seed(4))
    pt.model.eval()
    with torch.no_grad():
        mine_base = pt.model(ids, torch.arange(seq).expand(2, seq), None)
        with pt.lora.using("t1"):
            mine = pt.model(ids, torch.arange(seq).expand(2, seq), None)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        base = hf(input_ids=ids).logits
        theirs = PeftModel.from_pretrained(hf, out.path).eval()(input_ids=ids).logits
    err, base_err = float((mine - theirs).abs().max()), float((mine_base - base).abs().max())
    mean = float((mine - theirs).abs().mean())
    print(f"{model}: PEFT vs Megatron logits with the adapter max |diff| {err:.2e}, mean {mean:.2e} "
          f"(without: max {base_err:.2e})")
    # twice the base mapping's own difference: the trained adapter itself moves with the fp32 summation order of
    # its gradients (Adam's first step is +-lr for any gradient above eps, so a near-zero gradient's rounding picks
    # the sign): SmolLM2 measured max 1.03e-4 with the output layer at every position, 1.86e-4 with it at the
    # reply's positions only (model.output_at), against 1.16e-4 without an adapter; the mean stays below 2e-5
    assert err <= max(1e-4, 2 * base_err), (err, base_err)
    assert mean <= 2e-5, mean
    assert float((theirs - base).abs().max()) > 1e-2  # the adapter matters (the check can fail)


def test_resume_from_export_and_from_checkpoint(runtime, tmp_path):
    pt = policy_trainer(runtime, lora=LORA)
    batch = [_sample(0, reward=1.0), _sample(1, reward=-1.0)]
    random_adapter(pt, "t1", seed=5)
    pt.train_batch(batch, adapter="t1")
    out = pt.export_adapter("t1", tmp_path / "t1")
    # from the exported folder: same weights, fresh optimizer state
    other = policy_trainer(runtime, lora=LORA)
    assert other.load_adapter("t1", out.path, out.sha256) == out.sha256
    assert other.log_probs(batch, adapter="t1") == pt.log_probs(batch, adapter="t1")
    assert other.adapter_steps("t1") == 0
    # from a checkpoint (the trainer's own, on disk): the same weights and Adam moments, so the
    # next step is the same
    from pipeline.trainer import checkpoint as C

    C.save(tmp_path / "ckpt", 1, runtime, pt.state_dict(), {"policy_version": 1})
    again = policy_trainer(runtime, lora=LORA)
    again.load_state_dict(C.load(C.latest(tmp_path / "ckpt"), runtime)[1])
    assert again.adapters() == ["t1"] and again.adapter_steps("t1") == 1
    pt.train_batch(batch, adapter="t1")
    again.train_batch(batch, adapter="t1")
    assert again.log_probs(batch, adapter="t1") == pt.log_probs(batch, adapter="t1")
    # a tampered folder, or one of another rank, is refused
    (out.path / weightsync.ADAPTER_FILE).write_bytes((out.path / weightsync.ADAPTER_FILE).read_bytes()[:-4] + b"\0" * 4)
    with pytest.raises(ValueError, match="sha256"):
        other.load_adapter("t2", out.path)
    wide = policy_trainer(runtime, lora={"rank": 8, "alpha": 12})
    good = pt.export_adapter("t1", tmp_path / "t1-b")
    with pytest.raises(ValueError, match="r is 4"):
        wide.load_adapter("t1", good.path)


def test_the_trainer_stage_refuses_lora_until_it_trains_adapters():
    """``trainer.lora`` is refused at the stage's start with a config error, not accepted and then
    failing on the first batch (the stage does not route tenants to adapters yet)."""
    from pipeline.trainer.stage import TrainerStage

    with pytest.raises(ConfigError, match="trainer.lora"):
        TrainerStage(load_config(None, trainer={"lora": {"rank": 4}}))
    TrainerStage(load_config(None))  # full fine-tuning: constructed as before


def test_reset_optimizer_forgets_one_adapters_moments_and_keeps_its_weights(runtime):
    pt = policy_trainer(runtime, lora=LORA)
    batch = [_sample(0, reward=1.0), _sample(1, reward=-1.0)]
    pt.train_batch(batch, adapter="a")
    pt.train_batch(batch, adapter="b")
    wa, oa, _ = _snapshot(pt, "a")
    _, ob, _ = _snapshot(pt, "b")
    assert oa and ob
    pt.reset_optimizer("a")
    wa2, oa2, _ = _snapshot(pt, "a")
    _, ob2, _ = _snapshot(pt, "b")
    assert oa2 == {} and all(torch.equal(wa[k], wa2[k]) for k in wa)  # moments gone, weights kept
    assert ob2.keys() == ob.keys() and all(torch.equal(ob[k], ob2[k]) for k in ob)  # the other tenant's kept
    pt.train_batch(batch, adapter="a")  # and it trains on from there
    assert _snapshot(pt, "a")[1]
