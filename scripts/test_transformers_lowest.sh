#!/usr/bin/env bash
# The low end of the declared transformers range (`[torch]`: >=5.10,<5.24): tests/trainer (replay coverage of every
# family, the audit, the cost counter, fake CUDA, layouts, session) on transformers 5.10.4 in verl's env
# (.venvs/verl, scripts/setup_verl.sh). The high end (5.23.0) is `make test-core` in .venv. test_doctor_truth.py
# stays on .venv (rr_server's doctor; GLM-4-MoE, which 5.10 refuses). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
bash scripts/setup_verl.sh
PY=".venvs/verl/bin/python"
echo "=== transformers $("$PY" -c 'import transformers; print(transformers.__version__)'): tests/trainer"
"$PY" -m pytest -q -p no:cacheprovider tests/trainer --ignore=tests/trainer/test_doctor_truth.py "$@"
echo "test_transformers_lowest: all passed in $(( $(date +%s) - t0 ))s"
