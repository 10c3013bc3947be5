#!/usr/bin/env bash
# Install (scripts/setup_sglang.sh) and test every supported SGLang version against SGLang's real code.
# Exit status is non-zero if any version fails to install or any test fails. Extra args go to pytest.
#   RR_SGLANG_VERSIONS="0.5.9 0.5.23" scripts/test_sglang.sh -x
# Every release runs the whole tests/sglang on its own overlay. The installs run one after another; the test runs
# are single-threaded Python, so they run RR_SGLANG_JOBS at a time (default: one per core, at most 2). The first
# version runs alone (it builds the tiny checkpoints every run shares), then the rest in parallel, each starting as
# soon as its overlay is installed; each run's output is kept and printed whole, in version order.
set -uo pipefail
cd "$(dirname "$0")/.."
# Every version where the behaviour rr relies on changes (see docs/engines.md): ~30-75 s each.
read -r -a VERSIONS <<< "${RR_SGLANG_VERSIONS:-0.5.7 0.5.8 0.5.9 0.5.10 0.5.11 0.5.12 0.5.13 0.5.14 0.5.15 0.5.16 0.5.17 0.5.18 0.5.19 0.5.20 0.5.21 0.5.22 0.5.23}"
PY="${VENV:-.venv}/bin/python"
CORES="$(nproc 2>/dev/null || echo 1)"
JOBS="${RR_SGLANG_JOBS:-$(( CORES < 2 ? 1 : 2 ))}"
LOGS="$(mktemp -d)"
trap 'rm -rf "$LOGS"' EXIT
failed=()
installed=()


run_one() {  # VERSION [pytest args]: the whole tests/sglang on that overlay; output and status to $LOGS
  local v="$1" t0 rc
  shift
  t0=$(date +%s)
  {
    echo "=== SGLang $v: tests/sglang"
    PYTHONPATH="$(scripts/setup_sglang.sh --pythonpath "$v")" RR_SGLANG_VERSION="$v" \
      "$PY" -m pytest -q -p no:cacheprovider -m sglang tests/sglang "$@"
    rc=$?
    echo "=== SGLang $v done in $(( $(date +%s) - t0 ))s"
  } > "$LOGS/$v.log" 2>&1
  echo "$rc" > "$LOGS/$v.rc"
}

# Each overlay is installed (one after another) just before its tests start, so the installs (disk-bound) overlap
# the tests of the releases before (CPU-bound) instead of all coming first.
t_tests=$(date +%s)
first_pid=""
for v in "${VERSIONS[@]}"; do
  if ! scripts/setup_sglang.sh "$v"; then
    echo "test_sglang: SGLang $v: INSTALL FAILED" >&2; failed+=("$v(install)"); continue
  fi
  installed+=("$v")
  if [ "${#installed[@]}" -eq 2 ]; then wait "$first_pid"; fi  # the first run alone: it builds the shared checkpoints
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
  run_one "$v" "$@" &
  if [ -z "$first_pid" ]; then first_pid=$!; fi
done
wait

for v in "${installed[@]}"; do
  cat "$LOGS/$v.log"
  [ "$(cat "$LOGS/$v.rc" 2>/dev/null)" = "0" ] || failed+=("$v")
done
echo "test_sglang: installs and tests of ${#installed[@]} releases took $(( $(date +%s) - t_tests ))s ($JOBS at a time)"
if [ ${#failed[@]} -gt 0 ]; then echo "test_sglang: FAILED: ${failed[*]}" >&2; exit 1; fi
echo "test_sglang: all passed (${VERSIONS[*]})"
