"""DeepSeek-V4's hash-routed MoE layers through rr-patched SGLang 0.5.23 (real TokenizerManager, detokenizer, HTTP
layer; the stand-in scheduler fills the capture buffer as SGLang's ``HashTopK`` layers do: not at all).

``/rr/info`` states the hash layer in ``uncaptured_layers``; the full check accepts its all-zero rows exactly there
and still refuses an all-zero row in a captured layer; ``replay_routing`` on the tiny DeepSeek-V4 model leaves the
hash layer to the model and replays the rest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rr_client import RRInfo
from rr_client.core.codec import decode_meta_info
from rr_client.trainer.replay import replay_routing
from tests.sglang.conftest import CACHE
from tests.sglang.deepseek_v4 import build_tiny_deepseek_v4, capture_buffer_rows, load
from tests.sglang.harness import Harness

pytestmark = [pytest.mark.sglang, pytest.mark.sglang_releases("0.5.23")]  # the first SGLang that serves V4
PROMPT = [3, 17, 29, 41, 53, 60, 11]


@pytest.fixture(scope="module")
def dsv4(tiny_moe: Path) -> Path:
    return build_tiny_deepseek_v4(CACHE / "sglang-deepseek-v4", tokenizer_from=tiny_moe)


async def _generate(h: Harness) -> dict[str, Any]:
    status, body = await h.post(
        {
            "input_ids": PROMPT,
            "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
        }
    )
    assert status == 200, body
    return body["meta_info"]  # type: ignore[no-any-return]


async def test_hash_layers_are_marked_checked_and_left_to_the_model(dsv4: Path, patched: None) -> None:
    h = Harness(dsv4, skip_tokenizer_init=True)
    async with h.client() as c:
        info = RRInfo.model_validate((await c.get("/rr/info")).json())
    assert info.moe_layers == [1, 2] and list(info.uncaptured_layers) == [0]
    assert "hash-routed" in info.uncaptured_layers[0]
    meta = await _generate(h)
    assert "routed_experts_error" not in meta
    r = h.sched.reqs[meta["id"]]
    tokens = r.prompt + r.completion
    rows = decode_meta_info(
        meta,
        rows=len(tokens) - 1,
        num_layers=info.num_hidden_layers,
        topk=info.topk,
        num_experts=info.num_experts,
        moe_layers=info.moe_layers,
    )
    np.testing.assert_array_equal(rows, capture_buffer_rows(dsv4, tokens[:-1]))
    assert not rows[:, 0].any() and rows[:, 1:].all(axis=-1).any()  # zero hash layer, routed layers recorded
    # the trainer: replay the checked rows on transformers' DeepSeek-V4; the hash layer stays the model's own
    model = load(dsv4)
    x = torch.tensor([tokens[:-1]])
    other = torch.from_numpy(rows.astype(np.int64))[None].clone()
    other[..., 1:, :] = (other[..., 1:, :] + 3) % info.num_experts  # rows the model would not choose
    with torch.no_grad(), replay_routing(model, other, audit=True) as rep:
        model(input_ids=x)
    assert rep["r3/left_layers_hash"] == 1 and rep["r3/layer0/left_rows_hash"] == x.shape[1]
    assert rep["r3/applied_share"] == 1.0 and rep["r3/replayed_rows"] == 2 * x.shape[1]
    assert "r3/layer0/replayed_rows" not in rep


async def test_an_all_zero_row_in_a_captured_layer_is_still_refused(dsv4: Path, patched: None) -> None:
    h = Harness(dsv4, skip_tokenizer_init=True)
    h.sched.zero_rows = (2, 1)  # token 2, layer 1: a learned MoE layer whose row was lost
    meta = await _generate(h)
    assert meta["routed_experts"] is None
    assert (
        meta["routed_experts_error"].startswith("UnrecordedRoutingError")
        and "row 2 layer 1" in meta["routed_experts_error"]
    )
