"""results -> layout -> replay_routing -> loss, offline: a tiny model plays the engine (per-sample forwards)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rr_client import GenerateBatch
from rr_client.trainer.metrics import r3_metrics, routing_agreement, token_logprobs
from rr_client.trainer.replay import record_routing, replay_routing
from tests.support.routing_data import dims_info

from .helpers import engine_result
from .tiny_models import EXPERTS, LAYERS, TOPK, VOCAB, moe_layers, tiny_model


def engine_batch(model: torch.nn.Module) -> tuple[GenerateBatch, list[torch.Tensor]]:
    """Samples whose routing and log-probs come from per-sample forwards, as an engine would return them."""
    g = torch.Generator().manual_seed(7)
    info = dims_info(LAYERS, EXPERTS, TOPK, moe_layers("qwen3_moe"))
    results, logps = [], []
    for i, (lp, lo) in enumerate([(3, 5), (6, 2), (2, 4)]):
        tokens = torch.randint(1, VOCAB, (1, lp + lo), generator=g)
        with torch.no_grad(), record_routing(model) as rec:
            logps.append(token_logprobs(model(tokens).logits, tokens)[0])
        rows = rec.routed_experts[0, :-1].numpy().astype(np.uint8)
        ids = tokens[0].tolist()
        results.append(engine_result(i, ids[:lp], ids[lp:], rows))
    return GenerateBatch(results=results, info=info), logps


@pytest.mark.parametrize("pad_side", ["right", "split"])
def test_results_layout_replay_loss(pad_side: str) -> None:
    model = tiny_model("qwen3_moe")
    batch, logps = engine_batch(model)
    kw = dict(prompt_length=6, response_length=5) if pad_side == "split" else {}
    t = batch.to_tensors(pad_side=pad_side, **kw)  # type: ignore[arg-type]
    lp_rollout = torch.zeros(t.input_ids.shape)
    for b, lp in enumerate(logps):
        lp_rollout[b, t.attention_mask[b].bool()] = lp
    pos = t.position_ids if pad_side == "split" else None
    model.train()
    with replay_routing(model, t):
        logits = model(t.input_ids, attention_mask=t.attention_mask, position_ids=pos).logits
        lp_train = token_logprobs(logits, t.input_ids)
        loss = -(lp_train * t.response_mask).sum() / t.response_mask.sum()
        loss.backward()
    model.eval()
    router_grads = [p.grad for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]
    assert router_grads and all(gr is not None and gr.abs().sum() > 0 for gr in router_grads)
    m = r3_metrics(lp_train.detach(), lp_rollout, t.response_mask)
    assert m.mean_abs_diff < 1e-4 and m.frac_gt_ln2 == 0.0
    with torch.no_grad(), record_routing(model) as rec:
        model(t.input_ids, attention_mask=t.attention_mask, position_ids=pos)
    rows = t.routed_experts_mask & t.response_mask.bool()
    assert routing_agreement(rec.routed_experts, t.routed_experts, rows, layers=batch.info.moe_layers) == 1.0
