"""``rr-server doctor`` against SGLang's real app (TokenizerManager, detokenizer, HTTP layer; the GPU
scheduler is the stand-in of tests/sglang/standin.py), driven by a scheduler loop that answers, as one
batch, whatever arrived since its last step.

- unpatched SGLang (``--engine sglang``: the doctor passes the caller's flag through, as a trainer talking to
  SGLang directly would): on <= 0.5.12 a request next to one that did not ask gets another's rows -> FAIL;
- patched SGLang: PASS, with every routing value equal to transformers' router top-k (``--model-path``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rr_server.doctor.checks import DoctorReport, run_doctor
from tests.sglang.harness import Harness

pytestmark = pytest.mark.sglang


@contextlib.asynccontextmanager
async def scheduler_loop(h: Harness) -> AsyncIterator[None]:
    """Every 20 ms, the requests that arrived since the last step are one scheduler batch, answered in full.

    An ``IndexError`` from ``_handle_batch_output`` is what kills SGLang's handle loop on <= 0.5.12 in a
    mixed batch; the loop then finishes those requests empty (production would hang them), so the doctor sees it.
    """
    h.tm.event_loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    async def loop() -> None:
        seen = 0
        while not stop.is_set():
            await asyncio.sleep(0.02)
            new = list(h.sched.arrivals[seen:])
            if not new:
                continue
            seen += len(new)
            await h.wait_listening(new)  # answered before SGLang waits for it: KeyError on a loaded machine (see there)
            states = {rid: h.tm.rid_to_state.get(rid) for rid in new}
            try:
                await h.deliver(h.sched.step(new))
            except IndexError:
                for rid, st in states.items():
                    if st is not None and not st.finished:
                        if not st.out_list:
                            st.out_list.append({"meta_info": {"id": rid, "finish_reason": None}, "output_ids": []})
                        st.finished = True
                        st.event.set()

    task = asyncio.ensure_future(loop())
    try:
        yield
    finally:
        stop.set()
        await task


async def _doctor(h: Harness, model: Path, **kw: Any) -> DoctorReport:
    async with scheduler_loop(h):
        return await run_doctor(
            "http://sglang",
            transport=httpx.ASGITransport(app=h.http.app),
            model_path=str(model),
            max_new_tokens=4,
            **kw,
        )


async def test_doctor_passes_on_patched_sglang(tiny_moe: Path, patched: None) -> None:
    h = Harness(tiny_moe)
    report = await _doctor(h, tiny_moe)
    failed = {c.name: c.detail for c in report.failures()}
    if not h.profile.has_start_field:  # 0.5.7 has no routed_experts_start_len: refused loudly, never shifted
        assert set(failed) == {"routed_experts_start"} and "ProtocolError" in failed["routed_experts_start"]
        return
    assert report.ok, failed
    assert report.deployment == "patched" and report.identity["engine"] == "sglang"
    assert report.ground_truth is not None and report.ground_truth["agreement"] == 1.0
    names = {c.name for c in report.checks}
    assert {"single", "batch", "routed_experts_start", "prefix-cache hit", "mixed batch", "ground truth"} <= names


async def test_doctor_on_unpatched_sglang(tiny_moe: Path) -> None:
    h = Harness(tiny_moe)
    report = await _doctor(h, tiny_moe, engine="sglang")
    failed = {c.name: c.detail for c in report.failures()}
    if h.profile.mixed_batch_bug:  # <= 0.5.12: SGLang's own answer mixes rows
        assert not report.ok and "mixed batch" in failed, failed
    else:  # 0.5.13+ fixed it upstream
        assert "mixed batch" not in failed, failed
