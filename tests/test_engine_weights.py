"""``/update_weights_from_disk``: atomic swap, version bookkeeping, requests in flight finish."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pipeline.client import EngineClient, EngineError
from pipeline.engine.testing import running_engine
from pipeline.models import resolve_model

SEQ = [1, 4093, 198, 6004, 2, 198, 1, 520, 9531, 198, 330, 1024, 77, 5]


@pytest.fixture(scope="module")
def perturbed_dir(tmp_path_factory):
    """tiny-random with every weight shifted by seeded noise (same architecture and tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = resolve_model("tiny-random")
    out = tmp_path_factory.mktemp("perturbed")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    g = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def url():
    with running_engine("tiny-random", threads=2, weight_version="0") as u:
        yield u


def test_update_swaps_weights_and_versions(url, perturbed_dir):
    async def main():
        async with EngineClient(url, 60) as c:
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


def test_update_failure_keeps_serving(url, tmp_path):
    async def main():
        async with EngineClient(url, 60) as c:
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
