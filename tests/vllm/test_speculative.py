"""Speculative decoding on the real vLLM 0.30 CPU server: routing is the target model's on every token and MoE
layer, with n-gram drafts (3 tokens, accepted and rejected) and with an MTP draft layer that has its own MoE
router (GLM-4.5-style checkpoint, tests/vllm/tiny_mtp.py): the draft-pollution case (vllm#48622).

vLLM 0.30 is past the draft-pollution fix (vllm#48622), so ``rr-server launch vllm`` passes
``--speculative-config`` through. Stock vLLM 0.30 CPU cannot verify a draft (its CPU runner leaves the
rejection sampler's dispatchers on the Triton kernels, which have no CPU backend here);
``cpu_spec_decode_fix/`` (named in conftest) points the greedy one at vLLM's own C++ CPU kernel. The n-gram
proposer, the scheduler's spec-decode bookkeeping, the verify forward, rejection sampling and rr's capture are
all vLLM's and rr's own code. Greedy requests only: vLLM 0.30's CPU kernels for sampled verification do not
match their dispatchers (``_expand_kernel_impl() missing ... 'input_val'``), so a sampled request with drafts
kills the engine on this CPU build.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest

from rr_client.core.codec import decode_meta_info
from rr_server.cli import main as cli
from rr_server.doctor.truth import LayerAgreement, RouterReference
from tests.vllm.test_vllm_e2e import _sse, check_item, no_routing, tokenize

pytestmark = pytest.mark.vllm_server

# Repetitive prompts: the n-gram proposer finds matches in them, so drafts are proposed from the first step.
PROMPTS = [
    "a b c d a b c d a b c d a b c d a b c d",
    "one two three one two three one two three one two",
    "x = x + 1; x = x + 1; x = x + 1; x = x + 1;",
]
_METRIC = re.compile(r"^vllm:spec_decode_num_(draft_tokens|accepted_tokens)_total\{[^}]*\} ([0-9.e+]+)$", re.M)


def spec_counts(server: Any) -> dict[str, float]:
    """vLLM's own spec-decode counters: draft tokens proposed and accepted so far."""
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    return {m.group(1): float(m.group(2)) for m in _METRIC.finditer(text)}


class DraftsSeen:
    """Counter deltas over a block: the routing below is only proof if drafts were accepted and rejected."""

    def __init__(self, server: Any) -> None:
        self.server = server

    def __enter__(self) -> DraftsSeen:
        self.before = spec_counts(self.server)
        return self

    def __exit__(self, *exc: object) -> None:
        after = spec_counts(self.server)
        self.drafted = after["draft_tokens"] - self.before["draft_tokens"]
        self.accepted = after["accepted_tokens"] - self.before["accepted_tokens"]

    def assert_accepted_and_rejected(self) -> None:
        assert self.accepted > 0, f"no draft token was accepted ({self.drafted} drafted): nothing was verified"
        assert self.drafted > self.accepted, f"every one of {self.drafted} drafts was accepted: no rejection tested"


def greedy(server: Any, input_ids: Any, n: int, **fields: Any) -> Any:
    """``/generate`` of ``input_ids`` (one prompt or a batch), ``n`` greedy tokens (no EOS stop), with routing: the
    answer's JSON, checked 200."""
    body = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
        "return_routed_experts": True,
        **fields,
    }
    r = httpx.post(server.base_url + "/generate", timeout=300, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_rr_info_states_speculative_method(ngram_server: Any) -> None:
    info = httpx.get(ngram_server.base_url + "/rr/info", timeout=30).json()
    assert info["speculative"] == "ngram" and info["routing_enabled"] and info["engine_version"] == "0.30.0"


def test_batch_routing_equals_transformers_with_drafts(ngram_server: Any) -> None:
    prompts = [tokenize(ngram_server.model_dir, p) for p in PROMPTS]
    with DraftsSeen(ngram_server) as seen:
        items = greedy(ngram_server, prompts, 40)
    assert len(items) == len(prompts)
    for ids, item in zip(prompts, items):
        assert len(item["output_ids"]) == 40
        check_item(ngram_server, item, ids)  # every row and MoE layer = transformers' top-k on the final tokens
    seen.assert_accepted_and_rejected()


def test_streaming_routing_with_drafts(ngram_server: Any) -> None:
    """A step can emit several tokens at once; the final chunk's rows still cover every token exactly once."""
    ids = tokenize(ngram_server.model_dir, PROMPTS[0])
    with DraftsSeen(ngram_server) as seen:
        chunks = _sse(
            ngram_server,
            {
                "input_ids": ids,
                "stream": True,
                "return_routed_experts": True,
                "sampling_params": {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True},
            },
        )
    for c in chunks[:-1]:
        no_routing(c)
    lens = [len(c["output_ids"]) for c in chunks]
    assert lens[-1] == 32 and len(chunks) < 32, f"accepted drafts emit several tokens per chunk: {lens}"
    check_item(ngram_server, chunks[-1], ids)
    seen.assert_accepted_and_rejected()


def test_routed_experts_start_with_drafts(ngram_server: Any) -> None:
    ids = tokenize(ngram_server.model_dir, PROMPTS[1])
    start = len(ids) - 2
    check_item(ngram_server, greedy(ngram_server, ids, 24, routed_experts_start=start), ids, start=start)


def test_doctor_ground_truth_runs_with_the_deployments_drafts(
    ngram_server: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    with DraftsSeen(ngram_server) as seen:
        rc = cli(["doctor", ngram_server.base_url, "--model-path", str(ngram_server.model_dir), "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0 and rep["verdict"] == "PASS", [c for c in rep["checks"] if not c["ok"]]
    (identity,) = [c for c in rep["checks"] if c["name"] == "identity"]
    assert "speculative decoding ngram (ground truth below runs with it)" in identity["detail"]
    assert rep["ground_truth"]["agreement"] == 1.0 and rep["ground_truth"]["compared"] > 100
    assert not any("draft" in b["what"] for b in rep["known_bugs"]), "vLLM 0.30 is past the draft-pollution fix"
    assert seen.accepted > 0, "the doctor's requests were verified from drafts"


# ------------------------------------------------------------------------------------------- MTP


def assert_target_routing(server: Any, item: dict[str, Any], prompt_ids: list[int]) -> None:
    """Every row and MoE layer equals the target routers' own selection (the doctor's ground truth)."""
    info = httpx.get(server.base_url + "/rr/info", timeout=30).json()
    layers, moe, topk = info["num_hidden_layers"], info["moe_layers"], info["topk"]
    tokens = prompt_ids + list(item["output_ids"])
    got = decode_meta_info(
        item["meta_info"],
        rows=len(tokens) - 1,
        num_layers=layers,
        topk=topk,
        num_experts=info["num_experts"],
        moe_layers=moe,
    )
    assert not got[:, [i for i in range(layers) if i not in moe]].any(), "dense layers must be all-zero rows"
    agg: dict[int, LayerAgreement] = {}
    _reference(str(server.model_dir)).compare(got, tokens, 0, moe, agg)
    assert {layer: a.share for layer, a in agg.items()} == {layer: 1.0 for layer in moe}, {
        layer: a.first_diff for layer, a in agg.items()
    }


_REFS: dict[str, RouterReference] = {}


def _reference(path: str) -> RouterReference:
    if path not in _REFS:
        _REFS[path] = RouterReference(path)
    return _REFS[path]


def test_mtp_rr_info_counts_only_the_target_layers(mtp_server: Any) -> None:
    info = httpx.get(mtp_server.base_url + "/rr/info", timeout=30).json()
    assert info["speculative"] == "mtp"
    assert info["num_hidden_layers"] == 3 and info["moe_layers"] == [1, 2], "the MTP layer (3) is no target layer"


def test_mtp_draft_layer_leaves_the_target_rows(mtp_server: Any) -> None:
    prompts = [tokenize(mtp_server.model_dir, p) for p in [*PROMPTS, "Hello world, this is a tiny test."]]
    with DraftsSeen(mtp_server) as seen:
        items = greedy(mtp_server, prompts, 30)
    for ids, item in zip(prompts, items, strict=True):
        assert len(item["output_ids"]) == 30
        assert_target_routing(mtp_server, item, ids)
    assert seen.drafted >= 4 * 29, f"the MTP layer (and its MoE router) drafted only {seen.drafted} tokens"


def test_mtp_streaming(mtp_server: Any) -> None:
    ids = tokenize(mtp_server.model_dir, PROMPTS[2])
    chunks = _sse(
        mtp_server,
        {
            "input_ids": ids,
            "stream": True,
            "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True},
        },
    )
    assert len(chunks[-1]["output_ids"]) == 20
    assert_target_routing(mtp_server, chunks[-1], ids)
