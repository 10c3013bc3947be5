"""``make demo`` ends with a one-line verdict and the commands to try next (rr_server.demo.quickstart)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from rr_server.demo import quickstart
from rr_server.demo.quickstart import MODEL_DIR, next_steps, verdict


def test_pass_verdict_names_the_routing_cells_the_agentic_loop_and_the_doctor() -> None:
    assert verdict(616, 616, True, True) == (
        True,
        "rr demo: PASS - 616/616 routing cells equal transformers' top-k, agentic loop exact, doctor PASS",
    )


@pytest.mark.parametrize(
    ("args", "line"),
    [
        ((600, 616, True, True), "rr demo: FAIL - 600/616 routing cells equal transformers' top-k (details above)"),
        ((0, 0, True, True), "rr demo: FAIL - 0/0 routing cells equal transformers' top-k (details above)"),
        ((616, 616, True, False), "rr demo: FAIL - doctor FAIL (details above)"),
        (
            (616, 616, False, False),
            "rr demo: FAIL - agentic loop routing differs from transformers', doctor FAIL (details above)",
        ),
    ],
)
def test_fail_verdict_names_only_what_failed(args: tuple[int, int, bool, bool], line: str) -> None:
    assert verdict(*args) == (False, line)


def test_next_steps_serve_the_demo_model_check_it_and_run_the_tests() -> None:
    assert next_steps(MODEL_DIR, ".venv/bin").splitlines() == [
        "next (commands live in .venv/bin; or `source .venv/bin/activate` first):",
        "  .venv/bin/rr-server launch vllm --model .cache/demo-qwen3-moe --port 8000   # serve the demo's tiny model",
        "  .venv/bin/rr-server doctor http://127.0.0.1:8000   # in another shell: check its routing",
        "  make test   # the whole suite (35-80 min on 2 CPU cores)",
    ]


def test_next_steps_name_this_interpreters_bin_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    bin_dir = tmp_path / "venv" / "bin"
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    monkeypatch.chdir(tmp_path)
    assert next_steps(MODEL_DIR).splitlines()[1].startswith(f"  {os.path.join('venv', 'bin')}/rr-server launch vllm")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # outside it: the absolute path, never ../venv/bin
    assert next_steps(MODEL_DIR).splitlines()[1].startswith(f"  {bin_dir}/rr-server launch vllm")


def test_a_step_that_raises_ends_on_a_fail_verdict(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def boom(args: object) -> int:
        raise RuntimeError("server at http://127.0.0.1:1 exited with rc=1 after 3s\nlog tail line")

    monkeypatch.setattr(quickstart, "run", boom)
    assert quickstart.main([]) == 2
    out, err = capsys.readouterr()
    assert out.splitlines()[-1] == (
        "rr demo: FAIL - RuntimeError: server at http://127.0.0.1:1 exited with rc=1 after 3s (details above)"
    )
    assert "log tail line" in err
