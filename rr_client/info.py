"""`/rr/info`: what a server tells clients about its routing output; the one "dims" type of rr.

Every producer checks routing against an :class:`RRInfo` before encoding it, and every client
checks every payload against the server's. Imports pydantic, never torch or httpx.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rr_client._version import __version__
from rr_client.codec import wire_dtype
from rr_client.hf_config import moe_layers_from_config, routing_dims_from_config

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

    @model_validator(mode="after")
    def _check(self) -> "RRInfo":
        if self.topk > self.num_experts:
            raise ValueError(f"topk={self.topk} exceeds num_experts={self.num_experts}")
        bad = [i for i in self.moe_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"moe_layers {bad} outside [0, {self.num_hidden_layers})")
        expected = wire_dtype(self.num_experts).name
        if self.wire_dtype != expected:
            raise ValueError(f"wire_dtype {self.wire_dtype} but num_experts={self.num_experts} needs {expected}")
        return self

    @classmethod
    def from_hf_config(
        cls, cfg: Mapping[str, Any], *, engine: str, engine_version: str, model: str = "", **extra: Any
    ) -> "RRInfo":
        """The one builder: routing dims and MoE layers from an HF ``config.json`` dict plus the engine's facts.

        ``extra`` lands in the info as-is (e.g. ``routing_enabled``, ``sidecar``, ``upstream``).
        """
        layers, experts, topk = routing_dims_from_config(cfg)
        return cls(
            engine=engine,
            engine_version=str(engine_version),
            rr_version=__version__,
            model=model,
            num_hidden_layers=layers,
            num_experts=experts,
            topk=topk,
            moe_layers=moe_layers_from_config(cfg),
            wire_dtype=wire_dtype(experts).name,  # type: ignore[arg-type]
            **extra,
        )
