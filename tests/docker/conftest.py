"""rr's CPU images, run for real: `make test-docker` builds them (`make docker`) and sets RR_TEST_DOCKER=1.

Under a plain ``pytest tests`` (no Docker engine asked for) these tests are deselected, never skipped; asked for,
a missing engine or image fails the session with what to run.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from rr_server.demo.quickstart import MODEL_DIR, MODEL_SPEC
from rr_server.demo.tiny_moe import build_tiny_moe
from tests.support.versions import deselect

IMAGES = ("rr-vllm:cpu", "rr-sglang:cpu")
WANTED = os.environ.get("RR_TEST_DOCKER") == "1"
REPO = Path(__file__).resolve().parents[2]


def docker_cli() -> str:
    """The client `make docker` builds with (docker/docker_cli.sh): RR_DOCKER_CLI, Debian's, else `docker`."""
    if cli := os.environ.get("RR_DOCKER_CLI"):
        return cli
    return "/usr/bin/docker" if Path("/usr/bin/docker").exists() else (shutil.which("docker") or "docker")


def docker(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The Docker client, its output captured as text."""
    return subprocess.run([docker_cli(), *args], capture_output=True, text=True, check=check, timeout=timeout)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The demo's tiny MoE where `make demo` keeps it (README's `docker run` line mounts that folder), built with
    the demo's own spec if missing; its files readable by the images' user (uid 1000)."""
    return build_tiny_moe(REPO / MODEL_DIR, **MODEL_SPEC)


def readme_run(image: str) -> tuple[list[str], list[str]]:
    """README's ``docker run ... IMAGE ...`` line: (docker's options, the engine's arguments), ``$PWD`` the checkout."""
    lines = [
        ln
        for ln in (REPO / "README.md").read_text().splitlines()
        if ln.startswith("docker run ") and f" {image} " in ln
    ]
    assert len(lines) == 1, f"README.md: {len(lines)} `docker run ... {image} ...` lines (one expected)"
    words = shlex.split(lines[0].split("#", 1)[0].replace("$PWD", str(REPO)))
    i = words.index(image)
    return words[2:i], words[i + 1 :]


def pytest_configure(config: pytest.Config) -> None:
    """Asked for (RR_TEST_DOCKER=1): the engine must answer and both images exist, else stop with the fix."""
    if not WANTED:
        return
    cli = docker_cli()
    if subprocess.run([cli, "info"], capture_output=True).returncode != 0:
        raise pytest.UsageError(f"RR_TEST_DOCKER=1 but no Docker engine answers '{cli} info': run make docker")
    for image in IMAGES:
        if subprocess.run([cli, "image", "inspect", image], capture_output=True).returncode != 0:
            raise pytest.UsageError(f"RR_TEST_DOCKER=1 but the image {image} is missing: run make docker")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without RR_TEST_DOCKER=1, deselect tests/docker (make test-docker runs it)."""
    if not WANTED:
        here = Path(__file__).parent
        deselect(config, items, lambda i: here in Path(str(i.path)).parents)
