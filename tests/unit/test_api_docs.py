"""`make docs` builds: pdoc renders the Makefile's API_MODULES with Python warnings as errors (a docstring or an
``__all__`` name pdoc cannot resolve fails it), and the key pages exist and name the public API."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytest.importorskip("pdoc")


def api_modules() -> list[str]:
    """The Makefile's ``API_MODULES`` (continuation lines joined): the one list `make docs` renders."""
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    m = re.search(r"^API_MODULES\s*:=\s*(.+)$", text, re.M)
    assert m is not None, "no API_MODULES in the Makefile"
    return m.group(1).split()


def test_make_docs_renders_the_same_list_with_warnings_as_errors() -> None:
    recipe = (REPO / "Makefile").read_text().split("\ndocs: setup\n", 1)[1].split("\n\n", 1)[0]
    assert "-W error -m pdoc" in recipe and "$(API_MODULES)" in recipe


def test_api_reference_builds_without_warnings(tmp_path: Path) -> None:
    modules = api_modules()
    assert "rr_client" in modules and "rr_client.trainer.replay" in modules
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run(
        [sys.executable, "-W", "error", "-m", "pdoc", "-o", str(tmp_path), *modules],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    assert "Warning" not in p.stderr, p.stderr[-4000:]
    for mod in modules:  # one page per listed module
        assert (tmp_path / (mod.replace(".", "/") + ".html")).is_file(), mod
    top = (tmp_path / "rr_client.html").read_text()
    assert 'id="RoutedExpertsClient"' in top and 'id="RoutedExpertsClient.generate"' in top
    replay = (tmp_path / "rr_client/trainer/replay.html").read_text()
    assert 'id="replay_routing"' in replay and "audit" in replay
