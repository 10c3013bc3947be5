#!/usr/bin/env bash
# The local base image rr's CPU images build on, made from Debian's own packages (no image registry needed):
# Debian bookworm minbase with Python 3.11, venv, pip, C and C++ compilers (rr's row checker compiles at install;
# torch's inductor compiles vLLM's CPU sampling kernels at the first sampled request) and the CA bundle. Written to a file first, then `docker import` (mmdebstrap writing into a pipe whose reader fails gets
# SIGHUP). Skipped when the image exists with the same package list (label rr.base.key; RR_DOCKER_REBUILD_BASE=1
# rebuilds it anyway).
#   docker/build_base.sh [IMAGE]          (default rr-base:bookworm)
# Apt sources: $RR_DEBIAN_SOURCES, else this host's (/etc/apt/sources.list.d/debian.sources or sources.list).
set -euo pipefail
. "$(dirname "$0")/docker_cli.sh"
image="${1:-rr-base:bookworm}"
packages=python3,python3-venv,python3-pip,python3-dev,gcc,g++,libc6-dev,ca-certificates,libgomp1,libnuma1,procps
key=$(echo "bookworm minbase $packages" | sha1sum | cut -c1-12)
if [ "$(docker image inspect -f '{{index .Config.Labels "rr.base.key"}}' "$image" 2>/dev/null)" = "$key" ] \
   && [ -z "${RR_DOCKER_REBUILD_BASE:-}" ]; then
  echo "build_base: $image exists ($(docker image inspect -f '{{.Size}}' "$image" | awk '{printf "%.0f MB", $1/1e6}'))"
  exit 0
fi
command -v mmdebstrap >/dev/null || {
  echo "build_base: mmdebstrap is missing: apt-get install -y --no-install-recommends mmdebstrap" >&2; exit 1; }
sources="${RR_DEBIAN_SOURCES:-}"
if [ -z "$sources" ]; then
  for f in /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list; do [ -s "$f" ] && { sources="$f"; break; }; done
fi
[ -n "$sources" ] || { echo "build_base: no apt sources file (set RR_DEBIAN_SOURCES)" >&2; exit 1; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
t0=$(date +%s)
mmdebstrap --quiet --variant=minbase \
  --include="$packages" \
  bookworm "$work/base.tar" "$sources" </dev/null
docker import --change 'CMD ["/bin/bash"]' --change 'ENV LANG=C.UTF-8' --change "LABEL rr.base.key=$key" --change "LABEL rr.image=1" \
  "$work/base.tar" "$image" >/dev/null
echo "build_base: $image from Debian bookworm ($sources) in $(( $(date +%s) - t0 ))s," \
  "$(docker image inspect -f '{{.Size}}' "$image" | awk '{printf "%.0f MB", $1/1e6}')"
