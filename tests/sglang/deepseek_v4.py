"""A tiny DeepSeek-V4-shaped checkpoint (layer 0 hash-routed, layers 1-2 learned top-2 of 8) for SGLang 0.5.23's
real code, and the rows SGLang's capture buffer holds for it: the learned routers' top-k from a transformers
forward, all zero in the hash layer (SGLang's ``HashTopK`` never writes the buffer, sglang#29040).

The checkpoint is transformers 5.23's ``DeepseekV4`` written in the hub's raw form: ``num_hash_layers`` instead of
``mlp_layer_types``, plus the fields SGLang 0.5.23's ``ModelConfig`` reads (``compress_ratios``, ``index_*``), which
transformers folds in on load.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from tests.support.tiny_checkpoints import copy_tokenizer, load_eager, model_type


def build_tiny_deepseek_v4(out: Path, tokenizer_from: Path) -> Path:
    """Build (or reuse) the checkpoint in ``out`` with the tokenizer files of ``tokenizer_from``."""
    done = out / "rr_tiny_dsv4.json"
    if done.exists():
        return out
    from tests.trainer.tiny_families import tiny_family_model

    out.mkdir(parents=True, exist_ok=True)
    tiny_family_model("deepseek_v4", vocab_size=512).save_pretrained(out)  # the stand-in samples ids < 300
    copy_tokenizer(tokenizer_from, out)
    cfg = json.loads((out / "config.json").read_text())
    assert (
        cfg.pop("mlp_layer_types")[0] == "hash_moe"
    )  # the hub's raw form says it as num_hash_layers (vLLM reads that)
    cfg.update(
        compress_ratios=[0] * cfg["num_hidden_layers"],
        index_head_dim=16,
        index_n_heads=2,
        index_topk=8,
        num_hash_layers=1,
    )
    cfg.setdefault("head_dim", 16)
    cfg.setdefault("qk_rope_head_dim", 8)
    cfg.setdefault("sliding_window", 8)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    done.write_text("{}")
    return out


def is_deepseek_v4(model_dir: Path) -> bool:
    return model_type(model_dir) == "deepseek_v4"


load = load_eager  #: the model as the stand-in's forward runs it


def capture_buffer_rows(model_dir: Path, token_ids: Sequence[int]) -> np.ndarray:
    """``(tokens, layers, topk)``: the learned routers' own top-k; zero in hash-routed layers (never written)."""
    from rr_client.trainer.replay import record_routing

    model = load(model_dir)
    with torch.no_grad(), record_routing(model) as rec:
        model(input_ids=torch.tensor([list(token_ids)]))
    return rec.routed_experts[0].numpy()
