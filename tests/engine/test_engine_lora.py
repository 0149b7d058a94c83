"""LoRA adapters on the CPU engine (tiny-random, in-process uvicorn): SGLang's adapter endpoints and
request fields, mixed batches of the base and several adapters with exact log-probs (against the
engine's own scoring pass and against an independent reference that merges ``W + scaling * B A``
into a copy of the Hugging Face model), the prefix cache keyed by adapter, and loads/unloads while
other adapters' requests are decoding."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from pipeline.engine.lora import LoraSettings
from pipeline.testing.engine import perturbed_copy, running_engine
from pipeline.testing.lora import write_random_adapter
from pipeline.weightsync import verify_adapter

IDS = [1, 4093, 198, 6004, 2, 198, 1, 520, 9531, 198, 731, 88, 12, 3051]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {"a": write_random_adapter(root / "a", seed=1),
            "b": write_random_adapter(root / "b", seed=2, r=8, alpha=4.0, targets=("q_proj", "v_proj", "down_proj")),
            "c": write_random_adapter(root / "c", seed=3, r=2),
            "big": write_random_adapter(root / "big", seed=4, r=32)}


@pytest.fixture(scope="module")
def url(adapters):
    lora = LoraSettings(enabled=True, max_rank=16, max_per_batch=8)
    with running_engine("tiny-random", threads=1, context_length=512, max_batch_size=8, lora=lora,
                        lora_paths={"a": str(adapters["a"])}) as u:
        yield u


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, timeout=120) as c:
        yield c


def load(http, name, path):
    return http.post("/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})


def score(http, ids, lora, start=0):
    """Prompt log-probs log p(t_i | t_<i), i = start+1 .. L-1, from the engine's scoring pass."""
    r = http.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 0},
                                     "return_logprob": True, "logprob_start_len": start, "lora_path": lora})
    assert r.status_code == 200, r.text
    mi = r.json()["meta_info"]
    return [e[0] for e in mi["input_token_logprobs"] if e[0] is not None], mi


def merged_reference(ids: list[int], adapter: Path | None, base: str = "tiny-random") -> list[float]:
    """log p(t_i | t_<i), i = 1 .. L-1, from a fresh HF model whose target weights are merged by
    hand from the LoRA definition: W' = W + (lora_alpha / r) * B @ A (no engine code involved)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from pipeline.models import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model(base), dtype=torch.float32).eval()
    if adapter is not None:
        cfg = json.loads((adapter / "adapter_config.json").read_text())
        sd = load_file(str(adapter / "adapter_model.safetensors"))
        scaling = cfg["lora_alpha"] / cfg["r"]
        merged = 0
        with torch.no_grad():
            for name, mod in model.named_modules():
                a = sd.get(f"base_model.model.{name}.lora_A.weight")
                if a is not None:
                    mod.weight += scaling * sd[f"base_model.model.{name}.lora_B.weight"] @ a
                    merged += 1
        assert merged == len(sd) // 2
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
    return [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]


def max_diff(xs, ys) -> float:
    assert len(xs) == len(ys) and xs
    return max(abs(x - y) for x, y in zip(xs, ys))


# ---- the endpoints ---------------------------------------------------------------------------------
def test_load_is_idempotent_and_refuses_other_content(http, adapters):
    r = load(http, "b", adapters["b"])
    assert r.status_code == 200 and r.json()["success"] is True and r.json()["error_message"] is None
    assert r.json()["loaded_adapters"]["b"] == str(adapters["b"])
    assert r.json()["adapter_versions"]["b"] == verify_adapter(adapters["b"])  # the content id of what it parsed
    again = load(http, "b", adapters["b"])
    assert again.status_code == 200 and again.json()["success"] is True
    other = load(http, "b", adapters["c"])
    assert other.status_code == 400 and other.json()["success"] is False
    assert "already exists with other content" in other.json()["error_message"]
    names = [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert names[0] == "tiny-random" and {"a", "b"} <= set(names[1:])
    card = next(m for m in http.get("/v1/models").json()["data"] if m["id"] == "b")
    assert card["parent"] == "tiny-random" and card["root"] == str(adapters["b"]) and card["max_model_len"] is None
    info = http.get("/server_info").json()
    shas = {a["lora_name"]: a["sha256"] for a in info["internal_states"][0]["lora_adapters"]}
    assert info["enable_lora"] is True and len(shas["b"]) == 64 and shas["a"] != shas["b"]


def _write_bad(folder: Path, src: Path, *, config: dict | None = None, tensors: dict | None = None) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "adapter_config.json").read_text())
    cfg.update(config or {})
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    sd = load_file(str(src / "adapter_model.safetensors"))
    sd.update(tensors or {})
    save_file(sd, str(folder / "adapter_model.safetensors"))
    return folder


def test_load_refusals_name_the_problem(http, adapters, tmp_path):
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    cases = {
        "does not exist": tmp_path / "missing",
        "above the engine's --max-lora-rank": adapters["big"],
        "not among the engine's LoRA targets": _write_bad(tmp_path / "t", adapters["c"],
                                                          config={"target_modules": ["c_attn"]}),
        "do not fit the served model": _write_bad(tmp_path / "s", adapters["c"], tensors={key: torch.ones(2, 65)}),
        "peft_type must be 'LORA'": _write_bad(tmp_path / "p", adapters["c"], config={"peft_type": "IA3"}),
        "bias must be 'none'": _write_bad(tmp_path / "bias", adapters["c"], config={"bias": "all"}),
        "names no LoRA target": _write_bad(tmp_path / "n", adapters["c"], tensors={
            "base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight": torch.ones(2, 64)}),
    }
    for needle, folder in cases.items():
        r = load(http, "bad", folder)
        assert r.status_code == 400 and r.json()["success"] is False, (needle, r.text)
        assert needle in r.json()["error_message"], (needle, r.json()["error_message"])
    b_key = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    for i, (name, bad) in enumerate([(b_key, float("nan")), (key, float("inf")), (b_key, -float("inf")), (key, None)]):
        t = load_file(str(adapters["c"] / "adapter_model.safetensors"))[name]
        if bad is None:
            t = t.to(torch.int32)  # not floating point
        else:
            t.view(-1)[[0, -1][i % 2]] = bad  # first or last element
        r = load(http, "bad", _write_bad(tmp_path / f"finite{i}", adapters["c"], tensors={name: t}))
        assert r.status_code == 400 and f"tensor {name} of" in r.json()["error_message"], r.text
        assert "must be finite floating point" in r.json()["error_message"]
    assert "bad" not in [m["id"] for m in http.get("/v1/models").json()["data"]]
    r = http.post("/load_lora_adapter", json={"lora_name": "x"})
    assert r.status_code == 400 and r.json()["object"] == "error"


def test_unload_and_unknown_names(http, adapters):
    assert load(http, "c", adapters["c"]).status_code == 200
    assert score(http, IDS, "c")[1]["lora_name"] == "c"
    r = http.post("/unload_lora_adapter", json={"lora_name": "c"})
    assert r.status_code == 200 and r.json()["success"] is True and "c" not in r.json()["loaded_adapters"]
    r = http.post("/unload_lora_adapter", json={"lora_name": "c"})
    assert r.status_code == 400 and r.json()["success"] is False
    assert r.json()["error_message"].startswith("LoRA with name c does not exist")
    g = http.post("/generate", json={"input_ids": IDS, "lora_path": "c"})
    assert g.status_code == 400 and "not loaded: c" in g.json()["error"]["message"]
    g = http.post("/generate", json={"input_ids": [IDS, IDS], "lora_path": ["a"]})
    assert g.status_code == 400 and "lora_path has 1 entries" in g.json()["error"]["message"]
    chat = http.post("/v1/chat/completions", json={"model": "tiny-random:c", "max_tokens": 2,
                                                   "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and chat.json()["object"] == "error" and "not loaded: c" in chat.json()["message"]


def test_lora_off_is_refused_in_each_shape():
    with running_engine("tiny-random", threads=1, context_length=128) as u, httpx.Client(base_url=u) as c:
        r = c.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": "/nonexistent"})
        assert r.status_code == 400 and "--enable-lora" in r.json()["error_message"]
        g = c.post("/generate", json={"input_ids": IDS, "lora_path": "a"})
        assert g.status_code == 400 and "--enable-lora" in g.json()["error"]["message"]
        ok = c.post("/generate", json={"input_ids": IDS, "sampling_params": {"max_new_tokens": 1}}).json()
        assert ok["meta_info"]["lora_name"] is None and ok["meta_info"]["lora_sha256"] is None


# ---- exactness ---------------------------------------------------------------------------------------
def test_mixed_batch_logprobs_equal_scoring_and_merged_reference(http, adapters):
    assert load(http, "b", adapters["b"]).status_code == 200
    loras = [None, "a", "b", "a"]
    prompts = [IDS, IDS, IDS[:9], IDS[3:]]
    steps = http.get("/server_info").json()["internal_states"][0]["decode_steps"]
    r = http.post("/generate", json={"input_ids": prompts, "lora_path": loras, "return_logprob": True,
                                     "sampling_params": {"max_new_tokens": 12, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    shas = set()
    for prompt, lora, out in zip(prompts, loras, r.json()):
        mi = out["meta_info"]
        assert mi["lora_name"] == lora
        shas.add(mi["lora_sha256"])
        full = prompt + out["output_ids"]
        recorded = [e[0] for e in mi["output_token_logprobs"]]
        scored, smi = score(http, full, lora, start=len(prompt) - 1)
        assert smi["lora_sha256"] == mi["lora_sha256"]
        assert max_diff(recorded, scored) <= 1e-4
        reference = merged_reference(full, adapters[lora] if lora else None)[len(prompt) - 1:]
        assert max_diff(recorded, reference) <= 1e-4
    assert len(shas) == 3  # base (None) and two adapters
    steps = http.get("/server_info").json()["internal_states"][0]["decode_steps"] - steps
    assert steps < 2 * 11  # the four rows decoded together (11 decode steps each after the prefill)
    base, with_a = score(http, IDS, None)[0], score(http, IDS, "a")[0]
    assert max_diff(base, with_a) > 1e-3  # the adapter changes the model


def test_chat_model_suffix_selects_the_adapter(http):
    body = {"model": "tiny-random:a", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 6,
            "logprobs": True, "return_token_ids": True, "ignore_eos": True}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    ch = out["choices"][0]
    assert out["metadata"]["lora_name"] == "a" and len(out["metadata"]["lora_sha256"]) == 64
    lps = [c["logprob"] for c in ch["logprobs"]["content"]]
    prompt = ch["prompt_token_ids"]
    scored, _ = score(http, prompt + ch["token_ids"], "a", start=len(prompt) - 1)
    assert max_diff(lps, scored) <= 1e-4


def test_prefix_cache_is_keyed_by_adapter(http):
    http.post("/flush_cache")
    long = (IDS * 4)[:48]
    k = len(long) - 5
    base, mi = score(http, long, None, start=k)
    assert mi["cached_tokens"] == 0
    _, mi = score(http, long, None, start=k)
    assert mi["cached_tokens"] > 0  # the base's own entry is reused
    with_a, mi = score(http, long, "a", start=k)
    assert mi["cached_tokens"] == 0  # never the base's KV under adapter a
    again, mi = score(http, long, "a", start=k)
    assert mi["cached_tokens"] > 0 and max_diff(again, with_a) <= 1e-5
    http.post("/flush_cache")
    fresh, _ = score(http, long, "a", start=k)
    assert max_diff(fresh, with_a) <= 1e-5 and max_diff(fresh, base) > 1e-3


def test_max_loras_per_batch_one_still_serves_every_adapter(adapters):
    lora = LoraSettings(enabled=True, max_rank=16, max_per_batch=1)
    with running_engine("tiny-random", threads=1, context_length=256, lora=lora,
                        lora_paths={"a": str(adapters["a"]), "c": str(adapters["c"])}) as u, \
            httpx.Client(base_url=u, timeout=60) as c:
        loras = ["a", None, "c", "a"]
        r = c.post("/generate", json={"input_ids": [IDS] * 4, "lora_path": loras, "return_logprob": True,
                                      "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})
        assert r.status_code == 200
        for lora, out in zip(loras, r.json()):
            scored, _ = score(c, IDS + out["output_ids"], lora, start=len(IDS) - 1)
            assert max_diff([e[0] for e in out["meta_info"]["output_token_logprobs"]], scored) <= 1e-4


def test_adapters_survive_a_base_weight_update(adapters, tmp_path):
    new = perturbed_copy(tmp_path / "w1", seed=7)
    lora = LoraSettings(enabled=True, max_rank=16)
    with running_engine("tiny-random", threads=1, context_length=256, lora=lora,
                        lora_paths={"a": str(adapters["a"])}) as u, httpx.Client(base_url=u, timeout=60) as c:
        assert c.post("/update_weights_from_disk", json={"model_path": str(new)}).status_code == 200
        got, _ = score(c, IDS, "a")
        assert max_diff(got, merged_reference(IDS, adapters["a"], base=str(new))) <= 1e-4


# ---- swaps while others decode ------------------------------------------------------------------------
def _stream(url: str, body: dict, out: dict, started: threading.Event) -> None:
    """Stream ``/generate`` and keep the last chunk in ``out['last']``; sets ``started`` at the first."""
    with httpx.Client(base_url=url, timeout=120) as c, c.stream("POST", "/generate", json={**body, "stream": True}) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out["last"] = json.loads(line[6:])
                started.set()
    out["done"] = True
    started.set()


def test_swap_of_one_adapter_holds_no_other_request(url, http, adapters, tmp_path):
    v1, v2 = adapters["c"], write_random_adapter(tmp_path / "c2", seed=33, r=2)
    assert load(http, "b", adapters["b"]).status_code == 200
    assert load(http, "x", v1).status_code == 200
    sha1 = http.post("/generate", json={"input_ids": IDS, "lora_path": "x",
                                        "sampling_params": {"max_new_tokens": 1}}).json()["meta_info"]["lora_sha256"]
    sha_b = {a["lora_name"]: a["sha256"] for a in
             http.get("/server_info").json()["internal_states"][0]["lora_adapters"]}["b"]
    running = {}
    for name, lora in (("base", None), ("b", "b"), ("x", "x")):
        out, started = {}, threading.Event()
        body = {"input_ids": IDS, "lora_path": lora, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}
        t = threading.Thread(target=_stream, args=(url, body, out, started), daemon=True)
        t.start()
        assert started.wait(60)
        running[name] = (t, out)
    # X's swap (SGLang's two calls) while base, b and the old x decode
    assert http.post("/unload_lora_adapter", json={"lora_name": "x"}).status_code == 200
    during = http.post("/generate", json={"input_ids": IDS, "lora_path": "x"})
    assert during.status_code == 400  # between the calls: refused, never served by a mix
    assert load(http, "x", v2).status_code == 200
    after = http.post("/generate", json={"input_ids": IDS, "lora_path": "x", "return_logprob": True,
                                         "sampling_params": {"max_new_tokens": 3}}).json()
    assert not any(out.get("done") for _, out in running.values())  # nobody waited for the swap
    for t, _ in running.values():
        t.join(120)
    assert load(http, "x-old", v1).status_code == 200  # to score what the old version produced
    sha2 = after["meta_info"]["lora_sha256"]
    assert sha2 not in (None, sha1)
    for name, lora in (("base", None), ("b", "b"), ("x", "x-old")):
        out = running[name][1]
        assert out["status"] == 200 and out["last"]["meta_info"]["finish_reason"]["type"] == "length"
        mi = out["last"]["meta_info"]
        assert mi["lora_sha256"] == {"x": sha1, "base": None, "b": sha_b}[name]
        scored, _ = score(http, IDS + out["last"]["output_ids"], lora, start=len(IDS) - 1)
        assert max_diff([e[0] for e in mi["output_token_logprobs"]], scored) <= 1e-4
    scored, smi = score(http, IDS + after["output_ids"], "x", start=len(IDS) - 1)
    assert smi["lora_sha256"] == sha2
    assert max_diff([e[0] for e in after["meta_info"]["output_token_logprobs"]], scored) <= 1e-4


# ---- units ------------------------------------------------------------------------------------------
def test_folder_sha256_is_the_manifest_digest(adapters, tmp_path):
    from pipeline.engine.lora import adapter_sha256

    src = adapters["a"]
    lines = "".join(f"{hashlib.sha256((src / n).read_bytes()).hexdigest()}  {n}\n"
                    for n in sorted(["adapter_config.json", "adapter_model.safetensors"]))
    assert adapter_sha256(src) == hashlib.sha256(lines.encode()).hexdigest()
    copy = tmp_path / "copy"
    copy.mkdir()
    for n in ("adapter_config.json", "adapter_model.safetensors"):
        (copy / n).write_bytes((src / n).read_bytes())
    (copy / "README.md").write_text("not part of the content id")
    assert adapter_sha256(copy) == adapter_sha256(src)
    (copy / "adapter_config.json").write_text((src / "adapter_config.json").read_text() + " ")
    assert adapter_sha256(copy) != adapter_sha256(src)


def test_plan_delta_equals_a_per_row_loop():
    """The gathered batched delta against a loop over rows written from the definition."""
    from pipeline.engine.lora import LoraAdapter, LoraPlan, lora_delta

    g = torch.Generator().manual_seed(0)
    key = "m"
    a1 = LoraAdapter("a1", "", "s1", 4, 8.0, ("q_proj",), {key: (torch.randn(4, 6, generator=g),
                                                                 torch.randn(5, 4, generator=g))})
    a2 = LoraAdapter("a2", "", "s2", 2, 2.0, ("q_proj",), {key: (torch.randn(2, 6, generator=g),
                                                                 torch.randn(5, 2, generator=g))})
    a3 = LoraAdapter("a3", "", "s3", 2, 2.0, ("k_proj",), {"other": (torch.randn(2, 6), torch.randn(5, 2))})
    plan = LoraPlan()
    rows = [a1, None, a2, a3, a1]
    plan.set(rows)
    x = torch.randn(5, 3, 6, generator=g)
    got = lora_delta(x, plan.stacks(key))
    for i, a in enumerate(rows):
        w = a.weights.get(key) if a is not None else None
        want = torch.zeros(3, 5) if w is None else x[i] @ w[0].t() @ w[1].t()
        assert torch.allclose(got[i], want, atol=1e-5)
    plan.set([None, None])
    assert not plan.active
    plan.set([a3, a3])
    assert plan.stacks(key) is None and plan.stacks("other")[0] == "shared"


def test_cli_lora_paths():
    from pipeline.engine.cli import _lora_paths

    assert _lora_paths(["x=/a/b", "/c/d/"]) == {"x": "/a/b", "d": "/c/d/"}
    assert _lora_paths(None) is None
    for bad in (["=/a"], ["x="], ["x=/a", "x=/b"]):
        with pytest.raises(ValueError):
            _lora_paths(bad)


def test_engine_client_lora_methods(url, http, adapters):
    import asyncio

    from pipeline.engine_api.client import EngineClient
    from pipeline.engine_api.errors import EngineError

    async def run():
        async with EngineClient(url) as client:
            out = await client.load_lora_adapter("cl", str(adapters["c"]))
            assert out["loaded_adapters"]["cl"] == str(adapters["c"])
            with pytest.raises(EngineError) as e:
                await client.load_lora_adapter("cl", str(adapters["a"]))
            assert e.value.status == 400 and "other content" in str(e.value)
            got = await client.score(IDS, 1, lora_path="cl")
            gen = await client.generate(IDS, sampling_params={"max_new_tokens": 2}, lora_path="cl")
            assert gen["meta_info"]["lora_name"] == "cl"
            await client.unload_lora_adapter("cl")
            with pytest.raises(EngineError) as e:
                await client.unload_lora_adapter("cl")
            assert e.value.status == 400 and "does not exist" in str(e.value)
            return got

    got = asyncio.run(run())
    assert max_diff(got, merged_reference(IDS, adapters["c"])) <= 1e-4


def test_admission_keeps_max_loras_per_batch():
    """The model thread admits a waiting request only if its adapter fits the batch's
    ``max_per_batch`` distinct adapters (the base counting as one); others are skipped, not dropped."""
    from types import SimpleNamespace

    from pipeline.engine.model import load_model, load_tokenizer
    from pipeline.engine.worker import EngineWorker, GenRequest
    from pipeline.models import resolve_model

    path = resolve_model("tiny-random")
    w = EngineWorker(load_model(path), load_tokenizer(path), context_length=64,
                     lora=LoraSettings(enabled=True, max_per_batch=2))
    a, b = SimpleNamespace(sha256="sa"), SimpleNamespace(sha256="sb")

    def req(lora):
        return GenRequest("r", [1], None, lambda u: None, lora=lora)

    w._batch.seqs = [SimpleNamespace(req=req(None)), SimpleNamespace(req=req(a))]  # base + a: full
    rb, ra, rbase = req(b), req(a), req(None)
    w._waiting.extend([rb, ra, rbase])
    assert w._next_admissible() is ra and w._next_admissible() is rbase
    assert w._next_admissible() is None and list(w._waiting) == [rb]  # b waits for a row to finish
    w._batch.seqs = [SimpleNamespace(req=req(None))]
    assert w._next_admissible() is rb


def test_a_waiting_head_is_passed_over_at_most_max_batch_size_times():
    """A steady stream for the adapters in the batch never starves a new adapter's request at the
    head: after ``max_batch_size`` admissions passed it, nothing more is admitted until it fits."""
    from types import SimpleNamespace

    from pipeline.engine.model import load_model, load_tokenizer
    from pipeline.engine.worker import EngineWorker, GenRequest
    from pipeline.models import resolve_model

    path = resolve_model("tiny-random")
    w = EngineWorker(load_model(path), load_tokenizer(path), context_length=64, max_batch_size=3,
                     lora=LoraSettings(enabled=True, max_per_batch=2))
    a, b = SimpleNamespace(sha256="sa"), SimpleNamespace(sha256="sb")

    def req(lora):
        return GenRequest("r", [1], None, lambda u: None, lora=lora)

    w._batch.seqs = [SimpleNamespace(req=req(None)), SimpleNamespace(req=req(a))]  # base + a: full
    head = req(b)
    w._waiting.extend([head] + [req(a) for _ in range(5)])
    passed = [w._next_admissible() for _ in range(5)]
    assert [r is not None for r in passed] == [True, True, True, False, False]  # 3 = max_batch_size
    assert w._waiting[0] is head and len(w._waiting) == 3
    w._batch.seqs = [SimpleNamespace(req=req(None))]  # a row finished: the head fits now
    assert w._next_admissible() is head
