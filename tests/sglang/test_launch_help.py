"""``rr-server launch sglang --help`` on a real SGLang: rr's options first, then SGLang's own launch_server help
(nothing patched, nothing started)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.sglang_releases("0.5.7", "0.5.23")]  # one parser call, ~15 s

REPO = Path(__file__).resolve().parents[2]


def test_rr_options_come_before_sglangs_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "rr_server", "launch", "sglang", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )  # PYTHONPATH (the SGLang overlay) is inherited
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert text.startswith("usage: rr-server launch sglang [rr options]")
    rr_flag, engine = text.index("--routed-experts-format {npy,sglang,ref}"), text.index("SGLang's own arguments:")
    assert rr_flag < engine < text.index("--model-path MODEL_PATH")  # SGLang's own parser printed its help
    assert "unavailable" not in text and "Traceback" not in out.stderr
