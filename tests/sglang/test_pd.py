"""Prefill/decode disaggregation on SGLang 0.5.23's real serving code, two servers in two processes
(tests/sglang/pd_server.py): ``rr_client.PDClient`` sends each prompt to both (SGLang's bootstrap fields, one room per
pair), takes the prompt's rows from the prefill server and the rest from the decode server, and joins them at the
seam. The merged rows equal transformers' own top-k on every (token, MoE layer) cell, single-turn and for a second
turn that extends the first; the refusals are typed: a decode server asked for prompt rows it never ran (rr's patch
on the decode server), a prefill answer with zero rows, the two servers at different weight versions.

Stood in (the GPU part): the scheduler of each server, in its P/D role, as SGLang 0.5.23's scheduler answers
(tests/sglang/standin.py: the prefill server finishes after the first token with every prompt row; the decode
server's rows for the prompt are its capture buffer's, zeros on a fresh server) and the KV transfer itself.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from rr_server.demo.tiny_moe import reference_routing
from rr_server.launch.process import free_port
from tests.sglang.pd_server import PDServer
from tests.sglang.standin import completion_for

pytestmark = [pytest.mark.sglang, pytest.mark.sglang_releases("0.5.22", "0.5.23")]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pair(tiny_moe: Path) -> Iterator[tuple[PDServer, PDServer, int]]:
    bootstrap = free_port()
    servers = [PDServer("prefill", tiny_moe, bootstrap), PDServer("decode", tiny_moe, bootstrap)]
    try:
        for s in servers:
            s.wait()
        yield servers[0], servers[1], bootstrap
    finally:
        for s in servers:
            s.stop()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def pd_generate(pair: tuple[PDServer, PDServer, int], prompts: list[list[int]], n: int, start: int = 0) -> Any:
    from rr_client import PDClient

    prefill, decode, bootstrap = pair

    async def go() -> Any:
        async with PDClient(prefill.url, decode.url, bootstrap_port=bootstrap, retries=0) as c:
            return await c.generate(prompts, {"max_new_tokens": n}, routed_experts_start=start)

    return run(go())


def test_merged_rows_equal_transformers_on_every_cell(pair: tuple[PDServer, PDServer, int], tiny_moe: Path) -> None:
    g = np.random.default_rng(5)
    prompts = [g.integers(10, 200, k).tolist() for k in (7, 12, 3)]
    batch = pd_generate(pair, prompts, 5)
    for prompt, r in zip(prompts, batch.results, strict=True):
        assert r.output_ids == completion_for(prompt, 5)
        want = reference_routing(tiny_moe, (prompt + r.output_ids)[:-1])
        assert r.routed_experts.shape == want.shape and np.array_equal(r.routed_experts, want)
        seam = r.meta["rr_seam"]
        assert seam["at"] == len(prompt) and seam["prefill"]["server"] == pair[0].url
        assert seam["decode"] == {"server": pair[1].url, "span": [len(prompt), len(prompt) + 4]}
    # a second turn: the first turn's prompt and answer, then new tokens, routed from the new turn's first token
    first = prompts[0] + batch.results[0].output_ids
    second = first + g.integers(10, 200, 4).tolist()
    r = pd_generate(pair, [second], 3, start=len(first)).results[0]
    want = reference_routing(tiny_moe, (second + r.output_ids)[:-1])[len(first) :]
    assert r.routed_experts_start == len(first) and np.array_equal(r.routed_experts, want)


def test_a_decode_server_refuses_prompt_rows_it_never_ran(pair: tuple[PDServer, PDServer, int]) -> None:
    """What sglang-router's mini load balancer returns (the decode server's answer, asked from token 0): SGLang's
    rows for the prompt there are its buffer's zeros; rr's patch on the decode server refuses them, naming the way."""
    from rr_client import RoutedExpertsClient, SeamMismatchError

    prefill, decode, bootstrap = pair
    body_extra = {"bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap, "bootstrap_room": 7}

    async def go() -> None:
        async with httpx.AsyncClient(base_url=decode.url) as http:
            resp = await http.post(
                "/generate",
                json={
                    "input_ids": [11, 12, 13, 14],
                    "sampling_params": {"max_new_tokens": 3},
                    "return_routed_experts": True,
                    **body_extra,
                },
            )
        meta = resp.json()["meta_info"]
        assert meta["routed_experts"] is None
        assert (
            "P/D decode server" in meta["routed_experts_error"]
            and "routed_experts_start_len=4" in meta["routed_experts_error"]
        )
        async with RoutedExpertsClient(decode.url, retries=0) as c:
            with pytest.raises(SeamMismatchError, match="never ran them"):
                await c.generate([[11, 12, 13, 14]], {"max_new_tokens": 3})

    run(go())


def test_a_prefill_answer_with_zero_rows_is_refused(pair: tuple[PDServer, PDServer, int]) -> None:
    """SGLang #23885: under overlap scheduling the prefill rows came back all zeros; the prefill server's full check
    refuses them, so the pair gives a typed error, never a merged tensor."""
    from rr_client import UnrecordedRoutingError

    prefill = pair[0]
    httpx.post(f"{prefill.url}/test/lose_rows", json={"start": 2}, timeout=10).raise_for_status()
    try:
        with pytest.raises(UnrecordedRoutingError, match=r"row 2 layer 0 has all-zero"):
            pd_generate(pair, [[21, 22, 23, 24, 25, 26]], 4)
    finally:
        httpx.post(f"{prefill.url}/test/lose_rows", json={"start": None}, timeout=10).raise_for_status()


def test_servers_at_different_weight_versions_are_refused(pair: tuple[PDServer, PDServer, int]) -> None:
    """A weight update reached the decode server but not the prefill server (rr counts it on each: its
    provenance's weight version): the decode tokens attended to KV from other weights; refused. Once both have it,
    the pair merges again."""
    from rr_client import StaleRoutingError

    prefill, decode, _ = pair
    httpx.post(f"{decode.url}/update_weight_version", json={"new_version": "v2"}, timeout=10).raise_for_status()
    with pytest.raises(StaleRoutingError, match=r"prefill server .* at weight version 0, the decode server .* at 1"):
        pd_generate(pair, [[31, 32, 33, 34, 35]], 4)
    httpx.post(f"{prefill.url}/update_weight_version", json={"new_version": "v2"}, timeout=10).raise_for_status()
    r = pd_generate(pair, [[31, 32, 33, 34, 35]], 4).results[0]
    assert r.meta["rr_seam"]["weight_version"] == 1


def test_both_halves_by_reference_resolve_and_merge_on_the_trainer_rank(
    pair: tuple[PDServer, PDServer, int], tiny_moe: Path
) -> None:
    """By reference, each server keeps its half; the sample holds a SeamRef (both refs and the seam), shipped to a
    trainer rank as JSON, where a plain client for the decode server reads both halves and merges them: equal to
    transformers on every cell. Swapped between two samples, the refs are refused by their token digests."""
    from rr_client import PDClient, RoutedExpertsClient, StaleRoutingError
    from rr_client.core.seam import SeamRef

    prefill, decode, bootstrap = pair
    g = np.random.default_rng(9)
    prompts = [g.integers(10, 200, k).tolist() for k in (6, 9)]

    async def go() -> None:
        async with PDClient(prefill.url, decode.url, bootstrap_port=bootstrap, retries=0) as c:
            batch = await c.generate(prompts, {"max_new_tokens": 4}, routed_experts_start=2, by_reference=True)
        assert all(r.routed_experts is None and isinstance(r.routing_ref, SeamRef) for r in batch.results)
        shipped = [replace(r, routing_ref=SeamRef.from_dict(r.routing_ref.to_dict())) for r in batch.results]
        async with RoutedExpertsClient(decode.url, retries=0) as trainer:
            got = await trainer.resolve_results(shipped)
            for prompt, r in zip(prompts, got, strict=True):
                want = reference_routing(tiny_moe, (prompt + r.output_ids)[:-1])[2:]
                assert r.routed_experts.shape == want.shape and np.array_equal(r.routed_experts, want)
            a, b = shipped
            with pytest.raises(StaleRoutingError, match="belong to other tokens"):
                await trainer.resolve_results([replace(a, routing_ref=b.routing_ref)])

    run(go())


async def test_the_doctor_probes_the_pair_against_one_server(
    pair: tuple[PDServer, PDServer, int], tiny_moe: Path, patched: None
) -> None:
    """``rr-server doctor URL --pd-prefill P --pd-decode D --pd-bootstrap-port N``: the same greedy prompts through
    the pair and through a patched server alone (SGLang's real app in this process) give equal rows on the prompt and
    on the generated tokens; the seams are in the report and the pair's samples join the ground truth (100%). With
    the prefill server losing rows, the probe fails, naming the refusal."""
    from rr_server.doctor import render
    from rr_server.doctor.pd import GENERATED_CHECK, PROMPT_CHECK, SEAM_CHECK, PDTarget
    from tests.sglang.harness import Harness
    from tests.sglang.test_doctor_sglang import _doctor

    prefill, decode, bootstrap = pair
    h = Harness(tiny_moe)
    pd = PDTarget(prefill.url, decode.url, bootstrap)
    report = await _doctor(h, tiny_moe, pd=pd)
    checks = {c.name: c for c in report.checks}
    assert report.ok, [(c.name, c.detail) for c in report.failures()]
    for name in (PROMPT_CHECK, GENERATED_CHECK):
        assert checks[name].exercised and "100.00%" in checks[name].detail
    assert len(report.seams) == 4 and all(s["decode"]["server"] == decode.url for s in report.seams)
    assert report.ground_truth is not None and report.ground_truth["agreement"] == 1.0
    assert "p/d seam (4 samples" in render(report)
    async with httpx.AsyncClient() as http:
        (await http.post(f"{prefill.url}/test/lose_rows", json={"start": 3})).raise_for_status()
        try:
            report = await _doctor(h, tiny_moe, pd=pd)
        finally:
            (await http.post(f"{prefill.url}/test/lose_rows", json={"start": None})).raise_for_status()
    failed = {c.name: c.detail for c in report.failures()}
    assert list(failed) == [SEAM_CHECK] and "UnrecordedRoutingError" in failed[SEAM_CHECK]


def test_a_decode_server_of_another_top_k_is_refused_by_the_client_and_the_sidecar(
    pair: tuple[PDServer, PDServer, int], tiny_moe: Path, tmp_path: Path
) -> None:
    """The same checkpoint served with top-3 on the decode server (the prefill server's is top-2), under the same
    name: PDClient's join refuses the halves (SeamMismatchError naming top-k, never a merged tensor), and rr's P/D
    sidecar refuses the pair at ``/rr/info`` (502 naming it) before any sample."""
    import json
    import shutil

    from rr_client import SeamMismatchError
    from rr_server.proxy.app import ProxyConfig, create_app

    prefill, _, bootstrap = pair
    other = Path(shutil.copytree(tiny_moe, tmp_path / "top3"))
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "num_experts_per_tok": 3}))
    decode = PDServer("decode", other, bootstrap, name=str(tiny_moe))  # served under the prefill server's name
    try:
        decode.wait()
        with pytest.raises(SeamMismatchError, match="differ in topk: 2 vs 3"):
            pd_generate((prefill, decode, bootstrap), [[51, 52, 53, 54]], 3)
        app = create_app(
            ProxyConfig(upstream=decode.url, engine="sglang", prefill_upstream=prefill.url, bootstrap_port=bootstrap)
        )

        async def info() -> httpx.Response:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sc") as http:
                return await http.get("/rr/info")

        r = run(info())
        assert r.status_code == 502 and "differ in topk: 2 vs 3" in r.text
    finally:
        decode.stop()


def test_behind_the_real_sglang_router_in_pd_mode_no_sample_passes_with_wrong_rows(
    pair: tuple[PDServer, PDServer, int],
) -> None:
    """sglang-router 0.3.2 (the Rust gateway) with ``--pd-disaggregation`` in front of the pair: it sends each request
    to both servers and returns the decode server's answer, without rr's fields (it drops ``return_routed_experts``
    and ``routed_experts_start_len``). The answer carries no rows at all, and rr's client on the router refuses the
    sample with a typed error naming the missing routing; whole samples come from PDClient or rr's P/D sidecar."""
    from rr_client import MissingRoutingError, RoutedExpertsClient, RRInfo
    from tests.scale.conftest import RouterProcess

    prefill, decode, bootstrap = pair
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
           "--pd-disaggregation", "--prefill", prefill.url, str(bootstrap), "--decode", decode.url,
           "--policy", "round_robin", "--prometheus-port", str(free_port()), "--log-level", "warn"]  # fmt: skip
    router = RouterProcess("sglang-router-pd", port, cmd)
    info = RRInfo.model_validate(httpx.get(f"{decode.url}/rr/info", timeout=10).json())
    body = {"input_ids": [61, 62, 63, 64], "sampling_params": {"max_new_tokens": 3}, "return_routed_experts": True}

    async def through_router() -> None:
        async with RoutedExpertsClient(router.url, info=info, retries=0) as c:
            with pytest.raises(MissingRoutingError):
                await c.generate([[61, 62, 63, 64]], {"max_new_tokens": 3})

    async def plain_sidecar_info() -> httpx.Response:
        from rr_server.proxy.app import ProxyConfig, create_app

        app = create_app(ProxyConfig(upstream=router.url, engine="sglang"))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sc", timeout=60) as c:
            return await c.get("/rr/info")

    for _ in router.serving():
        answer = httpx.post(f"{router.url}/generate", json=body, timeout=60).json()
        assert answer["output_ids"] == completion_for([61, 62, 63, 64], 3)  # the pair served it
        assert not {k for k in answer["meta_info"] if k.startswith("routed_experts")}
        run(through_router())
        # rr's plain sidecar in front of the router: the router answers a P/D server's model info; refused
        r = run(plain_sidecar_info())
        assert r.status_code == 502 and "SGLang P/D server" in r.text and "--prefill-upstream" in r.text, r.text


def _versions(pair: tuple[PDServer, PDServer, int]) -> list[int]:
    """Each server's weight version (the weight updates rr counted on it), prefill then decode."""
    return [httpx.get(f"{s.url}/rr/info", timeout=10).json()["weight_version"] for s in pair[:2]]


def test_a_prefill_half_from_an_older_weights_cache_is_refused_like_a_decode_half(
    pair: tuple[PDServer, PDServer, int],
) -> None:
    """Both servers took the same update (``/update_weight_version`` flushes no cache), and the prefill server served
    the prompt from its radix cache: the prompt's KV and rows may be the older weights'. The sample's provenance is
    built from both halves (the cache is the prefill server's), so the stale-rows policy refuses it as it refuses
    a decode half with a stale cache hit; the decode half alone says nothing is stale."""
    from rr_client import StaleRoutingError
    from rr_client.core.provenance import check_provenance

    prefill, decode, _ = pair
    while len(set(v := _versions(pair))) > 1:  # an earlier test may have left one server behind
        behind = pair[v.index(min(v))]
        httpx.post(f"{behind.url}/update_weight_version", json={"new_version": "v2"}, timeout=10).raise_for_status()
    for s in (prefill, decode):
        httpx.post(f"{s.url}/update_weight_version", json={"new_version": "v3"}, timeout=10).raise_for_status()
    httpx.post(f"{prefill.url}/test/cached_tokens", json={"cached": 3}, timeout=10).raise_for_status()
    try:
        (r,) = pd_generate(pair, [[71, 72, 73, 74, 75, 76]], 4).results
    finally:
        httpx.post(f"{prefill.url}/test/cached_tokens", json={"cached": 0}, timeout=10).raise_for_status()
    assert r.provenance is not None and r.provenance.cached_tokens == 3 and r.provenance.cached_under_older_weights
    assert r.meta["rr_provenance"] == r.provenance.to_dict()
    with pytest.raises(StaleRoutingError, match="its 3 cached tokens may come from KV computed under older weights"):
        check_provenance([r.provenance])


def test_a_one_token_completion_joins_inline_and_by_reference(
    pair: tuple[PDServer, PDServer, int], tiny_moe: Path
) -> None:
    """``max_new_tokens=1``: the prefill server samples the only token and the decode server routes none; the seam's
    decode span is empty, inline and as a SeamRef shipped as JSON to a trainer rank, rows equal to transformers."""
    from rr_client import PDClient, RoutedExpertsClient
    from rr_client.core.seam import SeamRef

    prefill, decode, bootstrap = pair
    prompt = [101, 102, 103, 104, 105]
    want = reference_routing(tiny_moe, prompt)

    async def go() -> None:
        async with PDClient(prefill.url, decode.url, bootstrap_port=bootstrap, retries=0) as c:
            (r,) = (await c.generate([prompt], {"max_new_tokens": 1})).results
            assert r.output_ids == completion_for(prompt, 1) and np.array_equal(r.routed_experts, want)
            assert r.meta["rr_seam"]["decode"]["span"] == [len(prompt), len(prompt)]
            (ref,) = (await c.generate([prompt], {"max_new_tokens": 1}, by_reference=True)).results
        shipped = replace(ref, routing_ref=SeamRef.from_dict(ref.routing_ref.to_dict()))
        async with RoutedExpertsClient(decode.url, retries=0) as trainer:
            (got,) = await trainer.resolve_results([shipped])
        assert np.array_equal(got.routed_experts, want)

    run(go())


def test_the_source_audit_re_scores_through_the_pair(pair: tuple[PDServer, PDServer, int]) -> None:
    """``PDClient(source_audit=1.0)`` (issue 57): every P/D sample is re-scored through the pair (every token one
    prefill on the prefill server, ``max_new_tokens=1``, a fresh ``extra_key`` on both) and its joined rows, prompt
    half and decode half, agree with the re-score on every cell."""
    from rr_client import PDClient
    from rr_client.client import SourceAudit

    prefill, decode, bootstrap = pair
    audit = SourceAudit(1.0)
    prompts = [[11, 23, 35, 47, 59, 61, 73], [101, 7, 19, 88, 5]]

    async def go() -> Any:
        async with PDClient(prefill.url, decode.url, bootstrap_port=bootstrap, retries=0, source_audit=audit) as c:
            return await c.generate(prompts, {"max_new_tokens": 5})

    batch = run(go())
    assert audit.stats.checked == 2 and audit.stats.flagged == 0 == audit.stats.failed
    for r in batch.results:
        p = r.provenance
        assert p is not None and p.source_checked and p.source_agreement == 1.0 and not p.source_flagged
        assert p.source_detail is not None and set(p.source_detail.by_segment) >= {"computed_prompt", "generated"}
