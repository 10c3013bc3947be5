"""``rr-server launch vllm ... --rr-store s3://bucket/prefix`` for real: the vLLM CPU server writes each sample's rows
to an S3-protocol server the test started on loopback (moto, tests/support/s3_server.py), its answers carry refs
naming the bucket, and after the server has stopped the refs still resolve, from the objects, to transformers' own
router top-k; examples/spans_multi_turn.py's multi-turn datum, built from provenance spans of two samples, resolves
after the stop to the conversation's top-k and replays with every row applied."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rr_client import RoutedExpertsClient, RoutingRef
from rr_client.core.hf_config import load_config, moe_layers_from_config
from rr_server.demo.tiny_moe import reference_routing
from tests.support.routing_asserts import assert_routing_sets_equal
from tests.support.s3_server import S3, s3_server
from tests.support.scripts import load_script

pytestmark = pytest.mark.vllm_server

PROMPTS = ["Hello world, this is a tiny test.", "1 2 3 4 5"]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0}
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "spans_multi_turn.py"


@pytest.fixture(scope="module")
def s3() -> Iterator[S3]:
    with s3_server() as server:
        yield server


def _streamed_ref(url: str, prompt_ids: list[int]) -> RoutingRef:
    """A streamed ``/generate`` by reference: the final chunk's ref."""
    import json

    import httpx

    body = {"input_ids": prompt_ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}, "stream": True,
            "return_routed_experts": True, "routed_experts_format": "ref"}  # fmt: skip
    last: dict[str, Any] = {}
    with httpx.stream("POST", url + "/generate", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[6:])
    return RoutingRef.from_dict(last["meta_info"]["routed_experts_ref"])


def _example() -> Any:
    return load_script(EXAMPLE, "spans_multi_turn")


def test_refs_in_s3_resolve_after_the_engine_stopped(s3: S3, tiny_models: dict[str, Any]) -> None:
    from tests.support.vllm_process import VLLMProcess

    model = tiny_models["qwen3_dense"]
    store = s3.url("run-1")
    server = VLLMProcess(model, name="qwen3-s3-store", extra=["--rr-store", store], env=s3.env).start()
    example = _example()
    try:

        async def run() -> tuple[Any, Any, Any, dict[str, Any]]:
            async with RoutedExpertsClient(server.base_url, object_stores=[store]) as c:
                inline = await c.generate(PROMPTS, GREEDY)
                by_ref = await c.generate(PROMPTS, GREEDY, by_reference=True)
                info = await c.info()
                return inline, by_ref, info, (await c._http_for(server.base_url).get("/rr/info")).json()

        inline, by_ref, info, rr_info = asyncio.run(run())
        streamed = _streamed_ref(server.base_url, list(inline[0].prompt_ids))  # its final chunk's ref, off the loop
        assert rr_info["routing_store"]["backend"] == "objects" and rr_info["routing_store"]["url"] == store
        turns = asyncio.run(example.rollout(server.base_url, [2, 88, 86, 260, 202], store))
    finally:
        server.stop()
    assert not server.alive()
    refs = [r.routing_ref for r in by_ref]
    assert all(isinstance(r, RoutingRef) and r.url == store for r in refs) and streamed.url == store
    keys = {p.rsplit("/", 1)[-1] for p in s3.filesystem().find(f"{s3.bucket}/run-1")}
    assert {f"{r.key}.rr" for r in refs} <= keys

    async def after() -> list[np.ndarray]:  # no server: the rows come from the bucket, checked against info
        async with RoutedExpertsClient(
            "http://127.0.0.1:9", info=info, object_stores=[store], storage_options=s3.storage_options
        ) as c:
            return await c.resolve(refs, tokens=[*by_ref, None])

    moe = moe_layers_from_config(load_config(model))
    refs.append(streamed)  # the streamed answer's ref: the same rows as the first prompt's
    got = asyncio.run(after())
    assert np.array_equal(got.pop(), inline[0].routed_experts)
    for a, rows in zip(inline, got):
        assert np.array_equal(rows, a.routed_experts)
        truth = reference_routing(model, [*a.prompt_ids, *a.output_ids])[:-1]
        assert_routing_sets_equal(rows, truth, layers=moe)

    book, (turn1, turn2), ex_info = turns
    datum = [*turn2.prompt_ids, *turn2.output_ids][:-1]
    spans = example.datum_spans(turn1, turn2)
    assert len(book) == 2 and [s.sequence_id for s in spans] == ["turn-1", "turn-1", "turn-2", "turn-2"]
    import fsspec.config

    fsspec.config.conf.setdefault("s3", {})["endpoint_url"] = s3.endpoint  # the example reads with fsspec's config
    try:
        rows = asyncio.run(example.resolve(book, spans, datum, ex_info, store))
    finally:
        fsspec.config.conf["s3"].pop("endpoint_url", None)
    assert rows.shape[0] == len(datum)
    assert_routing_sets_equal(rows, reference_routing(model, [*datum, turn2.output_ids[-1]])[:-1], layers=moe)
    metrics = example.replay(str(model), datum, rows)
    assert metrics["r3/applied_share"] == 1.0


def _sidecar(upstream: Any, store: str, log: Path) -> tuple[Any, str]:
    """``rr-server proxy --rr-store STORE`` in front of ``upstream``, as its own process; (process, URL) once healthy."""
    import subprocess
    import sys

    from rr_server.launch.process import free_port, wait_healthy
    from tests.support.deadlines import STARTUP_TIMEOUT_S

    port = free_port()
    cmd = [sys.executable, "-m", "rr_server", "proxy", "--upstream", upstream.base_url, "--engine", "vllm"]
    cmd += ["--port", str(port), "--model-path", str(upstream.model_dir), "--rr-store", store]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, log, STARTUP_TIMEOUT_S)
    return proc, url


def test_sidecar_refs_in_a_shared_folder_outlive_a_sidecar_restart(qwen_server: Any, tmp_path: Path) -> None:
    """The sidecar process with ``--rr-store file://...``: its refs resolve from the folder after it stopped, and a
    new sidecar process on the same folder answers them on its read route."""
    import httpx

    from rr_client.core.reference import READ_PATH, decode_frame
    from rr_server.launch.process import stop_process_group

    store = f"file://{tmp_path}/rollouts"
    proc, url = _sidecar(qwen_server, store, tmp_path / "sidecar-1.log")
    try:

        async def run() -> tuple[Any, Any, Any]:
            async with RoutedExpertsClient(url, object_stores=[store]) as c:
                return (
                    await c.generate(PROMPTS, GREEDY),
                    await c.generate(PROMPTS, GREEDY, by_reference=True),
                    (await c.info()),
                )

        inline, by_ref, info = asyncio.run(run())
    finally:
        stop_process_group(proc)
    refs = [r.routing_ref for r in by_ref]
    assert all(r.url == store for r in refs) and len(list(tmp_path.rglob("*.rr"))) == len(PROMPTS)

    async def after() -> list[np.ndarray]:
        async with RoutedExpertsClient("http://127.0.0.1:9", info=info, object_stores=[store]) as c:
            return await c.resolve(refs, tokens=list(by_ref))

    for a, rows in zip(inline, asyncio.run(after())):
        assert np.array_equal(rows, a.routed_experts)
    proc, url = _sidecar(qwen_server, store, tmp_path / "sidecar-2.log")  # the sidecar restarted
    try:
        r = httpx.post(url + READ_PATH, json={"refs": [{"store": x.store, "key": x.key} for x in refs]}, timeout=60)
        assert r.status_code == 200, r.text
        parts = decode_frame(r.content)
        assert [p.digest for p in parts] == [x.checksum for x in refs]
        assert all(np.array_equal(p.rows, a.routed_experts) for p, a in zip(parts, inline))
    finally:
        stop_process_group(proc)
