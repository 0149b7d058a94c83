"""``/update_weights_from_disk``: atomic swap, version bookkeeping, requests in flight finish."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pipeline.engine_api.client import EngineClient
from pipeline.engine_api.errors import EngineError
from pipeline.models import resolve_model

SEQ = [1, 4093, 198, 6004, 2, 198, 1, 520, 9531, 198, 330, 1024, 77, 5]


ENGINE_SETTINGS = {"threads": 2, "weight_version": "0"}  # for conftest.engine_url


def test_update_swaps_weights_and_versions(engine_url, perturbed_dir):
    async def main():
        async with EngineClient(engine_url, 60) as c:
            before = await c.score_result(SEQ, 3)
            assert before.weight_version == "0"
            # a long generation in flight while the update is requested
            stream = c.generate_stream([1, 2, 3], sampling_params={"max_new_tokens": 400, "ignore_eos": True},
                                       return_logprob=True)
            first = await stream.__anext__()
            assert first["meta_info"]["finish_reason"] is None
            update = asyncio.create_task(c.update_weights_from_disk(str(perturbed_dir)))
            last, after_update = first, 0
            async for ev in stream:
                last, after_update = ev, after_update + 1
                if ev["meta_info"]["finish_reason"] is not None:
                    # reader/writer semantics: the swap waits for this request
                    assert not update.done()
            assert after_update > 100  # the generation was still running while the update was pending
            res = await update
            assert res["success"] is True and "Weight version updated to 1" in res["message"]
            assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 400}
            assert last["meta_info"]["weight_version"] == "0"  # finished on the old weights
            # ...and its log-probs are those of the old weights throughout (no mixing)
            gen_ids = last["output_ids"]
            gen_lps = [e[0] for e in last["meta_info"]["output_token_logprobs"]]
            after = await c.score_result(SEQ, 3)
            assert after.weight_version == "1" and (await c.weight_version()) == "1"
            assert max(abs(a - b) for a, b in zip(before.logprobs, after.logprobs)) > 1e-2
            # restore the original weights with an explicit version: scores return exactly
            res = await c.update_weights_from_disk(str(resolve_model("tiny-random")), weight_version="7")
            assert res["weight_version"] == "7"
            again = await c.score_result(SEQ, 3)
            assert again.weight_version == "7"
            assert max(abs(a - b) for a, b in zip(before.logprobs, again.logprobs)) < 1e-6
            old_scores = await c.score([1, 2, 3] + gen_ids, 3)
            assert max(abs(a - b) for a, b in zip(old_scores, gen_lps)) < 1e-4
            # no explicit version: integer increment
            res = await c.update_weights_from_disk("tiny-random")
            assert res["weight_version"] == "8"
            chat = await c.chat({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
            assert chat["metadata"]["weight_version"] == "8"

    asyncio.run(main())


def test_update_failure_keeps_serving(engine_url, tmp_path):
    async def main():
        async with EngineClient(engine_url, 60) as c:
            version = await c.weight_version()
            with pytest.raises(EngineError) as ei:
                await c.update_weights_from_disk(str(tmp_path / "missing"))
            assert ei.value.status == 400 and ei.value.body["success"] is False
            (tmp_path / "broken").mkdir()
            (tmp_path / "broken" / "config.json").write_text("{not json")
            with pytest.raises(EngineError):
                await c.update_weights_from_disk(str(tmp_path / "broken"))
            assert await c.weight_version() == version
            out = await c.generate([1, 2], sampling_params={"max_new_tokens": 2})
            assert len(out["output_ids"]) == 2

    asyncio.run(main())


# ---- weights that do not fit the served model are refused; version and serving unchanged ----------
def _variant(src, out, *, config=None, tensors=None, tokenizer=None):
    """A copy of the HF folder ``src`` with config keys overridden, the tensor dict transformed
    (``tensors(dict) -> dict``) and/or the tokenizer replaced."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    if config:
        cfg = json.loads((out / "config.json").read_text())
        cfg.update(config)
        (out / "config.json").write_text(json.dumps(cfg))
    if tensors:
        save_file(tensors(load_file(str(out / "model.safetensors"))), str(out / "model.safetensors"),
                  metadata={"format": "pt"})
    if tokenizer:
        tokenizer(out)
    return out


def _three_layers(out):
    """A complete, self-consistent tiny Llama with one layer more than the served model."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = resolve_model("tiny-random")
    cfg = AutoConfig.from_pretrained(src)
    cfg.num_hidden_layers = 3
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out


def _added_token(out):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    tok.add_tokens(["<new_tool_token>"])
    tok.save_pretrained(out)


def _renamed(t):
    t["model.layers.1.mlp.up_projection.weight"] = t.pop("model.layers.1.mlp.up_proj.weight")
    return t


MISFITS = {
    # the case: config.json says 3 layers, the checkpoint has 2 (layer 2 would be random)
    "config_one_more_layer": (dict(config={"num_hidden_layers": 3}), "num_hidden_layers"),
    "model_one_more_layer": ("three_layers", "num_hidden_layers"),
    "missing_tensor": (dict(tensors=lambda t: {k: v for k, v in t.items() if k != "model.layers.0.mlp.down_proj.weight"}),
                       "model.layers.0.mlp.down_proj.weight"),
    "extra_tensor": (dict(tensors=lambda t: {**t, "model.layers.0.extra_bias": torch.zeros(64)}),
                     "model.layers.0.extra_bias"),
    "renamed_tensor": (dict(tensors=_renamed), "up_proj"),
    "wrong_shape": (dict(tensors=lambda t: {**t, "model.norm.weight": torch.ones(65)}), "model.norm.weight"),
    "integer_dtype": (dict(tensors=lambda t: {**t, "model.norm.weight": torch.ones(64, dtype=torch.int32)}),
                      "I32"),
    "other_vocabulary": (dict(config={"vocab_size": 49153}, tensors=lambda t: {
        **t, "model.embed_tokens.weight": torch.cat([t["model.embed_tokens.weight"], torch.zeros(1, 64)])}),
        "vocab_size"),
    "other_tokenizer": (dict(tokenizer=_added_token), "tokenizer"),
    "other_rope": (dict(config={"rope_theta": 500000.0}), "rope"),
}


@pytest.mark.parametrize("case", sorted(MISFITS))
def test_update_refuses_weights_that_do_not_fit(engine_url, tmp_path, case):
    how, named = MISFITS[case]
    src = resolve_model("tiny-random")
    folder = _three_layers(tmp_path / case) if how == "three_layers" else _variant(src, tmp_path / case, **how)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 1.0, "seed": 4,
            "logprobs": True, "return_token_ids": True}

    async def main():
        async with EngineClient(engine_url, 60) as c:
            version, info = await c.weight_version(), await c.model_info()
            before, chat_before = await c.score_result(SEQ, 3), await c.chat(chat)
            with pytest.raises(EngineError) as ei:
                await c.update_weights_from_disk(str(folder))
            assert ei.value.status == 400 and ei.value.body["success"] is False
            assert named in ei.value.message, ei.value.message
            assert await c.weight_version() == version
            assert (await c.model_info())["model_path"] == info["model_path"]
            after, chat_after = await c.score_result(SEQ, 3), await c.chat(chat)
            assert after.logprobs == before.logprobs  # identical: still the served weights
            assert after.weight_version == version
            a, b = chat_before["choices"][0], chat_after["choices"][0]
            assert a["token_ids"] == b["token_ids"] and a["message"] == b["message"]
            assert [x["logprob"] for x in a["logprobs"]["content"]] == [x["logprob"] for x in b["logprobs"]["content"]]
            assert chat_after["metadata"]["weight_version"] == version

    asyncio.run(main())


def test_update_accepts_a_fitting_folder_in_another_float_dtype(engine_url, tmp_path):
    """The trainer may export bf16 for an fp32-served model: floats are interchangeable."""
    folder = _variant(resolve_model("tiny-random"), tmp_path / "bf16",
                      config={"dtype": "bfloat16"}, tensors=lambda t: {k: v.to(torch.bfloat16) for k, v in t.items()})

    async def main():
        async with EngineClient(engine_url, 60) as c:
            before = await c.weight_version()
            res = await c.update_weights_from_disk(str(folder))
            assert res["success"] is True and await c.weight_version() != before
            res = await c.update_weights_from_disk(str(resolve_model("tiny-random")))  # back to the original
            assert res["success"] is True

    asyncio.run(main())
