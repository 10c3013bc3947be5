#!/bin/sh
# Installs rr into an engine's official image (run by docker/rr-<engine>/Dockerfile from /opt/rr).
# Usage: sh docker/install_rr.sh sglang|vllm
# rr's own dependencies are already in both images (numpy, torch, httpx, pybase64, orjson, pydantic, fastapi,
# uvicorn); --no-deps keeps the engine's pinned stack untouched. Installing registers rr's plugin entry point
# (`vllm.general_plugins: rr`, which every vLLM process loads; `sglang.srt.plugins: rr`, which SGLang's
# load_plugins() picks up). The import check fails the build when the engine's plugin or launcher does not
# import, the C row checker did not compile or rr's patch does not fit the installed engine (run outside the source folder, so the installed rr is the one checked).
set -eu
engine="$1"
case "$engine" in
  sglang|vllm) ;;
  *) echo "install_rr.sh: unknown engine '$engine' (sglang or vllm)" >&2; exit 2 ;;
esac
python3 -m pip install --no-cache-dir --no-deps .
# from / : in the source folder, `import rr_client` would find the sources (no compiled checker), not the install
cd /
python3 -c "import rr_client, rr_patches.${engine}.plugin, rr_server.launch.${engine}; from rr_client.core._rowcheck import HAVE_C; assert HAVE_C, 'the C row checker did not compile'"
# the patch fits the installed engine: the shape checks its start-up runs (python -m rr_patches.selfcheck)
python3 -m rr_patches.selfcheck "$engine"
