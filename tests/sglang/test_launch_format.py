"""``rr-server launch sglang --routed-experts-format {npy,sglang,ref}``: rr's flag, taken out of SGLang's arguments and
handed to the server process as RR_ROUTED_EXPERTS_FORMAT (no SGLang needed: runs under the main pytest)."""

from __future__ import annotations

from typing import Any

import pytest

from rr_server.launch import sglang as launch_sglang
from rr_server.launch.process import free_port
from rr_server.serving.generate_protocol import FORMAT_ENV, default_routed_experts_format

PORT = str(free_port())


@pytest.fixture(autouse=True)
def sglang_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's pre-flight asks whether SGLang is installed: here (the main venv) it is said to be."""
    from rr_server.serving.engines import sglang as sglang_releases

    monkeypatch.setattr(sglang_releases, "installed_version", lambda: "0.5.23")


@pytest.mark.parametrize(
    "argv",
    [
        ["--model-path", "m", "--routed-experts-format", "sglang", "--port", PORT],
        ["--model-path", "m", "--routed-experts-format=sglang", "--port", PORT],
    ],
)
def test_flag_sets_env_and_leaves_sglang_args(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Both spellings: SGLang gets its own arguments only; the patched server's default format becomes sglang."""
    monkeypatch.setenv(FORMAT_ENV, "")  # recorded, so the value main() sets is undone after the test
    ran: list[list[str]] = []
    monkeypatch.setattr(launch_sglang, "install_patch", lambda: "test")
    monkeypatch.setattr(launch_sglang, "_run", lambda args: ran.append(args))
    assert launch_sglang.main(argv) == 0
    assert ran == [["--model-path", "m", "--port", PORT, "--enable-return-routed-experts"]]
    assert default_routed_experts_format() == "sglang"


def test_without_flag_env_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    """No flag: the default stays npy (an env the operator set is left alone)."""
    monkeypatch.setenv(FORMAT_ENV, "")  # recorded, so the value main() sets is undone after the test
    monkeypatch.setattr(launch_sglang, "install_patch", lambda: "test")
    monkeypatch.setattr(launch_sglang, "_run", lambda args: None)
    assert launch_sglang.main(["--model-path", "m", "--port", PORT]) == 0
    assert default_routed_experts_format() == "npy"


@pytest.mark.parametrize("argv", [["--routed-experts-format", "bf16"], ["--routed-experts-format"]])
def test_bad_flag_refused_before_sglang(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An unknown or missing value exits 2 naming the flag; SGLang is never started."""
    monkeypatch.setenv(FORMAT_ENV, "")  # recorded, so the value main() sets is undone after the test

    def never(*_: Any) -> None:
        raise AssertionError("SGLang must not start")

    monkeypatch.setattr(launch_sglang, "install_patch", never)
    monkeypatch.setattr(launch_sglang, "_run", never)
    assert launch_sglang.main(["--model-path", "m", "--port", PORT, *argv]) == 2
    assert "--routed-experts-format" in capsys.readouterr().err
