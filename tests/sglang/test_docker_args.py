"""The Dockerfiles' ENTRYPOINT plus the documented ``docker run`` arguments parse with each engine's own parser."""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "docker" / "README.md", REPO / "README.md"]


def entrypoint(image: str) -> list[str]:
    """Exec-form ENTRYPOINT + CMD of ``docker/<image>/Dockerfile`` (what ``docker run IMAGE ARGS`` runs first)."""
    text = (REPO / "docker" / image / "Dockerfile").read_text()
    parts: dict[str, list[str]] = {}
    for key in ("ENTRYPOINT", "CMD"):
        found = re.findall(rf"^{key}\s+(\[.*\])\s*$", text, flags=re.M)
        if found:
            parts[key] = json.loads(found[-1])
    assert "ENTRYPOINT" in parts, f"{image}: no exec-form ENTRYPOINT"
    assert re.search(r"^FROM\s+\S+:v?\d+\.\d+\.\d+\S*\s*$", text, flags=re.M), f"{image}: base image not pinned"
    return parts["ENTRYPOINT"] + parts.get("CMD", [])


def documented_runs(image: str) -> list[list[str]]:
    """Arguments after the image name in every ``docker run ... IMAGE ...`` line of the READMEs."""
    runs: list[list[str]] = []
    for doc in DOCS:
        if not doc.is_file():
            continue
        for line in doc.read_text().splitlines():
            if line.strip().startswith("docker run") and re.search(rf"\s{re.escape(image)}(\s|$)", line):
                words = shlex.split(line, comments=True)  # a trailing `# ...` is the shell's comment
                runs.append(words[words.index(image) + 1 :])
    return runs


def _engine_argv(image: str, launcher: list[str], run: list[str]) -> list[str]:
    """What the rr launcher hands the engine for ``docker run IMAGE *run``."""
    argv = entrypoint(image) + run
    assert argv[: len(launcher)] == launcher, f"{image} ENTRYPOINT is not {launcher}: {argv}"
    return argv[len(launcher) :]


@pytest.mark.sglang
def test_sglang_docker_run_args_reach_server_args() -> None:
    """rr-sglang: every documented ``docker run`` line parses with SGLang's ServerArgs CLI parser."""
    from sglang.srt.server_args import ServerArgs

    from rr_server.launch.sglang import prepare_argv

    runs = documented_runs("rr-sglang")
    assert runs, "no `docker run ... rr-sglang ...` line documented"
    for run in runs:
        argv = prepare_argv(_engine_argv("rr-sglang", ["rr-server", "launch", "sglang"], run))
        parser = argparse.ArgumentParser(exit_on_error=False)
        ServerArgs.add_cli_args(parser)
        ns = parser.parse_args(argv)
        assert ns.model_path == run[run.index("--model-path") + 1]
        assert ns.enable_return_routed_experts is True
        assert (ns.host, ns.port) == ("0.0.0.0", 30000)


def test_vllm_docker_run_args_reach_make_arg_parser() -> None:
    """rr-vllm: every documented ``docker run`` line parses with vLLM's own api_server parser."""
    try:  # vLLM >= 0.29 moved the api_server parser
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    except ImportError:
        from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from rr_server.launch.vllm import build_command

    runs = documented_runs("rr-vllm")
    assert runs, "no `docker run ... rr-vllm ...` line documented"
    for run in runs:
        cmd, _ = build_command(_engine_argv("rr-vllm", ["rr-server", "launch", "vllm"], run), cpu=False)
        assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
        ns = make_arg_parser(FlexibleArgumentParser()).parse_args(cmd[3:])
        validate_parsed_serve_args(ns)
        assert ns.model == run[run.index("--model") + 1]
        assert ns.enable_return_routed_experts is True
        assert (ns.host, ns.port) == ("0.0.0.0", 8000)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_each_image_runs_the_shared_install_for_its_engine(engine: str) -> None:
    """Both Dockerfiles copy the repository through ``.dockerignore`` (rr's sources and build files only) and run
    ``docker/install_rr.sh <engine>``, whose import check names that engine's plugin and launcher."""
    text = (REPO / "docker" / f"rr-{engine}" / "Dockerfile").read_text()
    assert re.search(r"^COPY \. \./\s*$", text, flags=re.M), f"rr-{engine}: does not copy the repository root"
    assert re.search(rf"^RUN sh docker/install_rr\.sh {engine}\s*$", text, flags=re.M), text
    let_in = {line[1:] for line in (REPO / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    assert {
        "pyproject.toml",
        "setup.py",
        "README.md",
        "rr_client",
        "rr_server",
        "rr_patches",
        "docker/install_rr.sh",
    } <= let_in
    script = (REPO / "docker" / "install_rr.sh").read_text()
    assert "pip install --no-cache-dir --no-deps ." in script
    assert "import rr_client, rr_patches.${engine}.plugin, rr_server.launch.${engine};" in script
    assert (REPO / "rr_patches" / engine / "plugin.py").is_file()
    assert (REPO / "rr_server" / "launch" / f"{engine}.py").is_file()
