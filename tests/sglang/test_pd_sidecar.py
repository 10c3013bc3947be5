"""rr's sidecar as the P/D load balancer in front of two unpatched SGLang 0.5.23 servers (``rr-server proxy --upstream
DECODE --prefill-upstream PREFILL --bootstrap-port N``, the real CLI in its own process): each ``/generate`` goes to
both servers with SGLang's bootstrap fields, the prompt's rows come from the prefill server, the decode server's prompt
rows (its buffer's leftovers) are dropped, and the two halves are joined at the seam. A plain ``RoutedExpertsClient``
on the sidecar gets rows equal to transformers on every (token, MoE layer) cell, inline and by reference, single-turn
and for a second turn; a zero-row prefill answer and servers at different weight versions are typed refusals; the
OpenAI endpoints and streaming are refused with 400 and the sidecar keeps serving.

Stood in (the GPU part): each server's scheduler in its P/D role (tests/sglang/standin.py) and the KV transfer.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from rr_server.demo.tiny_moe import reference_routing
from rr_server.launch.process import free_port, wait_healthy
from tests.sglang.pd_server import REPO, PDServer
from tests.sglang.standin import completion_for

pytestmark = [pytest.mark.sglang, pytest.mark.sglang_releases("0.5.22", "0.5.23")]


@pytest.fixture(scope="module")
def sidecar(tiny_moe: Path) -> Iterator[tuple[str, PDServer, PDServer]]:
    bootstrap = free_port()
    servers = [PDServer(role, tiny_moe, bootstrap, patched=False) for role in ("prefill", "decode")]
    port = free_port()
    log_path = Path(tempfile.gettempdir()) / f"rr-pd-sidecar-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rr_server", "proxy", "--engine", "sglang", "--port", str(port),
             "--upstream", servers[1].url, "--prefill-upstream", servers[0].url, "--bootstrap-port", str(bootstrap)],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])},
            stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for s in servers:
            s.wait()
        wait_healthy(url, proc, log_path, 60)  # type: ignore[arg-type]  # its /health asks both servers'
        yield url, servers[0], servers[1]
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        for s in servers:
            s.stop()


def generate(url: str, prompts: list[list[int]], n: int, **kw: Any) -> Any:
    from rr_client import RoutedExpertsClient

    async def go() -> Any:
        async with RoutedExpertsClient(url, retries=0) as c:
            batch = await c.generate(prompts, {"max_new_tokens": n}, **kw)
            return await c.resolve_results(batch.results)

    return asyncio.run(go())


def test_the_sidecar_joins_unpatched_halves_equal_to_transformers(
    sidecar: tuple[str, PDServer, PDServer], tiny_moe: Path
) -> None:
    url, prefill, decode = sidecar
    g = np.random.default_rng(11)
    prompts = [g.integers(10, 200, k).tolist() for k in (8, 5)]
    for by_reference in (False, True):
        results = generate(url, prompts, 5, by_reference=by_reference)
        for prompt, r in zip(prompts, results, strict=True):
            assert r.output_ids == completion_for(prompt, 5)
            want = reference_routing(tiny_moe, (prompt + r.output_ids)[:-1])
            assert r.routed_experts.shape == want.shape and np.array_equal(r.routed_experts, want)
            assert r.meta["rr_seam"]["at"] == len(prompt)
            assert r.meta["rr_seam"]["prefill"]["server"] == prefill.url
            assert r.meta["rr_seam"]["decode"]["server"] == decode.url
    first = prompts[0] + results[0].output_ids
    second = first + g.integers(10, 200, 3).tolist()
    (r,) = generate(url, [second], 4, routed_experts_start=len(first))
    want = reference_routing(tiny_moe, (second + r.output_ids)[:-1])[len(first) :]
    assert r.routed_experts_start == len(first) and np.array_equal(r.routed_experts, want)
    for by_reference in (False, True):  # a one-token completion: the decode half routes no token
        (r,) = generate(url, [prompts[1]], 1, by_reference=by_reference)
        assert np.array_equal(r.routed_experts, reference_routing(tiny_moe, prompts[1]))
        assert r.meta["rr_seam"]["decode"]["span"] == [len(prompts[1]), len(prompts[1])]


def test_zero_prefill_rows_and_servers_at_different_weights_are_refused(
    sidecar: tuple[str, PDServer, PDServer],
) -> None:
    """The prefill server lost its rows (SGLang #23885): the one check refuses that half. A weight update that
    reached only the decode server: the halves are refused. Sent through the sidecar, an update reaches both
    servers and the pair joins again."""
    from rr_client import StaleRoutingError, UnrecordedRoutingError

    url, prefill, decode = sidecar
    httpx.post(f"{prefill.url}/test/lose_rows", json={"start": 1}, timeout=10).raise_for_status()
    try:
        with pytest.raises(UnrecordedRoutingError, match="all-zero"):
            generate(url, [[41, 42, 43, 44, 45]], 3)
    finally:
        httpx.post(f"{prefill.url}/test/lose_rows", json={"start": None}, timeout=10).raise_for_status()
    httpx.post(f"{decode.url}/update_weight_version", json={"new_version": "v7"}, timeout=10).raise_for_status()
    with pytest.raises(StaleRoutingError, match=r"prefill server .* weight version '.*', the decode server .* 'v7'"):
        generate(url, [[41, 42, 43, 44, 45]], 3)
    httpx.post(f"{url}/update_weight_version", json={"new_version": "v8"}, timeout=10).raise_for_status()
    (r,) = generate(url, [[41, 42, 43, 44, 45]], 3)
    assert r.routed_experts.shape[0] == 5 + 3 - 1


def test_openai_endpoints_and_streams_are_refused_and_it_keeps_serving(sidecar: tuple[str, PDServer, PDServer]) -> None:
    url = sidecar[0]
    r = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=10)
    assert r.status_code == 400 and "serves /generate only" in r.text
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}, "stream": True}
    r = httpx.post(f"{url}/generate", json=body, timeout=10)
    assert r.status_code == 400 and "stream=false" in r.text
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "n": 2}}
    r = httpx.post(f"{url}/generate", json=body, timeout=10)
    assert r.status_code == 400 and "n must be 1" in r.text
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}, "return_indexer_topk": True}
    r = httpx.post(f"{url}/generate", json=body, timeout=10)
    assert r.status_code == 400 and "indexer" in r.text
    (ok,) = generate(url, [[5, 6, 7]], 2)
    assert ok.routed_experts.shape[0] == 3 + 2 - 1


def test_a_stale_prefill_half_is_refused_like_a_stale_decode_half(sidecar: tuple[str, PDServer, PDServer]) -> None:
    """An update sent through the sidecar reaches both servers and flushes no cache (``/update_weight_version``);
    the prefill server then serves the prompt from its radix cache. The sample's ``rr_provenance`` is built from both
    halves, the cache from the prefill half: its cached tokens may be older weights' KV, and the stale-rows policy
    refuses the sample (the decode half's own provenance, no cache hit, says nothing is stale)."""
    from rr_client import StaleRoutingError
    from rr_client.core.provenance import check_provenance

    url, prefill, _ = sidecar
    httpx.post(f"{url}/update_weight_version", json={"new_version": "v9"}, timeout=10).raise_for_status()
    httpx.post(f"{prefill.url}/test/cached_tokens", json={"cached": 3}, timeout=10).raise_for_status()
    try:
        (r,) = generate(url, [[81, 82, 83, 84, 85, 86]], 3)
    finally:
        httpx.post(f"{prefill.url}/test/cached_tokens", json={"cached": 0}, timeout=10).raise_for_status()
    assert r.provenance is not None and r.provenance.cached_tokens == 3 and r.provenance.cached_under_older_weights
    with pytest.raises(StaleRoutingError, match="its 3 cached tokens may come from KV computed under older weights"):
        check_provenance([r.provenance])


def test_an_update_that_reached_one_server_only_is_refused_though_the_labels_agree(
    sidecar: tuple[str, PDServer, PDServer], tiny_moe: Path
) -> None:
    """A decode server started with SGLang's ``--admin-api-key`` (its weight routes need the key, ``/generate`` does
    not) behind a P/D sidecar that does not send it: an update through the sidecar lands on the prefill server and is
    refused (401) by the decode server. The update keeps SGLang's label, as ``DiskWeightSync``'s reloads do, so the
    labels agree; the sidecar's count of the updates each server took does not, and the halves are refused with a
    typed error naming both servers and their counts."""
    from rr_server.proxy.app import ProxyConfig, create_app

    _, prefill, _ = sidecar
    label = httpx.get(f"{prefill.url}/get_model_info", timeout=10).json()["weight_version"]  # the new server's too
    decode = PDServer("decode", tiny_moe, prefill.bootstrap_port, label, patched=False, admin_key="admin-key")
    body = {"input_ids": [91, 92, 93, 94], "sampling_params": {"max_new_tokens": 3}, "return_routed_experts": True}
    try:
        decode.wait()
        app = create_app(
            ProxyConfig(
                upstream=decode.url,
                engine="sglang",
                prefill_upstream=prefill.url,
                bootstrap_port=prefill.bootstrap_port,
            )
        )

        async def go() -> None:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sc", timeout=60) as c:
                meta = (await c.post("/generate", json=body)).json()["meta_info"]
                assert meta["routed_experts"] is not None, meta.get("routed_experts_error")
                upd = await c.post("/update_weight_version", json={"new_version": label})
                assert upd.status_code == 401, upd.text  # the decode server's admin key
                info = (await c.get("/rr/info")).json()
                assert info["pd_weight_updates"] == {prefill.url: 1, decode.url: None}
                meta = (await c.post("/generate", json=body)).json()["meta_info"]
                assert meta["routed_experts"] is None and "StaleRoutingError" in meta["routed_experts_error"]
                assert (
                    f"the prefill server ({prefill.url}) 1, the decode server ({decode.url}) unknown"
                    in meta["routed_experts_error"]
                )

        asyncio.run(go())
    finally:
        decode.stop()


def test_a_plain_sidecar_refuses_a_pd_server_as_its_upstream(
    sidecar: tuple[str, PDServer, PDServer], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``rr-server proxy --upstream`` a P/D decode (or prefill) server without ``--prefill-upstream`` would pass on
    prompt rows the decode server never ran: SGLang's ``/get_model_info`` says its ``disaggregation_mode``, and the
    sidecar refuses at startup in one line naming ``--prefill-upstream``, and at ``/rr/info`` and ``/generate``
    (502) when the upstream was not up at startup. A P/D sidecar whose servers are swapped is refused too."""
    import uvicorn

    from rr_server.proxy import main
    from rr_server.proxy.app import ProxyConfig, create_app

    _, prefill, decode = sidecar

    async def ask(app: Any) -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sc", timeout=60) as c:
            body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}, "return_routed_experts": True}
            return [await c.get("/rr/info"), await c.post("/generate", json=body)]

    for r in asyncio.run(ask(create_app(ProxyConfig(upstream=decode.url, engine="sglang")))):
        assert r.status_code == 502 and "disaggregation_mode='decode'" in r.text and "--prefill-upstream" in r.text
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)  # were it not refused, the sidecar would serve
    for server in (decode, prefill):
        assert main(["--upstream", server.url, "--engine", "sglang", "--port", str(free_port())]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert f"disaggregation_mode='{server.role}'" in line and "--prefill-upstream PREFILL_URL" in line
    swapped = [
        "--upstream",
        prefill.url,
        "--prefill-upstream",
        decode.url,
        "--bootstrap-port",
        str(prefill.bootstrap_port),
    ]
    assert main([*swapped, "--engine", "sglang"]) == 2
    assert "--prefill-upstream takes the prefill server" in capsys.readouterr().err
