#!/usr/bin/env bash
# `make docker-save`: each CPU image as a `docker save | gzip` archive in build/docker-images/ (no registry needed),
# with its size; on another host: gunzip -c rr-vllm-cpu.tar.gz | docker load
set -euo pipefail
. "$(dirname "$0")/docker_cli.sh"
cd "$(dirname "$0")/.."
out=build/docker-images
mkdir -p "$out"
images=("$@"); [ ${#images[@]} -gt 0 ] || images=(rr-vllm:cpu rr-sglang:cpu)
for tag in "${images[@]}"; do
  file="$out/${tag/:/-}.tar.gz"
  t0=$(date +%s)
  docker save "$tag" | gzip -1 > "$file.part"
  mv "$file.part" "$file"
  echo "docker-save: $tag -> $file ($(du -h "$file" | cut -f1), $(( $(date +%s) - t0 ))s); load: gunzip -c $file | docker load"
done
