#!/usr/bin/env bash
# verl 0.7.1 as a pip --target overlay on .venvs/verl (scripts/setup_verl.sh), for tests/verl/test_legacy_worker.py:
# verl's legacy FSDP worker (verl.workers.fsdp_workers, verl 0.5-0.7, the default of their main_ppo for fsdp/fsdp2;
# gone in 0.8), which rr must refuse when asked for routing replay. verl only, no deps: 0.7.1's worker imports and
# builds with .venvs/verl's packages (verl 0.9.1's). .venvs/verl itself is never modified.
# Use:  PYTHONPATH="$(scripts/setup_verl_legacy.sh --pythonpath):$PWD" .venvs/verl/bin/python ...
# Idempotent (a stamp keyed on this script). Fails loudly.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="0.7.1"
DIR="$PWD/.venvs/verl-legacy-$VERSION"
if [ "${1:-}" = "--pythonpath" ]; then echo "$DIR"; exit 0; fi
. scripts/_env.sh  # rr_compile_bytecode
VENV=".venvs/verl"
[ -x "$VENV/bin/python" ] || { echo "setup_verl_legacy: $VENV is missing; run scripts/setup_verl.sh first" >&2; exit 1; }
stamp="$DIR/.rr-stamp-$(sha1sum < scripts/setup_verl_legacy.sh | cut -c1-12)"
if [ -f "$stamp" ]; then echo "setup_verl_legacy: verl $VERSION overlay is up to date ($DIR)"; exit 0; fi
rm -rf "$DIR"
"$VENV/bin/uv" pip install -q --python "$VENV/bin/python" --no-deps --target "$DIR" "verl==$VERSION"
rr_compile_bytecode "$VENV/bin/python" "$DIR"
touch "$stamp"
echo "setup_verl_legacy: verl $VERSION overlay ready ($DIR)"
