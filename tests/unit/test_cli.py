"""``rr-server --help`` describes every command, ``--version`` prints the version, and the launchers' ``--help``
shows rr's own options before the engine's help (or says the engine is not installed, without a traceback)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rr_client import __version__
from rr_server.launch import sglang as launch_sglang
from rr_server.launch import vllm as launch_vllm
from rr_server.launch.options import FORMAT_FLAG, STORE_FLAG

REPO = Path(__file__).resolve().parents[2]


def rr_server(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m rr_server ARGS`` in a fresh interpreter (this checkout first on the path)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "rr_server", *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=120
    )


def test_help_describes_every_command() -> None:
    out = rr_server("--help")
    assert out.returncode == 0 and out.stderr == ""
    for command, says in [
        ("launch vllm ARGS...", "start vLLM's OpenAI API server with rr's plugin"),
        ("launch sglang ARGS...", "start SGLang's server with rr's patch"),
        ("proxy", "the sidecar"),
        ("doctor URL", "check, in seconds, that a running server's routing is right"),
        ("--version", "print rr-server's version"),
    ]:
        assert re.search(rf"^  {re.escape(command)} +{re.escape(says)}", out.stdout, re.M), command
    assert "make demo" in out.stdout


def test_version_and_usage_errors() -> None:
    out = rr_server("--version")
    assert (out.returncode, out.stdout, out.stderr) == (0, f"rr-server {__version__}\n", "")
    for bad, says in (
        ([], "no command given"),
        (["launch"], "launch needs an engine: launch vllm or launch sglang"),
        (["launch", "tgi"], "no engine 'tgi' to launch: launch vllm or launch sglang"),
        (["launch", "vlm", "--model", "m"], "no engine 'vlm' to launch: did you mean vllm?"),
        (["serve"], "unknown command 'serve'"),
        (["doctr", "http://127.0.0.1:8000"], "unknown command 'doctr': did you mean doctor?"),
    ):
        out = rr_server(*bad)
        assert (out.returncode, out.stdout) == (2, ""), bad
        assert out.stderr == f"rr-server: {says} (rr-server --help lists the commands)\n", bad


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang installed: tests/sglang has it")
def test_launch_sglang_help_without_sglang_shows_rr_options_then_says_why_no_more() -> None:
    out = rr_server("launch", "sglang", "--help", "--model-path", "m")
    assert out.returncode == 0 and "Traceback" not in out.stdout + out.stderr, out.stderr
    text = out.stdout
    assert text.startswith("usage: rr-server launch sglang [rr options] <SGLang launch_server arguments...>")
    assert re.search(r"--routed-experts-format \{npy,sglang,ref\}\s+the server's default routed_experts_format", text)
    assert (
        text.index("rr's options")
        < text.index("SGLang's own arguments:")
        < text.index("SGLang's help is unavailable: sglang is not installed (pip install 'rr-replay[sglang]')")
    )


def test_launch_vllm_help_shows_rr_options_before_vllms(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """rr's options first, then vLLM's own ``--help`` (``--help=GROUP`` passed on); nothing checked or started."""
    ran: list[list[str]] = []

    def call(cmd: list[str], env: dict[str, str]) -> int:
        ran.append(cmd)
        print("usage: vllm serve [-h] ...")
        return 0

    monkeypatch.setattr(launch_vllm.subprocess, "call", call)
    monkeypatch.setattr(launch_vllm, "installed_version", lambda: pytest.fail("help checks no version"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else None)
    assert launch_vllm.main(["--model", "m", "--help=ModelConfig", "--rr-cpu"]) == 0
    text = capsys.readouterr().out
    assert ran == [[sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--help=ModelConfig"]]
    assert text.startswith("usage: rr-server launch vllm [rr options] <vLLM api_server arguments...>")
    for flag in ("--rr-allow-unsupported-version", "--rr-cpu", "--rr-allow-open-dev-mode", "--routed-experts-format"):
        assert text.index(flag) < text.index("vLLM's own arguments:") < text.index("usage: vllm serve"), flag


def test_launch_vllm_help_without_vllm(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    monkeypatch.setattr(launch_vllm.subprocess, "call", lambda *a, **k: pytest.fail("no vLLM to ask"))
    assert launch_vllm.main(["-h"]) == 0
    text = capsys.readouterr().out
    assert "--rr-cpu" in text and text.rstrip().endswith(
        "vLLM's help is unavailable: vllm is not installed (pip install 'rr-replay[vllm]')"
    )


@pytest.mark.parametrize("launcher", [launch_vllm, launch_sglang], ids=["vllm", "sglang"])
def test_launcher_options_are_the_ones_it_takes_and_documented(launcher: object) -> None:
    parser = launcher.build_parser()  # type: ignore[attr-defined]
    flags = {o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    taken = {*launcher._RR_FLAGS, FORMAT_FLAG, STORE_FLAG}  # type: ignore[attr-defined]
    assert flags == taken
    assert all(a.help for a in parser._actions)  # every option explains itself
    text = (REPO / "docs/engines.md").read_text()
    assert [f for f in sorted(flags) if not re.search(re.escape(f) + r"(?![\w-])", text)] == []


def test_doctor_help_lists_every_probe_flag_with_a_one_line_help() -> None:
    """``rr-server doctor --help`` (80 columns, in a fresh interpreter): a "probes" section naming the probes that
    always run, and each ``--probe-*`` flag in it with its help on one line; every option explains itself."""
    from rr_server.doctor import MAX_PROBE_REQUESTS, build_parser
    from rr_server.doctor.probes import MAX_PROBE_REQUESTS as PROBES_CAP

    assert MAX_PROBE_REQUESTS == PROBES_CAP  # the help states the probes' own default
    parser = build_parser()
    probe_flags = {o: a for a in parser._actions for o in a.option_strings if o.startswith("--probe")}
    assert {"--probe-weight-update", "--probe-requests"} <= set(probe_flags)
    assert all(a.help for a in parser._actions)
    out = subprocess.run(
        [sys.executable, "-m", "rr_server", "doctor", "--help"],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "COLUMNS": "80",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        },
        cwd=REPO,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    section = out.stdout.split("\nprobes:\n", 1)[1]
    for name in ("preemption", "kv offload", "hierarchical cache", "bounded replay"):
        assert name in " ".join(section.split()), name
    lines = section.splitlines()
    for flag, action in probe_flags.items():
        assert any(flag in ln for ln in lines), f"{flag} is not in the probes section"
        assert any(ln.strip().endswith(str(action.help)) for ln in lines), f"{flag}'s help is not one line"


@pytest.mark.parametrize(
    "argv",
    [
        ["--pd-prefill", "http://p:1"],
        ["--pd-prefill", "http://p:1", "--pd-decode", "http://d:2"],
        ["--pd-prefill", "http://p:1", "--pd-decode", "http://d:2", "--pd-bootstrap-port", "0"],
    ],
)
def test_doctor_pd_flags_go_together(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Half a P/D pair is bad usage (exit 2, naming the three flags), before anything is sent."""
    from rr_server.doctor import main

    assert main(["http://127.0.0.1:9", *argv]) == 2
    assert "--pd-prefill, --pd-decode and --pd-bootstrap-port go together" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv", [["--engine", "vllm"], ["--engine", "sglang"], ["--engine", "sglang", "--bootstrap-port", "0"]]
)
def test_sidecar_prefill_upstream_needs_sglang_and_a_bootstrap_port(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from rr_server.proxy import main

    assert main(["--upstream", "http://d:2", "--prefill-upstream", "http://p:1", *argv]) == 2
    assert "needs --engine sglang and --bootstrap-port" in capsys.readouterr().err
