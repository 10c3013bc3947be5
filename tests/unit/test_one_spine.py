"""One spine: the phase test (forward or recompute) and the device tally are defined once in rr_client, and every
replay backend (the Hugging Face hooks, Megatron's lifecycle) uses those, not copies."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "rr_client"


def _defined(pattern: str) -> list[str]:
    """``file:line`` of every line of rr_client matching ``pattern``."""
    rx = re.compile(pattern)
    return [
        f"{p.relative_to(ROOT.parent)}:{i}"
        for p in sorted(ROOT.rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if rx.search(line)
    ]


def test_one_phase_test() -> None:
    """``in_backward`` (autograd's graph task: a checkpoint's recompute) exists once."""
    (where,) = _defined(r"^\s*def in_backward\(")
    assert where.startswith("rr_client/trainer/replay/phase.py:")
    assert len(_defined(r"_current_graph_task_id")) == 1


def test_one_device_tally() -> None:
    """The counts kept on the device in hooks and read once: one class, used by both backends."""
    assert len(_defined(r"^class \w*Tally\b")) == 1
    users = {line.split(":")[0] for line in _defined(r"\bDeviceTally\(\)")}
    assert "rr_client/trainer/replay/_replay.py" in users
    assert "rr_client/integrations/megatron/_lifecycle.py" in users


def test_one_rows_check_and_one_layer_axis_rule() -> None:
    """Replay rows are validated by one function and their layer axis decided by one rule (rr_client/trainer/rows.py);
    the HF hooks, verl and Megatron's feeder call those, none keeps its own."""
    (check,) = _defined(r"^def row_stats\(")
    (axis,) = _defined(r"^def axis_layers\(")
    assert check.startswith("rr_client/trainer/rows.py:") and axis.startswith("rr_client/trainer/rows.py:")
    for consumer in ("trainer/replay/_replay.py", "integrations/megatron/_feeder.py", "integrations/verl/_rows.py"):
        text = (ROOT / consumer).read_text()
        assert "rr_client.trainer.rows" in text, f"{consumer} does not take its rows through ReplayRows"
    # (rr_client/core/_rowcheck is the wire payload's check, on numpy, before any torch: the codec's one full check)
    torch_side = [d for d in _defined(r"^\s*def (_check|check_rows|layer_positions)\(") if "/core/" not in d]
    assert not torch_side, f"a second rows check or layer rule: {torch_side}"
