"""MoE layers the engine does not capture (DeepSeek-V4's hash-routed layers on SGLang): stated in ``RRInfo``,
all-zero exactly there, every other MoE row still checked; on vLLM (which captures them) they are routed rows."""

from __future__ import annotations

import numpy as np
import pytest

from rr_client import RRInfo
from rr_client.core.codec import check_payload
from rr_client.core.errors import ShapeMismatchError, UnrecordedRoutingError
from rr_client.core.hf_config import hash_layers_from_config, moe_layers_from_config
from tests.support.routing_data import make_routing

V4 = {
    "model_type": "deepseek_v4",
    "num_hidden_layers": 4,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
}


def test_hash_layers_from_the_config() -> None:
    assert hash_layers_from_config(V4) == [0, 1] and moe_layers_from_config(V4) == [2, 3]
    legacy = {k: v for k, v in V4.items() if k != "mlp_layer_types"} | {"num_hash_layers": 1}
    assert hash_layers_from_config(legacy) == [0] and moe_layers_from_config(legacy) == [1, 2, 3]
    default = {k: v for k, v in V4.items() if k != "mlp_layer_types"}  # transformers' default: 3 hash layers
    assert hash_layers_from_config(default) == [0, 1, 2]
    # SGLang loads V4 as a DeepseekV3Config subclass: V3's first_k_dense_replace=3 default must not make layers dense
    sglang_view = {**legacy, "first_k_dense_replace": 3, "moe_layer_freq": 1}
    assert moe_layers_from_config(sglang_view) == [1, 2, 3]
    qwen = {"num_hidden_layers": 3, "num_experts": 8, "num_experts_per_tok": 2}
    assert hash_layers_from_config(qwen) == [] and moe_layers_from_config(qwen) == [0, 1, 2]


def test_sglang_leaves_hash_layers_uncaptured_vllm_captures_them() -> None:
    sg = RRInfo.from_hf_config(V4, engine="sglang", engine_version="0.5.23")
    assert sg.moe_layers == [2, 3] and sorted(sg.uncaptured_layers) == [0, 1]
    assert all("hash-routed" in why for why in sg.uncaptured_layers.values())
    assert RRInfo.model_validate_json(sg.model_dump_json()) == sg  # served on /rr/info, read back by the client
    vl = RRInfo.from_hf_config(V4, engine="vllm", engine_version="0.33.0")
    assert vl.moe_layers == [0, 1, 2, 3] and vl.uncaptured_layers == {}
    with pytest.raises(ValueError, match="both captured"):
        RRInfo(**{**sg.model_dump(), "moe_layers": [0, 2, 3]})


def rows(n: int = 5) -> np.ndarray:
    return make_routing(n, 4, 2, 8, moe_layers=[2, 3], seed=3)  # zero in the hash layers 0, 1


def test_full_check_expects_zero_rows_exactly_in_uncaptured_layers() -> None:
    sg = RRInfo.from_hf_config(V4, engine="sglang", engine_version="0.5.23")
    assert (check_payload(rows(), sg, rows=5).array == rows()).all()
    lost = rows()
    lost[3, 2] = 0  # an all-zero row in a captured layer: still refused
    with pytest.raises(UnrecordedRoutingError, match="row 3 layer 2"):
        check_payload(lost, sg, rows=5)
    written = rows()
    written[1, 0] = [4, 6]  # ids in a layer the engine does not capture: not its routing
    with pytest.raises(ShapeMismatchError, match="row 1 layer 0"):
        check_payload(written, sg, rows=5)
    vl = RRInfo.from_hf_config(V4, engine="vllm", engine_version="0.33.0")
    with pytest.raises(UnrecordedRoutingError, match="layer 0"):  # vLLM captures them: zero there is a lost row
        check_payload(rows(), vl, rows=5)
    captured = make_routing(5, 4, 2, 8, moe_layers=[0, 1, 2, 3], seed=4)
    assert check_payload(captured, vl, rows=5).array.shape == (5, 4, 2)
