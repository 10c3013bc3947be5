"""Routing provenance on the real vLLM 0.30 CPU server (issue 38): cached tokens, preemptions, weight versions.

One server of this module's own (its weights change): the tiny Qwen3-MoE in dev mode (``VLLM_SERVER_DEV_MODE=1``)
with a KV cache of 12 blocks of 32 tokens, so concurrent long requests preempt each other. In order:

1. A cold sample and the same prompt again: the second carries its prefix-cache hit (``cached_tokens``, tier
   ``device``) and rows equal to the cold run's; both equal transformers' own router top-k, at one weight version
   at both ends, no preemption, and the digest of their tokens.
2. One long request, frozen in the engine by the pause before it was sent, while rr's weight sync reloads
   (``/collective_rpc`` ``reload_weights``, the same weights): it spans the update without a recompute, so it is
   flagged and kept, its rows exact.
3. Six long requests frozen in the engine the same way while the reload loads the checkpoint with every router
   negated; let go, they overfill the KV cache and vLLM preempts some. Each sample preempted across the update says
   so (preemptions > 0, spans it): ``check_provenance`` refuses it, or with ``stale_rows="mask"`` keeps it
   unreplayed and counts it; every busy sample's rows equal transformers' with the pushed weights.
4. ``/rr/info`` answers the new weight version; a new sample's rows equal transformers' with the pushed
   weights, on ``/generate`` (by reference too: its ref carries the version and the provenance) and on
   ``/v1/completions`` (``choice["rr_provenance"]``, streamed: on rr's routing event).

Both reloads run as RL frameworks run them on vLLM: ``/pause?mode=keep``, the reload, ``/resume``. The requests
are sent while the engine is paused and the reload waits until all of them are in it (``/rr/info``
``requests_in_engine``), so what the update overlaps is decided by no timing: aimed at requests mid-decode, the
pause landed after they finished on a loaded machine (the API process answers it only once their outputs drain).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import transformers

from rr_client.core.codec import decode_meta_info
from rr_client.core.errors import StaleRoutingError
from rr_client.core.provenance import PROVENANCE_FIELD, Provenance, check_provenance, tokens_digest
from rr_client.trainer.router_reference import router_forward, router_topk
from tests.support.routing_asserts import assert_routing_sets_equal
from tests.support.vllm_process import VLLMProcess, small_kv_dev_server

pytestmark = pytest.mark.vllm_server

MOE_LAYERS = [0, 2]  # qwen3_dense: layer 1 is dense
PROMPT = [int(t) for t in np.random.default_rng(38).integers(2, 440, size=40)]
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
LONG = {"max_new_tokens": 190, "temperature": 0, "ignore_eos": True}
# 12 blocks x 32 tokens (vLLM CPU wants multiples of 32) = 384 KV slots; six requests of 40 + 190 tokens
# need 1380: vLLM preempts
SMALL_KV_BLOCKS = 12


@pytest.fixture(scope="module")
def dev_server(tiny_models: dict[str, Path]) -> Iterator[VLLMProcess]:
    """The tiny Qwen3-MoE in dev mode with a small KV cache (this module's own: its weights change)."""
    yield from small_kv_dev_server(
        tiny_models["qwen3_dense"], name="provenance", blocks=SMALL_KV_BLOCKS, max_model_len=256, core=0
    )


def negated_routers(model_dir: Path, out: Path) -> Any:
    """The checkpoint with every MoE router negated (routing must change), saved to ``out``; returns the model."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for i in MOE_LAYERS:
            model.model.layers[i].mlp.gate.weight.neg_()
    model.save_pretrained(out)
    return model


def reference(model: Any, prompt: list[int], output: list[int]) -> np.ndarray:
    """Transformers' top-k ids for the rows the engine returns (prompt + completion - 1)."""
    _, logits = router_forward(model, prompt + output, MOE_LAYERS)
    return router_topk(logits, model.config.num_hidden_layers, model.config.num_experts_per_tok)[:-1]


def provenance(meta: dict[str, Any], prompt: list[int], output: list[int]) -> Provenance:
    """The sample's parsed provenance; its digest binds it to exactly these tokens."""
    p = Provenance.from_dict(meta[PROVENANCE_FIELD])
    assert p.tokens_digest == tokens_digest(prompt, output)
    return p


async def generate(c: httpx.AsyncClient, prompt: list[int], params: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """One /generate answer with routing."""
    r = await c.post(
        "/generate", json={"input_ids": prompt, "sampling_params": params, "return_routed_experts": True, **extra}
    )
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


async def pause(c: httpx.AsyncClient, *, clear_cache: bool) -> None:
    """vLLM's dev-mode ``/pause?mode=keep``: in-flight requests freeze (none finishes) until ``/resume``. With
    ``clear_cache`` (the route's default), vLLM 0.30 also resets the prefix cache with its running requests: each is
    preempted, and recomputed under the new weights after the resume."""
    r = await c.post("/pause", params={"mode": "keep", "clear_cache": str(clear_cache).lower()})
    assert r.status_code == 200, r.text


async def resume(c: httpx.AsyncClient) -> None:
    """vLLM's dev-mode ``/resume``: the frozen requests go on."""
    r = await c.post("/resume")
    assert r.status_code == 200, r.text


async def in_engine(c: httpx.AsyncClient, n: int) -> None:
    """Wait (bounded) until the paused server holds ``n`` requests in its engine (``/rr/info`` requests_in_engine):
    no timing decides what the update overlaps."""
    for _ in range(3000):
        if (await c.get("/rr/info")).json()["requests_in_engine"] == n:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{n} requests never reached the paused engine")


async def reload_and_resume(c: httpx.AsyncClient, folder: Path) -> None:
    """rr's weight sync's reload (dev-mode ``/collective_rpc`` ``reload_weights`` from ``folder``) while paused,
    then ``/resume``."""
    r = await c.post("/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": str(folder)}})
    assert r.status_code == 200, r.text
    await resume(c)


def test_provenance_through_prefix_hits_preemption_and_a_weight_update(
    dev_server: VLLMProcess, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    check_server(dev_server.base_url, dev_server.name, tiny_models["qwen3_dense"], tmp_path)


def check_server(url: str, name: str, model_dir: Path, tmp_path: Path) -> None:
    """Every step of the module docstring against the dev-mode server at ``url`` serving ``model_dir``."""
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pushed = negated_routers(model_dir, tmp_path / "pushed")
    v0 = httpx.get(url + "/rr/info", timeout=30).json()["weight_version"]

    def exact(sample: dict[str, Any], model: Any) -> None:
        meta = sample["meta_info"]
        got = decode_meta_info(meta)
        assert_routing_sets_equal(
            got, reference(model, meta["prompt_token_ids"], sample["output_ids"]), layers=MOE_LAYERS
        )

    async def run() -> tuple[list[dict[str, Any]], dict[str, Any], list[dict[str, Any]]]:
        async with httpx.AsyncClient(base_url=url, timeout=600) as c:
            cold = await generate(c, PROMPT, GREEDY)
            warm = await generate(c, PROMPT, GREEDY)
            # an update while one request is in the engine alone (no KV pressure): frozen there by the pause before
            # it was sent, admitted under the old weights, it spans the update without a recompute
            await pause(c, clear_cache=False)
            alone = asyncio.ensure_future(generate(c, PROMPT[:30], LONG))
            await in_engine(c, 1)
            await reload_and_resume(c, model_dir)  # the same weights again: a real reload, the rows stay exact
            spanning = await alone
            # six long requests frozen in the engine the same way while the pushed weights load; let go, they
            # overfill the KV cache (6 x 8 blocks > 12) and vLLM preempts some under the new weights
            await pause(c, clear_cache=True)
            prompts = [[(t + 7 * k) % 440 + 2 for t in PROMPT] for k in range(1, 7)]
            tasks = [asyncio.ensure_future(generate(c, p, LONG)) for p in prompts]
            await in_engine(c, len(tasks))
            await reload_and_resume(c, tmp_path / "pushed")
            busy = list(await asyncio.gather(*tasks))
            assert (await c.post("/reset_prefix_cache")).status_code == 200  # as rr's weight sync does after a push
            return [cold, warm], spanning, busy

    (cold, warm), spanning, busy = asyncio.run(run())

    # 1. prefix-cache hit: counted, served from the device cache, same rows as cold; both exact vs transformers
    pc, pw = (provenance(s["meta_info"], PROMPT, s["output_ids"]) for s in (cold, warm))
    assert pc.cached_tokens == 0 and pc.cache_tier is None
    assert pw.cached_tokens == 32 and pw.cache_tier == "device"  # the prompt's one full block of 32
    assert warm["meta_info"]["cached_tokens"] == 32
    assert np.array_equal(decode_meta_info(cold["meta_info"]), decode_meta_info(warm["meta_info"]))
    for s, p in ((cold, pc), (warm, pw)):
        exact(s, base)
        assert (p.preemptions, p.weight_version_admitted, p.weight_version_finished) == (0, v0, v0)
        assert not p.spans_update and not p.weight_update_during

    # 2. spanning an update without a recompute: flagged, kept, its rows exact
    ps = provenance(spanning["meta_info"], PROMPT[:30], spanning["output_ids"])
    assert ps.preemptions == 0 and ps.weight_version_admitted == v0 and ps.spans_update, ps
    assert not ps.may_be_recomputed_across_update
    flagged = check_provenance([ps], "refuse")
    assert flagged.replay == (True,) and flagged.spans_update == 1 and flagged.masked == 0
    exact(spanning, base)

    # 3. preempted across the update: refused, or masked and counted; every other sample exact
    provs = [provenance(s["meta_info"], s["meta_info"]["prompt_token_ids"], s["output_ids"]) for s in busy]
    stale = [i for i, p in enumerate(provs) if p.may_be_recomputed_across_update]
    assert stale and all(provs[i].preemptions and provs[i].weight_version_finished == v0 + 2 for i in stale)
    with pytest.raises(StaleRoutingError, match=f"sample {stale[0]}: its rows may have been recomputed"):
        check_provenance(provs, "refuse")
    masked = check_provenance(provs, "mask")
    assert masked.masked == len(stale) and [not r for r in masked.replay] == [i in stale for i in range(len(provs))]
    for s, p in zip(busy, provs):  # admitted before the update, computed after it: the pushed weights' rows
        assert p.spans_update and p.weight_version_admitted == v0 + 1 and p.weight_version_finished == v0 + 2, p
        exact(s, pushed)
    print(f"\npreemptions / spans update per busy sample: {[(p.preemptions, p.spans_update) for p in provs]}")

    # 4. after the update: its version, and new samples route as transformers does with the pushed weights
    info = httpx.get(url + "/rr/info", timeout=30).json()
    assert info["weight_version"] == v0 + 2 and info["weight_update_in_progress"] is False

    async def after() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]:
        async with httpx.AsyncClient(base_url=url, timeout=600) as c:
            fresh = await generate(c, PROMPT[:20], GREEDY)
            by_ref = await generate(c, PROMPT[:20], GREEDY, routed_experts_format="ref")
            r = await c.post(
                "/v1/completions",
                json={
                    "model": name,
                    "prompt": PROMPT[:20],
                    "max_tokens": 6,
                    "temperature": 0,
                    "ignore_eos": True,
                    "return_routed_experts": True,
                },
            )
            assert r.status_code == 200, r.text
            events = []
            async with c.stream(
                "POST",
                "/v1/completions",
                json={
                    "model": name,
                    "prompt": PROMPT[:20],
                    "max_tokens": 6,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                    "return_routed_experts": True,
                },
            ) as s:
                async for line in s.aiter_lines():
                    if line.startswith("data:") and line[5:].strip() != "[DONE]":
                        events.append(json.loads(line[5:]))
            routed = [e for e in events if any(PROVENANCE_FIELD in ch for ch in e.get("choices", ()))]
            assert len(routed) == 1 and routed[0] is events[-1]  # rr's routing event, right before [DONE]
            return fresh, by_ref, r.json(), routed[0]["choices"][0]

    fresh, by_ref, completion, streamed = asyncio.run(after())
    pf = provenance(fresh["meta_info"], PROMPT[:20], fresh["output_ids"])
    assert (pf.weight_version_admitted, pf.weight_version_finished, pf.spans_update) == (v0 + 2, v0 + 2, False)
    exact(fresh, pushed)
    ref = by_ref["meta_info"]["routed_experts_ref"]
    assert ref["weight_version"] == v0 + 2 and ref["provenance"] == by_ref["meta_info"][PROVENANCE_FIELD]
    assert httpx.post(url + "/rr/routing/retire", json={"through": v0 + 1}, timeout=30).status_code == 200
    read = httpx.post(url + "/rr/routing/read", json={"refs": [{"store": ref["store"], "key": ref["key"]}]}, timeout=30)
    assert read.status_code == 200  # rows made under the pushed weights stay through a retire of the older ones
    assert httpx.post(url + "/rr/routing/retire", json={"through": v0 + 2}, timeout=30).json()["retired"] >= 1
    choice = completion["choices"][0]
    pcmp = provenance(choice, PROMPT[:20], choice["token_ids"])
    assert (pcmp.weight_version_admitted, pcmp.weight_version_finished, pcmp.preemptions) == (v0 + 2, v0 + 2, 0)
    pst = provenance(streamed, PROMPT[:20], streamed["token_ids"])  # a stream's: on rr's routing event
    assert pst.weight_version_admitted == v0 + 2 and pst.cached_tokens == 0 and streamed["routed_experts"] is not None
