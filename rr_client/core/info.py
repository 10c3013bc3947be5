"""`/rr/info`: what a server tells clients about its routing output; the one "dims" type of rr.

Every producer checks routing against an :class:`RRInfo` before encoding it, and every client
checks every payload against the server's. Imports pydantic, never torch or httpx.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rr_client.core._version import __version__
from rr_client.core.codec import wire_dtype
from rr_client.core.engines import ENGINES
from rr_client.core.errors import ConfigurationError
from rr_client.core.hf_config import hash_layers_from_config, moe_layers_from_config, routing_dims_from_config
from rr_client.core.indexer import IndexerDims

# why a hash-routed MoE layer is uncaptured on an engine that skips them (Engine.captures_hash_layers: all-zero rows)
_HASH_REASON = "hash-routed (token-id table; the engine does not capture it)"

__all__ = ["RRInfo", "WIRE_FORMAT"]

WIRE_FORMAT = "npy-b64"


class RRInfo(BaseModel):
    """Model and engine facts every routing payload is validated against."""

    model_config = ConfigDict(extra="allow", frozen=True)

    engine: str
    engine_version: str
    rr_version: str
    model: str = ""
    num_hidden_layers: int = Field(gt=0)
    num_experts: int = Field(gt=0, le=65536)
    topk: int = Field(gt=0)
    moe_layers: list[int]
    wire_dtype: Literal["uint8", "uint16"]
    wire_format: str = WIRE_FORMAT
    # MoE layers the engine never writes routing for, with the reason: their rows are all zero, exactly like a dense
    # layer's (the full check expects that there and refuses all-zero rows in every layer of ``moe_layers``);
    # replay leaves them to the model. E.g. DeepSeek-V4's hash-routed layers on SGLang (sglang#29040).
    uncaptured_layers: dict[int, str] = Field(default_factory=dict)
    # What the sampled tokens' log-probs mean (rr_client.core.logprobs): "processed" (after temperature), "raw" (before:
    # vLLM's default raw_logprobs), None (the server does not say).
    logprobs_mode: Literal["processed", "raw"] | None = None
    # The sparse-attention indexer (DeepSeek-V3.2-style DSA, rr_client.core.indexer): the layers that run one and
    # the positions each token reads; empty / None for a model without one.
    indexer_layers: list[int] = Field(default_factory=list)
    index_topk: int | None = None

    @property
    def indexer(self) -> IndexerDims | None:
        """The model's :class:`IndexerDims`, None without an indexer."""
        if not self.indexer_layers or not self.index_topk:
            return None
        return IndexerDims(tuple(self.indexer_layers), self.index_topk)

    @model_validator(mode="after")
    def _check(self) -> RRInfo:
        if self.topk > self.num_experts:
            raise ConfigurationError(f"topk={self.topk} exceeds num_experts={self.num_experts}")
        bad = [i for i in [*self.moe_layers, *self.uncaptured_layers] if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ConfigurationError(f"moe_layers / uncaptured_layers {bad} outside [0, {self.num_hidden_layers})")
        both = sorted(set(self.moe_layers) & set(self.uncaptured_layers))
        if both:
            raise ConfigurationError(f"layers {both} are both captured (moe_layers) and uncaptured_layers")
        expected = wire_dtype(self.num_experts).name
        if self.wire_dtype != expected:
            raise ConfigurationError(
                f"wire_dtype {self.wire_dtype} but num_experts={self.num_experts} needs {expected}"
            )
        return self

    @classmethod
    def from_hf_config(
        cls, cfg: Mapping[str, Any], *, engine: str, engine_version: str, model: str = "", **extra: Any
    ) -> RRInfo:
        """The one builder: routing dims and MoE layers from an HF ``config.json`` dict plus the engine's facts.

        Hash-routed layers (DeepSeek-V4) are captured routing on vLLM (0.33 captures every router's ids, hash tables
        included) and ``uncaptured_layers`` on SGLang (0.5.23's ``HashTopK`` never writes the buffer, sglang#29040).
        ``extra`` lands in the info as-is (e.g. ``routing_enabled``, ``sidecar``, ``upstream``).
        """
        layers, experts, topk = routing_dims_from_config(cfg)
        hashed = hash_layers_from_config(cfg)
        eng = ENGINES.get(engine)
        uncaptured = {i: _HASH_REASON for i in hashed} if eng is not None and not eng.captures_hash_layers else {}
        moe = sorted(set(moe_layers_from_config(cfg)) | {i for i in hashed if i not in uncaptured})
        idx = IndexerDims.from_hf_config(cfg)
        if idx is not None:
            extra = {"indexer_layers": list(idx.layers), "index_topk": idx.index_topk, **extra}
        return cls(
            engine=engine,
            engine_version=str(engine_version),
            rr_version=__version__,
            model=model,
            num_hidden_layers=layers,
            num_experts=experts,
            topk=topk,
            moe_layers=moe,
            uncaptured_layers=uncaptured,
            wire_dtype=wire_dtype(experts).name,  # type: ignore[arg-type]
            **extra,
        )
