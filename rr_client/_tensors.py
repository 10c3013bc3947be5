"""Pad per-sample routing into trainer-ready torch tensors, aligned token-for-token with ``input_ids``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Literal, Protocol

import numpy as np

from rr_client.errors import MissingRoutingError, ShapeMismatchError
from rr_client.info import RRInfo

try:
    import torch
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("rr_client.to_tensors needs torch: pip install 'rr-replay[torch]'") from e

__all__ = ["RoutingTensors", "Sample", "to_tensors", "tensor_dtype"]


class Sample(Protocol):
    """What padding needs of one sample (a :class:`rr_client.GenerateResult` is one)."""

    @property
    def index(self) -> int: ...
    @property
    def prompt_ids(self) -> list[int] | None: ...
    @property
    def output_ids(self) -> list[int]: ...
    @property
    def routed_experts(self) -> np.ndarray | None: ...
    @property
    def routed_experts_start(self) -> int: ...


def _routing_of(sample: Sample) -> np.ndarray:
    """The sample's routing, or a typed error saying it was not requested/received."""
    if sample.routed_experts is None:
        raise MissingRoutingError(f"sample {sample.index} has no routing (generated with return_routed_experts=False)")
    return sample.routed_experts


@dataclass(frozen=True)
class RoutingTensors:
    """Padded batch. ``routed_experts[b, t]`` is the routing that produced token ``t + 1`` of sample ``b``.

    Shapes: ``input_ids``, ``attention_mask``, ``response_mask``, ``routed_experts_mask``: ``[B, T]``;
    ``routed_experts``: ``[B, T, L, K]`` (token-major) or ``[L, B, T, K]`` (layer-major). Pad rows are 0
    and ``routed_experts_mask`` is False there, at the last token of each sample (it has no routing)
    and before ``routed_experts_start``.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    routed_experts: torch.Tensor
    routed_experts_mask: torch.Tensor
    layers: list[int]

    def as_dict(self) -> dict[str, object]:
        """Plain dict, e.g. to merge into a trainer's batch."""
        return asdict(self)


def tensor_dtype(num_experts: int) -> np.dtype[np.generic]:
    """uint8 up to 256 experts; int16 above (torch has few uint16 kernels), up to 32768."""
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= 32768:
        return np.dtype(np.int16)
    raise ValueError(f"num_experts={num_experts} does not fit int16 expert ids")


def to_tensors(
    results: Sequence[Sample],
    info: RRInfo,
    *,
    pad_side: Literal["left", "right"] = "left",
    layout: Literal["token_major", "layer_major"] = "token_major",
    moe_layers_only: bool = False,
    pad_token_id: int = 0,
    pad_to: int | None = None,
) -> RoutingTensors:
    """Left-pad (default: real tokens flush right) or right-pad samples and their routing into one batch."""
    if pad_side not in ("left", "right"):
        raise ValueError(f"pad_side must be 'left' or 'right', got {pad_side!r}")
    if layout not in ("token_major", "layer_major"):
        raise ValueError(f"layout must be 'token_major' or 'layer_major', got {layout!r}")
    seqs: list[tuple[list[int], list[int]]] = []
    for r in results:
        if r.prompt_ids is None:
            raise ShapeMismatchError(
                f"sample {r.index}: prompt token ids unknown (text prompt and the server sent no "
                "meta_info.prompt_token_ids); send token-id prompts to build tensors"
            )
        seqs.append((r.prompt_ids, r.output_ids))
    lengths = [len(p) + len(o) for p, o in seqs]
    width = max(lengths, default=0)
    if pad_to is not None:
        if pad_to < width:
            raise ShapeMismatchError(f"pad_to={pad_to} is shorter than the longest sample ({width} tokens)")
        width = pad_to
    b = len(results)
    layers = list(info.moe_layers) if moe_layers_only else list(range(info.num_hidden_layers))
    n_layers, k = len(layers), info.topk
    dt = tensor_dtype(info.num_experts)

    ids = np.full((b, width), pad_token_id, dtype=np.int64)
    attn = np.zeros((b, width), dtype=np.int64)
    resp = np.zeros((b, width), dtype=np.int64)
    rmask = np.zeros((b, width), dtype=np.bool_)
    shape = (b, width, n_layers, k) if layout == "token_major" else (n_layers, b, width, k)
    routing = np.zeros(shape, dtype=dt)  # calloc: pad rows cost no writes
    layer_index = None if not moe_layers_only else np.asarray(layers)

    for i, (r, (p, o), n) in enumerate(zip(results, seqs, lengths)):
        off = width - n if pad_side == "left" else 0
        ids[i, off : off + len(p)] = p
        ids[i, off + len(p) : off + n] = o
        attn[i, off : off + n] = 1
        resp[i, off + len(p) : off + n] = 1
        arr = _routing_of(r)
        if layer_index is not None:
            arr = arr[:, layer_index]
        t0 = off + r.routed_experts_start
        t1 = t0 + arr.shape[0]
        if t1 > off + n:
            raise ShapeMismatchError(f"sample {r.index}: {arr.shape[0]} routing rows do not fit {n} tokens")
        rmask[i, t0:t1] = True
        if layout == "token_major":
            routing[i, t0:t1] = arr
        else:
            routing[:, i, t0:t1] = arr.transpose(1, 0, 2)

    return RoutingTensors(
        input_ids=torch.from_numpy(ids),
        attention_mask=torch.from_numpy(attn),
        response_mask=torch.from_numpy(resp),
        routed_experts=torch.from_numpy(routing),
        routed_experts_mask=torch.from_numpy(rmask),
        layers=layers,
    )
