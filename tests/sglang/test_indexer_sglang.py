"""Sparse-attention indexer top-k through rr-patched SGLang 0.5.23 (real TokenizerManager, detokenizer and HTTP layer;
the stand-in scheduler's capturers hold the routers' top-k and the indexers' picks from a transformers forward of a
tiny DeepSeek-V3.2): asked with ``return_indexer_topk``, an answer carries rr's checked indexer rows (the choosing
tokens only, uint16 ``.npy``) and never SGLang's raw int32; every (token, indexer layer) set equals transformers' own
indexer pick, and replayed in transformers the attention of every replayed token reads exactly those positions.
A malformed capture (a future position, a repeat) is refused with the typed error, the routing kept."""

from __future__ import annotations

import base64
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from rr_client import IndexerDims, IndexerPositionError, RoutingRef, RRInfo, StaleRoutingError, decode_indexer
from tests.sglang.conftest import CACHE
from tests.sglang.deepseek_v32 import INDEX_TOPK, build_tiny_deepseek_v32, forward_rows, load
from tests.sglang.harness import Harness

pytestmark = [pytest.mark.sglang, pytest.mark.sglang_releases("0.5.23")]  # the first SGLang that returns it
PROMPT = [3, 17, 29, 41, 53, 60, 11, 7, 90]


@pytest.fixture(scope="module")
def dsv32(tiny_moe: Path) -> Path:
    return build_tiny_deepseek_v32(CACHE / "sglang-deepseek-v32", tokenizer_from=tiny_moe)


@pytest.fixture(autouse=True)
def gpu_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's ServerArgs reads the GPU's compute capability for a DSA model (arg_groups/model_hook.py, the CUDA
    platform path): stood in as an H100's (9, 0), the only GPU fact this test needs."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_a, **_k: (9, 0))


async def _generate(h: Harness, **extra: Any) -> dict[str, Any]:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5, "temperature": 0.0}, **extra}
    status, out = await h.post(body)
    assert status == 200, out
    return out["meta_info"]  # type: ignore[no-any-return]


async def test_indexer_rows_equal_transformers_and_replay_reads_them(dsv32: Path, patched: None) -> None:
    h = Harness(dsv32)
    async with h.client() as c:
        info = RRInfo.model_validate((await c.get("/rr/info")).json())
    dims = info.indexer
    assert dims == IndexerDims((0, 1, 2), INDEX_TOPK)
    meta = await _generate(h, return_indexer_topk=True, return_routed_experts=True, indexer_topk_format="npy")
    assert "indexer_topk_error" not in meta and meta["indexer_topk_start"] == INDEX_TOPK
    r = h.sched.reqs[meta["id"]]
    tokens = r.prompt + r.completion
    got = decode_indexer(
        meta["indexer_topk"], dims, prompt_tokens=meta["prompt_tokens"], completion_tokens=meta["completion_tokens"]
    )
    assert got.array.dtype == np.uint16 and got.start == INDEX_TOPK
    want = forward_rows(dsv32, tokens[:-1])[1][INDEX_TOPK:]
    assert got.array.shape == want.shape
    assert np.array_equal(np.sort(got.array, -1), np.sort(want, -1))  # every (token, indexer layer) set
    # replayed in transformers: the eager attention reads exactly the engine's positions (its own weights say)
    model = load(dsv32)
    from rr_client.trainer import replay_indexer

    picks = torch.full((1, len(tokens) - 1, 3, INDEX_TOPK), -1, dtype=torch.int32)
    picks[0, INDEX_TOPK:] = torch.from_numpy(got.array.astype(np.int32))
    ids = torch.tensor([tokens[:-1]])
    with torch.no_grad(), replay_indexer(model, picks, audit=True) as report:
        att = model(ids, output_attentions=True).attentions
    assert report is not None and report["r3/indexer/applied_share"] == 1.0
    for li in range(3):
        read = att[li][0].sum(0) > 0
        for t in range(INDEX_TOPK, len(tokens) - 1):
            assert set(torch.nonzero(read[t]).flatten().tolist()) == set(got.array[t - INDEX_TOPK, li].tolist())


async def test_not_asked_no_indexer_rows_and_malformed_ones_refused(dsv32: Path, patched: None) -> None:
    h = Harness(dsv32)
    meta = await _generate(h, return_routed_experts=True)
    assert "indexer_topk" not in meta and "routed_experts" in meta

    def future(rows: np.ndarray) -> None:
        rows[6, 1, 2] = 8  # token 6 reads positions 0..6
        rows[6, 1, 3] = rows[6, 1, 0]

    h.sched.indexer_edit = future
    meta = await _generate(h, return_indexer_topk=True, return_routed_experts=True)
    assert meta["indexer_topk"] is None
    assert (
        meta["indexer_topk_error"].startswith("IndexerPositionError") and "future token" in meta["indexer_topk_error"]
    )
    assert meta["routed_experts"] is not None  # the routing is unaffected
    from rr_client import RoutedExpertsClient
    from tests.sglang.test_doctor_sglang import scheduler_loop

    http = httpx.ASGITransport(app=h.http.app)
    async with scheduler_loop(h), RoutedExpertsClient("http://sglang", transport=http, retries=0) as c:
        with pytest.raises(IndexerPositionError, match="future token"):
            await c.generate([PROMPT], {"max_new_tokens": 5}, return_indexer_topk=True)
        h.sched.indexer_edit = None
        # by reference, the server's default: the rows stay in its store until the trainer rank reads them
        prompts = [PROMPT, PROMPT[::-1]]
        batch = await c.generate(prompts, {"max_new_tokens": 5}, return_indexer_topk=True)
        assert all(r.indexer_topk is None and r.indexer_ref is not None for r in batch)
        assert batch[0].indexer_ref.kind == "indexer" and batch[0].indexer_ref.dtype == "uint16"
        a, b = batch.results
        with pytest.raises(StaleRoutingError, match="belong to other tokens"):  # refs swapped between samples
            await c.resolve_results([replace(a, indexer_ref=b.indexer_ref)])
        got = await c.resolve_results(batch.results)
        (inline,) = await c.generate(
            [PROMPT], {"max_new_tokens": 5}, return_indexer_topk=True, indexer_by_reference=False
        )
    for prompt, r in zip(prompts, got, strict=True):
        assert r.indexer_topk_start == INDEX_TOPK and r.indexer_topk.dtype == np.uint16
        want = forward_rows(dsv32, (prompt + r.output_ids)[:-1])[1][INDEX_TOPK:]
        assert np.array_equal(np.sort(r.indexer_topk, -1), np.sort(want, -1))
    assert inline.indexer_ref is None and np.array_equal(inline.indexer_topk, got[0].indexer_topk)


async def test_the_sidecar_checks_an_unpatched_servers_indexer_rows(dsv32: Path) -> None:
    """rr's sidecar in front of unpatched SGLang: SGLang's raw int32 indexer rows become rr's checked ones (equal to
    transformers), a malformed capture the typed refusal; the raw payload never passes."""
    from tests.sglang.test_sidecar_sglang import client_of, sidecar_app

    h = Harness(dsv32)
    async with sidecar_app(h) as app:
        body = {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 5},
            "return_indexer_topk": True,
            "indexer_topk_format": "npy",
        }
        status, out = await h.post(body, via=client_of(app))
        assert status == 200, out
        meta = out["meta_info"]
        r = h.sched.reqs[meta["id"]]
        info = RRInfo.model_validate((await client_of(app).get("/rr/info")).json())
        got = decode_indexer(
            meta["indexer_topk"], info.indexer, prompt_tokens=len(r.prompt), completion_tokens=len(r.completion)
        )
        assert got.array.dtype == np.uint16 and meta["indexer_topk_start"] == INDEX_TOPK
        want = forward_rows(dsv32, (r.prompt + r.completion)[:-1])[1][INDEX_TOPK:]
        assert np.array_equal(np.sort(got.array, -1), np.sort(want, -1))
        h.sched.indexer_edit = lambda rows: rows.__setitem__((7, 0, 1), rows[7, 0, 0])  # a repeat
        status, out = await h.post(body, via=client_of(app))
        assert out["meta_info"]["indexer_topk"] is None
        assert out["meta_info"]["indexer_topk_error"].startswith("IndexerPositionError")


async def test_the_sidecars_indexer_refs_are_bound_to_their_samples_tokens(dsv32: Path) -> None:
    """Behind the sidecar, by reference (the default), each indexer ref carries its sample's provenance, bound as rr's
    patch binds it (one function): a ref paired with another sample is refused before any read, and each resolves
    to transformers' picks."""
    from rr_client import RoutedExpertsClient
    from rr_client.core.provenance import tokens_digest
    from tests.sglang.test_doctor_sglang import scheduler_loop
    from tests.sglang.test_sidecar_sglang import client_of, sidecar_app

    h = Harness(dsv32)
    prompts = [PROMPT, PROMPT[::-1]]
    async with sidecar_app(h) as app, scheduler_loop(h):
        http = httpx.ASGITransport(app=app)
        async with RoutedExpertsClient("http://sidecar", transport=http, retries=0) as c:
            batch = await c.generate(prompts, {"max_new_tokens": 5}, return_indexer_topk=True)
            a, b = batch.results
            assert a.indexer_ref is not None and a.indexer_ref.provenance is not None
            assert a.indexer_ref.provenance.tokens_digest == tokens_digest(a.prompt_ids, a.output_ids)
            with pytest.raises(StaleRoutingError, match="belong to other tokens"):  # refs swapped between samples
                await c.resolve_results([replace(a, indexer_ref=b.indexer_ref)])
            got = await c.resolve_results(batch.results)
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5}, "return_indexer_topk": True}
        status, out = await h.post(body, via=client_of(app))  # the indexer alone, no routing asked
        assert status == 200, out
        ref = RoutingRef.from_dict(out["meta_info"]["indexer_topk_ref"])
        assert ref.provenance is not None and ref.provenance.tokens_digest == tokens_digest(PROMPT, out["output_ids"])
    for prompt, r in zip(prompts, got, strict=True):
        want = forward_rows(dsv32, (prompt + r.output_ids)[:-1])[1][INDEX_TOPK:]
        assert np.array_equal(np.sort(r.indexer_topk, -1), np.sort(want, -1))


async def test_a_plain_training_step_replays_experts_and_indexer_from_the_engine(dsv32: Path, patched: None) -> None:
    """One SGD step on (a fresh copy of) the tiny DeepSeek-V3.2 with the engine's rows from rr's client: the experts
    (replay_routing) and the indexer (replay_indexer) replayed together, both audits at 100% applied, gradients
    through the replayed forward, and the weights moved."""
    import transformers

    from rr_client import RoutedExpertsClient
    from rr_client.trainer import replay_indexer, replay_routing
    from tests.sglang.test_doctor_sglang import scheduler_loop

    h = Harness(dsv32)
    http = httpx.ASGITransport(app=h.http.app)
    async with scheduler_loop(h), RoutedExpertsClient("http://sglang", transport=http, retries=0) as c:
        (r,) = await c.resolve_results(await c.generate([PROMPT], {"max_new_tokens": 5}, return_indexer_topk=True))
    model = transformers.AutoModelForCausalLM.from_pretrained(dsv32, dtype=torch.float32, attn_implementation="eager")
    model.train()
    tokens = r.prompt_ids + r.output_ids
    ids = torch.tensor([tokens[:-1]])
    picks = torch.full((1, ids.shape[1], 3, INDEX_TOPK), -1, dtype=torch.int32)
    picks[0, r.indexer_topk_start :] = torch.from_numpy(r.indexer_topk.astype(np.int32))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    routing = torch.from_numpy(r.routed_experts.astype(np.int64))[None]
    with replay_routing(model, routing, audit=True) as r3, replay_indexer(model, picks, audit=True) as idx:
        loss = model(ids, labels=ids).loss  # transformers shifts the labels itself
        loss.backward()
    opt.step()
    assert r3 is not None and idx is not None
    assert r3["r3/applied_share"] == 1.0 and idx["r3/indexer/applied_share"] == 1.0
    assert idx["r3/indexer/replayed_rows"] == 3 * (ids.shape[1] - INDEX_TOPK)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


async def test_a_pd_decode_server_refuses_indexer_rows_for_the_prompt_it_never_ran(dsv32: Path, patched: None) -> None:
    """On a P/D decode server the prompt's indexer rows are capture-buffer leftovers, like its routing rows: refused
    (SeamMismatchError naming routed_experts_start_len), never sent as picks."""
    from rr_server.launch.process import free_port

    port = free_port()
    h = Harness(
        dsv32,
        disaggregation_mode="decode",
        disaggregation_transfer_backend="fake",
        disaggregation_bootstrap_port=port,
    )
    h.sched.pd_role = "decode"
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 11}
    meta = await _generate(h, return_indexer_topk=True, **boot)
    assert meta["indexer_topk"] is None and meta["indexer_topk_error"].startswith("SeamMismatchError")
    assert "P/D decode server" in meta["indexer_topk_error"]


def test_glm5_shared_indexer_layers_decode_by_sglangs_layer_count() -> None:
    """GLM-5 (``glm_moe_dsa``) with "shared" indexer layers: SGLang 0.5.23 gives every decoder layer a capture slot (its
    own ``get_num_indexer_layers`` on the config), a shared layer's slot holding the previous layer's pick
    (``dsa_layer_skips_topk`` says which; ``forward_mla.py`` mirrors ``prev_topk_indices``). rr decodes SGLang's payload
    by that count and keeps its indexer layers' picks, equal to transformers' own GLM-5 indexers."""
    from sglang.srt.configs.model_config import dsa_layer_skips_topk, get_num_indexer_layers

    from rr_client.trainer.replay import find_indexers
    from rr_server.serving.engines.sglang import indexer_slots, installed_version
    from rr_server.serving.indexer_fields import indexer_fields
    from tests.trainer.tiny_families import tiny_family_model

    model = tiny_family_model("glm_moe_dsa", index_topk=INDEX_TOPK, indexer_types=["full", "shared", "full"])
    cfg = model.config
    cfg.architectures = ["GlmMoeDsaForCausalLM"]
    info = RRInfo.from_hf_config(cfg.to_dict(), engine="sglang", engine_version=installed_version())
    assert info.indexer == IndexerDims((0, 2), INDEX_TOPK)
    slots = get_num_indexer_layers(cfg)  # what the release's capturer allocates
    assert slots == 3 and indexer_slots(info.engine_version, info.num_hidden_layers) == slots
    ids = [3, 17, 29, 41, 53, 60, 11, 7, 9, 5]
    picks: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _a, o: picks.append(o[0])) for _, m in find_indexers(model)]
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    for hook in hooks:
        hook.remove()
    own = torch.stack(picks, 1).numpy().astype(np.int32)  # [T, rr's 2 indexer layers, K]
    engine, k = [], 0
    for layer in range(slots):  # SGLang's buffer: the shared layer mirrors the previous layer's pick
        if not dsa_layer_skips_topk(cfg, layer):
            engine.append(own[:, k])
            k += 1
        else:
            engine.append(engine[-1])
    raw = np.ascontiguousarray(np.stack(engine, 1)[:-1])  # rows of tokens 0 .. P + C - 2, as SGLang sends them
    payload = base64.b64encode(raw.tobytes()).decode()
    fields = indexer_fields(info, payload, prompt_tokens=7, completion_tokens=3, start=0, fmt="npy")
    assert "indexer_topk_error" not in fields, fields
    got = decode_indexer(fields["indexer_topk"], info.indexer, prompt_tokens=7, completion_tokens=3)
    assert np.array_equal(got.array, own[INDEX_TOPK:-1])
    # a release whose layout rr does not know: refused, never read by a guessed layer count
    old = info.model_copy(update={"engine_version": "0.5.22"})
    refused = indexer_fields(old, payload, prompt_tokens=7, completion_tokens=3, start=0, fmt="npy")
    assert refused["indexer_topk"] is None and refused["indexer_topk_error"].startswith("UnsupportedSGLangError")


def _check_threads(monkeypatch: pytest.MonkeyPatch, off_loop: Any = None) -> list[int]:
    """The threads the one full indexer check runs in, from now on (the server side's calls: the client's own
    check is imported apart); ``off_loop``: called from the check when it runs off this test's thread."""
    import threading

    import rr_client.core.indexer as core

    seen: list[int] = []
    real = core.check_indexer
    loop_thread = threading.get_ident()

    def spy(*a: Any, **k: Any) -> Any:
        seen.append(threading.get_ident())
        if off_loop is not None and seen[-1] != loop_thread:
            off_loop()
        return real(*a, **k)

    monkeypatch.setattr(core, "check_indexer", spy)
    return seen


async def test_the_patch_checks_indexer_rows_off_sglangs_event_loop(
    dsv32: Path, patched: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rr's patch runs each batch's indexer checks in a worker thread before SGLang's handler appends the answers:
    SGLang's event loop (this test's thread) is not held by them, and the answer still carries the checked rows and
    its routing, also when SGLang's consumer takes the answer list meanwhile (``_wait_one_response``:
    ``state.out_list = []``)."""
    import asyncio
    import threading

    h, loop = Harness(dsv32), asyncio.get_running_loop()

    async def consumer_takes_the_lists() -> None:
        for state in h.tm.rid_to_state.values():
            state.out_list = []

    seen = _check_threads(
        monkeypatch, lambda: asyncio.run_coroutine_threadsafe(consumer_takes_the_lists(), loop).result()
    )
    meta = await _generate(h, return_indexer_topk=True, return_routed_experts=True, indexer_topk_format="npy")
    assert "indexer_topk_error" not in meta and meta["indexer_topk_start"] == INDEX_TOPK
    assert meta["routed_experts"] is not None and "routed_experts_error" not in meta
    r = h.sched.reqs[meta["id"]]
    assert seen and threading.get_ident() not in seen
    assert decode_indexer(
        meta["indexer_topk"], IndexerDims((0, 1, 2), INDEX_TOPK), prompt_tokens=len(r.prompt), completion_tokens=5
    ).array.shape == (len(r.prompt) + 5 - 1 - INDEX_TOPK, 3, INDEX_TOPK)


@pytest.mark.parametrize("stream", [False, True])
async def test_the_sidecar_checks_indexer_rows_off_its_event_loop(
    dsv32: Path, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """The sidecar checks SGLang's indexer rows in a worker thread, streamed or not: its event loop (this test's
    thread) serves every other request meanwhile."""
    import threading

    from tests.sglang.test_sidecar_sglang import client_of, sidecar_app

    h = Harness(dsv32)
    async with sidecar_app(h) as app:
        seen = _check_threads(monkeypatch)
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5}, "return_indexer_topk": True}
        if stream:
            body["stream"] = True
        status, out = await h.post(body, via=client_of(app))
        assert status == 200, out
        final = out[-1] if isinstance(out, list) else out
        assert final["meta_info"].get("indexer_topk_ref") is not None, final["meta_info"]
    assert seen and threading.get_ident() not in seen
