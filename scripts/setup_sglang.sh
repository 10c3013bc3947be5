#!/usr/bin/env bash
# Install SGLang VERSION... for rr's tests, one isolated overlay per version, on top of the main .venv.
#
#   .venvs/sglang-<V>/      pip --target overlay: sglang==<V> (no deps) + the few pins <V> needs over .venv
#   .venvs/sglang-common/   deps every version imports but .venv lacks (triton, torchvision, ...),
#                           plus a sitecustomize that lets CUDA-linked torchvision import on CPU torch
#   tests/sglang/_stubs/    a CPU stand-in for sgl_kernel (CUDA-only wheel that cannot load here)
# Use:  PYTHONPATH="$(scripts/setup_sglang.sh --pythonpath V)" .venv/bin/python -m pytest tests/sglang
# Idempotent (stamp files keyed on what each overlay installs); .venv itself is never modified. Fails loudly.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_env.sh  # rr_compile_bytecode
REPO="$PWD"
VENV="$(realpath -m "${VENV:-.venv}")"
ROOT="$(realpath -m "${RR_SGLANG_ROOT:-.venvs}")"
PY="$VENV/bin/python"
COMMON="$ROOT/sglang-common"
STUBS="tests/sglang/_stubs"

pythonpath() { echo "$ROOT/sglang-$1:$COMMON:$REPO/$STUBS:$REPO"; }
if [ "${1:-}" = "--pythonpath" ]; then pythonpath "$2"; exit 0; fi
[ $# -gt 0 ] || { echo "usage: $0 VERSION... | --pythonpath VERSION" >&2; exit 2; }
[ -x "$PY" ] || { echo "setup_sglang: $VENV is missing; run scripts/setup.sh first" >&2; exit 1; }
[ -x "$VENV/bin/uv" ] || "$PY" -m pip install -q uv
UV=("$VENV/bin/uv" pip install -q --python "$PY" --no-deps)

# Imported by every tested SGLang at module level and absent from .venv (pinned: what was tested).
COMMON_PKGS=("triton==3.9.0" "torchvision==0.28.0" "ipython==9.18.1" "traitlets==5.16.1" "gguf==0.19.0"
             "soundfile==0.14.0")

extra_pkgs() {  # pins a version needs on top of .venv (its transformers pin when .venv's breaks it)
  case "$1" in
    # 0.5.11/0.5.12 register configs (qwen3_asr, ...) that .venv's newer transformers already has
    0.5.11|0.5.12) echo "transformers==5.6.0 tokenizers>=0.22.0,<=0.23.0 huggingface-hub>=1.5.0,<2" ;;
    0.5.13|0.5.14) echo "transformers==5.8.1 tokenizers>=0.22.0,<=0.23.0 huggingface-hub>=1.5.0,<2" ;;
    0.5.1[5-9]|0.5.2[01]) echo "transformers==5.12.1 tokenizers==0.22.2 huggingface-hub>=1.5.0,<2" ;;
    0.5.22) echo "transformers==5.19.0 tokenizers==0.23.2 huggingface-hub>=1.5.0,<2" ;;
    *) echo "" ;;
  esac
}

stamp_key() { printf '%s\n' "$@" | sha1sum | cut -c1-12; }  # a change of what is installed reinstalls
key="$(stamp_key bytecode "${COMMON_PKGS[@]}" "$(sed -n '/cat > "$COMMON\/sitecustomize.py"/,/^PYEOF/p' "$0")")"
if [ ! -f "$COMMON/.rr-stamp-$key" ]; then
  echo "setup_sglang: common deps -> $COMMON"
  t0=$(date +%s)
  rm -rf "$COMMON"
  "${UV[@]}" --target "$COMMON" "${COMMON_PKGS[@]}"
  cat > "$COMMON/sitecustomize.py" <<'PYEOF'
"""Define torchvision's nms/qnms op schemas so the CUDA-linked torchvision wheel imports on CPU torch."""
try:
    import torch

    for _op in ("nms", "qnms"):
        torch.library.define(f"torchvision::{_op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
except Exception:  # torch missing, or the ops already exist (real torchvision ops loaded)
    pass
PYEOF
  rr_compile_bytecode "$PY" "$COMMON"
  touch "$COMMON/.rr-stamp-$key"
  echo "setup_sglang: common deps ready in $(( $(date +%s) - t0 ))s ($(du -sh "$COMMON" | cut -f1))"
fi

status=0
for v in "$@"; do
  dir="$ROOT/sglang-$v"
  key="$(stamp_key bytecode "sglang==$v" "$(extra_pkgs "$v")")"
  if [ -f "$dir/.rr-stamp-$key" ]; then echo "setup_sglang: SGLang $v is up to date ($dir)"; continue; fi
  t0=$(date +%s)
  rm -rf "$dir"
  # shellcheck disable=SC2046
  if ! "${UV[@]}" --target "$dir" "sglang==$v" $(extra_pkgs "$v"); then
    echo "setup_sglang: ERROR: SGLang $v could not be installed" >&2; status=1; rm -rf "$dir"; continue
  fi
  got=$(cd "$(mktemp -d)" && PYTHONPATH="$(pythonpath "$v")" "$PY" -c "import sglang; print(sglang.__version__)" 2>&1 | tail -1)
  if [ "$got" != "$v" ]; then
    echo "setup_sglang: ERROR: SGLang $v installed but 'import sglang' gives: $got" >&2; status=1; continue
  fi
  rr_compile_bytecode "$PY" "$dir"
  touch "$dir/.rr-stamp-$key"
  echo "setup_sglang: SGLang $v ready in $(( $(date +%s) - t0 ))s ($(du -sh "$dir" | cut -f1))"
done
exit $status
