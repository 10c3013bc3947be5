"""A tiny DeepSeek-V3.2 checkpoint (DSA: a lightning indexer in every layer, top-4 positions; MoE top-2 of 8) for
SGLang 0.5.23's real code, and what SGLang's two capturers hold for it: the routers' top-k and the indexers' picks
from one transformers forward (SGLang's indexer rows: int32 ``(tokens, indexer layers, index_topk)`` from token 0,
``-1`` where a token reads fewer than ``index_topk`` positions, as its DSA kernels pad them)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from tests.support.tiny_checkpoints import copy_tokenizer, load_eager, model_type

INDEX_TOPK = 4


def build_tiny_deepseek_v32(out: Path, tokenizer_from: Path) -> Path:
    """Build (or reuse) the checkpoint in ``out`` with the tokenizer files of ``tokenizer_from``."""
    done = out / "rr_tiny_dsv32.json"
    if done.exists():
        return out
    from tests.trainer.tiny_families import tiny_family_model

    out.mkdir(parents=True, exist_ok=True)
    model = tiny_family_model("deepseek_v32", vocab_size=512, index_topk=INDEX_TOPK, index_n_heads=2, index_head_dim=16)
    model.save_pretrained(out)
    copy_tokenizer(tokenizer_from, out)
    done.write_text("{}")
    return out


def is_deepseek_v32(model_dir: Path) -> bool:
    return model_type(model_dir) == "deepseek_v32"


load = load_eager  #: the model as the stand-in's forward runs it


_ROWS: dict[tuple[str, tuple[int, ...]], tuple[np.ndarray, np.ndarray]] = {}


def forward_rows(model_dir: Path, token_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """``(routing, indexer)`` for ``token_ids``: the routers' top-k ``(tokens, layers, topk)`` and the indexers' picks
    ``(tokens, indexer layers, index_topk)`` int32, ``-1`` for the positions a token before ``index_topk`` lacks.
    One forward per sequence (the stand-in asks for both capturers' rows); copies, which a test may edit."""
    key = (str(model_dir), tuple(int(t) for t in token_ids))
    if key not in _ROWS:
        _ROWS[key] = _forward(model_dir, key[1])
    routing, idx = _ROWS[key]
    return routing.copy(), idx.copy()


def _forward(model_dir: Path, token_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """One transformers forward of ``token_ids``: :func:`forward_rows`'s two arrays."""
    from rr_client.trainer.replay import find_indexers, record_routing

    model = load(model_dir)
    picks: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _a, o: picks.append(o[0])) for _, m in find_indexers(model)]
    try:
        with torch.no_grad(), record_routing(model) as rec:
            model(input_ids=torch.tensor([list(token_ids)]))
    finally:
        for h in hooks:
            h.remove()
    idx = torch.stack(picks, 1).numpy().astype(np.int32)  # [T, L, K]
    for t in range(min(INDEX_TOPK - 1, idx.shape[0])):  # reads t + 1 < index_topk positions: the rest is padding
        idx[t, :, t + 1 :] = -1
        idx[t, :, : t + 1] = np.arange(t + 1)
    return rec.routed_experts[0].numpy(), idx
