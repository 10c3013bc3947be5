#!/usr/bin/env bash
# .venvs/verl: verl 0.9.1 (rr-replay[verl]) on the machine's CPU torch, for tests/verl (scripts/test_verl.sh).
# Its own env: verl 0.9.1 pins transformers < 5.11, .venv has 5.24. Idempotent (a stamp keyed on this script and
# pyproject.toml skips work already done). .venv itself is never touched.
#  - cachetools: verl's rollout router imports it without declaring it.
#  - the SGLANG_READ pins: what SGLang 0.5.13's TokenizerManager and HTTP layer import beyond verl's deps, so
#    tests/verl/test_sglang_read.py runs verl's SGLang server read on SGLang's real code (the 0.5.13 overlay of
#    scripts/setup_sglang.sh on PYTHONPATH). Versions are the ones .venv has.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=".venvs/verl"
stamp="$VENV/.rr-setup-$(cat scripts/setup_verl.sh scripts/_env.sh pyproject.toml | sha1sum | cut -c1-12)"
if [ -f "$stamp" ]; then echo "setup_verl: $VENV is up to date"; exit 0; fi
mkdir -p .venvs
. scripts/_env.sh  # rr_setup_python (3.11/3.12), rr_torch_source (local CPU torch wheels or the PyTorch CPU index)
if [ ! -x "$VENV/bin/python" ]; then py=$(rr_setup_python); "$py" -m venv "$VENV"; fi
"$VENV/bin/python" -m pip install -q --upgrade uv
torch_source=$(rr_torch_source "$VENV/bin/python"); mapfile -t TORCH_SOURCE <<< "$torch_source"
rr_check_torch_source "$VENV/bin/python" "${TORCH_SOURCE[@]}"
SGLANG_READ=("uvloop==0.23.0" "pyzmq==27.3.0" "openai==3.57.0" "partial_json_parser==0.2.1.1.post7"
             "sentencepiece==0.2.3" "einops==0.8.2" "compressed_tensors==0.17.0" "msgspec==0.22.0"
             "python-multipart==0.0.34")
"$VENV/bin/uv" pip install --python "$VENV/bin/python" "${TORCH_SOURCE[@]}" --index-strategy unsafe-best-match \
  "torch==2.13.0+cpu" "transformers==5.10.4" "tensordict==0.10.0" "ray==2.60.0" "cachetools==8.0.2" \
  "${SGLANG_READ[@]}" -e ".[test,verl]"
rr_compile_bytecode "$VENV/bin/python"
rm -f "$VENV"/.rr-setup-*
touch "$stamp"
echo "setup_verl: $VENV ready ($("$VENV/bin/python" -c 'import verl; print("verl", verl.__version__)' 2>/dev/null | tail -1))"
