"""On identical weights (fp32, CPU) the trainer's log-probs equal the engine's rollout log-probs.

SmolLM2-135M-Instruct: the engine samples a chat reply at temperature 0.7 and records the
log-probs of the tempered distribution; the Megatron trainer scores the same token ids at the
sample's ``rollout_temperature``. Mean absolute difference must be <= 1e-4 nats.
"""

from __future__ import annotations

import asyncio

import pytest

from pipeline import events
from pipeline.config import load_config
from pipeline.models import resolve_model

pytestmark = pytest.mark.slow


async def _rollout(url, temperature):
    from pipeline.engine_api.client import EngineClient

    async with EngineClient(url, timeout_s=120) as eng:
        prompt = await eng.tokenize([{"role": "user", "content": "Name three prime numbers and say why."}])
        out = await eng.generate(prompt, sampling_params={"max_new_tokens": 48, "temperature": temperature,
                                                          "sampling_seed": 3}, return_logprob=True)
        lp = out["meta_info"]["output_token_logprobs"]
        return prompt, [e[1] for e in lp], [e[0] for e in lp]


def test_trainer_logprobs_equal_engine_rollout_logprobs_smollm2():
    from pipeline.testing.engine import running_engine
    from pipeline.trainer.policy import PolicyTrainer
    from pipeline.testing.trainer import megatron_runtime

    temperature = 0.7
    with running_engine("smollm2-135m", threads=2) as url:
        prompt, resp, rollout = asyncio.run(_rollout(url, temperature))
    assert len(resp) >= 8
    sample = events.Sample(sample_id="p:0:rl", session_id="p", turn_index=0, tokens=prompt + resp,
                           response_length=len(resp), rollout_log_probs=rollout, rollout_temperature=temperature)
    cfg = load_config(None, trainer={"model": "smollm2-135m", "micro_batch_size": 1}).trainer
    with megatron_runtime(tp=1, threads=2) as par:
        pt = PolicyTrainer(cfg, resolve_model("smollm2-135m"), par)
        mine = pt.log_probs([sample])[0]
        hot = pt.log_probs([events.Sample(**{**sample.__dict__, "rollout_temperature": 1.0})])[0]
    diffs = [abs(a - b) for a, b in zip(mine, rollout)]
    mean = sum(diffs) / len(diffs)
    print(f"smollm2 parity: {len(diffs)} tokens, mean |diff| {mean:.2e}, max {max(diffs):.2e}")
    assert len(mine) == len(rollout)
    assert mean <= 1e-4, mean
    # the temperature matters (so the comparison above is not vacuous)
    assert sum(abs(a - b) for a, b in zip(hot, rollout)) / len(hot) > 1e-2
