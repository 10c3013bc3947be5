#!/usr/bin/env bash
# A Docker engine for `make docker`: uses a running one; else installs Debian's (docker.io, and mmdebstrap for the
# base image) when missing and this is root on Debian, and starts dockerd in the background, its log and pid in
# $RR_DOCKER_STATE (default build/docker-daemon). Prints how to stop a daemon it started.
set -euo pipefail
. "$(dirname "$0")/docker_cli.sh"
state="${RR_DOCKER_STATE:-build/docker-daemon}"
if docker info >/dev/null 2>&1; then
  command -v mmdebstrap >/dev/null || need_pkgs=1
  [ -z "${need_pkgs:-}" ] && exit 0
fi
missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "ensure_docker: missing ${missing[*]}: install them (Debian: apt-get install -y --no-install-recommends" \
         "${missing[*]}) or start a Docker engine" >&2
    exit 1
  fi
  echo "ensure_docker: installing Debian's ${missing[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
docker info >/dev/null 2>&1 && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "ensure_docker: no Docker engine answers (docker info) and starting dockerd needs root" >&2; exit 1
fi
mkdir -p "$state"
state="$(realpath "$state")"
setsid dockerd >"$state/dockerd.log" 2>&1 </dev/null &
echo $! > "$state/dockerd.pid"
for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
if ! docker info >/dev/null 2>&1; then
  echo "ensure_docker: dockerd did not answer within 60 s; its log: $state/dockerd.log" >&2; tail -5 "$state/dockerd.log" >&2
  exit 1
fi
echo "ensure_docker: started dockerd (pid $(cat "$state/dockerd.pid")); log: $state/dockerd.log;" \
     "stop it with: kill \$(cat $state/dockerd.pid)"
