"""A tiny GLM-4.5-style MoE checkpoint with one MTP (next-token prediction) layer, for vLLM's ``mtp`` drafts.

Layers 0-2 are transformers' own ``Glm4MoeForCausalLM`` (layer 0 dense; sigmoid + correction-bias grouped top-2
of 8 in layers 1-2). Layer 3 is the MTP block vLLM's ``Glm4MoeMTP`` loads from ``model.layers.3.*``: a full
decoder layer with its own MoE router, plus ``eh_proj``/``enorm``/``hnorm``/``shared_head`` (random here, so
its drafts are rejected, while its MoE layer runs on every step). transformers ignores layer 3, so the
reference routing is the three target layers' alone: a draft layer writing the target's rows shows up as a
difference.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.support.tiny_checkpoints import copy_tokenizer

MTP_CONFIG = {"method": "mtp", "num_speculative_tokens": 1}


def build_tiny_glm4_mtp(out: Path, tokenizer_from: Path) -> Path:
    """Build (or reuse) the checkpoint in ``out`` with the tokenizer files of ``tokenizer_from``."""
    done = out / "rr_tiny_glm4_mtp.json"
    if done.exists():
        return out
    import torch
    from safetensors.torch import load_file, save_file

    from tests.trainer.tiny_families import tiny_family_model

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    # head_dim 32: vLLM's CPU attention has no kernel for 16
    tiny_family_model(
        "glm4_moe",
        vocab_size=512,
        num_hidden_layers=4,
        max_position_embeddings=1024,
        hidden_size=64,
        head_dim=32,
        num_attention_heads=2,
        num_key_value_heads=2,
    ).save_pretrained(out)
    copy_tokenizer(tokenizer_from, out)
    cfg = json.loads((out / "config.json").read_text())
    hidden = cfg["hidden_size"]
    cfg.update(num_hidden_layers=3, num_nextn_predict_layers=1, head_dim=32, partial_rotary_factor=0.5)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    g = torch.Generator().manual_seed(11)
    save_file(
        {
            "model.layers.3.eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=g) * 0.1,
            "model.layers.3.enorm.weight": torch.ones(hidden),
            "model.layers.3.hnorm.weight": torch.ones(hidden),
            "model.layers.3.shared_head.norm.weight": torch.ones(hidden),
        },
        str(out / "mtp.safetensors"),
        metadata={"format": "pt"},
    )
    weight_map = {name: f.name for f in sorted(out.glob("*.safetensors")) for name in load_file(str(f))}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    done.write_text("{}")
    return out
