"""``rr-server launch sglang --enable-hierarchical-cache`` on each real SGLang release: refused by rr with a typed
error naming sgl-project/sglang#26975 (no supported release refuses HiCache + routed experts itself). The release is
the installed one; SGLang's server itself is not started."""

from __future__ import annotations

from typing import Any

import pytest

from rr_client.core.errors import ConfigurationError
from rr_server.launch import sglang as launch_sglang
from rr_server.serving.engines.sglang import installed_version

pytestmark = pytest.mark.sglang


@pytest.mark.parametrize("flag", [["--enable-hierarchical-cache"], ["--enable-hierarchical-cache=true"]])
def test_hicache_with_routed_experts_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], flag: list[str]
) -> None:
    ran: list[Any] = []
    monkeypatch.setattr(launch_sglang, "install_patch", lambda: "test")
    monkeypatch.setattr(launch_sglang, "_run", lambda args: ran.append(args))
    assert launch_sglang.main(["--model-path", "m", *flag]) == 2 and not ran
    err = capsys.readouterr().err
    assert "sgl-project/sglang#26975" in err and "#39027" in err and installed_version() in err
    with pytest.raises(ConfigurationError, match="hierarchical"):
        launch_sglang.check_hicache(installed_version(), flag)


def test_hicache_off_is_not_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[Any] = []
    monkeypatch.setattr(launch_sglang, "install_patch", lambda: "test")
    monkeypatch.setattr(launch_sglang, "_run", lambda args: ran.append(args))
    assert launch_sglang.main(["--model-path", "m", "--enable-hierarchical-cache=false"]) == 0 and ran
