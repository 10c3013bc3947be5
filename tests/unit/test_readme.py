"""The README's offline quick-start example runs as written."""

from __future__ import annotations

import re
from pathlib import Path


def test_readme_offline_example_runs(capsys: object) -> None:
    text = Path(__file__).resolve().parents[2].joinpath("README.md").read_text()
    section = text.split("## Quick start: decode and pad a payload from any engine (offline)", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    exec(compile(code.group(1), "README.md", "exec"), {})
    assert "refused: row 0 layer 0 has all-zero" in capsys.readouterr().out  # type: ignore[attr-defined]
