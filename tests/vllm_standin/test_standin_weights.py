"""rr against vLLM 0.32/0.33's own weight checks, on vLLM's real API server with the stand-in executor (issue 44).

* **The weight checker.** The two session servers (the same tiny MoE) are two replicas in dev mode; rr's
  :class:`DiskWeightSync` pushes to both through vLLM's real ``/collective_rpc`` and ``/reset_prefix_cache``, then
  reads vLLM's real ``POST /weight_checker`` (``vllm/entrypoints/rl/online/api_router.py``), whose worker RPC runs
  vLLM's own ``compute_tensor_digests`` on the stand-in's model (:mod:`tests.vllm_standin.standin_executor`; only
  the GPU worker is stood in). A matching push passes, and the engines hold exactly what was pushed (vLLM's digests
  of the trainer's model). Loader faults planted in one engine's next reload (``standin_plant``: a tensor perturbed,
  a tensor kept, nothing loaded) fail the push with :class:`WeightSyncError` naming the engine, tensor and ranks.
* **Weight-version spans.** A sample whose output tokens vLLM labelled with two weight versions (the label changed
  inside the engine core, where rr's API server sees nothing) gets ``weight_update_during`` in its ``rr_provenance``
  on ``/generate`` (streamed) and ``/v1/completions``; the next sample, at one version, does not.
* vLLM 0.31 has neither (both came in 0.32; 0.33 adds only the HTTP ``return_weight_versions`` field): the push
  works and says so once.

The servers' weights are put back to the session's checkpoint at the end (later tests compare routing with it).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from rr_client.core.errors import WeightSyncError
from rr_client.integrations._weight_check import split_key
from rr_client.integrations.weight_sync import DiskWeightSync

needs_checker = pytest.mark.vllm_weight_checker(True)  # deselected on 0.31 (conftest), never skipped
GATE0, GATE2 = "model.layers.0.mlp.gate.weight", "model.layers.2.mlp.gate.weight"


def rpc(server: Any, method: str, *args: str, **kwargs: str) -> Any:
    """vLLM's dev-mode ``/collective_rpc`` (string arguments only, as its route takes them)."""
    r = httpx.post(
        server.base_url + "/collective_rpc", json={"method": method, "args": list(args), "kwargs": kwargs}, timeout=120
    )
    assert r.status_code == 200, r.text
    return r.json() if r.content else None


def checker(server: Any) -> dict[str, str]:
    """vLLM's own ``/weight_checker`` checksums of ``server``."""
    r = httpx.post(server.base_url + "/weight_checker", json={"action": "checksum"}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["checksums"]


@pytest.fixture(scope="module")
def replicas(server: Any, server_off: Any, tiny_moe: Path) -> Iterator[list[Any]]:
    """Both session servers as replicas of one model; afterwards their weights are the session checkpoint again."""
    yield [server, server_off]
    for s in (server, server_off):
        rpc(s, "standin_step_delay", "0")
        rpc(s, "reload_weights", weights_path=str(tiny_moe))
        assert httpx.post(s.base_url + "/reset_prefix_cache", timeout=60).status_code == 200


@pytest.fixture
def trainer(tiny_moe: Path) -> Any:
    """The trainer's copy of the tiny MoE (float32, as the stand-in holds it)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32).eval()


def nudge(model: Any, seed: int) -> None:
    """A training step: every parameter moves a little."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-2)


def digests(model: Any) -> dict[str, str]:
    """vLLM's own per-parameter digests of ``model`` (what its checker computes on the engine's copy)."""
    from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

    return compute_tensor_digests(model)


@needs_checker
def test_matching_push_passes_and_the_engines_hold_what_was_pushed(
    replicas: list[Any], trainer: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="rr.weight_sync")
    urls = [s.base_url for s in replicas]
    with DiskWeightSync(urls, tmp_path) as sync:
        for step in (1, 2):
            nudge(trainer, step)
            sync.push(trainer, step)
            want = digests(trainer)
            for s in replicas:
                got = checker(s)
                assert {split_key(k) for k in got} == {("dp0:pp0:pcp0:tp0", n) for n in want}
                assert {split_key(k)[1]: v for k, v in got.items()} == want
            assert sorted(sync._checksums) == sorted(urls)  # both were read and compared
    said = [r.getMessage() for r in caplog.records if r.name == "rr.weight_sync" and r.levelno >= logging.WARNING]
    assert said == []  # nothing unverified


@needs_checker
def test_a_replica_that_loaded_other_weights_is_named(replicas: list[Any], trainer: Any, tmp_path: Path) -> None:
    """One replica's reload perturbs one tensor: the replicas disagree there (the trainer changed it, and it moved
    on both, so only the comparison across replicas sees it)."""
    on, off = replicas
    with DiskWeightSync([on.base_url, off.base_url], tmp_path) as sync:
        nudge(trainer, 3)
        sync.push(trainer, 1)
        rpc(off, "standin_plant", "perturb", GATE0)
        nudge(trainer, 4)
        with pytest.raises(WeightSyncError) as err:
            sync.push(trainer, 2)
        sync.push(trainer, 3)  # a clean reload agrees again
    msg = str(err.value)
    assert "replicas' own weight checksums disagree" in msg and f"{off.base_url} differs in 1 tensor shard" in msg
    assert f"{GATE0} (dp0:pp0:pcp0:tp0)" in msg
    assert err.value.tensors == (GATE0,) and err.value.ranks == ("dp0:pp0:pcp0:tp0",)
    assert off.base_url in err.value.engine


@needs_checker
def test_one_engine_that_kept_a_tensor_is_named(replicas: list[Any], trainer: Any, tmp_path: Path) -> None:
    """A single engine (nothing to compare it with) whose reload skips one tensor the trainer changed."""
    on = replicas[0]
    with DiskWeightSync(on.base_url, tmp_path) as sync:
        nudge(trainer, 5)
        sync.push(trainer, 1)
        rpc(on, "standin_plant", "keep", GATE2)
        nudge(trainer, 6)
        with pytest.raises(WeightSyncError) as err:
            sync.push(trainer, 2)
    assert f"{on.base_url} did not load 1 tensor(s) the trainer changed" in str(err.value)
    assert f"{GATE2} (dp0:pp0:pcp0:tp0)" in str(err.value)
    assert (err.value.engine, err.value.tensors, err.value.ranks) == (on.base_url, (GATE2,), ("dp0:pp0:pcp0:tp0",))


@needs_checker
def test_a_reload_that_loaded_nothing_fails_the_push(replicas: list[Any], trainer: Any, tmp_path: Path) -> None:
    """The reload answers 200 and changes nothing: every digest kept although the trainer changed every tensor."""
    on = replicas[0]
    with DiskWeightSync(on.base_url, tmp_path) as sync:
        nudge(trainer, 7)
        sync.push(trainer, 1)
        rpc(on, "standin_plant", "noop")
        nudge(trainer, 8)
        with pytest.raises(WeightSyncError, match=r"kept every one of its \d+ weight checksums since the last push"):
            sync.push(trainer, 2)


@needs_checker
def test_an_engine_that_altered_an_unchanged_tensor_is_named(replicas: list[Any], trainer: Any, tmp_path: Path) -> None:
    """The trainer pushes the same weights again; the engine's reload perturbs one tensor."""
    on = replicas[0]
    with DiskWeightSync(on.base_url, tmp_path) as sync:
        nudge(trainer, 9)
        sync.push(trainer, 1)
        rpc(on, "standin_plant", "perturb", GATE2)
        with pytest.raises(
            WeightSyncError, match=rf"changed 1 tensor\(s\) the trainer pushed byte-identical .*{GATE2}"
        ):
            sync.push(trainer, 2)


@pytest.mark.vllm_weight_checker(False)
def test_vllm_without_a_checker_is_said_once_and_skipped(
    replicas: list[Any], trainer: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM 0.31 serves no ``/weight_checker``: the push works, each engine said once."""
    caplog.set_level(logging.INFO, logger="rr.weight_sync")
    with DiskWeightSync([s.base_url for s in replicas], tmp_path) as sync:
        for step in (1, 2):
            nudge(trainer, step)
            sync.push(trainer, step)
    said = [r.getMessage() for r in caplog.records if r.name == "rr.weight_sync" and r.levelno >= logging.WARNING]
    assert len(said) == 2 and all("serves no /weight_checker" in m and "not verified" in m for m in said)


def in_engine(server: Any, n: int) -> None:
    """Wait (bounded) until ``server`` holds ``n`` requests in its engine (``/rr/info`` requests_in_engine)."""
    for _ in range(600):
        if (httpx.get(server.base_url + "/rr/info", timeout=30).json().get("requests_in_engine") or 0) >= n:
            return
        time.sleep(0.02)
    raise AssertionError(f"{n} requests never reached {server.base_url}'s engine")


def _stream_generate(server: Any, prompt: list[int], n: int, on_tokens: tuple[int, Any]) -> dict[str, Any]:
    """rr's streamed ``/generate``; ``on_tokens = (k, fn)``: ``fn()`` once the stream has shown ``k`` tokens.
    Returns the final chunk."""
    k, fn = on_tokens
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": n, "ignore_eos": True}, "stream": True}
    last: dict[str, Any] = {}
    with httpx.stream("POST", server.base_url + "/generate", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            last = json.loads(line[len("data: ") :])
            if fn is not None and len(last["output_ids"]) >= k:
                fn()
                fn = None
    return last


@needs_checker
def test_a_sample_spanning_two_vllm_weight_versions_gets_weight_update_during(replicas: list[Any]) -> None:
    on = replicas[0]
    before = httpx.get(on.base_url + "/rr/info", timeout=30).json()["weight_version"]
    completions: dict[str, Any] = {}

    def v1() -> None:
        body = {"model": str(on.model_dir), "prompt": [21, 22, 23, 24], "max_tokens": 24, "ignore_eos": True}
        r = httpx.post(on.base_url + "/v1/completions", json={**body, "return_routed_experts": True}, timeout=120)
        completions["answer"] = r

    rpc(on, "standin_step_delay", "0.08")  # ~2 s per sample: the label changes while both run
    try:
        other = threading.Thread(target=v1)
        other.start()
        in_engine(on, 1)
        last = _stream_generate(on, [31, 32, 33, 34, 35], 24, (3, lambda: rpc(on, "standin_relabel", "rl-step-7")))
        other.join(timeout=120)
        after = _stream_generate(on, [41, 42, 43], 4, (0, None))  # entirely at the new label
    finally:
        rpc(on, "standin_step_delay", "0")
    prov = last["meta_info"]["rr_provenance"]
    assert prov["weight_update_during"] is True
    assert prov["weight_version_admitted"] == prov["weight_version_finished"] == before  # rr's own count saw nothing
    r = completions["answer"]
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["rr_provenance"]["weight_update_during"] is True
    assert after["meta_info"]["rr_provenance"]["weight_update_during"] is False
    assert httpx.get(on.base_url + "/weight_info", timeout=30).json() == {"weight_version": "rl-step-7"}
