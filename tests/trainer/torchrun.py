"""Two ranks under ``torchrun`` on the CPU, for the trainer's parallelism tests."""

from __future__ import annotations

import os
import subprocess
import sys


def torchrun_two(args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """Run ``torchrun --nproc-per-node 2 ARGS`` (``ARGS``: a script and its arguments, or
    ``-m pipeline ...``) on a free local port, one torch thread per rank, without the calling
    process's rank variables; its output captured as text.

    Raises:
        AssertionError: it ran past ``timeout_s`` (a rank waiting in a collective the other never
            enters) or exited non-zero (the end of its output in the message).
    """
    from pipeline.procutil import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *args]
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"torchrun did not finish in {timeout_s} s (a rank waits in a collective?): "
                             f"{str(e.stdout)[-2000:]}") from None
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r
