# Sourced by scripts/setup.sh: run a long step with its output kept out of sight and no silent stretch.
#
# rr_step LABEL CMD...   prints "setup: LABEL...", runs CMD (a command or a shell function) with its stdout and
#   stderr in a log, prints "setup: LABEL... Ns" every $RR_HEARTBEAT_S seconds (15) while it runs, then one line
#   "setup: LABEL: done in Ns" with uv's summary (Resolved/Prepared/Installed... lines; uv's per-package list is
#   not shown) and any warning line. On failure the step's whole output is printed on stderr, the log's path named,
#   and CMD's exit status returned. A hint in LABEL after " (" (an expected duration) is shown on the first line
#   only: "compiling .pyc (~2 min)" beats as "setup: compiling .pyc... 15s".
# The log: $RR_SETUP_LOG when set (each step appended to it), else a temporary file kept only when the step fails.

rr_step() {
  local label="$1"; shift
  local out t0 rc=0 hb summary short="${label%% (*}"
  out=$(mktemp "${TMPDIR:-/tmp}/rr-step.XXXXXX")
  t0=$(date +%s)
  echo "setup: $label..."
  # the heartbeat stops with the step, its sleep too (no stray process keeps a pipe such as `| tee` open), or by
  # itself if this shell is gone (Ctrl-C)
  ( s=""
    trap 'kill "$s" 2>/dev/null; wait "$s" 2>/dev/null; exit 0' TERM
    while :; do
      sleep "${RR_HEARTBEAT_S:-15}" >/dev/null 2>&1 &
      s=$!
      wait "$s" || true
      kill -0 "$$" 2>/dev/null || exit 0
      echo "setup: $short... $(( $(date +%s) - t0 ))s"
    done ) &
  hb=$!
  "$@" >"$out" 2>&1 </dev/null || rc=$?
  kill "$hb" 2>/dev/null || true
  wait "$hb" 2>/dev/null || true
  local log="${RR_SETUP_LOG:-$out}"
  if [ "$log" != "$out" ]; then
    { echo "== $short: $*"; cat "$out"; echo "== exit status $rc"; } >>"$log"
  fi
  if [ "$rc" -ne 0 ]; then
    {
      echo "setup: ERROR: $short failed (exit status $rc) after $(( $(date +%s) - t0 ))s; its output:"
      cat "$out"
      echo "setup: ERROR: $short failed (exit status $rc); its output is above and in $log"
    } >&2
    [ "$log" = "$out" ] || rm -f "$out"
    return "$rc"
  fi
  grep -E '^(warning|WARNING|Warning)' "$out" || true
  summary=$(grep -E '^(Resolved|Prepared|Uninstalled|Installed|Audited|Checked|Bytecode compiled) ' "$out" \
            | paste -sd ';' | sed 's/;/; /g' || true)
  echo "setup: $short: done in $(( $(date +%s) - t0 ))s${summary:+ ($summary)}"
  rm -f "$out"
}
