#!/usr/bin/env bash
# GPU path check of the trainer on one H100/H200-class GPU; finishes in well under 8 minutes.
#
#   bash bench/gpu_check.sh [size] [batch] [seq]      # size: 0.5b | 1b (default) | 3b
#
# Works offline: it writes a random-init Llama-shaped HF checkpoint with transformers instead of
# downloading one. Prints the Megatron step time and MFU with the GPU path (bf16, Transformer
# Engine layer spec when TE is installed, local spec otherwise) and the weight-sync time
# (export with sha256 + checksum verification + reload of the exported folder onto the GPU).
# Needs the project installed with a CUDA build of torch (`pip install -e .` on the GPU box;
# `pip install transformer-engine[pytorch]` for the TE spec). Set PYTHON to choose the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
SIZE="${1:-1b}"
BATCH="${2:-16}"
SEQ="${3:-1024}"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONWARNINGS=ignore
export CUDA_DEVICE_MAX_CONNECTIONS=1
WORK="${GPU_CHECK_DIR:-$(mktemp -d -t gpu-check-XXXXXX)}"
trap 'rm -rf "$WORK"' EXIT
start=$(date +%s)
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" - <<'PYEOF'
import torch, sys
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device (torch %s); install the CUDA build" % torch.__version__)
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
PYEOF
# 7-minute hard limit so the whole script stays under 8 minutes
timeout 420 "$PY" bench/trainer.py --gpu-check --size "$SIZE" --batch "$BATCH" --seq "$SEQ" --micro 4 \
  --steps 6 --workdir "$WORK"
echo "gpu_check: finished in $(( $(date +%s) - start )) s"
