"""vLLM as a real engine (issue 38): :class:`pipeline.engine_api.vllm.VllmClient` against a real
vLLM server (its CPU build, ``deploy/install-vllm.sh``), one per test file (~30 s to start),
serving ``tiny-random-64`` in float32.

References are independent of vLLM and of the client: log-probs recomputed with transformers from
the weights folder itself (``hf_logprobs``), adapters written in the trainer's own export format
and applied by hand in the reference. Skipped, saying why, when vLLM is not installed.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch

from pipeline.engine_api.backend import adapter_model, engine_client
from pipeline.engine_api.errors import EngineError
from pipeline.engine_api.vllm import WeightsFolderError, check_weights_folder, serve_command, serve_env
from pipeline.models import resolve_model
from pipeline.testing.vllm import require_vllm, running_vllm
from pipeline.weightsync import sha256_file

MODEL = "tiny-random-64"
MSGS = [{"role": "user", "content": "Name three fruits and say why you like them."}]

pytestmark = pytest.mark.slow


# ---------------------------------------------------------------------------------- helpers


def hf_logprobs(folder: Path, ids: list[int], start: int, lora: dict | None = None) -> list[float]:
    """log softmax of the logits of ``ids[start:]`` under the HF model in ``folder`` (float32),
    with a PEFT adapter's ``lora`` tensors merged by hand (``W + (alpha / r) B A``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    if lora is not None:
        scale = lora["config"]["lora_alpha"] / lora["config"]["r"]
        params = dict(model.named_parameters())
        for name, a in lora["tensors"].items():
            if ".lora_A." not in name:
                continue
            b = lora["tensors"][name.replace(".lora_A.", ".lora_B.")]
            target = name.replace("base_model.model.", "").replace(".lora_A.weight", ".weight")
            with torch.no_grad():
                params[target] += scale * (b @ a)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[i - 1, ids[i]]) for i in range(start, len(ids))]


def perturbed_copy(base: Path, out: Path, factor: float = 1.5) -> Path:
    """``base`` with every MLP down-projection scaled by ``factor`` (same tensors and shapes)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, out)
    sd = load_file(base / "model.safetensors")
    for k in sd:
        if "down_proj" in k:
            sd[k] = sd[k] * factor
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    return out


def write_adapter(out: Path, base: Path, seed: int = 0, rank: int = 8) -> dict:
    """A random LoRA adapter (q/v projections) for ``base`` in the trainer's export format
    (:func:`pipeline.trainer.lora.write_adapter_folder`, PEFT names); returns its config and tensors."""
    from pipeline.trainer.lora import write_adapter_folder

    cfg = json.loads((base / "config.json").read_text())
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // heads
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for target, rows in (("q_proj", heads * hd), ("v_proj", kv * hd)):
            pre = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(rank, h, generator=g) / h ** 0.5
            tensors[f"{pre}.lora_B.weight"] = torch.randn(rows, rank, generator=g) * 0.5
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": ["q_proj", "v_proj"], "base_model_name_or_path": str(base), "bias": "none",
              "lora_dropout": 0.0, "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
              "init_lora_weights": True, "inference_mode": True, "modules_to_save": None}
    write_adapter_folder(tensors, config, out)
    return {"config": config, "tensors": tensors}


def run(coro):
    return asyncio.run(coro)


async def _with_client(url: str, call):
    async with engine_client("vllm", url, 120) as c:
        return await call(c)


def ask(url: str, call):
    """``await call(VllmClient)`` on a fresh client."""
    return run(_with_client(url, call))


def ids_and_logprobs(answer: dict) -> tuple[list[int], list[int], list[float]]:
    ch = answer["choices"][0]
    prompt = answer.get("prompt_token_ids") or ch.get("prompt_token_ids")
    return list(prompt), list(ch["token_ids"]), [x["logprob"] for x in ch["logprobs"]["content"]]


# ---------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def vllm_url():
    require_vllm()
    with running_vllm(MODEL, max_lora_rank=16) as url:
        yield url


@pytest.fixture(scope="module")
def base() -> Path:
    return resolve_model(MODEL)


# ---------------------------------------------------------------------------------- unit (no server)


def test_serve_command_has_what_the_client_needs(tmp_path):
    cmd = serve_command("/py", tmp_path, 1234, enable_lora=True, max_lora_rank=16, served_model_name="m")
    with_adapters = serve_command("/py", tmp_path, 1, lora_modules={"alice@ab": "/a", "bob@cd": "/b"})
    assert with_adapters[with_adapters.index("--lora-modules") + 1:][:2] == ["alice@ab=/a", "bob@cd=/b"]
    assert "--enable-lora" in with_adapters
    assert cmd[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    for flag in ("--enable-lora", "--enable-auto-tool-choice", "--served-model-name"):
        assert flag in cmd
    assert cmd[cmd.index("--dtype") + 1] == "float32" and cmd[cmd.index("--port") + 1] == "1234"
    env = serve_env()
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


def test_serve_env_turns_ahead_of_time_compilation_off_unless_the_caller_sets_it(monkeypatch):
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    assert serve_env()["VLLM_USE_AOT_COMPILE"] == "0"  # the compile cache is read: no compile at every start
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    assert serve_env()["VLLM_USE_AOT_COMPILE"] == "1"


def test_adapter_model_per_engine_kind():
    assert adapter_model("vllm", "base", "alice-v3") == "alice-v3"
    assert adapter_model("sglang", "base", "alice-v3") == "base:alice-v3"
    assert adapter_model("native", "base", "alice-v3") == "base:alice-v3"
    with pytest.raises(ValueError):
        engine_client("tgi", "http://x")


def test_weights_folder_checks(tmp_path, base):
    """Every kind of bad folder is refused before anything is sent; a good one passes."""
    from safetensors.torch import load_file, save_file

    good = perturbed_copy(base, tmp_path / "good")
    check_weights_folder(good, base, sha256_file(good / "model.safetensors"))
    with pytest.raises(WeightsFolderError, match="not a model folder"):
        check_weights_folder(tmp_path / "nowhere", base)
    with pytest.raises(WeightsFolderError):
        check_weights_folder(good, base, "0" * 64)  # another checksum
    sd = load_file(good / "model.safetensors")
    for name, change in (("missing", lambda d, k: d.pop(k)),
                         ("shape", lambda d, k: d.__setitem__(k, d[k][:-1])),
                         ("extra", lambda d, k: d.__setitem__(k + ".extra", d[k].clone()))):
        bad = tmp_path / name
        shutil.copytree(good, bad)
        d = dict(sd)
        change(d, next(k for k in d if "down_proj" in k))
        save_file(d, bad / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(WeightsFolderError):
            check_weights_folder(bad, base)
    half = tmp_path / "half"  # another dtype is no refusal: vLLM casts what it loads
    shutil.copytree(good, half)
    save_file({k: v.to(torch.float16) for k, v in sd.items()}, half / "model.safetensors", metadata={"format": "pt"})
    check_weights_folder(half, base)
    # weights vLLM would read that the sha256 does not cover: an index naming other shards, another shard
    for extra, text in (("model.safetensors.index.json", '{"weight_map": {"model.embed_tokens.weight": '
                         '"model-00001-of-00002.safetensors"}}'), ("model-extra.safetensors", None)):
        folder = tmp_path / f"with-{extra}"
        shutil.copytree(good, folder)
        if text is None:
            save_file({"a.weight": torch.zeros(2)}, folder / extra)
        else:
            (folder / extra).write_text(text)
        with pytest.raises(WeightsFolderError, match="besides model.safetensors"):
            check_weights_folder(folder, base, sha256_file(folder / "model.safetensors"))
    torn = tmp_path / "torn"
    shutil.copytree(good, torn)
    (torn / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes()[:1000])
    with pytest.raises(WeightsFolderError, match="not a readable safetensors"):
        check_weights_folder(torn, base)


# ---------------------------------------------------------------------------------- the real server


def test_chat_stream_and_unary_give_the_same_ids_and_logprobs(vllm_url, base):
    """Greedy: the streamed and the non-streamed answer have the same prompt ids, token ids and
    log-probs (one per token); they are vLLM's raw log-probs (an independent HF forward), and the
    client reports them as temperature 1 with the engine's version."""
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 12, "temperature": 0, "logprobs": True,
            "ignore_eos": True}
    unary = ask(vllm_url, lambda c: c.chat(body))

    async def stream(c):
        return [ch async for ch in c.chat_stream(body, token_ids=True)]

    chunks = ask(vllm_url, stream)
    prompt, ids, lps = ids_and_logprobs(unary)
    s_prompt = next(c["prompt_token_ids"] for c in chunks if c.get("prompt_token_ids"))
    s_ids = [t for c in chunks for ch in c.get("choices") or [] for t in ch.get("token_ids") or []]
    s_lps = [x["logprob"] for c in chunks for ch in c.get("choices") or []
             for x in ((ch.get("logprobs") or {}).get("content") or [])]
    assert len(ids) == len(lps) == 12
    assert (s_prompt, s_ids) == (prompt, ids)
    assert s_lps == pytest.approx(lps, abs=1e-5)
    assert unary["metadata"] == {"weight_version": "0", "sampling_params": {"temperature": 1.0}}
    assert chunks[-1]["metadata"] == unary["metadata"]
    assert lps == pytest.approx(hf_logprobs(base, prompt + ids, len(prompt)), abs=2e-4)


def test_score_matches_sampled_logprobs_and_refuses_other_temperatures(vllm_url):
    """Scoring the sampled sequence gives the sampled log-probs (float32); a temperature the
    engine cannot score at is refused (400, not retried), never answered at T = 1."""
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 16, "temperature": 1.0, "seed": 3, "logprobs": True}
    prompt, ids, lps = ids_and_logprobs(ask(vllm_url, lambda c: c.chat(body)))
    res = ask(vllm_url, lambda c: c.score_result(prompt + ids, len(prompt), top_logprobs_num=3))
    assert res.logprobs == pytest.approx(lps, abs=1e-4)
    assert res.weight_version == "0"
    assert all(len(row) == 3 and row == sorted(row, key=lambda t: -t[1]) for row in res.top)
    with pytest.raises(EngineError) as e:
        ask(vllm_url, lambda c: c.score_result(prompt + ids, len(prompt), temperature=0.5))
    assert e.value.status == 400 and not e.value.retryable


def test_bad_folder_is_refused_and_the_server_keeps_serving(vllm_url, base, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = perturbed_copy(base, tmp_path / "bad")
    sd = load_file(bad / "model.safetensors")
    sd.pop(next(k for k in sd if "down_proj" in k))
    save_file(sd, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightsFolderError):
        ask(vllm_url, lambda c: c.update_weights_from_disk(str(bad), 5))
    with pytest.raises(WeightsFolderError):
        ask(vllm_url, lambda c: c.update_weights_from_disk(str(tmp_path / "missing"), 5))
    assert ask(vllm_url, lambda c: c.health())
    assert ask(vllm_url, lambda c: c.weight_version()) == "0"


def test_full_reload_serves_the_new_weights_with_a_fresh_prefix_cache(vllm_url, base, tmp_path):
    """A prompt cached under the old weights, asked again after a reload, is answered from the new
    weights only (the independent HF forward of the new folder); the version is the one given;
    the old weights come back the same way."""
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 8, "temperature": 0, "logprobs": True,
            "ignore_eos": True}
    before = ids_and_logprobs(ask(vllm_url, lambda c: c.chat(body)))  # the prompt is in the prefix cache now
    new = perturbed_copy(base, tmp_path / "v7", factor=3.0)
    out = ask(vllm_url, lambda c: c.update_weights_from_disk(str(new), 7, sha256=sha256_file(new / "model.safetensors")))
    assert out["success"] and out["weight_version"] == "7"
    try:
        answer = ask(vllm_url, lambda c: c.chat(body))
        prompt, ids, lps = ids_and_logprobs(answer)
        assert answer["metadata"]["weight_version"] == "7"
        assert prompt == before[0]
        assert lps == pytest.approx(hf_logprobs(new, prompt + ids, len(prompt)), abs=2e-4)
        assert lps != pytest.approx(hf_logprobs(base, prompt + ids, len(prompt)), abs=1e-2)
    finally:
        ask(vllm_url, lambda c: c.update_weights_from_disk(str(base), 8))
    again = ids_and_logprobs(ask(vllm_url, lambda c: c.chat(body)))
    assert again[1] == before[1] and again[2] == pytest.approx(before[2], abs=1e-5)


def test_lora_adapter_load_serve_unload(vllm_url, base, tmp_path):
    """An adapter in the trainer's export format loads, serves the requests that name it (the
    hand-merged HF reference) and not the others, and unloads; a second unload is a 400."""
    lora = write_adapter(tmp_path / "alice-v1", base, seed=1)
    name = "t-alice-v1"
    ask(vllm_url, lambda c: c.load_lora_adapter(name, str(tmp_path / "alice-v1")))
    try:
        body = {"model": name, "messages": MSGS, "max_tokens": 8, "temperature": 0, "logprobs": True,
                "ignore_eos": True}
        prompt, ids, lps = ids_and_logprobs(ask(vllm_url, lambda c: c.chat(body)))
        assert lps == pytest.approx(hf_logprobs(base, prompt + ids, len(prompt), lora), abs=5e-4)
        scored = ask(vllm_url, lambda c: c.score_result(prompt + ids, len(prompt), lora_path=name))
        assert scored.logprobs == pytest.approx(lps, abs=1e-4)
        plain = ask(vllm_url, lambda c: c.score_result(prompt + ids, len(prompt)))
        assert plain.logprobs == pytest.approx(hf_logprobs(base, prompt + ids, len(prompt)), abs=2e-4)
        cards = ask(vllm_url, lambda c: c.models())["data"]
        assert any(m["id"] == name and m.get("parent") for m in cards)
    finally:
        ask(vllm_url, lambda c: c.unload_lora_adapter(name))
    with pytest.raises(EngineError) as e:
        ask(vllm_url, lambda c: c.unload_lora_adapter(name))
    assert e.value.status == 400


def test_a_reload_that_fails_half_way_leaves_no_version_and_generation_resumed(vllm_url, base, tmp_path,
                                                                               monkeypatch):
    """The version vLLM reports while its weights change is no version: if the reload fails after
    the weights moved (here: setting the new version fails), turns served afterwards are of an
    unknown version (None), never labelled with the old one; generation is resumed either way."""
    from pipeline.engine_api.vllm import VllmClient

    new = perturbed_copy(base, tmp_path / "half", factor=2.0)
    real = VllmClient._set_version

    async def failing(self, version, timeout_s):
        if not version.startswith("reloading:"):
            raise EngineError("update_weight_version failed (test)", 504, None)
        await real(self, version, timeout_s)

    monkeypatch.setattr(VllmClient, "_set_version", failing)
    with pytest.raises(EngineError):
        ask(vllm_url, lambda c: c.update_weights_from_disk(str(new), 11))
    monkeypatch.setattr(VllmClient, "_set_version", real)
    assert ask(vllm_url, lambda c: c.weight_version()) is None
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 4, "logprobs": True}
    answer = ask(vllm_url, lambda c: c.chat(body))  # resumed: it answers, as of no known version
    assert answer["metadata"]["weight_version"] is None
    ask(vllm_url, lambda c: c.update_weights_from_disk(str(base), 12))
    assert ask(vllm_url, lambda c: c.weight_version()) == "12"
