"""The source audit through SGLang's real TokenizerManager and HTTP app, fed by the stand-in scheduler (issue 57):
rr's client re-scores every sample through SGLang's own ``/generate``; the re-score reaches the scheduler as one
prefill (``max_new_tokens=1``, routing from token 0) in its own radix-cache namespace (``extra_key``: SGLang keys its
radix tree by it, 0.5.23 ``mem_cache/common.py`` ``RadixKey(extra_key=...)``, 0.5.7 ``radix_cache.py`` ``RadixKey``);
a healthy sample agrees on every cell, and one whose decode rows the stand-in writes a token late (the test hook for
a GPU path's fault) is flagged in its generated segment. The stand-in does not model the radix cache itself, so the
bypass is proved by the field the real scheduler would read, not by a cache miss (vLLM's test proves the miss)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from rr_client import RoutedExpertsClient
from rr_client.client import SourceAudit
from rr_client.core.provenance import check_provenance
from tests.sglang.harness import Harness
from tests.sglang.standin import StandInReq

pytestmark = pytest.mark.sglang
PROMPTS = [[3, 17, 29, 41, 53, 67, 71, 5, 9], [5, 11, 13, 19, 23, 31, 37], [2, 4, 8, 16, 32, 64, 100, 7]]


@contextlib.asynccontextmanager
async def answering(h: Harness) -> AsyncIterator[None]:
    """The stand-in answers every request that reaches it, in the batches they arrive in, while the block runs."""
    h.tm.event_loop = asyncio.get_running_loop()
    h.sched.arrivals.clear()

    async def loop() -> None:
        done = 0
        while True:
            await asyncio.sleep(0.01)
            if len(h.sched.arrivals) > done:
                await asyncio.sleep(0.02)  # let the rest of a batch arrive
                new = h.sched.arrivals[done:]
                done += len(new)
                await h.wait_listening(new)
                await h.deliver(h.sched.step(new))

    task = asyncio.ensure_future(loop())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def late_decode(req: StandInReq, rows: np.ndarray) -> None:
    """The first prompt's decode rows written one token late, on served requests only (a re-score has no decode)."""
    p = len(req.prompt)
    if req.prompt == PROMPTS[0] and len(req.completion) > 1:
        rows[p + 1 :] = rows[p:-1].copy()


@pytest.mark.sglang_releases("0.5.7", "0.5.12", "0.5.23")  # rows from token 0 before 0.5.12; msgpack wire in 0.5.23
async def test_the_audit_through_sglangs_own_generate(tiny_moe: Path, patched: None) -> None:
    h = Harness(tiny_moe)
    h.sched.row_edit = late_decode
    audit = SourceAudit(1.0)
    async with answering(h):
        async with RoutedExpertsClient(
            "http://sglang", transport=httpx.ASGITransport(app=h.http.app), source_audit=audit
        ) as c:
            batch = await c.generate(PROMPTS, {"max_new_tokens": 6, "temperature": 0.0})
    assert audit.stats.checked == 3 and audit.stats.flagged == 1 and audit.stats.failed == 0
    bad, *good = batch.results
    for r in good:
        assert r.provenance.source_agreement == 1.0 and not r.provenance.source_flagged
    detail = bad.provenance.source_detail
    assert bad.provenance.source_flagged and detail is not None and "generated" in detail.failing()
    assert detail.by_segment["computed_prompt"][0] == detail.by_segment["computed_prompt"][1]
    rescores = [r for r in h.sched.reqs.values() if getattr(r.tok, "extra_key", None)]
    assert len(rescores) == 3
    for r in rescores:  # one prefill each, every token, routing from token 0, its own radix namespace
        assert r.tok.extra_key.startswith("rr-audit-") and r.tok.sampling_params.max_new_tokens == 1
        assert r.start == 0 and r.prompt in [p + s.output_ids for p, s in zip(PROMPTS, batch.results)]
    assert len({r.tok.extra_key for r in rescores}) == 3
    check = check_provenance([r.provenance for r in batch.results], "mask")
    assert check.replay == (False, True, True) and check.source_flagged == 1


@pytest.mark.sglang_releases("0.5.7", "0.5.23")
async def test_the_audit_through_rrs_sidecar_in_front_of_unpatched_sglang(tiny_moe: Path) -> None:
    """The same audit through rr's sidecar (SGLang unpatched behind it): the sidecar passes ``extra_key`` on to
    SGLang's ``/generate``, so the re-scores reach the scheduler in their own namespace, and the late rows are
    flagged there too."""
    from tests.sglang.test_sidecar_sglang import sidecar_app

    h = Harness(tiny_moe)
    h.sched.row_edit = late_decode
    audit = SourceAudit(1.0)
    async with answering(h), sidecar_app(h, model_path=str(tiny_moe)) as app:
        async with RoutedExpertsClient(
            "http://sidecar", transport=httpx.ASGITransport(app=app), source_audit=audit
        ) as c:
            batch = await c.generate(PROMPTS, {"max_new_tokens": 6, "temperature": 0.0})
    assert (audit.stats.checked, audit.stats.flagged) == (3, 1)
    assert [r.provenance.source_flagged for r in batch.results] == [True, False, False]
    keys = [r.tok.extra_key for r in h.sched.reqs.values() if getattr(r.tok, "extra_key", None)]
    assert len(keys) == 3 and all(k.startswith("rr-audit-") for k in keys)


def kv_slots(req: StandInReq, rows: np.ndarray, *, any_prompt: bool = False) -> None:
    """The fused indexer top-k's fault: picks as KV slots of another layout than token positions (here a rotation
    of each row's positions, so every pick stays a valid, distinct, earlier token), on the first served request
    (``any_prompt``: on every served request; a re-score, with one new token, is never edited)."""
    if (any_prompt or req.prompt == V32_PROMPTS[0]) and len(req.completion) > 1:
        pos = np.arange(rows.shape[0])[:, None, None]
        rows[...] = np.where(rows >= 0, (rows + 3) % (pos + 1), rows)


V32_PROMPTS = [[3, 17, 29, 41, 53, 60, 11, 7, 90, 12, 44], [5, 11, 13, 19, 23, 31, 37, 41, 43, 47]]


@pytest.mark.sglang_releases("0.5.23")  # the first SGLang that returns indexer picks
async def test_indexer_picks_of_slots_not_positions_are_flagged(
    tiny_moe: Path, patched: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny DeepSeek-V3.2 through SGLang 0.5.23's real serving code: the audit re-scores the indexer picks too
    (asked inline); picks the stand-in hands back as slots instead of positions are flagged while the routing of the
    same sample agrees on every cell, and the other sample passes both."""
    import torch

    from tests.sglang.conftest import CACHE
    from tests.sglang.deepseek_v32 import build_tiny_deepseek_v32

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_a, **_k: (9, 0))  # as test_indexer_sglang.py
    h = Harness(build_tiny_deepseek_v32(CACHE / "sglang-deepseek-v32", tokenizer_from=tiny_moe))
    h.sched.indexer_row_edit = kv_slots
    audit = SourceAudit(1.0)
    async with answering(h):
        async with RoutedExpertsClient("http://sglang", transport=httpx.ASGITransport(app=h.http.app)) as c:
            batch = await c.generate(
                V32_PROMPTS, {"max_new_tokens": 6, "temperature": 0.0}, return_indexer_topk=True,
                indexer_by_reference=False,
            )  # fmt: skip
            judged = await audit.audit(c, batch.results, batch.info)
    bad, good = (r.provenance for r in judged)
    assert bad.source_flagged and bad.source_agreement == 1.0  # the experts' rows are right ...
    assert bad.source_indexer is not None and bad.source_indexer.failing()  # ... the picks are not
    # the stand-in's own DSA forward ties on a few picks between the served and the re-scored sequence: the honest
    # near-tie the per-pick count leaves room for (3 of 132 here), far above the threshold
    assert not good.source_flagged and good.source_indexer is not None
    assert audit.threshold < good.source_indexer.agreement <= 1.0
    assert bad.source_indexer.agreement < 0.6
    check = check_provenance([bad, good], "mask")
    assert check.replay == (False, True) and check.source_indexer is not None and check.source_indexer.agreement < 1
    indexer_rescores = [r for r in h.sched.reqs.values() if getattr(r.tok, "extra_key", None) and r.asked_indexer]
    assert len(indexer_rescores) == 2


@pytest.mark.sglang_releases("0.5.23")
async def test_the_doctors_indexer_probe_gives_a_verdict(
    tiny_moe: Path, patched: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``rr-server doctor`` on a sparse-attention model: "source audit (indexer)" passes on an honest server and
    fails, naming the generated segment, when the picks are slots instead of positions."""
    import torch

    from rr_server.doctor.checks import run_doctor
    from tests.sglang.conftest import CACHE
    from tests.sglang.deepseek_v32 import build_tiny_deepseek_v32

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_a, **_k: (9, 0))
    h = Harness(build_tiny_deepseek_v32(CACHE / "sglang-deepseek-v32", tokenizer_from=tiny_moe))
    details = []
    for edit in (None, lambda req, rows: kv_slots(req, rows, any_prompt=True)):
        h.sched.indexer_row_edit = edit
        async with answering(h):
            report = await run_doctor("http://sglang", transport=httpx.ASGITransport(app=h.http.app), max_new_tokens=6)
        (check,) = [c for c in report.checks if c.name == "source audit (indexer)"]
        details.append((check.ok, check.detail))
    (ok0, d0), (ok1, d1) = details
    assert ok0 and "picks agree" in d0, d0
    assert not ok1 and "generated" in d1 and "KV slots" in d1, d1
