#!/usr/bin/env bash
# megatron-core + mbridge for verl 0.9.1's own Megatron engine (tests/verl_megatron), as a --target overlay on top of
# .venvs/verl (scripts/setup_verl.sh), which is never modified:
#
#   .venvs/verl-mcore-overlay/   megatron-core==0.16.1 + mbridge==0.15.1 (no deps: .venvs/verl has torch, numpy,
#                                packaging, transformers, safetensors, einops). No Transformer Engine, no Apex,
#                                no Megatron-Bridge: verl's engine runs with vanilla_mbridge=True on the local spec.
# Use:  PYTHONPATH="$(scripts/setup_verl_megatron.sh --pythonpath)" .venvs/verl/bin/python -m pytest tests/verl_megatron
# Idempotent (a stamp keyed on the pins); fails loudly.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_env.sh  # rr_compile_bytecode
REPO="$PWD"
VENV="$(realpath -m "${VERL_VENV:-.venvs/verl}")"
DIR="$(realpath -m "${RR_VERL_MCORE_OVERLAY:-.venvs/verl-mcore-overlay}")"
PY="$VENV/bin/python"
PKGS=("megatron-core==0.16.1" "mbridge==0.15.1")

if [ "${1:-}" = "--pythonpath" ]; then echo "$DIR:$REPO"; exit 0; fi
[ -x "$PY" ] || { echo "setup_verl_megatron: $VENV is missing; run scripts/setup_verl.sh first" >&2; exit 1; }
[ -x "$VENV/bin/uv" ] || "$PY" -m pip install -q uv

key="$(printf '%s\n' bytecode "${PKGS[@]}" | sha1sum | cut -c1-12)"
if [ -f "$DIR/.rr-stamp-$key" ]; then echo "setup_verl_megatron: $DIR is up to date"; exit 0; fi
t0=$(date +%s)
rm -rf "$DIR"
"$VENV/bin/uv" pip install -q --python "$PY" --no-deps --target "$DIR" "${PKGS[@]}"
got=$(cd "$(mktemp -d)" && PYTHONPATH="$DIR" "$PY" -c \
  "import megatron.core, mbridge, verl.workers.engine.megatron.transformer_impl; print(megatron.core.__version__)" \
  2>&1 | tail -1)
if [ "$got" != "0.16.1" ]; then
  echo "setup_verl_megatron: ERROR: installed, but importing verl's Megatron engine gives: $got" >&2; exit 1
fi
rr_compile_bytecode "$PY" "$DIR"
touch "$DIR/.rr-stamp-$key"
echo "setup_verl_megatron: megatron-core $got + mbridge ready in $DIR in $(( $(date +%s) - t0 ))s ($(du -sh "$DIR" | cut -f1))"
