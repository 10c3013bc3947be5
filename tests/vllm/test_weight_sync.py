"""DiskWeightSync on real vLLM 0.30 CPU servers (``VLLM_SERVER_DEV_MODE=1``) in the two setups of issue 29.

- keyed: ``rr-server launch vllm --api-key K``. ``api_key=K`` pushes and the engine then routes (every MoE
  layer, prompt and completion) exactly as transformers does with the pushed weights; without a key the push
  stops with a typed ``WeightSyncError`` (401).
- sidecar: a vLLM without rr's plugin behind ``rr-server proxy``. The plain engine URL (no ``/rr/info``) and the
  sidecar's URL stop with an error naming ``WeightEngine``; ``WeightEngine(engine_url, "vllm")`` pushes and the
  sidecar's routing then follows the pushed weights. Only layer 0 is compared there: without rr's plugin, vLLM
  0.30's CPU reload leaves the experts unpacked (rr_patches/vllm/reload_fix.py), so deeper layers see wrong
  expert outputs; layer 0's router reads embeddings and attention only.

The pushed model is the tiny Qwen3-MoE with its router weights negated, so routing must change. Both
servers are this module's own (their weights change) and start together, so their startups overlap.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from rr_client import GenerateResult, RoutedExpertsClient, WeightSyncError
from rr_client.integrations.weight_sync import DiskWeightSync, WeightEngine
from rr_client.trainer.router_reference import router_forward, router_topk
from rr_server.proxy.app import ProxyConfig
from tests.support.proxy_harness import SidecarServer
from tests.support.routing_asserts import assert_routing_sets_equal
from tests.support.vllm_process import VLLMProcess, all_launched

pytestmark = pytest.mark.vllm_server

KEY = "sync-key"
MOE_LAYERS = [0, 2]  # qwen3_dense: layer 1 is dense
PROMPT = [int(t) for t in np.random.default_rng(3).integers(2, 440, size=40)]
PARAMS = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
DEV = {"VLLM_SERVER_DEV_MODE": "1"}


@pytest.fixture(scope="module")
def engines(tiny_models: dict[str, Path]) -> Iterator[dict[str, VLLMProcess]]:
    """The keyed rr server and the plugin-free one, launched at once (one OpenMP core each), stopped at the end."""
    model = tiny_models["qwen3_dense"]
    servers = {
        "keyed": VLLMProcess(
            model, name="sync-keyed", extra=["--api-key", KEY], env={**DEV, "VLLM_CPU_OMP_THREADS_BIND": "0"}
        ),
        "bare": VLLMProcess(model, name="sync-bare", plugin=False, env={**DEV, "VLLM_CPU_OMP_THREADS_BIND": "1"}),
    }
    with all_launched(servers):
        yield servers


@pytest.fixture(scope="module")
def keyed_server(engines: dict[str, VLLMProcess]) -> VLLMProcess:
    return engines["keyed"].wait_healthy()


@pytest.fixture(scope="module")
def sidecar(engines: dict[str, VLLMProcess]) -> Iterator[tuple[SidecarServer, VLLMProcess]]:
    """rr's sidecar in front of the plugin-free engine; yields (sidecar, engine)."""
    bare = engines["bare"].wait_healthy()
    cfg = ProxyConfig(upstream=bare.base_url, engine="vllm", timeout=120, model_path=str(bare.model_dir))
    with SidecarServer(cfg) as sc:
        yield sc, bare


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RR_API_KEY", raising=False)


def new_router_weights(model_dir: Path) -> Any:
    """The checkpoint with every MoE router's weight negated: each token goes to its k least likely experts."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for i in MOE_LAYERS:
            model.model.layers[i].mlp.gate.weight.neg_()
    return model


def reference(model: Any, res: GenerateResult) -> np.ndarray:
    """Transformers' top-k ids for the rows the engine returned (prompt + completion - 1)."""
    tokens = list(res.prompt_ids or []) + list(res.output_ids)
    _, logits = router_forward(model, tokens, MOE_LAYERS)
    return router_topk(logits, model.config.num_hidden_layers, model.config.num_experts_per_tok)[:-1]


def generate(url: str, key: str | None = None) -> GenerateResult:
    """One greedy sample of PROMPT with its routing."""

    async def go() -> GenerateResult:
        async with RoutedExpertsClient(url, api_key=key, retries=0, timeout=120) as c:
            return (await c.generate([PROMPT], PARAMS))[0]

    res = asyncio.run(go())
    assert res.routed_experts is not None and res.prompt_ids == PROMPT
    return res


def changed_rows(a: GenerateResult, b: GenerateResult, layer: int) -> int:
    """Prompt rows whose top-k set at ``layer`` differs between two answers (same prompt)."""
    n = len(PROMPT) - 1
    sa, sb = np.sort(a.routed_experts[:n, layer], -1), np.sort(b.routed_experts[:n, layer], -1)  # type: ignore[index]
    return int((sa != sb).any(-1).sum())


def test_keyed_engine_push_with_api_key(
    keyed_server: VLLMProcess, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_models["qwen3_dense"], dtype=torch.float32).eval()
    before = generate(keyed_server.base_url, KEY)
    assert_routing_sets_equal(before.routed_experts, reference(base, before), layers=MOE_LAYERS)
    pushed = new_router_weights(tiny_models["qwen3_dense"])

    # no key (RR_API_KEY unset): /rr/info is guarded, so the plain URL stops there with a typed error
    with DiskWeightSync(keyed_server.base_url, tmp_path) as sync, pytest.raises(WeightSyncError) as err:
        sync.push(pushed, 1)
    assert "answered 401" in str(err.value) and "no API key was sent" in str(err.value)
    with (
        DiskWeightSync(keyed_server.base_url, tmp_path, api_key="not-the-key") as sync,
        pytest.raises(WeightSyncError) as err,
    ):
        sync.push(pushed, 1)
    assert "answered 401" in str(err.value) and "api_key argument was refused" in str(err.value)
    assert "not-the-key" not in str(err.value)

    with DiskWeightSync(keyed_server.base_url, tmp_path, api_key=KEY) as sync:
        seconds = sync.push(pushed, 1)
        assert sync.engine(keyed_server.base_url) == "vllm"
    after = generate(keyed_server.base_url, KEY)
    # the engine serves the pushed weights: every MoE layer routes as transformers does with them
    assert_routing_sets_equal(after.routed_experts, reference(pushed, after), layers=MOE_LAYERS)
    assert changed_rows(before, after, 0) > 0 and changed_rows(before, after, 2) > 0

    # named engine, no key: no /rr/info call; a server that guards the dev-mode routes answers 401 (typed error),
    # one that does not (rr before it guarded them) reloads. Either way it is never a silent failure.
    with DiskWeightSync(WeightEngine(keyed_server.base_url, "vllm"), tmp_path) as sync:
        try:
            sync.push(pushed, 2)
            guarded = False
        except WeightSyncError as e:
            # the first guarded route the push calls answers: the checksum baseline (/weight_checker) or the reload
            assert re.search(r"/(weight_checker|collective_rpc) answered 401", str(e)), str(e)
            assert "no API key was sent" in str(e), str(e)
            guarded = True
    print(f"\nunkeyed reload route guarded: {guarded}")
    print(
        f"keyed push: {seconds:.2f}s, prompt rows re-routed: layer 0 {changed_rows(before, after, 0)}, "
        f"layer 2 {changed_rows(before, after, 2)} of {len(PROMPT) - 1}"
    )


def test_sidecar_engine_push_with_weight_engine(
    sidecar: tuple[SidecarServer, VLLMProcess], tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    sc, bare = sidecar
    pushed = new_router_weights(tiny_models["qwen3_dense"])

    # the engine's plain URL: no /rr/info there (no rr plugin) -> the error says to name it
    with DiskWeightSync(bare.base_url, tmp_path) as sync, pytest.raises(WeightSyncError) as err:
        sync.push(pushed, 1)
    msg = str(err.value)
    assert "/rr/info is 404" in msg and "not an rr server" in msg and f"WeightEngine({bare.base_url!r}, 'vllm')" in msg
    # the sidecar's URL: it names the engine behind it
    with DiskWeightSync(sc.url, tmp_path) as sync, pytest.raises(WeightSyncError) as err:
        sync.push(pushed, 1)
    assert "rr's sidecar" in str(err.value) and f"WeightEngine({bare.base_url!r}, 'vllm')" in str(err.value), str(
        err.value
    )

    before = generate(sc.url)
    with DiskWeightSync(WeightEngine(bare.base_url, "vllm"), tmp_path) as sync:
        seconds = sync.push(pushed, 1)
    after = generate(sc.url)
    assert_routing_sets_equal(after.routed_experts, reference(pushed, after), layers=[0])
    assert changed_rows(before, after, 0) > 0
    ref = reference(pushed, after)
    same2 = (np.sort(after.routed_experts[:, 2], -1) == np.sort(ref[:, 2], -1)).all(-1).mean()  # type: ignore[index]
    print(
        f"\nsidecar push: {seconds:.2f}s, layer 0 re-routed {changed_rows(before, after, 0)} of {len(PROMPT) - 1} "
        f"prompt rows; layer 2 agreement with the pushed weights (unpatched CPU reload) {same2:.3f}"
    )
