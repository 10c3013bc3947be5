"""The mixed-batch routing list as SGLang's OWN scheduler code builds it (stand-in requests/state).

``tests/sglang/standin.py:sglang_stream_output`` runs each version's real stream-output function
(``SchedulerOutputProcessorMixin.stream_output_generation`` <= 0.5.12,
``SchedulerOutputStreamer._stream_output_generation`` 0.5.13+) and captures the
``BatchTokenIDOutput`` it hands to ``send_to_detokenizer``. So the <= 0.5.12 bug and the 0.5.13 fix
(PR #26423) both come from SGLang's code here, not from the stand-in.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tests.sglang.harness import Harness
from tests.sglang.standin import (
    StandInReq,
    StandInScheduler,
    completion_for,
    sglang_stream_output,
)
from tests.sglang.test_tokenizer_manager import _expected, _mixed

pytestmark = pytest.mark.sglang


def _field(out: object) -> list | None:
    """The batch's routing list under either field name (0.5.7 ``output_routed_experts``)."""
    for name in ("routed_experts", "output_routed_experts"):
        if hasattr(out, name):
            return getattr(out, name)
    raise AssertionError("BatchTokenIDOutput has no routing field")


def _sched(model: Path, asked: list[bool]) -> StandInScheduler:
    """A stand-in scheduler holding one finished request per flag (distinct prompt lengths)."""
    from rr_server.serving.engines.sglang import profile_for

    prof = profile_for()
    s = StandInScheduler(model, prof.release, prof.field)
    for i, a in enumerate(asked):
        prompt = [3, 17, 29, 41, 53, 67, 71][: 3 + i]
        s.reqs[str(i)] = StandInReq(
            SimpleNamespace(rid=str(i), return_routed_experts=a), prompt, completion_for(prompt, 3)
        )
    return s


def test_sglang_own_code_mixed_batch(tiny_moe: Path) -> None:
    """Unpatched flags [no, yes, no]: <= 0.5.12 lists 1 entry for 3 requests; 0.5.13+ lists 3, aligned."""
    s = _sched(tiny_moe, [False, True, False])
    out = sglang_stream_output(s, ["0", "1", "2"])
    routing = _field(out)
    assert list(out.rids) == ["0", "1", "2"]
    own = _expected(tiny_moe, SimpleNamespace(sched=s), "1")
    if s.release <= (0, 5, 12):
        assert len(routing) == 1 != len(out.rids), "SGLang's own code should list only the asker (the bug)"
        np.testing.assert_array_equal(np.asarray(routing[0]), own)  # index 0 belongs to rid "0", not "1"
    else:
        assert len(routing) == len(out.rids)
        assert routing[0] is None and routing[2] is None
        np.testing.assert_array_equal(np.asarray(routing[1]), own)


def test_sglang_own_code_all_asked_aligned(tiny_moe: Path) -> None:
    """What rr's patch makes the scheduler see (flag forced on every request): aligned on every version."""
    s = _sched(tiny_moe, [True, True, True])
    out = sglang_stream_output(s, ["0", "1", "2"])
    routing = _field(out)
    assert len(routing) == 3
    for i, rid in enumerate(out.rids):
        np.testing.assert_array_equal(np.asarray(routing[i]), _expected(tiny_moe, SimpleNamespace(sched=s), rid))


async def test_mixed_batch_unpatched_sglang_code(tiny_moe: Path) -> None:
    """Through the real TokenizerManager, batch built by SGLang's code: <= 0.5.12 misroutes and dies."""
    h = Harness(tiny_moe)
    h.sched.sglang_builds_output = True
    (_a, b, _c), err = await _mixed(h)
    if h.profile.mixed_batch_bug:
        assert isinstance(err, IndexError)
        assert "routed_experts" in b["meta_info"], "B (did not ask) should hold another request's rows"
    else:
        assert err is None and "routed_experts" not in b["meta_info"]


# The patched end-to-end run with the batch built by SGLang's code is test_tokenizer_manager.py::
# test_mixed_batch_patched[sglang_code-*] (the same test, both batch builders).


@pytest.mark.parametrize(
    "asked", [[False, True, False], [True, True, True], [False, False, False]], ids=["mixed", "all", "none"]
)
def test_standin_step_matches_sglang_code(tiny_moe: Path, asked: list[bool]) -> None:
    """The stand-in's own rebuild (used by the other tests) equals SGLang's function on the fields rr reads."""
    mine, theirs = _sched(tiny_moe, asked), _sched(tiny_moe, asked)
    a, b = mine.step(["0", "1", "2"]), sglang_stream_output(theirs, ["0", "1", "2"])
    for name in ("rids", "output_ids", "decode_ids", "read_offsets", "prompt_tokens", "completion_tokens"):
        assert [list(x) if not isinstance(x, (int, str)) else x for x in getattr(a, name)] == [
            list(x) if not isinstance(x, (int, str)) else x for x in getattr(b, name)
        ], name
    ra, rb = _field(a), _field(b)
    assert (ra is None) == (rb is None)
    if ra is not None:
        assert len(ra) == len(rb)
        for x, y in zip(ra, rb):
            assert (x is None) == (y is None)
            if x is not None:
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
