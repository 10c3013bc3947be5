#!/usr/bin/env bash
# rr in verl 0.9.1's real code (.venvs/verl, scripts/setup_verl.sh), on this CPU machine:
#  - tests/verl: verl's ActorRolloutRefWorker / FSDP engine / agent-loop layout / trainer data steps / ToolAgentLoop
#    with rr's plugin loaded from its verl.plugins entry point; one test starts the rr vLLM server of the main .venv.
#    tests/verl/test_legacy_worker.py builds verl 0.7.1's legacy FSDP worker (the overlay of
#    scripts/setup_verl_legacy.sh), in fresh processes.
#  - tests/verl_megatron: verl's own Megatron engine (megatron-core 0.16.1 + mbridge, the overlay of
#    scripts/setup_verl_megatron.sh) on CPU with rr's feeder in place of verl's: R3 (rows from the real vLLM server
#    too), R2 through the update, PP = 2 and CP = 2 on two gloo ranks, side by side with verl's feeder, the refusals.
#  - tests/verl/test_sglang_read.py again with SGLang 0.5.13's real TokenizerManager (the overlay of
#    scripts/setup_sglang.sh, on PYTHONPATH): verl's SGLang routing read, stock and with rr.
# Needs the main .venv (make setup). Extra args go to pytest. Exit status non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
bash scripts/setup_verl.sh
bash scripts/setup_verl_legacy.sh  # verl 0.7.1's legacy FSDP worker, for tests/verl/test_legacy_worker.py
PY=".venvs/verl/bin/python"
echo "=== verl: tests/verl"
"$PY" -m pytest -q -p no:cacheprovider tests/verl "$@"
echo "=== verl + megatron-core 0.16.1 (scripts/setup_verl_megatron.sh overlay): tests/verl_megatron"
bash scripts/setup_verl_megatron.sh
PYTHONPATH="$(scripts/setup_verl_megatron.sh --pythonpath)" "$PY" -m pytest -q -p no:cacheprovider tests/verl_megatron "$@"
echo "=== verl + SGLang 0.5.13: tests/verl/test_sglang_read.py"
bash scripts/setup_sglang.sh 0.5.13
PYTHONPATH="$(scripts/setup_sglang.sh --pythonpath 0.5.13)" RR_SGLANG_VERSION=0.5.13 \
  "$PY" -m pytest -q -p no:cacheprovider tests/verl/test_sglang_read.py "$@"
echo "test_verl: all passed in $(( $(date +%s) - t0 ))s"
