# Sourced by rr's docker scripts: `docker` is the client that can build with BuildKit. A newer client without its
# buildx plugin (refuses DOCKER_BUILDKIT=1) gives way to Debian's own /usr/bin/docker, whose built-in builder works.
docker() {
  if [ -z "${RR_DOCKER_CLI:-}" ]; then
    RR_DOCKER_CLI=$(command -v docker || true)
    if [ -x /usr/bin/docker ] && [ "$RR_DOCKER_CLI" != /usr/bin/docker ] && ! command docker buildx version >/dev/null 2>&1; then
      RR_DOCKER_CLI=/usr/bin/docker
    fi
    export RR_DOCKER_CLI
  fi
  "${RR_DOCKER_CLI:?no docker client (make docker installs the docker.io package)}" "$@"
}
