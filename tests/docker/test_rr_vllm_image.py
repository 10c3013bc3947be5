"""`docker run rr-vllm:cpu`: the image `make docker` builds serves rr's routing for real, from a container.

The demo's tiny MoE is mounted read-only; rows come back through rr's client and equal transformers' own router
top-k on every cell; `rr-server doctor` passes from the host; the API key given to `docker run` guards rr's routes;
the container runs as a non-root user with no secret in the image; `docker stop` leaves no process behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from rr_client import RoutedExpertsClient
from rr_client.core.hf_config import load_config, moe_layers_from_config
from rr_server.demo.tiny_moe import reference_routing
from tests.docker.conftest import docker, readme_run
from tests.support.routing_asserts import assert_routing_sets_equal
from tests.support.vllm_process import STARTUP_TIMEOUT_S

IMAGE = "rr-vllm:cpu"
KEY = "rr-docker-test-" + uuid.uuid4().hex[:8]
PROMPTS = ["Hello world, this is a tiny test.", "Once upon a time there was a router.", "1 2 3 4 5"]
GREEDY = {"max_new_tokens": 10, "temperature": 0.0}


def run_container(model: Path, *args: str, shm: bool = True) -> str:
    """README's `docker run ... rr-vllm:cpu` line, detached and named, on a free loopback port (README: 8000) and
    with ``args`` added; ``model`` must be the folder it mounts. ``shm=False`` drops its --shm-size."""
    options, engine = readme_run(IMAGE)
    assert "--rm" in options and "8000:8000" in options and f"{model}:/models/demo:ro" in options, options
    options = ["127.0.0.1::8000" if o == "8000:8000" else o for o in options if o != "--rm"]
    if not shm:
        i = options.index("--shm-size")
        options = options[:i] + options[i + 2 :]
    name = f"rr-test-{uuid.uuid4().hex[:8]}"
    docker("run", "-d", "--name", name, *options, IMAGE, *engine, *args)
    return name


def wait_healthy(name: str) -> str:
    """The container's base URL once vLLM's /health answers; fails with its log if it exits or stalls."""
    port = docker("port", name, "8000/tcp").stdout.strip().rsplit(":", 1)[1]
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if docker("inspect", "-f", "{{.State.Running}}", name).stdout.strip() != "true":
            raise AssertionError(f"{name} exited during start-up:\n{docker('logs', name).stderr[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise AssertionError(f"{name} not healthy in {STARTUP_TIMEOUT_S:.0f} s:\n{docker('logs', name).stderr[-3000:]}")


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[tuple[str, str]]:
    """One keyed rr-vllm:cpu container for the module: (name, base URL); removed at the end."""
    name = run_container(model_dir, "--api-key", KEY)
    try:
        yield name, wait_healthy(name)
    finally:
        docker("rm", "-f", name, check=False)


def test_generate_rows_equal_transformers_on_every_cell(served: tuple[str, str], model_dir: Path) -> None:
    _, url = served

    async def run() -> list:
        async with RoutedExpertsClient(url, api_key=KEY) as c:
            return list(await c.generate(PROMPTS, GREEDY))

    results = asyncio.run(run())
    moe = moe_layers_from_config(load_config(model_dir))
    assert len(results) == len(PROMPTS)
    for r in results:
        assert r.routed_experts is not None and r.routed_experts.dtype == np.uint8
        assert len(r.output_ids) == GREEDY["max_new_tokens"]
        truth = reference_routing(model_dir, list(r.prompt_ids) + list(r.output_ids))[:-1]
        assert r.routed_experts.shape == truth.shape
        assert_routing_sets_equal(r.routed_experts, truth, layers=moe)


def test_rr_routes_need_the_key_given_to_docker_run(served: tuple[str, str]) -> None:
    _, url = served
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}, "return_routed_experts": True}
    assert httpx.post(url + "/generate", json=body, timeout=60).status_code == 401
    bad = httpx.post(url + "/generate", json=body, headers={"Authorization": "Bearer wrong"}, timeout=60)
    assert bad.status_code == 401
    ok = httpx.post(url + "/generate", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_the_doctor_passes_from_the_host(served: tuple[str, str], model_dir: Path) -> None:
    _, url = served
    rr_server = Path(os.environ.get("VIRTUAL_ENV", ".venv")) / "bin" / "rr-server"
    exe = [str(rr_server)] if rr_server.exists() else ["python", "-m", "rr_server.cli"]
    out = subprocess.run(
        [*exe, "doctor", url, "--model-path", str(model_dir), "--api-key", KEY, "--json"],
        capture_output=True, text=True, timeout=STARTUP_TIMEOUT_S,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rep = json.loads(out.stdout)
    assert rep["verdict"] == "PASS" and rep["deployment"] == "patched", [c for c in rep["checks"] if not c["ok"]]
    # the engine's rows against transformers on the host's copy of the mounted checkpoint
    assert rep["ground_truth"]["agreement"] == 1.0 and rep["ground_truth"]["compared"] > 100


def test_non_root_user_and_no_secret_in_the_image(served: tuple[str, str]) -> None:
    name, _ = served
    assert docker("exec", name, "id", "-u").stdout.strip() == "1000"
    config = json.loads(docker("image", "inspect", IMAGE).stdout)[0]["Config"]
    assert config["User"] == "rr"
    env = dict(e.split("=", 1) for e in config["Env"])
    assert not [k for k in env if any(s in k.upper() for s in ("KEY", "TOKEN", "SECRET", "PASSWORD"))], env
    assert KEY not in json.dumps(config)  # the key given to docker run is the container's, not the image's
    assert KEY not in docker("history", "--no-trunc", IMAGE).stdout
    # the build's CA bundle was a build secret: mounted for pip and uv, never written into a layer
    assert (
        docker("run", "--rm", "--entrypoint", "sh", IMAGE, "-c", "test ! -e /run/secrets/ca", check=False).returncode
        == 0
    )


def test_a_model_only_root_can_read_is_refused_in_one_line(model_dir: Path, tmp_path: Path) -> None:
    """uid 1000 cannot read a 0600 root-owned weights file: rr's pre-flight says so (vLLM would say 'No such file')."""
    locked = tmp_path / "locked"
    shutil.copytree(model_dir, locked)
    (locked / "model.safetensors").chmod(0o600)
    locked.chmod(0o755)
    tmp_path.chmod(0o755)
    out = docker(
        "run", "--rm", "-v", f"{locked}:/models/demo:ro", IMAGE, "--model", "/models/demo", check=False,
        timeout=STARTUP_TIMEOUT_S,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    assert "--model /models/demo: model.safetensors cannot be read by this user (uid 1000)" in out.stderr


def test_dockers_small_dev_shm_is_named_before_vllm_fails(model_dir: Path) -> None:
    name = run_container(model_dir, shm=False)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while docker("inspect", "-f", "{{.State.Running}}", name).stdout.strip() == "true":
            assert time.monotonic() < deadline, "vLLM started with 64 MiB of /dev/shm (the note would be wrong)"
            time.sleep(2)
        log = docker("logs", name).stderr
        assert "rr: /dev/shm has 64 MiB free" in log and "--shm-size 1g" in log
        assert "Insufficient space in /dev/shm" in log  # vLLM's own refusal, which the note names in advance
    finally:
        docker("rm", "-f", name, check=False)


def test_docker_stop_leaves_no_process(served: tuple[str, str]) -> None:
    """Last in the module: it stops the module's container (the fixture then removes it)."""
    name, _ = served
    pids = [int(line.split()[0]) for line in docker("top", name, "-eo", "pid").stdout.splitlines()[1:]]
    assert len(pids) >= 3  # the launcher, vLLM's API server, its engine core (and its worker)
    docker("stop", "-t", "30", name, timeout=STARTUP_TIMEOUT_S)
    state = json.loads(docker("inspect", name).stdout)[0]["State"]
    assert state["Running"] is False
    # a clean exit of the launcher (rr's exit path), not Docker's SIGKILL after the grace period
    assert state["ExitCode"] in (0, 143), state
    assert not [p for p in pids if Path(f"/proc/{p}").exists()], "processes outlived docker stop"
