#!/usr/bin/env bash
# `make docker-stop`: stops the dockerd that docker/ensure_docker.sh started (its pid in $RR_DOCKER_STATE); a daemon
# started any other way is left alone.
set -euo pipefail
state="${RR_DOCKER_STATE:-build/docker-daemon}"
pid=$(cat "$state/dockerd.pid" 2>/dev/null || true)
if [ -z "$pid" ] || ! kill -0 "$pid" 2>/dev/null; then echo "docker-stop: no dockerd started by rr is running"; exit 0; fi
kill "$pid"
for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
rm -f "$state/dockerd.pid"
echo "docker-stop: stopped dockerd (pid $pid)"
