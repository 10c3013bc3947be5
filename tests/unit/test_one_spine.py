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


def test_adapters_only_convert_their_batch() -> None:
    """No adapter polices, counts or masks rows on its own (issue 56, "one door"): the session's door takes the
    rows with their provenance."""
    hits = [d for d in _defined(r"checked=True|add_provenance|\bKEEP\b") if d.startswith("rr_client/integrations/")]
    assert hits == []


def test_one_function_masks_rows() -> None:
    """Samples are taken out of rows, a layout's mask, indexer picks or a loss mask by one rule
    (rr_client/trainer/rows.py ``without_samples``); every other masking function calls it."""
    (rule,) = _defined(r"^def without_samples\(")
    assert rule.startswith("rr_client/trainer/rows.py:")
    maskers = _defined(r"^\s*def (mask_\w+|drop_samples|without)\(")
    assert {m.split(":")[0] for m in maskers} <= {"rr_client/trainer/provenance.py", "rr_client/trainer/rows.py"}
    text = (ROOT / "trainer/provenance.py").read_text()
    for name in ("mask_samples", "mask_indexer", "mask_rows", "drop_samples"):
        body = text.split(f"def {name}(", 1)[1].split("\ndef ", 1)[0]
        assert "without_samples(" in body or ".without(" in body, name
    per_token = _defined(r"def _token_keep\(|repeat_interleave\(keep")
    assert [d for d in per_token if not d.startswith("rr_client/trainer/rows.py:")] == [], per_token


_PACKAGES = ("rr_server", "rr_client", "rr_patches")
# where an engine's name may be compared: its own objects (the wire facts and the per-release facts)
_ENGINE_HOMES = ("rr_server/serving/engines/", "rr_client/core/engines.py")
_NAME = r"""["'](?:vllm|sglang)["']"""
_BY_NAME = re.compile(
    rf"(?:==|!=)\s*{_NAME}|{_NAME}\s*(?:==|!=)"  # engine == "sglang", "vllm" != info.engine, x.name == "vllm"
    rf"|\bin\s*(?:frozenset\(|set\()?[(\[{{]\s*{_NAME}"  # engine in ("vllm", ...), in {"sglang"}
    rf"|{{\s*{_NAME}\s*[:,}}]|,\s*{_NAME}\s*:"  # {"vllm": ..., "sglang": ...} dispatch tables, {"sglang"} sets
    r"|(?:==|!=|\bis(?:\s+not)?)\s*(?:VLLM|SGLANG)(?:\.name)?(?![\w.])"  # x == SGLANG.name, engine is VLLM
    r"|\b(?:VLLM|SGLANG)(?:\.name)?\s*(?:==|!=)"
)


def _by_engine_name(root: Path) -> list[str]:
    """``file:line: text`` of every line under ``root``'s packages that decides by an engine's name, outside the
    engine objects."""
    hits = []
    for package in _PACKAGES:
        for p in sorted((root / package).rglob("*.py")):
            rel = p.relative_to(root).as_posix()
            if rel.startswith(_ENGINE_HOMES):
                continue
            for i, line in enumerate(p.read_text().splitlines(), 1):
                if _BY_NAME.search(line):
                    hits.append(f"{rel}:{i}: {line.strip()}")
    return hits


def test_engines_are_asked_never_compared_by_name() -> None:
    """What differs between vLLM and SGLang is a fact or behaviour of the engine objects (rr_client.core.engines,
    rr_server.serving.engines), asked, never an ``engine == "sglang"`` comparison or a table keyed by engine name
    elsewhere (issue 55), like vLLM's Platform: one object per engine, asked what differs."""
    assert _by_engine_name(ROOT.parent) == []


def test_the_engine_name_grep_sees_a_comparison(tmp_path: Path) -> None:
    """The grep above finds each spelling of a comparison by name, and skips the engine modules."""
    bad = [
        'if info.engine == "sglang":',
        "if 'vllm' != args.engine:",
        'if eng.name == "vllm":',
        'ok = engine in ("vllm", "sglang")',
        '_UNCAPTURED = frozenset({"sglang"})',
        'READERS = {"vllm": read_a, "sglang": read_b}',
        "if engine is SGLANG:",
        "if SGLANG.name != cfg.engine:",
    ]
    good = ['releases("vllm").draft_issue', 'choices=("npy", "sglang", "ref")', 'RRInfo(engine="sglang")']
    (tmp_path / "rr_server" / "serving" / "engines").mkdir(parents=True)
    (tmp_path / "rr_client").mkdir()
    (tmp_path / "rr_patches").mkdir()
    (tmp_path / "rr_server" / "x.py").write_text("\n".join(bad + good) + "\n")
    (tmp_path / "rr_server" / "serving" / "engines" / "sglang.py").write_text("\n".join(bad) + "\n")
    found = _by_engine_name(tmp_path)
    assert [h.split(":")[1] for h in found] == [str(i) for i in range(1, len(bad) + 1)], found


def test_one_audit_clock() -> None:
    """When a step is audited is decided once (issue 56): ``AuditClock.audited``; the session owns the clock and
    every backend asks it, none keeps its own."""
    where = _defined(r"\bdef audited\b")
    assert len(where) == 1 and where[0].startswith("rr_client/trainer/audit.py:"), where
    assert "self.clock = AuditClock(" in (ROOT / "trainer/session.py").read_text()


def test_one_writer_of_applied_share() -> None:
    """An ``applied_share`` key is written from counts in one place (rr_client/trainer/audit.py: ``layer_keys``, and
    ``merged_keys`` beside it for a step's blocks), with one meaning for no rows (NaN)."""
    writers = _defined(r'(APPLIED_SHARE\s*:|APPLIED_SHARE\]\s*=|"applied_share"\)\]?\s*[:=])')
    assert writers and all(w.startswith("rr_client/trainer/audit.py:") for w in writers), writers


def test_no_public_way_around_the_rows_check() -> None:
    """Megatron's targets reach the routers only after the one rows check (issue 56, item 7): no public
    ``set_targets`` takes raw ids that would skip it (repeated ids would run one expert, and the audit, comparing a
    map scattered from the same ids, would say 1.0)."""
    assert _defined(r"^\s*def set_targets\(") == []
    assert len(_defined(r"^\s*def _set_targets\(")) == 1


def test_verls_step_clock_ends_a_step_at_the_outermost_train_mode() -> None:
    """verl's audit clock: update calls without verl's last-mini-batch mark end their step when the engine leaves
    its outermost ``train_mode`` block (``train_mini_batch`` around its mini-batches), once; a forward-only call
    after update calls ends it too, and a log-prob pass alone ends nothing."""
    from rr_client.integrations.verl._clock import TrainingStepClock

    clock = TrainingStepClock(2)
    clock.call_starts(True)  # the log-prob pass
    clock.call_ends(True, False)
    assert clock.steps == 0 and clock.audited
    with clock.train_mode():
        for _ in range(3):
            with clock.train_mode():  # train_batch's own block inside train_mini_batch's
                clock.call_starts(False)
                clock.call_ends(False, False)
        assert clock.steps == 0
    assert clock.steps == 1 and not clock.audited
    clock.call_starts(False)  # an update call outside any train_mode, then the next step's log-prob pass
    clock.call_ends(False, False)
    clock.call_starts(True)
    assert clock.steps == 2 and clock.audited
