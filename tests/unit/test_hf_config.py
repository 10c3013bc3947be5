"""MoE layer indices and routing dims from the HF config conventions trainers meet, and RRInfo checks."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rr_client import RRInfo, moe_layers_from_config, routing_dims_from_config


def test_deepseek_first_k_dense_replace() -> None:
    cfg = {
        "num_hidden_layers": 6,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
    }
    assert moe_layers_from_config(cfg) == [3, 4, 5]
    assert routing_dims_from_config(cfg) == (6, 256, 8)


def test_qwen_sparse_step_and_mlp_only_layers() -> None:
    cfg = {
        "num_hidden_layers": 6,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
    }
    assert moe_layers_from_config(cfg) == [1, 5]
    assert moe_layers_from_config(
        {"num_hidden_layers": 3, "num_experts": 8, "num_experts_per_tok": 2, "mlp_only_layers": [0]}
    ) == [1, 2]


def test_mixtral_all_layers_and_text_config() -> None:
    mixtral = {"num_hidden_layers": 4, "num_local_experts": 8, "num_experts_per_tok": 2}
    assert moe_layers_from_config(mixtral) == [0, 1, 2, 3]
    assert routing_dims_from_config({"text_config": mixtral, "model_type": "vl"}) == (4, 8, 2)


def test_missing_fields_named() -> None:
    with pytest.raises(KeyError, match="expert count"):
        routing_dims_from_config({"num_hidden_layers": 4, "num_experts_per_tok": 2})


def test_rrinfo_validation() -> None:
    ok = dict(
        engine="vllm",
        engine_version="0.30.0",
        rr_version="0.1.0",
        num_hidden_layers=2,
        num_experts=300,
        topk=2,
        moe_layers=[0, 1],
        wire_dtype="uint16",
    )
    assert RRInfo(**ok).wire_format == "npy-b64"
    with pytest.raises(ValidationError, match="needs uint16"):
        RRInfo(**{**ok, "wire_dtype": "uint8"})
    with pytest.raises(ValidationError, match="outside"):
        RRInfo(**{**ok, "moe_layers": [2]})
    with pytest.raises(ValidationError, match="topk"):
        RRInfo(**{**ok, "num_experts": 1, "wire_dtype": "uint8"})


def test_rrinfo_from_hf_config_is_the_dims_builder() -> None:
    """One builder for every producer: dims, MoE layers and wire dtype from the config, engine facts, extras."""
    from rr_client import __version__

    cfg = {
        "text_config": {
            "num_hidden_layers": 6,
            "n_routed_experts": 300,
            "num_experts_per_tok": 8,
            "first_k_dense_replace": 2,
        },
        "model_type": "vl",
    }
    info = RRInfo.from_hf_config(cfg, engine="vllm", engine_version="0.30.0", model="m", sidecar=True)
    assert (info.num_hidden_layers, info.num_experts, info.topk) == routing_dims_from_config(cfg) == (6, 300, 8)
    assert info.moe_layers == moe_layers_from_config(cfg) == [2, 3, 4, 5]
    assert info.wire_dtype == "uint16" and info.wire_format == "npy-b64"
    assert (info.engine, info.engine_version, info.model, info.rr_version) == ("vllm", "0.30.0", "m", __version__)
    assert info.model_dump()["sidecar"] is True
    assert RRInfo.model_validate(info.model_dump()) == info  # what /rr/info sends is what clients rebuild
    with pytest.raises(KeyError, match="top-k"):
        RRInfo.from_hf_config({"num_hidden_layers": 2, "num_experts": 8}, engine="vllm", engine_version="x")
