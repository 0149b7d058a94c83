"""Start a real vLLM server (its CPU build, from ``deploy/install-vllm.sh``'s venv) for tests and
benchmarks: ``running_vllm(model) -> base_url``.

Usage::

    from pipeline.testing.vllm import require_vllm, running_vllm

    @pytest.fixture(scope="module")          # one server for a whole test file (~30 s to start)
    def vllm_url():
        require_vllm()                       # skipped (failed under CI) when not installed
        with running_vllm("tiny-random-64") as url:
            yield url

The server is ``python -m vllm.entrypoints.openai.api_server`` with the flags and environment of
:func:`pipeline.engine_api.vllm.serve_command` / :func:`~pipeline.engine_api.vllm.serve_env`
(dev endpoints, runtime LoRA, fp32, one OpenMP thread), on a free port, its output in a log file;
it is stopped with SIGTERM (SIGKILL after ``stop_timeout_s``) together with its engine-core
children. ``tiny-random`` cannot be served (vLLM's CPU attention refuses 16-wide heads): use
``tiny-random-64``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

import httpx

from pipeline.engine_api.vllm import find_python, serve_command, serve_env
from pipeline.models import resolve_model
from pipeline.procutil import free_port


def require_vllm(cache_dir: str | None = None) -> None:
    """Skip the calling test when vLLM is not installed, saying why; under CI (``CI`` set) fail
    instead: CI installs it (``deploy/install.sh``) and must run the tests on the real engine."""
    import pytest

    why = vllm_missing(cache_dir)
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the vLLM tests: {why}")
        pytest.skip(why)


def vllm_missing(cache_dir: str | None = None) -> str | None:
    """Why vLLM cannot be started here (not installed: the message says how), or None."""
    try:
        find_python(cache_dir)
    except FileNotFoundError as e:
        return str(e)
    return None


@contextlib.contextmanager
def running_vllm(model: str = "tiny-random-64", cache_dir: str | None = None, *, enable_lora: bool = True,
                 max_lora_rank: int = 16, max_model_len: int = 2048, served_model_name: str | None = None,
                 threads: int = 1, start_timeout_s: float = 300.0, stop_timeout_s: float = 20.0,
                 log_path: str | os.PathLike | None = None) -> Iterator[str]:
    """Serve ``model`` with vLLM and yield its base URL (``http://127.0.0.1:PORT``).

    Raises:
        FileNotFoundError: vLLM is not installed (:func:`vllm_missing`).
        RuntimeError: it exited or did not answer ``/health`` within ``start_timeout_s`` (the
            message has the end of its log).
    """
    python, folder, port = find_python(cache_dir), resolve_model(model, cache_dir), free_port()
    cmd = serve_command(python, folder, port, served_model_name=served_model_name or model,
                        max_model_len=max_model_len, enable_lora=enable_lora, max_lora_rank=max_lora_rank)
    log = Path(log_path) if log_path else Path(tempfile.mkdtemp(prefix="vllm-")) / "server.log"
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, **serve_env(threads)),
                                start_new_session=True)
        try:
            _wait_healthy(proc, url, start_timeout_s, log)
            yield url
        finally:
            _stop(proc, stop_timeout_s)


def _wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode}: {_tail(log)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"vLLM did not answer /health within {timeout_s:.0f} s: {_tail(log)}")


def _tail(log: Path, n: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


def _stop(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM the server's process group (the API server and its engine core), then SIGKILL."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
