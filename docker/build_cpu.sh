#!/usr/bin/env bash
# `make docker`: rr's CPU images from nothing on this machine, no image registry: a Docker engine
# (docker/ensure_docker.sh), the Debian base (docker/build_base.sh), the shared CPU runtime (docker/cpu-runtime:
# .venv's exact versions), then rr-vllm:cpu and rr-sglang:cpu through docker/install_rr.sh, the GPU images' own
# install step. Layers and the pip/uv caches are reused: a second build takes seconds.
#   docker/build_cpu.sh [vllm|sglang]...   (default both)
# RR_DOCKER_CA: the CA bundle pip and uv trust in the build (a build secret; default: this host's).
set -euo pipefail
. "$(dirname "$0")/docker_cli.sh"
cd "$(dirname "$0")/.."
engines=("$@"); [ ${#engines[@]} -gt 0 ] || engines=(vllm sglang)
t_all=$(date +%s)
bash docker/ensure_docker.sh
bash docker/build_base.sh rr-base:bookworm
[ -x .venv/bin/python ] || { echo "build_cpu: .venv is missing: make setup first" >&2; exit 1; }
ca="${RR_DOCKER_CA:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}"
[ -s "$ca" ] || { echo "build_cpu: no CA bundle at $ca (set RR_DOCKER_CA)" >&2; exit 1; }

# the runtime's build context: its Dockerfile, .venv's freeze as constraints, the CPU torch wheel for cp311 (the
# image's Python) when a local one exists (else the PyTorch CPU index, RR_TORCH_INDEX)
stage=build/docker-runtime
rm -rf "$stage"; mkdir -p "$stage/wheels"
cp docker/cpu-runtime/Dockerfile "$stage/"
.venv/bin/uv pip freeze --python .venv/bin/python | grep -v '^-e ' > "$stage/constraints.txt"
torch_index=""
wheel=$(compgen -G "${RR_TORCH_WHEELS:-/opt/wheels}/torch-2.13.0+cpu-cp311-cp311-*.whl" | head -1 || true)
if [ -n "$wheel" ]; then ln "$wheel" "$stage/wheels/" 2>/dev/null || cp "$wheel" "$stage/wheels/"
else torch_index="${RR_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"; fi

export DOCKER_BUILDKIT=1
build() {  # TAG DOCKERFILE CONTEXT [build args]
  local tag="$1" file="$2" ctx="$3" t0; shift 3
  t0=$(date +%s)
  docker build -q --secret "id=ca,src=$ca" -t "$tag" -f "$file" "$@" "$ctx" >/dev/null
  echo "build_cpu: $tag in $(( $(date +%s) - t0 ))s, $(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1/1e6}')"
}
build rr-cpu-runtime "$stage/Dockerfile" "$stage" --build-arg "UV_VERSION=$(.venv/bin/uv --version | cut -d' ' -f2)" \
  --build-arg "TORCH_INDEX=$torch_index"
for e in "${engines[@]}"; do
  case "$e" in
    vllm|sglang) build "rr-$e:cpu" "docker/rr-$e/Dockerfile.cpu" . ;;
    *) echo "build_cpu: unknown engine '$e' (vllm or sglang)" >&2; exit 2 ;;
  esac
done
docker image prune -f --filter label=rr.image=1 >/dev/null  # rr's own images an earlier build left untagged
echo "build_cpu: done in $(( $(date +%s) - t_all ))s (docs/docker.md: run, test, save)"
