"""The adapter contract end to end: an adapter the Megatron trainer trained and exported is
loaded by the CPU engine by its folder, under the same version (``weightsync.adapter_version``),
and the engine scores a sequence under it with the log-probs the trainer computes for it.

No stand-ins: the real :class:`pipeline.trainer.policy.PolicyTrainer` (Megatron-core on the CPU,
tiny-random model), its real export, the real engine over HTTP with the real client.
"""

from __future__ import annotations

import asyncio

import pytest

from pipeline.config import load_config
from pipeline.engine.lora import LoraSettings
from pipeline.engine_api.client import EngineClient
from pipeline.models import resolve_model
from pipeline.testing.engine import running_engine
from pipeline.testing.trainer import random_adapter
from pipeline.weightsync import adapter_version
from tests.trainer.test_trainer_lora import LORA, _sample

TOL = 1e-4  # fp32, two implementations of the same forward (Megatron local spec vs transformers + hooks)


async def _served(url: str, tokens: list[int], start: int, adapter: str | None) -> tuple[list[float], str | None]:
    async with EngineClient(url, timeout_s=120) as eng:
        out = await eng.generate(list(tokens), sampling_params={"max_new_tokens": 0}, return_logprob=True,
                                 logprob_start_len=start - 1,
                                 **({"lora_path": adapter} if adapter is not None else {}))
    mi = out["meta_info"]
    entries = (mi.get("input_token_logprobs") or [])[-(len(tokens) - start):]
    assert [e[1] for e in entries] == tokens[start:]
    return [float(e[0]) for e in entries], mi.get("lora_sha256")


def test_a_trained_adapter_serves_with_the_trainers_log_probs_and_version(runtime, tmp_path):
    from pipeline.trainer.policy import PolicyTrainer

    cfg = load_config(None, trainer={"model": "tiny-random", "lr": 1e-3, "micro_batch_size": 2,
                                     "lora": LORA}).trainer
    pt = PolicyTrainer(cfg, resolve_model("tiny-random"), runtime)
    random_adapter(pt, "t1", seed=5)  # every A and B non-zero: the adapter moves every projection
    samples = [_sample(10, reward=1.0), _sample(11, reward=-1.0)]
    pt.train_batch(samples, adapter="t1")
    exported = pt.export_adapter("t1", tmp_path / "t1-v1")
    assert exported.sha256 == adapter_version(exported.path)
    want = pt.log_probs(samples, adapter="t1")
    base = pt.log_probs(samples)

    lora = LoraSettings(enabled=True, max_rank=16)
    with running_engine("tiny-random", lora=lora, lora_paths={"t1": str(exported.path)}) as url:
        for s, lp, lp_base in zip(samples, want, base):
            start = len(s.tokens) - s.response_length
            got, served = asyncio.run(_served(url, list(s.tokens), start, "t1"))
            got_base, none = asyncio.run(_served(url, list(s.tokens), start, None))
            assert served == exported.sha256 and none is None
            assert max(abs(a - b) for a, b in zip(got, lp)) <= TOL, (got, lp)
            assert max(abs(a - b) for a, b in zip(got_base, lp_base)) <= TOL
            # the adapter really changes the scores: matching the base would not pass
            assert max(abs(a - b) for a, b in zip(got, got_base)) > 100 * TOL
