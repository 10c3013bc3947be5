"""``rr-server launch sglang --speculative-*`` on each real SGLang release: refused before 0.5.23 (draft layers write
the target's rows, sgl-project/sglang#26980), passed through from 0.5.23 (``disable_routed_experts_capture_for_draft``).
The release is the installed one (scripts/test_sglang.sh's overlay); SGLang's server itself is not started."""

from __future__ import annotations

from typing import Any

import pytest

from rr_server.launch import sglang as launch_sglang
from rr_server.serving.engines import engine_release
from rr_server.serving.engines.sglang import installed_version

pytestmark = pytest.mark.sglang

SPEC = ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "d", "--speculative-num-steps", "2"]


def test_speculative_decoding_refused_exactly_where_drafts_pollute(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ran: list[list[str]] = []
    monkeypatch.setattr(launch_sglang, "install_patch", lambda: "test")
    monkeypatch.setattr(launch_sglang, "_run", lambda args: ran.append(args))
    rc = launch_sglang.main(["--model-path", "m", *SPEC])
    version = installed_version()
    if engine_release(version) < (0, 5, 23):
        err = capsys.readouterr().err
        assert rc == 2 and not ran
        assert "sgl-project/sglang#26980" in err and "sglang >= 0.5.23" in err and version in err
    else:
        assert rc == 0 and ran and all(a in ran[0] for a in SPEC)


def test_without_speculative_flags_nothing_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[Any] = []
    monkeypatch.setattr(launch_sglang, "install_patch", lambda: "test")
    monkeypatch.setattr(launch_sglang, "_run", lambda args: ran.append(args))
    assert launch_sglang.main(["--model-path", "m"]) == 0 and ran
