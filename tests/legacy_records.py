"""Records as older versions of the pipeline wrote them (for tests of reading old topics)."""

from __future__ import annotations

import msgpack
import numpy as np


def sample_v1(**over) -> bytes:
    """A ``sample`` record as the v1 judge wrote it: every field present, absence written as values
    (reward 0, the rollout log-probs as teacher, zeros for missing log-probs). Defaults: a combine
    sample with a +1 vote and no hint; ``over`` replaces fields (lists of ``*log_probs`` are packed)."""
    base = {"type": "sample", "v": 1, "sample_id": "s:0:combine", "session_id": "s", "turn_index": 0,
            "policy_version": 3, "kind": "opd+rl", "tokens": np.asarray([5, 6, 7, 8], "<i4").tobytes(),
            "response_length": 2, "rollout_log_probs": np.asarray([-0.5, -1.5], "<f4").tobytes(),
            "rollout_temperature": 0.7, "reward": 1.0, "loss_mask": 1,
            "teacher_log_probs": np.asarray([-0.5, -1.5], "<f4").tobytes(), "teacher_top_k": 0,
            "teacher_topk_ids": b"", "teacher_topk_log_probs": b"", "votes": [[1], [-1]], "hint": None,
            "judge": "llm", "created_at": 1, "turn_created_at": 1, "source": "proxy"}
    for k, v in over.items():
        base[k] = np.asarray(v, "<f4").tobytes() if k.endswith("log_probs") and isinstance(v, list) else v
    return msgpack.packb(base, use_bin_type=True)
