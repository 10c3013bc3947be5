"""`/rr/info`: what a server tells clients about its routing output, checked once per client."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

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
        expected = "uint8" if self.num_experts <= 256 else "uint16"
        if self.wire_dtype != expected:
            raise ValueError(f"wire_dtype {self.wire_dtype} but num_experts={self.num_experts} needs {expected}")
        return self
