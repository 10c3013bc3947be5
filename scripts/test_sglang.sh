#!/usr/bin/env bash
# Install (scripts/setup_sglang.sh) and test every supported SGLang version against SGLang's real code.
# Exit status is non-zero if any version fails to install or any test fails. Extra args go to pytest.
#   RR_SGLANG_VERSIONS="0.5.9 0.5.23" scripts/test_sglang.sh -x
set -uo pipefail
cd "$(dirname "$0")/.."
# Every version where the behaviour rr relies on changes (see docs/engines.md): ~30-75 s each.
read -r -a VERSIONS <<< "${RR_SGLANG_VERSIONS:-0.5.7 0.5.8 0.5.9 0.5.10 0.5.11 0.5.12 0.5.13 0.5.14 0.5.15 0.5.16 0.5.17 0.5.18 0.5.19 0.5.20 0.5.21 0.5.22 0.5.23}"
PY="${VENV:-.venv}/bin/python"
failed=()
for v in "${VERSIONS[@]}"; do
  t0=$(date +%s)
  if ! scripts/setup_sglang.sh "$v"; then
    echo "test_sglang: SGLang $v: INSTALL FAILED" >&2; failed+=("$v(install)"); continue
  fi
  echo "=== SGLang $v: tests/sglang"
  if ! PYTHONPATH="$(scripts/setup_sglang.sh --pythonpath "$v")" RR_SGLANG_VERSION="$v" \
       "$PY" -m pytest -q -p no:cacheprovider -m sglang tests/sglang "$@"; then
    failed+=("$v")
  fi
  echo "=== SGLang $v done in $(( $(date +%s) - t0 ))s"
done
if [ ${#failed[@]} -gt 0 ]; then echo "test_sglang: FAILED: ${failed[*]}" >&2; exit 1; fi
echo "test_sglang: all passed (${VERSIONS[*]})"
