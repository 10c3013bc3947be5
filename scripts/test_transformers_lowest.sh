#!/usr/bin/env bash
# The low end of the declared transformers range (`[torch]`: >=5.10,<5.25) on transformers 5.10.4 in verl's env
# (.venvs/verl, scripts/setup_verl.sh): what depends on the transformers release - replay coverage of every family
# (refusals naming the release included), replay and record on the tiny models, the audit, fake CUDA. The high end
# (5.24.0) runs the same files in `make test-core` (.venv). The rest of tests/trainer (layouts, metrics, the cost
# counter, session, checkpointing) also passed on 5.10.4 when this stage was added (issue 36), but runs on .venv
# only, to keep CI short; test_doctor_truth.py needs rr_server's doctor and GLM-4-MoE, which 5.10 refuses.
# Extra args go to pytest. Exit status non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
bash scripts/setup_verl.sh
PY=".venvs/verl/bin/python"
echo "=== transformers $("$PY" -c 'import transformers; print(transformers.__version__)'): tests/trainer"
"$PY" -m pytest -q -p no:cacheprovider tests/trainer/test_replay_families.py tests/trainer/test_replay.py \
  tests/trainer/test_replay_audit.py tests/trainer/test_fake_cuda.py "$@"
echo "test_transformers_lowest: all passed in $(( $(date +%s) - t0 ))s"
