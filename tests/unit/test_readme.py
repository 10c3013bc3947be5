"""The README's commands name what exists (each parsed by the check docs/ recipes get), and the offline decoding
example (moved to docs/wire-format.md with the README's third pass) runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.doc_recipes import commands
from tests.unit.test_doc_recipes import check_command

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def _shell_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, re.S)


def test_the_readme_has_its_set_up_commands_and_three_ways_in() -> None:
    blocks = _shell_blocks(README)
    assert blocks[0].startswith("make demo") and "\nmake test" in blocks[0]
    assert [h for h in re.findall(r"^## (.*)$", README, re.M) if h[0].isdigit()] == [
        "1. Serve routing",
        "2. Get trainer-ready tensors",
        "3. Replay in the trainer",
    ]


@pytest.mark.parametrize("n", range(len(_shell_blocks(README))))
def test_readme_commands_parse(n: int) -> None:
    """Each command (``.venv/bin/rr-server`` as ``rr-server``; placeholders ``/path/to/moe`` as the demo's model)
    passes the check of docs/ recipes: rr's and vLLM's own parsers, make targets, extras."""
    text = _shell_blocks(README)[n].replace(".venv/bin/rr-server", "rr-server")
    text = text.replace("/path/to/moe", ".cache/demo-qwen3-moe")
    cmds = commands(text)
    assert cmds
    for cmd in cmds:
        if cmd[:2] == ["rr-server", "launch"] and cmd[2] == "sglang":
            continue  # SGLang is not in this environment: tests/sglang launches it per release
        check_command(cmd, f"README.md block {n}")


def test_offline_decoding_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    text = (REPO / "docs" / "wire-format.md").read_text()
    section = text.split("## Decoding any engine's payload, offline", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    exec(compile(code.group(1), "docs/wire-format.md", "exec"), {})
    assert "refused: row 0 layer 0 has all-zero" in capsys.readouterr().out
